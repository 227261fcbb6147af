//! Node return: releasing volumes whose attachment was fenced away while this node was
//! gone (shut down or cut off).
//!
//! While the node was away, podgc force-deleted its pods and the attacher detached their
//! volumes with `fence = true`: the generation this node's loop devices hold was frozen and
//! the volume moved on to a new generation elsewhere. The node still holds the frozen one
//! (loop device, staging mount, pod bind mounts), the controller refuses to publish that
//! volume to this node again until it lets go (see `controller::publish`), and the frozen
//! generation cannot be garbage-collected. Recovery lets go:
//!
//! 0. Check the state dir (`state_guard`): a pass acts on what its metadata says, so it does
//!    nothing at all while the state dir is missing, has no identity, is not the one this
//!    node remembers, or is not mounted when it must be, and something of ours is mounted.
//! 1. Find this node's loop devices by tag (`fcsi:<hex>:<gen>`) whose generation is fenced
//!    (`generations[gen].fenced_at` in the volume metadata, read fresh from the state dir).
//!    A volume mounted here whose volume or generation record is missing is left in place
//!    with a warning (and keeps the node from counting as clean): a missing record says
//!    nothing about whether the data is in use.
//! 2. Per volume, under the same in-flight lock the CSI calls take (a kubelet call racing
//!    with recovery gets ABORTED and is retried by the CO, or recovery skips the volume
//!    until its next pass): force-unmount every pod publish target, then the staging mount,
//!    remove the targets and the globalmount directory, and detach the loop devices.
//! 3. When nothing fenced is left, report the node clean through a [`CleanReporter`]
//!    (fencecsi-podgc's `NodeCleanReporter` sets `fencecsi.io/node-clean` on the Node).
//!
//! Every pass also sweeps ephemeral inline volumes that are not mounted anywhere
//! (`Node::sweep_ephemeral`, `ephemeral/sweep.rs`), before and whatever the state dir
//! check: they are node-local, and never count against the node being clean.
//!
//! "This node's" devices: several node plugins may share one kernel (the drill, tests,
//! kind), and loop devices are kernel-wide, so a device counts as this node's when one of
//! its mounts lies under this node's kubelet dir, or, with no mount left anywhere, when the
//! metadata names this node as the one its generation was fenced from. Devices mounted only
//! under another root, and devices without our tag, are never touched.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use futures::future::BoxFuture;
use sha2::{Digest, Sha256};
use tokio::sync::{watch, Notify};

use super::stage::rdev;
use super::{remove_target, Node};
use crate::error::{CsiError, CsiResult};
use crate::ids::VolumeId;
use crate::kernel::loop_device::{self, LoopError, LoopInfo};
use crate::kernel::mounts;
use crate::paths::AllowedRoots;
use crate::terms::{node_tag, parse_tag_full};

/// Error type of reporters.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where the node plugin reports that this node holds nothing fenced any more.
///
/// Called after every recovery pass that left nothing fenced behind, with the time that
/// pass *started* (everything fenced before that moment has been released). Called often
/// (once per pass), so implementations should answer from a cache and write only when the
/// report changes something.
///
/// `Ok(true)`: recorded, or nothing needed recording. `Ok(false)`: the report came too late
/// to count (the node was quarantined after `time`); the next pass reports again.
pub trait CleanReporter: Send + Sync {
    fn report_clean<'a>(
        &'a self,
        node_id: &'a str,
        time: SystemTime,
    ) -> BoxFuture<'a, Result<bool, BoxError>>;
}

/// A reporter that only logs (the driver binary has no cluster client).
#[derive(Debug, Default, Clone)]
pub struct LogReporter;

impl CleanReporter for LogReporter {
    fn report_clean<'a>(
        &'a self,
        node_id: &'a str,
        time: SystemTime,
    ) -> BoxFuture<'a, Result<bool, BoxError>> {
        Box::pin(async move {
            tracing::debug!(
                node = node_id,
                ?time,
                "node holds no fenced volume (report not sent: no cluster client)"
            );
            Ok(true)
        })
    }
}

/// One volume generation released by a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    pub volume_id: String,
    pub generation: u64,
    /// Mounts removed (pod targets first, then staging).
    pub unmounted: Vec<PathBuf>,
    /// Loop devices detached.
    pub devices: Vec<PathBuf>,
}

/// What one recovery pass did.
#[derive(Debug, Clone)]
pub struct PassReport {
    /// Number of the pass in this plugin (1 = the pass at start).
    pub seq: u64,
    pub started_at: SystemTime,
    pub released: Vec<Released>,
    /// Volumes still held on a fenced generation after this pass, with why (busy with a
    /// concurrent CSI call, a lazily unmounted filesystem still in use, an error).
    pub pending: BTreeMap<String, String>,
    /// Nothing fenced is left on this node.
    pub clean: bool,
    /// The reporter's answer, when it was called (clean passes only).
    pub reported: Option<Result<bool, String>>,
    /// Why the pass did nothing at all: the state dir failed its check (then `clean` is
    /// false and Probe answers not ready).
    pub refused: Option<String>,
}

/// One of our loop devices on a fenced generation that belongs to this node.
#[derive(Debug, Clone)]
struct Held {
    lo: LoopInfo,
    gen: u64,
    /// Its mounts under this node's kubelet dir.
    mounts: Vec<PathBuf>,
}

/// What a scan of this node's loop devices found.
#[derive(Debug, Default)]
struct Scan {
    /// Devices on fenced generations, to release.
    fenced: BTreeMap<VolumeId, Vec<Held>>,
    /// Volumes mounted here whose metadata (volume or generation) is missing: left in
    /// place. A missing record says nothing about whether the volume is still in use, and
    /// the usual cause is a state dir that is not the right one.
    unrecorded: BTreeMap<VolumeId, Vec<PathBuf>>,
}

/// What one pass did, before it is reported.
#[derive(Debug, Default)]
pub struct PassOutcome {
    pub released: Vec<Released>,
    pub pending: BTreeMap<String, String>,
    /// Set when the state dir check refused the pass (see `state_guard`): nothing was done.
    pub refused: Option<String>,
}

impl Node {
    /// The staging path kubelet uses for a volume of this driver:
    /// `<kubelet>/plugins/kubernetes.io/csi/<driver>/<sha256(volumeHandle)>/globalmount`.
    pub fn kubelet_staging_path(&self, id: &VolumeId) -> PathBuf {
        let root = self
            .roots
            .roots()
            .first()
            .cloned()
            .unwrap_or_else(|| self.cfg.kubelet_dir.clone());
        root.join("plugins/kubernetes.io/csi")
            .join(&self.cfg.driver_name)
            .join(hex::encode(Sha256::digest(id.as_str().as_bytes())))
            .join("globalmount")
    }

    fn under_roots(&self, p: &Path) -> bool {
        under_roots(&self.roots, p)
    }

    /// This node's loop devices: those on fenced generations, and volumes mounted here that
    /// the metadata does not know.
    fn scan(&self) -> CsiResult<Scan> {
        let all = loop_device::list().map_err(|e| CsiError::internal("listing loop devices", e))?;
        let table =
            mounts::mounts().map_err(|e| CsiError::internal("reading the mount table", e))?;
        let mut metas = BTreeMap::new();
        let mut out = Scan::default();
        for lo in all {
            // Only this node's devices: other node plugins may share the kernel.
            let Some((id, gen, node)) = parse_tag_full(&lo.tag) else {
                continue;
            };
            if node != node_tag(&self.node_id) {
                continue;
            }
            if !metas.contains_key(&id) {
                let m = self.read_meta(&id)?;
                metas.insert(id.clone(), m);
            }
            let recorded = metas[&id].as_ref().and_then(|m| {
                m.generations
                    .get(&gen)
                    .map(|g| (g, crate::fence::is_fenced_device(&lo, m.data_bytes(gen))))
            });
            let fenced = match recorded {
                None => false,
                Some((g, _)) if g.fenced_at.is_some() => true,
                // Only this device was fenced (the generation lives on for another node):
                // just as stale.
                Some((_, device_fenced)) => device_fenced,
            };
            if recorded.is_some() && !fenced {
                continue;
            }
            let Ok((major, minor)) = rdev(&lo.device) else {
                continue; // unbound since the listing
            };
            let users: Vec<&mounts::MountEntry> = table
                .iter()
                .filter(|m| device_matches(m, major, minor))
                .collect();
            let mine: Vec<PathBuf> = users
                .iter()
                .map(|m| m.mount_point.clone())
                .filter(|p| self.under_roots(p))
                .collect();
            if recorded.is_none() {
                // Unmounted, or mounted only under another root: whose it is cannot be told.
                if !mine.is_empty() {
                    out.unrecorded.entry(id).or_default().extend(mine);
                }
                continue;
            }
            // Nothing mounts it any more (lazily unmounted, or never mounted): the tag says
            // it is this node's, and a fenced one is released whoever the record names (a
            // fence of several nodes, or of an unknown holder). Mounted only under another
            // node's root: not ours.
            if !mine.is_empty() || users.is_empty() {
                out.fenced.entry(id).or_default().push(Held {
                    lo,
                    gen,
                    mounts: mine,
                });
            }
        }
        Ok(out)
    }

    /// The state dir check that gates every pass.
    pub(super) fn check_state_dir(&self) -> Result<Option<crate::state_id::StateId>, String> {
        check_state_dir(&self.guard, &self.node_id, &self.roots)
    }

    /// Releases one volume's stale devices. Holds the volume's in-flight lock throughout.
    fn release_volume(&self, id: &VolumeId) -> CsiResult<Vec<Released>> {
        let _lock = self.inflight.try_lock(id.as_str())?;
        // Re-read under the lock: a racing NodeUnpublish/NodeUnstage may have done it all.
        let held = self.scan()?.fenced.remove(id).unwrap_or_default();
        let mut by_gen: BTreeMap<u64, Vec<Held>> = BTreeMap::new();
        for h in held {
            by_gen.entry(h.gen).or_default().push(h);
        }
        let mut out = Vec::new();
        for (gen, devices) in by_gen {
            let mut unmounted = Vec::new();
            let mut staging: BTreeSet<PathBuf> = BTreeSet::new();
            let mut targets: BTreeSet<PathBuf> = BTreeSet::new();
            for h in &devices {
                for m in &h.mounts {
                    if is_staging_mount(m, id) {
                        staging.insert(m.clone());
                    } else {
                        targets.insert(m.clone());
                    }
                }
            }
            // Pod targets first (they are bind mounts of the staging mount), then staging.
            for t in &targets {
                self.unmount_path(t, true)?;
                remove_target(t).or_else(|e| {
                    tracing::warn!(volume = %id, target = %t.display(), error = %e, "target left in place");
                    Ok::<_, CsiError>(())
                })?;
                unmounted.push(t.clone());
            }
            for s in &staging {
                self.unmount_path(s, true)?;
                unmounted.push(s.clone());
                if s.file_name().is_some_and(|n| n == id.as_str()) {
                    // Raw block: the device bind-mounted on a file inside the staging dir.
                    remove_target(s)?;
                    if let Some(dir) = s.parent() {
                        remove_dir_if_empty(dir);
                    }
                } else {
                    remove_dir_if_empty(s);
                }
            }
            let mut detached = Vec::new();
            for h in &devices {
                loop_device::detach(&h.lo.device).map_err(|e| {
                    CsiError::internal(&format!("detaching {}", h.lo.device.display()), e)
                })?;
                detached.push(h.lo.device.clone());
            }
            for h in &devices {
                if !wait_unbound(&h.lo, Duration::from_secs(2)) {
                    return Err(CsiError::FailedPrecondition(format!(
                        "{} is still bound to generation {gen} after detach: a lazily unmounted filesystem on it is still in use; it goes when its last user does",
                        h.lo.device.display()
                    )));
                }
            }
            tracing::warn!(volume = %id, generation = gen, unmounted = ?unmounted, devices = ?detached,
                "released a volume fenced away from this node");
            out.push(Released {
                volume_id: id.to_string(),
                generation: gen,
                unmounted,
                devices: detached,
            });
        }
        // The globalmount dir of kubelet's layout, also when its mount was gone already.
        remove_dir_if_empty(&self.kubelet_staging_path(id));
        Ok(out)
    }

    /// One recovery pass (blocking: mount table, ioctls). Never fails as a whole: what
    /// could not be released is listed in `pending`, and a state dir that fails its check
    /// (`state_guard`) stops the pass before it does anything.
    pub fn recover_fenced(&self) -> PassOutcome {
        let mut out = PassOutcome::default();
        // Ephemeral inline volumes are node-local: their leftovers go whatever the state
        // dir looks like, and never keep the node from counting as clean.
        self.sweep_ephemeral();
        match self.check_state_dir() {
            Ok(Some(_)) => {}
            Ok(None) => return out, // no identity yet, nothing held here
            Err(why) => {
                out.pending.insert("*".to_string(), why.clone());
                out.refused = Some(why);
                return out;
            }
        }
        let scan = match self.scan() {
            Ok(s) => s,
            Err(e) => {
                out.pending.insert("*".to_string(), e.to_string());
                return out;
            }
        };
        for (id, mounts) in &scan.unrecorded {
            tracing::warn!(volume = %id, mounts = ?mounts, state_dir = %self.cfg.state_dir.display(),
                "volume mounted here has no metadata in the state dir: left in place (is the state dir the right one? detach it by hand once it is known to be unused)");
            out.pending.insert(
                id.to_string(),
                "mounted here but has no metadata in the state dir: left in place".into(),
            );
        }
        for id in scan.fenced.keys() {
            match self.release_volume(id) {
                Ok(r) => out.released.extend(r),
                Err(e) => {
                    if !matches!(e, CsiError::Aborted(_)) {
                        tracing::warn!(volume = %id, error = %e, "could not release a fenced volume yet");
                    }
                    out.pending.insert(id.to_string(), e.to_string());
                }
            }
        }
        out
    }
}

/// The state dir check, given what identifies this node's mounts.
pub(super) fn check_state_dir(
    guard: &super::state_guard::StateGuard,
    node_id: &str,
    roots: &AllowedRoots,
) -> Result<Option<crate::state_id::StateId>, String> {
    let held = mounted_here(node_id, roots).map_err(|e| e.to_string())?;
    guard.check(&held).map_err(|r| r.to_string())
}

/// Our volumes mounted under this node's kubelet dir, whatever the metadata says: what a
/// wrong state dir would put at risk.
fn mounted_here(node_id: &str, roots: &AllowedRoots) -> CsiResult<BTreeSet<VolumeId>> {
    let all = loop_device::list().map_err(|e| CsiError::internal("listing loop devices", e))?;
    let table = mounts::mounts().map_err(|e| CsiError::internal("reading the mount table", e))?;
    let me = node_tag(node_id);
    let mut out = BTreeSet::new();
    for lo in all {
        let Some((id, _, node)) = parse_tag_full(&lo.tag) else {
            continue;
        };
        if node != me || out.contains(&id) {
            continue;
        }
        let Ok((major, minor)) = rdev(&lo.device) else {
            continue;
        };
        if table
            .iter()
            .any(|m| device_matches(m, major, minor) && under_roots(roots, &m.mount_point))
        {
            out.insert(id);
        }
    }
    Ok(out)
}

fn under_roots(roots: &AllowedRoots, p: &Path) -> bool {
    roots.roots().iter().any(|r| p.starts_with(r) && p != r)
}

/// Same rule as `mounts::mounts_of_device`, on an already-read table.
fn device_matches(m: &mounts::MountEntry, major: u32, minor: u32) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let rdev = libc::makedev(major, minor);
    let is_dev = |p: &Path| {
        std::fs::metadata(p)
            .map(|md| md.file_type().is_block_device() && md.rdev() == rdev)
            .unwrap_or(false)
    };
    (m.major == major && m.minor == minor)
        || (m.source.starts_with("/dev/") && is_dev(Path::new(&m.source)))
        || (matches!(m.fs_type.as_str(), "devtmpfs" | "tmpfs")
            && m.root != Path::new("/")
            && is_dev(&m.mount_point))
}

/// A staging mount: kubelet's `globalmount` dir (filesystem volumes) or our block file
/// named after the volume inside a staging dir.
fn is_staging_mount(p: &Path, id: &VolumeId) -> bool {
    p.file_name()
        .is_some_and(|n| n == "globalmount" || n == id.as_str())
}

fn remove_dir_if_empty(dir: &Path) {
    match std::fs::remove_dir(dir) {
        Ok(()) => tracing::info!(dir = %dir.display(), "staging directory removed"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "staging directory left in place")
        }
    }
}

/// Waits until `lo` is unbound (LOOP_CLR_FD may complete at the last close), or another
/// file took the device number.
pub(super) fn wait_unbound(lo: &LoopInfo, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        match loop_device::status(&lo.device) {
            Err(LoopError::NotBound(_)) => return true,
            Ok(now) if now.backing_ino != lo.backing_ino || now.backing_dev != lo.backing_dev => {
                return true
            }
            Err(_) => return true,
            Ok(_) => {}
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Settings of the background recovery loop.
#[derive(Clone)]
pub struct RecoveryOptions {
    /// Time between passes after the one at start. Zero: only the pass at start (and
    /// passes asked for through [`RecoveryHandle::run_now`]).
    pub interval: Duration,
    pub reporter: Arc<dyn CleanReporter>,
}

impl std::fmt::Debug for RecoveryOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecoveryOptions")
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

/// Control of a running recovery loop. Cheap to clone.
#[derive(Clone)]
pub struct RecoveryHandle {
    trigger: Arc<Notify>,
    reports: watch::Receiver<Option<PassReport>>,
    abort: tokio::task::AbortHandle,
}

impl RecoveryHandle {
    /// Asks for a pass now and waits for a pass that started after this call.
    pub async fn run_now(&self) -> PassReport {
        let mut rx = self.reports.clone();
        let asked = SystemTime::now();
        self.trigger.notify_one();
        loop {
            if let Some(r) = rx.borrow_and_update().as_ref() {
                if r.started_at >= asked {
                    return r.clone();
                }
            }
            if rx.changed().await.is_err() {
                return PassReport {
                    seq: 0,
                    started_at: asked,
                    released: vec![],
                    pending: [("*".to_string(), "recovery loop stopped".to_string())].into(),
                    clean: false,
                    reported: None,
                    refused: None,
                };
            }
        }
    }

    /// Reports of passes as they finish (the latest one; `None` before the first).
    pub fn subscribe(&self) -> watch::Receiver<Option<PassReport>> {
        self.reports.clone()
    }

    pub fn latest(&self) -> Option<PassReport> {
        self.reports.borrow().clone()
    }

    /// Stops the loop (after the ongoing blocking step, if any).
    pub fn abort(&self) {
        self.abort.abort();
    }
}

/// Starts the recovery loop: a pass at once, then every `interval` (and on demand).
pub fn spawn(node: Arc<Node>, opts: RecoveryOptions) -> RecoveryHandle {
    let trigger = Arc::new(Notify::new());
    let (tx, rx) = watch::channel(None);
    let t = trigger.clone();
    let task = tokio::spawn(async move {
        let mut seq = 0u64;
        loop {
            seq += 1;
            let report = run_pass(&node, &opts, seq).await;
            tx.send_replace(Some(report));
            if opts.interval.is_zero() {
                t.notified().await;
            } else {
                tokio::select! {
                    _ = t.notified() => {}
                    _ = tokio::time::sleep(opts.interval) => {}
                }
            }
        }
    });
    RecoveryHandle {
        trigger,
        reports: rx,
        abort: task.abort_handle(),
    }
}

async fn run_pass(node: &Arc<Node>, opts: &RecoveryOptions, seq: u64) -> PassReport {
    let started_at = SystemTime::now();
    let n = node.clone();
    let PassOutcome {
        released,
        pending,
        refused,
    } = match tokio::task::spawn_blocking(move || n.recover_fenced()).await {
        Ok(r) => r,
        Err(e) => PassOutcome {
            pending: [("*".to_string(), format!("recovery pass panicked: {e}"))].into(),
            ..Default::default()
        },
    };
    let clean = pending.is_empty();
    let reported = if clean {
        let r = opts
            .reporter
            .report_clean(&node.node_id, started_at)
            .await
            .map_err(|e| e.to_string());
        match &r {
            Ok(true) if !released.is_empty() => {
                tracing::info!(node = %node.node_id, released = released.len(), "node reported clean")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(node = %node.node_id, error = %e, "reporting the node clean failed; retried next pass")
            }
        }
        Some(r)
    } else {
        None
    };
    PassReport {
        seq,
        started_at,
        released,
        pending,
        clean,
        reported,
        refused,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_mounts_are_recognised() {
        let id = VolumeId::generate();
        assert!(is_staging_mount(
            Path::new("/k/plugins/kubernetes.io/csi/d/abc/globalmount"),
            &id
        ));
        assert!(is_staging_mount(
            &Path::new("/k/plugins/kubernetes.io/csi/volumeDevices/staging/pv").join(id.as_str()),
            &id
        ));
        assert!(!is_staging_mount(
            Path::new("/k/pods/uid/volumes/kubernetes.io~csi/pv/mount"),
            &id
        ));
    }
}
