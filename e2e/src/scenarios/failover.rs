//! Failover of the StatefulSet writer when its node fails, in three ways ([`Fault`]):
//! a partition (the node's link goes down while its pod keeps writing), a power-off (every
//! process of the node killed) and a hang (the node's cgroup frozen, thawed after the
//! failover). Asserts that the pod is Running on another node with every acknowledged
//! record, that the old pod's writes fail after the fence (where it still runs), that no
//! byte reaches the fenced generation, and, once the node is back, that it is cleaned,
//! un-quarantined and schedulable again.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, ensure, Context, Result};

use super::evidence;
use super::writer::{self, Event};
use crate::cluster::Cluster;
use crate::kubectl::{condition_true, taint_keys};
use crate::teardown::Teardown;
use crate::{cgroups, network, node, say, wait};

const QUARANTINE_TAINT: &str = "fencecsi.io/quarantine";
const OUT_OF_SERVICE_TAINT: &str = "node.kubernetes.io/out-of-service";

/// How the writer's node fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The node's veth goes down; its processes keep running.
    Partition,
    /// Every process of the node is killed; the node is started anew to come back.
    PowerOff,
    /// The node's cgroup is frozen (`docker pause`); thawed after the failover.
    Hang,
}

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::Partition => "partition",
            Fault::PowerOff => "power-off",
            Fault::Hang => "hang",
        }
    }

    fn inject(self, c: &Cluster, node: &str) -> Result<()> {
        let n = c.node(node)?;
        match self {
            Fault::Partition => network::partition(&n.spec.host_end),
            Fault::PowerOff => cgroups::kill_all(&n.spec.cgroup),
            Fault::Hang => cgroups::freeze(&n.spec.cgroup),
        }
    }

    /// Whether the old pod still runs after the failover (and so must see its writes fail).
    fn old_pod_runs(self) -> bool {
        self != Fault::PowerOff
    }
}

/// What one failover measured.
#[derive(Debug, Clone)]
pub struct Figures {
    pub fault: &'static str,
    pub node: String,
    pub to_node: String,
    /// Fault → the fence was recorded (from the generation's `fenced_at`).
    pub fault_to_fence_s: f64,
    /// Fault → the new pod Running on another node.
    pub fault_to_running_s: f64,
    /// Fault → the new pod Ready.
    pub fault_to_ready_s: f64,
    /// Link back → the node Ready with its quarantine lifted.
    pub heal_to_lifted_s: f64,
    pub acked_by_old_pod: usize,
    pub old_writes_failed_after_fence: usize,
    /// Fault → another controller pod took the plugin's Lease, when the leading controller
    /// ran on the failed node.
    pub fault_to_new_leader_s: Option<f64>,
    /// Fault → the last of the elections the failed controller pod led was taken by
    /// another pod (checked against `leader::CONTROLLER_BOUND_S`).
    pub fault_to_controller_s: Option<f64>,
}

impl Figures {
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "fault": self.fault, "node": self.node, "to_node": self.to_node,
            "fault_to_fence_s": self.fault_to_fence_s,
            "fault_to_running_s": self.fault_to_running_s,
            "fault_to_ready_s": self.fault_to_ready_s,
            "heal_to_lifted_s": self.heal_to_lifted_s,
            "acked_by_old_pod": self.acked_by_old_pod,
            "old_writes_failed_after_fence": self.old_writes_failed_after_fence,
            "fault_to_new_leader_s": self.fault_to_new_leader_s,
            "fault_to_controller_s": self.fault_to_controller_s,
        })
    }
}

fn now_nanos() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// The writer as it was before the fault.
struct Before {
    uid: String,
    node: String,
    handle: String,
    generation: u64,
}

/// Waits until the writer pod is Ready and has acknowledged at least `min_acks` records.
pub fn wait_writing(c: &Cluster, min_acks: u64, limit: Duration) -> Result<(String, String)> {
    wait::until_explained(
        "the writer to be Ready and writing",
        limit,
        Duration::from_secs(1),
        || {
            let Some(p) = writer::pod(c)? else {
                return Ok(Err("no writer pod".into()));
            };
            let (uid, node, running, ready) = writer::pod_place(&p);
            if !(running && ready) {
                return Ok(Err(format!(
                    "writer on {node:?} running={running} ready={ready}"
                )));
            }
            let n = c.node(&node)?;
            let acks = writer::events(&n.spec.log_dir(), &uid)
                .map(|e| writer::last_ack(&e).unwrap_or(0))
                .unwrap_or(0);
            Ok(if acks >= min_acks {
                Ok((uid, node))
            } else {
                Err(format!("{acks} records acknowledged on {node}"))
            })
        },
    )
}

/// One failover by `fault` and the node's return.
pub fn fail_over_and_return(c: &mut Cluster, fault: Fault, td: &Teardown) -> Result<Figures> {
    let (uid, node) = wait_writing(c, 10, Duration::from_secs(180))?;
    let handle = writer::volume_handle(c)?;
    let rec = evidence::volume_record(&c.state_dir, &handle)?;
    let generation = evidence::current_generation(&rec).context("no current generation")?;
    let before = Before {
        uid,
        node,
        handle,
        generation,
    };
    let what = fault.name();
    // The writer's node fails; the leading controller may run there too (the standby then
    // takes over: a frozen leader through its kill switch), which is said here.
    let controller = super::install::controller_node(c)?;
    let leader_fails = controller == before.node;
    let leader_pod = super::install::controller_pod(c)?;
    let led = if leader_fails {
        let led = super::leader::leases_held_by(c, &leader_pod)?;
        say(format!(
            "{}: the leading controller {leader_pod} runs on the failing node too, leading {}",
            fault.name(),
            led.join(", ")
        ));
        led
    } else {
        Vec::new()
    };
    say(format!(
        "{what}: {} fails while writer {} writes to volume {} generation {}",
        before.node, before.uid, before.handle, before.generation
    ));
    let fault_nanos = now_nanos();
    let fault_at = Instant::now();
    fault.inject(c, &before.node)?;
    let seen = watch_failover(c, &before, fault_at)?;
    let takeover = leader_fails
        .then(|| super::leader::new_leader(c, &leader_pod, fault_nanos))
        .transpose()?;
    let controller_s = leader_fails
        .then(|| super::leader::elections_moved_within_bound(c, &led, &leader_pod, fault_nanos))
        .transpose()?;
    let fence_nanos = seen.fence_nanos;
    let fault_to_fence_s = (fence_nanos - fault_nanos) as f64 / 1e9;
    say(format!(
        "{what}: fence {fault_to_fence_s:.1} s, Running on {} {:.1} s, Ready {:.1} s after the fault",
        seen.to_node, seen.running_s, seen.ready_s
    ));
    if fault == Fault::Hang {
        cgroups::thaw(&c.node(&before.node)?.spec.cgroup)?;
        say(format!("{what}: {} thawed", before.node));
    }
    let old_log = c.node(&before.node)?.spec.log_dir();
    let old_events = if fault.old_pod_runs() {
        old_writes_fail(&old_log, &before.uid, fence_nanos)?
    } else {
        writer::events(&old_log, &before.uid)?
    };
    let failed_after_fence = old_events
        .iter()
        .filter(|e| matches!(e, Event::Fail { at_nanos, .. } if *at_nanos > fence_nanos))
        .count();
    // An ack stamped just after the fence is a write the fence waited for (it must then
    // be on the new generation: checked below); one stamped a second later is not.
    let slack = 1_000_000_000;
    let acked_late: Vec<&Event> = old_events
        .iter()
        .filter(|e| matches!(e, Event::Ack { at_nanos, .. } if *at_nanos > fence_nanos + slack))
        .collect();
    if fault != Fault::Hang {
        ensure!(
            acked_late.is_empty(),
            "the old pod acknowledged writes after the fence: {acked_late:?}"
        );
    }
    check_records_and_fence(c, &before, &old_events, &seen)?;
    let heal_to_lifted_s = return_node(c, fault, &before, td)?;
    if let Some(t) = &takeover {
        super::leader::former_leader_did_nothing(c, t, &c.state_dir)?;
    }
    Ok(Figures {
        fault: what,
        node: before.node,
        to_node: seen.to_node,
        fault_to_fence_s,
        fault_to_running_s: seen.running_s,
        fault_to_ready_s: seen.ready_s,
        heal_to_lifted_s,
        acked_by_old_pod: old_events
            .iter()
            .filter(|e| matches!(e, Event::Ack { .. }))
            .count(),
        old_writes_failed_after_fence: failed_after_fence,
        fault_to_new_leader_s: takeover.map(|t| t.fault_to_leader_s),
        fault_to_controller_s: controller_s,
    })
}

/// Waits until the old pod, still running on the failed node, logs a failed write after
/// the fence; its events.
fn old_writes_fail(old_log: &std::path::Path, uid: &str, fence_nanos: i64) -> Result<Vec<Event>> {
    let events = wait::until_explained(
        "the old pod's writes to fail after the fence",
        Duration::from_secs(60),
        Duration::from_millis(500),
        || {
            let ev = writer::events(old_log, uid)?;
            let failed = ev
                .iter()
                .filter(|e| matches!(e, Event::Fail { at_nanos, .. } if *at_nanos > fence_nanos))
                .count();
            Ok(if failed > 0 {
                Ok(ev)
            } else {
                Err(format!(
                    "{} events, none a failure after the fence",
                    ev.len()
                ))
            })
        },
    )?;
    if let Some(Event::Fail { why, .. }) = events.iter().find(|e| matches!(e, Event::Fail { .. })) {
        say(format!("the old pod's first failed write: {why}"));
    }
    Ok(events)
}

/// Every record the old pod acknowledged is on the volume the new pod sees, and no byte
/// reached the fenced generation after the fence.
fn check_records_and_fence(
    c: &Cluster,
    before: &Before,
    old_events: &[Event],
    seen: &Seen,
) -> Result<()> {
    let last_old = writer::last_ack(old_events).unwrap_or(0);
    wait_writing(c, last_old + 3, Duration::from_secs(60))?;
    let present = writer::records_in_volume(c)?;
    let old_acks: Vec<Event> = old_events
        .iter()
        .filter(|e| matches!(e, Event::Ack { .. }))
        .cloned()
        .collect();
    let missing = writer::missing_acks(&old_acks, &present);
    ensure!(
        missing.is_empty(),
        "acknowledged records missing after the failover: {missing:?}"
    );
    say(format!(
        "all {} records the old pod acknowledged are on the volume ({} records there)",
        old_acks.len(),
        present.len()
    ));
    let gen = evidence::generation_path(&c.state_dir, &before.handle, before.generation);
    let diff = evidence::differing_bytes(&gen, &seen.fenced_copy)?;
    ensure!(
        diff == 0,
        "{diff} bytes of the fenced generation changed after the fence"
    );
    say("the fenced generation is unchanged since the fence");
    Ok(())
}

/// Brings the failed node back (link up, or a fresh start after a power-off; a hang was
/// thawed already) and waits until it is lifted. Seconds from its return.
fn return_node(c: &mut Cluster, fault: Fault, before: &Before, td: &Teardown) -> Result<f64> {
    match fault {
        Fault::Partition => network::heal(&c.node(&before.node)?.spec.host_end)?,
        Fault::PowerOff => {
            let spec = c.node(&before.node)?.spec.clone();
            // A reboot starts with no cgroups: the dead containers' cgroups left behind
            // would make the new kubelet's cAdvisor try to adopt each one (about 3 s each,
            // 38 s in all, measured), which no real power cycle shows.
            cgroups::kill_and_remove(&spec.cgroup)?;
            let kubeconfig = c.node_kubeconfig(&spec.name)?;
            let fresh = node::start(&spec, &c.node_env(), &kubeconfig, td)?;
            let slot = c
                .nodes
                .iter_mut()
                .find(|n| n.spec.name == spec.name)
                .context("node vanished")?;
            *slot = fresh;
        }
        Fault::Hang => {}
    }
    say(format!("{}: {} is back", fault.name(), before.node));
    wait_lifted(c, before)
}

/// What the failover watch saw.
struct Seen {
    to_node: String,
    running_s: f64,
    ready_s: f64,
    fence_nanos: i64,
    fenced_copy: std::path::PathBuf,
}

/// Polls the fence (state dir) and the writer pod (API server) until the new pod is Ready
/// on another node and the fence has been seen and its generation copied.
fn watch_failover(c: &Cluster, before: &Before, fault: Instant) -> Result<Seen> {
    let copy = c.run_dir.join(format!(
        "fenced-{}-gen{}.img",
        before.handle, before.generation
    ));
    let mut fence_nanos: Option<i64> = None;
    let mut running_s: Option<f64> = None;
    let limit = Duration::from_secs(300);
    loop {
        if fence_nanos.is_none() {
            let rec = evidence::volume_record(&c.state_dir, &before.handle)?;
            if let Some(t) = evidence::fenced_at(&rec, before.generation) {
                let gen =
                    evidence::generation_path(&c.state_dir, &before.handle, before.generation);
                evidence::copy_data_region(&gen, &copy)?;
                say(format!(
                    "generation {} fenced; data region copied",
                    before.generation
                ));
                fence_nanos = Some(t);
            }
        }
        if let Some(p) = writer::pod(c).unwrap_or(None) {
            let (uid, node, running, ready) = writer::pod_place(&p);
            if uid != before.uid && node != before.node && running {
                let r = *running_s.get_or_insert(fault.elapsed().as_secs_f64());
                if ready {
                    if let Some(f) = fence_nanos {
                        return Ok(Seen {
                            to_node: node,
                            running_s: r,
                            ready_s: fault.elapsed().as_secs_f64(),
                            fence_nanos: f,
                            fenced_copy: copy,
                        });
                    }
                    bail!(
                        "the writer is Ready on {node} but generation {} was never fenced",
                        before.generation
                    );
                }
            }
        }
        if fault.elapsed() > limit {
            bail!(
                "no failover within {limit:?}: fence seen={} running={running_s:?}",
                fence_nanos.is_some()
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Waits until the node is Ready, its quarantine lifted and it is schedulable, and
/// recovery released what was fenced there. Seconds from the call.
fn wait_lifted(c: &Cluster, before: &Before) -> Result<f64> {
    let healed = Instant::now();
    wait::until_explained(
        "the node Ready, un-quarantined and schedulable",
        Duration::from_secs(300),
        Duration::from_millis(500),
        || {
            let n = c.kubectl.get(&["node", &before.node])?;
            let taints = taint_keys(&n);
            let ok = condition_true(&n, "Ready")
                && !taints
                    .iter()
                    .any(|t| t == QUARANTINE_TAINT || t == OUT_OF_SERVICE_TAINT)
                && n["spec"]["unschedulable"] != true;
            Ok(if ok {
                Ok(())
            } else {
                Err(format!(
                    "Ready={} taints={taints:?}",
                    condition_true(&n, "Ready")
                ))
            })
        },
    )?;
    let lifted = healed.elapsed().as_secs_f64();
    say(format!(
        "{} un-quarantined {lifted:.1} s after it came back",
        before.node
    ));
    wait::until_explained(
        "recovery to release the fenced generation",
        Duration::from_secs(120),
        Duration::from_secs(1),
        || {
            let rec = evidence::volume_record(&c.state_dir, &before.handle)?;
            let from = evidence::fenced_from(&rec);
            Ok(if from.contains(&before.node) {
                Err(format!("fenced_from={from:?}"))
            } else {
                Ok(())
            })
        },
    )?;
    say(format!("{} released the fenced generation", before.node));
    Ok(lifted)
}
