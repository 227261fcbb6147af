//! The driver's locks, in the order they are taken, and how long anyone waits.
//!
//! 1. [`OwnerLock`] (`<state>/controller.lock`, exclusive, never waited for): one
//!    controller process owns a state dir, for as long as any call of it runs.
//! 2. [`InFlight`] (in-process, per volume or snapshot): the CSI spec asks a plugin
//!    already working on a volume to answer a second concurrent call for it with
//!    ABORTED rather than queue it; the CO retries.
//! 3. The capacity guard (`MetaStore::capacity_guard`, in-process): from a
//!    capacity check to the record, or reservation, that takes the space.
//!    ControllerExpandVolume takes the volume's `PublishLock` inside it (a
//!    bounded wait); nothing takes the guard while holding a `PublishLock`.
//! 4. [`PublishLock`] (`<state>/volumes/<id>`, a flock): orders a node's attach
//!    against the controller's attachment changes. Nodes take it shared, the
//!    controller exclusive.
//! 5. [`BackingLock`] (a generation's image, a flock): the fence and the node's
//!    attach, detach and stats. Taken inside a `PublishLock` when both are held;
//!    nothing takes a `PublishLock` while holding one, so the two cannot deadlock.
//! 6. [`RecordsLock`] (`<state>/records.lock`, controllers only): around one
//!    record's version check and write, innermost.
//!
//! Besides these, a freeze record's own file is locked while its freeze is
//! live (`controller::freeze_record`), so a restarted controller thaws only the
//! freezes of dead operations; it is taken inside the volume's locks and nothing
//! is taken inside it.
//!
//! Every file lock but the owner's goes through [`flock_within`], so every wait
//! has a bound. A node can hang while it holds one (a frozen or paused node, a
//! D-state attach), so the controller waits at most [`NODE_LOCK_WAIT`] and the
//! fence then goes on without it; a node waits at most [`CONTROLLER_LOCK_WAIT`]
//! and answers ABORTED. See docs/lifecycle.md, "Locks".

mod backing_lock;
mod owner_lock;
mod publish_lock;
mod records_lock;

pub use backing_lock::BackingLock;
pub(crate) use owner_lock::OwnerLock;
pub use publish_lock::PublishLock;
pub(crate) use records_lock::RecordsLock;

use std::collections::HashSet;
use std::fs::File;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::CsiError;

/// How long the controller waits for a file lock a node plugin may hold
/// before it decides the node is stuck. A node holds one only around an
/// attach or a status read (milliseconds), so this is generous.
pub const NODE_LOCK_WAIT: Duration = Duration::from_secs(2);

/// How long a node plugin waits for a file lock the controller holds (the
/// longest: a snapshot's copy, see `controller::quiesce`) before it answers
/// ABORTED and lets the CO retry.
pub const CONTROLLER_LOCK_WAIT: Duration = Duration::from_secs(10);

/// Takes an advisory `flock` on `file` (shared or exclusive), waiting at most
/// `bound`; the file, locked. A lock still held by someone else then is
/// `ErrorKind::TimedOut`.
///
/// The wait is a real blocking `flock` (so the kernel lists the waiter in
/// /proc/locks) on a thread of its own: past the bound that thread is left
/// waiting, and when it gets the lock it finds nobody to hand it to and lets
/// go at once. So a holder that never lets go costs one parked thread per
/// timed-out wait, never a call that hangs.
pub fn flock_within(file: File, exclusive: bool, bound: Duration) -> std::io::Result<File> {
    let tried = if exclusive {
        file.try_lock()
    } else {
        file.try_lock_shared()
    };
    match tried {
        Ok(()) => return Ok(file),
        Err(std::fs::TryLockError::Error(e)) => return Err(e),
        Err(std::fs::TryLockError::WouldBlock) if bound.is_zero() => return Err(timed_out(bound)),
        Err(std::fs::TryLockError::WouldBlock) => {}
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("flock-wait".into())
        .spawn(move || {
            let locked = if exclusive {
                file.lock()
            } else {
                file.lock_shared()
            };
            // Nobody waits any more: the file (and its lock) drops here.
            let _ = tx.send(locked.map(|()| file));
        })?;
    match rx.recv_timeout(bound) {
        Ok(locked) => locked,
        Err(_) => Err(timed_out(bound)),
    }
}

fn timed_out(bound: Duration) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("held by another process for {bound:?}"),
    )
}

#[derive(Clone, Default)]
pub struct InFlight {
    keys: Arc<Mutex<HashSet<String>>>,
}

pub struct InFlightGuard {
    keys: Arc<Mutex<HashSet<String>>>,
    key: String,
}

impl InFlight {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes `key` or answers ABORTED if another operation holds it.
    pub fn try_lock(&self, key: impl Into<String>) -> Result<InFlightGuard, CsiError> {
        let key = key.into();
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if !keys.insert(key.clone()) {
            return Err(CsiError::Aborted(format!(
                "an operation on {key} is already in progress; retry later"
            )));
        }
        Ok(InFlightGuard {
            keys: self.keys.clone(),
            key,
        })
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_file_lock_wait_ends_at_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lock");
        let held = flock_within(File::create(&path).unwrap(), true, Duration::ZERO).unwrap();
        let start = Instant::now();
        let err = flock_within(
            File::open(&path).unwrap(),
            false,
            Duration::from_millis(100),
        )
        .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(start.elapsed() >= Duration::from_millis(100));
        // Control: a waiter gets the lock once it is released, and the
        // waiter left behind above lets go of it at once.
        let waiter = std::thread::spawn({
            let path = path.clone();
            move || flock_within(File::open(&path).unwrap(), true, Duration::from_secs(10))
        });
        drop(held);
        let again = waiter.join().unwrap().expect("the lock once released");
        drop(again);
        flock_within(File::open(&path).unwrap(), true, Duration::from_secs(10)).unwrap();
    }

    #[test]
    fn second_holder_is_aborted_until_release() {
        let f = InFlight::new();
        let g = f.try_lock("vol-a").unwrap();
        assert!(matches!(f.try_lock("vol-a"), Err(CsiError::Aborted(_))));
        let _other = f.try_lock("vol-b").unwrap();
        drop(g);
        assert!(f.try_lock("vol-a").is_ok());
    }
}
