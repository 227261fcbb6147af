//! The second line behind the fence: finding writes that reached a fenced
//! image's trailer (what garbage collection reports).

use std::path::Path;

use crate::kernel::files;
use crate::window::WINDOW_BYTES;

/// Where something was written into a fenced image past its data and its
/// window: the first offset with data from the 4 KiB block (the granularity
/// filesystems report data in) after the one holding the window, None when
/// there is none. The trailer is made sparse and nothing of the driver writes
/// it, so data there is a write that passed the end check with the data's
/// size and reached the device only after its window moved, later than
/// [`crate::SETTLE`]: reported done to node A, and not in the data. Not seen: a
/// one-sector write at sector 0 (it lands in the window by design), and a
/// late discard or write-zeroes (they leave holes or unwritten extents, which
/// SEEK_DATA skips). A holder that showed more than the data (a device from
/// before the trailer) moves the window further in, and its one-sector writes
/// are then reported too.
/// An image that is gone holds nothing (None).
pub fn late_write_at(path: &Path, data_bytes: u64) -> std::io::Result<Option<u64>> {
    let from = (data_bytes + WINDOW_BYTES).next_multiple_of(4096);
    match files::first_data_at_or_after(path, from) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::ensure_trailer;
    use crate::window::TRAILER_BYTES;
    use std::os::unix::fs::FileExt;

    /// `late_write_at` on a real sparse image: nothing in a fresh trailer;
    /// a one-sector write into the window is left alone (by design); a block
    /// written further into the trailer, or past the image's end, is found.
    #[test]
    fn late_writes_are_found_past_the_window() {
        const DATA: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("gen-1.img");
        files::create_sparse(&img, DATA).unwrap();
        ensure_trailer(&img, DATA).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(&[7; 4096], 0).unwrap();
        f.sync_all().unwrap();
        assert_eq!(late_write_at(&img, DATA).unwrap(), None, "a fresh trailer");
        f.write_all_at(&[7; 512], DATA).unwrap();
        f.sync_all().unwrap();
        assert_eq!(late_write_at(&img, DATA).unwrap(), None, "the window");
        f.write_all_at(&[7; 4096], DATA + 64 * 4096).unwrap();
        f.sync_all().unwrap();
        assert_eq!(
            late_write_at(&img, DATA).unwrap(),
            Some(DATA + 64 * 4096),
            "a block in the trailer"
        );
        let past = dir.path().join("gen-2.img");
        files::create_sparse(&past, DATA).unwrap();
        ensure_trailer(&past, DATA).unwrap();
        let g = std::fs::OpenOptions::new().write(true).open(&past).unwrap();
        g.write_all_at(&[7; 4096], DATA + TRAILER_BYTES + 8192)
            .unwrap();
        g.sync_all().unwrap();
        assert_eq!(
            late_write_at(&past, DATA).unwrap(),
            Some(DATA + TRAILER_BYTES + 8192),
            "past the image's end"
        );
    }
}
