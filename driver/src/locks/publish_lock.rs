//! The lock on a volume's directory that orders a node's attach against the
//! controller's attachment changes.

use std::path::Path;

use super::{CONTROLLER_LOCK_WAIT, NODE_LOCK_WAIT};
use crate::ids::VolumeId;

/// An advisory `flock` on a volume's directory (`<state>/volumes/<id>`): the
/// lock that makes a node's "the record publishes generation G to me" and its
/// attach of G one step with respect to the controller's changes of the
/// attachments. The controller holds it exclusive in ControllerPublish and
/// ControllerUnpublish from its scan of the holders until the record is
/// written; a node holds it shared from its re-read of the record until its
/// loop device exists. So either the unpublish sees the node's device (and
/// fences it), or the node sees the attachment gone (and attaches nothing).
///
/// A node that hangs while it holds the lock must not hold up a fence: the
/// controller waits at most [`NODE_LOCK_WAIT`], then an unpublish fences the
/// target's whole generation without the lock (its marker keeps the stuck
/// stage's attach out, see `fence::freeze` and `Node::find_or_attach`), and a
/// publish goes on only when it hands out a new generation.
///
/// Lock order: this lock first, then an image's [`super::BackingLock`] (the
/// fence and the node's attach take that one inside it). Nothing takes this
/// lock while holding a `BackingLock` (`loop_device::detach`, the fence, stats),
/// so the two cannot deadlock. The directory, not a file in it: the records
/// are replaced by rename, and a node must not create files in the state dir.
pub struct PublishLock {
    _dir: std::fs::File,
}

impl PublishLock {
    /// [`PublishLock::take`] for an RPC: a volume without a directory is
    /// NOT_FOUND, a lock still held after the wait ABORTED (the CO retries),
    /// anything else INTERNAL naming `why` the lock was taken. Only the
    /// controller takes it exclusive (and waits [`NODE_LOCK_WAIT`] for nodes),
    /// only nodes shared (and wait [`CONTROLLER_LOCK_WAIT`] for the controller).
    pub fn take_for_rpc(
        state_dir: &Path,
        id: &VolumeId,
        exclusive: bool,
        why: &str,
    ) -> crate::error::CsiResult<Self> {
        use crate::error::CsiError;
        let wait = Self::wait(exclusive);
        Self::within_for_rpc(state_dir, id, exclusive, why)?.ok_or_else(|| {
            CsiError::Aborted(format!(
                "volume {id}: another process held its attachments lock for {wait:?} while {why}; retry later"
            ))
        })
    }

    /// Like [`PublishLock::take_for_rpc`], but a lock still held after
    /// `wait` is Ok(None): the caller decides what it may do without it.
    pub fn within_for_rpc(
        state_dir: &Path,
        id: &VolumeId,
        exclusive: bool,
        why: &str,
    ) -> crate::error::CsiResult<Option<Self>> {
        use crate::error::CsiError;
        match Self::take(state_dir, id, exclusive, Self::wait(exclusive)) {
            Ok(l) => Ok(Some(l)),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(CsiError::NotFound(format!("volume {id} does not exist")))
            }
            Err(e) => Err(CsiError::internal(why, e)),
        }
    }

    fn wait(exclusive: bool) -> std::time::Duration {
        if exclusive {
            NODE_LOCK_WAIT
        } else {
            CONTROLLER_LOCK_WAIT
        }
    }

    /// Takes the lock on `id`'s directory (shared or exclusive), waiting at
    /// most `wait` (then `ErrorKind::TimedOut`). NotFound when the volume has
    /// no directory (it does not exist).
    pub fn take(
        state_dir: &Path,
        id: &VolumeId,
        exclusive: bool,
        wait: std::time::Duration,
    ) -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(state_dir.join("volumes").join(id.as_str()))?;
        Ok(PublishLock {
            _dir: super::flock_within(dir, exclusive, wait)?,
        })
    }
}
