//! The lock that makes one controller own a state dir.

/// An exclusive `flock` on `<state>/controller.lock`. The controller keeps
/// the volume metadata in memory and writes it back, so a second controller
/// on the same state dir (say, a replacement pod while the old one still
/// runs) would overwrite the first one's records; it refuses to start instead.
pub(crate) struct OwnerLock {
    _file: std::fs::File,
}

impl OwnerLock {
    pub(crate) fn acquire(state_dir: &std::path::Path) -> std::io::Result<Self> {
        use std::io::{Read, Seek, Write};
        let path = state_dir.join("controller.lock");
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)?;
        match f.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = f.read_to_string(&mut holder);
                return Err(std::io::Error::new(
                    std::io::ErrorKind::WouldBlock,
                    format!(
                        "{} is owned by another running controller plugin (pid {}); only one may serve a state dir",
                        state_dir.display(),
                        holder.trim()
                    ),
                ));
            }
        }
        f.set_len(0)?;
        f.rewind()?;
        write!(f, "{}", std::process::id())?;
        Ok(OwnerLock { _file: f })
    }
}
