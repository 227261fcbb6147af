//! Node recovery's check that the state dir is the one this node's volumes live in.
//!
//! Recovery acts on what the state dir's metadata says (fenced generations), so a wrong
//! state dir makes it wrong: an unmounted or mistyped one (a `DirectoryOrCreate` hostPath
//! makes an empty directory without a word), or another machine's. The node therefore
//! remembers the identity of the state dir it uses (`<node state dir>/state-id`, see
//! [`crate::state_id`]) and refuses to act while the state dir is missing, has no identity,
//! has another one, or is not a mount point when it must be.
//!
//! It refuses only while this node holds something (a volume of ours mounted under its
//! kubelet dir): with nothing held there is nothing to protect, which is what a fresh
//! install looks like (the node may start before the controller makes the identity), and
//! then the node adopts whatever identity the state dir has. A refusal is logged, shown by
//! Probe (ready = false) and keeps the node from reporting itself clean.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::backend::meta::now_nanos;
use crate::ids::VolumeId;
use crate::state_id::{self, StateId, StateIdError};

/// What the node remembers of the state dir it uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remembered {
    pub state: StateId,
    /// The path it was seen at (for the operator reading the file).
    pub state_dir: PathBuf,
    /// Whether the state dir was a mount point then: if it was, not being one now means
    /// the mount is missing.
    pub was_mount: bool,
    pub seen_at: i64,
}

/// Why recovery does not act.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("state dir {dir} does not exist")]
    Missing { dir: PathBuf },
    #[error("state dir {dir} has no identity file ({}): it is empty, or not the directory the controller initialised", state_id::FILE)]
    NoIdentity { dir: PathBuf },
    #[error("state dir {dir} has identity {found}, but this node's volumes live in the state dir with identity {expected}")]
    Mismatch {
        dir: PathBuf,
        found: String,
        expected: String,
    },
    #[error("state dir {dir} is not a mount point ({why})")]
    NotMounted { dir: PathBuf, why: &'static str },
    #[error("state dir {dir} has no metadata for volumes mounted on this node ({volumes}), and this node has no record of the state dir it used before")]
    Unknown { dir: PathBuf, volumes: String },
    #[error("state dir identity unreadable: {0}")]
    Unreadable(#[from] StateIdError),
}

/// The outcome of one check.
#[derive(Debug)]
enum Decision {
    /// The state dir is the remembered one.
    Proceed(StateId),
    /// Take this identity as the node's (first sight, or nothing held to protect).
    Adopt(StateId),
    /// No identity yet and nothing held: nothing to do, nothing to protect.
    Wait(String),
    Refuse(Refusal),
}

/// What a check looks at.
struct Observed {
    dir: PathBuf,
    exists: bool,
    mounted: bool,
    state: Result<Option<StateId>, StateIdError>,
    remembered: Option<Remembered>,
    /// Our volumes mounted under this node's kubelet dir.
    held: BTreeSet<VolumeId>,
}

fn decide(o: Observed, must_be_mount: bool, has_meta: impl Fn(&VolumeId) -> bool) -> Decision {
    let held = !o.held.is_empty();
    let dir = o.dir.clone();
    if must_be_mount && !o.mounted {
        return Decision::Refuse(Refusal::NotMounted {
            dir,
            why: "--state-dir-must-be-mount is set",
        });
    }
    if held && !o.mounted && o.remembered.as_ref().is_some_and(|r| r.was_mount) {
        return Decision::Refuse(Refusal::NotMounted {
            dir,
            why: "it was one when this node last checked",
        });
    }
    match (o.state, o.remembered) {
        (Err(e), _) if held => Decision::Refuse(e.into()),
        (Err(e), _) => Decision::Wait(e.to_string()),
        (Ok(None), _) if held => Decision::Refuse(if o.exists {
            Refusal::NoIdentity { dir }
        } else {
            Refusal::Missing { dir }
        }),
        (Ok(None), _) => Decision::Wait(format!(
            "state dir {} has no identity yet (the controller makes it)",
            dir.display()
        )),
        (Ok(Some(s)), Some(r)) if r.state.id == s.id => Decision::Proceed(s),
        (Ok(Some(s)), Some(r)) if held => Decision::Refuse(Refusal::Mismatch {
            dir,
            found: s.id,
            expected: r.state.id,
        }),
        (Ok(Some(s)), _) => {
            // First sight (a new node, or an upgrade from a version that kept no record):
            // trust it only if it knows every volume mounted here.
            let unknown: Vec<String> = o
                .held
                .iter()
                .filter(|v| !has_meta(v))
                .map(|v| v.to_string())
                .collect();
            if unknown.is_empty() {
                Decision::Adopt(s)
            } else {
                Decision::Refuse(Refusal::Unknown {
                    dir,
                    volumes: unknown.join(", "),
                })
            }
        }
    }
}

/// The last check's result, for Probe and for logging only changes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Status {
    Unchecked,
    Trusted(String),
    Waiting(String),
    Refused(String),
}

pub struct StateGuard {
    state_dir: PathBuf,
    remembered: PathBuf,
    must_be_mount: bool,
    boot_id_file: PathBuf,
    status: Mutex<Status>,
}

impl StateGuard {
    pub fn new(cfg: &crate::config::Config) -> Self {
        StateGuard {
            state_dir: cfg.state_dir.clone(),
            remembered: cfg.node_state_dir().join(state_id::FILE),
            must_be_mount: cfg.state_dir_must_be_mount,
            boot_id_file: cfg.boot_id_file.clone(),
            status: Mutex::new(Status::Unchecked),
        }
    }

    fn remembered(&self) -> Option<Remembered> {
        match std::fs::read(&self.remembered) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(r) => Some(r),
                Err(e) => {
                    // Treated as absent: then the state dir must know every volume held here.
                    tracing::warn!(file = %self.remembered.display(), error = %e, "the node's record of its state dir is damaged");
                    None
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::warn!(file = %self.remembered.display(), error = %e, "cannot read the node's record of its state dir");
                None
            }
        }
    }

    fn remember(&self, state: &StateId, mounted: bool) -> std::io::Result<()> {
        let r = Remembered {
            state: state.clone(),
            state_dir: self.state_dir.clone(),
            was_mount: mounted,
            seen_at: now_nanos(),
        };
        if let Some(dir) = self.remembered.parent() {
            std::fs::create_dir_all(dir)?;
        }
        crate::kernel::files::write_atomic(
            &self.remembered,
            &serde_json::to_vec_pretty(&r).map_err(std::io::Error::other)?,
        )
    }

    /// Checks the state dir, given this node's mounted volumes (`held`). `Ok(Some)`: act on
    /// it. `Ok(None)`: it has no identity yet and nothing is held, so there is nothing to
    /// do. `Err`: do nothing at all (logged here, and shown by [`StateGuard::refusal`]).
    pub fn check(&self, held: &BTreeSet<VolumeId>) -> Result<Option<StateId>, Refusal> {
        let mounted = crate::kernel::mounts::is_mountpoint(&self.state_dir).unwrap_or(false);
        let remembered = self.remembered();
        let previously_mount = remembered.as_ref().map(|r| r.was_mount);
        let previous_id = remembered.as_ref().map(|r| r.state.id.clone());
        let observed = Observed {
            dir: self.state_dir.clone(),
            exists: self.state_dir.is_dir(),
            mounted,
            state: state_id::read(&self.state_dir),
            remembered,
            held: held.clone(),
        };
        let has_meta = |v: &VolumeId| {
            crate::backend::meta::MetaStore::read_volume(&self.state_dir, v)
                .is_ok_and(|m| m.is_some())
        };
        let (result, status) = match decide(observed, self.must_be_mount, has_meta) {
            Decision::Proceed(s) => {
                if previously_mount != Some(mounted) {
                    if let Err(e) = self.remember(&s, mounted) {
                        tracing::warn!(file = %self.remembered.display(), error = %e, "cannot update the node's record of its state dir");
                    }
                }
                let st = Status::Trusted(s.id.clone());
                (Ok(Some(s)), st)
            }
            Decision::Adopt(s) => match self.remember(&s, mounted) {
                Ok(()) => {
                    tracing::info!(state_dir = %self.state_dir.display(), id = %s.id, topology = %s.topology,
                        previous = ?previous_id, mounted_volumes = held.len(), "node took the state dir's identity as its own");
                    let st = Status::Trusted(s.id.clone());
                    (Ok(Some(s)), st)
                }
                // Not recorded, so not trusted: the next check would not know it either.
                Err(source) => {
                    let r = Refusal::Unreadable(StateIdError::Write {
                        path: self.remembered.clone(),
                        source,
                    });
                    let st = Status::Refused(r.to_string());
                    (Err(r), st)
                }
            },
            Decision::Wait(why) => (Ok(None), Status::Waiting(why)),
            Decision::Refuse(r) => {
                let st = Status::Refused(r.to_string());
                (Err(r), st)
            }
        };
        let mut last = self.status.lock().unwrap_or_else(|p| p.into_inner());
        if *last != status {
            match &status {
                Status::Refused(why) => tracing::error!(
                    state_dir = %self.state_dir.display(),
                    node_record = %self.remembered.display(),
                    mounted_volumes = held.len(),
                    reason = %why,
                    "node recovery REFUSES to act: nothing is unmounted or detached while the state dir looks wrong. \
                     Check that the state dir is mounted and is the directory the controller uses (same host path, same filesystem). \
                     If it was replaced on purpose, release this node's volumes first (drain the node), then remove the node record"
                ),
                Status::Waiting(why) => {
                    tracing::warn!(state_dir = %self.state_dir.display(), reason = %why,
                    "node recovery waits: nothing of ours is mounted here, so nothing to protect")
                }
                Status::Trusted(id) if matches!(*last, Status::Refused(_)) => {
                    tracing::info!(state_dir = %self.state_dir.display(), id = %id, "state dir check passes again: node recovery resumes")
                }
                Status::Trusted(_) | Status::Unchecked => {}
            }
            *last = status;
        }
        result
    }

    /// Why node recovery refuses to act, as of the latest check.
    pub fn refusal(&self) -> Option<String> {
        match &*self.status.lock().unwrap_or_else(|p| p.into_inner()) {
            Status::Refused(why) => Some(why.clone()),
            _ => None,
        }
    }

    /// The topology value this node reports: its state dir's, or, while that is not the
    /// remembered one, the remembered one (what this node's PVs say). Before any identity
    /// exists, the current boot ID, which is what the controller will make it in this boot.
    pub fn topology(&self) -> String {
        let remembered = self.remembered();
        match (state_id::read(&self.state_dir), remembered) {
            (Ok(Some(s)), Some(r)) if r.state.id != s.id => r.state.topology,
            (Ok(Some(s)), _) => s.topology,
            (_, Some(r)) => r.state.topology,
            _ => state_id::boot_id(&self.boot_id_file).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "no topology value known");
                "unknown".into()
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sid(id: &str) -> StateId {
        StateId {
            id: id.into(),
            topology: format!("topo-{id}"),
            created_at: 0,
        }
    }

    fn rem(id: &str, was_mount: bool) -> Remembered {
        Remembered {
            state: sid(id),
            state_dir: "/s".into(),
            was_mount,
            seen_at: 0,
        }
    }

    fn obs(
        state: Option<StateId>,
        remembered: Option<Remembered>,
        held: usize,
        mounted: bool,
    ) -> Observed {
        Observed {
            dir: "/s".into(),
            exists: true,
            mounted,
            state: Ok(state),
            remembered,
            held: (0..held).map(|_| VolumeId::generate()).collect(),
        }
    }

    #[test]
    fn refuses_only_what_it_cannot_trust_while_something_is_held() {
        let yes = |_: &VolumeId| true;
        let no = |_: &VolumeId| false;
        // Right dir.
        assert!(matches!(
            decide(
                obs(Some(sid("a")), Some(rem("a", false)), 2, false),
                false,
                no
            ),
            Decision::Proceed(_)
        ));
        // Empty dir (no identity), something held: refused; nothing held: wait (fresh install).
        assert!(matches!(
            decide(obs(None, Some(rem("a", false)), 1, false), false, yes),
            Decision::Refuse(Refusal::NoIdentity { .. })
        ));
        assert!(matches!(
            decide(obs(None, None, 0, false), false, yes),
            Decision::Wait(_)
        ));
        // Missing dir.
        let mut o = obs(None, Some(rem("a", false)), 1, false);
        o.exists = false;
        assert!(matches!(
            decide(o, false, yes),
            Decision::Refuse(Refusal::Missing { .. })
        ));
        // Another identity: refused while held, adopted when nothing is.
        assert!(matches!(
            decide(
                obs(Some(sid("b")), Some(rem("a", false)), 1, false),
                false,
                yes
            ),
            Decision::Refuse(Refusal::Mismatch { .. })
        ));
        assert!(matches!(
            decide(
                obs(Some(sid("b")), Some(rem("a", false)), 0, false),
                false,
                yes
            ),
            Decision::Adopt(_)
        ));
        // First sight with volumes mounted (an upgrade): only if it knows them all.
        assert!(matches!(
            decide(obs(Some(sid("a")), None, 2, false), false, yes),
            Decision::Adopt(_)
        ));
        assert!(matches!(
            decide(obs(Some(sid("a")), None, 2, false), false, no),
            Decision::Refuse(Refusal::Unknown { .. })
        ));
        // Mount points.
        assert!(matches!(
            decide(
                obs(Some(sid("a")), Some(rem("a", false)), 0, false),
                true,
                yes
            ),
            Decision::Refuse(Refusal::NotMounted { .. })
        ));
        assert!(matches!(
            decide(
                obs(Some(sid("a")), Some(rem("a", true)), 1, false),
                false,
                yes
            ),
            Decision::Refuse(Refusal::NotMounted { .. })
        ));
        assert!(matches!(
            decide(
                obs(Some(sid("a")), Some(rem("a", true)), 1, true),
                true,
                yes
            ),
            Decision::Proceed(_)
        ));
        // A damaged identity is refused while something is held.
        let mut o = obs(None, Some(rem("a", false)), 1, false);
        o.state = Err(StateIdError::Corrupt {
            path: "/s/state-id".into(),
            reason: "x".into(),
        });
        assert!(matches!(
            decide(o, false, yes),
            Decision::Refuse(Refusal::Unreadable(_))
        ));
    }
}
