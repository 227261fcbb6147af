//! Thin wrappers over what the kernel does for the driver, each named for what it
//! wraps: loop devices (`loop_device`; `loop_gate` stacks a node's device on a
//! gate, the device the fence shuts), the mount table and mount/unmount
//! (`mounts`), filesystems on a device (`filesystem`: probe, mkfs, grow, usage),
//! files on the backing filesystem (`files`: sparse images, reflinks, the
//! immutable flag, atomic writes) and advisory file locks with a bounded wait
//! (`flock`). Policy (what to fence, when to lock) lives elsewhere.

pub mod files;
pub mod filesystem;
pub mod flock;
pub mod loop_device;
pub mod loop_gate;
pub mod mounts;
