//! podgc in this process against a real API server (no kube-controller-manager, scheduler
//! or kubelet needed: Nodes, Pods and VolumeAttachments are only API objects here).
//!
//! Ignored unless asked for: set `FENCECSI_TEST_KUBECONFIG` to a kubeconfig with rights to
//! create Nodes, CSIDrivers, PVs, VolumeAttachments and Pods/PVCs/Events in `default`, and
//! pass `--ignored`; without the variable the test prints SKIPPED and passes.
//!
//! ```text
//! FENCECSI_TEST_KUBECONFIG=/path/admin.kubeconfig \
//!   cargo test -p fencecsi-podgc --test real_cluster -- --ignored --nocapture
//! ```
//!
//! Every object it creates carries a per-run name suffix and the label
//! `fencecsi.test/real-cluster-run=<run>`; all of them (and the Events podgc recorded about
//! them) are deleted at the end, also when the scenario fails. podgc acts on every node of
//! the cluster, so the test refuses to start while a node it did not create is NotReady
//! or quarantined.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use fencecsi_cluster::k8s_openapi::api::core::v1::{
    Container, Node, NodeCondition, PersistentVolume, PersistentVolumeClaim, Pod,
    VolumeResourceRequirements,
};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{CSIDriver, CSIDriverSpec, VolumeAttachment};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::well_known::*;
use fencecsi_cluster::{
    Cluster, DeleteOptions, ListParams, MetadataPatch, Object, WatchEvent, WatchParams,
};
use fencecsi_podgc::annotations::FENCES_DONE;
use fencecsi_podgc::{PodGc, PodGcConfig, PodGcHandle, CONTROLLER_NAME};
use fencecsi_tests::real_cluster::{
    events_about, kubeconfig_or_skip, name_of, resume_failure, Recorder, RunCtx, Sweep, EVENTS_NS,
    RUN_LABEL,
};

/// The namespace of the test's pods and claims (and of the Events podgc records).
const NS: &str = EVENTS_NS;
/// Bound on every wait for podgc.
const T: Duration = Duration::from_secs(30);
/// podgc's resync in this test: far longer than any wait below that expects a reaction to
/// a pod event, so a reaction within that wait came from the pod watch.
const RESYNC: Duration = Duration::from_secs(60);
/// podgc's field selector on its pod watch (controller/run.rs).
const POD_WATCH_FIELDS: &str = "status.phase!=Succeeded,status.phase!=Failed";

/// The names of this test's objects in the run.
trait Names {
    fn driver(&self) -> String;
    fn node_a(&self) -> String;
    fn node_b(&self) -> String;
    fn handle(&self, pod: &str) -> String;
    /// How the kubelet names the CSI volume of `pod` in `status.volumesInUse`.
    fn in_use(&self, pod: &str) -> String;
}

impl Names for RunCtx {
    fn driver(&self) -> String {
        format!("fc-driver-{}.fencecsi.test", self.run)
    }

    fn node_a(&self) -> String {
        self.name("node-a")
    }

    fn node_b(&self) -> String {
        self.name("node-b")
    }

    fn handle(&self, pod: &str) -> String {
        format!("handle-{pod}-{}", self.run)
    }

    fn in_use(&self, pod: &str) -> String {
        format!("kubernetes.io/csi/{}^{}", self.driver(), self.handle(pod))
    }
}

fn disruption_condition(p: &Pod) -> Option<(String, Option<String>, Option<String>)> {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == DISRUPTION_TARGET_CONDITION))
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

fn rv<K: Object>(o: &K) -> u64 {
    o.metadata()
        .resource_version
        .as_deref()
        .unwrap_or("0")
        .parse()
        .unwrap_or(0)
}

/// Polls `f` every 100 ms until it is true; panics with `what` after `limit`.
async fn wait_for<F, Fut>(what: &str, limit: Duration, mut f: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    start.elapsed()
}

/// The Ready condition `status` ("True", "False", "Unknown"), changed now.
fn ready(status: &str) -> NodeCondition {
    NodeCondition {
        type_: "Ready".into(),
        status: status.into(),
        reason: Some(
            if status == "True" {
                "KubeletReady"
            } else {
                "NodeStatusUnknown"
            }
            .into(),
        ),
        message: Some(format!("set by the real-cluster test: Ready={status}")),
        last_heartbeat_time: Some(Time(Timestamp::now())),
        last_transition_time: Some(Time(
            Timestamp::from_second(Timestamp::now().as_second()).unwrap(),
        )),
    }
}

/// Writes the node's status: Ready=`status` since now, and (if given) `volumesInUse`.
async fn set_node_status(c: &Cluster, node: &str, status: &str, in_use: Option<Vec<String>>) {
    let nodes = c.api::<Node>(None);
    let mut n = nodes.get(node).await.unwrap();
    let st = n.status.get_or_insert_with(Default::default);
    st.conditions = Some(vec![ready(status)]);
    if let Some(v) = in_use {
        st.volumes_in_use = Some(v);
    }
    nodes.replace_status(&n).await.unwrap();
}

/// A pod on `node` with a PVC (in `NS`) bound to a CSI PV of the run's driver, and a
/// VolumeAttachment of that PV on the node. Returns (pod, VA name).
async fn stateful_pod(ctx: &RunCtx, base: &str, node: &str) -> (Pod, String) {
    let c = &ctx.cluster;
    let pv = ctx.name(&format!("pv-{base}"));
    let claim = ctx.name(&format!("data-{base}"));
    let size: BTreeMap<String, Quantity> = [("storage".into(), Quantity("16Mi".into()))].into();
    let mut pv_object = csi_pv(
        ctx.meta(&pv, None),
        &ctx.driver(),
        &ctx.handle(base),
        "ReadWriteOnce",
    );
    let spec = pv_object.spec.as_mut().unwrap();
    spec.capacity = Some(size.clone());
    spec.storage_class_name = Some(String::new());
    spec.volume_mode = Some("Filesystem".into());
    spec.csi.as_mut().unwrap().fs_type = Some("ext4".into());
    c.api::<PersistentVolume>(None)
        .create(&pv_object)
        .await
        .unwrap();
    let mut pvc = bound_claim(ctx.meta(&claim, Some(NS)), &pv, "ReadWriteOnce");
    let spec = pvc.spec.as_mut().unwrap();
    spec.storage_class_name = Some(String::new());
    spec.resources = Some(VolumeResourceRequirements {
        requests: Some(size),
        ..Default::default()
    });
    c.api::<PersistentVolumeClaim>(Some(NS))
        .create(&pvc)
        .await
        .unwrap();
    let va = ctx.name(&format!("va-{base}"));
    c.api::<VolumeAttachment>(None)
        .create(&volume_attachment(
            ctx.meta(&va, None),
            &ctx.driver(),
            node,
            &pv,
        ))
        .await
        .unwrap();
    let mut p = pod_on(
        ctx.meta(ctx.name(base), Some(NS)),
        node,
        vec![claim_volume(&claim)],
    );
    let spec = p.spec.as_mut().unwrap();
    spec.containers = vec![Container {
        name: "c".into(),
        image: Some("registry.k8s.io/pause:3.10".into()),
        ..Default::default()
    }];
    spec.termination_grace_period_seconds = Some(3600);
    let pod = c.api::<Pod>(Some(NS)).create(&p).await.unwrap();
    (pod, va)
}

/// A graceful delete with a long grace: the pod turns Terminating, and no kubelet will
/// ever finish it.
async fn terminate(c: &Cluster, name: &str) {
    let out = c
        .api::<Pod>(Some(NS))
        .delete(name, &DeleteOptions::grace_period(3600))
        .await
        .unwrap();
    assert!(!out.is_deleted(), "{name} must stay Terminating");
}

/// podgc acts on every node of the cluster: refuse to run next to a node this run did not
/// make that it could act on (NotReady or already quarantined), or another safe-detach
/// driver's attachments on such a node.
async fn check_cluster_is_safe_to_use(c: &Cluster) {
    for n in c
        .api::<Node>(None)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
    {
        let ready = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status.clone());
        assert!(
            !matches!(ready.as_deref(), Some("False" | "Unknown"))
                && !has_taint(&n, QUARANTINE_TAINT_KEY),
            "refusing to run podgc: node {} (not made by this test) is NotReady or quarantined, and podgc would act on it",
            name_of(&n)
        );
    }
}

fn podgc_config(ctx: &RunCtx) -> PodGcConfig {
    PodGcConfig {
        shutdown_grace: Duration::from_secs(2),
        node_lease_grace: None,
        resync_interval: RESYNC,
        debounce: Duration::from_millis(50),
        identity: format!("podgc-real-{}", ctx.run),
        leader_election: None,
        ..Default::default()
    }
}

/// The scenario; panics on failure (the caller cleans up either way).
async fn scenario(ctx: RunCtx, h: Arc<PodGcHandle>) {
    let c = ctx.cluster.clone();
    let (node_a, node_b) = (ctx.node_a(), ctx.node_b());
    let pods = c.api::<Pod>(Some(NS));
    let nodes = c.api::<Node>(None);
    let vas = c.api::<VolumeAttachment>(None);

    // A safe-detach driver of this run, two Ready nodes.
    let mut driver = CSIDriver {
        metadata: ctx.meta(ctx.driver(), None),
        spec: CSIDriverSpec {
            attach_required: Some(true),
            ..Default::default()
        },
    };
    driver
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(SAFE_DETACH_ANNOTATION.into(), "true".into());
    c.api::<CSIDriver>(None).create(&driver).await.unwrap();
    for n in [&node_a, &node_b] {
        nodes
            .create(&Node {
                metadata: ctx.meta(n, None),
                spec: Some(Default::default()),
                status: None,
            })
            .await
            .unwrap();
    }
    set_node_status(
        &c,
        &node_a,
        "True",
        Some(vec![ctx.in_use("a1"), ctx.in_use("a2")]),
    )
    .await;
    set_node_status(&c, &node_b, "True", Some(vec![ctx.in_use("b1")])).await;

    // node A: a1 (terminating before the node goes) and a2 (running, terminated later);
    // node B (stays Ready): b1, terminating: the positive control.
    let (a1, va_a1) = stateful_pod(&ctx, "a1", &node_a).await;
    let (a2, va_a2) = stateful_pod(&ctx, "a2", &node_a).await;
    let (b1, va_b1) = stateful_pod(&ctx, "b1", &node_b).await;

    // Watches started now, before anything changes: our pods (all events), podgc's own
    // pod watch (field selector, changes only), our nodes.
    let pod_rec = Recorder::start(
        pods.watch(&WatchParams::default().labels(&ctx.selector()))
            .unwrap(),
    );
    let podgc_like = Recorder::start(
        c.api::<Pod>(None)
            .watch(
                &WatchParams::default()
                    .fields(POD_WATCH_FIELDS)
                    .changes_only(),
            )
            .unwrap(),
    );
    let node_rec = Recorder::start(
        nodes
            .watch(&WatchParams::default().labels(&ctx.selector()))
            .unwrap(),
    );
    wait_for("the test's watches listed", T, || async {
        [
            pod_rec.snapshot().len(),
            podgc_like.snapshot().len(),
            node_rec.snapshot().len(),
        ]
        .iter()
        .all(|n| *n > 0)
    })
    .await;
    // podgc's pod watch: the list that starts it carries no pod although three match.
    match podgc_like.snapshot().first() {
        Some(WatchEvent::Listed(items)) => assert!(
            items.is_empty(),
            "changes_only: the initial list keeps no pod, got {}",
            items.len()
        ),
        other => panic!("podgc's pod watch must start with Listed, got {other:?}"),
    }
    let matching = c
        .api::<Pod>(None)
        .list(&ListParams::default().fields(POD_WATCH_FIELDS))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| name_of(p).ends_with(&ctx.run))
        .count();
    assert_eq!(matching, 3, "the field selector matches our three pods");

    terminate(&c, &name_of(&a1)).await;
    terminate(&c, &name_of(&b1)).await;
    // podgc has synced its caches and made its first pass.
    let mut passes = h.passes();
    tokio::time::timeout(T, passes.wait_for(|s| s.seq >= 1))
        .await
        .expect("podgc's first pass")
        .unwrap();

    // Node A goes NotReady; podgc acts after the 2 s shutdown grace.
    let not_ready_at = Instant::now();
    set_node_status(&c, &node_a, "Unknown", None).await;

    wait_for("a1 force-deleted", T, || async {
        pods.get_opt(&name_of(&a1)).await.unwrap().is_none()
    })
    .await;
    // The grace counts from lastTransitionTime, which the API server keeps in whole
    // seconds: up to 1 s before `not_ready_at`.
    let acted_after = not_ready_at.elapsed();
    assert!(
        acted_after + Duration::from_secs(1) >= Duration::from_secs(2),
        "podgc must wait out the shutdown grace, acted after {acted_after:?}"
    );
    eprintln!("NotReady -> a1 force-deleted in {acted_after:?} (shutdown grace 2s)");
    wait_for("a1's VolumeAttachment deleted", T, || async {
        vas.get_opt(&va_a1).await.unwrap().is_none()
    })
    .await;
    let na = nodes.get(&node_a).await.unwrap();
    assert!(has_taint(&na, QUARANTINE_TAINT_KEY), "node A quarantined");
    let taint = na
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .and_then(|t| t.iter().find(|t| t.key == QUARANTINE_TAINT_KEY))
        .cloned()
        .unwrap();
    assert_eq!(taint.value.as_deref(), Some(QUARANTINE_TAINT_VALUE));
    assert_eq!(taint.effect, "NoSchedule");
    assert!(
        annotation(&na, QUARANTINED_AT_ANNOTATION).is_some(),
        "quarantined-at annotation"
    );
    assert!(
        !has_taint(&na, OUT_OF_SERVICE_TAINT_KEY),
        "no out-of-service taint unless configured"
    );

    // a2 runs on: it stays, so does its attachment and its volumesInUse entry (a1's went).
    let a2_now = pods.get(&name_of(&a2)).await.unwrap();
    assert_eq!(a2_now.metadata.uid, a2.metadata.uid);
    assert!(a2_now.metadata.deletion_timestamp.is_none());
    assert!(disruption_condition(&a2_now).is_none());
    assert!(
        vas.get_opt(&va_a2).await.unwrap().is_some(),
        "a2's VA stays"
    );
    wait_for("a1's volume out of node A's volumesInUse", T, || async {
        let n = nodes.get(&node_a).await.unwrap();
        n.status.and_then(|s| s.volumes_in_use) == Some(vec![ctx.in_use("a2")])
    })
    .await;

    // The order, from the watches: quarantine, then the condition, then the force delete.
    // (resourceVersions are etcd revisions on a real server: one order across kinds.)
    let quarantined_rv = node_rec
        .snapshot()
        .iter()
        .filter_map(|ev| match ev {
            WatchEvent::Added(n) | WatchEvent::Modified(n)
                if name_of(n) == node_a && has_taint(n, QUARANTINE_TAINT_KEY) =>
            {
                assert!(annotation(n, QUARANTINED_AT_ANNOTATION).is_some());
                Some(rv(n))
            }
            _ => None,
        })
        .min()
        .expect("the node watch saw node A quarantined");
    let check_disrupted = |pod: &Pod, node: &str| -> (u64, u64) {
        let evs = pod_rec.snapshot();
        let condition_rv = evs
            .iter()
            .filter_map(|ev| match ev {
                WatchEvent::Added(p) | WatchEvent::Modified(p)
                    if p.metadata.uid == pod.metadata.uid =>
                {
                    let (status, reason, message) = disruption_condition(p)?;
                    assert_eq!(status, "True");
                    assert_eq!(reason.as_deref(), Some(DELETION_BY_PODGC_REASON));
                    let msg = message.unwrap_or_default();
                    assert!(msg.contains(node) && msg.contains("NotReady"), "{msg}");
                    assert_eq!(
                        p.status.as_ref().and_then(|s| s.phase.as_deref()),
                        Some("Failed"),
                        "marked Failed with the condition"
                    );
                    Some(rv(p))
                }
                _ => None,
            })
            .min()
            .unwrap_or_else(|| panic!("no DisruptionTarget seen on {}", name_of(pod)));
        let deleted = evs
            .iter()
            .find_map(|ev| match ev {
                WatchEvent::Deleted(p) if p.metadata.uid == pod.metadata.uid => Some(p.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no Deleted event for {}", name_of(pod)));
        assert_eq!(
            deleted.metadata.deletion_grace_period_seconds,
            Some(0),
            "force delete (grace 0)"
        );
        assert!(
            disruption_condition(&deleted).is_some(),
            "deleted with its condition"
        );
        (condition_rv, rv(&deleted))
    };
    let (cond_rv, del_rv) = check_disrupted(&a1, &node_a);
    assert!(
        quarantined_rv < cond_rv && cond_rv < del_rv,
        "quarantine {quarantined_rv} < condition {cond_rv} < delete {del_rv}"
    );

    // podgc's own pod watch on the real server: a running pod of the quarantined node
    // turning Terminating must start a pass at once, not at the next resync (60 s).
    tokio::time::sleep(Duration::from_secs(1)).await; // the passes the above caused settle
    let before = podgc_like.snapshot().len();
    terminate(&c, &name_of(&a2)).await;
    let took = wait_for(
        "a2 force-deleted after it turned Terminating",
        T,
        || async { pods.get_opt(&name_of(&a2)).await.unwrap().is_none() },
    )
    .await;
    assert!(
        took < Duration::from_secs(15),
        "podgc reacted to the pod watch only after {took:?} (resync is {RESYNC:?})"
    );
    eprintln!("a2 Terminating -> force-deleted in {took:?} (resync {RESYNC:?})");
    let seen: Vec<String> = podgc_like.snapshot()[before..]
        .iter()
        .map(|ev| match ev {
            WatchEvent::Listed(i) => format!("Listed({})", i.len()),
            WatchEvent::Added(p) => format!(
                "Added({}, deleting={})",
                name_of(p),
                p.metadata.deletion_timestamp.is_some()
            ),
            WatchEvent::Modified(p) => format!(
                "Modified({}, deleting={})",
                name_of(p),
                p.metadata.deletion_timestamp.is_some()
            ),
            WatchEvent::Deleted(p) => format!("Deleted({})", name_of(p)),
        })
        .collect();
    eprintln!("podgc-style pod watch (field selector, changes only) after a2's delete: {seen:?}");
    assert!(
        podgc_like.snapshot()[before..].iter().any(|ev| matches!(ev,
            WatchEvent::Added(p) | WatchEvent::Modified(p)
                if p.metadata.uid == a2.metadata.uid && p.metadata.deletion_timestamp.is_some())),
        "the field-selector watch delivered a2 turning Terminating: {seen:?}"
    );
    assert!(
        podgc_like
            .snapshot()
            .iter()
            .any(|ev| matches!(ev, WatchEvent::Deleted(p) if p.metadata.uid == a2.metadata.uid)),
        "the field-selector watch delivered a2 leaving (Failed or deleted): {seen:?}"
    );
    let (cond_rv2, del_rv2) = check_disrupted(&a2, &node_a);
    assert!(cond_rv2 < del_rv2);
    wait_for("a2's VolumeAttachment deleted", T, || async {
        vas.get_opt(&va_a2).await.unwrap().is_none()
    })
    .await;
    wait_for("volumesInUse of node A emptied", T, || async {
        let n = nodes.get(&node_a).await.unwrap();
        n.status
            .and_then(|s| s.volumes_in_use)
            .is_none_or(|v| v.is_empty())
    })
    .await;
    // No safe-detach attachment left on node A: the fences are done, quarantined-at re-stamped.
    wait_for("fences-done on node A", T, || async {
        annotation(&nodes.get(&node_a).await.unwrap(), FENCES_DONE).is_some()
    })
    .await;

    // The positive control: node B, its terminating pod and its attachment untouched.
    let b1_now = pods.get(&name_of(&b1)).await.unwrap();
    assert_eq!(b1_now.metadata.uid, b1.metadata.uid);
    assert!(b1_now.metadata.deletion_timestamp.is_some());
    assert!(disruption_condition(&b1_now).is_none(), "b1 not disrupted");
    assert!(
        vas.get_opt(&va_b1).await.unwrap().is_some(),
        "b1's VA stays"
    );
    let nb = nodes.get(&node_b).await.unwrap();
    assert!(
        !has_taint(&nb, QUARANTINE_TAINT_KEY),
        "node B not quarantined"
    );
    assert!(annotation(&nb, QUARANTINED_AT_ANNOTATION).is_none());
    assert_eq!(
        nb.status.and_then(|s| s.volumes_in_use),
        Some(vec![ctx.in_use("b1")])
    );
    // The PVs and claims are not podgc's to delete.
    for base in ["a1", "a2"] {
        assert!(c
            .api::<PersistentVolume>(None)
            .get_opt(&ctx.name(&format!("pv-{base}")))
            .await
            .unwrap()
            .is_some());
        assert!(c
            .api::<PersistentVolumeClaim>(Some(NS))
            .get_opt(&ctx.name(&format!("data-{base}")))
            .await
            .unwrap()
            .is_some());
    }

    // Node A returns and its node plugin reports it clean after the fences: lifted.
    set_node_status(&c, &node_a, "True", None).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    nodes
        .patch_metadata(
            &node_a,
            &MetadataPatch::new()
                .set_annotation(NODE_CLEAN_ANNOTATION, &Timestamp::now().to_string()),
        )
        .await
        .unwrap();
    wait_for("node A's quarantine lifted", T, || async {
        let n = nodes.get(&node_a).await.unwrap();
        !has_taint(&n, QUARANTINE_TAINT_KEY)
            && annotation(&n, QUARANTINED_AT_ANNOTATION).is_none()
            && annotation(&n, FENCES_DONE).is_none()
    })
    .await;

    // Events podgc recorded (events.k8s.io/v1, in "default" for the Node).
    let want = [
        "NodeQuarantined",
        "TerminatingPodsForceDeleted",
        "QuarantineLifted",
    ];
    wait_for("podgc's Events about node A", T, || async {
        let reasons = event_reasons(&c, &node_a).await;
        want.iter().all(|w| reasons.iter().any(|r| r == w))
    })
    .await;
    eprintln!(
        "Events about node A: {:?}",
        event_reasons(&c, &node_a).await
    );
    assert!(
        event_reasons(&c, &node_b).await.is_empty(),
        "no Event about node B"
    );

    let m = h.metrics();
    assert_eq!(m.force_deleted_count("safe-detach-volumes"), 2);
    assert_eq!(m.force_deleted_count("no-volumes"), 0);
    let text = m.encode();
    assert!(
        text.contains("fencecsi_podgc_volume_attachments_deleted_total 2"),
        "{text}"
    );
}

/// Reasons of the Events podgc recorded about the object named `name` (in `NS`).
async fn event_reasons(c: &Cluster, name: &str) -> Vec<String> {
    events_about(c, name, Some(CONTROLLER_NAME))
        .await
        .into_iter()
        .filter_map(|e| e.reason)
        .collect()
}

/// What this run creates on the API server, in the order the cleanup deletes it.
fn kinds() -> Vec<Sweep> {
    vec![
        Sweep::with::<Pod>(Some(NS), DeleteOptions::force()),
        Sweep::of::<VolumeAttachment>(None),
        Sweep::of::<PersistentVolumeClaim>(Some(NS)),
        Sweep::of::<PersistentVolume>(None),
        Sweep::of::<Node>(None),
        Sweep::of::<CSIDriver>(None),
    ]
}

/// Shows as "ignored" in a plain `cargo test`. Run with
/// `FENCECSI_TEST_KUBECONFIG=<kubeconfig> cargo test -p fencecsi-podgc --test real_cluster -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real API server: set FENCECSI_TEST_KUBECONFIG and pass --ignored"]
async fn podgc_on_a_real_api_server() {
    let Some(path) = kubeconfig_or_skip("podgc_on_a_real_api_server") else {
        return;
    };
    let ctx = RunCtx::connect(&path).await; // RUST_LOG; podgc's warnings by default
    let cluster = ctx.cluster.clone();
    eprintln!(
        "podgc real-cluster run {} (label {RUN_LABEL}={})",
        ctx.run, ctx.run
    );
    // In a task of its own: its watches would not fit the test thread's stack in a debug build.
    tokio::spawn(check_cluster_is_safe_to_use_owned(cluster.clone()))
        .await
        .expect("the cluster is safe to run podgc on");

    let h = Arc::new(PodGc::new(cluster, podgc_config(&ctx)).spawn());
    let outcome = tokio::spawn(Box::pin(scenario(ctx.clone(), h.clone()))).await;
    // The scenario's handle is gone with its task: stop podgc before cleaning up.
    match Arc::try_unwrap(h) {
        Ok(h) => {
            if let Err(e) = h.shutdown().await {
                eprintln!("podgc stopped with an error: {e:#}");
            }
        }
        Err(h) => drop(h),
    }
    let left = ctx.cleanup_in_task(kinds()).await;
    resume_failure(outcome, &left);
    assert!(left.is_empty(), "objects left on the API server: {left:?}");
    eprintln!("cleaned up: nothing of run {} left", ctx.run);
}

async fn check_cluster_is_safe_to_use_owned(c: Cluster) {
    check_cluster_is_safe_to_use(&c).await
}
