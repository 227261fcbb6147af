//! fencecsi CSI plugin: volumes are sparse image files attached as real Linux
//! loop devices, with a write fence made on the backing inode.
//!
//! Layout: the gRPC services (`identity`, `controller`, `node`) sit on a
//! storage `backend` (image files, generations, metadata), the locks
//! (`locks`) and the kernel wrappers (`kernel`: mounts and filesystems here;
//! loop devices, files and file locks from the fence crate), and on the
//! fence itself, the `fencecsi-fence` crate, re-exported as `fence`. The
//! terms the services share are in `terms`.

pub mod backend;
pub mod capability;
pub mod config;
pub mod controller;
pub mod error;
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
pub mod standby;
pub mod state_id;
pub mod terms;

/// The failpoints (`fencecsi-failpoint`), under the name the driver's code uses.
pub use fencecsi_failpoint as failpoint;
/// The write fence (`fencecsi-fence`), under the name the driver's code uses.
pub use fencecsi_fence as fence;
