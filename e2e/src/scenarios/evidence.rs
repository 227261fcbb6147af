//! Evidence from the shared state directory: the controller's record of a volume
//! (`volumes/<id>/volume.json`), and a copy of a fenced generation's data region, taken as
//! soon as the fence is seen, to prove later that no byte reached it afterwards.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

/// The fence trailer behind each generation's data (driver: `fence::TRAILER_BYTES`); it
/// may take a racing request by design and is never compared.
const TRAILER_BYTES: u64 = 1 << 20;

pub fn volume_record(state_dir: &Path, handle: &str) -> Result<Value> {
    let p = state_dir.join("volumes").join(handle).join("volume.json");
    let s = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    Ok(serde_json::from_str(&s)?)
}

pub fn generation_path(state_dir: &Path, handle: &str, generation: u64) -> PathBuf {
    state_dir
        .join("volumes")
        .join(handle)
        .join(format!("gen-{generation:06}.img"))
}

/// When generation `g` of the record was fenced (unix nanos), if it was.
pub fn fenced_at(record: &Value, g: u64) -> Option<i64> {
    record["generations"][g.to_string()]["fenced_at"].as_i64()
}

pub fn current_generation(record: &Value) -> Option<u64> {
    record["current_generation"].as_u64()
}

/// The nodes the record says were fenced from some generation and not yet released.
pub fn fenced_from(record: &Value) -> Vec<String> {
    record["fenced_from"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// Copies the data region of `gen` to `dst`, and keeps `gen` open: the comparison after
/// the failover then reads this very inode, which the controller's garbage collection may
/// already have unlinked (superseded, and released by its node once back).
pub fn open_and_copy_data_region(gen: &Path, dst: &Path) -> Result<std::fs::File> {
    let src = std::fs::File::open(gen)?;
    let len = src.metadata()?.len().saturating_sub(TRAILER_BYTES);
    let mut out = std::fs::File::create(dst)?;
    std::io::copy(&mut (&src).take(len), &mut out)?;
    Ok(src)
}

/// Bytes of `gen`'s data region that differ from the copy `copy`.
pub fn differing_bytes(gen: &std::fs::File, copy: &Path) -> Result<u64> {
    use std::os::unix::fs::FileExt;
    let b = std::fs::File::open(copy)?;
    let mut left = b.metadata()?.len().min(gen.metadata()?.len());
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let (mut diff, mut at) = (0u64, 0u64);
    while left > 0 {
        let n = left.min(ba.len() as u64) as usize;
        gen.read_exact_at(&mut ba[..n], at)?;
        b.read_exact_at(&mut bb[..n], at)?;
        diff += ba[..n].iter().zip(&bb[..n]).filter(|(x, y)| x != y).count() as u64;
        left -= n as u64;
        at += n as u64;
    }
    Ok(diff)
}
