//! The kernel wrappers the fence is built on: loop devices (`loop_device`;
//! `loop_gate` stacks a node's device on a gate, the device the fence
//! shuts), files on the backing filesystem (`files`: sparse images,
//! reflinks, the immutable flag, atomic writes), advisory file locks with
//! a bounded wait (`flock`) and discard and write-zeroes of a block range
//! (`block_range`).

pub mod block_range;
pub mod files;
pub mod flock;
pub mod loop_device;
pub mod loop_gate;
/// A cgroup v1 freezer for tests that pause a process (the `test-support` feature).
#[cfg(any(test, feature = "test-support"))]
pub mod test_freezer;
