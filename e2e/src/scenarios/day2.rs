//! Day-2 operations while the writer's volume is in use: a rolling restart of the node
//! DaemonSet, a kubelet restart on the writer's node, and a restart of the controller
//! Deployment (its leader Lease moving to the new pod). None may give the writer an I/O
//! error, restart or move it, or fence its volume.

use std::time::Duration;

use anyhow::{ensure, Context, Result};

use super::install::NAMESPACE;
use super::writer::{self, wait_writing, Event, Writer};
use super::{evidence, install, now_nanos};
use crate::cluster::Cluster;
use crate::teardown::Teardown;
use crate::{node, say, wait};

#[derive(Debug, Clone, Copy)]
pub enum Operation {
    NodeDaemonSetRollout,
    KubeletRestart,
    ControllerRollout,
}

impl Operation {
    pub const ALL: [Operation; 3] = [
        Operation::NodeDaemonSetRollout,
        Operation::KubeletRestart,
        Operation::ControllerRollout,
    ];

    fn name(self) -> &'static str {
        match self {
            Operation::NodeDaemonSetRollout => "rolling restart of daemonset/fencecsi-node",
            Operation::KubeletRestart => "kubelet restart on the writer's node",
            Operation::ControllerRollout => "restart of deployment/fencecsi-controller",
        }
    }
}

/// Runs `op` and checks the writer went on undisturbed.
pub fn undisturbed(c: &mut Cluster, op: Operation, td: &Teardown) -> Result<()> {
    let (uid, node_name) = wait_writing(c, Writer::FIRST, 3, Duration::from_secs(120))?;
    let handle = writer::volume_handle(c, Writer::FIRST)?;
    let rec = evidence::volume_record(&c.state_dir, &handle)?;
    let generation = evidence::current_generation(&rec).context("no generation")?;
    let start = now_nanos();
    say(format!(
        "day-2: {} while the writer writes on {node_name}",
        op.name()
    ));
    match op {
        Operation::NodeDaemonSetRollout => rollout(c, "daemonset/fencecsi-node")?,
        Operation::ControllerRollout => controller_rollout(c)?,
        Operation::KubeletRestart => kubelet_restart(c, &node_name, td)?,
    }
    // Ten more records (two seconds of writing) after the operation, then the checks.
    let log_dir = c.node(&node_name)?.spec.log_dir();
    let acked = writer::last_ack(&writer::events(Writer::FIRST, &log_dir, &uid)?).unwrap_or(0);
    let (uid_after, node_after) =
        wait_writing(c, Writer::FIRST, acked + 10, Duration::from_secs(120))?;
    ensure!(
        uid_after == uid && node_after == node_name,
        "the writer moved: {uid}@{node_name} -> {uid_after}@{node_after}"
    );
    let failures: Vec<Event> = writer::events(Writer::FIRST, &log_dir, &uid)?
        .into_iter()
        .filter(|e| matches!(e, Event::Fail { at_nanos, .. } if *at_nanos >= start))
        .collect();
    ensure!(
        failures.is_empty(),
        "the writer saw I/O errors during the {}: {failures:?}",
        op.name()
    );
    check_not_restarted_nor_fenced(c, &handle, generation, op)?;
    say(format!(
        "day-2: {}: no I/O error, no restart, nothing fenced",
        op.name()
    ));
    Ok(())
}

/// The writer's container never restarted, and its volume is on the same generation,
/// with no node fenced from it.
fn check_not_restarted_nor_fenced(
    c: &Cluster,
    handle: &str,
    generation: u64,
    op: Operation,
) -> Result<()> {
    let p = writer::pod(c, Writer::FIRST)?.context("writer gone")?;
    let restarts = p["status"]["containerStatuses"][0]["restartCount"]
        .as_u64()
        .unwrap_or(0);
    ensure!(
        restarts == 0,
        "the writer container restarted {restarts} times"
    );
    let rec = evidence::volume_record(&c.state_dir, handle)?;
    ensure!(
        evidence::current_generation(&rec) == Some(generation)
            && evidence::fenced_at(&rec, generation).is_none(),
        "the volume was fenced or moved to a new generation during the {}: {rec}",
        op.name()
    );
    ensure!(
        evidence::fenced_from(&rec).is_empty(),
        "a node was fenced: {rec}"
    );
    Ok(())
}

/// Restarts the controller Deployment (one pod at a time) and waits for the plugin's Lease
/// to move to a new pod. The leader may then run on any node, the writer's included; the
/// failover scenarios say so when it does.
fn controller_rollout(c: &Cluster) -> Result<()> {
    let before: Vec<String> = install::controller_pods_placed(c)?
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    rollout(c, "deployment/fencecsi-controller")?;
    install::wait_installed(c)?;
    let after = install::controller_pods_placed(c)?;
    ensure!(
        after.iter().all(|(name, _)| !before.contains(name)),
        "the controller pods were not all replaced: {before:?} -> {after:?}"
    );
    wait::until_explained(
        "the controller plugin's Lease to move to a new pod",
        Duration::from_secs(90),
        Duration::from_secs(1),
        || {
            let holder = install::plugin_lease_holder(c)?.unwrap_or_default();
            Ok(if after.iter().any(|(name, _)| *name == holder) {
                Ok(())
            } else {
                Err(format!("held by {holder:?}"))
            })
        },
    )?;
    Ok(())
}

/// Restarts the kubelet of `node_name` and waits until it registered again and its node
/// is Ready.
fn kubelet_restart(c: &mut Cluster, node_name: &str, td: &Teardown) -> Result<()> {
    let mut n = c.node(node_name)?.clone();
    let kubeconfig = c.node_kubeconfig(node_name)?;
    let registered = node::kubelet_registrations(&n.spec);
    node::restart_kubelet(&mut n, &c.node_env(), &kubeconfig, td)?;
    wait::until(
        "the restarted kubelet to register with the API server",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || Ok((node::kubelet_registrations(&n.spec) > registered).then_some(())),
    )?;
    if let Some(slot) = c.nodes.iter_mut().find(|x| x.spec.name == node_name) {
        *slot = n;
    }
    c.wait_nodes_ready(&[node_name.to_string()], Duration::from_secs(120))
}

fn rollout(c: &Cluster, what: &str) -> Result<()> {
    c.kubectl
        .run(&["rollout", "restart", "-n", NAMESPACE, what])?;
    // kubectl's own bounded wait; --request-timeout does not bound `rollout status`.
    c.kubectl
        .run(&["rollout", "status", "-n", NAMESPACE, what, "--timeout=240s"])
        .with_context(|| format!("waiting for the rollout of {what}"))?;
    Ok(())
}
