//! cgroup v1: one cgroup per node, made by the suite in every hierarchy, holding the
//! node's every process (its namespace holder, containerd with its shims and containers,
//! the kubelet). The kubelet's `cgroupRoot` is that cgroup, so kubelets do not share a
//! tree. Killing a node (power-off) and tearing down kill what is in it; the freezer
//! hierarchy pauses it whole (a hang).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const ROOT: &str = "/sys/fs/cgroup";

/// The mount points of every cgroup hierarchy (v1 controllers, named ones and the
/// hybrid unified one), from /proc/self/mountinfo.
pub fn hierarchies() -> Result<Vec<PathBuf>> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mut out = Vec::new();
    for line in info.lines() {
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let fstype = post.split_whitespace().next().unwrap_or("");
        if fstype != "cgroup" && fstype != "cgroup2" {
            continue;
        }
        if let Some(mp) = pre.split_whitespace().nth(4) {
            if mp.starts_with(ROOT) {
                out.push(PathBuf::from(mp));
            }
        }
    }
    if out.is_empty() {
        bail!("no cgroup hierarchy mounted under {ROOT}");
    }
    Ok(out)
}

/// Creates `rel` (e.g. `fencecsi-e2e-123/node-1`) in every hierarchy, each level's
/// cpuset copied down from its parent (a v1 cpuset cgroup is unusable until set).
pub fn create(rel: &str) -> Result<()> {
    for h in hierarchies()? {
        let mut cur = h.clone();
        for part in rel.split('/') {
            let parent = cur.clone();
            cur = cur.join(part);
            if !cur.exists() {
                std::fs::create_dir(&cur).with_context(|| format!("mkdir {}", cur.display()))?;
            }
            for f in ["cpuset.cpus", "cpuset.mems"] {
                let src = parent.join(f);
                if src.exists() {
                    let v = std::fs::read_to_string(&src)?;
                    std::fs::write(cur.join(f), v.trim())
                        .with_context(|| format!("writing {}", cur.join(f).display()))?;
                }
            }
        }
    }
    Ok(())
}

/// The `cgroup.procs` files of `rel` in every hierarchy: a process that writes its pid
/// to each before exec'ing runs entirely in the node's cgroup.
pub fn procs_files(rel: &str) -> Result<Vec<PathBuf>> {
    Ok(hierarchies()?
        .into_iter()
        .map(|h| h.join(rel).join("cgroup.procs"))
        .collect())
}

fn freezer(rel: &str) -> Result<PathBuf> {
    hierarchies()?
        .into_iter()
        .find(|h| h.join("freezer.state").exists() || h.ends_with("freezer"))
        .map(|h| h.join(rel))
        .context("no v1 freezer hierarchy")
}

/// Freezes every process of `rel` (what `docker pause` does) and waits until FROZEN.
pub fn freeze(rel: &str) -> Result<()> {
    set_freezer(rel, "FROZEN")
}

/// Thaws `rel`.
pub fn thaw(rel: &str) -> Result<()> {
    set_freezer(rel, "THAWED")
}

fn set_freezer(rel: &str, state: &str) -> Result<()> {
    let f = freezer(rel)?.join("freezer.state");
    std::fs::write(&f, state).with_context(|| format!("writing {state} to {}", f.display()))?;
    crate::wait::until(
        &format!("{} to be {state}", f.display()),
        Duration::from_secs(20),
        Duration::from_millis(50),
        || Ok((std::fs::read_to_string(&f)?.trim() == state).then_some(())),
    )
}

/// Thaws `rel` and every cgroup below it in the freezer hierarchy, ignoring errors (for the
/// teardown: a frozen process neither stops nor dies).
pub fn thaw_tree(rel: &str) {
    fn walk(dir: &Path) {
        let state = dir.join("freezer.state");
        if state.exists() {
            let _ = std::fs::write(&state, "THAWED");
        }
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    walk(&e.path());
                }
            }
        }
    }
    if let Ok(f) = freezer(rel) {
        walk(&f);
    }
}

/// Every pid in `rel` or below, in every hierarchy.
pub fn pids_below(rel: &str) -> Result<Vec<i32>> {
    let mut pids = Vec::new();
    for h in hierarchies()? {
        collect_pids(&h.join(rel), &mut pids);
    }
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

fn collect_pids(dir: &Path, pids: &mut Vec<i32>) {
    if let Ok(s) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        pids.extend(s.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                collect_pids(&e.path(), pids);
            }
        }
    }
}

/// SIGKILLs every process in `rel` (thawing all of it first: a frozen process cannot die) until
/// none is left, bounded to 30 s.
pub fn kill_all(rel: &str) -> Result<()> {
    // A child frozen on its own stays frozen when only its parent is thawed.
    thaw_tree(rel);
    let start = Instant::now();
    // Every pid killed here, reaped on each pass: one that was this process's child
    // leaves the cgroup when it dies, before it is waited for.
    let mut killed = std::collections::BTreeSet::new();
    loop {
        let pids = pids_below(rel)?;
        killed.iter().for_each(|p| crate::process::reap(*p));
        if pids.is_empty() {
            return Ok(());
        }
        for p in &pids {
            // SAFETY: kill(2) on a pid read from our own cgroup.
            unsafe { libc::kill(*p, libc::SIGKILL) };
            killed.insert(*p);
        }
        if start.elapsed() > Duration::from_secs(30) {
            bail!("processes still in cgroup {rel} after 30 s: {pids:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Kills everything in `rel` and removes its directories, deepest first, in every
/// hierarchy.
pub fn kill_and_remove(rel: &str) -> Result<()> {
    kill_all(rel)?;
    for h in hierarchies()? {
        remove_deepest_first(&h.join(rel));
    }
    Ok(())
}

fn remove_deepest_first(dir: &Path) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_deepest_first(&e.path());
            }
        }
    }
    // A cgroup directory is removed with rmdir alone; its files are the kernel's. The
    // last exited task may take a moment to leave.
    for _ in 0..50 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    crate::say(format!(
        "teardown: could not remove cgroup {}",
        dir.display()
    ));
}
