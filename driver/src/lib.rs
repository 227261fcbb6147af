//! fencecsi CSI plugin: volumes are sparse image files attached as real Linux
//! loop devices, with a write fence made on the backing inode.
//!
//! Layout: the gRPC services (`identity`, `controller`, `node`) sit on a
//! storage `backend` (image files, generations, metadata) and on the kernel
//! helpers (`loopdev`, `mounts`, `fsutil`, `fsops`, `fence`).

pub mod backend;
pub mod capability;
pub mod config;
pub mod controller;
pub mod error;
pub mod failpoint;
pub mod fence;
pub mod fsops;
pub mod fsutil;
pub mod http;
pub mod identity;
pub mod ids;
pub mod leadership;
pub mod locks;
pub mod loopdev;
pub mod metrics;
pub mod mounts;
pub mod node;
pub mod paths;
pub mod rpc;
pub mod server;
pub mod state_id;
