//! The write fence. A node's loop device holds an open descriptor on one
//! generation's inode, so renaming or unlinking the path fences nothing, and
//! the immutable flag alone holds only on ext4 and only for writes (xfs and
//! btrfs check it at open; discard and write-zeroes become `fallocate`,
//! which passes it everywhere). The fence therefore works in the block layer.
//!
//! **Gated devices** (every volume device a node attaches, see
//! `kernel::loop_gate`): the node's device is stacked on a gate, a loop
//! device over the image. The fence shuts the gate (capacity 0, in place),
//! drains the device above with a barrier, and moves the gate's empty
//! window into the trailer (`shut_gate`). The guarantee: once the fence
//! returned Ok, every write, discard and write-zeroes the node's device
//! reports done is in `[0, data_bytes)` as the next generation copies it,
//! however long the kernel held the request before the loop driver ran it
//! (blk-throttle, a plug, a preempted submitter): the gate's block-device
//! file refuses every request run after the shut (`blkdev_write_iter`,
//! `blkdev_fallocate` check the capacity when they run), and the barrier
//! waits for the ones run before it. No timed wait is part of it.
//!
//! **Plain devices** (attached straight onto the image: by an older driver,
//! or by hand) are remapped as before gates: every image carries a
//! *trailer* of [`TRAILER_BYTES`] beyond its data, and the fence shrinks
//! each such device to one sector in place, so every new request of more
//! than one sector fails the block layer's end check, waits [`SETTLE`] for
//! the requests already past that check, and moves the window into the
//! trailer. That is a bound, not a proof: a request held longer lands in the
//! trailer and is reported done ([`late_write_at`] finds it).
//!
//! For both: `FS_IMMUTABLE_FL` is set as a second layer on a whole
//! generation (refuses new writable opens on every filesystem, and writes on
//! ext4), best effort; the generation is fsynced so what was written before
//! the fence is durable. Only when every holder is seen fenced does the
//! fence count as made. [`probe`] proves the gated mechanism on the state
//! dir's own filesystem at start.
//!
//! What the crate offers: [`freeze`] and [`fence_devices`] (the fence),
//! [`holders`] and [`is_fenced_device`] (who holds a generation, and whether
//! fenced, as the kernel says), [`widen_holders`], [`thaw`], [`late_write_at`]
//! (the second line), [`probe`] (the start-up proof), the image layout
//! ([`TRAILER_BYTES`], [`ensure_trailer`], [`marker_path`]), and the kernel
//! wrappers and the image lock it is built on (`kernel`, `lock`), which the
//! driver's node plugin attaches with. What it needs: root, loop devices,
//! and a backing filesystem that takes sparse files.

pub mod kernel;
pub mod lock;

mod gate;
mod generation;
mod late_write;
mod plain;
mod probe;
mod window;

pub use generation::{
    ensure_trailer, fence_devices, freeze, holders, is_frozen, marker_path, thaw, widen_holders,
    FenceError, FenceReport,
};
pub use late_write::late_write_at;
pub use plain::SETTLE;
pub use probe::{fs_name, probe, ProbeReport};
pub use window::{is_fenced_device, TRAILER_BYTES, WINDOW_BYTES};
