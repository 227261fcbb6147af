//! The controller's own node fails: the writer is placed on the node of the leading
//! controller pod, and the failover also measures the controller's (the plugin's Lease
//! taken by a pod elsewhere) and checks that the former leader did nothing once back (the
//! state dir's ownership generation is still the new leader's).

use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};

use super::install::{self, NAMESPACE};
use super::writer::{self, Writer};
use crate::cluster::Cluster;
use crate::{say, wait};

/// A hostname no node has: the writer's "avoid" when it may go anywhere.
const NO_NODE: &str = "no-such-node";

/// Moves the first writer onto the leading controller's node (its StatefulSet's placement
/// changed, so its pod is replaced there) and waits until it writes there. The node's name.
pub fn place_writer_on_leader(c: &Cluster, storage_class: &str) -> Result<String> {
    let leader = install::controller_node(c)?;
    c.kubectl.apply_text(&writer::manifest(
        Writer::FIRST,
        storage_class,
        &[NO_NODE],
        &leader,
    ))?;
    wait_writing_where(
        c,
        Writer::FIRST,
        "the writer to write on the leading controller's node",
        |node| {
            if node == leader {
                Ok(())
            } else {
                Err(format!("writing on {node}, not {leader}"))
            }
        },
    )?;
    say(format!("writer: on the leading controller's node {leader}"));
    Ok(leader)
}

/// Puts the first writer back off the leading controller's node, as the worker-node
/// faults want it.
pub fn place_writer_off_leader(c: &Cluster, storage_class: &str) -> Result<()> {
    let leader = install::controller_node(c)?;
    let prefer = c
        .nodes
        .iter()
        .map(|n| n.spec.name.clone())
        .find(|n| *n != leader)
        .context("no node without the controller")?;
    c.kubectl.apply_text(&writer::manifest(
        Writer::FIRST,
        storage_class,
        &[&leader],
        &prefer,
    ))?;
    writer::wait_writing(c, Writer::FIRST, 10, Duration::from_secs(240))?;
    Ok(())
}

/// Places the second writer on a node with no controller pod (so its failure leaves the
/// standby, which takes over, alone) and not the first writer's, and waits until it
/// writes there. The node's name.
pub fn place_second_writer(c: &Cluster, storage_class: &str) -> Result<String> {
    let controllers: Vec<String> = install::controller_pods_placed(c)?
        .into_iter()
        .map(|(_, node)| node)
        .collect();
    let first = writer::wait_writing(c, Writer::FIRST, 1, Duration::from_secs(240))?.1;
    let free: Vec<String> = c
        .nodes
        .iter()
        .map(|n| n.spec.name.clone())
        .filter(|n| !controllers.contains(n) && *n != first)
        .collect();
    let prefer = free.first().with_context(|| {
        format!("no node for the second writer: controllers on {controllers:?}, the first writer on {first}")
    })?;
    let mut avoid: Vec<&str> = controllers.iter().map(String::as_str).collect();
    avoid.push(&first);
    c.kubectl.apply_text(&writer::manifest(
        Writer::SECOND,
        storage_class,
        &avoid,
        prefer,
    ))?;
    wait_writing_where(
        c,
        Writer::SECOND,
        "the second writer to write on a node with no controller pod",
        |node| {
            if avoid.contains(&node) {
                Err(format!("writing on {node}, one of {avoid:?}"))
            } else {
                Ok(())
            }
        },
    )
    .inspect(|node| {
        say(format!(
            "second writer: on {node}, which runs no controller pod"
        ))
    })
}

/// Waits (bounded) until `w` writes on a node `accept` takes (or says why not). The node.
fn wait_writing_where(
    c: &Cluster,
    w: Writer,
    what: &str,
    accept: impl Fn(&str) -> std::result::Result<(), String>,
) -> Result<String> {
    wait::until_explained(
        what,
        Duration::from_secs(240),
        Duration::from_secs(1),
        || {
            let (_, node) = writer::wait_writing(c, w, 10, Duration::from_secs(240))?;
            Ok(accept(&node).map(|()| node))
        },
    )
}

/// What the controller's own failover showed.
pub struct Takeover {
    /// The pod that leads now.
    pub pod: String,
    /// Fault → the new leader's `acquireTime` on its Lease (recorded by the new leader).
    pub fault_to_leader_s: f64,
    /// That `acquireTime`, in unix nanos.
    pub acquired_nanos: i64,
    /// The state dir's ownership generation the new leader holds.
    pub generation: u64,
}

/// Waits (bounded) for a pod other than `old` to hold the plugin's Lease and to own the
/// state dir; `fault_nanos`: the fault, on the wall clock.
pub fn new_leader(c: &Cluster, old: &str, fault_nanos: i64) -> Result<Takeover> {
    let (pod, acquired) = wait::until_explained(
        "another controller pod to take the plugin's Lease",
        Duration::from_secs(180),
        Duration::from_millis(500),
        || {
            let l = c
                .kubectl
                .get(&["lease", "-n", NAMESPACE, "fencecsi-controller-plugin"])?;
            let holder = l["spec"]["holderIdentity"]
                .as_str()
                .unwrap_or("")
                .to_string();
            let acquired = l["spec"]["acquireTime"].as_str().unwrap_or("").to_string();
            Ok(if !holder.is_empty() && holder != old {
                Ok((holder, acquired))
            } else {
                Err(format!("held by {holder:?}"))
            })
        },
    )?;
    let at = acquired
        .parse::<fencecsi_cluster::k8s_openapi::jiff::Timestamp>()
        .with_context(|| format!("the Lease's acquireTime {acquired:?}"))?;
    let acquired_nanos = at.as_nanosecond() as i64;
    let fault_to_leader_s = (acquired_nanos - fault_nanos) as f64 / 1e9;
    let generation = wait::until_explained(
        "the new leader to own the state dir",
        Duration::from_secs(60),
        Duration::from_millis(500),
        || {
            let owner = fencecsi_driver::locks::owner_of(&c.state_dir)?;
            Ok(match owner {
                Some(h) => Ok(h.generation),
                None => Err("nobody owns it".to_string()),
            })
        },
    )?;
    say(format!(
        "controller: {pod} leads {fault_to_leader_s:.1} s after the fault (its Lease's acquireTime), owning generation {generation} of the state dir"
    ));
    Ok(Takeover {
        pod,
        fault_to_leader_s,
        acquired_nanos,
        generation,
    })
}

/// The bound on the controller's own failover: fault → every election the failed
/// pod led (the plugin's, the attacher's, podgc's, each sidecar's) led from another pod.
pub const CONTROLLER_BOUND_S: f64 = 20.0;

/// The Leases in the namespace whose holder is `pod` (the elections its containers lead),
/// by name.
pub fn leases_held_by(c: &Cluster, pod: &str) -> Result<Vec<String>> {
    let leases = c.kubectl.items(&["lease", "-n", NAMESPACE])?;
    let mut held = Vec::new();
    for l in &leases {
        let holder = l["spec"]["holderIdentity"].as_str().unwrap_or("");
        let name = l["metadata"]["name"].as_str().unwrap_or("");
        // Sidecars may suffix the pod name (hostname) with more.
        if !holder.is_empty() && holder.starts_with(pod) {
            held.push(name.to_string());
        }
    }
    Ok(held)
}

/// Waits (bounded) until every one of `leases` is held by a pod other than `old`, and
/// checks each was taken within [`CONTROLLER_BOUND_S`] of the fault: its `acquireTime`,
/// recorded by the new holder, against `fault_nanos` on the wall clock. The worst.
pub fn elections_moved_within_bound(
    c: &Cluster,
    leases: &[String],
    old: &str,
    fault_nanos: i64,
) -> Result<f64> {
    let mut taken = Vec::new();
    for lease in leases {
        let acquired = wait::until_explained(
            &format!("Lease {lease} to move off {old}"),
            Duration::from_secs(180),
            Duration::from_millis(500),
            || {
                let l = c.kubectl.get(&["lease", "-n", NAMESPACE, lease])?;
                let holder = l["spec"]["holderIdentity"].as_str().unwrap_or("");
                Ok(match l["spec"]["acquireTime"].as_str() {
                    Some(at) if !holder.is_empty() && !holder.starts_with(old) => {
                        Ok(at.to_string())
                    }
                    _ => Err(format!("held by {holder:?}")),
                })
            },
        )?;
        let at = acquired
            .parse::<fencecsi_cluster::k8s_openapi::jiff::Timestamp>()
            .with_context(|| format!("Lease {lease}'s acquireTime {acquired:?}"))?;
        taken.push((
            lease.clone(),
            (at.as_nanosecond() as i64 - fault_nanos) as f64 / 1e9,
        ));
    }
    let listed: Vec<String> = taken.iter().map(|(l, s)| format!("{l} {s:.1} s")).collect();
    say(format!(
        "controller: elections led from another pod after the fault: {}",
        listed.join(", ")
    ));
    let worst = taken.iter().map(|(_, s)| *s).fold(0.0, f64::max);
    ensure!(
        worst <= CONTROLLER_BOUND_S,
        "the controller's failover took {worst:.1} s, over its bound of {CONTROLLER_BOUND_S} s: {}",
        listed.join(", ")
    );
    Ok(worst)
}

/// Once the failed node is back: the new leader still leads and owns the generation it
/// took, so the former leader did nothing with the state dir when it ran again.
pub fn former_leader_did_nothing(c: &Cluster, t: &Takeover, state_dir: &Path) -> Result<()> {
    let holder = install::plugin_lease_holder(c)?;
    ensure!(
        holder.as_deref() == Some(t.pod.as_str()),
        "the plugin's Lease moved again once the node was back: {holder:?}"
    );
    let owner =
        fencecsi_driver::locks::owner_of(state_dir)?.context("nobody owns the state dir")?;
    ensure!(
        owner.generation == t.generation,
        "the state dir changed owners once the node was back: generation {} then {}",
        t.generation,
        owner.generation
    );
    say(format!(
        "controller: {} still leads and owns generation {} after the node's return",
        t.pod, t.generation
    ));
    Ok(())
}
