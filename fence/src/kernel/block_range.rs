//! Range requests on a block device: discard (`BLKDISCARD`) and write-zeroes
//! (`BLKZEROOUT`) of a byte range. The start-up probe sends both through a
//! fenced device, and the tests send them as a hostile node would.
//!
//! Both ioctls drop the device's cached pages over the range before the
//! request is sent (`truncate_bdev_range` in block/ioctl.c), dirty ones
//! included, so they act on the page cache even when the device then fails
//! the request.

use std::io;
use std::os::fd::AsRawFd;

/// The raw ioctls, kept private (the macro makes them `pub`).
mod sys {
    // _IO(0x12, 119) and _IO(0x12, 127) in include/uapi/linux/fs.h; the
    // argument is a {start, length} pair of u64 in bytes.
    nix::ioctl_write_ptr_bad!(blkdiscard, nix::request_code_none!(0x12, 119), [u64; 2]);
    nix::ioctl_write_ptr_bad!(blkzeroout, nix::request_code_none!(0x12, 127), [u64; 2]);
}

/// One kind of range request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeRequest {
    Discard,
    WriteZeroes,
}

impl RangeRequest {
    /// The ioctl's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            RangeRequest::Discard => "BLKDISCARD",
            RangeRequest::WriteZeroes => "BLKZEROOUT",
        }
    }

    /// Sends the request for bytes [`offset`, `offset + len`) of the block
    /// device open as `dev`; returns when the kernel answers.
    pub fn send(self, dev: &impl AsRawFd, offset: u64, len: u64) -> io::Result<()> {
        let range = [offset, len];
        // SAFETY: an ioctl on a descriptor the caller holds open, with a valid
        // 16-byte range that outlives the call.
        let sent = unsafe {
            match self {
                RangeRequest::Discard => sys::blkdiscard(dev.as_raw_fd(), &range),
                RangeRequest::WriteZeroes => sys::blkzeroout(dev.as_raw_fd(), &range),
            }
        };
        sent.map(drop).map_err(io::Error::from)
    }
}
