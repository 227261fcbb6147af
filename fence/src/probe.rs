//! The start-up probe: the gated fence proved on the state dir's own
//! filesystem before the driver offers it.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::generation::freeze;
use crate::kernel::block_range::RangeRequest;
use crate::kernel::files;
use crate::kernel::loop_device::{self, AttachOptions};
use crate::kernel::loop_gate;
use crate::plain::SETTLE;
use crate::window::TRAILER_BYTES;

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
    if fencecsi_failpoint::is_armed("fence-probe:fail") {
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
        let len = data.min(64 << 10);
        let discard = RangeRequest::Discard.send(&f, 0, len);
        let zero = RangeRequest::WriteZeroes.send(&f, 0, len);
        let after = std::fs::read(img).map_err(|e| e.to_string())?;
        if after[..data as usize] != expected[..] {
            return Err(format!(
                "data changed after the fence (write {}, discard {}, write-zeroes {})",
                outcome(&write),
                outcome(&discard),
                outcome(&zero)
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

/// What a request through the fenced device got, for the probe's message.
fn outcome(r: &std::io::Result<()>) -> String {
    match r {
        Ok(()) => "succeeded".into(),
        Err(e) => format!("failed ({e})"),
    }
}

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
