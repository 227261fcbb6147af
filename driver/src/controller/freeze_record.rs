//! The records that make a filesystem freeze outlive nothing (see
//! [`super::quiesce`], "A freeze never outlives its operation"): what one
//! copy froze, written before each `FIFREEZE` under `<state>/freezes/`,
//! owned through a lock file the kernel lets go with the process, and the
//! pass that thaws what a dead operation left.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::backend::meta::now_nanos;
use crate::kernel::files;
use crate::kernel::mounts;

// _IOWR('X', 119, int) and _IOWR('X', 120, int) from include/uapi/linux/fs.h.
pub(super) const FIFREEZE: libc::c_ulong = 0xC004_5877;
pub(super) const FITHAW: libc::c_ulong = 0xC004_5878;

/// Where freeze records live, below the state dir: `<op>.json` (the record)
/// beside `<op>.lock` (held by the live operation).
pub const FREEZES_DIR: &str = "freezes";

/// What one operation froze, written before the first `FIFREEZE`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezeRecord {
    /// What the freeze is for ("point-in-time copy", "group copy").
    pub operation: String,
    pub volumes: Vec<String>,
    pub owner: Owner,
    /// Wall clock (ns since the epoch) when the freezes began, and by when
    /// the owner thaws them itself (`--max-freeze` later).
    pub started_at: i64,
    pub thaw_by: i64,
    pub filesystems: Vec<FrozenFs>,
}

/// The controller process that froze.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    pub pid: u32,
    /// Its start time (clock ticks after boot, /proc/<pid>/stat field 22):
    /// with the pid and the boot ID, one process.
    pub start_ticks: u64,
    pub boot_id: String,
}

impl Owner {
    pub(super) fn current() -> Owner {
        let start_ticks = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| {
                // Fields after the command name (which may hold spaces): state is field 3.
                let rest = s.rsplit_once(')')?.1;
                rest.split_whitespace().nth(22 - 3)?.parse().ok()
            })
            .unwrap_or(0);
        Owner {
            pid: std::process::id(),
            start_ticks,
            boot_id: std::fs::read_to_string(crate::state_id::BOOT_ID_PATH)
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
        }
    }
}

/// One filesystem frozen (or about to be).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrozenFs {
    pub volume: String,
    pub generation: u64,
    /// The loop device the volume is attached through.
    pub device: PathBuf,
    /// The filesystem's st_dev (mountinfo's major:minor).
    pub major: u32,
    pub minor: u32,
    /// Every mount of it seen when it was frozen, the one frozen through
    /// first. While one of them is still mounted, the superblock is the one
    /// that was frozen.
    pub mounts: Vec<MountRef>,
}

/// A mount by its mountinfo ID and mount point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountRef {
    pub id: i32,
    pub path: PathBuf,
}

/// The files of one live operation's record; the `flock` on the lock file
/// is what says the operation is alive.
pub(super) struct RecordFiles {
    dir: PathBuf,
    json: PathBuf,
    lock_path: PathBuf,
    _lock: File,
}

impl RecordFiles {
    /// A new, locked operation name under `<state>/freezes`.
    pub(super) fn create(state_dir: &Path) -> io::Result<RecordFiles> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = state_dir.join(FREEZES_DIR);
        if !dir.is_dir() {
            std::fs::create_dir_all(&dir)?;
            files::fsync_parent(&dir)?;
        }
        let op = format!(
            "{}-{}-{}",
            std::process::id(),
            now_nanos(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        // Locked under a temporary name, then renamed into place: a lock file a
        // recovery pass can see is always held, so it never takes a live
        // operation's lock file for a stray and removes it.
        let lock_path = dir.join(format!("{op}.lock"));
        let fresh = dir.join(format!(".{op}.lock.tmp-new"));
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&fresh)?;
        let locked = lock
            .try_lock()
            .map_err(|e| match e {
                std::fs::TryLockError::Error(e) => e,
                std::fs::TryLockError::WouldBlock => io::ErrorKind::WouldBlock.into(),
            })
            .and_then(|()| std::fs::rename(&fresh, &lock_path));
        if let Err(e) = locked {
            let _ = std::fs::remove_file(&fresh);
            return Err(e);
        }
        Ok(RecordFiles {
            json: dir.join(format!("{op}.json")),
            dir,
            lock_path,
            _lock: lock,
        })
    }

    pub(super) fn write(&self, rec: &FreezeRecord) -> io::Result<()> {
        let bytes = serde_json::to_vec_pretty(rec).map_err(io::Error::other)?;
        files::write_atomic(&self.json, &bytes)
    }

    /// Removes the record, then the lock file (the lock goes with `self`).
    pub(super) fn remove(self) -> io::Result<()> {
        remove_if_there(&self.json)?;
        files::fsync_dir(&self.dir)?;
        remove_if_there(&self.lock_path)
    }
}

fn remove_if_there(p: &Path) -> io::Result<()> {
    match std::fs::remove_file(p) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

pub(super) fn ioctl_on(dir: &File, op: libc::c_ulong) -> io::Result<()> {
    // SAFETY: ioctl on a directory fd we own; the argument is unused.
    if unsafe { libc::ioctl(dir.as_raw_fd(), op, 0) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// What [`thaw_recorded`] found.
#[derive(Debug, PartialEq, Eq)]
enum Thaw {
    Thawed(PathBuf),
    /// FITHAW answered EINVAL: not frozen (any more).
    NotFrozen(PathBuf),
    /// No mount the record names is left.
    Gone,
}

/// Thaws a recorded filesystem through a mount the record names that is
/// still that mount (see the module docs).
fn thaw_recorded(fs: &FrozenFs) -> io::Result<Thaw> {
    let table = mounts::mounts().map_err(io::Error::other)?;
    let dev = libc::makedev(fs.major, fs.minor);
    for r in &fs.mounts {
        // By path and device, not by mount ID: a restarted controller may look
        // from another mount namespace, where the same mount has another ID. The
        // opened directory's st_dev below makes sure it is the same superblock.
        let still = table
            .iter()
            .any(|m| m.mount_point == r.path && (m.major, m.minor) == (fs.major, fs.minor));
        if !still {
            continue;
        }
        let Ok(dir) = File::open(&r.path) else {
            continue;
        };
        let md = dir.metadata()?;
        if !md.is_dir() || md.dev() != dev {
            continue;
        }
        return match ioctl_on(&dir, FITHAW) {
            Ok(()) => Ok(Thaw::Thawed(r.path.clone())),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(Thaw::NotFrozen(r.path.clone())),
            Err(e) => Err(e),
        };
    }
    Ok(Thaw::Gone)
}

/// Thaws what every freeze record in `state_dir` names whose operation is
/// gone (its lock is free), and removes those records; returns how many
/// filesystems it thawed. `at_start`: nothing of this controller runs yet, so
/// temp files of record writes are removed too. Logs what it does.
pub fn thaw_leftovers(state_dir: &Path, at_start: bool) -> usize {
    thaw(state_dir, at_start, false)
}

/// [`thaw_leftovers`] at the start of a controller that took the state dir from an owner
/// proven killed but frozen: that owner still holds the locks of its live freezes, and will
/// never thaw them, so every record is settled, held or not.
pub fn thaw_leftovers_of_a_killed_owner(state_dir: &Path) -> usize {
    thaw(state_dir, true, true)
}

fn thaw(state_dir: &Path, at_start: bool, held_too: bool) -> usize {
    let dir = state_dir.join(FREEZES_DIR);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return 0;
    };
    let names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    let mut thawed = 0;
    for name in &names {
        if name.starts_with('.') && name.contains(".tmp-") {
            if at_start {
                // A record never renamed into place: nothing was frozen after it.
                let _ = std::fs::remove_file(dir.join(name));
            }
            continue;
        }
        if let Some(op) = name.strip_suffix(".json") {
            match settle(&dir, op, held_too) {
                Ok(n) => thawed += n,
                Err(e) => {
                    tracing::error!(record = %dir.join(name).display(), error = %e, "cannot settle a freeze record; the next pass tries again")
                }
            }
        }
    }
    // Lock files whose record is gone (a crash before the record was written,
    // or after it was removed) and that nobody holds.
    for op in names.iter().filter_map(|n| n.strip_suffix(".lock")) {
        if dir.join(format!("{op}.json")).exists() {
            continue;
        }
        if let Ok(Some(_free)) = try_lock(&dir.join(format!("{op}.lock"))) {
            let _ = std::fs::remove_file(dir.join(format!("{op}.lock")));
        }
    }
    thawed
}

/// Thaws what this process's own freezes froze, leaving their records for the
/// next pass: for a controller about to give up the state dir while a copy still
/// runs (a leader that lost its Lease), whose volumes' writers would otherwise
/// stay frozen until a successor starts. The caller makes sure no FIFREEZE runs
/// beside it or starts after ([`super::Controller::give_up_freezes`]). The copy then finds its filesystems thawed by someone else and is
/// refused, so no snapshot comes of it. Returns how many filesystems it thawed.
/// (The records stay for the successor's start-up pass, which finds their
/// filesystems not frozen.)
pub fn thaw_own(state_dir: &Path) -> usize {
    let me = Owner::current();
    let Ok(entries) = std::fs::read_dir(state_dir.join(FREEZES_DIR)) else {
        return 0;
    };
    let mut thawed = 0;
    for path in entries.flatten().map(|e| e.path()) {
        if path.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let Some(rec) = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<FreezeRecord>(&b).ok())
        else {
            continue;
        };
        if rec.owner != me {
            continue;
        }
        for fs in &rec.filesystems {
            match thaw_recorded(fs) {
                Ok(Thaw::Thawed(at)) => {
                    thawed += 1;
                    tracing::warn!(volume = %fs.volume, mount = %at.display(), operation = %rec.operation, "filesystem thawed as the controller gives up: the copy that froze it is abandoned");
                }
                Ok(Thaw::NotFrozen(_) | Thaw::Gone) => {}
                Err(e) => {
                    tracing::error!(volume = %fs.volume, device = %fs.device.display(), error = %e, "cannot thaw a filesystem frozen for a copy as the controller gives up; the next controller thaws it at its start")
                }
            }
        }
    }
    thawed
}

/// The lock file at `path`, locked: Ok(None) when it is held (a live
/// operation), Ok(Some(None)) when it does not exist.
fn try_lock(path: &Path) -> io::Result<Option<Option<File>>> {
    match OpenOptions::new().read(true).write(true).open(path) {
        Ok(f) => match f.try_lock() {
            Ok(()) => Ok(Some(Some(f))),
            Err(std::fs::TryLockError::WouldBlock) => Ok(None),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Some(None)),
        Err(e) => Err(e),
    }
}

/// Thaws and removes the record `op` in `dir` when no live operation holds
/// it; returns how many filesystems it thawed.
fn settle(dir: &Path, op: &str, held_too: bool) -> io::Result<usize> {
    let json = dir.join(format!("{op}.json"));
    let lock_path = dir.join(format!("{op}.lock"));
    let held = try_lock(&lock_path)?;
    if held.is_none() && !held_too {
        return Ok(0); // a live operation: it thaws by itself, within its bound
    }
    let lock = held;
    // Read only now, under the lock: the owner may have removed it meanwhile.
    let bytes = match std::fs::read(&json) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            remove_if_there(&lock_path)?;
            return Ok(0);
        }
        Err(e) => return Err(e),
    };
    let mut rec: FreezeRecord = match serde_json::from_slice(&bytes) {
        Ok(r) => r,
        Err(e) => {
            let aside = dir.join(format!("{op}.json.unreadable"));
            std::fs::rename(&json, &aside)?;
            remove_if_there(&lock_path)?;
            tracing::error!(record = %aside.display(), error = %e, "unreadable freeze record moved aside: what it froze is unknown, so nothing was thawed; if a volume's writers hang, thaw its filesystem by hand (fsfreeze -u <mount>)");
            return Ok(0);
        }
    };
    tracing::warn!(
        record = %json.display(),
        operation = %rec.operation,
        volumes = ?rec.volumes,
        owner_pid = rec.owner.pid,
        owner_boot_id = %rec.owner.boot_id,
        "a freeze whose operation is gone (its controller died, or could not thaw): thawing what it froze"
    );
    let mut thawed = 0;
    let mut left = Vec::new();
    for fs in std::mem::take(&mut rec.filesystems) {
        match thaw_recorded(&fs) {
            Ok(Thaw::Thawed(at)) => {
                thawed += 1;
                tracing::warn!(volume = %fs.volume, generation = fs.generation, mount = %at.display(), "filesystem thawed: it was left frozen by a copy whose controller did not live to thaw it");
            }
            Ok(Thaw::NotFrozen(at)) => {
                tracing::info!(volume = %fs.volume, mount = %at.display(), "filesystem of a freeze record is not frozen (any more)");
            }
            Ok(Thaw::Gone) => {
                tracing::info!(volume = %fs.volume, device = %fs.device.display(), "no mount a freeze record names is left: nothing to thaw");
            }
            Err(e) => {
                tracing::error!(volume = %fs.volume, device = %fs.device.display(), error = %e, "cannot thaw a filesystem a freeze record names; the next pass tries again");
                left.push(fs);
            }
        }
    }
    if lock.is_none() {
        // Thawed over a killed owner's held lock: that owner may still be finishing a
        // FIFREEZE in the kernel, so the record stays for the next pass, which settles it
        // (thawing again) once the owner is gone and its lock with it.
    } else if left.is_empty() {
        remove_if_there(&json)?;
        files::fsync_dir(dir)?;
        remove_if_there(&lock_path)?;
    } else {
        rec.filesystems = left;
        let bytes = serde_json::to_vec_pretty(&rec).map_err(io::Error::other)?;
        files::write_atomic(&json, &bytes)?;
    }
    Ok(thawed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(fs: Vec<FrozenFs>) -> FreezeRecord {
        FreezeRecord {
            operation: "point-in-time copy".into(),
            volumes: vec!["v".into()],
            owner: Owner::current(),
            started_at: 1,
            thaw_by: 2,
            filesystems: fs,
        }
    }

    /// A record is settled only once its operation's lock is free; a record
    /// naming mounts that no longer exist is removed without thawing anything,
    /// and so are stray lock files and (at start) temp files.
    /// A lock file a recovery pass can see is always held: it is locked under a
    /// temporary name first (a pass that found it unlocked would remove it as a
    /// stray, and later take the live operation for a dead one).
    #[test]
    fn an_operations_lock_file_is_held_from_the_moment_it_is_seen() {
        let state = tempfile::tempdir().unwrap();
        let files = RecordFiles::create(state.path()).unwrap();
        let names: Vec<String> = std::fs::read_dir(state.path().join(FREEZES_DIR))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 1, "only the lock file: {names:?}");
        assert!(names[0].ends_with(".lock"), "{names:?}");
        assert!(
            matches!(try_lock(&files.lock_path), Ok(None)),
            "held by the live operation"
        );
        thaw_leftovers(state.path(), false);
        assert!(
            files.lock_path.exists(),
            "a pass leaves a live lock file alone"
        );
        // Control: once the operation is gone, the pass removes it.
        let lock = files.lock_path.clone();
        drop(files);
        thaw_leftovers(state.path(), false);
        assert!(!lock.exists());
    }

    #[test]
    fn records_of_live_operations_are_left_alone() {
        let state = tempfile::tempdir().unwrap();
        let files = RecordFiles::create(state.path()).unwrap();
        let gone = FrozenFs {
            volume: "v".into(),
            generation: 1,
            device: "/dev/loop-none".into(),
            major: 7,
            minor: 4095,
            mounts: vec![MountRef {
                id: i32::MAX,
                path: state.path().join("no-such-mount"),
            }],
        };
        files.write(&record(vec![gone])).unwrap();
        let json = files.json.clone();
        let lock = files.lock_path.clone();
        assert_eq!(thaw_leftovers(state.path(), false), 0);
        assert!(json.exists(), "a live operation's record was settled");
        // The operation dies: its lock goes with it.
        drop(files);
        assert_eq!(thaw_leftovers(state.path(), false), 0);
        assert!(!json.exists() && !lock.exists(), "a dead record stays");

        let dir = state.path().join(FREEZES_DIR);
        std::fs::write(dir.join("1-2-3.lock"), b"").unwrap();
        std::fs::write(dir.join(".4-5-6.json.tmp-7"), b"{").unwrap();
        thaw_leftovers(state.path(), false);
        assert!(!dir.join("1-2-3.lock").exists(), "a free stray lock stays");
        assert!(
            dir.join(".4-5-6.json.tmp-7").exists(),
            "a temp file removed while operations may run"
        );
        thaw_leftovers(state.path(), true);
        assert!(!dir.join(".4-5-6.json.tmp-7").exists());

        // Unreadable: moved aside, nothing guessed.
        std::fs::write(dir.join("8-9-10.json"), b"not json").unwrap();
        thaw_leftovers(state.path(), false);
        assert!(dir.join("8-9-10.json.unreadable").exists());
        assert!(!dir.join("8-9-10.json").exists());
    }

    #[test]
    fn the_owner_is_this_process() {
        let o = Owner::current();
        assert_eq!(o.pid, std::process::id());
        assert!(o.start_ticks > 0, "{o:?}");
    }
}
