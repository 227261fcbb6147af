//! Gates: a node's loop device stacked on a second loop device, the gate,
//! which alone reads and writes the image file.
//!
//! Why: the loop driver runs each request against its backing file at
//! `lo_offset + sector`, reading the offset when the request runs, and the
//! block layer checks a request against the device's end only once, in
//! `submit_bio_noacct` (`bio_check_eod`), before blk-throttle
//! (`blk_throtl_bio`) may hold it for as long as a cgroup's I/O limit says
//! and before the task submitting it may be preempted. So nothing done to a
//! device over a *file* stops a request that already passed that check: it
//! runs later, wherever the window is then (and a file refuses nothing by
//! itself: xfs and btrfs take a write at any offset below `s_maxbytes`,
//! `MAX_LFS_FILESIZE`, and `fallocate` from the loop driver skips the VFS
//! checks).
//!
//! A device over a *block device* is different: its worker runs each
//! request as a call on the gate's block-device file (`loop_queue_rq` →
//! `do_req_filebacked` → `lo_rw_aio` → `blkdev_write_iter`, or
//! `lo_fallocate` → `blkdev_fallocate`), and those calls check the gate's
//! capacity when they run: `blkdev_write_iter` fails with ENOSPC at
//! `ki_pos >= bdev_nr_bytes`, `blkdev_fallocate` with EINVAL at
//! `start >= isize`, `blkdev_read_iter` reads nothing (the loop driver then
//! fails the read). A shut gate (capacity 0, [`SHUT_LIMIT`]) therefore fails
//! every write, discard and write-zeroes of the device above it that runs
//! from then on, however long the kernel held it before. What ran before is
//! drained by a barrier on the device above (`LOOP_SET_STATUS64` freezes its
//! queue until every request in it completed), and the device above uses
//! direct I/O, so a request completes only once the gate completed the bios
//! it made (no page cache of the gate in between). See the fence crate's `gate.rs`.
//!
//! The gate carries the tag `gate:<tag of the device above>` and the
//! autoclear flag: it is unbound when the device above lets go of it (or
//! when an attach that made it dies before stacking a device on it).
//! `loop_device::list` and `status` make a stacked device report the gate's backing file,
//! window and I/O mode, so the rest of the driver sees one device per
//! attachment, as before gates.

use std::path::Path;

use super::loop_device::{self, bind, gate_tag, AttachOptions, LoopError, LoopInfo};

/// `lo_sizelimit` of a shut gate: one byte, which the loop driver rounds
/// down to 0 sectors. 0 itself would mean "up to the end of the file".
pub const SHUT_LIMIT: u64 = 1;

/// Attaches `file` through a gate: a gate over the file with `opts`'
/// window, mode and read-only flag, and a device stacked on it, tagged
/// `opts.tag`, using direct I/O on the gate. Returns the device above, as
/// `loop_device::status` reports it. Refuses (and unbinds both) when the kernel will
/// not let the device above use direct I/O: the fence's argument needs it.
pub fn attach_gated(file: &Path, opts: &AttachOptions) -> Result<LoopInfo, LoopError> {
    let gate_opts = AttachOptions {
        tag: gate_tag(&opts.tag),
        ..opts.clone()
    };
    // Held open until the device above holds the gate: autoclear unbinds
    // the gate at its last close, also when this process dies here.
    let (gate, _gate_held) = bind(file, &gate_opts, true, true)?;
    let top_opts = AttachOptions {
        read_only: opts.read_only,
        direct_io: true,
        tag: opts.tag.clone(),
        size_limit: 0,
        logical_block_size: opts.logical_block_size,
    };
    let top = loop_device::attach(&gate.device, &top_opts)?;
    // From here a failure releases the device above (unused yet), and the
    // gate goes with it when `_gate_held` closes.
    let checked = loop_device::open_raw_status(&top.device).and_then(|raw| {
        if raw.direct_io {
            loop_device::status(&top.device)
        } else {
            Err(LoopError::NotDirect {
                device: top.device.clone(),
                gate: gate.device.clone(),
            })
        }
    });
    if checked.is_err() {
        if let Err(e) = loop_device::clear_unused(&top.device) {
            tracing::warn!(device = %top.device.display(), error = %e, "could not release the device of a failed gated attach");
        }
    }
    checked
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::loop_device::test_support::*;
    use std::os::unix::fs::MetadataExt;

    /// One attachment is one listed device: the device above, reporting the
    /// image as its backing file, the gate's window and mode; the gate itself
    /// is not listed. Detaching the device above unbinds the gate too
    /// (autoclear). Control: while attached, the gate is bound and over the
    /// image, and the device above uses direct I/O.
    #[test]
    fn a_gated_attachment_is_one_device_and_goes_whole() {
        require_root!();
        let dir = tempfile::tempdir().unwrap();
        let img = sparse_image(dir.path(), "g.img", 8 << 20);
        let meta = std::fs::metadata(&img).unwrap();
        let tag = test_tag("gate");
        let top = attach_gated(
            &img,
            &AttachOptions {
                read_only: false,
                direct_io: false,
                tag: tag.clone(),
                size_limit: 4 << 20,
                logical_block_size: 0,
            },
        )
        .unwrap();
        let gate = top.gate.clone().expect("stacked on a gate");
        let listed: Vec<LoopInfo> = loop_device::find_by_inode(meta.dev(), meta.ino()).unwrap();
        let top_raw = loop_device::open_raw_status(&top.device);
        let gate_raw = loop_device::open_raw_status(&gate);
        loop_device::detach(&top.device).unwrap();
        // Unbound at its last close, which a udev probe may hold a moment.
        let ours = |r: &Result<LoopInfo, LoopError>| matches!(r, Ok(g) if (g.backing_dev, g.backing_ino) == (meta.dev(), meta.ino()));
        let mut gate_after = loop_device::open_raw_status(&gate);
        for _ in 0..500 {
            if !ours(&gate_after) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            gate_after = loop_device::open_raw_status(&gate);
        }
        assert_eq!(listed.len(), 1, "one device per attachment: {listed:?}");
        assert_eq!(listed[0].device, top.device);
        assert_eq!((top.backing_dev, top.backing_ino), (meta.dev(), meta.ino()));
        assert_eq!(
            (top.size_bytes, top.size_limit, top.offset),
            (4 << 20, 4 << 20, 0)
        );
        assert!(!top.direct_io, "the gate's mode");
        assert!(
            top_raw.unwrap().direct_io,
            "the device above uses direct I/O"
        );
        let gate_raw = gate_raw.unwrap();
        assert_eq!(gate_raw.tag, gate_tag(&tag));
        assert!(gate_raw.autoclear);
        assert_eq!(
            (gate_raw.backing_dev, gate_raw.backing_ino),
            (meta.dev(), meta.ino())
        );
        // (Another test may have been given the number since.)
        assert!(
            !ours(&gate_after),
            "the gate goes with the device above: {gate_after:?}"
        );
    }
}
