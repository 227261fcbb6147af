//! The observer: polls and watches the cluster once node A is down and records when each
//! step of the failover was first seen, per volume and overall; the scenario waits on
//! these times.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::bail;
use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, Pod};
use fencecsi_cluster::k8s_openapi::api::events::v1::Event;
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::well_known::*;
use fencecsi_cluster::{Cluster, ListParams, WatchEvent, WatchParams};
use fencecsi_embedded_cluster::sim::ready_condition;
use futures::StreamExt;

use crate::kubelet::Board;
use crate::report::Step;
use crate::standins::Task;
use crate::{Progress, NAMESPACE};

/// What the observer knows about one volume.
#[derive(Clone, Default)]
pub(super) struct VolObs {
    pub(super) pod: String,
    pub(super) pv: String,
    pub(super) handle: String,
    pub(super) old_uid: String,
    pub(super) old_generation: u64,
    pub(super) va_a: String,
    pub(super) t: BTreeMap<Step, f64>,
    pub(super) new_uid: Option<String>,
    pub(super) new_node: Option<String>,
    pub(super) fenced_copy: Option<PathBuf>,
    pub(super) fenced_path: Option<PathBuf>,
    pub(super) fenced_immutable: bool,
    pub(super) deleted_with_condition: bool,
}

#[derive(Default)]
pub(super) struct Obs {
    pub(super) steps: BTreeMap<Step, f64>,
    pub(super) vols: Vec<VolObs>,
    pub(super) problems: Vec<String>,
}

pub(super) type Shared = Arc<Mutex<Obs>>;

pub(super) fn mark(o: &mut Obs, step: Step, t: f64, p: &Progress, detail: &str) {
    if let std::collections::btree_map::Entry::Vacant(e) = o.steps.entry(step) {
        e.insert(t);
        p.say(format!("STEP {:?}: {}{detail}", step, step.describe()));
    }
}

fn has_taint(n: &Node, key: &str) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key))
}

/// Pod deletions by uid: when the watch delivered each, and whether the object as
/// deleted carried the disruption condition, phase Failed and no grace period.
type Deletions = Arc<Mutex<HashMap<String, (f64, bool)>>>;

/// Node A's transitions, timed as the watch delivers them.
type NodeTimes = Arc<Mutex<BTreeMap<Step, f64>>>;

/// Polls the cluster and records when each step was first seen.
pub(super) fn observer(
    cluster: Cluster,
    node_a: String,
    state_dir: PathBuf,
    evidence: PathBuf,
    board: Board,
    shared: Shared,
    progress: Progress,
) -> Task {
    let (deletions, watch) = watch_deletions(&cluster, &progress);
    let (node_times, node_watch) = watch_node(&cluster, &node_a, &progress);
    let o = Observer {
        cluster,
        node_a,
        state_dir,
        evidence,
        board,
        shared,
        progress,
        deletions,
        node_times,
    };
    Task(tokio::spawn(async move {
        let _watch = Task(watch);
        let _node_watch = Task(node_watch);
        loop {
            if let Err(e) = o.observe_once().await {
                tracing::debug!(error = %format!("{e:#}"), "observer");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }))
}

/// Watches the namespace's pods for deletions, with the object as deleted.
fn watch_deletions(
    cluster: &Cluster,
    progress: &Progress,
) -> (Deletions, tokio::task::JoinHandle<()>) {
    let deletions = Deletions::default();
    let (del, c, prog) = (deletions.clone(), cluster.clone(), progress.clone());
    let task = tokio::spawn(async move {
        let Ok(mut w) = c.api::<Pod>(Some(NAMESPACE)).watch(&WatchParams::default()) else {
            return;
        };
        while let Some(ev) = w.next().await {
            if let WatchEvent::Deleted(p) = ev {
                let cond = p
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| {
                        // Whoever started the disruption (the taint manager's eviction,
                        // or podgc) names it; podgc keeps the reason it finds.
                        cs.iter()
                            .any(|c| c.type_ == DISRUPTION_TARGET_CONDITION && c.status == "True")
                    })
                    && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")
                    && p.metadata.deletion_grace_period_seconds == Some(0);
                del.lock().unwrap().insert(
                    p.metadata.uid.clone().unwrap_or_default(),
                    (prog.elapsed().as_secs_f64(), cond),
                );
            }
        }
    });
    (deletions, task)
}

/// Watches node A and times its transitions.
fn watch_node(
    cluster: &Cluster,
    node_a: &str,
    progress: &Progress,
) -> (NodeTimes, tokio::task::JoinHandle<()>) {
    let node_times = NodeTimes::default();
    let (nt, c, prog, na) = (
        node_times.clone(),
        cluster.clone(),
        progress.clone(),
        node_a.to_string(),
    );
    let task = tokio::spawn(async move {
        let params = WatchParams::default().fields(&format!("metadata.name={na}"));
        let Ok(mut w) = c.api::<Node>(None).watch(&params) else {
            return;
        };
        while let Some(ev) = w.next().await {
            let nodes = match ev {
                WatchEvent::Listed(v) => v,
                WatchEvent::Added(n) | WatchEvent::Modified(n) => vec![n],
                WatchEvent::Deleted(_) => vec![],
            };
            let t = prog.elapsed().as_secs_f64();
            let mut m = nt.lock().unwrap();
            for n in nodes {
                note_node_steps(&n, t, &mut m);
            }
        }
    });
    (node_times, task)
}

/// The steps this version of node A shows, first seen at `t`.
fn note_node_steps(n: &Node, t: f64, m: &mut BTreeMap<Step, f64>) {
    if ready_condition(n).is_some_and(|c| c.status != "True") {
        m.entry(Step::NotReady).or_insert(t);
    }
    let q = has_taint(n, QUARANTINE_TAINT_KEY);
    if q {
        m.entry(Step::Quarantined).or_insert(t);
    }
    if !m.contains_key(&Step::Quarantined) {
        return;
    }
    // A report counts once it is newer than quarantined-at, which podgc re-stamps when
    // the fences are done (an earlier report is stale).
    let a = n.metadata.annotations.clone().unwrap_or_default();
    let ts = |k: &str| {
        a.get(k).and_then(|v| {
            v.parse::<fencecsi_cluster::k8s_openapi::jiff::Timestamp>()
                .ok()
        })
    };
    let counts = a.contains_key(fencecsi_podgc::annotations::FENCES_DONE)
        && matches!(
            (ts(NODE_CLEAN_ANNOTATION), ts(QUARANTINED_AT_ANNOTATION)),
            (Some(c), Some(q)) if c > q
        );
    if counts {
        m.entry(Step::NodeCleaned).or_insert(t);
    }
    if !q {
        m.entry(Step::QuarantineLifted).or_insert(t);
    }
}

/// What one polling pass reads and where it records.
struct Observer {
    cluster: Cluster,
    node_a: String,
    state_dir: PathBuf,
    evidence: PathBuf,
    board: Board,
    shared: Shared,
    progress: Progress,
    deletions: Deletions,
    node_times: NodeTimes,
}

impl Observer {
    async fn observe_once(&self) -> anyhow::Result<()> {
        let t = self.progress.elapsed().as_secs_f64();
        let (armed, mut vols) = {
            let o = self.shared.lock().unwrap();
            (o.steps.contains_key(&Step::NodeDown), o.vols.clone())
        };
        if !armed {
            return Ok(());
        }
        let node = self.cluster.api::<Node>(None).get(&self.node_a).await?;
        // Every polled step is stamped with this pass's time, and each pass looks for the
        // later steps first: a step seen in this pass finds the (lasting) steps before it
        // already true when they are looked at next, so polled stamps follow the causal
        // order. Steps timed by a watch (the deletion, the quarantine) are clamped to the
        // polled steps that prove them below.
        self.poll_replacements(&mut vols, t).await?;
        self.poll_fences_and_deletions(&mut vols, t).await?;
        let nt = self.node_times.lock().unwrap().clone();
        let mut o = self.shared.lock().unwrap();
        o.vols = vols.clone();
        let clean = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NODE_CLEAN_ANNOTATION))
            .cloned()
            .unwrap_or_default();
        self.mark_node_steps(&mut o, nt, &vols, &clean);
        self.mark_volume_steps(&mut o, &vols);
        Ok(())
    }

    /// The replacement pods: re-created, attached on their node, published there.
    async fn poll_replacements(&self, vols: &mut [VolObs], t: f64) -> anyhow::Result<()> {
        let pods = self.cluster.api::<Pod>(Some(NAMESPACE));
        let vas = self.cluster.api::<VolumeAttachment>(None);
        for v in vols.iter_mut() {
            if let (Some(u), false) = (&v.new_uid, v.t.contains_key(&Step::PublishedOnB)) {
                if self.board.by_uid(u).is_some() {
                    v.t.insert(Step::PublishedOnB, t);
                }
            }
            if let (Some(n), false) = (&v.new_node, v.t.contains_key(&Step::AttachedOnB)) {
                let name = volume_attachment_name(&v.handle, DRIVER_NAME, n);
                if vas
                    .get_opt(&name)
                    .await?
                    .and_then(|va| va.status)
                    .is_some_and(|s| s.attached)
                {
                    v.t.insert(Step::AttachedOnB, t);
                }
            }
            if v.new_uid.is_none() {
                if let Some(p) = pods.get_opt(&v.pod).await? {
                    if p.metadata.uid.as_deref() != Some(v.old_uid.as_str())
                        && p.metadata.deletion_timestamp.is_none()
                    {
                        v.new_uid = p.metadata.uid.clone();
                        v.new_node = p.spec.and_then(|s| s.node_name);
                        v.t.insert(Step::PodRecreated, t);
                    }
                }
            }
        }
        Ok(())
    }

    /// The old side: the fence (its Event; the fenced generation is copied then), the
    /// attachment gone, the old pod's deletion.
    async fn poll_fences_and_deletions(&self, vols: &mut [VolObs], t: f64) -> anyhow::Result<()> {
        let vas = self.cluster.api::<VolumeAttachment>(None);
        let fenced_events = self
            .cluster
            .api::<Event>(None)
            .list_filtered(&ListParams::default(), |e| {
                e.reason.as_deref() == Some(fencecsi_attacher::REASON_FENCED)
            })
            .await?;
        for v in vols.iter_mut() {
            if !v.t.contains_key(&Step::Fenced)
                && fenced_events.iter().any(|e| {
                    e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(v.va_a.as_str())
                })
            {
                v.t.insert(Step::Fenced, t);
                note_fenced_copy(
                    &self.state_dir,
                    &self.evidence,
                    v,
                    &self.shared,
                    &self.progress,
                )
                .await?;
            }
            if !v.t.contains_key(&Step::AttachmentDeleted) && vas.get_opt(&v.va_a).await?.is_none()
            {
                v.t.insert(Step::AttachmentDeleted, t);
            }
            // Timed by the Pod watch as it delivered the deletion, or by the pass that saw
            // what follows it (the re-created pod, the fence, the attachment gone) if that
            // came first: the old pod was gone by then.
            if !v.t.contains_key(&Step::ForceDeleted) {
                if let Some((dt, cond)) = self.deletions.lock().unwrap().get(&v.old_uid).copied() {
                    let seen = [Step::PodRecreated, Step::Fenced, Step::AttachmentDeleted]
                        .iter()
                        .filter_map(|s| v.t.get(s))
                        .fold(dt, |a, &b| a.min(b));
                    v.t.insert(Step::ForceDeleted, seen);
                    v.deleted_with_condition = cond;
                }
            }
        }
        Ok(())
    }

    /// Records node A's steps as the watch timed them.
    fn mark_node_steps(&self, o: &mut Obs, nt: BTreeMap<Step, f64>, vols: &[VolObs], clean: &str) {
        for (step, when) in nt {
            let detail = if step == Step::NodeCleaned {
                format!(" ({NODE_CLEAN_ANNOTATION}={clean})")
            } else {
                String::new()
            };
            // The Node watch may deliver the quarantine after a pass saw an attachment
            // gone, which follows it (podgc quarantines before anything is detached).
            let when = if step == Step::Quarantined {
                vols.iter()
                    .filter_map(|v| v.t.get(&Step::AttachmentDeleted))
                    .fold(when, |a, &b| a.min(b))
            } else {
                when
            };
            if step != Step::QuarantineLifted || o.steps.contains_key(&Step::NodeCleaned) {
                mark(o, step, when, &self.progress, &detail);
            }
        }
    }

    /// Records each per-volume step once every volume reached it, at the last one's time.
    fn mark_volume_steps(&self, o: &mut Obs, vols: &[VolObs]) {
        for step in [
            Step::ForceDeleted,
            Step::AttachmentDeleted,
            Step::Fenced,
            Step::PodRecreated,
            Step::AttachedOnB,
            Step::PublishedOnB,
        ] {
            if vols.iter().all(|v| v.t.contains_key(&step)) {
                let when = vols.iter().map(|v| v.t[&step]).fold(0.0, f64::max);
                let detail = match step {
                    Step::PodRecreated => format!(
                        " [{}]",
                        vols.iter()
                            .map(|v| format!(
                                "{} on {}",
                                v.pod,
                                v.new_node.clone().unwrap_or_default()
                            ))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    _ => String::new(),
                };
                if let std::collections::btree_map::Entry::Vacant(e) = o.steps.entry(step) {
                    e.insert(when);
                    self.progress
                        .say(format!("STEP {step:?}: {}{detail}", step.describe()));
                }
            }
        }
    }
}

/// Waits until the observer (or the scenario) has recorded `step`; returns its time.
pub(super) async fn wait_step(
    shared: &Shared,
    step: Step,
    timeout: Duration,
) -> anyhow::Result<f64> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(t) = shared.lock().unwrap().steps.get(&step) {
            return Ok(*t);
        }
        if Instant::now() > deadline {
            let o = shared.lock().unwrap();
            let reached: Vec<String> = o.steps.keys().map(|s| format!("{s:?}")).collect();
            bail!(
                "timed out after {:?} waiting for {step:?} ({}); reached: {}",
                timeout,
                step.describe(),
                reached.join(", ")
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Copies the fenced generation of `v` for the comparison at the end and notes
/// the copy in `v`; a failed copy is a problem of the run, not of the poll.
async fn note_fenced_copy(
    state_dir: &Path,
    evidence: &Path,
    v: &mut VolObs,
    shared: &Shared,
    progress: &Progress,
) -> anyhow::Result<()> {
    let copied =
        super::evidence::copy_fenced_generation(state_dir, evidence, &v.handle, v.old_generation)
            .await?;
    match copied {
        Ok(c) => {
            progress.say(format!(
                "observer: {} fenced: generation {} ({}) immutable={}, copied for comparison",
                v.pod,
                v.old_generation,
                c.source.display(),
                c.immutable
            ));
            v.fenced_immutable = c.immutable;
            v.fenced_copy = Some(c.copy);
            v.fenced_path = Some(c.source);
        }
        Err(e) => shared.lock().unwrap().problems.push(format!(
            "copying the fenced generation {} of {}: {e}",
            v.old_generation, v.handle
        )),
    }
    Ok(())
}
