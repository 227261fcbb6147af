//! The lock on a generation's image that the fence and node teardown share.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// An advisory `flock` on a loop device's backing file, the one lock the
/// fence (controller) and node teardown (node plugins) share: they run in
/// different processes but always on the same kernel and the same inode.
/// Found through sysfs' backing_file and checked by device and inode, so a
/// renamed or replaced path is never locked by mistake.
pub struct BackingLock {
    _file: File,
}

impl BackingLock {
    /// Locks `path` (shared or exclusive), waiting at most `wait` for the
    /// other side (then `ErrorKind::TimedOut`).
    pub fn on_path(path: &Path, exclusive: bool, wait: Duration) -> io::Result<BackingLock> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
            .open(path)?;
        Ok(BackingLock {
            _file: super::flock_within(file, exclusive, wait)?,
        })
    }

    /// Exclusive lock on the backing file of loop device `number`, if that
    /// file can still be reached at the path sysfs reports and the lock can
    /// be had within [`super::NODE_LOCK_WAIT`]. Without it a detach
    /// still goes on: at worst a remap running meanwhile drops its autoclear
    /// flag, and the device stays bound (fenced or idle) until released again.
    pub(crate) fn exclusive_for(number: u32, dev: u64, ino: u64) -> Option<BackingLock> {
        let raw = std::fs::read_to_string(
            crate::kernel::loop_device::sys_loop_dir(number).join("loop/backing_file"),
        )
        .ok()?;
        let path = PathBuf::from(raw.trim_end_matches('\n'));
        let meta = std::fs::metadata(&path).ok()?;
        if meta.dev() != dev || meta.ino() != ino {
            return None;
        }
        match BackingLock::on_path(&path, true, super::NODE_LOCK_WAIT) {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "detaching without the image lock");
                None
            }
        }
    }
}
