//! Small simulations of what the kubelet and kube-controller-manager do, for the embedded
//! cluster (tests, benchmarks, the local drill). Each works over the seam, so it runs on a
//! real API server too, but there the real components do this job.
//!
//! - [`KubeletHeartbeat`]: one node's kubelet. Renews the node's Lease in
//!   `kube-node-lease` and keeps its `Ready` condition `True`; optionally finishes the
//!   deletion of its terminating pods, as a live kubelet does once their containers
//!   stopped. [`HeartbeatHandle::stop`] is the node shutting down (or being cut off),
//!   [`HeartbeatHandle::start`] the node coming back.
//! - [`NodeLifecycle`]: the node lifecycle controller. Marks `Ready=Unknown` on a node whose
//!   lease was not renewed for longer than a grace period and taints it
//!   `node.kubernetes.io/unreachable` (NoSchedule and NoExecute); a `Ready=False` node gets
//!   `node.kubernetes.io/not-ready`; both taints go once the node is `Ready` again.
//! - [`TaintEviction`]: the taint eviction controller. Deletes, gracefully (the pod's
//!   terminationGracePeriodSeconds), the pods of nodes with NoExecute taints the pods do not
//!   tolerate, honouring `tolerationSeconds`. Like the DefaultTolerationSeconds admission
//!   plugin, a pod without its own toleration for `not-ready` / `unreachable` is treated as
//!   tolerating them for a default period (300 s in Kubernetes); the out-of-service taint is
//!   never tolerated by default. That is how pods on a dead node become "terminating".
//!
//! - [`attach_detach`]: the attach-detach controller, with its own view of what is
//!   attached, its Multi-Attach refusal, and detach gated on `volumesInUse`.
//! - [`out_of_service`]: what upstream PodGC and the attach-detach controller do on a
//!   node with the out-of-service taint (force-delete, force-detach).
//!
//! Each is a small struct with a `spawn()` returning a handle (or a `reconcile()` a test
//! steps); every time value is configurable so tests can work in seconds.

pub mod attach_detach;
pub mod out_of_service;

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    Node, NodeCondition, NodeStatus, Pod, PodCondition, Taint, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use fencecsi_cluster::well_known::NODE_LEASE_NAMESPACE;
use fencecsi_cluster::Cluster;
use fencecsi_cluster::Result;
use fencecsi_cluster::{DeleteOptions, ListParams};

/// Taint keys the node lifecycle controller manages.
pub const UNREACHABLE_TAINT_KEY: &str = "node.kubernetes.io/unreachable";
pub const NOT_READY_TAINT_KEY: &str = "node.kubernetes.io/not-ready";
pub const NO_EXECUTE: &str = "NoExecute";
pub const NO_SCHEDULE: &str = "NoSchedule";
/// Reason of the DisruptionTarget condition the taint eviction controller sets.
pub const DELETION_BY_TAINT_MANAGER_REASON: &str = "DeletionByTaintManager";

fn now() -> Timestamp {
    Timestamp::now()
}

/// metav1.Time has second precision on the wire.
fn time_now() -> Time {
    Time(Timestamp::from_second(now().as_second()).expect("timestamp in range"))
}

fn micro_now() -> MicroTime {
    let n = now();
    MicroTime(Timestamp::from_microsecond(n.as_microsecond()).unwrap_or(n))
}

/// The node's `Ready` condition, if it has one.
pub fn ready_condition(node: &Node) -> Option<&NodeCondition> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
}

/// A Node as a kubelet registers it: `Ready=True` since now. For tests and benchmarks.
pub fn ready_node(name: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        spec: Some(Default::default()),
        status: Some(NodeStatus {
            conditions: Some(vec![ready_condition_value(
                "True",
                "KubeletReady",
                "kubelet is posting ready status",
            )]),
            ..Default::default()
        }),
    }
}

fn ready_condition_value(status: &str, reason: &str, message: &str) -> NodeCondition {
    NodeCondition {
        type_: "Ready".into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_heartbeat_time: Some(time_now()),
        last_transition_time: Some(time_now()),
    }
}

/// Sets the node's Ready condition to `status` (status subresource), keeping the
/// transition time when the status does not change. Returns whether it wrote.
pub async fn set_node_ready(
    cluster: &Cluster,
    node: &str,
    status: &str,
    reason: &str,
    message: &str,
) -> Result<bool> {
    let nodes = cluster.api::<Node>(None);
    for _ in 0..5 {
        let mut n = nodes.get(node).await?;
        if ready_condition(&n).is_some_and(|c| c.status == status) {
            return Ok(false);
        }
        let st = n.status.get_or_insert_with(Default::default);
        let conds = st.conditions.get_or_insert_with(Vec::new);
        conds.retain(|c| c.type_ != "Ready");
        conds.push(ready_condition_value(status, reason, message));
        match nodes.replace_status(&n).await {
            Ok(_) => return Ok(true),
            Err(e) if e.is_conflict() => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// A spawned simulation loop. Dropping the handle aborts it.
pub struct SimHandle {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl SimHandle {
    fn spawn<F>(every: Duration, mut tick: F) -> Self
    where
        F: FnMut() -> futures::future::BoxFuture<'static, ()> + Send + 'static,
    {
        let (stop, mut stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            loop {
                tick().await;
                tokio::select! {
                    _ = &mut stop_rx => break,
                    _ = tokio::time::sleep(every) => {}
                }
            }
        });
        SimHandle {
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Stops the loop after its current round.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Kubelet heartbeat

/// Timing of a [`KubeletHeartbeat`].
#[derive(Debug, Clone)]
pub struct HeartbeatConfig {
    /// Lease renew interval (kubelet: 10 s, a quarter of the lease duration).
    pub interval: Duration,
    /// leaseDurationSeconds written into the Lease (kubelet: 40).
    pub lease_duration_seconds: i32,
    /// While running, remove this node's terminating pods at once (force delete), as a live
    /// kubelet does once the containers have stopped.
    pub finish_terminating_pods: bool,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        HeartbeatConfig {
            interval: Duration::from_secs(10),
            lease_duration_seconds: 40,
            finish_terminating_pods: true,
        }
    }
}

/// One node's kubelet, as far as the control plane can see it.
#[derive(Debug, Clone)]
pub struct KubeletHeartbeat {
    cluster: Cluster,
    node: String,
    cfg: HeartbeatConfig,
}

impl KubeletHeartbeat {
    pub fn new(cluster: &Cluster, node: &str, cfg: HeartbeatConfig) -> Self {
        KubeletHeartbeat {
            cluster: cluster.clone(),
            node: node.to_string(),
            cfg,
        }
    }

    /// One heartbeat: renew (or create) the Lease, set `Ready=True` if it is not, finish
    /// terminating pods if configured. Creates the Node (Ready) if it does not exist.
    pub async fn beat(&self) -> Result<()> {
        let nodes = self.cluster.api::<Node>(None);
        if nodes.get_opt(&self.node).await?.is_none() {
            match nodes.create(&ready_node(&self.node)).await {
                Ok(_) => {}
                Err(e) if e.is_already_exists() => {}
                Err(e) => return Err(e),
            }
        }
        self.renew_lease().await?;
        set_node_ready(
            &self.cluster,
            &self.node,
            "True",
            "KubeletReady",
            "kubelet is posting ready status",
        )
        .await?;
        if self.cfg.finish_terminating_pods {
            let pods = self.cluster.api::<Pod>(None);
            let gone = pods
                .list_filtered(
                    &ListParams::default().fields(&format!("spec.nodeName={}", self.node)),
                    |p| p.metadata.deletion_timestamp.is_some(),
                )
                .await?;
            for p in gone {
                let ns = p.metadata.namespace.clone().unwrap_or_default();
                let name = p.metadata.name.clone().unwrap_or_default();
                let uid = p.metadata.uid.clone().unwrap_or_default();
                match self
                    .cluster
                    .api::<Pod>(Some(&ns))
                    .delete(&name, &DeleteOptions::force().with_uid(&uid))
                    .await
                {
                    Ok(_) => {}
                    Err(e) if e.is_not_found() || e.is_conflict() => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(())
    }

    async fn renew_lease(&self) -> Result<()> {
        let leases = self.cluster.api::<Lease>(Some(NODE_LEASE_NAMESPACE));
        for _ in 0..5 {
            let res = match leases.get_opt(&self.node).await? {
                None => {
                    leases
                        .create(&Lease {
                            metadata: ObjectMeta {
                                name: Some(self.node.clone()),
                                namespace: Some(NODE_LEASE_NAMESPACE.into()),
                                ..Default::default()
                            },
                            spec: Some(LeaseSpec {
                                holder_identity: Some(self.node.clone()),
                                lease_duration_seconds: Some(self.cfg.lease_duration_seconds),
                                renew_time: Some(micro_now()),
                                ..Default::default()
                            }),
                        })
                        .await
                }
                Some(mut l) => {
                    let spec = l.spec.get_or_insert_with(Default::default);
                    spec.holder_identity = Some(self.node.clone());
                    spec.lease_duration_seconds = Some(self.cfg.lease_duration_seconds);
                    spec.renew_time = Some(micro_now());
                    leases.replace(&l).await
                }
            };
            match res {
                Ok(_) => return Ok(()),
                Err(e) if e.is_conflict() || e.is_already_exists() => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Runs the heartbeat in a task, beating at once.
    pub fn spawn(self) -> HeartbeatHandle {
        let (running_tx, mut running_rx) = watch::channel(true);
        let (stop, mut stop_rx) = oneshot::channel::<()>();
        let hb = self;
        let task = tokio::spawn(async move {
            loop {
                if *running_rx.borrow_and_update() {
                    if let Err(e) = hb.beat().await {
                        tracing::warn!(node = %hb.node, error = %e, "simulated kubelet heartbeat failed");
                    }
                }
                tokio::select! {
                    _ = &mut stop_rx => break,
                    _ = tokio::time::sleep(hb.cfg.interval) => {}
                    // Resumed or paused: act on it at once.
                    r = running_rx.changed() => { if r.is_err() { break } }
                }
            }
        });
        HeartbeatHandle {
            running: running_tx,
            stop: Some(stop),
            task: Some(task),
        }
    }
}

/// A running [`KubeletHeartbeat`].
pub struct HeartbeatHandle {
    running: watch::Sender<bool>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl HeartbeatHandle {
    /// The node shuts down (or is cut off): no more lease renewals or status updates.
    pub fn stop(&self) {
        self.running.send_replace(false);
    }

    /// The node comes back: beats at once, then every interval.
    pub fn start(&self) {
        self.running.send_replace(true);
    }

    pub fn is_running(&self) -> bool {
        *self.running.borrow()
    }

    /// Ends the task.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for HeartbeatHandle {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Node lifecycle

/// Timing of a [`NodeLifecycle`].
#[derive(Debug, Clone)]
pub struct NodeLifecycleConfig {
    /// A lease older than this makes the node `Ready=Unknown` (node-monitor-grace-period,
    /// 40 s by default in Kubernetes).
    pub grace: Duration,
    /// How often nodes are checked (node-monitor-period, 5 s).
    pub interval: Duration,
}

impl Default for NodeLifecycleConfig {
    fn default() -> Self {
        NodeLifecycleConfig {
            grace: Duration::from_secs(40),
            interval: Duration::from_secs(5),
        }
    }
}

/// The node lifecycle controller's health monitoring and NoExecute/NoSchedule tainting.
#[derive(Debug, Clone)]
pub struct NodeLifecycle {
    cluster: Cluster,
    cfg: NodeLifecycleConfig,
}

impl NodeLifecycle {
    pub fn new(cluster: &Cluster, cfg: NodeLifecycleConfig) -> Self {
        NodeLifecycle {
            cluster: cluster.clone(),
            cfg,
        }
    }

    /// One round over all nodes.
    pub async fn reconcile(&self) -> Result<()> {
        let nodes = self.cluster.api::<Node>(None);
        let leases: HashMap<String, Timestamp> = self
            .cluster
            .api::<Lease>(Some(NODE_LEASE_NAMESPACE))
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter_map(|l| {
                let renew = l.spec.as_ref()?.renew_time.as_ref()?.0;
                Some((l.metadata.name?, renew))
            })
            .collect();
        let grace = SignedDuration::try_from(self.cfg.grace).unwrap_or(SignedDuration::MAX);
        let now = now();
        for node in nodes.list(&ListParams::default()).await?.items {
            let name = node.metadata.name.clone().unwrap_or_default();
            let stale = leases
                .get(&name)
                .is_some_and(|renew| now.duration_since(*renew) > grace);
            let status = ready_condition(&node).map(|c| c.status.clone());
            if stale && status.as_deref() != Some("Unknown") {
                tracing::info!(node = %name, "simulated node lifecycle: lease expired, Ready=Unknown");
                set_node_ready(
                    &self.cluster,
                    &name,
                    "Unknown",
                    "NodeStatusUnknown",
                    "Kubelet stopped posting node status.",
                )
                .await?;
            }
            let status = if stale {
                Some("Unknown".to_string())
            } else {
                status
            };
            let want: Option<&str> = match status.as_deref() {
                Some("Unknown") => Some(UNREACHABLE_TAINT_KEY),
                Some("False") => Some(NOT_READY_TAINT_KEY),
                _ => None,
            };
            self.set_taints(&name, want).await?;
        }
        Ok(())
    }

    /// Makes the node carry exactly `want` (NoSchedule + NoExecute) of the two lifecycle taints.
    async fn set_taints(&self, node: &str, want: Option<&str>) -> Result<()> {
        let nodes = self.cluster.api::<Node>(None);
        for _ in 0..5 {
            let mut n = nodes.get(node).await?;
            let spec = n.spec.get_or_insert_with(Default::default);
            let mut taints = spec.taints.clone().unwrap_or_default();
            let before = taints.clone();
            taints.retain(|t| {
                let ours = t.key == UNREACHABLE_TAINT_KEY || t.key == NOT_READY_TAINT_KEY;
                !ours || Some(t.key.as_str()) == want
            });
            if let Some(key) = want {
                for effect in [NO_SCHEDULE, NO_EXECUTE] {
                    if !taints.iter().any(|t| t.key == key && t.effect == effect) {
                        taints.push(Taint {
                            key: key.into(),
                            effect: effect.into(),
                            value: None,
                            time_added: Some(time_now()),
                        });
                    }
                }
            }
            if taints == before {
                return Ok(());
            }
            spec.taints = Some(taints).filter(|t| !t.is_empty());
            match nodes.replace(&n).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    pub fn spawn(self) -> SimHandle {
        let every = self.cfg.interval;
        SimHandle::spawn(every, move || {
            let me = self.clone();
            Box::pin(async move {
                if let Err(e) = me.reconcile().await {
                    tracing::warn!(error = %e, "simulated node lifecycle round failed");
                }
            })
        })
    }
}

// ---------------------------------------------------------------------------------------
// Taint eviction

/// Timing of a [`TaintEviction`].
#[derive(Debug, Clone)]
pub struct TaintEvictionConfig {
    pub interval: Duration,
    /// tolerationSeconds of the not-ready/unreachable tolerations a pod gets by default
    /// (DefaultTolerationSeconds admission plugin: 300).
    pub default_toleration_seconds: i64,
}

impl Default for TaintEvictionConfig {
    fn default() -> Self {
        TaintEvictionConfig {
            interval: Duration::from_secs(1),
            default_toleration_seconds: 300,
        }
    }
}

/// Does `tol` tolerate `taint` (core/v1 `Toleration.ToleratesTaint`)?
pub fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = tol.effect.as_deref().filter(|e| !e.is_empty()) {
        if effect != taint.effect {
            return false;
        }
    }
    let key = tol.key.as_deref().unwrap_or("");
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match tol.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" | "" => {
            // An empty key with Equal matches nothing (validation forbids it).
            !key.is_empty()
                && tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
        _ => false,
    }
}

/// The pod's tolerations plus the defaults the DefaultTolerationSeconds admission plugin
/// adds (not-ready and unreachable, NoExecute, `default_secs`) when the pod has none of its
/// own for those keys.
pub fn effective_tolerations(pod: &Pod, default_secs: i64) -> Vec<Toleration> {
    let mut tols = pod
        .spec
        .as_ref()
        .and_then(|s| s.tolerations.clone())
        .unwrap_or_default();
    for key in [NOT_READY_TAINT_KEY, UNREACHABLE_TAINT_KEY] {
        let probe = Taint {
            key: key.into(),
            effect: NO_EXECUTE.into(),
            value: None,
            time_added: None,
        };
        if !tols.iter().any(|t| tolerates(t, &probe)) {
            tols.push(Toleration {
                key: Some(key.into()),
                operator: Some("Exists".into()),
                effect: Some(NO_EXECUTE.into()),
                toleration_seconds: Some(default_secs),
                value: None,
            });
        }
    }
    tols
}

/// When the pod must be evicted from a node with `taints`: `None` if it tolerates all its
/// NoExecute taints forever, otherwise the deadline (now or in the past if untolerated).
pub fn eviction_time(
    pod: &Pod,
    taints: &[Taint],
    default_secs: i64,
    now: Timestamp,
) -> Option<Timestamp> {
    let tols = effective_tolerations(pod, default_secs);
    let mut deadline: Option<Timestamp> = None;
    for taint in taints.iter().filter(|t| t.effect == NO_EXECUTE) {
        let matching: Vec<&Toleration> = tols.iter().filter(|t| tolerates(t, taint)).collect();
        let when = if matching.is_empty() {
            now
        } else {
            // The shortest tolerationSeconds of the matching tolerations; none = forever.
            let Some(secs) = matching.iter().filter_map(|t| t.toleration_seconds).min() else {
                continue;
            };
            let added = taint.time_added.as_ref().map(|t| t.0).unwrap_or(now);
            added + SignedDuration::from_secs(secs.max(0))
        };
        deadline = Some(deadline.map_or(when, |d| d.min(when)));
    }
    deadline
}

/// The taint eviction controller.
#[derive(Debug, Clone)]
pub struct TaintEviction {
    cluster: Cluster,
    cfg: TaintEvictionConfig,
}

impl TaintEviction {
    pub fn new(cluster: &Cluster, cfg: TaintEvictionConfig) -> Self {
        TaintEviction {
            cluster: cluster.clone(),
            cfg,
        }
    }

    /// One round: evicts what is due; returns how many pods it deleted.
    pub async fn reconcile(&self) -> Result<usize> {
        let now = now();
        let mut evicted = 0;
        let tainted: Vec<(String, Vec<Taint>)> = self
            .cluster
            .api::<Node>(None)
            .list_filtered(&ListParams::default(), |n| {
                n.spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|ts| ts.iter().any(|t| t.effect == NO_EXECUTE))
            })
            .await?
            .into_iter()
            .map(|n| {
                let taints = n.spec.and_then(|s| s.taints).unwrap_or_default();
                (n.metadata.name.unwrap_or_default(), taints)
            })
            .collect();
        for (node, taints) in tainted {
            let pods = self
                .cluster
                .api::<Pod>(None)
                .list_filtered(
                    &ListParams::default().fields(&format!("spec.nodeName={node}")),
                    |p| p.metadata.deletion_timestamp.is_none(),
                )
                .await?;
            for pod in pods {
                let due = eviction_time(&pod, &taints, self.cfg.default_toleration_seconds, now)
                    .is_some_and(|t| t <= now);
                if due && self.evict(&pod, &node).await? {
                    evicted += 1;
                }
            }
        }
        Ok(evicted)
    }

    async fn evict(&self, pod: &Pod, node: &str) -> Result<bool> {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let pods = self.cluster.api::<Pod>(Some(&ns));
        let mut p = pod.clone();
        let st = p.status.get_or_insert_with(Default::default);
        let conds = st.conditions.get_or_insert_with(Vec::new);
        conds.retain(|c| c.type_ != fencecsi_cluster::well_known::DISRUPTION_TARGET_CONDITION);
        conds.push(PodCondition {
            type_: fencecsi_cluster::well_known::DISRUPTION_TARGET_CONDITION.into(),
            status: "True".into(),
            reason: Some(DELETION_BY_TAINT_MANAGER_REASON.into()),
            message: Some(format!(
                "Taint manager: deleting due to NoExecute taint on node {node}"
            )),
            last_transition_time: Some(time_now()),
            ..Default::default()
        });
        match pods.replace_status(&p).await {
            Ok(_) => {}
            Err(e) if e.is_conflict() || e.is_not_found() => return Ok(false), // next round
            Err(e) => return Err(e),
        }
        match pods
            .delete(&name, &DeleteOptions::default().with_uid(&uid))
            .await
        {
            Ok(_) => {
                tracing::info!(pod = %format!("{ns}/{name}"), node, "simulated taint eviction: pod deleted");
                Ok(true)
            }
            Err(e) if e.is_not_found() || e.is_conflict() => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub fn spawn(self) -> SimHandle {
        let every = self.cfg.interval;
        SimHandle::spawn(every, move || {
            let me = self.clone();
            Box::pin(async move {
                if let Err(e) = me.reconcile().await {
                    tracing::warn!(error = %e, "simulated taint eviction round failed");
                }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencecsi_cluster::well_known::OUT_OF_SERVICE_TAINT_KEY;
    use k8s_openapi::api::core::v1::PodSpec;

    fn pod_with(tols: Option<Vec<Toleration>>) -> Pod {
        Pod {
            spec: Some(PodSpec {
                tolerations: tols,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn taint(key: &str, added: Timestamp) -> Taint {
        Taint {
            key: key.into(),
            effect: NO_EXECUTE.into(),
            value: None,
            time_added: Some(Time(added)),
        }
    }

    #[test]
    fn default_tolerations_and_out_of_service() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let p = pod_with(None);
        // Unreachable: tolerated for the default 300 s.
        assert_eq!(
            eviction_time(&p, &[taint(UNREACHABLE_TAINT_KEY, t0)], 300, t0),
            Some(t0 + SignedDuration::from_secs(300))
        );
        // Out-of-service: never tolerated by default, evicted now.
        let now = t0 + SignedDuration::from_secs(5);
        assert_eq!(
            eviction_time(
                &p,
                &[
                    taint(UNREACHABLE_TAINT_KEY, t0),
                    taint(OUT_OF_SERVICE_TAINT_KEY, t0)
                ],
                300,
                now
            ),
            Some(now)
        );
        // An explicit toleration without seconds tolerates forever.
        let forever = pod_with(Some(vec![Toleration {
            operator: Some("Exists".into()),
            ..Default::default()
        }]));
        assert_eq!(
            eviction_time(&forever, &[taint(UNREACHABLE_TAINT_KEY, t0)], 300, t0),
            None
        );
        // An explicit short toleration wins over the default.
        let short = pod_with(Some(vec![Toleration {
            key: Some(UNREACHABLE_TAINT_KEY.into()),
            operator: Some("Exists".into()),
            effect: Some(NO_EXECUTE.into()),
            toleration_seconds: Some(2),
            value: None,
        }]));
        assert_eq!(
            eviction_time(&short, &[taint(UNREACHABLE_TAINT_KEY, t0)], 300, t0),
            Some(t0 + SignedDuration::from_secs(2))
        );
        // A NoSchedule taint never evicts.
        let mut ns = taint("x", t0);
        ns.effect = NO_SCHEDULE.into();
        assert_eq!(eviction_time(&p, &[ns], 300, t0), None);
    }

    #[tokio::test]
    async fn heartbeat_lifecycle_and_eviction_make_pods_terminating() {
        let c = crate::EmbeddedCluster::new();
        let kubelet = KubeletHeartbeat::new(
            &c,
            "n1",
            HeartbeatConfig {
                interval: Duration::from_millis(100),
                lease_duration_seconds: 1,
                finish_terminating_pods: false,
            },
        );
        let hb = kubelet.clone().spawn();
        let nodes = c.api::<Node>(None);
        wait(|| async { nodes.get_opt("n1").await.unwrap().is_some() }).await;
        let pods = c.api::<Pod>(Some("default"));
        let short = |name: &str, secs: i64| Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("n1".into()),
                termination_grace_period_seconds: Some(30),
                tolerations: Some(vec![Toleration {
                    key: Some(UNREACHABLE_TAINT_KEY.into()),
                    operator: Some("Exists".into()),
                    effect: Some(NO_EXECUTE.into()),
                    toleration_seconds: Some(secs),
                    value: None,
                }]),
                ..Default::default()
            }),
            status: None,
        };
        pods.create(&short("quick", 0)).await.unwrap();
        pods.create(&short("slow", 3600)).await.unwrap();
        let lifecycle = NodeLifecycle::new(
            &c,
            NodeLifecycleConfig {
                grace: Duration::from_millis(1500),
                interval: Duration::from_millis(100),
            },
        );
        let eviction = TaintEviction::new(
            &c,
            TaintEvictionConfig {
                interval: Duration::from_millis(100),
                default_toleration_seconds: 300,
            },
        );
        // Healthy: a round of each, right after a heartbeat, leaves the node and its pods
        // alone (rounds the test runs, so they have run when it looks).
        kubelet.beat().await.unwrap();
        lifecycle.reconcile().await.unwrap();
        assert_eq!(eviction.reconcile().await.unwrap(), 0, "nothing evicted");
        let n = nodes.get("n1").await.unwrap();
        assert_eq!(ready_condition(&n).unwrap().status, "True");
        assert!(n.spec.unwrap().taints.is_none());
        let lc = lifecycle.spawn();
        let te = eviction.spawn();
        // The node dies.
        hb.stop();
        wait(|| async {
            let n = nodes.get("n1").await.unwrap();
            ready_condition(&n).unwrap().status == "Unknown"
                && n.spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|t| {
                        t.iter()
                            .any(|t| t.key == UNREACHABLE_TAINT_KEY && t.effect == NO_EXECUTE)
                    })
        })
        .await;
        wait(|| async {
            pods.get("quick")
                .await
                .unwrap()
                .metadata
                .deletion_timestamp
                .is_some()
        })
        .await;
        let quick = pods.get("quick").await.unwrap();
        assert_eq!(quick.metadata.deletion_grace_period_seconds, Some(30));
        assert!(pods
            .get("slow")
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_none());
        // It comes back: Ready, taints gone.
        hb.start();
        wait(|| async {
            let n = nodes.get("n1").await.unwrap();
            ready_condition(&n).unwrap().status == "True"
                && n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_none()
        })
        .await;
        hb.shutdown().await;
        lc.shutdown().await;
        te.shutdown().await;
    }

    async fn wait<F, Fut>(mut f: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        // A bound on liveness only: each condition comes within a few seconds.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !f().await {
            assert!(
                std::time::Instant::now() < deadline,
                "condition not reached in time"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
