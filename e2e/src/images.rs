//! Image archives (docker-archive tars): which references each carries, and importing
//! them into a node's containerd. No registry is reachable, so every image a pod names,
//! the pause image too, is imported into every node before anything is applied.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::process::run;

/// One archive and the references (`RepoTags`) in its manifest.json.
#[derive(Debug, Clone)]
pub struct Archive {
    pub path: PathBuf,
    pub refs: Vec<String>,
}

/// Reads the references of a docker-archive.
pub fn archive_refs(path: &Path) -> Result<Vec<String>> {
    let out = run(Command::new("tar")
        .arg("-xOf")
        .arg(path)
        .arg("manifest.json"))
    .with_context(|| format!("reading manifest.json of {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let refs: Vec<String> = v
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|m| m["RepoTags"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t.as_str().map(String::from))
        .collect();
    if refs.is_empty() {
        bail!("{} names no image (RepoTags)", path.display());
    }
    Ok(refs)
}

/// Every `*.tar` in `dir`, with its references.
pub fn archives_in(dir: &Path) -> Result<Vec<Archive>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "tar") {
            let refs = archive_refs(&p)?;
            out.push(Archive { path: p, refs });
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// The references a manifest names as `image:`, as the kubelet sees them.
pub fn images_in_manifests(rendered: &str) -> Vec<String> {
    let mut v: Vec<String> = rendered
        .lines()
        .filter_map(|l| l.trim().strip_prefix("image: "))
        .map(|s| s.trim().trim_matches('"').to_string())
        .collect();
    v.sort();
    v.dedup();
    v
}

/// Docker's normalisation: `fencecsi:0.1.0` is `docker.io/library/fencecsi:0.1.0`.
pub fn normalize(r: &str) -> String {
    let first = r.split('/').next().unwrap_or("");
    let has_registry =
        r.contains('/') && (first.contains('.') || first.contains(':') || first == "localhost");
    if has_registry {
        r.to_string()
    } else if r.contains('/') {
        format!("docker.io/{r}")
    } else {
        format!("docker.io/library/{r}")
    }
}

/// Imports `archive` into the containerd at `socket` inside node `holder`'s mount
/// namespace, into the CRI's namespace (`k8s.io`).
pub fn import(holder: i32, socket: &str, archive: &Path) -> Result<()> {
    run(Command::new("nsenter")
        .arg("-t")
        .arg(holder.to_string())
        .args([
            "-m",
            "-p",
            "--",
            "ctr",
            "--address",
            socket,
            "-n",
            "k8s.io",
            "images",
            "import",
            // What `kind load image-archive` runs on each kind node.
            "--all-platforms",
            "--digests",
        ])
        .arg(archive))?;
    Ok(())
}

/// The fencecsi image archive: `FENCECSI_E2E_FENCECSI_IMAGE` if set (a relative path is
/// the repository's, where the README's commands run, not the e2e crate's, where cargo
/// runs the test), else what `scripts/image.sh` builds from this checkout (run now; fast
/// when its cache is warm).
pub fn fencecsi_image(repo: &Path) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("FENCECSI_E2E_FENCECSI_IMAGE") {
        return Ok(repo.join(p));
    }
    crate::say("building the fencecsi image from this checkout: bash scripts/image.sh");
    let mut cmd = Command::new("bash");
    // The variables cargo sets for a test (CARGO_*, RUSTC*, ...) would make the release
    // build see a different environment than a user's and rebuild from scratch.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().to_string();
        let cargo_set = (k.starts_with("CARGO") && k != "CARGO_HOME" && k != "CARGO_TARGET_DIR")
            || k.starts_with("RUSTC")
            || k.starts_with("__CARGO")
            || k == "RUST_RECURSION_COUNT"
            || k == "OUT_DIR"
            || k == "LD_LIBRARY_PATH";
        if cargo_set {
            cmd.env_remove(&k);
        }
    }
    let out = cmd
        .arg(repo.join("scripts/image.sh"))
        .current_dir(repo)
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running scripts/image.sh")?;
    if !out.status.success() {
        bail!("scripts/image.sh failed ({})", out.status);
    }
    let path = String::from_utf8_lossy(&out.stdout)
        .trim()
        .lines()
        .last()
        .unwrap_or("")
        .to_string();
    if path.is_empty() {
        bail!("scripts/image.sh printed no path");
    }
    Ok(PathBuf::from(path))
}
