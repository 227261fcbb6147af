//! The write fence. A node's loop device holds an open descriptor on one
//! generation's inode, so renaming or unlinking the path fences nothing, and
//! the immutable flag alone holds only on ext4 and only for writes (xfs and
//! btrfs check it at open; discard and write-zeroes become `fallocate`,
//! which passes it everywhere). The fence therefore works in the block layer.
//!
//! **Gated devices** (every volume device a node attaches, see
//! `kernel::loop_gate`): the node's device is stacked on a gate, a loop
//! device over the image. The fence shuts the gate (capacity 0, in place),
//! drains the device above with a barrier, and moves the gate's empty
//! window into the trailer (`shut_gate`). The guarantee: once the fence
//! returned Ok, every write, discard and write-zeroes the node's device
//! reports done is in `[0, data_bytes)` as the next generation copies it,
//! however long the kernel held the request before the loop driver ran it
//! (blk-throttle, a plug, a preempted submitter): the gate's block-device
//! file refuses every request run after the shut (`blkdev_write_iter`,
//! `blkdev_fallocate` check the capacity when they run), and the barrier
//! waits for the ones run before it. No timed wait is part of it.
//!
//! **Plain devices** (attached straight onto the image: by an older driver,
//! or by hand) are remapped as before gates: every image carries a
//! *trailer* of [`TRAILER_BYTES`] beyond its data, and the fence shrinks
//! each such device to one sector in place, so every new request of more
//! than one sector fails the block layer's end check, waits [`SETTLE`] for
//! the requests already past that check, and moves the window into the
//! trailer. That is a bound, not a proof: a request held longer lands in the
//! trailer and is reported done ([`late_write_at`] finds it).
//!
//! For both: `FS_IMMUTABLE_FL` is set as a second layer on a whole
//! generation (refuses new writable opens on every filesystem, and writes on
//! ext4), best effort; the generation is fsynced so what was written before
//! the fence is durable. Only when every holder is seen fenced does the
//! fence count as made. [`probe`] proves the gated mechanism on the state
//! dir's own filesystem at start.

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::kernel::files;
use crate::kernel::loop_device::{self, AttachOptions, HeldDevice, LoopInfo};
use crate::kernel::loop_gate;
use crate::locks::BackingLock;

/// Bytes every image keeps beyond its data for the fence window.
pub const TRAILER_BYTES: u64 = 1 << 20;
/// Size of the window a fenced device is left with: one sector, so any
/// request of a filesystem block (or a 4 KiB record) is past its end. It
/// must not be 0: capacity 0 turns the block layer's end check off.
pub const WINDOW_BYTES: u64 = 512;
/// How often the holder scan repeats when a new holder shows up meanwhile.
const SCAN_PASSES: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("the fence is not available on this driver: {0}")]
    Unsupported(String),
    #[error("could not fence {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("could not remap loop device {device} holding {path}: {message}")]
    Remap {
        path: PathBuf,
        device: PathBuf,
        message: String,
    },
    #[error("could not list loop devices holding {path}: {message}")]
    Holders { path: PathBuf, message: String },
    #[error("holders of {path} kept changing during the fence; not fenced")]
    Unstable { path: PathBuf },
}

#[derive(Debug, Clone)]
pub struct FenceReport {
    /// Loop devices that held the generation and now show only the window.
    pub fenced: Vec<LoopInfo>,
    /// Whether the immutable flag is set as well (second layer).
    pub immutable: bool,
    pub elapsed: Duration,
    /// Time spent in the settle: only devices attached straight onto the
    /// image (no gate) have one; zero when every holder is gated.
    pub settled: Duration,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> FenceError + '_ {
    move |source| FenceError::Io {
        path: path.into(),
        source,
    }
}

/// Loop devices whose backing file is this inode (found by device and
/// inode number, never by path).
pub fn holders(path: &Path) -> Result<Vec<LoopInfo>, FenceError> {
    let (dev, ino) = files::dev_ino(path).map_err(io_err(path))?;
    loop_device::find_by_inode(dev, ino).map_err(|e| FenceError::Holders {
        path: path.into(),
        message: e.to_string(),
    })
}

/// Whether a device already shows only a fence window (no byte of the data).
pub fn is_fenced_device(lo: &LoopInfo, data_bytes: u64) -> bool {
    lo.offset >= data_bytes && lo.size_limit > 0 && lo.size_bytes <= WINDOW_BYTES
}

/// Makes sure the file has its trailer (images made before the trailer
/// existed get it here: a sparse extension, no data moves). An immutable
/// file is thawed for the extension and frozen again.
pub fn ensure_trailer(path: &Path, end_of_data: u64) -> Result<(), FenceError> {
    let want = end_of_data + TRAILER_BYTES;
    let len = std::fs::metadata(path).map_err(io_err(path))?.len();
    if len >= want {
        return Ok(());
    }
    let frozen = files::is_immutable(path).unwrap_or(false);
    if frozen {
        files::set_immutable(path, false).map_err(io_err(path))?;
    }
    let grown = files::grow(path, want).map_err(io_err(path));
    if frozen {
        files::set_immutable(path, true).map_err(io_err(path))?;
    }
    grown?;
    tracing::info!(path = %path.display(), end_of_data, "fence trailer added to the image");
    Ok(())
}

/// The marker a whole-generation fence leaves next to the image, made
/// before any holder is remapped and checked by every node attach under the
/// shared lock: a stage that read the records just before the fence can no
/// longer attach the generation after the fence's scan, with or without the
/// immutable flag.
pub fn marker_path(image: &Path) -> PathBuf {
    let mut name = image.file_name().unwrap_or_default().to_os_string();
    name.push(".fenced");
    image.with_file_name(name)
}

/// The whole-generation fence: see the module docs. `data_bytes` is the
/// generation's data size; nothing in `[0, data_bytes)` changes after this
/// returns Ok. `settle` is how long each holder stays shrunk in place before
/// it moves ([`SETTLE`] unless the controller's `--fence-settle` says
/// otherwise; zero is one barrier, for a device no write was issued on yet, or
/// to measure what the settle buys).
pub fn freeze(path: &Path, data_bytes: u64, settle: Duration) -> Result<FenceReport, FenceError> {
    fence(path, data_bytes, true, &|_| true, settle)
}

/// Fences only the holders `pick` selects (say, a node with no right to a
/// generation another node legitimately writes), settling as [`freeze`]
/// does. No immutable flag: the others keep writing.
pub fn fence_devices(
    path: &Path,
    data_bytes: u64,
    pick: &dyn Fn(&LoopInfo) -> bool,
    settle: Duration,
) -> Result<FenceReport, FenceError> {
    fence(path, data_bytes, false, pick, settle)
}

fn fence(
    path: &Path,
    data_bytes: u64,
    immutable: bool,
    pick: &dyn Fn(&LoopInfo) -> bool,
    settle: Duration,
) -> Result<FenceReport, FenceError> {
    let start = Instant::now();
    // The lock orders this fence with node-side attaches, but a node that
    // hangs holding it must not hold up the fence: past the bound the fence
    // goes on. The marker below is then made before the holder scan, and an
    // attach checks the marker again after its device exists (see
    // `Node::find_or_attach`), so it either is seen here or refuses itself.
    let _lock = match BackingLock::on_path(path, true, crate::locks::NODE_LOCK_WAIT) {
        Ok(l) => Some(l),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            tracing::warn!(path = %path.display(), wait = ?crate::locks::NODE_LOCK_WAIT, "a node process holds the image lock (stuck in an attach?): fencing without it");
            None
        }
        Err(e) => return Err(io_err(path)(e)),
    };
    if immutable {
        let marker = marker_path(path);
        std::fs::File::create(&marker)
            .and_then(|f| f.sync_all())
            .and_then(|_| files::fsync_parent(&marker))
            .map_err(io_err(path))?;
    }
    // After the marker: a retried fence of an image that lacks its trailer
    // thaws the immutable flag for a moment to extend it, and a writable
    // open in that moment would have passed the flag but not the marker.
    ensure_trailer(path, data_bytes)?;
    // Second layer: from here on no new writable open of the image succeeds
    // where the flag can be set. New holders are kept out by the marker (an
    // attach checks it under the shared lock this fence holds exclusively).
    let mut flagged = false;
    if immutable {
        match files::set_immutable(path, true) {
            Ok(()) => flagged = true,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "immutable flag not set (second layer only; the remap is the fence)")
            }
        }
    }
    let mut fenced: Vec<LoopInfo> = Vec::new();
    let mut settled = Duration::ZERO;
    let mut stable = false;
    for _ in 0..SCAN_PASSES {
        let found = holders(path)?;
        let (gated, plain) = split_by_gate(&found, pick);
        // The window starts past every byte any plain holder shows as data.
        let end = plain
            .iter()
            .filter(|l| !is_fenced_device(l, data_bytes))
            .map(|l| l.offset + l.size_bytes)
            .fold(data_bytes, u64::max);
        if end > data_bytes {
            ensure_trailer(path, end)?;
        }
        let mut new = 0;
        let mut results: Vec<(PathBuf, Result<LoopInfo, loop_device::LoopError>)> = Vec::new();
        for group in &gated {
            // A gate shut and moved was drained before it moved: nothing to do.
            if group.iter().all(|l| is_fenced_device(l, data_bytes)) {
                results.extend(group.iter().map(|l| (l.device.clone(), Ok(l.clone()))));
                continue;
            }
            new += 1;
            results.extend(shut_gate(group, data_bytes, end));
        }
        let (done, new_plain, slept) = remap_pass(&plain, data_bytes, end, settle);
        new += new_plain;
        settled += slept;
        results.extend(plain.iter().map(|l| l.device.clone()).zip(done));
        for (device, result) in results {
            let after = match result {
                Ok(after) => after,
                // Released meanwhile: nothing holds the data through it any more.
                Err(loop_device::LoopError::NotBound(_)) => continue,
                Err(e) => {
                    return Err(FenceError::Remap {
                        path: path.into(),
                        device,
                        message: e.to_string(),
                    })
                }
            };
            if !is_fenced_device(&after, data_bytes) {
                return Err(FenceError::Remap {
                    path: path.into(),
                    device,
                    message: format!(
                        "the kernel reports offset {} and {} bytes after the remap",
                        after.offset, after.size_bytes
                    ),
                });
            }
            if !fenced.iter().any(|f| f.device == after.device) {
                fenced.push(after);
            }
        }
        if new == 0 {
            stable = true;
            break;
        }
    }
    if !stable {
        return Err(FenceError::Unstable { path: path.into() });
    }
    // fsync is allowed on an immutable file: it changes no data, it only makes
    // the pre-fence writes durable.
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io_err(path))?;
    let elapsed = start.elapsed();
    tracing::info!(path = %path.display(), holders = fenced.len(), immutable = flagged, elapsed_us = elapsed.as_micros() as u64, "write fence made");
    Ok(FenceReport {
        fenced,
        immutable: flagged,
        elapsed,
        settled,
    })
}

/// Makes every unfenced holder of `path` show exactly `[0, data_bytes)`
/// (after a growth of the data, or a device attached before windows
/// existed); devices in a fence window are left alone. Only the controller
/// remaps devices, so a node that hangs can never undo a fence with a stale
/// widen; the image lock keeps a node's concurrent detach from losing its
/// autoclear flag. Returns the devices widened.
pub fn widen_holders(path: &Path, data_bytes: u64) -> Result<Vec<LoopInfo>, FenceError> {
    let _lock =
        BackingLock::on_path(path, true, crate::locks::NODE_LOCK_WAIT).map_err(io_err(path))?;
    let mut widened = Vec::new();
    for lo in holders(path)? {
        // A device shrunk in place is a fence under way (or one a crash
        // interrupted): never widened back.
        let shrunk = lo.size_limit > 0 && lo.size_limit <= WINDOW_BYTES;
        let shows_data = lo.offset == 0 && !shrunk && !is_fenced_device(&lo, data_bytes);
        if !shows_data || (lo.size_limit == data_bytes && lo.size_bytes == data_bytes) {
            continue;
        }
        match widen(&lo, data_bytes) {
            Ok(after) => widened.push(after),
            Err(loop_device::LoopError::NotBound(_)) => {}
            Err(e) => {
                return Err(FenceError::Remap {
                    path: path.into(),
                    device: lo.device.clone(),
                    message: e.to_string(),
                })
            }
        }
    }
    Ok(widened)
}

/// Shows `[0, data_bytes)` on one holder: a plain device is remapped; for a
/// device on a gate, the gate is, and the device above re-reads its size.
fn widen(lo: &LoopInfo, data_bytes: u64) -> Result<LoopInfo, loop_device::LoopError> {
    let Some(gate) = &lo.gate else {
        return loop_device::remap(&lo.device, 0, data_bytes);
    };
    let now = loop_device::status(gate)?;
    if now.size_limit != data_bytes || now.size_bytes != data_bytes {
        loop_device::remap(gate, 0, data_bytes)?;
    }
    if lo.device != *gate {
        loop_device::set_capacity(&lo.device)?;
    }
    loop_device::status(&lo.device)
}

/// The holders `pick` selects: gated ones grouped by gate (a gate is
/// selected with every device on it when `pick` selects any of them), and
/// plain ones (attached straight to the image: by an older driver, or by
/// hand).
fn split_by_gate(
    found: &[LoopInfo],
    pick: &dyn Fn(&LoopInfo) -> bool,
) -> (Vec<Vec<LoopInfo>>, Vec<LoopInfo>) {
    let mut groups: Vec<Vec<LoopInfo>> = Vec::new();
    let mut plain = Vec::new();
    for lo in found {
        match &lo.gate {
            Some(g) => match groups
                .iter_mut()
                .find(|grp| grp[0].gate.as_ref() == Some(g))
            {
                Some(grp) => grp.push(lo.clone()),
                None => groups.push(vec![lo.clone()]),
            },
            None if pick(lo) => plain.push(lo.clone()),
            None => {}
        }
    }
    groups.retain(|grp| grp.iter().any(|l| pick(l)));
    (groups, plain)
}

/// The fence of one gate and the devices stacked on it (see
/// `kernel::loop_gate` for why this is a proof and not a bound):
/// 1. each device above is made to use direct I/O if someone switched it
///    off (its requests then complete only once the gate completed them);
/// 2. the gate is shut in place (capacity 0, offset unchanged): every
///    request a device above runs from now on fails in the gate's
///    block-device file, whenever it passed its own end check;
/// 3. a barrier on each device above: the requests that ran before the shut
///    complete, into the data, before this returns;
/// 4. the gate's empty window moves past the data, so a request sent to the
///    gate itself (not through a device above) lands in the trailer, where
///    [`late_write_at`] finds it.
///
/// No timed wait. Returns each device's state after, by device.
fn shut_gate(
    group: &[LoopInfo],
    data_bytes: u64,
    end: u64,
) -> Vec<(PathBuf, Result<LoopInfo, loop_device::LoopError>)> {
    let gate_path = group[0].gate.clone().expect("grouped by gate");
    let backing = (group[0].backing_dev, group[0].backing_ino);
    let outcome = (|| -> Result<Vec<(PathBuf, Result<LoopInfo, loop_device::LoopError>)>, loop_device::LoopError> {
        let gate = HeldDevice::open(&gate_path, backing)?;
        // The devices above, from their own status (not from the listing,
        // which sees them through the gate): a device above that is skipped
        // would not be drained. Only one unbound since counts as released.
        let held: Vec<HeldDevice> = loop_device::stacked_on(&gate_path)?
            .iter()
            .filter_map(|t| match HeldDevice::open(t, backing) {
                Err(loop_device::LoopError::NotBound(_)) => None,
                other => Some(other),
            })
            .collect::<Result<_, _>>()?;
        for top in &held {
            if !top.raw_status()?.direct_io {
                loop_device::set_direct_io_raw(top.path(), true)?;
                if !top.raw_status()?.direct_io {
                    return Err(loop_device::LoopError::NotDirect {
                        device: top.path().to_path_buf(),
                        gate: gate_path.clone(),
                    });
                }
                tracing::warn!(device = %top.path().display(), "a device on a gate was using buffered I/O: switched back to direct I/O before the fence");
            }
        }
        let now = gate.status()?;
        if now.size_limit != loop_gate::SHUT_LIMIT {
            gate.remap(now.offset, loop_gate::SHUT_LIMIT)?;
        }
        for top in &held {
            top.barrier()?;
        }
        if now.offset < data_bytes {
            gate.remap(end, loop_gate::SHUT_LIMIT)?;
        }
        let mut out: Vec<_> = held.iter().map(|t| (t.path().to_path_buf(), t.status())).collect();
        if held.is_empty() {
            out.push((gate_path.clone(), gate.status()));
        }
        Ok(out)
    })();
    outcome.unwrap_or_else(|e| vec![(gate_path, Err(e))])
}

/// How long plain holders (no gate) stay shrunk in place before their
/// windows move into the trailer; gated holders need none. A request that passed the block layer's end-of-device check with
/// the old size runs with whatever window the device has when it gets into
/// the queue: it may be waiting for the queue a remap froze, or for a CPU
/// (a pod at its CPU limit waits for the next CFS period, 100 ms in
/// Kubernetes). If it reaches the queue during the settle it lands in the
/// data, where it was meant to, before the fence returns. Later than that it
/// lands in the trailer and still reports success: a write acknowledged to
/// node A that node B never sees (tests/tests/fence_inflight.rs shows both).
/// Nothing bounds how long a task can be kept off a CPU, so this is a bound
/// chosen, not a proof; [`late_write_at`] finds what outlasted it.
/// The controller's `--fence-settle` sets it; this is its default.
pub const SETTLE: Duration = Duration::from_millis(250);
/// Barriers during the settle: each drains the late requests that got into
/// the queue since the last one (the move's own freeze drains the rest).
const SETTLE_BARRIERS: u32 = 5;

/// One pass over the holders: the ones already fenced get a barrier, the
/// others are shrunk in place, settled for `settle` and moved into the
/// trailer at `end` (see [`SETTLE`]). Each new holder is held open from its
/// shrink to its move (`HeldDevice`), so a device released meanwhile cannot
/// come back as another volume's and be remapped in its place. Returns each
/// holder's result, in order, how many were new, and the time settled
/// (none when no holder was shrunk).
fn remap_pass(
    found: &[LoopInfo],
    data_bytes: u64,
    end: u64,
    settle: Duration,
) -> (
    Vec<Result<LoopInfo, loop_device::LoopError>>,
    usize,
    Duration,
) {
    let mut held: Vec<Option<HeldDevice>> = Vec::with_capacity(found.len());
    let mut results = Vec::with_capacity(found.len());
    let mut new = 0;
    for lo in found {
        if is_fenced_device(lo, data_bytes) {
            // Already fenced (a retry): the remap is a barrier, on the device
            // only while it still backs this image.
            results.push(
                HeldDevice::open(&lo.device, (lo.backing_dev, lo.backing_ino))
                    .and_then(|h| h.remap(lo.offset, lo.size_limit)),
            );
            held.push(None);
            continue;
        }
        new += 1;
        match HeldDevice::open(&lo.device, (lo.backing_dev, lo.backing_ino)) {
            Ok(h) => {
                results.push(shrink_in_place(&h));
                held.push(Some(h));
            }
            Err(e) => {
                results.push(Err(e));
                held.push(None);
            }
        }
    }
    let shrunk: Vec<usize> = (0..found.len())
        .filter(|&i| held[i].is_some() && results[i].is_ok())
        .collect();
    let device = |i: usize| held[i].as_ref().expect("only held devices are in `shrunk`");
    // A zero settle is the fence as it was before the settle: one barrier.
    let (barriers, pause) = if shrunk.is_empty() {
        (0, Duration::ZERO)
    } else if settle.is_zero() {
        (1, Duration::ZERO)
    } else {
        (SETTLE_BARRIERS, settle / SETTLE_BARRIERS)
    };
    let settle_start = Instant::now();
    for _ in 0..barriers {
        std::thread::sleep(pause);
        for &i in &shrunk {
            if let Ok(now) = &results[i] {
                results[i] = device(i).remap(now.offset, now.size_limit);
            }
        }
    }
    for &i in &shrunk {
        if results[i].is_ok() {
            results[i] = device(i).remap(end, WINDOW_BYTES);
        }
    }
    let settled = if pause.is_zero() {
        Duration::ZERO
    } else {
        settle_start.elapsed()
    };
    (results, new, settled)
}

/// Shrinks a device to one sector at its current offset: from here the end
/// check refuses every new request of more than a sector, and the requests
/// already past it land in the data if they reach the queue before the
/// window moves (see [`SETTLE`]).
fn shrink_in_place(device: &HeldDevice) -> Result<LoopInfo, loop_device::LoopError> {
    let now = device.status()?;
    device.remap(now.offset, WINDOW_BYTES)
}

/// Where something was written into a fenced image past its data and its
/// window: the first offset with data from the 4 KiB block (the granularity
/// filesystems report data in) after the one holding the window, None when
/// there is none. The trailer is made sparse and nothing of the driver writes
/// it, so data there is a write that passed the end check with the data's
/// size and reached the device only after its window moved, later than
/// [`SETTLE`]: reported done to node A, and not in the data. Not seen: a
/// one-sector write at sector 0 (it lands in the window by design), and a
/// late discard or write-zeroes (they leave holes or unwritten extents, which
/// SEEK_DATA skips). A holder that showed more than the data (a device from
/// before the trailer) moves the window further in, and its one-sector writes
/// are then reported too.
/// An image that is gone holds nothing (None).
pub fn late_write_at(path: &Path, data_bytes: u64) -> std::io::Result<Option<u64>> {
    let from = (data_bytes + WINDOW_BYTES).next_multiple_of(4096);
    match files::first_data_at_or_after(path, from) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        r => r,
    }
}

/// Lifts the flag so a released, fenced generation can be deleted. Callers
/// must have checked that no loop device holds it any more.
pub fn thaw(path: &Path) -> Result<(), FenceError> {
    files::set_immutable(path, false).map_err(io_err(path))
}

pub fn is_frozen(path: &Path) -> Result<bool, FenceError> {
    files::is_immutable(path).map_err(io_err(path))
}

/// What the start-up probe found.
#[derive(Debug, Clone)]
pub struct ProbeReport {
    pub filesystem: String,
    pub elapsed: Duration,
}

/// Prefix of the probe's loop tags and directories: what a crashed probe
/// left is recognised (and only that is removed) by the next start.
const PROBE_PREFIX: &str = "fcsi-probe";

/// Proves the fence on `dir`'s filesystem: an image with data and trailer
/// on a gated loop device, as nodes attach (gate buffered, then direct
/// I/O; the device above the gate must get direct I/O), fenced, then a
/// write, a discard and a write-zeroes through the device: each runs after
/// the gate was shut, as a request held across the fence would. The data
/// must be byte-identical afterwards and the write must fail. Err says why
/// not.
pub fn probe(dir: &Path) -> Result<ProbeReport, String> {
    let start = Instant::now();
    // Compiled only with the `failpoints` feature: without it is_armed is
    // false anyway, but a debug build would still carry the message (and
    // tests/tests/failpoints.rs looks for failpoint strings in the binary).
    #[cfg(feature = "failpoints")]
    if crate::failpoint::is_armed("fence-probe:fail") {
        return Err("failpoint fence-probe:fail is armed".into());
    }
    let work = dir.join(format!(".{PROBE_PREFIX}-{}", std::process::id()));
    clean_probe_leftovers(dir);
    std::fs::create_dir_all(&work).map_err(|e| format!("creating {}: {e}", work.display()))?;
    let result = (|| -> Result<(), String> {
        for direct in [false, true] {
            probe_once(&work, direct)?;
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&work);
    result?;
    Ok(ProbeReport {
        filesystem: fs_name(dir),
        elapsed: start.elapsed(),
    })
}

fn probe_once(work: &Path, direct: bool) -> Result<(), String> {
    const DATA: u64 = 1 << 20;
    let img = work.join(format!("probe-{}.img", u8::from(direct)));
    files::create_sparse(&img, DATA + TRAILER_BYTES).map_err(|e| format!("probe image: {e}"))?;
    let pattern: Vec<u8> = (0..DATA).map(|i| (i % 251) as u8 | 1).collect();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .and_then(|f| {
            f.write_all_at(&pattern, 0)?;
            f.sync_all()
        })
        .map_err(|e| format!("probe image: {e}"))?;
    let tag = format!("{PROBE_PREFIX}:{}:{}", std::process::id(), u8::from(direct));
    let lo = loop_gate::attach_gated(
        &img,
        &AttachOptions {
            read_only: false,
            direct_io: direct,
            tag,
            size_limit: DATA,
            logical_block_size: 0,
        },
    )
    .map_err(|e| format!("attaching a probe loop device: {e}"))?;
    let outcome = probe_device(&img, &lo.device, DATA, &pattern);
    if let Err(e) = loop_device::detach(&lo.device) {
        tracing::warn!(device = %lo.device.display(), error = %e, "could not detach the probe loop device");
    }
    let _ = files::set_immutable(&img, false);
    outcome
}

fn probe_device(img: &Path, dev: &Path, data: u64, pattern: &[u8]) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .map_err(|e| format!("opening {}: {e}", dev.display()))?;
    let layout = std::alloc::Layout::from_size_align(4096, 4096).expect("layout");
    // SAFETY: non-zero, aligned layout; freed below.
    let raw = unsafe { std::alloc::alloc_zeroed(layout) };
    let buf = unsafe { std::slice::from_raw_parts_mut(raw, 4096) };
    // Positive control: before the fence, a write reaches the data.
    let before = f
        .write_at(buf, 8192)
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("write before the fence failed: {e}"));
    let read_back = std::fs::read(img).map_err(|e| e.to_string())?;
    let control = read_back[8192..8192 + 4096].iter().all(|b| *b == 0);
    let mut expected = pattern.to_vec();
    expected[8192..8192 + 4096].fill(0);
    let outcome = (|| {
        before?;
        if !control {
            return Err("a write before the fence did not reach the image".into());
        }
        freeze(img, data, SETTLE).map_err(|e| e.to_string())?;
        buf.fill(0xEE);
        // A whole block at 0 (a sector of it may land in the window, never
        // in the data) and a block further in must both fail.
        let write = f
            .write_all_at(buf, 0)
            .and_then(|_| f.write_all_at(buf, 8192))
            .and_then(|_| f.sync_all());
        let range = [0u64, data.min(64 << 10)];
        // SAFETY: ioctls on an fd we own with a valid 16-byte range.
        let discard = unsafe { libc::ioctl(f.as_raw_fd(), BLKDISCARD, range.as_ptr()) };
        let zero = unsafe { libc::ioctl(f.as_raw_fd(), BLKZEROOUT, range.as_ptr()) };
        let after = std::fs::read(img).map_err(|e| e.to_string())?;
        if after[..data as usize] != expected[..] {
            return Err(format!(
                "data changed after the fence (write {}, discard {discard}, write-zeroes {zero})",
                if write.is_ok() { "succeeded" } else { "failed" }
            ));
        }
        if write.is_ok() {
            return Err("a write through the fenced device succeeded".into());
        }
        Ok(())
    })();
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(raw, layout) };
    outcome
}

// _IO(0x12, 119) and _IO(0x12, 127) from include/uapi/linux/fs.h.
const BLKDISCARD: libc::c_ulong = 0x1277;
const BLKZEROOUT: libc::c_ulong = 0x127f;

/// Removes what a probe that crashed left: its loop devices (recognised by
/// tag and by a backing file under `dir`) and its directories.
fn clean_probe_leftovers(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let ours: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!(".{PROBE_PREFIX}-"))
        })
        .map(|e| e.path())
        .collect();
    if ours.is_empty() {
        return;
    }
    let inodes: Vec<(u64, u64)> = ours
        .iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
        .filter_map(|e| files::dev_ino(&e.path()).ok())
        .collect();
    for lo in loop_device::list().unwrap_or_default() {
        let tag = lo.tag.trim_start_matches(loop_device::GATE_TAG_PREFIX);
        if tag.starts_with(PROBE_PREFIX) && inodes.contains(&(lo.backing_dev, lo.backing_ino)) {
            let _ = loop_device::detach(&lo.device);
        }
    }
    for d in ours {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let _ = files::set_immutable(&e.path(), false);
        }
        match std::fs::remove_dir_all(&d) {
            Ok(()) => {
                tracing::info!(dir = %d.display(), "removed a crashed fence probe's leftovers")
            }
            Err(e) => {
                tracing::warn!(dir = %d.display(), error = %e, "cannot remove a fence probe's leftovers")
            }
        }
    }
}

/// The filesystem type of `dir` as the kernel names it (for logs).
pub fn fs_name(dir: &Path) -> String {
    match nix::sys::statfs::statfs(dir) {
        Ok(s) => match s.filesystem_type().0 as u64 {
            0xEF53 => "ext4".into(),
            0x5846_5342 => "xfs".into(),
            0x9123_683E => "btrfs".into(),
            0x0102_1994 => "tmpfs".into(),
            0x794C_7630 => "overlayfs".into(),
            other => format!("0x{other:x}"),
        },
        Err(e) => format!("unknown ({e})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `late_write_at` on a real sparse image: nothing in a fresh trailer;
    /// a one-sector write into the window is left alone (by design); a block
    /// written further into the trailer, or past the image's end, is found.
    #[test]
    fn late_writes_are_found_past_the_window() {
        const DATA: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("gen-1.img");
        files::create_sparse(&img, DATA).unwrap();
        ensure_trailer(&img, DATA).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(&[7; 4096], 0).unwrap();
        f.sync_all().unwrap();
        assert_eq!(late_write_at(&img, DATA).unwrap(), None, "a fresh trailer");
        f.write_all_at(&[7; 512], DATA).unwrap();
        f.sync_all().unwrap();
        assert_eq!(late_write_at(&img, DATA).unwrap(), None, "the window");
        f.write_all_at(&[7; 4096], DATA + 64 * 4096).unwrap();
        f.sync_all().unwrap();
        assert_eq!(
            late_write_at(&img, DATA).unwrap(),
            Some(DATA + 64 * 4096),
            "a block in the trailer"
        );
        let past = dir.path().join("gen-2.img");
        files::create_sparse(&past, DATA).unwrap();
        ensure_trailer(&past, DATA).unwrap();
        let g = std::fs::OpenOptions::new().write(true).open(&past).unwrap();
        g.write_all_at(&[7; 4096], DATA + TRAILER_BYTES + 8192)
            .unwrap();
        g.sync_all().unwrap();
        assert_eq!(
            late_write_at(&past, DATA).unwrap(),
            Some(DATA + TRAILER_BYTES + 8192),
            "past the image's end"
        );
    }
}
