//! Point-in-time copies of a volume in use (snapshots, clones of a live
//! volume). A copy must equal the volume at one instant:
//!
//! - a filesystem on a writing holder that is mounted where this process can
//!   see it is frozen (`FIFREEZE`) while the copy reads the image: its writers
//!   block, its dirty data reaches the image first, and the copy is a clean
//!   filesystem;
//! - a holder that cannot be frozen (a raw block volume, or a mount in
//!   another mount namespace) is copied atomically only where the backing
//!   filesystem makes reflinks (xfs, btrfs: the clone takes the image's
//!   inode lock, so it sees every write before it and none after). On a
//!   backing filesystem without reflinks there is no way to stop the loop
//!   device's writers for the length of a copy, so the copy is refused
//!   rather than made torn.
//!
//! # How long writers are blocked
//!
//! The filesystems are thawed as soon as the copy has *read* its source
//! ([`files::SourceWindow::close`]), before the copy's own flush and rename:
//!
//! - where the state dir makes reflinks (xfs, btrfs) the freeze lasts the
//!   `FIFREEZE` itself (the kernel syncs the filesystem's dirty data) and one
//!   reflink: milliseconds, whatever the volume's size;
//! - on a state dir without reflinks (ext4) a full copy of the data under the
//!   freeze is the only point-in-time copy there is, so it is kept, but
//!   bounded: a watchdog thread thaws everything once `--max-freeze` (default
//!   10 s) has passed since the first `FIFREEZE`, the copy stops at its next
//!   range (at most 64 MiB later) and the call is refused with
//!   FAILED_PRECONDITION, leaving nothing. Refusing every such copy would
//!   break snapshots of small, busy volumes that take well under a second;
//!   an unbounded freeze hung writers for as long as the copy (or a stuck
//!   controller) lasted. 10 s is well under the kernel's hung-task warning
//!   (120 s) and the usual liveness-probe budgets, and copies a few GiB of
//!   data on a local disk.
//!
//! # A freeze never outlives its operation
//!
//! A controller that dies (SIGKILL, OOM, a node reboot of its pod) between
//! `FIFREEZE` and `FITHAW` would leave the filesystem frozen for good: every
//! writer in D state until someone runs `fsfreeze -u`. So before anything is
//! frozen, a record is written atomically under `<state>/freezes/<op>.json`
//! naming the controller (pid, process start time, boot ID) and, written
//! again before each `FIFREEZE`, the filesystem about to be frozen (the
//! volume and generation, the loop device, the filesystem's major:minor and
//! every mount of it by mountinfo ID and path). The
//! operation holds an exclusive `flock` on `<op>.lock` for as long as it
//! lives (taken before the record is written, released by the kernel when
//! the process dies), so "owned by a live operation" is a question the kernel
//! answers. The record is removed after the thaw; a filesystem that answers
//! `FIFREEZE` with EBUSY (frozen by someone else) is taken out of the record
//! at once. [`super::freeze_record::thaw_leftovers`] thaws what a record names when its lock is
//! free: at controller start before anything is served, before every
//! quiesce (so a retried copy first clears a leftover of its predecessor),
//! and from the garbage-collection pass ([`Controller::thaw_leftover_freezes`]).
//! It thaws a filesystem only through a mount the record names that is still
//! there (same mountinfo ID, path and major:minor, and the opened directory's
//! st_dev), so the superblock is the one that was frozen; `FITHAW` answering
//! EINVAL means it is not frozen any more (fine). A filesystem someone else
//! froze is never in a record and never thawed. The one window left: a crash
//! between a `FIFREEZE` that answered EBUSY and the rewrite of the record
//! (one atomic write) leaves that filesystem named, and the next pass thaws
//! the other party's freeze.
//!
//! A filesystem already frozen by someone else (EBUSY) may be thawed by
//! them in the middle of the copy, so it counts as still written: a reflink
//! is then required, and without reflinks the copy is refused with that
//! reason (not as "a mount this controller cannot see").
//!
//! A group of volumes (`group`) is copied at one instant when every member's
//! writers are stopped together: all visible filesystems are frozen first,
//! then every member is copied, then all are thawed (after the last member's
//! copy has read its source; the bound covers the whole group). A member that
//! cannot be frozen keeps writing during the copies, so the copies are one
//! instant only if that member is copied atomically (a reflink) while all the
//! others are frozen: the frozen members do not change between their freeze
//! and the thaw, so each equals its state at the instant of that one reflink.
//! Two such members would be copied at two different instants, with writes to
//! either in between; such a group is refused. See [`Controller::quiesce_group`].

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::freeze_record::{
    ioctl_on, thaw_leftovers, FreezeRecord, FrozenFs, MountRef, Owner, RecordFiles, FIFREEZE,
    FITHAW,
};
use super::Controller;
use crate::backend::meta::now_nanos;
use crate::error::{CsiError, CsiResult};
use crate::ids::VolumeId;
use crate::kernel::files::{CloneKind, SourceWindow};
use crate::kernel::mounts;
use crate::locks::PublishLock;

/// The stall point (see [`crate::failpoint::stall`]) a copy reaches when it
/// starts reading its source, with the volume's filesystems frozen; also a pause
/// point keyed by the state dir.
pub const FP_COPYING: &str = "quiesce:copying";

// ---------------------------------------------------------------- the live freeze

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Nothing frozen (nothing to freeze, or all writers unstoppable).
    Idle,
    Frozen,
    /// Thawed by the operation (the copy read its source, or it ended).
    Thawed,
    /// Thawed by the watchdog: the bound passed before the copy read its source.
    Expired,
    /// Thawed by someone else (FITHAW answered EINVAL) before the copy had read its
    /// source: writers may have run during the copy.
    Interrupted,
}

struct Hold {
    /// (the mount's directory, its path, what the record says of it)
    frozen: Vec<(File, PathBuf, FrozenFs)>,
    files: Option<RecordFiles>,
    record: Option<FreezeRecord>,
    phase: Phase,
    since: Option<Instant>,
}

impl Hold {
    /// Rewrites the record (a filesystem left it before being frozen).
    fn rewrite(&self) -> io::Result<()> {
        match (&self.files, &self.record) {
            (Some(f), Some(r)) => f.write(r),
            _ => Ok(()),
        }
    }

    /// Thaws every filesystem frozen, then removes the record (kept, naming
    /// what could not be thawed, for the next pass when a thaw fails). True when
    /// someone else had thawed one of them already.
    fn thaw_all(&mut self, why: &str) -> bool {
        let mut failed = Vec::new();
        let mut thawed_by_others = false;
        let n = self.frozen.len();
        for (dir, path, fs) in self.frozen.drain(..) {
            match ioctl_on(&dir, FITHAW) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    thawed_by_others = true;
                    tracing::warn!(mount = %path.display(), "a filesystem frozen for a copy was thawed by someone else before the copy ended")
                }
                Err(e) => {
                    tracing::error!(mount = %path.display(), error = %e, "could not thaw a filesystem frozen for a copy; the recovery pass tries again");
                    failed.push(fs);
                }
            }
        }
        if n > 0 {
            let ms = self
                .since
                .map(|t| t.elapsed().as_secs_f64() * 1e3)
                .unwrap_or(0.0);
            tracing::info!(
                filesystems = n,
                frozen_ms = ms,
                reason = why,
                "filesystems thawed"
            );
        }
        if let Some(files) = self.files.take() {
            let result = if failed.is_empty() {
                files.remove()
            } else {
                let mut rec = self.record.clone().expect("a record with its files");
                rec.filesystems = failed;
                files.write(&rec) // the lock goes with `files`: the next pass retries
            };
            if let Err(e) = result {
                tracing::warn!(error = %e, "cannot update a freeze record after the thaw; the next recovery pass settles it");
            }
        }
        thawed_by_others
    }
}

struct Shared {
    hold: Mutex<Hold>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Hold> {
        self.hold.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Why a writing holder keeps writing during the copy.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Why {
    /// A raw block volume, or a mount this process cannot see.
    Unfreezable,
    /// FIFREEZE answered EBUSY: frozen already, by someone else.
    AlreadyFrozen(PathBuf),
    /// FIFREEZE is not supported by the filesystem.
    CannotFreeze(PathBuf),
}

/// Writing holders that keep writing, by index of their member.
type RunningBy = Vec<(usize, Running)>;

/// A writing holder whose writers could not be stopped.
#[derive(Debug, Clone)]
pub(crate) struct Running {
    device: PathBuf,
    why: Why,
}

impl Running {
    fn describe(&self) -> String {
        let dev = self.device.display();
        match &self.why {
            Why::Unfreezable => {
                format!("{dev} (a raw block volume, or a mount this controller cannot see)")
            }
            Why::AlreadyFrozen(m) => format!(
                "{dev} (its filesystem at {} is already frozen: FIFREEZE answered EBUSY; this controller did not freeze it, so it neither thaws it nor counts on it staying frozen)",
                m.display()
            ),
            Why::CannotFreeze(m) => format!(
                "{dev} (its filesystem at {} cannot be frozen)",
                m.display()
            ),
        }
    }
}

/// Filesystems frozen for a copy (see the module docs); thawed when the copy
/// has read its source ([`Quiesced::window`]), when the bound passes, or when
/// dropped, error or not.
pub(crate) struct Quiesced {
    shared: Arc<Shared>,
    watchdog: Option<std::thread::JoinHandle<()>>,
    bound: Duration,
    state_dir: PathBuf,
    /// Set when a writer of the volume could not be stopped: the copy is one
    /// instant only if it is a reflink (the caller checks what it made).
    pub(crate) reflink_required: bool,
    /// The volumes' publish locks, held from the holder scan until after the
    /// thaw: a node's stage waits, so no writer the scan did not see (and
    /// so neither froze nor reflinked around) can start during the copy.
    _stages_held: Vec<PublishLock>,
}

impl Drop for Quiesced {
    fn drop(&mut self) {
        {
            let mut h = self.shared.lock();
            if h.phase == Phase::Frozen {
                h.thaw_all("the copy ended");
                h.phase = Phase::Thawed;
            } else if h.phase == Phase::Idle {
                // The watchdog of a freeze that never happened ends too.
                h.phase = Phase::Thawed;
            }
            if let Some(files) = h.files.take() {
                // An error before anything was frozen: the record names nothing of ours.
                if let Err(e) = files.remove() {
                    tracing::warn!(error = %e, "cannot remove a freeze record; the next recovery pass settles it");
                }
            }
            self.shared.cv.notify_all();
        }
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
    }
}

/// The window of one copy made while a [`Quiesced`] lives.
pub(crate) struct Window<'a> {
    q: &'a Quiesced,
    /// The last copy of the operation: its `close` thaws.
    last: bool,
}

impl SourceWindow for Window<'_> {
    fn open(&self) -> bool {
        crate::failpoint::stall(FP_COPYING);
        crate::failpoint::pause(FP_COPYING, &self.q.state_dir.to_string_lossy());
        !self.q.expired()
    }

    fn close(&self) -> bool {
        let mut h = self.q.shared.lock();
        match h.phase {
            Phase::Expired | Phase::Interrupted => false,
            Phase::Frozen if self.last => {
                let others = h.thaw_all("the copy has read its source");
                h.phase = if others {
                    Phase::Interrupted
                } else {
                    Phase::Thawed
                };
                self.q.shared.cv.notify_all();
                !others
            }
            _ => true,
        }
    }
}

impl Quiesced {
    fn new(cfg: &crate::config::Config, stages: Vec<PublishLock>) -> Quiesced {
        Quiesced {
            shared: Arc::new(Shared {
                hold: Mutex::new(Hold {
                    frozen: Vec::new(),
                    files: None,
                    record: None,
                    phase: Phase::Idle,
                    since: None,
                }),
                cv: Condvar::new(),
            }),
            watchdog: None,
            bound: cfg.max_freeze,
            state_dir: cfg.state_dir.clone(),
            reflink_required: false,
            _stages_held: stages,
        }
    }

    /// The window to hand the copy (`last`: the operation's last copy, after
    /// which the writers may go on).
    pub(crate) fn window(&self, last: bool) -> Window<'_> {
        Window { q: self, last }
    }

    /// Whether the writers were let go before the copy had read its source: the
    /// bound passed, or someone else thawed a filesystem.
    pub(crate) fn expired(&self) -> bool {
        matches!(
            self.shared.lock().phase,
            Phase::Expired | Phase::Interrupted
        )
    }

    /// Thaws everything when the bound passes while still frozen.
    fn start_watchdog(&mut self) {
        let shared = self.shared.clone();
        let bound = self.bound;
        let spawned = std::thread::Builder::new()
            .name("freeze-bound".into())
            .spawn(move || {
                let mut h = shared.lock();
                let deadline = h.since.unwrap_or_else(Instant::now) + bound;
                // From before the first FIFREEZE: one that takes long (its sync) or
                // hangs must not keep the members frozen before it past the bound.
                while matches!(h.phase, Phase::Idle | Phase::Frozen) {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        tracing::warn!(bound_s = bound.as_secs_f64(), "the copy did not read its source within --max-freeze: its writers are let go and the copy will be refused");
                        h.thaw_all("the freeze bound passed");
                        h.phase = Phase::Expired;
                        break;
                    }
                    h = shared
                        .cv
                        .wait_timeout(h, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            });
        match spawned {
            Ok(w) => self.watchdog = Some(w),
            // Without a watchdog the freeze still ends with the copy (and the
            // record stays for a crash): the bound is not kept, so say so.
            Err(e) => {
                tracing::error!(error = %e, "cannot start the freeze-bound watchdog; this freeze lasts as long as the copy")
            }
        }
    }

    /// The refusal of a copy whose writers were let go before it had read its source.
    pub(crate) fn expiry_refusal(&self, id: &VolumeId) -> CsiError {
        if self.shared.lock().phase == Phase::Interrupted {
            return CsiError::FailedPrecondition(format!(
                "volume {id}: a filesystem frozen for the copy was thawed by someone else (FITHAW found it not frozen) before the copy had read the volume: its writers may have run during the copy, which is discarded since it would not be point-in-time; retry"
            ));
        }
        CsiError::FailedPrecondition(format!(
            "volume {id}: the copy had not read the volume within --max-freeze ({:?}), the longest its writers are kept frozen; they were let go, and the copy is discarded since it would not be point-in-time. On this state dir's filesystem ({}) a copy of a volume in use is a full copy under the freeze: copy it when it is not in use, raise --max-freeze, or keep the state dir on xfs or btrfs, where the freeze lasts one reflink",
            self.bound,
            crate::fence::fs_name(&self.state_dir)
        ))
    }

    /// `e`, the failure of a copy made while this lived, or the expiry
    /// refusal when the copy failed because the bound passed.
    pub(crate) fn explain(&self, id: &VolumeId, e: CsiError) -> CsiError {
        if self.expired() {
            self.expiry_refusal(id)
        } else {
            e
        }
    }

    /// Refuses a copy made while this lived that is not one instant: a plain
    /// copy (say, the reflink failed and the backend fell back) of a volume
    /// whose writers kept going, or any copy whose writers were let go (the
    /// bound passed) before it had read its source. The caller removes what
    /// it made.
    pub(crate) fn refuse_torn(&self, id: &VolumeId, made: CloneKind) -> CsiResult<()> {
        if self.expired() {
            return Err(self.expiry_refusal(id));
        }
        if self.reflink_required && made != CloneKind::Reflink {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} is in use by writers that cannot be stopped, and the copy could not be made as a reflink: it would not be point-in-time"
            )));
        }
        Ok(())
    }
}

/// A filesystem to freeze: which member, through which mount.
struct Planned {
    member: usize,
    mount: PathBuf,
    fs: FrozenFs,
}

/// When the operation froze nothing: its record removed, and the watchdog let go (it has
/// nothing to bound).
fn drop_record_if_nothing_frozen(q: &Quiesced) {
    let mut h = q.shared.lock();
    if !h.frozen.is_empty() {
        return;
    }
    if let Some(files) = h.files.take() {
        if let Err(e) = files.remove() {
            tracing::warn!(error = %e, "cannot remove an empty freeze record; the next pass does");
        }
    }
    if h.phase == Phase::Idle {
        h.phase = Phase::Thawed;
        q.shared.cv.notify_all();
    }
}

impl Controller {
    /// Thaws the freezes of operations that are gone (see the module docs):
    /// for the garbage-collection pass. Returns how many it thawed.
    pub fn thaw_leftover_freezes(&self) -> usize {
        thaw_leftovers(&self.cfg.state_dir, false)
    }

    /// Thaws what this controller's copies froze, for a controller giving up the
    /// state dir while copies still run (a leader that lost its Lease): first it
    /// waits for a FIFREEZE already started and keeps later ones out, so no
    /// filesystem is frozen after it returns. Returns how many it thawed.
    pub fn give_up_freezes(&self) -> usize {
        let mut giving_up = self.giving_up.write().unwrap_or_else(|p| p.into_inner());
        *giving_up = true;
        super::freeze_record::thaw_own(&self.cfg.state_dir)
    }

    /// Runs `freeze` (one FIFREEZE) unless the controller is giving up the state
    /// dir; None then, and nothing was frozen.
    fn freeze_unless_giving_up(
        &self,
        freeze: impl FnOnce() -> io::Result<()>,
    ) -> Option<io::Result<()>> {
        let giving_up = self.giving_up.read().unwrap_or_else(|p| p.into_inner());
        if *giving_up {
            return None;
        }
        Some(freeze())
    }

    /// Stops every writer of generation `gen` until the copy made with
    /// [`Quiesced::window`] has read it, at most `--max-freeze` (see the
    /// module docs), or refuses with FAILED_PRECONDITION.
    pub(crate) fn quiesce(&self, id: &VolumeId, gen: u64, data_bytes: u64) -> CsiResult<Quiesced> {
        let mut q = Quiesced::new(&self.cfg, self.hold_stages([id])?);
        let running = self.stop_writers(
            "point-in-time copy",
            &[(id.clone(), gen, data_bytes)],
            &mut q,
        )?;
        if let Some((_, r)) = running.first() {
            if !self.backend.reflinks() {
                return Err(self.no_reflink_refusal(id, r));
            }
            q.reflink_required = true;
        }
        Ok(q)
    }

    /// The publish locks of `ids`, exclusive, taken in one order (sorted), so
    /// two group snapshots sharing members cannot deadlock.
    fn hold_stages<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a VolumeId>,
    ) -> CsiResult<Vec<PublishLock>> {
        let mut ids: Vec<&VolumeId> = ids.into_iter().collect();
        ids.sort();
        ids.dedup();
        ids.into_iter()
            .map(|id| {
                PublishLock::take_for_rpc(
                    &self.cfg.state_dir,
                    id,
                    true,
                    "locking the volume against new stages for the copy",
                )
            })
            .collect()
    }

    /// Stops the writers of every member of a group at once, until the last
    /// member's copy has read its source (at most `--max-freeze`): returns
    /// the frozen filesystems, and the index in `members` (volume, generation,
    /// data bytes) of the one member whose writers could not be stopped, if
    /// there is one. That member must be copied by one reflink while the
    /// result lives; the copies are then the members' state at the instant of
    /// that reflink. Refuses (FAILED_PRECONDITION, everything thawed) when
    /// more than one member keeps writers, or one does and the state dir makes
    /// no reflinks.
    pub(crate) fn quiesce_group(
        &self,
        members: &[(VolumeId, u64, u64)],
    ) -> CsiResult<(Quiesced, Option<usize>)> {
        let mut q = Quiesced::new(
            &self.cfg,
            self.hold_stages(members.iter().map(|(id, _, _)| id))?,
        );
        let mut running = self.stop_writers("group copy", members, &mut q)?;
        // One entry per member: the first holder that keeps writing.
        running.dedup_by_key(|(i, _)| *i);
        match running.as_slice() {
            [] => Ok((q, None)),
            [(i, r)] if self.backend.reflinks() => {
                tracing::info!(volume = %members[*i].0, device = %r.device.display(), "group member cannot be frozen: it is copied by a reflink while every other member is frozen");
                q.reflink_required = true;
                Ok((q, Some(*i)))
            }
            [(i, r)] => Err(self.no_reflink_refusal(&members[*i].0, r)),
            many => Err(CsiError::FailedPrecondition(format!(
                "volumes {} are in use through {}: their writers cannot be stopped, and copies of two volumes that keep writing are not taken at one instant, so the group snapshot would not be point-in-time. Snapshot the group when at most one of them is in use that way",
                many.iter()
                    .map(|(i, _)| members[*i].0.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                many.iter()
                    .map(|(_, r)| r.describe())
                    .collect::<Vec<_>>()
                    .join(", "),
            ))),
        }
    }

    fn no_reflink_refusal(&self, id: &VolumeId, r: &Running) -> CsiError {
        let fs = crate::fence::fs_name(&self.cfg.state_dir);
        CsiError::FailedPrecondition(match &r.why {
            Why::AlreadyFrozen(m) => format!(
                "volume {id} is in use through {}, whose filesystem (mounted at {}) is already frozen: FIFREEZE answered EBUSY. This controller did not freeze it (it keeps a record of every freeze it makes, and thaws its own), so whoever did may thaw it during the copy, and the state dir's filesystem ({fs}) makes no reflinks: a copy now would not be point-in-time. Retry once it is thawed (fsfreeze -u {}), or keep the state dir on xfs or btrfs",
                r.device.display(),
                m.display(),
                m.display()
            ),
            _ => format!(
                "volume {id} is in use through {} and the state dir's filesystem ({fs}) makes no reflinks: a copy now would not be point-in-time. Copy it (snapshot or clone) when it is not in use, or keep the state dir on xfs or btrfs",
                r.describe()
            ),
        })
    }

    /// Freezes the filesystem of every writing holder of the members that
    /// this process can see (into `q`, under a record written first, with
    /// the watchdog started); returns the writing holders that keep writing,
    /// by member index, in member order.
    fn stop_writers(
        &self,
        operation: &str,
        members: &[(VolumeId, u64, u64)],
        q: &mut Quiesced,
    ) -> CsiResult<RunningBy> {
        // A predecessor's leftover (a crash mid-copy) would answer EBUSY.
        thaw_leftovers(&self.cfg.state_dir, false);
        let (plan, mut running) = self.plan_freezes(members)?;
        if plan.is_empty() {
            return Ok(running);
        }
        self.open_freeze_record(operation, members, q)?;
        q.start_watchdog();
        for p in plan {
            if let Some(r) = self.freeze_one(p, members, q)? {
                running.push(r);
            }
        }
        drop_record_if_nothing_frozen(q);
        running.sort_by_key(|(i, _)| *i);
        Ok(running)
    }

    /// Writes the operation's freeze record, naming no filesystem yet, before any freeze.
    fn open_freeze_record(
        &self,
        operation: &str,
        members: &[(VolumeId, u64, u64)],
        q: &Quiesced,
    ) -> CsiResult<()> {
        let files = RecordFiles::create(&self.cfg.state_dir)
            .map_err(|e| CsiError::internal("making a freeze record", e))?;
        let started_at = now_nanos();
        let mut h = q.shared.lock();
        h.files = Some(files);
        h.record = Some(FreezeRecord {
            operation: operation.into(),
            volumes: members.iter().map(|(id, _, _)| id.to_string()).collect(),
            owner: Owner::current(),
            started_at,
            thaw_by: started_at.saturating_add(q.bound.as_nanos() as i64),
            filesystems: Vec::new(),
        });
        h.since = Some(Instant::now());
        Ok(())
    }

    /// Freezes one planned filesystem, recorded before it is frozen. None once frozen;
    /// the member's holder that keeps running, and why, when it cannot be frozen here.
    fn freeze_one(
        &self,
        p: Planned,
        members: &[(VolumeId, u64, u64)],
        q: &Quiesced,
    ) -> CsiResult<Option<(usize, Running)>> {
        let (id, gen) = (&members[p.member].0, members[p.member].1);
        let dir = File::open(&p.mount)
            .map_err(|e| CsiError::internal("opening a mount to freeze it", e))?;
        // The record names each filesystem before it is frozen, and only
        // those this operation froze or is freezing now.
        {
            let mut h = q.shared.lock();
            if let Some(r) = h.record.as_mut() {
                r.filesystems.push(p.fs.clone());
            }
            h.rewrite().map_err(|e| {
                CsiError::internal("writing a freeze record (its filesystem was not frozen)", e)
            })?;
        }
        let Some(answer) = self.freeze_unless_giving_up(|| ioctl_on(&dir, FIFREEZE)) else {
            // Dropping `q` thaws what it froze and removes the record.
            return Err(CsiError::Unavailable(format!(
                "volume {id}: the controller plugin is giving up the state dir (it lost its Lease): no freeze starts; retry on the new leader"
            )));
        };
        let mut h = q.shared.lock();
        let why = match answer {
            Ok(()) => {
                tracing::info!(volume = %id, generation = gen, mount = %p.mount.display(), "filesystem frozen for a point-in-time copy");
                h.frozen.push((dir, p.mount, p.fs));
                if matches!(h.phase, Phase::Expired | Phase::Interrupted) {
                    // The bound passed (or someone thawed a member) while this
                    // FIFREEZE ran.
                    h.thaw_all("the freeze bound passed");
                    drop(h);
                    return Err(q.expiry_refusal(id));
                }
                h.phase = Phase::Frozen;
                return Ok(None);
            }
            // Frozen by someone else already: they may thaw it in the
            // middle of our copy, so it counts as still written (a reflink
            // is then required, or the copy is refused). Not ours: out of
            // the record at once, so no recovery pass thaws it.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                tracing::warn!(volume = %id, mount = %p.mount.display(), "filesystem already frozen by someone else (FIFREEZE answered EBUSY): left as it is");
                Why::AlreadyFrozen(p.mount.clone())
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOTTY)) => {
                Why::CannotFreeze(p.mount.clone())
            }
            Err(e) => {
                return Err(CsiError::internal(
                    &format!("freezing {} for a point-in-time copy", p.mount.display()),
                    e,
                ))
            }
        };
        if let Some(r) = h.record.as_mut() {
            r.filesystems.retain(|f| f != &p.fs);
        }
        h.rewrite()
            .map_err(|e| CsiError::internal("rewriting a freeze record", e))?;
        Ok(Some((
            p.member,
            Running {
                device: p.fs.device.clone(),
                why,
            },
        )))
    }

    /// What to freeze of each member's writing holders, and the holders that
    /// cannot be frozen at all.
    fn plan_freezes(
        &self,
        members: &[(VolumeId, u64, u64)],
    ) -> CsiResult<(Vec<Planned>, RunningBy)> {
        let mut plan: Vec<Planned> = Vec::new();
        let mut running = Vec::new();
        for (i, (id, gen, data_bytes)) in members.iter().enumerate() {
            let holders = self.backend.holders(id, *gen)?;
            for lo in holders.iter().filter(|l| !l.read_only) {
                if crate::fence::is_fenced_device(lo, *data_bytes) {
                    continue; // fenced: can no longer write the data
                }
                let rdev = std::fs::metadata(&lo.device)
                    .map_err(|e| CsiError::internal("inspecting a holder", e))?
                    .rdev();
                let (major, minor) = (libc::major(rdev), libc::minor(rdev));
                let mounted = mounts::mounts_of_device(major, minor)
                    .map_err(|e| CsiError::internal("reading the mount table", e))?;
                // A filesystem on the device, mounted as a directory (a raw block
                // volume's bind-mounted device node is a file and cannot be frozen).
                let dirs: Vec<_> = mounted.iter().filter(|m| m.mount_point.is_dir()).collect();
                let Some(first) = dirs.first() else {
                    running.push((
                        i,
                        Running {
                            device: lo.device.clone(),
                            why: Why::Unfreezable,
                        },
                    ));
                    continue;
                };
                if plan
                    .iter()
                    .any(|p| (p.fs.major, p.fs.minor) == (first.major, first.minor))
                {
                    continue;
                }
                plan.push(Planned {
                    member: i,
                    mount: first.mount_point.clone(),
                    fs: FrozenFs {
                        volume: id.to_string(),
                        generation: *gen,
                        device: lo.device.clone(),
                        major: first.major,
                        minor: first.minor,
                        mounts: dirs
                            .iter()
                            .filter(|m| (m.major, m.minor) == (first.major, first.minor))
                            .map(|m| MountRef {
                                id: m.mount_id,
                                path: m.mount_point.clone(),
                            })
                            .collect(),
                    },
                });
            }
        }
        Ok((plan, running))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller giving up the state dir starts no freeze after it (so none can
    /// outlive the process that exits next); before, a freeze goes ahead.
    #[test]
    fn a_controller_giving_up_the_state_dir_starts_no_freeze() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = crate::config::Config::local(
            crate::config::Mode::Controller,
            None,
            dir.path().join("state"),
            dir.path().join("kubelet"),
            dir.path().join("c.sock"),
        );
        let c = Controller::open(cfg).unwrap();
        let mut ran = 0;
        let mut freeze = || {
            ran += 1;
            Ok(())
        };
        assert!(
            c.freeze_unless_giving_up(&mut freeze).is_some(),
            "control: a freeze runs"
        );
        assert_eq!(c.give_up_freezes(), 0, "nothing of ours was frozen");
        assert!(c.freeze_unless_giving_up(&mut freeze).is_none());
        assert_eq!(ran, 1, "no freeze ran after giving up");
    }

    fn quiesced(reflink_required: bool) -> Quiesced {
        let dir = std::env::temp_dir();
        let cfg = crate::config::Config::local(
            crate::config::Mode::Controller,
            None,
            dir.clone(),
            dir.clone(),
            dir.join("unused.sock"),
        );
        let mut q = Quiesced::new(&cfg, Vec::new());
        q.reflink_required = reflink_required;
        q
    }

    /// Snapshots and clones share this check: a plain copy of a volume whose
    /// writers kept going is refused; with the writers stopped any copy is one
    /// instant, and a reflink always is.
    #[test]
    fn a_plain_copy_of_a_running_volume_is_refused() {
        let id = VolumeId::generate();
        let e = quiesced(true)
            .refuse_torn(&id, CloneKind::SparseCopy)
            .unwrap_err();
        assert!(matches!(e, CsiError::FailedPrecondition(_)), "{e:?}");
        assert!(quiesced(true).refuse_torn(&id, CloneKind::Reflink).is_ok());
        assert!(quiesced(false)
            .refuse_torn(&id, CloneKind::SparseCopy)
            .is_ok());
    }

    /// A filesystem someone else thawed during the copy (FITHAW answers EINVAL:
    /// not frozen) means its writers may have run: the copy is refused with that
    /// reason. Control: the same close with nothing thawed behind its back.
    #[test]
    fn a_copy_whose_filesystem_someone_else_thawed_is_refused() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIP: FITHAW needs root");
            return;
        }
        let id = VolumeId::generate();
        let dir = tempfile::tempdir().unwrap();
        let q = quiesced(false);
        {
            let mut h = q.shared.lock();
            // A mount that is not frozen stands for one someone else thawed.
            h.frozen.push((
                File::open(dir.path()).unwrap(),
                dir.path().to_path_buf(),
                FrozenFs {
                    volume: id.to_string(),
                    generation: 1,
                    device: "/dev/loop-none".into(),
                    major: 0,
                    minor: 0,
                    mounts: Vec::new(),
                },
            ));
            h.phase = Phase::Frozen;
        }
        assert!(!q.window(true).close(), "the copy's window was not held");
        let e = q.refuse_torn(&id, CloneKind::Reflink).unwrap_err();
        assert!(
            matches!(&e, CsiError::FailedPrecondition(m) if m.contains("thawed by someone else")),
            "{e:?}"
        );
        let control = quiesced(false);
        control.shared.lock().phase = Phase::Frozen;
        assert!(control.window(true).close());
        assert!(control.refuse_torn(&id, CloneKind::SparseCopy).is_ok());
    }

    /// A copy whose writers the watchdog let go is refused whatever it made,
    /// and a window that closed makes the copy itself fail.
    #[test]
    fn a_copy_after_the_bound_is_refused() {
        let id = VolumeId::generate();
        let q = quiesced(false);
        q.shared.lock().phase = Phase::Expired;
        assert!(!q.window(true).open());
        assert!(!q.window(true).close());
        for made in [CloneKind::Reflink, CloneKind::SparseCopy] {
            let e = q.refuse_torn(&id, made).unwrap_err();
            assert!(
                matches!(&e, CsiError::FailedPrecondition(m) if m.contains("--max-freeze")),
                "{e:?}"
            );
        }
        let e = q.explain(&id, CsiError::Internal("copy failed".into()));
        assert!(matches!(e, CsiError::FailedPrecondition(_)), "{e:?}");
        // Not expired: the copy's own error stands.
        let e = quiesced(false).explain(&id, CsiError::Internal("copy failed".into()));
        assert!(matches!(e, CsiError::Internal(_)), "{e:?}");
    }
}
