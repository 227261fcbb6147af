//! The shipped deployment on real kubelets, on one machine.
//!
//! `tests/real_kubelets.rs` brings up etcd, kube-apiserver, kube-controller-manager and
//! kube-scheduler on the host, four nodes (each its own mount, UTS, network and PID namespace,
//! its own cgroup, containerd and kubelet) on a bridge this crate makes, imports the images,
//! runs `kubectl apply -k deploy/base` unchanged, and then the failover scenarios.
//! Everything it makes is recorded in a [`teardown::Teardown`] as it is made and undone in
//! reverse on success, failure, panic and Ctrl-C; nothing else is touched.
//!
//! Inputs are named by environment variables (see [`inputs`]); without them the test says
//! SKIPPED and returns.

pub mod certs;
pub mod cgroups;
pub mod cluster;
pub mod control_plane;
pub mod image_run;
pub mod images;
pub mod inputs;
pub mod kubectl;
pub mod network;
pub mod node;
pub mod node_access;
pub mod process;
pub mod scenarios;
pub mod state_fs;
pub mod teardown;
pub mod upstream;
pub mod wait;

/// Progress on stderr, with seconds since the run started.
pub fn say(msg: impl AsRef<str>) {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    let t = START.get_or_init(Instant::now).elapsed().as_secs_f64();
    eprintln!("e2e [{t:7.1}s] {}", msg.as_ref());
}

/// Appends one JSON line to `target/e2e/<file>` (beside the run directories, kept
/// across runs): the figures of a run.
pub fn record_result(c: &cluster::Cluster, file: &str, line: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let p = c
        .run_dir
        .parent()
        .context("run dir has a parent")?
        .join(file);
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&p)?;
    writeln!(f, "{line}")?;
    Ok(())
}

/// A SKIPPED banner, written to the process's stderr itself: libtest captures
/// `eprintln!` of a passing test, and a skip must be seen.
pub fn skipped(msg: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(msg.as_bytes());
}
