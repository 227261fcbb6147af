//! The fence of one generation (see the crate's docs): the image lock, the
//! marker, the immutable flag, the holder scan until it is stable, each
//! holder fenced by its kind (`gate`, `plain`), the fsync. Also what undoes
//! or extends it: widening the holders after a growth, thawing a released
//! generation.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::gate::{shut_gate, split_by_gate};
use crate::kernel::files;
use crate::kernel::loop_device::{self, LoopInfo};
use crate::lock::{BackingLock, NODE_LOCK_WAIT};
use crate::plain::remap_pass;
use crate::window::{is_fenced_device, TRAILER_BYTES, WINDOW_BYTES};

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
/// it moves ([`crate::SETTLE`] unless the controller's `--fence-settle` says
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
    let _lock = lock_image(path)?;
    if immutable {
        make_marker(path)?;
    }
    // After the marker: a retried fence of an image that lacks its trailer
    // thaws the immutable flag for a moment to extend it, and a writable
    // open in that moment would have passed the flag but not the marker.
    ensure_trailer(path, data_bytes)?;
    let flagged = immutable && flag_immutable(path);
    let mut fenced: Vec<LoopInfo> = Vec::new();
    let mut settled = Duration::ZERO;
    let mut stable = false;
    for _ in 0..SCAN_PASSES {
        let pass = fence_pass(path, data_bytes, pick, settle)?;
        settled += pass.settled;
        for (device, result) in pass.results {
            if let Some(after) = checked_fenced(path, data_bytes, device, result)? {
                if !fenced.iter().any(|f| f.device == after.device) {
                    fenced.push(after);
                }
            }
        }
        if pass.new == 0 {
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

/// The image lock, or none past its bound. The lock orders this fence with
/// node-side attaches, but a node that hangs holding it must not hold up the
/// fence: past the bound the fence goes on. The marker is then made before
/// the holder scan, and an attach checks the marker again after its device
/// exists (see `Node::find_or_attach`), so it either is seen here or refuses
/// itself.
fn lock_image(path: &Path) -> Result<Option<BackingLock>, FenceError> {
    match BackingLock::on_path(path, true, NODE_LOCK_WAIT) {
        Ok(l) => Ok(Some(l)),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            tracing::warn!(path = %path.display(), wait = ?NODE_LOCK_WAIT, "a node process holds the image lock (stuck in an attach?): fencing without it");
            Ok(None)
        }
        Err(e) => Err(io_err(path)(e)),
    }
}

/// The whole-generation marker ([`marker_path`]), durable before any holder
/// is touched.
fn make_marker(path: &Path) -> Result<(), FenceError> {
    let marker = marker_path(path);
    std::fs::File::create(&marker)
        .and_then(|f| f.sync_all())
        .and_then(|_| files::fsync_parent(&marker))
        .map_err(io_err(path))
}

/// Second layer: from here on no new writable open of the image succeeds
/// where the flag can be set. New holders are kept out by the marker (an
/// attach checks it under the shared lock the fence holds exclusively).
/// Whether the flag is set.
fn flag_immutable(path: &Path) -> bool {
    match files::set_immutable(path, true) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "immutable flag not set (second layer only; the remap is the fence)");
            false
        }
    }
}

/// One scan of the holders, each fenced by its kind.
struct Pass {
    /// Each holder's state after, by device.
    results: Vec<(PathBuf, Result<LoopInfo, loop_device::LoopError>)>,
    /// Holders (gates, or plain devices) that were not fenced yet.
    new: usize,
    settled: Duration,
}

fn fence_pass(
    path: &Path,
    data_bytes: u64,
    pick: &dyn Fn(&LoopInfo) -> bool,
    settle: Duration,
) -> Result<Pass, FenceError> {
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
    let mut results = Vec::new();
    for group in &gated {
        // A gate shut and moved was drained before it moved: nothing to do.
        if group.iter().all(|l| is_fenced_device(l, data_bytes)) {
            results.extend(group.iter().map(|l| (l.device.clone(), Ok(l.clone()))));
            continue;
        }
        new += 1;
        results.extend(shut_gate(group, data_bytes, end));
    }
    let (done, new_plain, settled) = remap_pass(&plain, data_bytes, end, settle);
    results.extend(plain.iter().map(|l| l.device.clone()).zip(done));
    Ok(Pass {
        results,
        new: new + new_plain,
        settled,
    })
}

/// A holder's state after its fence, checked as the kernel reports it:
/// None when it was released meanwhile (nothing holds the data through it
/// any more), an error when it is not fenced.
fn checked_fenced(
    path: &Path,
    data_bytes: u64,
    device: PathBuf,
    result: Result<LoopInfo, loop_device::LoopError>,
) -> Result<Option<LoopInfo>, FenceError> {
    let after = match result {
        Ok(after) => after,
        Err(loop_device::LoopError::NotBound(_)) => return Ok(None),
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
    Ok(Some(after))
}

/// Makes every unfenced holder of `path` show exactly `[0, data_bytes)`
/// (after a growth of the data, or a device attached before windows
/// existed); devices in a fence window are left alone. Only the controller
/// remaps devices, so a node that hangs can never undo a fence with a stale
/// widen; the image lock keeps a node's concurrent detach from losing its
/// autoclear flag. Returns the devices widened.
pub fn widen_holders(path: &Path, data_bytes: u64) -> Result<Vec<LoopInfo>, FenceError> {
    let _lock = BackingLock::on_path(path, true, NODE_LOCK_WAIT).map_err(io_err(path))?;
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

/// Lifts the flag so a released, fenced generation can be deleted. Callers
/// must have checked that no loop device holds it any more.
pub fn thaw(path: &Path) -> Result<(), FenceError> {
    files::set_immutable(path, false).map_err(io_err(path))
}

pub fn is_frozen(path: &Path) -> Result<bool, FenceError> {
    files::is_immutable(path).map_err(io_err(path))
}
