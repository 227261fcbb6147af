//! fencecsi CSI plugin: volumes are sparse image files attached as real Linux
//! loop devices, with a write fence made on the backing inode.
//!
//! Layout: the gRPC services (`identity`, `controller`, `node`) sit on a
//! storage `backend` (image files, generations, metadata), on the fence
//! (`fence`), the locks (`locks`) and the kernel wrappers (`kernel`: loop
//! devices, mounts, filesystems, files, file locks).

pub mod backend;
pub mod capability;
pub mod config;
pub mod controller;
pub mod error;
pub mod failpoint;
pub mod fence;
pub mod http;
pub mod identity;
pub mod ids;
pub mod kernel;
pub mod leadership;
pub mod locks;
pub mod metrics;
pub mod node;
pub mod paths;
pub mod rpc;
pub mod server;
pub mod socket;
pub mod state_id;
pub mod terms;
