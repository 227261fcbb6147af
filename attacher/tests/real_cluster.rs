//! The attacher in this process against a real API server, with the real driver in this
//! process on real loop devices (needs root). No kube-controller-manager or kubelet is
//! needed: the Node, CSINode, PersistentVolume and VolumeAttachments are made here as the
//! kubelet and the attach-detach controller would make them.
//!
//! Ignored unless asked for: set `FENCECSI_TEST_KUBECONFIG` to a kubeconfig with rights to
//! create Nodes, CSINodes, PVs, VolumeAttachments and Events, and pass `--ignored`;
//! without the variable the test prints SKIPPED and passes.
//!
//! ```text
//! FENCECSI_TEST_KUBECONFIG=/path/admin.kubeconfig \
//!   cargo test -p fencecsi-attacher --test real_cluster -- --ignored --nocapture
//! ```
//!
//! The driver gets a name of its own for the run (`fc-att-<run>.fencecsi.test`), so the
//! attacher acts only on this run's VolumeAttachments and PVs. Every object carries a
//! per-run name suffix and the label `fencecsi.test/real-cluster-run=<run>`; all of them
//! (and the Events about them) are deleted at the end, also when the scenario fails, and
//! the test env unmounts and detaches whatever the driver set up.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use fencecsi_attacher::metrics::SUCCESS;
use fencecsi_attacher::{
    spawn, Metrics, REASON_ATTACHED, REASON_DETACHED, REASON_FENCED, REPORTING_CONTROLLER,
    VA_NODE_ID_ANNOTATION,
};
use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, NodeStatus, PersistentVolume};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{CSINode, VolumeAttachment};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use fencecsi_cluster::{well_known, Cluster, DeleteOptions, WatchEvent, WatchParams};
use fencecsi_driver::config::Mode;
use fencecsi_driver::kernel::files::is_immutable;
use fencecsi_driver::terms::CTX_GENERATION;
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::real_cluster::{
    kubeconfig_or_skip, name_of, resume_failure, Recorder, RunCtx, Sweep, RUN_LABEL,
};
use fencecsi_tests::{csi, generation_path, require_root, Env, InProcess};

/// The finalizer kube-apiserver's StorageObjectInUseProtection admission puts on every PV.
const PV_PROTECTION: &str = "kubernetes.io/pv-protection";
/// Bound on every wait for the attacher.
const T: Duration = Duration::from_secs(30);

/// The names of this test's objects in the run.
trait Names {
    fn driver(&self) -> String;
    fn node(&self) -> String;
    /// The CSI node ID: not the node's name, so the attacher must read the CSINode.
    fn node_id(&self) -> String;
    fn finalizer(&self) -> String;
}

impl Names for RunCtx {
    fn driver(&self) -> String {
        format!("fc-att-{}.fencecsi.test", self.run)
    }

    fn node(&self) -> String {
        self.name("att-node")
    }

    fn node_id(&self) -> String {
        self.name("att-node-id")
    }

    fn finalizer(&self) -> String {
        well_known::attacher_finalizer(&self.driver())
    }
}

/// Reasons of the attacher's Events about the VolumeAttachment `va`, in order.
async fn event_reasons(cluster: &Cluster, va: &str) -> Vec<String> {
    va_event_reasons(cluster, va, Some(REPORTING_CONTROLLER)).await
}

async fn wait_event(cluster: &Cluster, va: &str, reason: &str) -> Vec<String> {
    wait_va_event(cluster, va, reason, Some(REPORTING_CONTROLLER), T).await
}

/// A volume made through the driver, its PV and a VolumeAttachment to the run's node, as
/// the PV controller and the attach-detach controller would make them. Returns (volume
/// handle, PV name, VA name).
async fn volume_and_va(ctx: &RunCtx, client: &CsiClient, base: &str) -> (String, String, String) {
    let c = &ctx.cluster;
    let pv_name = ctx.name(&format!("pv-{base}"));
    let handle = create_volume(client, &pv_name, true).await;
    let mut p = pv_of(&pv_name, &handle, true, "ReadWriteOnce", &ctx.driver());
    p.metadata = ctx.meta(&pv_name, None);
    let spec = p.spec.as_mut().unwrap();
    spec.capacity = Some(BTreeMap::from([(
        "storage".to_string(),
        Quantity("1Mi".into()),
    )]));
    spec.storage_class_name = Some(String::new());
    c.api::<PersistentVolume>(None).create(&p).await.unwrap();
    let va_name = ctx.name(&format!("va-{base}"));
    let mut va = va_of(&pv_name, &handle, &ctx.node(), &ctx.driver());
    va.metadata = ctx.meta(&va_name, None);
    c.api::<VolumeAttachment>(None).create(&va).await.unwrap();
    (handle, pv_name, va_name)
}

/// The scenario; panics on failure (the caller cleans up either way).
async fn scenario(ctx: RunCtx, client: CsiClient, env: Arc<Env>, metrics: Arc<Metrics>) {
    let c = ctx.cluster.clone();
    let node = ctx.node();
    let vas = c.api::<VolumeAttachment>(None);
    let pvs = c.api::<PersistentVolume>(None);

    // The node as its kubelet registers it: Ready, and a CSINode naming the driver's node ID.
    c.api::<Node>(None)
        .create(&Node {
            metadata: ctx.meta(&node, None),
            spec: None,
            status: Some(NodeStatus::default()),
        })
        .await
        .unwrap();
    set_ready(&c, &node, true).await;
    let mut cn = csinode(&node, &ctx.node_id());
    cn.metadata = ctx.meta(&node, None);
    cn.spec.drivers[0].name = ctx.driver();
    c.api::<CSINode>(None).create(&cn).await.unwrap();

    let va_rec = Recorder::start(
        vas.watch(&WatchParams::default().labels(&ctx.selector()))
            .unwrap(),
    );

    // 1. Attach: finalizers on the VA and the PV, the node ID from the CSINode, the
    //    publish context in the status, published in the driver.
    let (h1, pv1, va1) = volume_and_va(&ctx, &client, "ready").await;
    let attached = wait_attached(&c, &va1, T).await;
    assert_eq!(finalizers(&attached), vec![ctx.finalizer()]);
    assert_eq!(
        attached.metadata.annotations.as_ref().unwrap()[VA_NODE_ID_ANNOTATION],
        ctx.node_id()
    );
    let st = attached.status.clone().unwrap();
    assert_eq!(st.attach_error, None);
    let gen1 = st
        .attachment_metadata
        .as_ref()
        .and_then(|m| m.get(CTX_GENERATION))
        .expect("attachmentMetadata carries the generation")
        .parse::<u64>()
        .unwrap();
    // The API server's StorageObjectInUseProtection admission gave the PV its own
    // finalizer at create; the attacher's is added next to it.
    assert_eq!(
        finalizers(&pvs.get(&pv1).await.unwrap()),
        vec![PV_PROTECTION.to_string(), ctx.finalizer()],
        "the PV is held while attached"
    );
    assert_eq!(published_nodes(&client, &h1).await, vec![ctx.node_id()]);
    wait_event(&c, &va1, REASON_ATTACHED).await;

    // 2. Detach from a Ready node: unpublished without a fence, the finalizer released,
    //    the VA gone.
    vas.delete(&va1, &DeleteOptions::default()).await.unwrap();
    wait_gone(&c, &va1, T).await;
    assert!(
        published_nodes(&client, &h1).await.is_empty(),
        "unpublished"
    );
    assert_eq!(
        finalizers(&pvs.get(&pv1).await.unwrap()),
        vec![PV_PROTECTION.to_string()],
        "the attacher's PV finalizer released, the API server's kept"
    );
    assert!(
        !is_immutable(&generation_path(&env, &h1, gen1)).unwrap(),
        "no fence on a Ready node"
    );
    let reasons = wait_event(&c, &va1, REASON_DETACHED).await;
    assert!(!reasons.iter().any(|r| r == REASON_FENCED), "{reasons:?}");
    // From the watch: the VA was held by the finalizer while deleting, and went without it.
    let evs = va_rec.snapshot();
    assert!(
        evs.iter().any(
            |ev| matches!(ev, WatchEvent::Added(v) | WatchEvent::Modified(v)
            if name_of(v) == va1 && v.metadata.deletion_timestamp.is_some()
                && finalizers(v) == vec![ctx.finalizer()])
        ),
        "the watch saw the VA deleting, held by the finalizer"
    );
    let gone = evs
        .iter()
        .find_map(|ev| match ev {
            WatchEvent::Deleted(v) if name_of(v) == va1 => Some(v.clone()),
            _ => None,
        })
        .expect("the watch saw the VA deleted");
    // As etcd keeps it: the Deleted event carries the last stored state, the one that
    // still had the finalizer (its removal is the update that deleted the object).
    assert!(gone.metadata.deletion_timestamp.is_some());
    eprintln!(
        "Deleted event of {va1}: finalizers {:?} (the state before the removal)",
        finalizers(&gone)
    );

    // 3. Detach from a node that went NotReady: fenced.
    let (h2, pv2, va2) = volume_and_va(&ctx, &client, "notready").await;
    let attached = wait_attached(&c, &va2, T).await;
    let gen2: u64 = attached.status.unwrap().attachment_metadata.unwrap()[CTX_GENERATION]
        .parse()
        .unwrap();
    set_ready(&c, &node, false).await;
    vas.delete(&va2, &DeleteOptions::default()).await.unwrap();
    wait_gone(&c, &va2, T).await;
    assert!(
        published_nodes(&client, &h2).await.is_empty(),
        "unpublished"
    );
    assert!(
        is_immutable(&generation_path(&env, &h2, gen2)).unwrap(),
        "the fenced generation carries the immutable flag"
    );
    wait_event(&c, &va2, REASON_FENCED).await;
    assert_eq!(
        finalizers(&pvs.get(&pv2).await.unwrap()),
        vec![PV_PROTECTION.to_string()],
        "the attacher's PV finalizer released, the API server's kept"
    );
    assert_eq!(metrics.fences(SUCCESS), 1);
    eprintln!(
        "events: {va1}: {:?}; {va2}: {:?}",
        event_reasons(&c, &va1).await,
        event_reasons(&c, &va2).await
    );

    for h in [h1, h2] {
        client
            .clone()
            .controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: h.clone(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("DeleteVolume {h}: {e}"));
    }
}

/// What this run creates on the API server, in the order the cleanup deletes it.
fn kinds() -> Vec<Sweep> {
    vec![
        Sweep::of::<VolumeAttachment>(None),
        Sweep::of::<PersistentVolume>(None),
        Sweep::of::<CSINode>(None),
        Sweep::of::<Node>(None),
    ]
}

/// Shows as "ignored" in a plain `cargo test`. Run with
/// `FENCECSI_TEST_KUBECONFIG=<kubeconfig> cargo test -p fencecsi-attacher --test real_cluster -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real API server: set FENCECSI_TEST_KUBECONFIG and pass --ignored"]
async fn attacher_on_a_real_api_server() {
    let Some(path) = kubeconfig_or_skip("attacher_on_a_real_api_server") else {
        return;
    };
    require_root!();
    let ctx = RunCtx::connect(&path).await;
    let cluster = ctx.cluster.clone();
    eprintln!(
        "attacher real-cluster run {} (label {RUN_LABEL}={}, driver {})",
        ctx.run,
        ctx.run,
        ctx.driver()
    );

    let env = Arc::new(Env::new());
    let mut dcfg = env.config(Mode::All, Some(&ctx.node_id()), "all");
    dcfg.driver_name = ctx.driver();
    let (plugin, client) = InProcess::start(dcfg).await;
    let mut a = spawn(cluster, test_config(&env.socket("all")));
    let active = a.wait_active(T).await;
    let outcome = if active {
        assert_eq!(a.status().driver, Some(ctx.driver()));
        tokio::spawn(Box::pin(scenario(
            ctx.clone(),
            client,
            env.clone(),
            a.metrics().clone(),
        )))
        .await
    } else {
        Ok(())
    };
    // Stop the attacher first, so it does not act on what the cleanup does.
    if let Err(e) = a.shutdown().await {
        eprintln!("the attacher stopped with an error: {e}");
    }
    let left = ctx.cleanup_in_task(kinds()).await;
    plugin.stop().await;
    let env = Arc::try_unwrap(env).unwrap_or_else(|_| panic!("the scenario still holds the env"));
    let (mounts, loops) = env.teardown();
    resume_failure(outcome, &left);
    assert!(active, "the attacher never became active");
    assert!(left.is_empty(), "objects left on the API server: {left:?}");
    assert_eq!(
        (mounts, loops),
        (0, 0),
        "the driver left mounts or loop devices"
    );
    env.assert_clean();
    eprintln!("cleaned up: nothing of run {} left", ctx.run);
}
