//! The seam's contract, run with identical code against both backends.
//!
//! Always against the embedded cluster. Against a real API server only when asked
//! (`--ignored`, with `FENCECSI_TEST_KUBECONFIG` naming a kubeconfig); otherwise that
//! test is reported as ignored. The real run works in namespace `default` (override with
//! `FENCECSI_TEST_NAMESPACE`), labels everything it creates with a per-run id, and cleans
//! up after itself. It needs no nodes: pods are bound to a node name that does not exist,
//! so no kubelet ever touches them, and VolumeAttachments name a driver no attacher serves.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Result};
use fencecsi_cluster::k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use fencecsi_cluster::k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus};
use fencecsi_cluster::k8s_openapi::api::events::v1::Event;
use fencecsi_cluster::k8s_openapi::api::storage::v1::{
    VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec, VolumeAttachmentStatus,
};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use fencecsi_cluster::k8s_openapi::jiff::{SignedDuration, Timestamp};
use fencecsi_cluster::{
    object_ref, Api, Cluster, DeleteOptions, DeleteOutcome, EventRecorder, EventType,
    LeaderElectionConfig, LeaderElector, ListParams, MetadataPatch, VacancyProof, WatchEvent,
    WatchParams, WatchStream,
};
use fencecsi_embedded_cluster::EmbeddedCluster;
use futures::StreamExt;

const RUN_LABEL: &str = "fencecsi.test/contract-run";
const VA_FINALIZER: &str = "external-attacher/fencecsi-contract.example.com";
const POD_FINALIZER: &str = "fencecsi.test/hold";

struct Ctx {
    cluster: Cluster,
    ns: String,
    run: String,
}

impl Ctx {
    fn new(cluster: Cluster, ns: &str) -> Self {
        let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
        Ctx {
            cluster,
            ns: ns.to_string(),
            run,
        }
    }

    fn name(&self, base: &str) -> String {
        format!("fc-{base}-{}", self.run)
    }

    fn meta(&self, base: &str, ns: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            name: Some(self.name(base)),
            namespace: ns.map(str::to_string),
            labels: Some([(RUN_LABEL.to_string(), self.run.clone())].into()),
            ..Default::default()
        }
    }

    fn selector(&self) -> String {
        format!("{RUN_LABEL}={}", self.run)
    }

    fn va(&self, base: &str) -> VolumeAttachment {
        VolumeAttachment {
            metadata: self.meta(base, None),
            spec: VolumeAttachmentSpec {
                attacher: "fencecsi-contract.example.com".into(),
                node_name: format!("fc-node-{}", self.run),
                source: VolumeAttachmentSource {
                    persistent_volume_name: Some(format!("fc-pv-{base}-{}", self.run)),
                    ..Default::default()
                },
            },
            status: None,
        }
    }

    /// A pod bound to a node that does not exist: nothing will run or delete it.
    fn pod(&self, base: &str, node: Option<&str>) -> Pod {
        Pod {
            metadata: self.meta(base, Some(&self.ns)),
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "c".into(),
                    image: Some("registry.k8s.io/pause:3.10".into()),
                    ..Default::default()
                }],
                node_name: node.map(str::to_string),
                termination_grace_period_seconds: Some(30),
                ..Default::default()
            }),
            status: None,
        }
    }
}

async fn next_event<K: Clone + Send + 'static>(s: &mut WatchStream<K>) -> Result<WatchEvent<K>> {
    tokio::time::timeout(Duration::from_secs(15), s.next())
        .await
        .map_err(|_| anyhow!("no watch event within 15s"))?
        .ok_or_else(|| anyhow!("watch stream ended"))
}

fn name_of<K: fencecsi_cluster::Object>(o: &K) -> String {
    o.metadata().name.clone().unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------------

async fn create_get_list(ctx: &Ctx) -> Result<()> {
    let vas = ctx.cluster.api::<VolumeAttachment>(None);
    let a = vas.create(&ctx.va("a")).await?;
    let b = vas.create(&ctx.va("b")).await?;
    let m = &a.metadata;
    ensure!(m.uid.as_deref().is_some_and(|u| !u.is_empty()), "uid set");
    ensure!(m.creation_timestamp.is_some(), "creationTimestamp set");
    let (rva, rvb) = (
        m.resource_version.clone().unwrap_or_default(),
        b.metadata.resource_version.clone().unwrap_or_default(),
    );
    ensure!(
        !rva.is_empty() && rva != rvb,
        "distinct resourceVersions {rva} {rvb}"
    );

    let got = vas.get(&ctx.name("a")).await?;
    ensure!(
        got.metadata.uid == a.metadata.uid && got.spec == a.spec,
        "get returns the created object"
    );
    let err = vas
        .create(&ctx.va("a"))
        .await
        .expect_err("duplicate create");
    ensure!(err.is_already_exists(), "duplicate create: {err}");
    let err = vas
        .get(&ctx.name("missing"))
        .await
        .expect_err("get missing");
    ensure!(err.is_not_found(), "get missing: {err}");
    ensure!(
        vas.get_opt(&ctx.name("missing")).await?.is_none(),
        "get_opt missing"
    );

    let list = vas
        .list(&ListParams::default().labels(&ctx.selector()))
        .await?;
    let names: BTreeSet<_> = list.items.iter().map(name_of).collect();
    ensure!(
        names == [ctx.name("a"), ctx.name("b")].into(),
        "list by label: {names:?}"
    );
    ensure!(!list.resource_version.is_empty(), "list resourceVersion");

    let only_a = vas
        .list(
            &ListParams::default()
                .labels(&ctx.selector())
                .fields(&format!("metadata.name={}", ctx.name("a"))),
        )
        .await?;
    ensure!(only_a.items.len() == 1, "field selector metadata.name");
    let want = ctx.name("b");
    let filtered = vas
        .list_filtered(&ListParams::default().labels(&ctx.selector()), |v| {
            name_of(v) == want
        })
        .await?;
    ensure!(
        filtered.len() == 1 && name_of(&filtered[0]) == want,
        "list_filtered"
    );

    // Namespaced kinds: the pod lives in its namespace; pods filtered by node.
    let pods = ctx.cluster.api::<Pod>(Some(&ctx.ns));
    let node = format!("fc-node-{}", ctx.run);
    let p = pods.create(&ctx.pod("p", Some(&node))).await?;
    ensure!(
        p.metadata.namespace.as_deref() == Some(ctx.ns.as_str()),
        "pod namespace"
    );
    ensure!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending"),
        "new pod is Pending"
    );
    let on_node = pods
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?;
    ensure!(
        on_node.items.iter().map(name_of).collect::<Vec<_>>() == vec![ctx.name("p")],
        "pods by spec.nodeName"
    );
    let everywhere = ctx.cluster.api::<Pod>(None);
    let all = everywhere
        .list(&ListParams::default().labels(&ctx.selector()))
        .await?;
    ensure!(all.items.len() == 1, "all-namespace list sees the pod");
    let err = everywhere
        .get(&ctx.name("p"))
        .await
        .expect_err("namespaced get without namespace");
    ensure!(err.is_invalid(), "get without namespace: {err}");
    pods.delete(&ctx.name("p"), &DeleteOptions::force()).await?;
    Ok(())
}

async fn conflict_on_stale_resource_version(ctx: &Ctx) -> Result<()> {
    let vas = ctx.cluster.api::<VolumeAttachment>(None);
    let v1 = vas.create(&ctx.va("conflict")).await?;
    let mut edit = v1.clone();
    edit.metadata
        .labels
        .get_or_insert_default()
        .insert("step".into(), "1".into());
    let v2 = vas.replace(&edit).await?;
    ensure!(
        v2.metadata.resource_version != v1.metadata.resource_version,
        "replace moves resourceVersion"
    );

    let mut stale = v1.clone();
    stale
        .metadata
        .labels
        .get_or_insert_default()
        .insert("step".into(), "stale".into());
    let err = vas.replace(&stale).await.expect_err("stale replace");
    ensure!(err.is_conflict(), "stale replace: {err}");
    let now = vas.get(&name_of(&v1)).await?;
    ensure!(
        now.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("step"))
            .map(String::as_str)
            == Some("1"),
        "stale write lost"
    );

    let stale_rv = v1.metadata.resource_version.clone().unwrap_or_default();
    let err = vas
        .patch_metadata(
            &name_of(&v1),
            &MetadataPatch::new()
                .set_label("x", "y")
                .if_resource_version(&stale_rv),
        )
        .await
        .expect_err("stale patch");
    ensure!(err.is_conflict(), "stale patch: {err}");
    let err = vas
        .delete(
            &name_of(&v1),
            &DeleteOptions::default().with_resource_version(&stale_rv),
        )
        .await
        .expect_err("stale delete");
    ensure!(err.is_conflict(), "stale delete precondition: {err}");
    ensure!(
        vas.get_opt(&name_of(&v1)).await?.is_some(),
        "nothing deleted"
    );
    vas.delete(&name_of(&v1), &DeleteOptions::default()).await?;
    Ok(())
}

async fn finalizer_holds_deletion(ctx: &Ctx) -> Result<()> {
    let vas = ctx.cluster.api::<VolumeAttachment>(None);
    let name = ctx.name("fin");
    vas.create(&ctx.va("fin")).await?;
    let with = vas
        .patch_metadata(&name, &MetadataPatch::new().add_finalizer(VA_FINALIZER))
        .await?;
    ensure!(
        with.metadata.finalizers.as_deref() == Some(&[VA_FINALIZER.to_string()][..]),
        "finalizer added"
    );
    // Adding again is a no-op.
    let again = vas
        .patch_metadata(&name, &MetadataPatch::new().add_finalizer(VA_FINALIZER))
        .await?;
    ensure!(
        again.metadata.finalizers.as_ref().map(Vec::len) == Some(1),
        "finalizer set semantics"
    );

    let out = vas.delete(&name, &DeleteOptions::default()).await?;
    let DeleteOutcome::Terminating(t) = out else {
        bail!("delete with finalizer must not remove the object")
    };
    ensure!(
        t.metadata.deletion_timestamp.is_some(),
        "deletionTimestamp set"
    );
    let still = vas.get(&name).await?;
    ensure!(
        still.metadata.deletion_timestamp.is_some(),
        "object stays while finalizer pending"
    );
    ensure!(
        still.metadata.deletion_grace_period_seconds == Some(0),
        "grace 0 for non-pods"
    );

    let err = vas
        .patch_metadata(
            &name,
            &MetadataPatch::new().add_finalizer("fencecsi.test/late"),
        )
        .await
        .expect_err("new finalizer on deleting object");
    ensure!(err.is_invalid(), "no new finalizers while deleting: {err}");

    // A second delete changes nothing.
    ensure!(
        matches!(
            vas.delete(&name, &DeleteOptions::default()).await?,
            DeleteOutcome::Terminating(_)
        ),
        "redelete"
    );
    vas.patch_metadata(&name, &MetadataPatch::new().remove_finalizer(VA_FINALIZER))
        .await?;
    ensure!(
        vas.get_opt(&name).await?.is_none(),
        "removing the last finalizer deletes"
    );
    Ok(())
}

async fn pod_grace_period_and_force_delete(ctx: &Ctx) -> Result<()> {
    let pods = ctx.cluster.api::<Pod>(Some(&ctx.ns));
    let node = format!("fc-node-{}", ctx.run);
    let name = ctx.name("grace");
    pods.create(&ctx.pod("grace", Some(&node))).await?;

    let out = pods.delete(&name, &DeleteOptions::grace_period(30)).await?;
    ensure!(
        matches!(out, DeleteOutcome::Terminating(_)),
        "graceful delete keeps the pod"
    );
    let p = pods.get(&name).await?;
    ensure!(
        p.metadata.deletion_timestamp.is_some(),
        "deletionTimestamp set"
    );
    ensure!(
        p.metadata.deletion_grace_period_seconds == Some(30),
        "grace recorded: {:?}",
        p.metadata.deletion_grace_period_seconds
    );

    // A longer grace period cannot extend it.
    pods.delete(&name, &DeleteOptions::grace_period(60)).await?;
    ensure!(
        pods.get(&name)
            .await?
            .metadata
            .deletion_grace_period_seconds
            == Some(30),
        "grace not extended"
    );
    // A shorter one shortens it.
    pods.delete(&name, &DeleteOptions::grace_period(10)).await?;
    ensure!(
        pods.get(&name)
            .await?
            .metadata
            .deletion_grace_period_seconds
            == Some(10),
        "grace shortened"
    );

    let out = pods.delete(&name, &DeleteOptions::force()).await?;
    ensure!(out.is_deleted(), "force delete removes the pod: {out:?}");
    ensure!(pods.get_opt(&name).await?.is_none(), "pod gone");

    // An unscheduled pod has no kubelet to wait for: it goes at once.
    let lone = ctx.name("unscheduled");
    pods.create(&ctx.pod("unscheduled", None)).await?;
    ensure!(
        pods.delete(&lone, &DeleteOptions::default())
            .await?
            .is_deleted(),
        "unscheduled pod deleted at once"
    );

    // A pod's own finalizers hold it even through a force delete.
    let held = ctx.name("held");
    let mut p = ctx.pod("held", Some(&node));
    p.metadata.finalizers = Some(vec![POD_FINALIZER.into()]);
    pods.create(&p).await?;
    ensure!(
        matches!(
            pods.delete(&held, &DeleteOptions::force()).await?,
            DeleteOutcome::Terminating(_)
        ),
        "finalizer holds pod"
    );
    ensure!(
        pods.get(&held)
            .await?
            .metadata
            .deletion_grace_period_seconds
            == Some(0),
        "forced grace 0"
    );
    pods.patch_metadata(&held, &MetadataPatch::new().remove_finalizer(POD_FINALIZER))
        .await?;
    ensure!(
        pods.get_opt(&held).await?.is_none(),
        "pod deleted after last finalizer"
    );
    Ok(())
}

async fn uid_precondition_protects_recreated_pod(ctx: &Ctx) -> Result<()> {
    let pods = ctx.cluster.api::<Pod>(Some(&ctx.ns));
    let node = format!("fc-node-{}", ctx.run);
    let name = ctx.name("uid");
    let first = pods.create(&ctx.pod("uid", Some(&node))).await?;
    let uid1 = first.metadata.uid.clone().unwrap_or_default();
    pods.delete(&name, &DeleteOptions::force().with_uid(&uid1))
        .await?;
    let second = pods.create(&ctx.pod("uid", Some(&node))).await?;
    let uid2 = second.metadata.uid.clone().unwrap_or_default();
    ensure!(uid1 != uid2, "re-created pod has a new uid");

    let err = pods
        .delete(&name, &DeleteOptions::force().with_uid(&uid1))
        .await
        .expect_err("stale uid");
    ensure!(
        err.is_conflict(),
        "uid precondition mismatch is a conflict: {err}"
    );
    let still = pods.get(&name).await?;
    ensure!(
        still.metadata.uid.as_deref() == Some(uid2.as_str()),
        "the new pod survives"
    );
    ensure!(
        still.metadata.deletion_timestamp.is_none(),
        "and is not terminating"
    );

    // A replace carrying the old uid is refused too.
    let mut old = first.clone();
    old.metadata.resource_version = None;
    let err = pods.replace(&old).await.expect_err("replace with old uid");
    ensure!(
        err.is_conflict() || err.is_invalid(),
        "replace with stale uid refused: {err}"
    );

    ensure!(
        pods.delete(&name, &DeleteOptions::force().with_uid(&uid2))
            .await?
            .is_deleted(),
        "delete with right uid"
    );
    Ok(())
}

async fn status_subresource(ctx: &Ctx) -> Result<()> {
    let vas = ctx.cluster.api::<VolumeAttachment>(None);
    let mut sent = ctx.va("status");
    sent.status = Some(VolumeAttachmentStatus {
        attached: true,
        ..Default::default()
    });
    let created = vas.create(&sent).await?;
    ensure!(
        !created.status.as_ref().is_some_and(|s| s.attached),
        "create drops client status"
    );

    // Status update: status taken, spec change ignored.
    let mut st = created.clone();
    st.status = Some(VolumeAttachmentStatus {
        attached: true,
        ..Default::default()
    });
    st.spec.node_name = "somewhere-else".into();
    let after = vas.replace_status(&st).await?;
    ensure!(
        after.status.as_ref().is_some_and(|s| s.attached),
        "status written"
    );
    ensure!(
        after.spec.node_name == created.spec.node_name,
        "spec ignored by status update"
    );
    ensure!(
        after.metadata.generation == created.metadata.generation,
        "status does not bump generation"
    );

    // Main update: status change ignored, metadata change kept.
    let mut main = after.clone();
    main.status = Some(VolumeAttachmentStatus {
        attached: false,
        ..Default::default()
    });
    main.metadata
        .labels
        .get_or_insert_default()
        .insert("touched".into(), "yes".into());
    let after2 = vas.replace(&main).await?;
    ensure!(
        after2.status.as_ref().is_some_and(|s| s.attached),
        "main update keeps status"
    );
    ensure!(
        after2
            .metadata
            .labels
            .as_ref()
            .is_some_and(|l| l.contains_key("touched")),
        "main update writes metadata"
    );

    // Stale status update conflicts.
    let err = vas.replace_status(&st).await.expect_err("stale status");
    ensure!(err.is_conflict(), "stale status update: {err}");

    // Pods: phase through the status subresource.
    let pods = ctx.cluster.api::<Pod>(Some(&ctx.ns));
    let node = format!("fc-node-{}", ctx.run);
    let mut p = pods.create(&ctx.pod("status", Some(&node))).await?;
    p.status = Some(PodStatus {
        phase: Some("Running".into()),
        ..Default::default()
    });
    let p = pods.replace_status(&p).await?;
    ensure!(
        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
        "pod phase via status"
    );
    let running = pods
        .list(
            &ListParams::default()
                .labels(&ctx.selector())
                .fields("status.phase=Running"),
        )
        .await?;
    ensure!(running.items.len() == 1, "field selector status.phase");
    pods.delete(&name_of(&p), &DeleteOptions::force()).await?;
    vas.delete(&name_of(&created), &DeleteOptions::default())
        .await?;
    Ok(())
}

async fn watch_sees_the_sequence(ctx: &Ctx) -> Result<()> {
    let vas = ctx.cluster.api::<VolumeAttachment>(None);
    let selector = format!("{RUN_LABEL}={},watch=yes", ctx.run);
    let mut w = vas.watch(&WatchParams::default().labels(&selector))?;
    match next_event(&mut w).await? {
        WatchEvent::Listed(items) => ensure!(items.is_empty(), "initial list empty"),
        other => bail!("first event must be Listed, got {other:?}"),
    }
    let before = vas
        .list(&ListParams::default().labels(&selector))
        .await?
        .resource_version;

    let name = ctx.name("watch");
    let mut va = ctx.va("watch");
    va.metadata
        .labels
        .get_or_insert_default()
        .insert("watch".into(), "yes".into());
    vas.create(&va).await?;
    vas.patch_metadata(&name, &MetadataPatch::new().set_label("step", "2"))
        .await?;
    vas.patch_metadata(&name, &MetadataPatch::new().add_finalizer(VA_FINALIZER))
        .await?;
    vas.delete(&name, &DeleteOptions::default()).await?;
    vas.patch_metadata(&name, &MetadataPatch::new().remove_finalizer(VA_FINALIZER))
        .await?;

    // The real-cluster backend reports an add as Modified (kube-runtime's watcher does
    // not tell them apart); the embedded cluster says Added.
    let embedded = !ctx.cluster.is_kube();
    let expect = |ev: &WatchEvent<VolumeAttachment>| -> String {
        match ev {
            WatchEvent::Listed(_) => "Listed".into(),
            WatchEvent::Added(_) => "Added".into(),
            WatchEvent::Modified(o)
                if !embedded
                    && o.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get("step"))
                        .is_none() =>
            {
                "Added".into()
            }
            WatchEvent::Modified(o) if o.metadata.deletion_timestamp.is_some() => {
                "Modified(deleting)".into()
            }
            WatchEvent::Modified(_) => "Modified".into(),
            WatchEvent::Deleted(_) => "Deleted".into(),
        }
    };
    let want = [
        "Added",
        "Modified",
        "Modified",
        "Modified(deleting)",
        "Deleted",
    ];
    let mut got = Vec::new();
    let mut last_rv = 0u64;
    for _ in want {
        let ev = next_event(&mut w).await?;
        if let WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) = &ev {
            let rv: u64 = o
                .metadata
                .resource_version
                .as_deref()
                .unwrap_or("0")
                .parse()
                .unwrap_or(0);
            ensure!(rv > last_rv, "resourceVersions increase along the watch");
            last_rv = rv;
        }
        got.push(expect(&ev));
    }
    ensure!(got == want, "watch sequence {got:?}");

    // Starting after a resourceVersion replays what came after it, without a list; the
    // real-cluster backend lists instead (allowed by the seam), and the list holds the
    // object's latest state.
    let mut w2 = vas.watch(&WatchParams::default().labels(&selector).after(&before))?;
    let first = next_event(&mut w2).await?;
    if embedded {
        ensure!(
            matches!(first, WatchEvent::Added(_)),
            "watch from resourceVersion starts with the change: {}",
            expect(&first)
        );
    } else {
        ensure!(
            matches!(&first, WatchEvent::Listed(items) if items.is_empty()),
            "watch from resourceVersion on a real cluster starts with a list of what is left: {}",
            expect(&first)
        );
    }
    Ok(())
}

async fn leader_election(ctx: &Ctx) -> Result<()> {
    let lease_name = ctx.name("lease");
    let lease = Duration::from_secs(2);
    let timing = |id: &str| {
        LeaderElectionConfig::new(&ctx.ns, &lease_name, id).with_timing(
            lease,
            Duration::from_millis(1200),
            Duration::from_millis(200),
        )
    };
    let leases = ctx.cluster.api::<Lease>(Some(&ctx.ns));
    // The Lease's history, as the candidates write it.
    let mut history_w = watch_started(&leases).await?;
    let mut history = Vec::new();
    let a = LeaderElector::new(&ctx.cluster, timing("a"))?.spawn();
    let b = LeaderElector::new(&ctx.cluster, timing("b"))?.spawn();

    // Exactly one leads, and never both.
    let watch_both = |a: &fencecsi_cluster::LeaderHandle, b: &fencecsi_cluster::LeaderHandle| {
        ensure!(
            !(a.is_leader() && b.is_leader()),
            "both candidates lead at once"
        );
        Ok(())
    };
    let start = Instant::now();
    while !(a.is_leader() || b.is_leader()) {
        watch_both(&a, &b)?;
        ensure!(start.elapsed() < LIVENESS, "nobody became leader");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Watched on for over a lease duration: still never both.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        watch_both(&a, &b)?;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Exactly one, once any renew delayed by a loaded machine has caught up.
    wait_until("exactly one leader", LIVENESS, || {
        a.is_leader() != b.is_leader()
    })
    .await?;
    let (leader, follower) = if a.is_leader() { (a, b) } else { (b, a) };
    let leader_id = leader.elector().identity().to_string();
    let follower_id = follower.elector().identity().to_string();

    // Release: the follower takes over promptly, not once the lease has expired: its
    // acquireTime comes less than a lease duration after the release the leader recorded
    // (no holder, its renewTime). Both stamps are the candidates' own.
    leader.shutdown().await?;
    wait_until("the follower takes the released lease", LIVENESS, || {
        follower.is_leader()
    })
    .await?;
    lease_records_until(&mut history_w, &lease_name, &mut history, |l| {
        holder(l) == Some(follower_id.as_str())
    })
    .await?;
    let after_release = taken_after_release(&history)?;
    ensure!(
        after_release < SignedDuration::try_from(lease)?,
        "the follower took the lease {after_release:?} after its release: it waited for the expiry"
    );
    let lease_now = leases.get(&lease_name).await?;
    let spec = lease_now.spec.clone().unwrap_or_default();
    ensure!(
        spec.holder_identity.as_deref() == Some(follower.elector().identity()),
        "holder recorded"
    );
    ensure!(
        spec.holder_identity.as_deref() != Some(leader_id.as_str()),
        "old holder gone"
    );
    ensure!(
        spec.lease_transitions.unwrap_or(0) >= 1,
        "transition counted: {:?}",
        spec.lease_transitions
    );
    ensure!(
        spec.acquire_time.is_some() && spec.renew_time.is_some(),
        "times recorded"
    );

    // Expiry: the leader crashes (its loop stops, no release); a newcomer waits the lease
    // out. The crashed leader's own time-based view must end before the newcomer leads.
    let c = LeaderElector::new(&ctx.cluster, timing("c"))?.spawn();
    let c_started = Timestamp::now();
    // The follower goes on renewing while the newcomer tries (two renewals stamped after
    // it started): the newcomer must not lead while the lease is held.
    let mut renewals = 0;
    lease_records_until(&mut history_w, &lease_name, &mut history, |l| {
        if holder(l) == Some(follower_id.as_str())
            && l.renew_time.as_ref().is_some_and(|t| t.0 > c_started)
        {
            renewals += 1;
        }
        renewals >= 2
    })
    .await?;
    ensure!(
        !c.is_leader(),
        "newcomer must not lead while the lease is held"
    );
    let mut crashed = follower;
    wait_until("the follower leads", LIVENESS, || crashed.is_leader()).await?;
    let crash = Instant::now();
    crashed.abort();
    while !c.is_leader() {
        ensure!(
            !crashed.is_leader() || !c.is_leader(),
            "newcomer leads while the crashed leader still thinks it leads"
        );
        ensure!(
            crash.elapsed() < LIVENESS,
            "newcomer did not take over an expired lease"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    ensure!(
        !crashed.is_leader(),
        "crashed leader's view expired before takeover"
    );
    // The newcomer counts the lease duration on its own clock from when it saw the
    // crashed leader's last renewal, which came after that was stamped; it stamps
    // acquireTime as the round that finds the lease expired begins, one read earlier. So
    // acquireTime comes a lease duration after the last renewTime, less that read: half
    // the lease leaves it a second.
    lease_records_until(&mut history_w, &lease_name, &mut history, |l| {
        holder(l) == Some("c")
    })
    .await?;
    let last_renewal = history
        .iter()
        .rev()
        .find(|l| holder(l) == Some(follower_id.as_str()))
        .and_then(|l| l.renew_time.clone())
        .ok_or_else(|| anyhow!("no renewal of the crashed leader: {history:?}"))?;
    let acquired = history
        .last()
        .and_then(|l| l.acquire_time.clone())
        .ok_or_else(|| anyhow!("no acquireTime: {history:?}"))?;
    let waited = acquired.0.duration_since(last_renewal.0);
    ensure!(
        waited >= SignedDuration::try_from(lease / 2)?,
        "took over {waited:?} after the last renewal, before the lease ({lease:?}) expired"
    );
    let lease_now = leases.get(&lease_name).await?;
    let holder_now = lease_now.spec.and_then(|s| s.holder_identity);
    ensure!(
        holder_now.as_deref() == Some("c"),
        "newcomer holds the lease: {holder_now:?}"
    );
    c.shutdown().await?;
    Ok(())
}

/// The holder a Lease record names, if any (a released Lease names none).
/// Followers lead only where the followed Lease's holder is: of two candidates that share
/// a Lease and follow another, the one whose identity holds the other leads (the positive
/// control that the gate lets anyone lead); when the followed Lease moves, it releases
/// and the other takes over without waiting for an expiry.
async fn followers_lead_where_the_followed_lease_is_held(ctx: &Ctx) -> Result<()> {
    let own = ctx.name("follower-lease");
    let followed = ctx.name("followed-lease");
    let leases = ctx.cluster.api::<Lease>(Some(&ctx.ns));
    let set_holder = |who: &str| Lease {
        metadata: ObjectMeta {
            name: Some(followed.clone()),
            namespace: Some(ctx.ns.clone()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(who.into()),
            ..Default::default()
        }),
    };
    leases.create(&set_holder("pod-a")).await?;
    let lease = Duration::from_secs(2);
    let timing = |id: &str| {
        LeaderElectionConfig::new(&ctx.ns, &own, id)
            .with_timing(
                lease,
                Duration::from_millis(1200),
                Duration::from_millis(200),
            )
            .following(Some(&followed))
    };
    let mut history_w = watch_started(&leases).await?;
    let mut history = Vec::new();
    let a = LeaderElector::new(&ctx.cluster, timing("pod-a"))?.spawn();
    let b = LeaderElector::new(&ctx.cluster, timing("pod-b"))?.spawn();
    let t = Instant::now();
    while !a.is_leader() {
        ensure!(
            !b.is_leader(),
            "pod-b leads while the followed Lease names pod-a"
        );
        ensure!(t.elapsed() < LIVENESS, "pod-a never led");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    ensure!(!b.is_leader(), "both lead");

    let mut moved = leases.get(&followed).await?;
    moved.spec = set_holder("pod-b").spec;
    leases.replace(&moved).await?;
    let t = Instant::now();
    while !b.is_leader() {
        ensure!(t.elapsed() < LIVENESS, "pod-b never took over");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    ensure!(
        !a.is_leader(),
        "pod-a still leads after the followed Lease moved"
    );
    lease_records_until(&mut history_w, &own, &mut history, |l| {
        holder(l) == Some("pod-b")
    })
    .await?;
    ensure!(
        taken_after_release(&history)? < SignedDuration::try_from(lease)?,
        "pod-b waited for the expiry instead of taking the released Lease"
    );
    a.shutdown().await?;
    b.shutdown().await?;
    Ok(())
}

/// How long after the last release in `history` (no holder; its renewTime) the newest
/// holder acquired the Lease (its acquireTime): both stamps are the candidates' own.
fn taken_after_release(history: &[LeaseSpec]) -> Result<SignedDuration> {
    let released = history
        .iter()
        .rev()
        .find(|l| holder(l).is_none())
        .and_then(|l| l.renew_time.clone())
        .ok_or_else(|| anyhow!("the release is not in the Lease's history: {history:?}"))?;
    let acquired = history
        .last()
        .and_then(|l| l.acquire_time.clone())
        .ok_or_else(|| anyhow!("no acquireTime: {history:?}"))?;
    Ok(acquired.0.duration_since(released.0))
}

fn holder(l: &LeaseSpec) -> Option<&str> {
    l.holder_identity.as_deref().filter(|h| !h.is_empty())
}

/// A watch of `leases` that has delivered its initial list, so every later write reaches
/// it. A watch starts when it is first polled (on a real API server, kube's watcher lists
/// then), so one that waits unpolled would begin with a list of the latest state and miss
/// the history in between. The list itself is dropped: the Leases under test do not exist
/// yet.
async fn watch_started(leases: &Api<Lease>) -> Result<WatchStream<Lease>> {
    let mut w = leases.watch(&WatchParams::default())?;
    match next_event(&mut w).await? {
        WatchEvent::Listed(_) => Ok(w),
        other => Err(anyhow!("a watch began with {other:?}, not its list")),
    }
}

/// Reads the records of the Lease `name` from `w`, in the order they were written, until
/// `until` accepts one; appends them all to `seen`.
async fn lease_records_until(
    w: &mut WatchStream<Lease>,
    name: &str,
    seen: &mut Vec<LeaseSpec>,
    mut until: impl FnMut(&LeaseSpec) -> bool,
) -> Result<()> {
    loop {
        let leases = match next_event(w).await? {
            WatchEvent::Listed(l) => l,
            WatchEvent::Added(l) | WatchEvent::Modified(l) => vec![l],
            WatchEvent::Deleted(_) => continue,
        };
        for l in leases {
            if l.metadata.name.as_deref() != Some(name) {
                continue;
            }
            let spec = l.spec.unwrap_or_default();
            let done = until(&spec);
            seen.push(spec);
            if done {
                return Ok(());
            }
        }
    }
}

/// A candidate with a vacancy proof takes a Lease over before it expires once the proof
/// shows the holder gone on two rounds a retry period apart, the Lease unchanged between
/// them. The rounds are driven one by one and the Lease lasts an hour, so expiry explains
/// nothing here. Controls, with the same rounds: a proof that does not show the holder
/// gone, one that does not answer in time, a holder that renews between the two sightings
/// and a proof that wavers between them (either way, the count starts again).
async fn a_proven_vacancy_takes_over_before_expiry(ctx: &Ctx) -> Result<()> {
    let lease = ctx.name("vacated");
    let (_holder, candidate) = held_beside(ctx, &lease, proof_of_gone("gone")).await?;
    let led = rounds_of(&candidate, 2).await?;
    ensure!(
        led == [false, true],
        "proven gone twice, taken on the second round: {led:?}"
    );
    ensure!(
        holder_of(ctx, &lease).await?.as_deref() == Some("candidate"),
        "the candidate holds the Lease"
    );

    let slow: VacancyProof = Arc::new(|_: &str| {
        std::thread::sleep(VACANCY_RETRY * 3);
        true
    });
    for (what, proof) in [
        (
            "a proof that shows the holder running",
            proof_of_gone("nobody"),
        ),
        ("a proof that does not answer within the retry period", slow),
    ] {
        let lease = ctx.name("not-vacated");
        let (_holder, candidate) = held_beside(ctx, &lease, proof).await?;
        let led = rounds_of(&candidate, 4).await?;
        ensure!(led == [false; 4], "{what}: the candidate led: {led:?}");
        ensure!(
            holder_of(ctx, &lease).await?.as_deref() == Some("gone"),
            "{what}: the Lease moved"
        );
    }

    let lease = ctx.name("renewed");
    let (holder, candidate) = held_beside(ctx, &lease, proof_of_gone("gone")).await?;
    ensure!(
        !candidate.try_acquire_or_renew().await?,
        "led on its first sighting"
    );
    // A retry period on, the second sighting would take the Lease, but for the renewal.
    tokio::time::sleep(VACANCY_RETRY).await;
    ensure!(holder.try_acquire_or_renew().await?, "the holder renews");
    let led = rounds_of(&candidate, 2).await?;
    ensure!(
        led == [false, true],
        "a renewal between the sightings starts the count again: {led:?}"
    );

    // Gone, then not, then gone twice: taken on the fourth round, not the third.
    let answers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let wavering: VacancyProof =
        Arc::new(move |_: &str| answers.fetch_add(1, std::sync::atomic::Ordering::SeqCst) != 1);
    let lease = ctx.name("wavering");
    let (_holder, candidate) = held_beside(ctx, &lease, wavering).await?;
    let led = rounds_of(&candidate, 4).await?;
    ensure!(
        led == [false, false, false, true],
        "a round that does not show the holder gone starts the count again: {led:?}"
    );
    Ok(())
}

/// The retry period of the vacancy case's candidates; their Lease lasts an hour. It also
/// bounds each call of the proof, so it is long enough for a loaded machine to start one.
const VACANCY_RETRY: Duration = Duration::from_secs(1);

fn vacancy_timing(ctx: &Ctx, lease: &str, id: &str) -> LeaderElectionConfig {
    LeaderElectionConfig::new(&ctx.ns, lease, id).with_timing(
        Duration::from_secs(3600),
        Duration::from_secs(10),
        VACANCY_RETRY,
    )
}

/// A proof that shows `gone` gone, and every other holder running.
fn proof_of_gone(gone: &'static str) -> VacancyProof {
    Arc::new(move |holder: &str| holder == gone)
}

/// `lease` held by "gone" (one round of its elector), and a "candidate" with `proof`.
async fn held_beside(
    ctx: &Ctx,
    lease: &str,
    proof: VacancyProof,
) -> Result<(LeaderElector, LeaderElector)> {
    let holder = LeaderElector::new(&ctx.cluster, vacancy_timing(ctx, lease, "gone"))?;
    ensure!(holder.try_acquire_or_renew().await?, "the holder leads");
    let candidate = LeaderElector::new(&ctx.cluster, vacancy_timing(ctx, lease, "candidate"))?
        .proving_vacancy(proof);
    Ok((holder, candidate))
}

/// Whether `candidate` led after each of `n` rounds, a retry period apart.
async fn rounds_of(candidate: &LeaderElector, n: usize) -> Result<Vec<bool>> {
    let mut led = Vec::new();
    for i in 0..n {
        if i > 0 {
            tokio::time::sleep(VACANCY_RETRY).await;
        }
        led.push(candidate.try_acquire_or_renew().await?);
    }
    Ok(led)
}

async fn holder_of(ctx: &Ctx, lease: &str) -> Result<Option<String>> {
    let l = ctx.cluster.api::<Lease>(Some(&ctx.ns)).get(lease).await?;
    Ok(l.spec.and_then(|s| s.holder_identity))
}

async fn events_are_recorded(ctx: &Ctx) -> Result<()> {
    let vas = ctx.cluster.api::<VolumeAttachment>(None);
    let va = vas.create(&ctx.va("event")).await?;
    let rec = EventRecorder::new(&ctx.cluster, "fencecsi.io/contract-test", "test-instance");
    rec.record(
        &object_ref(&va),
        EventType::Warning,
        "FenceFailed",
        "could not freeze generation 3",
    )
    .await?;
    let events = ctx.cluster.api::<Event>(Some("default"));
    let got = events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|e| e.regarding.as_ref().and_then(|r| r.uid.clone()) == va.metadata.uid)
        .ok_or_else(|| anyhow!("no event regarding the VolumeAttachment"))?;
    ensure!(got.type_.as_deref() == Some("Warning"), "type");
    ensure!(got.reason.as_deref() == Some("FenceFailed"), "reason");
    ensure!(
        got.note.as_deref() == Some("could not freeze generation 3"),
        "note"
    );
    ensure!(
        got.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("VolumeAttachment"),
        "regarding kind"
    );
    ensure!(
        got.regarding.as_ref().and_then(|r| r.uid.clone()) == va.metadata.uid,
        "regarding uid"
    );
    events
        .delete(&name_of(&got), &DeleteOptions::default())
        .await?;
    vas.delete(&name_of(&va), &DeleteOptions::default()).await?;
    Ok(())
}

/// How long a case waits for what must come (normally within a lease duration or two): a
/// bound on liveness that a busy machine keeps.
const LIVENESS: Duration = Duration::from_secs(30);

async fn wait_until(what: &str, limit: Duration, f: impl Fn() -> bool) -> Result<()> {
    let t = Instant::now();
    while !f() {
        ensure!(t.elapsed() < limit, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Runner
// ---------------------------------------------------------------------------------------

/// Each case comes boxed: held inline, the largest case future (a kube-runtime watch in
/// a debug build) overflowed the test thread's 2 MiB stack on a real API server.
async fn case(name: &str, failures: &mut Vec<String>, fut: impl Future<Output = Result<()>>) {
    let t = Instant::now();
    match fut.await {
        Ok(()) => eprintln!("  ok    {name} ({:?})", t.elapsed()),
        Err(e) => {
            eprintln!("  FAIL  {name}: {e:#}");
            failures.push(format!("{name}: {e:#}"));
        }
    }
}

/// Removes everything a run created (also after a failed case).
async fn cleanup(ctx: &Ctx) -> Result<()> {
    let lp = ListParams::default().labels(&ctx.selector());
    let vas = ctx.cluster.api::<VolumeAttachment>(None);
    for va in vas.list(&lp).await?.items {
        let n = name_of(&va);
        let _ = vas
            .patch_metadata(&n, &MetadataPatch::new().remove_finalizer(VA_FINALIZER))
            .await;
        let _ = vas.delete(&n, &DeleteOptions::default()).await;
    }
    let pods = ctx.cluster.api::<Pod>(Some(&ctx.ns));
    for p in pods.list(&lp).await?.items {
        let n = name_of(&p);
        let _ = pods
            .patch_metadata(&n, &MetadataPatch::new().remove_finalizer(POD_FINALIZER))
            .await;
        let _ = pods.delete(&n, &DeleteOptions::force()).await;
    }
    let _ = ctx
        .cluster
        .api::<Lease>(Some(&ctx.ns))
        .delete(&ctx.name("lease"), &DeleteOptions::default())
        .await;
    Ok(())
}

/// The whole contract, identical for every backend.
/// A merge patch changes only what it names, `null` removes, and a stale
/// resourceVersion in it is a conflict that changes nothing.
async fn merge_patch(ctx: &Ctx) -> Result<()> {
    use fencecsi_cluster::k8s_openapi::api::coordination::v1::LeaseSpec;
    use serde_json::json;
    let leases = ctx.cluster.api::<Lease>(Some(&ctx.ns));
    let mut l = Lease {
        metadata: ctx.meta("patch", Some(&ctx.ns)),
        spec: Some(LeaseSpec {
            holder_identity: Some("x".into()),
            lease_duration_seconds: Some(15),
            ..Default::default()
        }),
    };
    l.metadata
        .labels
        .get_or_insert_default()
        .insert("a".into(), "1".into());
    let v1 = leases.create(&l).await?;
    let name = name_of(&v1);
    let v2 = leases
        .patch_merge(
            &name,
            &json!({"metadata": {"labels": {"b": "2"}}, "spec": {"holderIdentity": "y"}}),
        )
        .await?;
    let labels = v2.metadata.labels.clone().unwrap_or_default();
    ensure!(
        labels.get("a").map(String::as_str) == Some("1")
            && labels.get("b").map(String::as_str) == Some("2"),
        "labels merged: {labels:?}"
    );
    let spec = v2.spec.clone().unwrap_or_default();
    ensure!(
        spec.holder_identity.as_deref() == Some("y") && spec.lease_duration_seconds == Some(15),
        "spec merged: {spec:?}"
    );
    let v3 = leases
        .patch_merge(&name, &json!({"metadata": {"labels": {"b": null}}}))
        .await?;
    ensure!(
        !v3.metadata
            .labels
            .clone()
            .unwrap_or_default()
            .contains_key("b"),
        "null removes"
    );
    let err = leases
        .patch_merge(
            &name,
            &json!({"metadata": {"resourceVersion": v1.metadata.resource_version, "labels": {"c": "3"}}, "spec": {"holderIdentity": "stale"}}),
        )
        .await
        .expect_err("stale merge patch");
    ensure!(err.is_conflict(), "stale merge patch: {err}");
    let now = leases.get(&name).await?;
    ensure!(
        now.spec.and_then(|s| s.holder_identity).as_deref() == Some("y")
            && !now.metadata.labels.unwrap_or_default().contains_key("c"),
        "a stale merge patch changed nothing"
    );
    leases.delete(&name, &DeleteOptions::default()).await?;

    // The status subresource: only status changes, and a stale resourceVersion conflicts.
    let pods = ctx.cluster.api::<Pod>(Some(&ctx.ns));
    let node = format!("fc-node-{}", ctx.run);
    let p1 = pods.create(&ctx.pod("patch-status", Some(&node))).await?;
    let pname = name_of(&p1);
    let p2 = pods
        .patch_status_merge(
            &pname,
            &json!({"status": {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "Test"}]}}),
        )
        .await?;
    let conds = p2.status.and_then(|s| s.conditions).unwrap_or_default();
    ensure!(
        conds
            .iter()
            .any(|c| c.type_ == "DisruptionTarget" && c.reason.as_deref() == Some("Test")),
        "status merged: {conds:?}"
    );
    ensure!(
        p2.spec.and_then(|s| s.node_name).as_deref() == Some(node.as_str()),
        "spec kept"
    );
    let err = pods
        .patch_status_merge(
            &pname,
            &json!({"metadata": {"resourceVersion": p1.metadata.resource_version}, "status": {"conditions": null}}),
        )
        .await
        .expect_err("stale status patch");
    ensure!(err.is_conflict(), "stale status patch: {err}");
    pods.delete(&pname, &DeleteOptions::force()).await?;
    Ok(())
}

async fn run_contract(cluster: Cluster, ns: &str) -> Result<()> {
    let ctx = Ctx::new(cluster, ns);
    eprintln!(
        "contract run {} on {:?} (namespace {ns})",
        ctx.run, ctx.cluster
    );
    let mut failures = Vec::new();
    case(
        "create/get/list",
        &mut failures,
        Box::pin(create_get_list(&ctx)),
    )
    .await;
    case(
        "conflict on stale resourceVersion",
        &mut failures,
        Box::pin(conflict_on_stale_resource_version(&ctx)),
    )
    .await;
    case(
        "finalizer holds deletion",
        &mut failures,
        Box::pin(finalizer_holds_deletion(&ctx)),
    )
    .await;
    case(
        "pod grace period and force delete",
        &mut failures,
        Box::pin(pod_grace_period_and_force_delete(&ctx)),
    )
    .await;
    case(
        "uid precondition protects re-created pod",
        &mut failures,
        Box::pin(uid_precondition_protects_recreated_pod(&ctx)),
    )
    .await;
    case(
        "status subresource",
        &mut failures,
        Box::pin(status_subresource(&ctx)),
    )
    .await;
    case(
        "watch sees the sequence",
        &mut failures,
        Box::pin(watch_sees_the_sequence(&ctx)),
    )
    .await;
    case("merge patch", &mut failures, Box::pin(merge_patch(&ctx))).await;
    case(
        "leader election",
        &mut failures,
        Box::pin(leader_election(&ctx)),
    )
    .await;
    case(
        "followers lead where the followed lease is held",
        &mut failures,
        Box::pin(followers_lead_where_the_followed_lease_is_held(&ctx)),
    )
    .await;
    case(
        "a proven vacancy takes over before expiry",
        &mut failures,
        Box::pin(a_proven_vacancy_takes_over_before_expiry(&ctx)),
    )
    .await;
    case(
        "events recorded",
        &mut failures,
        Box::pin(events_are_recorded(&ctx)),
    )
    .await;
    if let Err(e) = cleanup(&ctx).await {
        failures.push(format!("cleanup: {e:#}"));
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(anyhow!(
            "{} contract case(s) failed:\n{}",
            failures.len(),
            failures.join("\n")
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_embedded() {
    run_contract(EmbeddedCluster::new().cluster(), "default")
        .await
        .unwrap();
}

/// Shows as "ignored" in every plain `cargo test` (a skipped run must not
/// look like a pass). Run it with
/// `FENCECSI_TEST_KUBECONFIG=<kubeconfig> cargo test -p fencecsi-embedded-cluster --test contract -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real API server: set FENCECSI_TEST_KUBECONFIG and pass --ignored"]
async fn contract_real_cluster() {
    let path = std::env::var_os("FENCECSI_TEST_KUBECONFIG")
        .filter(|p| !p.is_empty())
        .expect("FENCECSI_TEST_KUBECONFIG must name a kubeconfig for the real-cluster run");
    let ns = std::env::var("FENCECSI_TEST_NAMESPACE").unwrap_or_else(|_| "default".into());
    let cluster = Cluster::from_kubeconfig(&path)
        .await
        .expect("load FENCECSI_TEST_KUBECONFIG");
    run_contract(cluster, &ns).await.unwrap();
}
