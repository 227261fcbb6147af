//! The drill's scenario: set up, shut node A down, watch the failover, bring A back.
//!
//! ## Layout
//!
//! - this file: [`run`] (option checks, the scenario raced against cancellation, the Env
//!   guard's cleanup, the leftovers) and the scenario's sequence of phases;
//! - `setup`: the cluster's objects and simulations, the driver, attacher, podgc and the
//!   stand-ins, held until the teardown;
//! - `node_plugin`: a node plugin served in this process with its recovery handle and
//!   clean reports;
//! - `observer`: the task that timestamps each step as it first sees it;
//! - `failover`: the phases on the running set-up: writers on A, node A down, the checks
//!   on B, the pod of the driver without safe detach, node A back;
//! - `evidence`: the copy of each fenced generation and its comparison with the copy;
//! - `teardown`: the graceful teardown before the Env guard's;
//! - `figures`: per-volume results and the [`Report`].

mod evidence;
mod failover;
mod figures;
mod node_plugin;
mod observer;
mod setup;
mod teardown;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use fencecsi_embedded_cluster::EmbeddedCluster;
use fencecsi_tests::Env;

use crate::kubelet::Board;
use crate::procs::Procs;
use crate::report::{Report, Step};
use crate::{node_names, Options};
use observer::Shared;

/// Polls `f` every 20 ms until it answers true; an error of `f` ends the wait.
async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    while !f().await? {
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Runs the drill until it ends or `cancel` resolves; in both cases tears everything
/// down (writers killed first, then every mount and loop device below the temp dir).
pub async fn run(opts: Options, cancel: impl Future<Output = ()>) -> anyhow::Result<Report> {
    if opts.nodes < 2 {
        bail!("--nodes must be at least 2");
    }
    if opts.volumes == 0 {
        bail!("--volumes must be at least 1");
    }
    if opts.fs != "ext4" && opts.fs != "xfs" {
        bail!("--fs must be ext4 or xfs");
    }
    if !fencecsi_tests::can_run_kernel_tests() {
        bail!("the drill needs root and /dev/loop-control (loop devices, mounts)");
    }
    let started = Instant::now();
    opts.progress.reset();
    let env = Env::new();
    let procs = Procs::default();
    let board = Board::default();
    let shared: Shared = Arc::default();
    opts.progress.say(format!(
        "fencecsi drill: {} nodes, {} volume(s), {}; everything under {}",
        opts.nodes,
        opts.volumes,
        opts.fs,
        env.path().display()
    ));
    let result = tokio::select! {
        r = scenario(&env, &opts, &procs, &board, &shared) => r,
        _ = cancel => Err(anyhow!("interrupted")),
    };
    // Everything the scenario started is dropped by now (tasks aborted, servers told to
    // stop). Kill writers first so nothing keeps a file busy, let in-flight calls settle,
    // then the Env guard's teardown.
    let killed = procs.kill_all_and_wait();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (m, l) = env.teardown();
    if killed + m + l > 0 {
        opts.progress.say(format!(
            "cleanup: killed {killed} writer(s); the Env guard removed {m} mount(s) and {l} loop device(s)"
        ));
    }
    let leftover_mounts = env.mounts().len();
    let leftover_loops = env.loops().len();
    let env_dir = env.path().display().to_string();
    drop(env);
    let mut report = result?;
    report.leftover_mounts = leftover_mounts;
    report.leftover_loop_devices = leftover_loops;
    report.writers_left = procs.len();
    report.env_dir = env_dir;
    report.duration_s = started.elapsed().as_secs_f64();
    if leftover_mounts + leftover_loops > 0 {
        report.failures.push(format!(
            "{leftover_mounts} mount(s) / {leftover_loops} loop device(s) left"
        ));
    }
    report.ok = report.failures.is_empty();
    Ok(report)
}

async fn scenario(
    env: &Env,
    opts: &Options,
    procs: &Procs,
    board: &Board,
    shared: &Shared,
) -> anyhow::Result<Report> {
    let p = &opts.progress;
    let names = node_names(opts.nodes);
    let node_a = names[0].clone();
    let cluster = EmbeddedCluster::new().cluster();
    let mut failures: Vec<String> = vec![];

    let rig = setup::start(env, opts, procs, board, &cluster, &names).await?;

    // --- writers running on A ------------------------------------------------------------------
    failover::writers_on_a(&cluster, opts, board, shared, &node_a).await?;
    let observer = observer::observer(
        cluster.clone(),
        node_a.clone(),
        env.state_dir(),
        env.path().join("evidence"),
        board.clone(),
        shared.clone(),
        p.clone(),
    );

    // --- node A shuts down ----------------------------------------------------------------------
    failover::shut_down_a(&rig, opts, shared);
    let chain = observer::wait_step(shared, Step::PublishedOnB, opts.step_timeout).await;
    if let Err(e) = chain {
        failures.push(format!("{e:#}"));
    }

    let mut per_volume = vec![];
    let mut unsafe_result = None;
    if failures.is_empty() {
        // --- verify on B -------------------------------------------------------------------------
        let vols = shared.lock().unwrap().vols.clone();
        failover::verify_on_b(opts, board, shared, &vols, &mut failures).await;
        // Let A's writers run into the fence a little longer, then compare the fenced
        // generation with the copy taken when the fence was observed.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let evidence: Vec<evidence::Evidence> = vols
            .iter()
            .map(|v| evidence::Evidence {
                pod: &v.pod,
                fenced: v.fenced_path.as_deref(),
                copy: v.fenced_copy.as_deref(),
            })
            .collect();
        let fenced_diff = evidence::compare_fenced(&evidence, &mut failures).await?;
        if opts.unsafe_pod {
            unsafe_result = Some(failover::unsafe_pod(&cluster, &node_a, opts).await?);
        }

        // --- node A returns --------------------------------------------------------------------------
        failover::bring_back_a(&rig, opts, shared, &mut failures).await;

        // --- figures -----------------------------------------------------------------------------
        per_volume = figures::volume_results(board, shared, &fenced_diff, &mut failures);
    }
    {
        let o = shared.lock().unwrap();
        failures.extend(o.problems.iter().cloned());
    }

    let multi_attach_errors = rig.adc_model.multi_attach_errors();

    // --- graceful teardown ------------------------------------------------------------------------
    teardown::graceful(&cluster, opts, rig, observer).await;

    // --- report -----------------------------------------------------------------------------------
    let o = shared.lock().unwrap();
    let mut report = figures::report(opts, &o, per_volume, unsafe_result, failures);
    report.multi_attach_errors = multi_attach_errors;
    Ok(report)
}
