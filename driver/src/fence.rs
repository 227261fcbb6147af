//! The write fence. A node's loop device holds an open descriptor on one
//! generation's inode, so renaming or unlinking the path fences nothing. We
//! fence the inode itself:
//!
//! 1. set `FS_IMMUTABLE_FL` on it. The backing filesystem checks the flag on
//!    every write under the inode lock, and setting the flag takes that lock,
//!    so buffered writes already inside the kernel finish first and every
//!    later write fails (the filesystem on the loop device sees EIO);
//! 2. drain every loop device that holds the inode: re-applying its own status
//!    freezes its request queue, which waits for requests already submitted,
//!    asynchronous direct I/O included, to complete or fail;
//! 3. fsync the generation so what was written before the fence is durable.
//!
//! Only when all three succeed is the fence reported as made.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::fsops;
use crate::loopdev::{self, LoopInfo};

#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("the backing filesystem cannot set the immutable flag on {path}: {source} (a fence needs a filesystem with FS_IMMUTABLE_FL, such as ext4, xfs or btrfs, and CAP_LINUX_IMMUTABLE)")]
    Unsupported {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("could not freeze {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("could not drain loop device {device} holding {path}: {message}")]
    Drain {
        path: PathBuf,
        device: PathBuf,
        message: String,
    },
    #[error("could not list loop devices holding {path}: {message}")]
    Holders { path: PathBuf, message: String },
}

#[derive(Debug, Clone)]
pub struct FenceReport {
    /// Loop devices that held the generation and were drained.
    pub drained: Vec<LoopInfo>,
    pub elapsed: Duration,
}

/// Loop devices whose backing file is this inode (found by device and
/// inode number, never by path).
pub fn holders(path: &Path) -> Result<Vec<LoopInfo>, FenceError> {
    let (dev, ino) = fsops::dev_ino(path).map_err(|source| FenceError::Io {
        path: path.into(),
        source,
    })?;
    loopdev::find_by_inode(dev, ino).map_err(|e| FenceError::Holders {
        path: path.into(),
        message: e.to_string(),
    })
}

/// Makes the fence on one generation file; see the module docs.
pub fn freeze(path: &Path) -> Result<FenceReport, FenceError> {
    let start = Instant::now();
    if let Err(source) = fsops::set_immutable(path, true) {
        let unsupported = matches!(
            source.raw_os_error(),
            Some(libc::ENOTTY | libc::EOPNOTSUPP | libc::EPERM | libc::EINVAL)
        );
        return Err(if unsupported {
            FenceError::Unsupported {
                path: path.into(),
                source,
            }
        } else {
            FenceError::Io {
                path: path.into(),
                source,
            }
        });
    }
    let drained = holders(path)?;
    for lo in &drained {
        loopdev::drain(&lo.device).map_err(|e| FenceError::Drain {
            path: path.into(),
            device: lo.device.clone(),
            message: e.to_string(),
        })?;
    }
    // fsync is allowed on an immutable file: it changes no data, it only makes
    // the pre-fence writes durable.
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|source| FenceError::Io {
            path: path.into(),
            source,
        })?;
    tracing::info!(path = %path.display(), holders = drained.len(), elapsed_us = start.elapsed().as_micros() as u64, "generation fenced");
    Ok(FenceReport {
        drained,
        elapsed: start.elapsed(),
    })
}

/// Lifts the flag so a released, fenced generation can be deleted. Callers
/// must have checked that no loop device holds it any more.
pub fn thaw(path: &Path) -> Result<(), FenceError> {
    fsops::set_immutable(path, false).map_err(|source| FenceError::Io {
        path: path.into(),
        source,
    })
}

pub fn is_frozen(path: &Path) -> Result<bool, FenceError> {
    fsops::is_immutable(path).map_err(|source| FenceError::Io {
        path: path.into(),
        source,
    })
}
