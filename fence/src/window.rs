//! The layout of a generation's image as the fence sees it: the data, then
//! a trailer the fence moves a device's window into; and what a fenced
//! device shows.

use crate::kernel::loop_device::LoopInfo;

/// Bytes every image keeps beyond its data for the fence window.
pub const TRAILER_BYTES: u64 = 1 << 20;
/// Size of the window a fenced device is left with: one sector, so any
/// request of a filesystem block (or a 4 KiB record) is past its end. It
/// must not be 0: capacity 0 turns the block layer's end check off.
pub const WINDOW_BYTES: u64 = 512;

/// Whether a device already shows only a fence window (no byte of the data).
pub fn is_fenced_device(lo: &LoopInfo, data_bytes: u64) -> bool {
    lo.offset >= data_bytes && lo.size_limit > 0 && lo.size_bytes <= WINDOW_BYTES
}
