//! What the fence cannot refuse: a buffered write on node A whose dirty page
//! node A itself drops before it is written back.
//!
//! `BLKDISCARD` and `BLKZEROOUT` on a block device (and `BLKSECDISCARD`, and
//! `fallocate` on it) first drop the device's page cache over their range,
//! dirty pages included (`truncate_bdev_range`), and only then send their
//! request. After the fence the request fails, but the pages are gone: a
//! writer that had written one of them and not yet synced it finds nothing
//! to write back, and its fsync succeeds. The write never reached any
//! storage, so the data is unchanged; only that writer's acknowledgement is
//! wrong. No fence on the device can stop it: the pages sit above the
//! device. (The block device's read-only flag, `BLKROSET`, is no way out:
//! it stays on the loop device after it is detached, for whoever binds that
//! number next.)
//!
//! The fence torture test exempts exactly such acknowledgements (a buffered
//! writer on a raw block volume, its write and sync overlapping node A's own
//! discard of the record area), provided the record is not in the data. This
//! test shows the mechanism on one gated device, with its control: the same
//! write with no discard in between fails its fsync.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use fencecsi_fence::kernel::block_range::RangeRequest;
use fencecsi_fence::kernel::loop_device::test_support::LoopGuard;
use fencecsi_fence::kernel::loop_device::AttachOptions;
use fencecsi_fence::kernel::loop_gate;
use fencecsi_tests::{region_hash, require_root, Env};

const DATA: u64 = 16 << 20;
const PAGE: usize = 4096;
/// Sends `request` for [`at`, `at + len`) of the block device at `dev`.
fn range_request(dev: &Path, request: RangeRequest, at: u64, len: u64) -> std::io::Result<()> {
    request.send(&OpenOptions::new().write(true).open(dev)?, at, len)
}

/// Whether the image's data holds `page` at `at`.
fn image_holds(image: &Path, at: u64, page: &[u8]) -> bool {
    let mut buf = vec![0u8; page.len()];
    File::open(image)
        .unwrap()
        .read_exact_at(&mut buf, at)
        .unwrap();
    buf == page
}

#[test]
fn a_page_node_a_drops_itself_is_acknowledged_but_never_written() {
    require_root!();
    let env = Env::new();
    let image = env.path().join("g.img");
    File::create(&image)
        .unwrap()
        .set_len(DATA + fencecsi_fence::TRAILER_BYTES)
        .unwrap();
    let opts = AttachOptions {
        read_only: false,
        direct_io: false,
        tag: format!("fcsi-test-dropped-{}", std::process::id()),
        size_limit: DATA,
        logical_block_size: 0,
    };
    // Detaches the device above (and with it its gate) when dropped, panic or not.
    let dev = LoopGuard(loop_gate::attach_gated(&image, &opts).unwrap());
    let writer = OpenOptions::new()
        .read(true)
        .write(true)
        .open(dev.path())
        .unwrap();
    // Control: the device writes through before the fence.
    let before = [0x11u8; PAGE];
    writer.write_all_at(&before, 0).unwrap();
    writer.sync_data().unwrap();
    assert!(image_holds(&image, 0, &before), "written before the fence");

    let report = fencecsi_fence::fence_devices(&image, DATA, &|_| true, fencecsi_fence::SETTLE)
        .unwrap_or_else(|e| panic!("the fence: {e}"));
    assert_eq!(report.fenced.len(), 1, "one device fenced");
    let fenced = region_hash(&image, DATA);

    // Control: a write after the fence, synced with nothing in between, fails.
    let page = |b: u8| [b; PAGE];
    writer.write_all_at(&page(0x22), 1 << 20).unwrap();
    let synced = writer.sync_data();
    assert!(
        synced.is_err(),
        "control: a write after the fence must fail its fsync"
    );

    // The same, with node A discarding (then zeroing) the range in between.
    for (request, at, fill) in [
        (RangeRequest::Discard, 2u64 << 20, 0x33u8),
        (RangeRequest::WriteZeroes, 3 << 20, 0x44),
    ] {
        let name = request.name();
        writer.write_all_at(&page(fill), at).unwrap();
        let own = range_request(dev.path(), request, 0, 8 << 20);
        // EIO: the request was sent, after the drop, and failed at the fence.
        assert_eq!(
            own.as_ref().map_err(|e| e.raw_os_error()),
            Err(Some(libc::EIO)),
            "{name} after the fence must fail at the device: {own:?}"
        );
        let synced = writer.sync_data();
        assert!(
            synced.is_ok(),
            "{name} no longer drops a dirty page it fails to discard ({synced:?}): \
             fence_torture's exemption for such acknowledgements can go"
        );
        assert!(
            !image_holds(&image, at, &page(fill)),
            "{name}: the acknowledged write reached the image after the fence"
        );
    }
    assert_eq!(
        region_hash(&image, DATA),
        fenced,
        "the data changed after the fence"
    );
    drop(writer);
    drop(dev);
    env.assert_clean();
}
