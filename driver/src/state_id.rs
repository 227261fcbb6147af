//! The state dir's identity: `<state>/state-id`, made once by the controller when it
//! first initialises a state dir, never changed afterwards.
//!
//! It answers two questions a path alone cannot:
//!
//! - *Is this the state dir the node's volumes live in?* A hostPath with
//!   `DirectoryOrCreate` turns an unmounted or mistyped state dir into an empty one
//!   without a word. Node recovery compares the identity with the one the node
//!   remembers (`node::state_guard`) and refuses to act on a stranger.
//! - *Which topology value do nodes and controller report?* The value goes into every
//!   PV's (immutable) node affinity, so it must survive reboots. It is the kernel boot
//!   ID current when the identity was made: on an upgrade from a version that reported
//!   the live boot ID, the PVs provisioned during this boot carry exactly that value and
//!   stay schedulable, and from then on a reboot changes nothing.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::backend::meta::now_nanos;
use crate::kernel::files;

/// The identity file's name inside the state dir.
pub const FILE: &str = "state-id";

/// Where the kernel publishes its boot ID (configurable: tests fake a reboot).
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateId {
    /// Random; names this state dir.
    pub id: String,
    /// The value of `topology.loop.fencecsi.io/kernel` for everything that uses this
    /// state dir (see the module docs for why it is a boot ID, and whose).
    pub topology: String,
    pub created_at: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum StateIdError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a state dir identity: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("reading the kernel boot ID from {path}: {source}")]
    BootId {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE)
}

/// The identity of `state_dir`; `None` when it has none (never initialised, or not the
/// directory it should be).
pub fn read(state_dir: &Path) -> Result<Option<StateId>, StateIdError> {
    read_file(&path(state_dir))
}

/// Reads an identity record from any file (the node keeps a copy of the one it saw).
pub fn read_file(path: &Path) -> Result<Option<StateId>, StateIdError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(StateIdError::Read {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let id: StateId = serde_json::from_slice(&bytes).map_err(|e| StateIdError::Corrupt {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    if id.id.is_empty() || id.topology.is_empty() {
        return Err(StateIdError::Corrupt {
            path: path.to_path_buf(),
            reason: "empty id or topology".into(),
        });
    }
    Ok(Some(id))
}

/// The controller's side: the state dir's identity, made (atomically and durably) when
/// there is none yet. The caller must own the state dir (the controller's lock), so no
/// one else writes it meanwhile. Returns the identity and whether it was made now.
pub fn ensure(state_dir: &Path, boot_id_file: &Path) -> Result<(StateId, bool), StateIdError> {
    if let Some(id) = read(state_dir)? {
        return Ok((id, false));
    }
    let id = StateId {
        id: uuid::Uuid::new_v4().simple().to_string(),
        topology: boot_id(boot_id_file)?,
        created_at: now_nanos(),
    };
    let p = path(state_dir);
    let bytes = serde_json::to_vec_pretty(&id).expect("a StateId serialises");
    files::write_atomic(&p, &bytes).map_err(|source| StateIdError::Write { path: p, source })?;
    Ok((id, true))
}

/// The kernel's boot ID as read from `file`.
pub fn boot_id(file: &Path) -> Result<String, StateIdError> {
    let err = |source| StateIdError::BootId {
        path: file.to_path_buf(),
        source,
    };
    let s = std::fs::read_to_string(file).map_err(err)?;
    let s = s.trim();
    if s.is_empty() {
        return Err(err(std::io::Error::other("empty")));
    }
    Ok(s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn made_once_from_the_boot_id_then_kept_across_reboots() {
        let dir = tempfile::tempdir().unwrap();
        let boot = dir.path().join("boot_id");
        std::fs::write(&boot, "boot-1\n").unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        assert_eq!(read(&state).unwrap(), None);
        let (first, made) = ensure(&state, &boot).unwrap();
        assert!(made);
        assert_eq!(first.topology, "boot-1");
        std::fs::write(&boot, "boot-2\n").unwrap();
        let (again, made) = ensure(&state, &boot).unwrap();
        assert!(!made);
        assert_eq!(again, first, "a reboot changes nothing");
        // Another state dir, same boot: same topology, different identity.
        let other = dir.path().join("other");
        std::fs::create_dir(&other).unwrap();
        let (o, _) = ensure(&other, &boot).unwrap();
        assert_ne!(o.id, first.id);
    }

    #[test]
    fn a_damaged_identity_is_an_error_not_an_absence() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(path(dir.path()), b"{not json").unwrap();
        assert!(matches!(
            read(dir.path()),
            Err(StateIdError::Corrupt { .. })
        ));
        let boot = dir.path().join("boot_id");
        std::fs::write(&boot, "b").unwrap();
        assert!(
            ensure(dir.path(), &boot).is_err(),
            "never overwritten by a new one"
        );
    }
}
