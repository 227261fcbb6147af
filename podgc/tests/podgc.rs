//! podgc on the embedded cluster: no driver, no attacher.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use common::world::*;
use common::*;
use fencecsi_cluster::k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, NodeCondition, Pod, Taint};
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use fencecsi_cluster::k8s_openapi::jiff::{SignedDuration, Timestamp};
use fencecsi_cluster::well_known::*;
use fencecsi_cluster::{
    Cluster, DeleteOptions, LeaderElectionConfig, ListParams, MetadataPatch, WatchEvent,
    WatchParams,
};
use fencecsi_driver::node::recover::CleanReporter;
use fencecsi_driver::node::report::NodeCleanReporter;
use fencecsi_embedded_cluster::sim;
use fencecsi_podgc::annotations::{FENCES_DONE, OUT_OF_SERVICE_ADDED};
use fencecsi_podgc::{disrupt_and_delete, DeleteResult, PodGc, PodGcConfig, PodGcHandle};
use futures::StreamExt;

/// Ready=`status` since `ago`.
async fn set_ready(c: &Cluster, node: &str, status: &str, ago: Duration) {
    let api = c.api::<Node>(None);
    let mut n = api.get(node).await.unwrap();
    let since = Timestamp::now() - SignedDuration::try_from(ago).unwrap();
    n.status.get_or_insert_with(Default::default).conditions = Some(vec![NodeCondition {
        type_: "Ready".into(),
        status: status.into(),
        last_transition_time: Some(Time(Timestamp::from_second(since.as_second()).unwrap())),
        ..Default::default()
    }]);
    api.replace_status(&n).await.unwrap();
}

/// Lets podgc run until a pass has begun after the grace that starts when it starts
/// leading. It starts leading, and that grace, before its first pass ends; so the grace
/// is over once it has gone by since a pass was seen to end, and the pass after the next
/// one begins after that. A busy machine only makes this wait longer. (100 ms more for the
/// wall clock podgc goes by against the monotonic one slept on.)
async fn past_first_grace(h: &PodGcHandle) {
    h.next_pass().await;
    tokio::time::sleep(cfg().shutdown_grace + Duration::from_millis(100)).await;
    passes(h, 2).await;
}

/// When the node's Ready condition last changed, as the Node records it.
async fn ready_since(c: &Cluster, node: &str) -> Timestamp {
    let n = c.api::<Node>(None).get(node).await.unwrap();
    n.status
        .and_then(|s| s.conditions)
        .and_then(|cs| cs.into_iter().find(|c| c.type_ == "Ready"))
        .and_then(|c| c.last_transition_time)
        .expect("the Ready condition's lastTransitionTime")
        .0
}

/// Lets podgc run `n` more passes.
async fn passes(h: &PodGcHandle, n: usize) {
    for _ in 0..n {
        h.next_pass().await;
    }
}

fn rv<K: fencecsi_cluster::Object>(o: &K) -> u64 {
    o.metadata()
        .resource_version
        .as_deref()
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test]
async fn quarantines_before_it_force_deletes_with_condition_and_deletes_attachments() {
    let c = cluster(&["n1", "n2"]).await;
    let (p1, va1) = pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
    let (_p2, _) = pod(&c, "web-0", "n1", None).await;
    let (_p3, va3) = pod(&c, "db-1", "n2", Some((SAFE, "ReadWriteOnce"))).await;
    terminate(&c, "db-0").await;
    terminate(&c, "web-0").await;
    terminate(&c, "db-1").await; // on a Ready node: must stay

    let mut node_w = c.api::<Node>(None).watch(&WatchParams::default()).unwrap();
    let mut pod_w = c
        .api::<Pod>(Some(NS))
        .watch(&WatchParams::default())
        .unwrap();
    let _ = node_w.next().await;
    let _ = pod_w.next().await;

    let h = PodGc::new(c.clone(), cfg()).spawn();
    // NotReady from now: podgc acts once the 2 s grace has passed (checked below on
    // the times the Node and podgc record).
    set_ready(&c, "n1", "Unknown", Duration::ZERO).await;

    let pods = c.api::<Pod>(Some(NS));
    wait_for("db-0 and web-0 force-deleted", || async {
        pods.get_opt("db-0").await.unwrap().is_none()
            && pods.get_opt("web-0").await.unwrap().is_none()
    })
    .await;
    let vas = c.api::<VolumeAttachment>(None);
    wait_for("db-0's attachment deleted", || async {
        vas.get_opt(va1.as_ref().unwrap()).await.unwrap().is_none()
    })
    .await;
    // The Ready node's terminating pod and attachment are untouched.
    assert!(pods
        .get("db-1")
        .await
        .unwrap()
        .metadata
        .deletion_timestamp
        .is_some());
    assert!(vas.get_opt(va3.as_ref().unwrap()).await.unwrap().is_some());

    // Order: the quarantine is written before any pod change; the condition before the delete.
    let mut quarantined_rv = None;
    while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_millis(100), node_w.next()).await {
        if let WatchEvent::Modified(n) = ev {
            if n.metadata.name.as_deref() == Some("n1")
                && has_taint(&n, QUARANTINE_TAINT_KEY)
                && quarantined_rv.is_none()
            {
                assert!(annotation(&n, QUARANTINED_AT_ANNOTATION).is_some());
                quarantined_rv = Some(rv(&n));
            }
        }
    }
    let quarantined_rv = quarantined_rv.expect("n1 quarantined");
    let mut condition_rv = None;
    let mut deleted_rv = None;
    while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_millis(100), pod_w.next()).await {
        match ev {
            WatchEvent::Modified(p) if p.metadata.name.as_deref() == Some("db-0") => {
                let cond = p
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .and_then(|cs| cs.iter().find(|c| c.type_ == DISRUPTION_TARGET_CONDITION))
                    .cloned();
                if let Some(cond) = cond {
                    assert_eq!(
                        p.status.as_ref().and_then(|s| s.phase.as_deref()),
                        Some("Failed"),
                        "marked Failed in the same write as the condition"
                    );
                    assert_eq!(cond.status, "True");
                    assert_eq!(cond.reason.as_deref(), Some(DELETION_BY_PODGC_REASON));
                    let msg = cond.message.unwrap();
                    assert!(msg.contains("n1") && msg.contains("NotReady"), "{msg}");
                    condition_rv.get_or_insert(rv(&p));
                }
            }
            WatchEvent::Deleted(p) if p.metadata.name.as_deref() == Some("db-0") => {
                assert_eq!(p.metadata.uid, p1.metadata.uid);
                assert_eq!(
                    p.metadata.deletion_grace_period_seconds,
                    Some(0),
                    "force delete"
                );
                deleted_rv = Some(rv(&p));
            }
            _ => {}
        }
    }
    let (condition_rv, deleted_rv) = (
        condition_rv.expect("condition written"),
        deleted_rv.expect("db-0 deleted"),
    );
    assert!(
        quarantined_rv < condition_rv && condition_rv < deleted_rv,
        "{quarantined_rv} < {condition_rv} < {deleted_rv}"
    );
    // Not before the grace: podgc stamped the quarantine (its own clock) a full grace
    // after the NotReady transition the Node records.
    let not_ready = ready_since(&c, "n1").await;
    let quarantined = quarantined_at(&c, "n1").await;
    assert!(
        quarantined.duration_since(not_ready)
            >= SignedDuration::try_from(cfg().shutdown_grace).unwrap(),
        "n1 quarantined at {quarantined}, NotReady since {not_ready}: less than the grace"
    );

    let m = h.metrics();
    assert_eq!(m.force_deleted_count("safe-detach-volumes"), 1);
    assert_eq!(m.force_deleted_count("no-volumes"), 1);
    assert!(
        m.encode().contains("fencecsi_podgc_quarantined_nodes 1"),
        "{}",
        m.encode()
    );
    assert!(!events(&c, "NodeQuarantined").await.is_empty());
    // n2 was never touched.
    assert!(!has_taint(
        &c.api::<Node>(None).get("n2").await.unwrap(),
        QUARANTINE_TAINT_KEY
    ));
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn pods_of_drivers_without_safe_detach_and_rwx_pods_are_left_alone_with_an_event() {
    let c = cluster(&["n1", "n2", "n3"]).await;
    let (p_unsafe, va_unsafe) = pod(&c, "other-0", "n1", Some((UNSAFE, "ReadWriteOnce"))).await;
    let (p_rwx, va_rwx) = pod(&c, "shared-0", "n1", Some((SAFE, "ReadWriteMany"))).await;
    terminate(&c, "other-0").await;
    terminate(&c, "shared-0").await;
    set_ready(&c, "n1", "False", Duration::from_secs(60)).await;
    let h = PodGc::new(c.clone(), cfg()).spawn();
    past_first_grace(&h).await;
    passes(&h, 5).await;
    let pods = c.api::<Pod>(Some(NS));
    for p in [&p_unsafe, &p_rwx] {
        let now = pods.get(p.metadata.name.as_deref().unwrap()).await.unwrap();
        assert_eq!(now.metadata.uid, p.metadata.uid);
        assert!(now
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_none_or(|cs| cs.iter().all(|c| c.type_ != DISRUPTION_TARGET_CONDITION)));
    }
    let vas = c.api::<VolumeAttachment>(None);
    assert!(vas
        .get_opt(va_unsafe.as_ref().unwrap())
        .await
        .unwrap()
        .is_some());
    assert!(vas
        .get_opt(va_rwx.as_ref().unwrap())
        .await
        .unwrap()
        .is_some());
    // Nothing to delete: no quarantine either.
    assert!(!has_taint(
        &c.api::<Node>(None).get("n1").await.unwrap(),
        QUARANTINE_TAINT_KEY
    ));
    let skipped = events(&c, "ForceDeleteSkipped").await;
    assert_eq!(
        skipped.len(),
        2,
        "one event per pod, not per pass: {skipped:#?}"
    );
    let note = |name: &str| {
        skipped
            .iter()
            .find(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .and_then(|e| e.note.clone())
            .unwrap_or_default()
    };
    assert!(
        note("other-0").contains(UNSAFE) && note("other-0").contains(SAFE_DETACH_ANNOTATION),
        "{}",
        note("other-0")
    );
    assert!(
        note("shared-0").contains("ReadWriteMany"),
        "{}",
        note("shared-0")
    );
    assert!(skipped
        .iter()
        .all(|e| e.type_.as_deref() == Some("Warning")));
    let text = h.metrics().encode();
    assert!(
        text.contains("fencecsi_podgc_skipped_pods_total{reason=\"driver-not-safe-detach\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("fencecsi_podgc_skipped_pods_total{reason=\"read-write-many\"} 1"),
        "{text}"
    );
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_ready_node_is_never_quarantined() {
    let c = cluster(&["n1"]).await;
    pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
    terminate(&c, "db-0").await;
    // Ready for long; an old NotReady episode that ended does not count.
    set_ready(&c, "n1", "True", Duration::from_secs(3600)).await;
    let h = PodGc::new(c.clone(), cfg()).spawn();
    passes(&h, 5).await;
    let n = c.api::<Node>(None).get("n1").await.unwrap();
    assert!(!has_taint(&n, QUARANTINE_TAINT_KEY));
    assert!(annotation(&n, QUARANTINED_AT_ANNOTATION).is_none());
    assert!(c
        .api::<Pod>(Some(NS))
        .get_opt("db-0")
        .await
        .unwrap()
        .is_some());
    assert_eq!(h.metrics().force_deleted_count("safe-detach-volumes"), 0);
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn mass_not_ready_is_disruption_mode_and_changes_nothing() {
    let names: Vec<String> = (0..10).map(|i| format!("n{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let c = cluster(&refs).await;
    for (i, n) in names.iter().enumerate().take(6) {
        pod(&c, &format!("db-{i}"), n, Some((SAFE, "ReadWriteOnce"))).await;
        terminate(&c, &format!("db-{i}")).await;
        set_ready(&c, n, "Unknown", Duration::from_secs(120)).await;
    }
    let h = PodGc::new(c.clone(), cfg()).spawn();
    passes(&h, 5).await;
    let s = h.next_pass().await;
    assert!(s.disruption_mode, "{s:?}");
    assert_eq!(s.unhealthy, 6);
    for (i, name) in names.iter().enumerate().take(6) {
        assert!(c
            .api::<Pod>(Some(NS))
            .get_opt(&format!("db-{i}"))
            .await
            .unwrap()
            .is_some());
        assert!(!has_taint(
            &c.api::<Node>(None).get(name).await.unwrap(),
            QUARANTINE_TAINT_KEY
        ));
    }
    assert_eq!(
        c.api::<VolumeAttachment>(None)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        6
    );
    assert!(h
        .metrics()
        .encode()
        .contains("fencecsi_podgc_disruption_mode 1"));
    assert_eq!(
        events(&c, "DisruptionMode").await.len(),
        1,
        "one event when entering, not one per pass"
    );
    // Five come back: 1 of 10 NotReady is below the fraction; podgc acts on the last one,
    // but only a full grace after disruption mode ended (its grace restarts then).
    for n in names.iter().take(5) {
        set_ready(&c, n, "True", Duration::ZERO).await;
    }
    let pods = c.api::<Pod>(Some(NS));
    wait_for("db-5 force-deleted", || async {
        pods.get_opt("db-5").await.unwrap().is_none()
    })
    .await;
    let ended = disruption_ended_at(&c).await;
    let quarantined_at = quarantined_at(&c, "n5").await;
    assert!(
        quarantined_at.duration_since(ended)
            >= SignedDuration::try_from(cfg().shutdown_grace).unwrap(),
        "n5 quarantined at {quarantined_at}, disruption mode ended at {ended}: less than the grace"
    );
    for i in 0..5 {
        assert!(pods.get_opt(&format!("db-{i}")).await.unwrap().is_some());
    }
    assert!(h
        .metrics()
        .encode()
        .contains("fencecsi_podgc_disruption_mode 0"));
    h.shutdown().await.unwrap();
}

/// When podgc said it left disruption mode (its one `DisruptionModeEnded` Event).
async fn disruption_ended_at(c: &Cluster) -> Timestamp {
    let ended = events(c, "DisruptionModeEnded").await;
    assert_eq!(ended.len(), 1, "one event when leaving disruption mode");
    ended[0].event_time.as_ref().unwrap().0
}

/// The node's `quarantined-at` stamp (podgc's clock).
async fn quarantined_at(c: &Cluster, node: &str) -> Timestamp {
    let n = c.api::<Node>(None).get(node).await.unwrap();
    annotation(&n, QUARANTINED_AT_ANNOTATION)
        .unwrap_or_else(|| panic!("{node} not quarantined"))
        .parse()
        .unwrap()
}

/// A control-plane outage heals node by node. Every node was NotReady since the outage
/// began, long past the grace; the node lifecycle controller gives each node still
/// NotReady a fresh grace when disruption mode ends, and so must podgc. B comes back
/// within that grace and is never touched; C stays down and is quarantined, a full grace
/// after the outage ended (the positive control: same history, same pass timing).
#[tokio::test]
async fn a_staggered_return_after_an_outage_fences_no_node_that_comes_back_within_the_grace() {
    let c = cluster(&["a", "b", "c"]).await;
    for n in ["a", "b", "c"] {
        pod(&c, &format!("db-{n}"), n, Some((SAFE, "ReadWriteOnce"))).await;
        terminate(&c, &format!("db-{n}")).await;
        set_ready(&c, n, "Unknown", Duration::from_secs(120)).await;
    }
    let h = PodGc::new(
        c.clone(),
        PodGcConfig {
            max_unhealthy_fraction: 0.7,
            ..cfg()
        },
    )
    .spawn();
    wait_for("disruption mode", || async {
        h.next_pass().await.disruption_mode
    })
    .await;
    // A returns: 2 of 3 NotReady is below the fraction, so podgc acts again.
    set_ready(&c, "a", "True", Duration::ZERO).await;
    let first = loop {
        let s = h.next_pass().await;
        if !s.disruption_mode {
            break s;
        }
    };
    assert!(
        first.quarantined_now.is_empty() && first.force_deleted.is_empty(),
        "nodes NotReady since the outage began were acted on as soon as it ended: {first:?}"
    );
    // B returns within its fresh grace.
    set_ready(&c, "b", "True", Duration::ZERO).await;
    let pods = c.api::<Pod>(Some(NS));
    wait_for("db-c force-deleted", || async {
        pods.get_opt("db-c").await.unwrap().is_none()
    })
    .await;
    let ended = disruption_ended_at(&c).await;
    let grace = SignedDuration::try_from(cfg().shutdown_grace).unwrap();
    assert!(quarantined_at(&c, "c").await.duration_since(ended) >= grace);
    for n in ["a", "b"] {
        let node = c.api::<Node>(None).get(n).await.unwrap();
        assert!(!has_taint(&node, QUARANTINE_TAINT_KEY), "{n} quarantined");
        assert!(pods.get_opt(&format!("db-{n}")).await.unwrap().is_some());
    }
    assert_eq!(
        c.api::<VolumeAttachment>(None)
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        2,
        "the attachments of a and b stay"
    );
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_pod_re_created_with_the_same_name_survives() {
    let c = cluster(&["n1"]).await;
    let (old, _) = pod(&c, "db-0", "n1", None).await;
    terminate(&c, "db-0").await;
    let snapshot = c.api::<Pod>(Some(NS)).get("db-0").await.unwrap();
    // The old pod goes (its kubelet finished after all), a StatefulSet re-creates the name.
    c.api::<Pod>(Some(NS))
        .delete("db-0", &DeleteOptions::force())
        .await
        .unwrap();
    let (new, _) = pod(&c, "db-0", "n1", None).await;
    terminate(&c, "db-0").await;
    assert_ne!(old.metadata.uid, new.metadata.uid);
    let r = disrupt_and_delete(&c, &snapshot, "test").await.unwrap();
    assert_eq!(r, DeleteResult::Recreated);
    let now = c.api::<Pod>(Some(NS)).get("db-0").await.unwrap();
    assert_eq!(now.metadata.uid, new.metadata.uid);
    assert!(now
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_none_or(|cs| cs.iter().all(|c| c.type_ != DISRUPTION_TARGET_CONDITION)));
    // The current one, by its own snapshot, goes.
    assert_eq!(
        disrupt_and_delete(&c, &now, "test").await.unwrap(),
        DeleteResult::Deleted
    );
    assert!(c
        .api::<Pod>(Some(NS))
        .get_opt("db-0")
        .await
        .unwrap()
        .is_none());
    assert_eq!(
        disrupt_and_delete(&c, &now, "test").await.unwrap(),
        DeleteResult::Gone
    );
}

#[tokio::test]
async fn quarantine_is_lifted_only_after_ready_no_attachment_and_a_clean_report() {
    let c = cluster(&["n1", "n2", "n3"]).await;
    let (_, va) = pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
    let va = va.unwrap();
    // The attacher's finalizer: the attachment stays until "it detached with a fence".
    let fin = attacher_finalizer(SAFE);
    c.api::<VolumeAttachment>(None)
        .patch_metadata(&va, &MetadataPatch::new().add_finalizer(&fin))
        .await
        .unwrap();
    // An administrator's own out-of-service taint on n2 must survive podgc.
    terminate(&c, "db-0").await;
    set_ready(&c, "n1", "Unknown", Duration::from_secs(60)).await;
    let h = PodGc::new(
        c.clone(),
        PodGcConfig {
            out_of_service_taint: true,
            ..cfg()
        },
    )
    .spawn();
    let nodes = c.api::<Node>(None);
    let vas = c.api::<VolumeAttachment>(None);
    wait_for("attachment deletion started", || async {
        vas.get(&va)
            .await
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    })
    .await;
    let n = nodes.get("n1").await.unwrap();
    assert!(has_taint(&n, QUARANTINE_TAINT_KEY) && has_taint(&n, OUT_OF_SERVICE_TAINT_KEY));
    assert_eq!(
        annotation(&n, OUT_OF_SERVICE_ADDED).map(String::as_str),
        Some("true")
    );

    let reporter = NodeCleanReporter::new(&c, "n1");
    // The node comes back and reports clean, but the fence is not done (attachment left).
    set_ready(&c, "n1", "True", Duration::ZERO).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(reporter
        .report_clean("n1", SystemTime::now())
        .await
        .unwrap());
    passes(&h, 4).await;
    assert!(
        has_taint(&nodes.get("n1").await.unwrap(), QUARANTINE_TAINT_KEY),
        "attachment still there"
    );

    // The attacher finishes: the attachment goes. podgc re-stamps quarantined-at, so the
    // report taken before the fence no longer counts.
    let before_fence = SystemTime::now();
    vas.patch_metadata(&va, &MetadataPatch::new().remove_finalizer(&fin))
        .await
        .unwrap();
    wait_for("fences-done stamp", || async {
        annotation(&nodes.get("n1").await.unwrap(), FENCES_DONE).is_some()
    })
    .await;
    passes(&h, 4).await;
    let n = nodes.get("n1").await.unwrap();
    assert!(
        has_taint(&n, QUARANTINE_TAINT_KEY),
        "clean report older than the fences"
    );
    // A pass that started before the fences cannot count either, once the reporter's
    // watch has brought it the re-stamp (until then it answers from what it saw before).
    wait_for(
        "a report from before the fences refused: too old, report again",
        || async { !reporter.report_clean("n1", before_fence).await.unwrap() },
    )
    .await;
    passes(&h, 2).await;
    assert!(has_taint(
        &nodes.get("n1").await.unwrap(),
        QUARANTINE_TAINT_KEY
    ));

    // A fresh report lifts it, with the out-of-service taint podgc added.
    assert!(reporter
        .report_clean("n1", SystemTime::now())
        .await
        .unwrap());
    wait_for("quarantine lifted", || async {
        !has_taint(&nodes.get("n1").await.unwrap(), QUARANTINE_TAINT_KEY)
    })
    .await;
    let n = nodes.get("n1").await.unwrap();
    assert!(!has_taint(&n, OUT_OF_SERVICE_TAINT_KEY));
    assert!(
        annotation(&n, QUARANTINED_AT_ANNOTATION).is_none()
            && annotation(&n, OUT_OF_SERVICE_ADDED).is_none()
    );
    assert!(annotation(&n, NODE_CLEAN_ANNOTATION).is_some());
    assert_eq!(events(&c, "QuarantineLifted").await.len(), 1);
    h.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_out_of_service_taint_podgc_did_not_add_stays() {
    let c = cluster(&["n1", "n2", "n3"]).await;
    pod(&c, "web-0", "n1", None).await;
    terminate(&c, "web-0").await;
    let nodes = c.api::<Node>(None);
    let mut n = nodes.get("n1").await.unwrap();
    n.spec.get_or_insert_with(Default::default).taints = Some(vec![Taint {
        key: OUT_OF_SERVICE_TAINT_KEY.into(),
        value: Some(OUT_OF_SERVICE_TAINT_VALUE.into()),
        effect: "NoExecute".into(),
        time_added: None,
    }]);
    nodes.replace(&n).await.unwrap();
    set_ready(&c, "n1", "False", Duration::from_secs(60)).await;
    let h = PodGc::new(
        c.clone(),
        PodGcConfig {
            out_of_service_taint: true,
            ..cfg()
        },
    )
    .spawn();
    let pods = c.api::<Pod>(Some(NS));
    wait_for("web-0 force-deleted", || async {
        pods.get_opt("web-0").await.unwrap().is_none()
    })
    .await;
    assert!(annotation(&nodes.get("n1").await.unwrap(), OUT_OF_SERVICE_ADDED).is_none());
    set_ready(&c, "n1", "True", Duration::ZERO).await;
    wait_for("fences done", || async {
        annotation(&nodes.get("n1").await.unwrap(), FENCES_DONE).is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let reporter = NodeCleanReporter::new(&c, "n1");
    assert!(reporter
        .report_clean("n1", SystemTime::now())
        .await
        .unwrap());
    wait_for("lifted", || async {
        !has_taint(&nodes.get("n1").await.unwrap(), QUARANTINE_TAINT_KEY)
    })
    .await;
    assert!(
        has_taint(&nodes.get("n1").await.unwrap(), OUT_OF_SERVICE_TAINT_KEY),
        "the administrator's taint stays"
    );
    h.shutdown().await.unwrap();
}

/// Renews `node`'s Lease in kube-node-lease now (creates it first).
async fn renew_lease(c: &Cluster, node: &str) {
    let leases = c.api::<Lease>(Some(NODE_LEASE_NAMESPACE));
    let now = Some(MicroTime(Timestamp::now()));
    match leases.get_opt(node).await.unwrap() {
        None => {
            let lease = Lease {
                metadata: meta(node, Some(NODE_LEASE_NAMESPACE)),
                spec: Some(LeaseSpec {
                    holder_identity: Some(node.into()),
                    renew_time: now,
                    ..Default::default()
                }),
            };
            leases.create(&lease).await.unwrap();
        }
        Some(mut l) => {
            l.spec.get_or_insert_with(Default::default).renew_time = now;
            leases.replace(&l).await.unwrap();
        }
    }
}

/// What changes on the API server after podgc's watches went silent, once its cache has
/// seen n1 ready for a lift.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BehindTheWatch {
    /// Nothing: the cache is behind but still right.
    Nothing,
    /// n1 turns NotReady.
    NodeNotReady,
    /// A VolumeAttachment of the safe-detach driver names n1.
    NewAttachment,
}

/// How many passes the lift scenario watches for a lift, from the first in which podgc
/// has seen n1's Lease renewed again (the control lifts in the first or the next).
const LIFT_CHANCES: usize = 5;

/// n1 is quarantined from its Lease alone (no heartbeat: `node_lease_grace` 1 s, the
/// shutdown grace an hour), its attachment goes, fences done, it reports clean: podgc's
/// cache now has it Ready, clean and without attachments, and only the stale Lease keeps
/// the quarantine. Then the Node and VolumeAttachment watches go silent (a network cut),
/// `change` happens on the API server, and n1's Lease is renewed (its watch still works):
/// the cache says lift. Returns whether podgc lifted within [`LIFT_CHANCES`] passes, and
/// the cluster.
async fn lift_with_watches_behind(change: BehindTheWatch) -> (bool, Cluster) {
    let c = embedded(&["n1", "n2", "n3"]).await;
    renew_lease(&c, "n1").await;
    let (_, va) = pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
    terminate(&c, "db-0").await;
    let h = PodGc::new(
        c.cluster(),
        PodGcConfig {
            shutdown_grace: Duration::from_secs(3600),
            node_lease_grace: Some(Duration::from_secs(1)),
            ..cfg()
        },
    )
    .spawn();
    let nodes = c.api::<Node>(None);
    let vas = c.api::<VolumeAttachment>(None);
    wait_for("attachment deleted", || async {
        vas.get_opt(va.as_ref().unwrap()).await.unwrap().is_none()
    })
    .await;
    wait_for("fences done", || async {
        annotation(&nodes.get("n1").await.unwrap(), FENCES_DONE).is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(NodeCleanReporter::new(&c, "n1")
        .report_clean("n1", SystemTime::now())
        .await
        .unwrap());
    // The watches deliver the report; only the stale Lease holds the quarantine.
    passes(&h, 4).await;
    let s = h.next_pass().await;
    assert_eq!(s.unhealthy, 1, "n1's Lease is stale: {s:?}");
    let n1 = nodes.get("n1").await.unwrap();
    assert!(has_taint(&n1, QUARANTINE_TAINT_KEY));
    assert!(annotation(&n1, NODE_CLEAN_ANNOTATION).is_some());

    c.cut_watches::<Node>();
    c.cut_watches::<VolumeAttachment>();
    match change {
        BehindTheWatch::Nothing => {}
        BehindTheWatch::NodeNotReady => {
            set_ready(&c, "n1", "False", Duration::ZERO).await;
        }
        BehindTheWatch::NewAttachment => {
            vas.create(&volume_attachment(
                meta("va-after-the-cut", None),
                SAFE,
                "n1",
                "pv-after-the-cut",
            ))
            .await
            .unwrap();
        }
    }
    let renewing = {
        let c = c.clone();
        tokio::spawn(async move {
            loop {
                renew_lease(&c, "n1").await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    // The chances to lift: the first pass in which n1 no longer counts as down (its
    // Lease seen renewed; nothing else counts a node down here), and those after it.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut chances = 0;
    let mut lifted = false;
    while !lifted && chances < LIFT_CHANCES {
        assert!(
            std::time::Instant::now() < deadline,
            "podgc never saw n1's Lease renewed"
        );
        let s = h.next_pass().await;
        lifted = s.lifted.contains(&"n1".to_string());
        if chances > 0 || s.unhealthy == 0 {
            chances += 1;
        }
    }
    renewing.abort();
    assert_eq!(
        lifted,
        !has_taint(&nodes.get("n1").await.unwrap(), QUARANTINE_TAINT_KEY),
        "the pass summaries and the Node agree"
    );
    h.shutdown().await.unwrap();
    (lifted, c.cluster())
}

/// Issue 17: the lift was decided on the cache, so a Node watch behind (an API server
/// restart) or dead (a network cut) could lift the quarantine of a node no longer Ready.
/// podgc now reads the Node right before it lifts and goes by that. Control:
/// `a_lift_behind_watches_that_are_still_right_happens`.
#[tokio::test]
async fn a_lift_goes_by_the_node_read_afresh_not_by_a_watch_that_is_behind() {
    let (lifted, c) = lift_with_watches_behind(BehindTheWatch::NodeNotReady).await;
    assert!(!lifted, "n1 is NotReady on the API server");
    assert!(events(&c, "QuarantineLifted").await.is_empty());
}

/// The same for a VolumeAttachment the watch did not deliver: it is read afresh too, and
/// goes into the cache as the watch would have put it, so fences-done is cleared (the new
/// attachment needs its fence and a clean report after it). Control:
/// `a_lift_behind_watches_that_are_still_right_happens`.
#[tokio::test]
async fn a_lift_waits_for_a_volume_attachment_the_watch_did_not_deliver() {
    let (lifted, c) = lift_with_watches_behind(BehindTheWatch::NewAttachment).await;
    assert!(!lifted, "a VolumeAttachment names n1 on the API server");
    let n1 = c.api::<Node>(None).get("n1").await.unwrap();
    assert!(
        annotation(&n1, FENCES_DONE).is_none(),
        "fences-done cleared for the new attachment"
    );
}

/// The control of the two above: the same run, nothing changed behind the silent watches:
/// the fresh reads agree with the cache, and the quarantine is lifted.
#[tokio::test]
async fn a_lift_behind_watches_that_are_still_right_happens() {
    let (lifted, c) = lift_with_watches_behind(BehindTheWatch::Nothing).await;
    assert!(lifted, "nothing changed on the API server");
    assert_eq!(events(&c, "QuarantineLifted").await.len(), 1);
}

/// A cluster with three nodes n1..n3 whose simulated kubelets renew their Leases every
/// 200 ms; `finish_terminating_pods` as a live kubelet does.
async fn three_kubelets(finish_terminating_pods: bool) -> (Cluster, Vec<sim::HeartbeatHandle>) {
    let c = cluster(&[]).await;
    let hb_cfg = sim::HeartbeatConfig {
        interval: Duration::from_millis(200),
        lease_duration_seconds: 1,
        finish_terminating_pods,
    };
    let hbs: Vec<_> = ["n1", "n2", "n3"]
        .iter()
        .map(|n| sim::KubeletHeartbeat::new(&c, n, hb_cfg.clone()).spawn())
        .collect();
    let nodes = c.api::<Node>(None);
    wait_for("nodes registered", || async {
        nodes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len()
            == 3
    })
    .await;
    (c, hbs)
}

/// The whole control-plane loop on simulated kubelets: heartbeat stops, lifecycle marks the
/// node Unknown and taints it, taint eviction makes the pods Terminating, podgc (leader
/// elected, leases watched) force-deletes and detaches, the node returns, reports clean,
/// the quarantine goes.
#[tokio::test]
async fn simulated_node_shutdown_and_return() {
    let (c, hbs) = three_kubelets(true).await;
    let nodes = c.api::<Node>(None);
    let (_, va) = pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
    let lc = sim::NodeLifecycle::new(
        &c,
        sim::NodeLifecycleConfig {
            grace: Duration::from_secs(2),
            interval: Duration::from_millis(100),
        },
    )
    .spawn();
    let te = sim::TaintEviction::new(
        &c,
        sim::TaintEvictionConfig {
            interval: Duration::from_millis(100),
            default_toleration_seconds: 1,
        },
    )
    .spawn();
    let h = PodGc::new(
        c.clone(),
        PodGcConfig {
            node_lease_grace: Some(Duration::from_secs(2)),
            leader_election: Some(
                LeaderElectionConfig::new("kube-system", "fencecsi-podgc", "podgc-test")
                    .with_timing(
                        Duration::from_secs(3),
                        Duration::from_secs(2),
                        Duration::from_millis(200),
                    ),
            ),
            ..cfg()
        },
    )
    .spawn();
    let pods = c.api::<Pod>(Some(NS));
    // podgc leads and has had a pass with the three nodes up: the running pod stays.
    wait_for("a pass of the leader with every node up", || async {
        let s = h.next_pass().await;
        s.leader && s.nodes == 3 && s.unhealthy == 0
    })
    .await;
    assert!(pods.get_opt("db-0").await.unwrap().is_some());

    hbs[0].stop();
    wait_for("db-0 force-deleted by podgc", || async {
        pods.get_opt("db-0").await.unwrap().is_none()
    })
    .await;
    let vas = c.api::<VolumeAttachment>(None);
    wait_for("attachment deleted", || async {
        vas.get_opt(va.as_ref().unwrap()).await.unwrap().is_none()
    })
    .await;
    assert!(has_taint(
        &nodes.get("n1").await.unwrap(),
        QUARANTINE_TAINT_KEY
    ));
    assert_eq!(h.metrics().force_deleted_count("safe-detach-volumes"), 1);
    let deleted_by: BTreeMap<_, _> = events(&c, "TerminatingPodsForceDeleted")
        .await
        .into_iter()
        .map(|e| (e.regarding.and_then(|r| r.name), e.reporting_controller))
        .collect();
    assert_eq!(
        deleted_by.get(&Some("n1".to_string())),
        Some(&Some(fencecsi_podgc::CONTROLLER_NAME.to_string()))
    );

    // The node returns; its node plugin reports clean after a pass that started now.
    hbs[0].start();
    wait_for("fences done", || async {
        annotation(&nodes.get("n1").await.unwrap(), FENCES_DONE).is_some()
    })
    .await;
    let reporter = NodeCleanReporter::new(&c, "n1");
    wait_for("clean report accepted and quarantine lifted", || async {
        let _ = reporter
            .report_clean("n1", SystemTime::now())
            .await
            .unwrap();
        !has_taint(&nodes.get("n1").await.unwrap(), QUARANTINE_TAINT_KEY)
    })
    .await;
    h.shutdown().await.unwrap();
    // The leader lease was released on shutdown.
    let lease = c
        .api::<fencecsi_cluster::k8s_openapi::api::coordination::v1::Lease>(Some("kube-system"))
        .get("fencecsi-podgc")
        .await
        .unwrap();
    assert!(lease.spec.unwrap().holder_identity.is_none());
    for hb in hbs {
        hb.shutdown().await;
    }
    lc.shutdown().await;
    te.shutdown().await;
}

#[tokio::test]
async fn metrics_healthz_and_readyz_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = cluster(&["n1"]).await;
    let gc = PodGc::new(c.clone(), cfg());
    let server = fencecsi_cluster::http::start(&"127.0.0.1:0".parse().unwrap(), gc.report())
        .await
        .unwrap();
    let addr = server.local_addr();
    let h = gc.spawn();
    h.next_pass().await;
    let get = |path: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    let m = get("/metrics").await;
    assert!(m.starts_with("HTTP/1.1 200"), "{m}");
    for name in [
        "fencecsi_podgc_passes_total",
        "fencecsi_podgc_quarantined_nodes",
        "fencecsi_podgc_disruption_mode",
        "fencecsi_podgc_leader 1",
    ] {
        assert!(m.contains(name), "{name} missing: {m}");
    }
    assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
    assert!(get("/readyz").await.starts_with("HTTP/1.1 200"));
    assert!(get("/nope").await.starts_with("HTTP/1.1 404"));
    server.stop().await;
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_service_taint_evicts_running_stateful_pods_without_waiting_for_tolerations() {
    // Pods keep running on a dead node for their NoExecute toleration (300 s by
    // default). With --out-of-service-taint podgc quarantines at once, and the
    // taint evicts them now; without it, podgc waits for them to terminate.
    for oos in [false, true] {
        let c = cluster(&["n1", "n2"]).await;
        let (_p, _va) = pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
        let h = PodGc::new(
            c.clone(),
            PodGcConfig {
                out_of_service_taint: oos,
                ..cfg()
            },
        )
        .spawn();
        set_ready(&c, "n1", "Unknown", Duration::from_secs(10)).await;
        past_first_grace(&h).await;
        passes(&h, 3).await;
        let n = c.api::<Node>(None).get("n1").await.unwrap();
        assert_eq!(
            has_taint(&n, QUARANTINE_TAINT_KEY),
            oos,
            "quarantine with out_of_service_taint={oos}"
        );
        assert_eq!(
            has_taint(&n, OUT_OF_SERVICE_TAINT_KEY),
            oos,
            "out-of-service taint with out_of_service_taint={oos}"
        );
        let pod = c.api::<Pod>(Some(NS)).get("db-0").await.unwrap();
        assert!(
            pod.metadata.deletion_timestamp.is_none(),
            "podgc itself never deletes a running pod"
        );
        let _ = h.shutdown().await;
    }
}

/// One round of each of kube-controller-manager's parts that act on a dead node: the
/// taint manager's eviction, upstream PodGC under the out-of-service taint, and the
/// attach-detach controller (its own view, detach gated on volumesInUse, forced under the
/// taint).
async fn kcm_round(
    te: &sim::TaintEviction,
    gc: &sim::out_of_service::OutOfServicePodGc,
    adc: &sim::attach_detach::AttachDetach,
) {
    te.reconcile().await.unwrap();
    gc.reconcile().await.unwrap();
    adc.reconcile().await.unwrap();
}

async fn set_volumes_in_use(c: &Cluster, node: &str, list: &[String]) {
    let api = c.api::<Node>(None);
    let mut n = api.get(node).await.unwrap();
    n.status.get_or_insert_with(Default::default).volumes_in_use = Some(list.to_vec());
    api.replace_status(&n).await.unwrap();
}

async fn volumes_in_use(c: &Cluster, node: &str) -> Vec<String> {
    let n = c.api::<Node>(None).get(node).await.unwrap();
    n.status.and_then(|s| s.volumes_in_use).unwrap_or_default()
}

/// The pod as it was deleted (the watch's last word on it).
async fn deleted_pod(w: &mut fencecsi_cluster::WatchStream<Pod>, name: &str) -> Pod {
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(60), w.next())
            .await
            .unwrap_or_else(|_| panic!("{name} not deleted"))
            .unwrap();
        if let WatchEvent::Deleted(p) = ev {
            if p.metadata.name.as_deref() == Some(name) {
                return p;
            }
        }
    }
}

fn disruption_reason(p: &Pod) -> Option<String> {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == DISRUPTION_TARGET_CONDITION))
        .and_then(|c| c.reason.clone())
}

/// With the out-of-service taint, upstream PodGC force-deletes every terminating pod on
/// the node and the attach-detach controller force-detaches every volume, whatever the
/// driver. So podgc sets it only when everything on the node is fenced. With another
/// driver's pod on the dead node it withholds the taint, evicts and force-deletes only the
/// fenced stateful pod itself, and the other pod and its attachment stay, though the
/// kube-controller-manager model runs all along. Controls: with only fenced volumes on
/// the node podgc does set the taint and the model evicts, force-deletes (keeping the taint
/// manager's reason) and detaches; and once someone sets the taint by hand on the mixed
/// node, the model does force-detach the other driver's volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_out_of_service_taint_is_withheld_while_another_drivers_volume_is_on_the_node() {
    for foreign in [true, false] {
        let c = cluster(&["n1", "n2"]).await;
        let (_db, db_va) = pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
        let other_va = if foreign {
            pod(&c, "other-0", "n1", Some((UNSAFE, "ReadWriteOnce")))
                .await
                .1
        } else {
            None
        };
        // What the kubelet last reported mounted on n1, before it died.
        let mut in_use = vec![format!("kubernetes.io/csi/{SAFE}^handle-db-0")];
        if foreign {
            in_use.push(format!("kubernetes.io/csi/{UNSAFE}^handle-other-0"));
        }
        set_volumes_in_use(&c, "n1", &in_use).await;
        let te = sim::TaintEviction::new(&c, Default::default());
        let gc = sim::out_of_service::OutOfServicePodGc::new(&c);
        let adc = sim::attach_detach::AttachDetach::new(
            &c,
            sim::attach_detach::AttachDetachConfig {
                drivers: vec![SAFE.into(), UNSAFE.into()],
                ..Default::default()
            },
        );
        let mut pod_w = c
            .api::<Pod>(Some(NS))
            .watch(&WatchParams::default())
            .unwrap();
        let _ = pod_w.next().await;
        let h = PodGc::new(
            c.clone(),
            PodGcConfig {
                out_of_service_taint: true,
                ..cfg()
            },
        )
        .spawn();
        set_ready(&c, "n1", "Unknown", Duration::from_secs(10)).await;
        let vas = c.api::<VolumeAttachment>(None);
        let db_va = db_va.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while vas.get_opt(&db_va).await.unwrap().is_some() {
            assert!(std::time::Instant::now() < deadline, "db-0 never detached");
            h.next_pass().await;
            kcm_round(&te, &gc, &adc).await;
        }
        // The fenced volume leaves volumesInUse, so that the attach-detach controller
        // detaches it at once; the other driver's entry stays.
        let left: Vec<String> = in_use[1..].to_vec();
        wait_for("db-0's volume out of volumesInUse", || async {
            volumes_in_use(&c, "n1").await == left
        })
        .await;
        let gone = deleted_pod(&mut pod_w, "db-0").await;
        assert_eq!(
            gone.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Failed")
        );
        let n1 = c.api::<Node>(None).get("n1").await.unwrap();
        assert!(has_taint(&n1, QUARANTINE_TAINT_KEY));
        assert_eq!(has_taint(&n1, OUT_OF_SERVICE_TAINT_KEY), !foreign);
        let withheld = events(&c, "OutOfServiceTaintWithheld").await;
        if !foreign {
            // Control: the taint was set, the taint manager evicted db-0 and its reason is
            // kept.
            assert!(withheld.is_empty());
            assert_eq!(
                disruption_reason(&gone).as_deref(),
                Some(sim::DELETION_BY_TAINT_MANAGER_REASON)
            );
            h.shutdown().await.unwrap();
            continue;
        }
        assert_eq!(withheld.len(), 1, "one Warning for the node");
        let note = withheld[0].note.clone().unwrap_or_default();
        assert!(note.contains("other-0") && note.contains(UNSAFE), "{note}");
        assert_eq!(
            disruption_reason(&gone).as_deref(),
            Some(DELETION_BY_PODGC_REASON),
            "podgc evicted db-0 itself"
        );
        // The attach-detach controller's own view no longer has db-0's volume on n1, so a
        // replacement pod elsewhere gets it without waiting for the verification.
        kcm_round(&te, &gc, &adc).await;
        assert!(adc.attached_nodes("pv-db-0").is_empty());
        // Two more rounds of everything: the other driver's pod and volume stay.
        for _ in 0..2 {
            h.next_pass().await;
            kcm_round(&te, &gc, &adc).await;
        }
        let other = c.api::<Pod>(Some(NS)).get("other-0").await.unwrap();
        assert!(
            other.metadata.deletion_timestamp.is_none(),
            "other-0 evicted"
        );
        let other_va = other_va.unwrap();
        assert!(vas.get_opt(&other_va).await.unwrap().is_some());
        assert_eq!(adc.attached_nodes("pv-other-0"), vec!["n1"]);
        // Control: an operator confirms the node is off and sets the taint; the model now
        // evicts and force-deletes other-0 and force-detaches its volume, unfenced.
        let mut n1 = c.api::<Node>(None).get("n1").await.unwrap();
        n1.spec
            .get_or_insert_with(Default::default)
            .taints
            .get_or_insert_with(Vec::new)
            .push(Taint {
                key: OUT_OF_SERVICE_TAINT_KEY.into(),
                value: Some(OUT_OF_SERVICE_TAINT_VALUE.into()),
                effect: "NoExecute".into(),
                time_added: None,
            });
        c.api::<Node>(None).replace(&n1).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while vas.get_opt(&other_va).await.unwrap().is_some() {
            assert!(std::time::Instant::now() < deadline, "model never detached");
            kcm_round(&te, &gc, &adc).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        h.shutdown().await.unwrap();
    }
}

/// podgc watches pods: a pod of a down node that turns terminating (the taint manager's
/// eviction) is acted on at once, not at the next resync. The resync here is an hour and
/// the node crossed its grace before podgc started, so no timer would run another pass:
/// only the pod's own event can.
#[tokio::test]
async fn an_eviction_on_a_down_node_is_acted_on_when_it_is_watched() {
    let c = cluster(&["n1", "n2"]).await;
    let (_p, va) = pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
    set_ready(&c, "n1", "Unknown", Duration::from_secs(60)).await;
    let h = PodGc::new(
        c.clone(),
        PodGcConfig {
            resync_interval: Duration::from_secs(3600),
            ..cfg()
        },
    )
    .spawn();
    let s = h.next_pass().await;
    assert_eq!(s.unhealthy, 1);
    assert!(s.force_deleted.is_empty(), "a running pod stays: {s:?}");
    terminate(&c, "db-0").await;
    let pods = c.api::<Pod>(Some(NS));
    wait_for("db-0 force-deleted", || async {
        pods.get_opt("db-0").await.unwrap().is_none()
    })
    .await;
    let vas = c.api::<VolumeAttachment>(None);
    wait_for("db-0's attachment deleted", || async {
        vas.get_opt(va.as_ref().unwrap()).await.unwrap().is_none()
    })
    .await;
    h.shutdown().await.unwrap();
}

/// A dead node is seen from its Lease, without waiting for NotReady and the shutdown grace
/// on top: here no node lifecycle controller runs and the shutdown grace is an hour, so
/// only the lease can trigger podgc. Control: while the kubelet renews, passes go by and
/// nothing happens. The lease grace is fifteen renewals (3 s), so that a kubelet a busy
/// machine holds up a while still counts as renewing.
#[tokio::test]
async fn a_node_whose_lease_stops_is_acted_on_after_the_lease_grace_alone() {
    let (c, hbs) = three_kubelets(false).await;
    let nodes = c.api::<Node>(None);
    let (_, va) = pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
    terminate(&c, "db-0").await;
    let h = PodGc::new(
        c.clone(),
        PodGcConfig {
            shutdown_grace: Duration::from_secs(3600),
            node_lease_grace: Some(Duration::from_secs(3)),
            ..cfg()
        },
    )
    .spawn();
    // Control: renewing leases, several passes spanning more than the lease grace.
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_millis(3500) {
        let s = h.next_pass().await;
        assert_eq!(s.unhealthy, 0, "{s:?}");
    }
    let pods = c.api::<Pod>(Some(NS));
    assert!(pods.get_opt("db-0").await.unwrap().is_some());

    hbs[0].stop();
    wait_for("db-0 force-deleted", || async {
        pods.get_opt("db-0").await.unwrap().is_none()
    })
    .await;
    let vas = c.api::<VolumeAttachment>(None);
    wait_for("attachment deleted", || async {
        vas.get_opt(va.as_ref().unwrap()).await.unwrap().is_none()
    })
    .await;
    let n1 = nodes.get("n1").await.unwrap();
    assert!(has_taint(&n1, QUARANTINE_TAINT_KEY));
    assert!(
        n1.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
        "no lifecycle controller: the node never turned NotReady"
    );
    let ev = events(&c, "TerminatingPodsForceDeleted").await;
    let note = ev[0].note.clone().unwrap_or_default();
    assert!(note.contains("has not renewed its Lease"), "{note}");
    h.shutdown().await.unwrap();
    for hb in hbs {
        hb.shutdown().await;
    }
}

/// A podgc that starts (or takes over as leader) knows nothing of the time before: a node
/// NotReady for long gets a full grace from then, as the node lifecycle controller does
/// after its own start. After an outage, a standby that takes over must not act at once
/// on nodes whose heartbeats have not arrived yet.
#[tokio::test]
async fn a_podgc_that_starts_leading_gives_every_down_node_a_full_grace() {
    let c = cluster(&["n1", "n2", "n3"]).await;
    pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
    terminate(&c, "db-0").await;
    set_ready(&c, "n1", "Unknown", Duration::from_secs(600)).await;
    let started = Timestamp::now();
    let h = PodGc::new(c.clone(), cfg()).spawn();
    let first = h.next_pass().await;
    assert_eq!(first.unhealthy, 1);
    assert!(
        first.force_deleted.is_empty() && first.quarantined_now.is_empty(),
        "acted on the first pass: {first:?}"
    );
    let pods = c.api::<Pod>(Some(NS));
    wait_for("db-0 force-deleted", || async {
        pods.get_opt("db-0").await.unwrap().is_none()
    })
    .await;
    let grace = SignedDuration::try_from(cfg().shutdown_grace).unwrap();
    // quarantined-at has second precision.
    assert!(
        quarantined_at(&c, "n1").await.duration_since(started)
            >= grace - SignedDuration::from_secs(1)
    );
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_turns_unhealthy_while_the_election_is_forbidden() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = embedded(&["n1"]).await;
    // The API server forbids Leases in "locked" (say, RBAC for another namespace).
    c.deny::<fencecsi_cluster::k8s_openapi::api::coordination::v1::Lease>("locked");
    let instance = |id: &str, ns: &str| {
        let mut cfg = cfg();
        cfg.identity = id.into();
        cfg.leader_election = Some(
            LeaderElectionConfig::new(ns, "fencecsi-podgc", id)
                .with_timing(
                    Duration::from_secs(2),
                    Duration::from_millis(1500),
                    Duration::from_millis(200),
                )
                // Fifteen rounds: the open instance, whose rounds a busy machine may
                // hold up a while, stays healthy; the locked one turns unhealthy all
                // the same.
                .unhealthy_after(Duration::from_secs(3)),
        );
        PodGc::new(c.cluster(), cfg)
    };
    let (open, locked) = (
        instance("open", "kube-system"),
        instance("locked", "locked"),
    );
    let (open_live, locked_live) = (open.liveness(), locked.liveness());
    let server = fencecsi_cluster::http::start(&"127.0.0.1:0".parse().unwrap(), locked.report())
        .await
        .unwrap();
    let addr = server.local_addr();
    let get = |path: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    let healthz = || get("/healthz");
    let (open, locked) = (open.spawn(), locked.spawn());
    wait_for("the locked instance's /healthz turns 503", || async {
        healthz().await.starts_with("HTTP/1.1 503")
    })
    .await;
    assert!(!locked_live.healthy());
    assert!(
        get("/readyz").await.starts_with("HTTP/1.1 503"),
        "not ready either"
    );
    // Control: the instance with a usable Lease leads and stays healthy.
    let o = &open;
    wait_for("the open instance leads", || async move {
        o.next_pass().await.leader
    })
    .await;
    assert!(open_live.healthy());
    server.stop().await;
    locked.shutdown().await.unwrap();
    open.shutdown().await.unwrap();
}
