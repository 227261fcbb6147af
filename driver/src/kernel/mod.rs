//! Thin wrappers over what the kernel does for the driver: the mount table
//! and mount/unmount (`mounts`) and filesystems on a device (`filesystem`:
//! probe, mkfs, grow, usage) here; loop devices, gates, files and bounded
//! file locks from the fence crate (`fencecsi_fence::kernel`), re-exported
//! under the same names. Policy (what to fence, when to lock) lives elsewhere.

pub use fencecsi_fence::kernel::{files, flock, loop_device, loop_gate};

pub mod filesystem;
pub mod mounts;
