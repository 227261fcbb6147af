//! Evidence that the fence held: when the observer sees a volume fenced it copies the
//! fenced generation's data region; later the scenario compares that generation with the
//! copy, so any byte node A's writers got into it after the fence shows up as a difference.

use std::collections::HashMap;
use std::path::Path;

use super::observer::{Shared, VolObs};
use crate::Progress;

/// Copies the fenced generation of `v` into `evidence` and notes the copy (and whether the
/// generation is immutable) in `v`; a failed copy is a problem of the run, not of the poll.
pub(super) async fn copy_fenced_generation(
    state_dir: &Path,
    evidence: &Path,
    v: &mut VolObs,
    shared: &Shared,
    progress: &Progress,
) -> anyhow::Result<()> {
    // Evidence: the fenced generation as it is right now.
    let src = state_dir
        .join("volumes")
        .join(&v.handle)
        .join(format!("gen-{:06}.img", v.old_generation));
    let dst = evidence.join(format!("{}-gen-{}.img", v.handle, v.old_generation));
    let (s2, d2) = (src.clone(), dst.clone());
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
    match r {
        Ok(imm) => {
            v.fenced_immutable = imm;
            v.fenced_copy = Some(dst);
            v.fenced_path = Some(src.clone());
            progress.say(format!(
                "observer: {} fenced: generation {} ({}) immutable={imm}, copied for comparison",
                v.pod,
                v.old_generation,
                src.display()
            ));
        }
        Err(e) => shared.lock().unwrap().problems.push(format!(
            "copying the fenced generation {}: {e}",
            src.display()
        )),
    }
    Ok(())
}

/// Compares each volume's fenced generation with its copy: bytes that differ, by pod.
/// A volume without a copy, or a comparison that fails, is a failure of the run.
pub(super) async fn compare_fenced(
    vols: &[VolObs],
    failures: &mut Vec<String>,
) -> anyhow::Result<HashMap<String, u64>> {
    let mut fenced_diff: HashMap<String, u64> = HashMap::new();
    for v in vols {
        match (&v.fenced_path, &v.fenced_copy) {
            (Some(a), Some(b)) => {
                let (a, b) = (a.clone(), b.clone());
                let d = tokio::task::spawn_blocking(move || differing_bytes(&a, &b)).await?;
                match d {
                    Ok(d) => {
                        fenced_diff.insert(v.pod.clone(), d);
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
