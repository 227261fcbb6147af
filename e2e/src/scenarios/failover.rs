//! Failover of the StatefulSet writer when its node fails, in three ways ([`Fault`]):
//! a partition (the node's link goes down while its pod keeps writing), a power-off (every
//! process of the node killed) and a hang (the node's cgroup frozen, thawed after the
//! failover). Asserts that the pod is Running on another node with every acknowledged
//! record, that the old pod's writes fail after the fence (where it still runs), that no
//! byte reaches the fenced generation, and, once the node is back, that it is cleaned,
//! un-quarantined and schedulable again.
//!
//! Several writers may fail over at once, each on its own node, the later nodes failing a
//! few seconds after the first: with the first on the leading controller's node, the later
//! ones fail while the controller itself fails over, and are checked the same way.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use super::writer::{self, Event, Writer};
use super::{evidence, now_nanos};
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

/// What one writer's failover measured.
#[derive(Debug, Clone)]
pub struct Figures {
    pub fault: &'static str,
    /// The writer StatefulSet that failed over.
    pub writer: &'static str,
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
    /// For a writer whose node failed while the controller failed over: its fault → the
    /// new leader's `acquireTime` (positive: the controller was still failing over).
    pub own_fault_to_new_leader_s: Option<f64>,
    /// How long the API server was stopped at the leader's fault ([`API_STALL`]).
    pub api_stall_s: Option<f64>,
}

impl Figures {
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "fault": self.fault, "writer": self.writer,
            "node": self.node, "to_node": self.to_node,
            "fault_to_fence_s": self.fault_to_fence_s,
            "fault_to_running_s": self.fault_to_running_s,
            "fault_to_ready_s": self.fault_to_ready_s,
            "heal_to_lifted_s": self.heal_to_lifted_s,
            "acked_by_old_pod": self.acked_by_old_pod,
            "old_writes_failed_after_fence": self.old_writes_failed_after_fence,
            "fault_to_new_leader_s": self.fault_to_new_leader_s,
            "fault_to_controller_s": self.fault_to_controller_s,
            "own_fault_to_new_leader_s": self.own_fault_to_new_leader_s,
            "api_stall_s": self.api_stall_s,
        })
    }
}

/// A writer as it was before the fault.
struct Before {
    w: Writer,
    uid: String,
    node: String,
    handle: String,
    generation: u64,
}

/// A writer whose node failed: what it was, and when its node failed (wall clock, and
/// monotonic for the figures).
struct Failing {
    before: Before,
    fault_nanos: i64,
    fault_at: Instant,
}

/// `FENCECSI_E2E_API_STALL` (seconds, as `8s`; unset: none): in a `controller-` fault, the
/// API server's process group is stopped (SIGSTOP) as the leader's node fails, and
/// continued that long after, so that every client's request in flight or sent meanwhile
/// is answered late: the API server of run F in BENCHMARKS.md, which answered about 8 s
/// late at a leader's power-off.
pub const API_STALL: &str = "FENCECSI_E2E_API_STALL";

fn api_stall() -> Result<Option<Duration>> {
    let Ok(v) = std::env::var(API_STALL) else {
        return Ok(None);
    };
    if v.trim().is_empty() {
        return Ok(None);
    }
    let secs = v
        .trim()
        .strip_suffix('s')
        .and_then(|n| n.parse::<f64>().ok())
        .filter(|n| n.is_finite() && *n > 0.0 && *n <= 60.0)
        .with_context(|| format!("{API_STALL}={v}: give seconds up to 60, as 8s"))?;
    Ok(Some(Duration::from_secs_f64(secs)))
}

/// The API server stopped by [`stall_api_server`]: continued by its thread when the stall is
/// over, or at once when this is dropped before ([`Stalled::finish`] not reached: a failed
/// run), so that the teardown finds it running.
struct Stalled {
    pgid: i32,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Stalled {
    /// Waits for the stall's end.
    fn finish(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Stalled {
    fn drop(&mut self) {
        if self.thread.is_some() {
            // SAFETY: killpg takes no pointers.
            unsafe { libc::killpg(self.pgid, libc::SIGCONT) };
        }
    }
}

/// Stops the API server's process group now, and continues it after `d`.
fn stall_api_server(pgid: i32, d: Duration) -> Result<Stalled> {
    // SAFETY: killpg takes no pointers.
    if unsafe { libc::killpg(pgid, libc::SIGSTOP) } != 0 {
        bail!(
            "stopping the API server: {}",
            std::io::Error::last_os_error()
        );
    }
    say(format!(
        "API server stopped for {:.1} s (SIGSTOP to its process group)",
        d.as_secs_f64()
    ));
    let thread = std::thread::spawn(move || {
        std::thread::sleep(d);
        // SAFETY: as above.
        unsafe { libc::killpg(pgid, libc::SIGCONT) };
        say("API server continued");
    });
    Ok(Stalled {
        pgid,
        thread: Some(thread),
    })
}

/// How long after the first node's fault the next writer's node fails: inside the
/// controller's failover, and checked to be so. The shortest is a power-off's: a standby
/// takes the plugin's Lease once it has seen the leader's ownership lock free twice, a
/// retry period (2 s) apart, so at least 2 s after the fault.
const NEXT_FAULT_AFTER: Duration = Duration::from_secs(1);

fn before_fault(c: &Cluster, w: Writer) -> Result<Before> {
    let (uid, node) = writer::wait_writing(c, w, 10, Duration::from_secs(180))?;
    let handle = writer::volume_handle(c, w)?;
    let rec = evidence::volume_record(&c.state_dir, &handle)?;
    let generation = evidence::current_generation(&rec).context("no current generation")?;
    Ok(Before {
        w,
        uid,
        node,
        handle,
        generation,
    })
}

/// The leading controller pod and the elections it leads, when it runs on `node`.
fn leader_on(c: &Cluster, node: &str, fault: Fault) -> Result<Option<(String, Vec<String>)>> {
    if super::install::controller_node(c)? != node {
        return Ok(None);
    }
    let pod = super::install::controller_pod(c)?;
    let led = super::leader::leases_held_by(c, &pod)?;
    say(format!(
        "{}: the leading controller {pod} runs on the failing node too, leading {}",
        fault.name(),
        led.join(", ")
    ));
    Ok(Some((pod, led)))
}

/// Fails each writer's node by `fault`, in order, the later ones [`NEXT_FAULT_AFTER`] after
/// the one before (so while the controller fails over, when the first node is its leader's),
/// then checks each failover and brings the nodes back. One [`Figures`] per writer.
pub fn fail_over_and_return(
    c: &mut Cluster,
    fault: Fault,
    writers: &[Writer],
    td: &Teardown,
) -> Result<Vec<Figures>> {
    let befores = writers
        .iter()
        .map(|w| before_fault(c, *w))
        .collect::<Result<Vec<_>>>()?;
    let first = befores.first().context("no writer to fail over")?;
    let nodes: std::collections::BTreeSet<&str> = befores.iter().map(|b| b.node.as_str()).collect();
    ensure!(
        nodes.len() == befores.len(),
        "the writers must each be on their own node: {nodes:?}"
    );
    let leader = leader_on(c, &first.node, fault)?;
    let stall = match leader {
        Some(_) => api_stall()?,
        None => None,
    };
    let (failing, stalled) = inject_in_turn(c, fault, befores, stall)?;
    let seen = watch_failovers(c, &failing)?;
    if let Some(s) = stalled {
        s.finish();
    }
    let fault_nanos = failing[0].fault_nanos;
    let takeover = leader
        .as_ref()
        .map(|(pod, _)| super::leader::new_leader(c, pod, fault_nanos))
        .transpose()?;
    let controller_s = leader
        .as_ref()
        .map(|(pod, led)| super::leader::elections_moved_within_bound(c, led, pod, fault_nanos))
        .transpose()?;
    if let Some(t) = &takeover {
        during_controller_failover(t, &failing[1..])?;
    }
    if fault == Fault::Hang {
        for f in &failing {
            cgroups::thaw(&c.node(&f.before.node)?.spec.cgroup)?;
            say(format!("{}: {} thawed", fault.name(), f.before.node));
        }
    }
    let mut figures = Vec::new();
    for (i, (f, s)) in failing.iter().zip(&seen).enumerate() {
        let mut fig = check_failover(c, fault, f, s)?;
        if let Some(t) = &takeover {
            fig.fault_to_new_leader_s = Some(t.fault_to_leader_s);
            fig.fault_to_controller_s = controller_s;
            if i > 0 {
                fig.own_fault_to_new_leader_s =
                    Some((t.acquired_nanos - f.fault_nanos) as f64 / 1e9);
            }
            fig.api_stall_s = stall.map(|d| d.as_secs_f64());
        }
        figures.push(fig);
    }
    return_nodes(c, fault, &failing, &mut figures, td)?;
    if let Some(t) = &takeover {
        super::leader::former_leader_did_nothing(c, t, &c.state_dir)?;
    }
    Ok(figures)
}

/// Fails each writer's node in turn; with `stall`, stops the API server for that long as
/// the first fails.
fn inject_in_turn(
    c: &Cluster,
    fault: Fault,
    befores: Vec<Before>,
    stall: Option<Duration>,
) -> Result<(Vec<Failing>, Option<Stalled>)> {
    let mut failing = Vec::new();
    let mut stalled = None;
    for b in befores {
        if !failing.is_empty() {
            std::thread::sleep(NEXT_FAULT_AFTER);
        }
        say(format!(
            "{}: {} fails while {} {} writes to volume {} generation {}",
            fault.name(),
            b.node,
            b.w.pod,
            b.uid,
            b.handle,
            b.generation
        ));
        let fault_nanos = now_nanos();
        let fault_at = Instant::now();
        fault.inject(c, &b.node)?;
        if let (Some(d), true) = (stall, failing.is_empty()) {
            stalled = Some(stall_api_server(c.control_plane.apiserver_pgid, d)?);
        }
        failing.push(Failing {
            before: b,
            fault_nanos,
            fault_at,
        });
    }
    Ok((failing, stalled))
}

/// The later nodes failed before the new leader took over (its Lease's `acquireTime`), so
/// their failovers did wait for the controller's.
fn during_controller_failover(t: &super::leader::Takeover, later: &[Failing]) -> Result<()> {
    for f in later {
        ensure!(
            f.fault_nanos < t.acquired_nanos,
            "{} failed {:.1} s after the new leader took over: not during the controller's failover",
            f.before.node,
            (f.fault_nanos - t.acquired_nanos) as f64 / 1e9
        );
        say(format!(
            "{} failed {:.1} s before the new leader took over",
            f.before.node,
            (t.acquired_nanos - f.fault_nanos) as f64 / 1e9
        ));
    }
    Ok(())
}

/// One writer's failover, once its new pod is Ready: the old pod's writes failed (where it
/// still runs), nothing it acknowledged is lost, its generation is untouched since the
/// fence and was fenced once. Its figures, but for the node's return.
fn check_failover(c: &Cluster, fault: Fault, f: &Failing, seen: &Seen) -> Result<Figures> {
    let b = &f.before;
    let fence_nanos = seen.fence_nanos;
    let fault_to_fence_s = (fence_nanos - f.fault_nanos) as f64 / 1e9;
    say(format!(
        "{}: {} fenced {fault_to_fence_s:.1} s, Running on {} {:.1} s, Ready {:.1} s after its node's fault",
        fault.name(),
        b.w.pod,
        seen.to_node,
        seen.running_s,
        seen.ready_s
    ));
    let old_log = c.node(&b.node)?.spec.log_dir();
    let old_events = if fault.old_pod_runs() {
        old_writes_fail(b.w, &old_log, &b.uid, fence_nanos)?
    } else {
        writer::events(b.w, &old_log, &b.uid)?
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
    check_records_and_fence(c, b, &old_events, seen)?;
    Ok(Figures {
        fault: fault.name(),
        writer: b.w.name,
        node: b.node.clone(),
        to_node: seen.to_node.clone(),
        fault_to_fence_s,
        fault_to_running_s: seen.running_s,
        fault_to_ready_s: seen.ready_s,
        heal_to_lifted_s: 0.0,
        acked_by_old_pod: old_events
            .iter()
            .filter(|e| matches!(e, Event::Ack { .. }))
            .count(),
        old_writes_failed_after_fence: failed_after_fence,
        fault_to_new_leader_s: None,
        fault_to_controller_s: None,
        own_fault_to_new_leader_s: None,
        api_stall_s: None,
    })
}

/// Waits until the old pod, still running on the failed node, logs a failed write after
/// the fence; its events.
fn old_writes_fail(
    w: Writer,
    old_log: &std::path::Path,
    uid: &str,
    fence_nanos: i64,
) -> Result<Vec<Event>> {
    let events = wait::until_explained(
        &format!("the old {}'s writes to fail after the fence", w.pod),
        Duration::from_secs(60),
        Duration::from_millis(500),
        || {
            let ev = writer::events(w, old_log, uid)?;
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
        say(format!("the old {}'s first failed write: {why}", w.pod));
    }
    Ok(events)
}

/// Every record the old pod acknowledged is on the volume the new pod sees, no byte
/// reached the fenced generation after the fence, and the volume was fenced once: the
/// new pod writes generation G+1, which is not fenced.
fn check_records_and_fence(
    c: &Cluster,
    before: &Before,
    old_events: &[Event],
    seen: &Seen,
) -> Result<()> {
    let w = before.w;
    let last_old = writer::last_ack(old_events).unwrap_or(0);
    writer::wait_writing(c, w, last_old + 3, Duration::from_secs(60))?;
    let present = writer::records_in_volume(c, w)?;
    let old_acks: Vec<Event> = old_events
        .iter()
        .filter(|e| matches!(e, Event::Ack { .. }))
        .cloned()
        .collect();
    let missing = writer::missing_acks(&old_acks, &present);
    ensure!(
        missing.is_empty(),
        "{}: acknowledged records missing after the failover: {missing:?}",
        w.pod
    );
    say(format!(
        "all {} records the old {} acknowledged are on the volume ({} records there)",
        old_acks.len(),
        w.pod,
        present.len()
    ));
    let diff = evidence::differing_bytes(&seen.fenced_generation, &seen.fenced_copy)
        .context("comparing the fenced generation with its copy")?;
    ensure!(
        diff == 0,
        "{diff} bytes of {}'s fenced generation changed after the fence",
        w.pod
    );
    let rec = evidence::volume_record(&c.state_dir, &before.handle)?;
    let next = before.generation + 1;
    ensure!(
        evidence::current_generation(&rec) == Some(next)
            && evidence::fenced_at(&rec, next).is_none(),
        "{}'s volume was fenced more than once: the new pod should write generation {next}, unfenced: {rec}",
        w.pod
    );
    say(format!(
        "{}: the fenced generation is unchanged since the fence, and generation {next} (the new pod's) is not fenced",
        w.pod
    ));
    Ok(())
}

/// Brings the failed nodes back (links up, or a fresh start after a power-off; a hang was
/// thawed already) and waits until each is lifted, filling in its figures.
fn return_nodes(
    c: &mut Cluster,
    fault: Fault,
    failing: &[Failing],
    figures: &mut [Figures],
    td: &Teardown,
) -> Result<()> {
    let mut back = Vec::new();
    for f in failing {
        return_node(c, fault, &f.before.node, td)?;
        back.push(Instant::now());
    }
    for ((f, fig), at) in failing.iter().zip(figures.iter_mut()).zip(back) {
        fig.heal_to_lifted_s = wait_lifted(c, &f.before, at)?;
    }
    Ok(())
}

fn return_node(c: &mut Cluster, fault: Fault, node_name: &str, td: &Teardown) -> Result<()> {
    match fault {
        Fault::Partition => network::heal(&c.node(node_name)?.spec.host_end)?,
        Fault::PowerOff => {
            let spec = c.node(node_name)?.spec.clone();
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
    say(format!("{}: {node_name} is back", fault.name()));
    Ok(())
}

/// What the failover watch saw of one writer.
struct Seen {
    to_node: String,
    running_s: f64,
    ready_s: f64,
    fence_nanos: i64,
    fenced_copy: std::path::PathBuf,
    /// The fenced generation's image, opened when the fence was seen.
    fenced_generation: std::fs::File,
}

/// One writer's failover as watched so far.
struct Watch<'a> {
    f: &'a Failing,
    copy: std::path::PathBuf,
    fence_nanos: Option<i64>,
    fenced_generation: Option<std::fs::File>,
    running_s: Option<f64>,
    seen: Option<Seen>,
}

/// Polls each writer's fence (state dir) and pod (API server) until every new pod is
/// Ready on another node and every fence has been seen and its generation copied.
fn watch_failovers(c: &Cluster, failing: &[Failing]) -> Result<Vec<Seen>> {
    let mut watches: Vec<Watch> = failing
        .iter()
        .map(|f| Watch {
            f,
            copy: c.run_dir.join(format!(
                "fenced-{}-gen{}.img",
                f.before.handle, f.before.generation
            )),
            fence_nanos: None,
            fenced_generation: None,
            running_s: None,
            seen: None,
        })
        .collect();
    let limit = Duration::from_secs(300);
    let started = Instant::now();
    loop {
        for w in watches.iter_mut().filter(|w| w.seen.is_none()) {
            poll_failover(c, w)?;
        }
        if watches.iter().all(|w| w.seen.is_some()) {
            return Ok(watches.into_iter().filter_map(|w| w.seen).collect());
        }
        if started.elapsed() > limit {
            let states: Vec<String> = watches
                .iter()
                .map(|w| {
                    format!(
                        "{}: fence seen={} running={:?}",
                        w.f.before.w.pod,
                        w.fence_nanos.is_some(),
                        w.running_s
                    )
                })
                .collect();
            bail!("no failover within {limit:?}: {}", states.join("; "));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// One look at a writer's fence and pod; sets `seen` once its new pod is Ready elsewhere.
fn poll_failover(c: &Cluster, w: &mut Watch) -> Result<()> {
    let b = &w.f.before;
    if w.fence_nanos.is_none() {
        let rec = evidence::volume_record(&c.state_dir, &b.handle)?;
        if let Some(t) = evidence::fenced_at(&rec, b.generation) {
            let gen = evidence::generation_path(&c.state_dir, &b.handle, b.generation);
            w.fenced_generation = Some(
                evidence::open_and_copy_data_region(&gen, &w.copy)
                    .with_context(|| format!("copying {}", gen.display()))?,
            );
            say(format!(
                "{}: generation {} fenced; data region copied",
                b.w.pod, b.generation
            ));
            w.fence_nanos = Some(t);
        }
    }
    let Some(p) = writer::pod(c, b.w).unwrap_or(None) else {
        return Ok(());
    };
    let (uid, node, running, ready) = writer::pod_place(&p);
    if uid == b.uid || node == b.node || !running {
        return Ok(());
    }
    let fault = w.f.fault_at;
    let r = *w.running_s.get_or_insert(fault.elapsed().as_secs_f64());
    if !ready {
        return Ok(());
    }
    let (Some(f), Some(fenced_generation)) = (w.fence_nanos, w.fenced_generation.take()) else {
        bail!(
            "{} is Ready on {node} but generation {} was never fenced",
            b.w.pod,
            b.generation
        );
    };
    w.seen = Some(Seen {
        to_node: node,
        running_s: r,
        ready_s: fault.elapsed().as_secs_f64(),
        fence_nanos: f,
        fenced_copy: w.copy.clone(),
        fenced_generation,
    });
    Ok(())
}

/// Waits until the node is Ready, its quarantine lifted and it is schedulable, and
/// recovery released what was fenced there. Seconds from `healed`, its return.
fn wait_lifted(c: &Cluster, before: &Before, healed: Instant) -> Result<f64> {
    wait::until_explained(
        &format!("{} Ready, un-quarantined and schedulable", before.node),
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
        &format!("recovery to release {}'s fenced generation", before.w.pod),
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
