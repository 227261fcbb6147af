//! The lock on a generation's image that the fence and node teardown share,
//! and how long the fence waits for it.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use crate::kernel::flock::flock_within;

/// How long the controller waits for a file lock a node plugin may hold
/// before it decides the node is stuck. A node holds one only around an
/// attach or a status read (milliseconds), so this is generous.
pub const NODE_LOCK_WAIT: Duration = Duration::from_secs(2);

/// An advisory `flock` on a loop device's backing file, the one lock the
/// fence (controller) and node teardown (node plugins) share: they run in
/// different processes but always on the same kernel and the same inode.
/// A detach finds it through sysfs' backing_file, checked by device and
/// inode (`loop_device::detach`).
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
            _file: flock_within(file, exclusive, wait)?,
        })
    }
}
