//! The lock every controller takes around a volume record's check and write.

use std::fs::File;
use std::path::Path;

use super::{flock_within, NODE_LOCK_WAIT};

/// Where every controller serialises its record writes: `<state>/records.lock`.
const RECORDS_LOCK: &str = "records.lock";

/// Held around a record's check and write; only controllers take it, for a
/// write's length (another controller's wait is bounded all the same).
pub(crate) struct RecordsLock {
    _file: File,
}

impl RecordsLock {
    pub(crate) fn take(state_dir: &Path) -> std::io::Result<Self> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(state_dir.join(RECORDS_LOCK))?;
        Ok(RecordsLock {
            _file: flock_within(f, true, NODE_LOCK_WAIT)?,
        })
    }

    /// Removes the lock file of a former owner proven killed while it held the state dir:
    /// the next `take` makes a new one, which that owner (frozen) does not hold.
    pub(crate) fn forget_holder(state_dir: &Path) -> std::io::Result<()> {
        match std::fs::remove_file(state_dir.join(RECORDS_LOCK)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}
