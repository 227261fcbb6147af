//! The driver's locks, in the order they are taken, and how long anyone waits.
//!
//! 1. [`OwnerLock`] (`<state>/owner/<generation>.lock`, exclusive, never waited for): one
//!    controller process owns a state dir, for as long as any call of it runs. A leader
//!    takes it from a former owner that still holds it by SIGKILLing that owner through
//!    its kill switch (`kill_switch`), and treats the locks a frozen one keeps as free.
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

mod kill_switch;
mod owner_lock;
mod publish_lock;
mod records_lock;

pub use fencecsi_fence::lock::{BackingLock, NODE_LOCK_WAIT};
pub(crate) use owner_lock::OwnerLock;
pub use owner_lock::{
    leader_socket, owner_of, vacated_by, Claim, Holder, Predecessor, TAKEOVER_WAIT,
};
pub use publish_lock::PublishLock;
pub(crate) use records_lock::RecordsLock;

pub use fencecsi_fence::kernel::flock::flock_within;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::CsiError;

/// How long a node plugin waits for a file lock the controller holds (the
/// longest: a snapshot's copy, see `controller::quiesce`) before it answers
/// ABORTED and lets the CO retry.
pub const CONTROLLER_LOCK_WAIT: Duration = Duration::from_secs(10);

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
