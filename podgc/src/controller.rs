//! The controller loop.
//!
//! One task owns everything: it applies watch events of Nodes, node Leases,
//! VolumeAttachments and CSIDrivers to small projections, and runs a *pass* when a relevant
//! event arrived (after a short debounce), when a NotReady node crosses its grace period,
//! and at least every `resync_interval`. Pods are never watched or listed in full: a pass
//! lists the pods of each node it acts on with the `spec.nodeName` field selector.
//!
//! ## Quarantine and the clean report
//!
//! The node plugin reports the node clean (`fencecsi.io/node-clean`, an RFC 3339 time) after
//! a recovery pass that found nothing fenced, with the time that pass *started*. A report
//! taken before the attacher made the fences proves nothing: the node would then still hold
//! the frozen generations. So podgc re-stamps `fencecsi.io/quarantined-at` when it sees the
//! node's last VolumeAttachment of a safe-detach driver go (the attacher removes its
//! finalizer only after `ControllerUnpublishVolume(fence = true)` returned), marking that
//! with `podgc.fencecsi.io/fences-done`. A clean report counts only if it is newer than
//! that; reporters that find their report too old answer "report again" and the node
//! plugin does so after its next pass. Times are compared across clocks (the node's and
//! podgc's): keep them in sync (NTP), as Kubernetes itself expects.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencecsi_cluster::k8s_openapi::api::coordination::v1::Lease;
use fencecsi_cluster::k8s_openapi::api::core::v1::{
    Node, ObjectReference, Pod, PodCondition, Taint,
};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{CSIDriver, VolumeAttachment};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use fencecsi_cluster::k8s_openapi::jiff::{SignedDuration, Timestamp};
use fencecsi_cluster::well_known::{
    DELETION_BY_PODGC_REASON, DISRUPTION_TARGET_CONDITION, NODE_CLEAN_ANNOTATION,
    NODE_LEASE_NAMESPACE, OUT_OF_SERVICE_TAINT_KEY, OUT_OF_SERVICE_TAINT_VALUE,
    QUARANTINED_AT_ANNOTATION, QUARANTINE_TAINT_KEY, QUARANTINE_TAINT_VALUE,
    SAFE_DETACH_ANNOTATION,
};
use fencecsi_cluster::{
    object_ref, Cluster, DeleteOptions, DeleteOutcome, EventRecorder, EventType, LeaderElector,
    LeaderHandle, ListParams, MetadataPatch, WatchEvent, WatchParams, WatchStream,
    ELECTION_UNHEALTHY_AFTER,
};
use futures::StreamExt;
use tokio::sync::{oneshot, watch};

use crate::annotations::{FENCES_DONE, OUT_OF_SERVICE_ADDED};
use crate::config::PodGcConfig;
use crate::http::Liveness;
use crate::metrics::Metrics;
use crate::volumes::Resolver;
use crate::CONTROLLER_NAME;

fn now() -> Timestamp {
    Timestamp::now()
}

fn sd(d: Duration) -> SignedDuration {
    SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX)
}

fn parse_time(s: Option<&String>) -> Option<Timestamp> {
    s.and_then(|s| s.parse::<Timestamp>().ok())
}

/// Readiness of a node as its Ready condition says.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Readiness {
    True,
    /// False or Unknown since this time.
    NotReady(Timestamp),
    /// No Ready condition (never posted status).
    Missing,
}

/// What podgc keeps of a Node.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NodeInfo {
    ready: Readiness,
    quarantined: bool,
    quarantined_at: Option<Timestamp>,
    clean_at: Option<Timestamp>,
    fences_done: bool,
    oos_added: bool,
}

impl NodeInfo {
    fn of(n: &Node, previous: Option<&NodeInfo>) -> NodeInfo {
        let cond = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
        let ready = match cond {
            None => Readiness::Missing,
            Some(c) if c.status == "True" => Readiness::True,
            Some(c) => {
                let since = c.last_transition_time.as_ref().map(|t| t.0).unwrap_or_else(
                    // No transition time: from when we first saw it NotReady.
                    || match previous.map(|p| &p.ready) {
                        Some(Readiness::NotReady(t)) => *t,
                        _ => now(),
                    },
                );
                Readiness::NotReady(since)
            }
        };
        let ann = n.metadata.annotations.as_ref();
        let get = |k: &str| ann.and_then(|a| a.get(k));
        NodeInfo {
            ready,
            quarantined: taints(n).iter().any(|t| t.key == QUARANTINE_TAINT_KEY),
            quarantined_at: parse_time(get(QUARANTINED_AT_ANNOTATION)),
            clean_at: parse_time(get(NODE_CLEAN_ANNOTATION)),
            fences_done: get(FENCES_DONE).is_some(),
            oos_added: get(OUT_OF_SERVICE_ADDED).is_some(),
        }
    }
}

fn taints(n: &Node) -> &[Taint] {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or(&[])
}

#[derive(Debug, Clone)]
struct LeaseInfo {
    renew: Option<String>,
    /// podgc's clock when it saw `renew` change.
    observed: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct VaInfo {
    node: String,
    pv: Option<String>,
    attacher: String,
    deleting: bool,
}

impl VaInfo {
    fn of(va: &VolumeAttachment) -> VaInfo {
        VaInfo {
            node: va.spec.node_name.clone(),
            pv: va.spec.source.persistent_volume_name.clone(),
            attacher: va.spec.attacher.clone(),
            deleting: va.metadata.deletion_timestamp.is_some(),
        }
    }
}

/// The projections the watches feed.
#[derive(Default)]
struct Caches {
    nodes: HashMap<String, NodeInfo>,
    leases: HashMap<String, LeaseInfo>,
    vas: HashMap<String, VaInfo>,
    vas_by_node: HashMap<String, HashSet<String>>,
    /// CSIDriver name -> carries safe-detach "true".
    drivers: HashMap<String, bool>,
    synced_nodes: bool,
    synced_leases: bool,
    synced_vas: bool,
    synced_drivers: bool,
}

impl Caches {
    fn synced(&self) -> bool {
        self.synced_nodes && self.synced_leases && self.synced_vas && self.synced_drivers
    }

    /// Returns whether a pass should follow soon.
    fn apply_node(&mut self, ev: WatchEvent<Node>) -> bool {
        let upsert = |c: &mut Caches, n: &Node| -> bool {
            let name = n.metadata.name.clone().unwrap_or_default();
            let info = NodeInfo::of(n, c.nodes.get(&name));
            c.nodes.insert(name, info.clone()) != Some(info)
        };
        match ev {
            WatchEvent::Listed(items) => {
                let old = std::mem::take(&mut self.nodes);
                for n in &items {
                    let name = n.metadata.name.clone().unwrap_or_default();
                    let info = NodeInfo::of(n, old.get(&name));
                    self.nodes.insert(name, info);
                }
                self.synced_nodes = true;
                true
            }
            WatchEvent::Added(n) | WatchEvent::Modified(n) => upsert(self, &n),
            WatchEvent::Deleted(n) => {
                let name = n.metadata.name.clone().unwrap_or_default();
                self.nodes.remove(&name).is_some()
            }
        }
    }

    fn apply_lease(&mut self, ev: WatchEvent<Lease>) -> bool {
        let renew_of = |l: &Lease| {
            l.spec
                .as_ref()
                .and_then(|s| s.renew_time.as_ref())
                .map(|t| t.0.to_string())
        };
        let now = now();
        let upsert = |c: &mut HashMap<String, LeaseInfo>, old: Option<&LeaseInfo>, l: &Lease| {
            let name = l.metadata.name.clone().unwrap_or_default();
            let renew = renew_of(l);
            let observed = match old {
                Some(o) if o.renew == renew => o.observed,
                _ => now,
            };
            c.insert(name, LeaseInfo { renew, observed });
        };
        match ev {
            WatchEvent::Listed(items) => {
                let old = std::mem::take(&mut self.leases);
                for l in &items {
                    let name = l.metadata.name.clone().unwrap_or_default();
                    upsert(&mut self.leases, old.get(&name), l);
                }
                self.synced_leases = true;
                true
            }
            WatchEvent::Added(l) | WatchEvent::Modified(l) => {
                let name = l.metadata.name.clone().unwrap_or_default();
                let old = self.leases.get(&name).cloned();
                upsert(&mut self.leases, old.as_ref(), &l);
                // A renewal of a lease we counted as stale makes the node healthy again.
                false
            }
            WatchEvent::Deleted(l) => {
                self.leases.remove(&l.metadata.name.unwrap_or_default());
                false
            }
        }
    }

    fn remove_va(&mut self, name: &str) -> Option<VaInfo> {
        let old = self.vas.remove(name)?;
        if let Some(set) = self.vas_by_node.get_mut(&old.node) {
            set.remove(name);
            if set.is_empty() {
                self.vas_by_node.remove(&old.node);
            }
        }
        Some(old)
    }

    fn put_va(&mut self, va: &VolumeAttachment) -> (Option<VaInfo>, VaInfo) {
        let name = va.metadata.name.clone().unwrap_or_default();
        let old = self.remove_va(&name);
        let info = VaInfo::of(va);
        self.vas_by_node
            .entry(info.node.clone())
            .or_default()
            .insert(name.clone());
        self.vas.insert(name, info.clone());
        (old, info)
    }

    fn apply_va(&mut self, ev: WatchEvent<VolumeAttachment>) -> bool {
        let quarantined = |c: &Caches, node: &str| c.nodes.get(node).is_some_and(|n| n.quarantined);
        match ev {
            WatchEvent::Listed(items) => {
                self.vas.clear();
                self.vas_by_node.clear();
                for va in &items {
                    self.put_va(va);
                }
                self.synced_vas = true;
                true
            }
            WatchEvent::Added(va) | WatchEvent::Modified(va) => {
                let (old, new) = self.put_va(&va);
                old.as_ref() != Some(&new) && quarantined(self, &new.node)
            }
            WatchEvent::Deleted(va) => {
                let name = va.metadata.name.clone().unwrap_or_default();
                self.remove_va(&name)
                    .is_some_and(|old| quarantined(self, &old.node))
            }
        }
    }

    fn apply_driver(&mut self, ev: WatchEvent<CSIDriver>) -> bool {
        let safe = |d: &CSIDriver| {
            d.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SAFE_DETACH_ANNOTATION))
                .is_some_and(|v| v == "true")
        };
        match ev {
            WatchEvent::Listed(items) => {
                self.drivers = items
                    .iter()
                    .map(|d| (d.metadata.name.clone().unwrap_or_default(), safe(d)))
                    .collect();
                self.synced_drivers = true;
            }
            WatchEvent::Added(d) | WatchEvent::Modified(d) => {
                self.drivers
                    .insert(d.metadata.name.clone().unwrap_or_default(), safe(&d));
            }
            WatchEvent::Deleted(d) => {
                self.drivers.remove(&d.metadata.name.unwrap_or_default());
            }
        }
        true
    }

    fn safe_vas_on(&self, node: &str) -> usize {
        self.vas_by_node.get(node).map_or(0, |set| {
            set.iter()
                .filter(|n| {
                    self.vas
                        .get(*n)
                        .is_some_and(|v| self.drivers.get(&v.attacher).copied().unwrap_or(false))
                })
                .count()
        })
    }
}

/// What one pass did (published after every pass; tests and the drill wait on it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassSummary {
    pub seq: u64,
    pub leader: bool,
    pub nodes: usize,
    pub unhealthy: usize,
    pub disruption_mode: bool,
    pub quarantined_now: Vec<String>,
    pub force_deleted: Vec<String>,
    pub skipped: Vec<String>,
    pub volume_attachments_deleted: Vec<String>,
    pub lifted: Vec<String>,
    /// Nodes carrying the quarantine taint after the pass.
    pub quarantined: usize,
}

/// Result of [`disrupt_and_delete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteResult {
    /// Force-deleted (it may linger while other finalizers are pending).
    Deleted,
    /// Already gone.
    Gone,
    /// The name now belongs to another pod (new UID): left alone.
    Recreated,
}

/// Marks `pod` with a `DisruptionTarget` condition (reason `DeletionByPodGC`, `message`)
/// through the status subresource, then force-deletes it (grace 0) with a UID
/// precondition. Both steps are bound to the pod's UID: a pod re-created under the same
/// name is never touched.
pub async fn disrupt_and_delete(
    cluster: &Cluster,
    pod: &Pod,
    message: &str,
) -> fencecsi_cluster::Result<DeleteResult> {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let pods = cluster.api::<Pod>(Some(&ns));
    let mut current = pod.clone();
    for attempt in 0..5 {
        if attempt > 0 {
            match pods.get_opt(&name).await? {
                None => return Ok(DeleteResult::Gone),
                Some(p) if p.metadata.uid.as_deref() != Some(uid.as_str()) => {
                    return Ok(DeleteResult::Recreated)
                }
                Some(p) => current = p,
            }
        }
        let mut p = current.clone();
        let conds = p
            .status
            .get_or_insert_with(Default::default)
            .conditions
            .get_or_insert_with(Vec::new);
        let already = conds.iter().any(|c| {
            c.type_ == DISRUPTION_TARGET_CONDITION
                && c.status == "True"
                && c.reason.as_deref() == Some(DELETION_BY_PODGC_REASON)
        });
        if already {
            break;
        }
        conds.retain(|c| c.type_ != DISRUPTION_TARGET_CONDITION);
        conds.push(PodCondition {
            type_: DISRUPTION_TARGET_CONDITION.into(),
            status: "True".into(),
            reason: Some(DELETION_BY_PODGC_REASON.into()),
            message: Some(message.to_string()),
            last_transition_time: Some(Time(
                Timestamp::from_second(now().as_second()).unwrap_or_else(|_| now()),
            )),
            ..Default::default()
        });
        // The uid in the object makes the write conditional on it, like the resourceVersion.
        p.metadata.uid = Some(uid.clone());
        match pods.replace_status(&p).await {
            Ok(_) => break,
            Err(e) if e.is_not_found() => return Ok(DeleteResult::Gone),
            Err(e) if e.is_conflict() => continue,
            Err(e) => return Err(e),
        }
    }
    match pods
        .delete(&name, &DeleteOptions::force().with_uid(&uid))
        .await
    {
        Ok(DeleteOutcome::Deleted) | Ok(DeleteOutcome::Terminating(_)) => Ok(DeleteResult::Deleted),
        Err(e) if e.is_not_found() => Ok(DeleteResult::Gone),
        Err(e) if e.is_conflict() => Ok(DeleteResult::Recreated),
        Err(e) => Err(e),
    }
}

/// The controller.
pub struct PodGc {
    cluster: Cluster,
    cfg: PodGcConfig,
    metrics: Arc<Metrics>,
    liveness: Arc<Liveness>,
}

/// A spawned [`PodGc`].
pub struct PodGcHandle {
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    metrics: Arc<Metrics>,
    passes: watch::Receiver<PassSummary>,
}

impl PodGcHandle {
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Summaries of passes as they finish.
    pub fn passes(&self) -> watch::Receiver<PassSummary> {
        self.passes.clone()
    }

    /// Waits for the next pass to finish (one that started after this call, roughly: the
    /// next published summary) and returns it.
    pub async fn next_pass(&self) -> PassSummary {
        let mut rx = self.passes.clone();
        rx.borrow_and_update();
        let _ = rx.changed().await;
        let v = rx.borrow().clone();
        v
    }

    /// Graceful stop: finishes the current pass, releases the leader lease.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.task.take() {
            Some(t) => t.await?,
            None => Ok(()),
        }
    }
}

impl Drop for PodGcHandle {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

struct Runner {
    cluster: Cluster,
    cfg: PodGcConfig,
    metrics: Arc<Metrics>,
    recorder: EventRecorder,
    caches: Caches,
    in_disruption: bool,
    /// Pod UIDs already warned about (per node), so a skipped pod gets one Event.
    warned: HashMap<String, HashSet<String>>,
    seq: u64,
    lease_ref: ObjectReference,
}

impl PodGc {
    pub fn new(cluster: Cluster, cfg: PodGcConfig) -> Self {
        PodGc {
            cluster,
            liveness: Arc::new(Liveness::new(
                cfg.resync_interval * 6 + Duration::from_secs(30),
            )),
            cfg,
            metrics: Arc::new(Metrics::new()),
        }
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    pub fn liveness(&self) -> Arc<Liveness> {
        self.liveness.clone()
    }

    /// Runs in a task until [`PodGcHandle::shutdown`].
    pub fn spawn(self) -> PodGcHandle {
        let (stop, rx) = oneshot::channel::<()>();
        let (ptx, prx) = watch::channel(PassSummary::default());
        let metrics = self.metrics.clone();
        let task = tokio::spawn(async move {
            self.run_with(
                async move {
                    let _ = rx.await;
                },
                Some(ptx),
            )
            .await
        });
        PodGcHandle {
            stop: Some(stop),
            task: Some(task),
            metrics,
            passes: prx,
        }
    }

    /// Runs until `shutdown` resolves; then finishes the current pass and releases the
    /// leader lease.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        self.run_with(shutdown, None).await
    }

    async fn run_with(
        self,
        shutdown: impl Future<Output = ()> + Send,
        passes: Option<watch::Sender<PassSummary>>,
    ) -> anyhow::Result<()> {
        self.cfg.validate().map_err(anyhow::Error::msg)?;
        let cfg = self.cfg.clone();
        let cluster = self.cluster.clone();
        let leader: Option<LeaderHandle> = match &cfg.leader_election {
            Some(le) => Some(LeaderElector::new(&cluster, le.clone())?.spawn()),
            None => None,
        };
        let lease_ref = match &cfg.leader_election {
            Some(le) => ObjectReference {
                api_version: Some("coordination.k8s.io/v1".into()),
                kind: Some("Lease".into()),
                name: Some(le.lease_name.clone()),
                namespace: Some(le.namespace.clone()),
                ..Default::default()
            },
            None => ObjectReference {
                api_version: Some("coordination.k8s.io/v1".into()),
                kind: Some("Lease".into()),
                name: Some("fencecsi-podgc".into()),
                namespace: Some("kube-system".into()),
                ..Default::default()
            },
        };
        let mut nodes_w = cluster.api::<Node>(None).watch(&WatchParams::default())?;
        let mut leases_w: WatchStream<Lease> = match cfg.node_lease_grace {
            Some(_) => cluster
                .api::<Lease>(Some(NODE_LEASE_NAMESPACE))
                .watch(&WatchParams::default())?,
            None => futures::stream::pending().boxed(),
        };
        let mut vas_w = cluster
            .api::<VolumeAttachment>(None)
            .watch(&WatchParams::default())?;
        let mut drivers_w = cluster
            .api::<CSIDriver>(None)
            .watch(&WatchParams::default())?;

        let mut r = Runner {
            recorder: EventRecorder::new(&cluster, CONTROLLER_NAME, &cfg.identity),
            cluster,
            cfg: cfg.clone(),
            metrics: self.metrics.clone(),
            caches: Caches {
                synced_leases: cfg.node_lease_grace.is_none(),
                ..Default::default()
            },
            in_disruption: false,
            warned: HashMap::new(),
            seq: 0,
            lease_ref,
        };
        tracing::info!(identity = %cfg.identity, shutdown_grace = ?cfg.shutdown_grace, node_lease_grace = ?cfg.node_lease_grace,
            max_unhealthy_fraction = cfg.max_unhealthy_fraction, out_of_service_taint = cfg.out_of_service_taint, "podgc starting");
        let far = tokio::time::Instant::now() + Duration::from_secs(3600 * 24 * 365);
        let mut next_pass = far;
        tokio::pin!(shutdown);
        loop {
            // Alive only while the election can work: a Lease it may not touch
            // must turn /healthz red, not leave a standby that never leads.
            match leader.as_ref() {
                Some(l) if !l.healthy(ELECTION_UNHEALTHY_AFTER) => {
                    tracing::error!(failing_for = ?l.elector().failing_for(), "leader election gets no answer from the API server (forbidden, or unreachable): reporting unhealthy");
                }
                _ => self.liveness.stamp(),
            }
            if r.caches.synced() && next_pass == far {
                next_pass = tokio::time::Instant::now();
            }
            let soon = tokio::time::Instant::now() + cfg.debounce;
            tokio::select! {
                biased;
                _ = &mut shutdown => break,
                _ = tokio::time::sleep_until(next_pass), if r.caches.synced() => {
                    let leading = leader.as_ref().is_none_or(|l| l.is_leader());
                    self.metrics.leader.set(leading as i64);
                    let start = Instant::now();
                    let summary = if leading { r.pass().await } else {
                        r.seq += 1;
                        PassSummary { seq: r.seq, leader: false, ..Default::default() }
                    };
                    self.metrics.passes.inc();
                    self.metrics.pass_duration_seconds.observe(start.elapsed().as_secs_f64());
                    if let Some(p) = &passes { p.send_replace(summary); }
                    next_pass = tokio::time::Instant::now() + r.until_next_deadline();
                }
                Some(ev) = nodes_w.next() => if r.caches.apply_node(ev) { next_pass = next_pass.min(soon) },
                Some(ev) = leases_w.next() => if r.caches.apply_lease(ev) { next_pass = next_pass.min(soon) },
                Some(ev) = vas_w.next() => if r.caches.apply_va(ev) { next_pass = next_pass.min(soon) },
                Some(ev) = drivers_w.next() => if r.caches.apply_driver(ev) { next_pass = next_pass.min(soon) },
            }
        }
        tracing::info!("podgc stopping");
        if let Some(l) = leader {
            if let Err(e) = l.shutdown().await {
                tracing::warn!(error = %e, "releasing the leader lease failed");
            }
        }
        Ok(())
    }
}

impl Runner {
    /// When the node counts as NotReady, if it does.
    fn not_ready_since(&self, name: &str, info: &NodeInfo, now: Timestamp) -> Option<Timestamp> {
        let by_condition = match info.ready {
            Readiness::NotReady(t) => Some(t),
            _ => None,
        };
        let by_lease = self.cfg.node_lease_grace.and_then(|g| {
            let l = self.caches.leases.get(name)?;
            let stale_at = l.observed + sd(g);
            (stale_at <= now).then_some(stale_at)
        });
        match (by_condition, by_lease) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Time until the next moment a node crosses a grace period, capped by the resync.
    fn until_next_deadline(&self) -> Duration {
        let now = now();
        let grace = sd(self.cfg.shutdown_grace);
        let mut next = self.cfg.resync_interval;
        let mut consider = |t: Timestamp| {
            if t > now {
                let d = Duration::try_from(t.duration_since(now)).unwrap_or(Duration::ZERO);
                next = next.min(d + Duration::from_millis(5));
            }
        };
        for (name, info) in &self.caches.nodes {
            if let Readiness::NotReady(t) = info.ready {
                consider(t + grace);
            }
            if let (Some(g), Some(l)) = (self.cfg.node_lease_grace, self.caches.leases.get(name)) {
                consider(l.observed + sd(g));
                consider(l.observed + sd(g) + grace);
            }
        }
        next
    }

    async fn event(&self, obj_ref: ObjectReference, t: EventType, reason: &str, msg: &str) {
        if let Err(e) = self.recorder.record(&obj_ref, t, reason, msg).await {
            tracing::debug!(error = %e, reason, "recording an event failed");
        }
    }

    fn node_ref(name: &str) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(name.to_string()),
            ..Default::default()
        }
    }

    async fn pass(&mut self) -> PassSummary {
        self.seq += 1;
        let now = now();
        let mut s = PassSummary {
            seq: self.seq,
            leader: true,
            nodes: self.caches.nodes.len(),
            ..Default::default()
        };
        let unhealthy: Vec<(String, Timestamp)> = self
            .caches
            .nodes
            .iter()
            .filter_map(|(n, i)| self.not_ready_since(n, i, now).map(|t| (n.clone(), t)))
            .collect();
        s.unhealthy = unhealthy.len();
        self.metrics.unhealthy_nodes.set(unhealthy.len() as i64);
        let fraction = if s.nodes == 0 {
            0.0
        } else {
            unhealthy.len() as f64 / s.nodes as f64
        };
        let disruption = fraction > self.cfg.max_unhealthy_fraction;
        self.metrics.disruption_mode.set(disruption as i64);
        s.disruption_mode = disruption;
        if disruption {
            if !self.in_disruption {
                let msg = format!(
                    "{} of {} nodes ({:.0}%) are NotReady, more than the {:.0}% podgc acts under: the fault is likely the control plane's network, not the nodes. podgc quarantines, deletes and lifts nothing until fewer nodes are NotReady.",
                    unhealthy.len(), s.nodes, fraction * 100.0, self.cfg.max_unhealthy_fraction * 100.0
                );
                tracing::warn!(
                    unhealthy = unhealthy.len(),
                    nodes = s.nodes,
                    "entering disruption mode: {msg}"
                );
                self.event(
                    self.lease_ref.clone(),
                    EventType::Warning,
                    "DisruptionMode",
                    &msg,
                )
                .await;
            }
            self.in_disruption = true;
            s.quarantined = self.count_quarantined();
            return s;
        }
        if self.in_disruption {
            let msg = format!(
                "{} of {} nodes are NotReady: podgc acts again",
                unhealthy.len(),
                s.nodes
            );
            tracing::info!("{msg}");
            self.event(
                self.lease_ref.clone(),
                EventType::Normal,
                "DisruptionModeEnded",
                &msg,
            )
            .await;
            self.in_disruption = false;
        }

        // Quarantined nodes: re-stamp after the fences, lift when clean.
        let quarantined: Vec<String> = self
            .caches
            .nodes
            .iter()
            .filter(|(_, i)| i.quarantined)
            .map(|(n, _)| n.clone())
            .collect();
        let unhealthy_set: HashSet<&str> = unhealthy.iter().map(|(n, _)| n.as_str()).collect();
        for name in quarantined {
            match self
                .maybe_lift(&name, unhealthy_set.contains(name.as_str()))
                .await
            {
                Ok(true) => s.lifted.push(name),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(node = %name, error = %e, "checking the quarantine failed")
                }
            }
        }

        let grace = sd(self.cfg.shutdown_grace);
        let mut healthy_warned: Vec<String> = Vec::new();
        for n in self.warned.keys() {
            if !unhealthy_set.contains(n.as_str()) {
                healthy_warned.push(n.clone());
            }
        }
        for n in healthy_warned {
            self.warned.remove(&n);
        }
        for (name, since) in unhealthy {
            if now.duration_since(since) < grace {
                continue;
            }
            if let Err(e) = self.handle_node(&name, since, &mut s).await {
                tracing::warn!(node = %name, error = %e, "acting on a shut-down node failed; retried next pass");
            }
        }
        s.quarantined = self.count_quarantined();
        s
    }

    fn count_quarantined(&self) -> usize {
        let n = self.caches.nodes.values().filter(|i| i.quarantined).count();
        self.metrics.quarantined_nodes.set(n as i64);
        n
    }

    /// Acts on one node that has been NotReady for longer than the grace.
    async fn handle_node(
        &mut self,
        node: &str,
        since: Timestamp,
        s: &mut PassSummary,
    ) -> anyhow::Result<()> {
        let pods = self
            .cluster
            .api::<Pod>(None)
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await?
            .items;
        let why = format!(
            "node {node} has been NotReady since {since} (longer than the shutdown grace of {}s)",
            self.cfg.shutdown_grace.as_secs()
        );
        let mut selected = Vec::new();
        let mut keep_pvs: HashSet<String> = HashSet::new();
        let mut warn = Vec::new();
        // Running pods whose every volume can be detached safely (fenced).
        let mut safe_running = 0usize;
        {
            let mut resolver = Resolver::new(&self.cluster, &self.caches.drivers);
            for pod in &pods {
                let c = resolver.classify(pod).await?;
                if pod.metadata.deletion_timestamp.is_none() {
                    if c.verdict.is_ok() && !c.pvs.is_empty() {
                        safe_running += 1;
                    }
                    keep_pvs.extend(c.pvs);
                    continue;
                }
                match c.verdict {
                    Ok(reason) => selected.push((pod.clone(), reason, c.pvs)),
                    Err((reason, detail)) => {
                        keep_pvs.extend(c.pvs);
                        warn.push((pod.clone(), reason, detail));
                    }
                }
            }
        }
        let seen: HashSet<String> = pods.iter().filter_map(|p| p.metadata.uid.clone()).collect();
        let warned = self.warned.entry(node.to_string()).or_default();
        warned.retain(|u| seen.contains(u));
        let mut to_warn = Vec::new();
        for (pod, reason, detail) in warn {
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            s.skipped.push(format!(
                "{}/{}",
                pod.metadata.namespace.as_deref().unwrap_or(""),
                pod.metadata.name.as_deref().unwrap_or("")
            ));
            if warned.insert(uid) {
                to_warn.push((pod, reason, detail));
            }
        }
        for (pod, reason, detail) in to_warn {
            self.metrics.skipped(reason.as_str());
            let msg = format!("{why}, but podgc leaves this terminating pod alone: {detail}. Delete it by hand once the node is known to be off.");
            tracing::warn!(pod = %format!("{}/{}", pod.metadata.namespace.as_deref().unwrap_or(""), pod.metadata.name.as_deref().unwrap_or("")), node, reason = reason.as_str(), "{msg}");
            self.event(
                object_ref(&pod),
                EventType::Warning,
                "ForceDeleteSkipped",
                &msg,
            )
            .await;
        }

        // With the out-of-service taint, podgc need not wait for pods to be
        // evicted by their NoExecute tolerations (300 s by default): the taint
        // it adds with the quarantine is tolerated by nothing by default, so
        // the node's stateful pods are evicted at once and force-deleted on
        // the next pass. Without it, podgc only acts on pods already terminating.
        if selected.is_empty() && safe_running > 0 && self.cfg.out_of_service_taint {
            if self.ensure_quarantine(node, &why).await? {
                s.quarantined_now.push(node.to_string());
                tracing::warn!(node, pods = safe_running, "quarantined with the out-of-service taint so its stateful pods are evicted now");
            }
        }
        if !selected.is_empty() {
            if self.ensure_quarantine(node, &why).await? {
                s.quarantined_now.push(node.to_string());
            }
            let msg = format!("{why}; podgc force-deletes this terminating pod and detaches its volumes with a write fence");
            let mut names = Vec::new();
            for (pod, reason, pvs) in selected {
                let full = format!(
                    "{}/{}",
                    pod.metadata.namespace.as_deref().unwrap_or(""),
                    pod.metadata.name.as_deref().unwrap_or("")
                );
                match disrupt_and_delete(&self.cluster, &pod, &msg).await {
                    Ok(DeleteResult::Deleted) => {
                        self.metrics.force_deleted(reason.as_str());
                        tracing::info!(pod = %full, node, reason = reason.as_str(), "terminating pod force-deleted");
                        names.push(full.clone());
                        s.force_deleted.push(full);
                    }
                    Ok(DeleteResult::Gone) => {}
                    Ok(DeleteResult::Recreated) => {
                        tracing::info!(pod = %full, node, "pod was re-created under the same name; left alone");
                    }
                    Err(e) => {
                        tracing::warn!(pod = %full, node, error = %e, "force delete failed; retried next pass");
                        keep_pvs.extend(pvs);
                    }
                }
            }
            if !names.is_empty() {
                let mut list = names.join(", ");
                if list.len() > 600 {
                    list.truncate(600);
                    list.push_str(", ...");
                }
                self.event(
                    Self::node_ref(node),
                    EventType::Warning,
                    "TerminatingPodsForceDeleted",
                    &format!(
                        "{why}: force-deleted {} terminating pod(s): {list}",
                        names.len()
                    ),
                )
                .await;
            }
        }

        // Detach what nothing on the node uses any more (also retries of earlier passes).
        if self.caches.nodes.get(node).is_some_and(|i| i.quarantined) {
            let names: Vec<String> = self
                .caches
                .vas_by_node
                .get(node)
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default();
            let mut deleted_any = false;
            for va_name in names {
                let Some(va) = self.caches.vas.get(&va_name).cloned() else {
                    continue;
                };
                if va.deleting
                    || !self
                        .caches
                        .drivers
                        .get(&va.attacher)
                        .copied()
                        .unwrap_or(false)
                {
                    continue;
                }
                let Some(pv) = va.pv.as_ref() else { continue };
                if keep_pvs.contains(pv) {
                    continue;
                }
                match self
                    .cluster
                    .api::<VolumeAttachment>(None)
                    .delete(&va_name, &DeleteOptions::default())
                    .await
                {
                    Ok(_) | Err(fencecsi_cluster::Error::NotFound(_)) => {
                        tracing::info!(node, volume_attachment = %va_name, pv = %pv, "VolumeAttachment deleted: the attacher detaches with a fence");
                        self.metrics.volume_attachments_deleted.inc();
                        if let Some(v) = self.caches.vas.get_mut(&va_name) {
                            v.deleting = true;
                        }
                        s.volume_attachments_deleted.push(va_name);
                        deleted_any = true;
                    }
                    Err(e) => {
                        tracing::warn!(node, volume_attachment = %va_name, error = %e, "deleting VolumeAttachment failed; retried next pass")
                    }
                }
            }
            if deleted_any && self.caches.nodes.get(node).is_some_and(|i| i.fences_done) {
                self.patch_node(node, MetadataPatch::new().remove_annotation(FENCES_DONE))
                    .await?;
            }
        }
        Ok(())
    }

    async fn patch_node(&mut self, node: &str, patch: MetadataPatch) -> anyhow::Result<()> {
        let n = self
            .cluster
            .api::<Node>(None)
            .patch_metadata(node, &patch)
            .await?;
        let info = NodeInfo::of(&n, self.caches.nodes.get(node));
        self.caches.nodes.insert(node.to_string(), info);
        Ok(())
    }

    /// Taints and annotates the node (one write). Returns whether it was not quarantined yet.
    async fn ensure_quarantine(&mut self, node: &str, why: &str) -> anyhow::Result<bool> {
        let nodes = self.cluster.api::<Node>(None);
        for _ in 0..5 {
            let mut n = nodes.get(node).await?;
            let has = |n: &Node, k: &str| taints(n).iter().any(|t| t.key == k);
            let annotated = n
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(QUARANTINED_AT_ANNOTATION));
            let want_oos = self.cfg.out_of_service_taint && !has(&n, OUT_OF_SERVICE_TAINT_KEY);
            if has(&n, QUARANTINE_TAINT_KEY) && annotated && !want_oos {
                let info = NodeInfo::of(&n, self.caches.nodes.get(node));
                self.caches.nodes.insert(node.to_string(), info);
                return Ok(false);
            }
            let stamp = Some(Time(
                Timestamp::from_second(now().as_second()).unwrap_or_else(|_| now()),
            ));
            let spec = n.spec.get_or_insert_with(Default::default);
            let list = spec.taints.get_or_insert_with(Vec::new);
            if !list.iter().any(|t| t.key == QUARANTINE_TAINT_KEY) {
                list.push(Taint {
                    key: QUARANTINE_TAINT_KEY.into(),
                    value: Some(QUARANTINE_TAINT_VALUE.into()),
                    effect: "NoSchedule".into(),
                    time_added: stamp.clone(),
                });
            }
            let ann = n.metadata.annotations.get_or_insert_with(Default::default);
            if want_oos {
                list.push(Taint {
                    key: OUT_OF_SERVICE_TAINT_KEY.into(),
                    value: Some(OUT_OF_SERVICE_TAINT_VALUE.into()),
                    effect: "NoExecute".into(),
                    time_added: stamp,
                });
                ann.insert(OUT_OF_SERVICE_ADDED.into(), "true".into());
            }
            ann.entry(QUARANTINED_AT_ANNOTATION.into())
                .or_insert_with(|| now().to_string());
            ann.remove(FENCES_DONE);
            match nodes.replace(&n).await {
                Ok(written) => {
                    let info = NodeInfo::of(&written, self.caches.nodes.get(node));
                    self.caches.nodes.insert(node.to_string(), info);
                    self.metrics.quarantines.inc();
                    let msg = format!("{why}: podgc quarantined the node ({QUARANTINE_TAINT_KEY}:NoSchedule{}) before force-deleting its terminating pods; the quarantine is lifted once the node is Ready again and its node plugin reports it released every fenced volume",
                        if want_oos { format!(", {OUT_OF_SERVICE_TAINT_KEY}:NoExecute") } else { String::new() });
                    tracing::warn!(node, "{msg}");
                    self.event(
                        Self::node_ref(node),
                        EventType::Warning,
                        "NodeQuarantined",
                        &msg,
                    )
                    .await;
                    return Ok(true);
                }
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        anyhow::bail!("node {node} kept changing; quarantine retried next pass")
    }

    /// Re-stamps after the fences, lifts the quarantine when everything says so.
    async fn maybe_lift(&mut self, node: &str, unhealthy: bool) -> anyhow::Result<bool> {
        let Some(info) = self.caches.nodes.get(node).cloned() else {
            return Ok(false);
        };
        let vas = self.caches.safe_vas_on(node);
        if vas == 0 && !info.fences_done {
            // The fences are done now: only a clean report from after this moment counts.
            self.patch_node(
                node,
                MetadataPatch::new()
                    .set_annotation(QUARANTINED_AT_ANNOTATION, &now().to_string())
                    .set_annotation(FENCES_DONE, "true"),
            )
            .await?;
            tracing::info!(node, "no VolumeAttachment of a safe-detach driver left on the node: fences done; waiting for a clean report");
            return Ok(false);
        }
        if vas > 0 && info.fences_done {
            self.patch_node(node, MetadataPatch::new().remove_annotation(FENCES_DONE))
                .await?;
            return Ok(false);
        }
        if unhealthy || info.ready != Readiness::True || vas > 0 {
            return Ok(false);
        }
        let (Some(qa), Some(clean)) = (info.quarantined_at, info.clean_at) else {
            return Ok(false);
        };
        if clean <= qa {
            return Ok(false);
        }
        let nodes = self.cluster.api::<Node>(None);
        for _ in 0..5 {
            let mut n = nodes.get(node).await?;
            let owned_oos = n
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(OUT_OF_SERVICE_ADDED));
            if let Some(spec) = n.spec.as_mut() {
                if let Some(list) = spec.taints.as_mut() {
                    list.retain(|t| {
                        t.key != QUARANTINE_TAINT_KEY
                            && !(owned_oos && t.key == OUT_OF_SERVICE_TAINT_KEY)
                    });
                    if list.is_empty() {
                        spec.taints = None;
                    }
                }
            }
            if let Some(a) = n.metadata.annotations.as_mut() {
                a.remove(QUARANTINED_AT_ANNOTATION);
                a.remove(OUT_OF_SERVICE_ADDED);
                a.remove(FENCES_DONE);
            }
            match nodes.replace(&n).await {
                Ok(written) => {
                    let info = NodeInfo::of(&written, self.caches.nodes.get(node));
                    self.caches.nodes.insert(node.to_string(), info);
                    self.metrics.quarantines_lifted.inc();
                    let msg = format!("node {node} is Ready, no VolumeAttachment of a safe-detach driver names it, and its node plugin reported it clean at {clean} (after {qa}): quarantine lifted");
                    tracing::info!(node, "{msg}");
                    self.event(
                        Self::node_ref(node),
                        EventType::Normal,
                        "QuarantineLifted",
                        &msg,
                    )
                    .await;
                    return Ok(true);
                }
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(false)
    }
}
