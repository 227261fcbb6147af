//! Evidence that the fence held: when the observer sees a volume fenced it copies the
//! fenced generation's data region; later the scenario compares that generation with the
//! copy, so any byte node A's writers got into it after the fence shows up as a difference.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A fenced generation as it was when the observer saw it fenced.
pub(super) struct FencedCopy {
    /// The fenced generation's image.
    pub(super) source: PathBuf,
    /// Its data region, copied.
    pub(super) copy: PathBuf,
    /// Whether the generation carried the immutable flag.
    pub(super) immutable: bool,
}

/// Copies the data region of generation `generation` of volume `handle` into `evidence`.
pub(super) async fn copy_fenced_generation(
    state_dir: &Path,
    evidence: &Path,
    handle: &str,
    generation: u64,
) -> anyhow::Result<std::io::Result<FencedCopy>> {
    let source = state_dir
        .join("volumes")
        .join(handle)
        .join(format!("gen-{generation:06}.img"));
    let copy = evidence.join(format!("{handle}-gen-{generation}.img"));
    let (s2, d2) = (source.clone(), copy.clone());
    let r = tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(d2.parent().unwrap())?;
        let imm = fencecsi_driver::kernel::files::is_immutable(&s2)?;
        // The data region only: the fence trailer behind it may take
        // a racing request by design, and is never volume data.
        let data = std::fs::metadata(&s2)?
            .len()
            .saturating_sub(fencecsi_driver::fence::TRAILER_BYTES);
        fencecsi_driver::kernel::files::clone_file(&s2, &d2, data, data)?;
        Ok::<_, std::io::Error>(imm)
    })
    .await?;
    Ok(r.map(|immutable| FencedCopy {
        source,
        copy,
        immutable,
    }))
}

/// One volume's evidence: its pod, its fenced generation and the copy made
/// when it was seen fenced (either missing when the observer saw no fence).
pub(super) struct Evidence<'a> {
    pub(super) pod: &'a str,
    pub(super) fenced: Option<&'a Path>,
    pub(super) copy: Option<&'a Path>,
}

/// Compares each volume's fenced generation with its copy: bytes that differ, by pod.
/// A volume without a copy, or a comparison that fails, is a failure of the run.
pub(super) async fn compare_fenced(
    vols: &[Evidence<'_>],
    failures: &mut Vec<String>,
) -> anyhow::Result<HashMap<String, u64>> {
    let mut fenced_diff: HashMap<String, u64> = HashMap::new();
    for v in vols {
        match (v.fenced, v.copy) {
            (Some(a), Some(b)) => {
                let (a, b) = (a.to_path_buf(), b.to_path_buf());
                let d = tokio::task::spawn_blocking(move || differing_bytes(&a, &b)).await?;
                match d {
                    Ok(d) => {
                        fenced_diff.insert(v.pod.to_string(), d);
                    }
                    Err(e) => failures.push(format!("comparing fenced generation: {e}")),
                }
            }
            _ => failures.push(format!("{}: no copy of the fenced generation", v.pod)),
        }
    }
    Ok(fenced_diff)
}

/// Bytes that differ over the common length: `b` is a copy of the data region
/// of `a`, and `a` may be longer by its fence trailer, which is never compared.
fn differing_bytes(a: &Path, b: &Path) -> std::io::Result<u64> {
    use std::io::Read;
    let mut fa = std::fs::File::open(a)?;
    let mut fb = std::fs::File::open(b)?;
    // `b` is a copy of `a`'s data region; `a` may be longer by its trailer.
    let (la, lb) = (fa.metadata()?.len(), fb.metadata()?.len());
    let mut diff = 0;
    let mut ba = vec![0u8; 1 << 20];
    let mut bb = vec![0u8; 1 << 20];
    let mut left = la.min(lb);
    while left > 0 {
        let n = left.min(ba.len() as u64) as usize;
        fa.read_exact(&mut ba[..n])?;
        fb.read_exact(&mut bb[..n])?;
        if ba[..n] != bb[..n] {
            diff += ba[..n].iter().zip(&bb[..n]).filter(|(x, y)| x != y).count() as u64;
        }
        left -= n as u64;
    }
    Ok(diff)
}
