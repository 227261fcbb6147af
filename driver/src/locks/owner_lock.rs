//! The lock that makes one controller own a state dir, and how a successor takes it from a
//! former owner that cannot let go (a frozen one).
//!
//! Ownership is an exclusive `flock` on the newest generation file, `<state>/owner/<N>.lock`.
//! Every acquisition makes a new generation: created with `O_EXCL` (one maker per number),
//! its maker writes its pid, the name of its [`KillSwitch`] and the Lease identity it leads
//! under into it before it locks it, and only its maker ever keeps its lock. So a generation's content always names the process that
//! holds its lock, and nobody else's.
//!
//! A controller that finds the newest generation locked is refused ([`Claim::take_over`]
//! off), or, leading the Lease, fires the holder's switch: the kernel queues SIGKILL to it. If
//! it exits, its lock goes with its last thread. If it still holds the lock after
//! [`TAKEOVER_WAIT`], it is frozen (its signal waits for it to thaw, and it dies before it
//! runs again) or stuck in the kernel; the successor makes the next generation all the same
//! and owns the state dir, while the former owner keeps a lock nobody looks at. A holder that
//! armed no switch (an in-process controller, or a driver from before switches) cannot be
//! proven dead, and is waited for as before.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::kill_switch::{self, Fired, KillSwitch};

/// The directory of the generation files and the switches, in the state dir.
const OWNER_DIR: &str = "owner";

/// The ownership lock of drivers from before generations: honoured (never taken), so that
/// an older controller still running on the state dir keeps a newer one out.
const LEGACY_LOCK: &str = "controller.lock";

/// How long a successor waits, after firing a former owner's switch, for the kernel to
/// drop its lock before it takes over anyway. A running process dies in milliseconds; one
/// that still holds the lock after this is frozen (which is safe: it dies before it runs
/// again) or in an uninterruptible kernel call that long (which is not covered: its
/// call completes after the successor started; see docs/lifecycle.md, "Locks").
pub const TAKEOVER_WAIT: Duration = Duration::from_secs(3);

/// Where the leading controller serves the whole plugin for its standbys: beside the
/// ownership lock, in the state dir, which every replica sees on this one kernel.
pub fn leader_socket(state_dir: &Path) -> PathBuf {
    state_dir.join(OWNER_DIR).join("leader.sock")
}

/// How many times an acquisition starts again when another maker took the number it
/// wanted (only a second successor racing, which leader election makes rare).
const RACES: usize = 8;

/// How an acquisition treats a former owner, and what its generation says of it.
#[derive(Clone, Debug, Default)]
pub struct Claim {
    /// Arm a kill switch for this process, so that a successor can prove it gone. Only a
    /// process that may be killed arms one: never a test or tool that serves in-process.
    pub arm: bool,
    /// Fire a holder's switch and take over (only while leading the Lease); else refuse.
    pub take_over: bool,
    /// The name this owner leads under (its Lease identity), written into its generation
    /// so that a standby can learn from the kernel that the Lease's holder let go
    /// ([`vacated_by`]). None names none.
    pub identity: Option<String>,
}

/// What became of the former owner of a state dir taken over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Predecessor {
    /// None held the state dir, or it exited: the kernel dropped every lock it held.
    Gone,
    /// It was sent SIGKILL and still holds its locks (frozen): the files it holds locked
    /// (the records lock, freeze records) are to be treated as free.
    KilledButHolding,
}

/// The state dir's ownership; let go with the last reference (see `Controller::hold_ownership`).
pub(crate) struct OwnerLock {
    /// Disarmed before the lock goes (see the `Drop`).
    switch: Option<KillSwitch>,
    _file: File,
    pub(crate) generation: u64,
    pub(crate) predecessor: Predecessor,
}

/// The process a generation file names.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holder {
    /// The generation it holds.
    pub generation: u64,
    pub pid: u32,
    /// Its kill switch; empty when it armed none.
    pub switch: String,
    /// The Lease identity it leads under; empty when it named none.
    pub identity: String,
}

impl OwnerLock {
    /// Owns `state_dir` for this process, or refuses with `WouldBlock` (see the module docs).
    pub(crate) fn acquire(state_dir: &Path, claim: Claim) -> io::Result<Self> {
        let dir = state_dir.join(OWNER_DIR);
        std::fs::create_dir_all(&dir)?;
        refuse_a_legacy_owner(state_dir)?;
        let mut fired = false;
        // Kept across a lost race: a frozen holder, once fired at, still holds its locks.
        let mut predecessor = Predecessor::Gone;
        for _ in 0..RACES {
            let newest = newest_generation(&dir)?;
            // Held until the next generation is made and locked: its maker, if it has not
            // locked it yet, then finds the next one there and backs off.
            let probe_lock: Option<File> = match newest.map(|n| probe(&dir, n)).transpose()? {
                None | Some(Probe::Gone) => None,
                Some(Probe::Free(f)) => Some(f),
                Some(Probe::Held(holder)) => {
                    // At most one takeover per call: a second holder is a successor that
                    // won the race, and the caller asks its Lease again before it tries
                    // once more.
                    if !claim.take_over || fired {
                        return Err(owned_by(state_dir, &holder, ""));
                    }
                    fired = true;
                    predecessor = take_from(state_dir, &dir, newest.unwrap_or(0), &holder)?;
                    None
                }
            };
            let next = newest.unwrap_or(0) + 1;
            let switch = match claim.arm {
                true => KillSwitch::arm(&dir)?,
                false => None,
            };
            let Some(file) =
                make_generation(&dir, next, switch.as_ref(), claim.identity.as_deref())?
            else {
                continue;
            };
            drop(probe_lock);
            if newest_generation(&dir)? != Some(next) {
                continue; // a successor already took over from this one
            }
            remove_superseded(&dir, next);
            return Ok(OwnerLock {
                switch,
                _file: file,
                generation: next,
                predecessor,
            });
        }
        Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!(
                "{}: the ownership kept changing hands (another controller plugin is starting)",
                state_dir.display()
            ),
        ))
    }

    /// Whether a successor can prove this owner gone (it armed a switch).
    pub(crate) fn armed(&self) -> bool {
        self.switch.is_some()
    }
}

impl Drop for OwnerLock {
    fn drop(&mut self) {
        // Disarmed before the lock goes, so that a successor never fires at a process that no
        // longer owns; then unlocked, not only closed: a child forked meanwhile holds a copy of
        // the file until it execs, and with it the lock a standby looks at (`vacated_by`).
        drop(self.switch.take());
        let _ = self._file.unlock();
    }
}

/// The process that owns `state_dir` now, if one does (read from the kernel's lock).
pub fn owner_of(state_dir: &Path) -> io::Result<Option<Holder>> {
    let dir = state_dir.join(OWNER_DIR);
    match newest_generation(&dir)? {
        Some(n) => held_by(&dir, n),
        None => Ok(None),
    }
}

/// Whether the Lease holder `identity` has let go of the state dir for good: the newest
/// generation names it, and nobody holds its lock. The kernel drops that lock only when the
/// owner lets go (a graceful stop, after which it never owns again without a new
/// generation) or with its last thread (an exit, a kill, a power-off); a frozen or a
/// running owner keeps it. A holder that has not made its generation yet, or made one
/// naming no identity, proves nothing (false). The lock is only tried, shared, for an
/// instant; an owner making a generation, or trying the newest one's lock, waits out such
/// a try (`make_generation`, [`PROBE_PATIENCE`]).
pub fn vacated_by(state_dir: &Path, identity: &str) -> io::Result<bool> {
    let dir = state_dir.join(OWNER_DIR);
    let Some(n) = newest_generation(&dir)? else {
        return Ok(false);
    };
    let mut f = match File::open(generation_path(&dir, n)) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    if identity.is_empty() || parse_holder(&text).identity != identity {
        return Ok(false);
    }
    match f.try_lock_shared() {
        Ok(()) => Ok(true),
        Err(std::fs::TryLockError::WouldBlock) => Ok(false),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

fn generation_path(dir: &Path, n: u64) -> PathBuf {
    dir.join(format!("{n}.lock"))
}

/// The newest generation in `dir`, if any (none when the directory is missing).
fn newest_generation(dir: &Path) -> io::Result<Option<u64>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".lock")?.parse().ok())
        .max())
}

/// What a try of generation `n`'s lock found.
enum Probe {
    /// Nobody holds it: here it is, locked by this process until dropped.
    Free(File),
    Held(Holder),
    Gone,
}

/// How long a probe waits for a lock someone holds before it counts it held: long enough
/// for a standby's look ([`vacated_by`], an instant) to pass.
const PROBE_PATIENCE: Duration = Duration::from_millis(100);

fn probe(dir: &Path, n: u64) -> io::Result<Probe> {
    let open = || match File::open(generation_path(dir, n)) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    };
    let Some(f) = open()? else {
        return Ok(Probe::Gone);
    };
    match super::flock_within(f, true, PROBE_PATIENCE) {
        Ok(f) => Ok(Probe::Free(f)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut => {
            let Some(mut f) = open()? else {
                return Ok(Probe::Gone);
            };
            let mut text = String::new();
            f.read_to_string(&mut text)?;
            Ok(Probe::Held(Holder {
                generation: n,
                ..parse_holder(&text)
            }))
        }
        Err(e) => Err(e),
    }
}

/// Who holds generation `n`'s lock; None when it is free (or gone).
fn held_by(dir: &Path, n: u64) -> io::Result<Option<Holder>> {
    Ok(match probe(dir, n)? {
        Probe::Held(h) => Some(h),
        Probe::Free(_) | Probe::Gone => None,
    })
}

fn parse_holder(text: &str) -> Holder {
    let mut h = Holder::default();
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("pid=") {
            h.pid = v.trim().parse().unwrap_or(0);
        } else if let Some(v) = line.strip_prefix("switch=") {
            h.switch = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("identity=") {
            h.identity = v.trim().to_string();
        }
    }
    h
}

fn owned_by(state_dir: &Path, holder: &Holder, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::WouldBlock,
        format!(
            "{} is owned by another running controller plugin (pid {}); only one may serve a state dir{why}",
            state_dir.display(),
            holder.pid
        ),
    )
}

/// An older driver's `controller.lock`, held: refused, since it cannot be fired at.
fn refuse_a_legacy_owner(state_dir: &Path) -> io::Result<()> {
    let Ok(f) = File::open(state_dir.join(LEGACY_LOCK)) else {
        return Ok(());
    };
    match f.try_lock() {
        Ok(()) => Ok(()),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
        Err(std::fs::TryLockError::WouldBlock) => Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!(
                "{} is owned by another running controller plugin (an older fencecsi-driver holds {LEGACY_LOCK}); only one may serve a state dir",
                state_dir.display()
            ),
        )),
    }
}

/// Fires the switch of the holder of generation `n` and waits up to [`TAKEOVER_WAIT`] for
/// its lock to go. Refuses (`WouldBlock`) when the holder armed no switch.
fn take_from(state_dir: &Path, dir: &Path, n: u64, holder: &Holder) -> io::Result<Predecessor> {
    if kill_switch::fire(dir, &holder.switch)? == Fired::NoListener {
        return Err(owned_by(
            state_dir,
            holder,
            " (it armed no kill switch, so it cannot be proven gone: waiting for it to let go)",
        ));
    }
    tracing::warn!(pid_in_its_namespace = holder.pid, generation = n, switch = %holder.switch, "a former owner of the state dir still holds it: SIGKILL sent through its kill switch");
    let deadline = Instant::now() + TAKEOVER_WAIT;
    loop {
        if held_by(dir, n)?.is_none() {
            tracing::info!(
                generation = n,
                "the former owner exited; taking the state dir"
            );
            return Ok(Predecessor::Gone);
        }
        if Instant::now() >= deadline {
            tracing::warn!(generation = n, waited = ?TAKEOVER_WAIT, "the former owner still holds its lock after SIGKILL: it is frozen (it dies before it runs again); taking the state dir over, and treating the files it holds locked as free");
            return Ok(Predecessor::KilledButHolding);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Creates generation `n` naming this process (and the identity it leads under) and locks
/// it; None if another maker took the number, or holds it (a prober, for an instant: it
/// then moves on to a newer one).
fn make_generation(
    dir: &Path,
    n: u64,
    switch: Option<&KillSwitch>,
    identity: Option<&str>,
) -> io::Result<Option<File>> {
    let mut f = match OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(generation_path(dir, n))
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(None),
        Err(e) => return Err(e),
    };
    // Before the lock: whoever finds it locked reads a complete name.
    write!(
        f,
        "pid={}\nswitch={}\n",
        std::process::id(),
        switch.map(KillSwitch::name).unwrap_or_default()
    )?;
    // One line per field, read back trimmed: a name that would not read back as written is
    // left out (it proves nothing).
    if let Some(id) =
        identity.filter(|id| !id.is_empty() && *id == id.trim() && !id.contains(char::is_control))
    {
        writeln!(f, "identity={id}")?;
    }
    match super::flock_within(f, true, Duration::from_secs(1)) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Removes the generations before `current`, and their switches: their owners are gone or
/// proven killed (a frozen one keeps its open files; the names go).
fn remove_superseded(dir: &Path, current: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(n) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".lock"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if n >= current {
            continue;
        }
        if let Ok(text) = std::fs::read_to_string(entry.path()) {
            kill_switch::remove(dir, &parse_holder(&text).switch);
        }
        let _ = std::fs::remove_file(entry.path());
    }
}

#[cfg(test)]
#[path = "owner_lock_tests.rs"]
mod tests;
