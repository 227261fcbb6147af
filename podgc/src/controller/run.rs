//! Running the controller: [`PodGc`] and its handle, and the one task that applies watch
//! events to the caches and decides when a pass runs: soon after a relevant event (the
//! debounce gathers a burst into one pass), when a NotReady node crosses a grace period,
//! at least every `resync_interval`. A replica that does not lead only publishes an empty
//! summary. Liveness is stamped while leader election gets answers.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencecsi_cluster::k8s_openapi::api::coordination::v1::Lease;
use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{CSIDriver, VolumeAttachment};
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::well_known::{HEARTBEAT_LABEL, NODE_LEASE_NAMESPACE};
use fencecsi_cluster::{
    Cluster, EventRecorder, LeaderElector, LeaderHandle, WatchParams, WatchStream,
};
use futures::StreamExt;
use tokio::sync::{oneshot, watch};

use super::caches::{Caches, Readiness};
use super::fast_path::Probes;
use super::{now, sd, PassSummary, Runner};
use crate::config::PodGcConfig;
use crate::http::Liveness;
use crate::metrics::Metrics;
use crate::{Result, CONTROLLER_NAME};

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
    task: Option<tokio::task::JoinHandle<Result<()>>>,
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
    pub async fn shutdown(mut self) -> Result<()> {
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

    /// What to serve on the HTTP endpoint (`fencecsi_cluster::http::start`).
    pub fn report(&self) -> Arc<crate::http::Report> {
        Arc::new(crate::http::Report {
            metrics: self.metrics.clone(),
            liveness: self.liveness.clone(),
        })
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
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        self.run_with(shutdown, None).await
    }

    async fn run_with(
        self,
        shutdown: impl Future<Output = ()> + Send,
        passes: Option<watch::Sender<PassSummary>>,
    ) -> Result<()> {
        self.cfg.validate()?;
        let cfg = self.cfg.clone();
        let cluster = self.cluster.clone();
        let leader: Option<LeaderHandle> = match &cfg.leader_election {
            Some(le) => Some(LeaderElector::new(&cluster, le.clone())?.spawn()),
            None => None,
        };
        let mut w = Watches::open(&cluster, &cfg)?;
        let (probe_tx, mut probe_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut r = Runner {
            recorder: EventRecorder::new(&cluster, CONTROLLER_NAME, &cfg.identity),
            lease_ref: lease_ref(&cfg),
            cluster,
            cfg: cfg.clone(),
            metrics: self.metrics.clone(),
            caches: Caches::new(cfg.node_lease_grace.is_some(), cfg.heartbeat.is_some()),
            probes: Probes::new(probe_tx),
            in_disruption: false,
            clocks_restarted: None,
            oos_withheld: Default::default(),
            warned: HashMap::new(),
            seq: 0,
        };
        tracing::info!(identity = %cfg.identity, shutdown_grace = ?cfg.shutdown_grace, node_lease_grace = ?cfg.node_lease_grace, heartbeat = ?cfg.heartbeat,
            max_unhealthy_fraction = cfg.max_unhealthy_fraction, out_of_service_taint = cfg.out_of_service_taint, "podgc starting");
        let mut was_leading = false;
        let far = tokio::time::Instant::now() + Duration::from_secs(3600 * 24 * 365);
        let mut next_pass = far;
        tokio::pin!(shutdown);
        loop {
            self.report_election_health(leader.as_ref());
            if r.caches.synced() && next_pass == far {
                next_pass = tokio::time::Instant::now();
            }
            let soon = tokio::time::Instant::now() + cfg.debounce;
            tokio::select! {
                biased;
                _ = &mut shutdown => break,
                _ = tokio::time::sleep_until(next_pass), if r.caches.synced() => {
                    let leading = leader.as_ref().is_none_or(|l| l.is_leader());
                    let summary = self.pass_if_leading(&mut r, leading, &mut was_leading).await;
                    if let Some(p) = &passes { p.send_replace(summary); }
                    next_pass = tokio::time::Instant::now() + r.until_next_deadline();
                }
                Some(ev) = w.nodes.next() => if r.caches.apply_node(ev) { next_pass = next_pass.min(soon) },
                Some(ev) = w.leases.next() => if r.caches.apply_lease(ev) { next_pass = next_pass.min(soon) },
                Some(ev) = w.heartbeats.next() => if r.caches.apply_heartbeat(ev) { next_pass = next_pass.min(soon) },
                Some((node, outcome)) = probe_rx.recv() => if r.note_probe(node, outcome) { next_pass = next_pass.min(soon) },
                Some(ev) = w.vas.next() => if r.caches.apply_va(ev) { next_pass = next_pass.min(soon) },
                Some(ev) = w.drivers.next() => if r.caches.apply_driver(ev) { next_pass = next_pass.min(soon) },
                Some(ev) = w.pods.next() => if r.caches.apply_pod(ev) { next_pass = next_pass.min(soon) },
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

    /// Alive only while the election can work: a Lease it may not touch must turn
    /// /healthz red, not leave a standby that never leads.
    fn report_election_health(&self, leader: Option<&LeaderHandle>) {
        match leader {
            Some(l) if !l.healthy() => {
                self.liveness.fail();
                tracing::error!(failing_for = ?l.elector().failing_for(), "leader election gets no answer from the API server (forbidden, or unreachable): reporting unhealthy");
            }
            _ => self.liveness.stamp(),
        }
    }

    /// One pass when leading (a newly won lead restarts every node's grace), an empty
    /// summary otherwise; timed and counted.
    async fn pass_if_leading(
        &self,
        r: &mut Runner,
        leading: bool,
        was_leading: &mut bool,
    ) -> PassSummary {
        if leading && !*was_leading {
            r.clocks_restarted = Some(now());
            tracing::info!("leading: every node's grace starts now");
        }
        *was_leading = leading;
        self.metrics.leader.set(leading as i64);
        let start = Instant::now();
        let summary = if leading {
            r.pass().await
        } else {
            r.seq += 1;
            PassSummary {
                seq: r.seq,
                leader: false,
                ..Default::default()
            }
        };
        self.metrics.passes.inc();
        self.metrics
            .pass_duration_seconds
            .observe(start.elapsed().as_secs_f64());
        summary
    }
}

impl Runner {
    /// Time until the next moment podgc may act on a node, capped by the resync.
    fn until_next_deadline(&self) -> Duration {
        let now = now();
        let mut next = self.cfg.resync_interval;
        let mut consider = |t: Timestamp| {
            if t > now {
                let d = Duration::try_from(t.duration_since(now)).unwrap_or(Duration::ZERO);
                next = next.min(d + Duration::from_millis(5));
            }
        };
        let floor = |t: Timestamp| self.clocks_restarted.map_or(t, |e| e.max(t));
        for (name, info) in &self.caches.nodes {
            if let Readiness::NotReady(t) = info.ready {
                consider(floor(t) + sd(self.cfg.shutdown_grace));
            }
            if let (Some(g), Some(l)) = (self.cfg.node_lease_grace, self.caches.leases.get(name)) {
                consider(floor(l.observed) + sd(g));
            }
        }
        for t in self.probe_deadlines() {
            consider(t);
        }
        next
    }
}

/// The object podgc's own Events are about: its Lease (or, without an election, the
/// Lease it would hold).
fn lease_ref(cfg: &PodGcConfig) -> ObjectReference {
    let (name, namespace) = match &cfg.leader_election {
        Some(le) => (le.lease_name.clone(), le.namespace.clone()),
        None => ("fencecsi-podgc".into(), "kube-system".into()),
    };
    ObjectReference {
        api_version: Some("coordination.k8s.io/v1".into()),
        kind: Some("Lease".into()),
        name: Some(name),
        namespace: Some(namespace),
        ..Default::default()
    }
}

/// The watches that feed the caches.
struct Watches {
    nodes: WatchStream<Node>,
    leases: WatchStream<Lease>,
    heartbeats: WatchStream<Lease>,
    vas: WatchStream<VolumeAttachment>,
    drivers: WatchStream<CSIDriver>,
    pods: WatchStream<Pod>,
}

impl Watches {
    fn open(cluster: &Cluster, cfg: &PodGcConfig) -> Result<Watches> {
        Ok(Watches {
            nodes: cluster.api::<Node>(None).watch(&WatchParams::default())?,
            leases: match cfg.node_lease_grace {
                Some(_) => cluster
                    .api::<Lease>(Some(NODE_LEASE_NAMESPACE))
                    .watch(&WatchParams::default())?,
                None => futures::stream::pending().boxed(),
            },
            heartbeats: match &cfg.heartbeat {
                Some(h) => cluster.api::<Lease>(Some(&h.namespace)).watch(
                    &WatchParams::default()
                        .labels(&format!("{}={}", HEARTBEAT_LABEL.0, HEARTBEAT_LABEL.1)),
                )?,
                None => futures::stream::pending().boxed(),
            },
            vas: cluster
                .api::<VolumeAttachment>(None)
                .watch(&WatchParams::default())?,
            drivers: cluster
                .api::<CSIDriver>(None)
                .watch(&WatchParams::default())?,
            // Finished pods never concern podgc; the rest only trigger passes: nothing is
            // kept, and the (re-)list that starts the watch keeps no pod either.
            pods: cluster.api::<Pod>(None).watch(
                &WatchParams::default()
                    .fields("status.phase!=Succeeded,status.phase!=Failed")
                    .changes_only(),
            )?,
        })
    }
}
