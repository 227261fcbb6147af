//! The attacher against the real driver (in this process, on real loop devices) and the
//! embedded cluster.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use fencecsi_attacher::metrics::{ATTACH, DETACH, ERROR, SUCCESS};
use fencecsi_attacher::{
    lease_name_for, spawn, Attacher, FencePolicy, LeaderElectionArgs, Phase, REASON_ATTACHED,
    REASON_ATTACHMENT_LOST, REASON_ATTACH_FAILED, REASON_DETACHED, REASON_FENCED,
    VA_NODE_ID_ANNOTATION,
};
use fencecsi_cluster::k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, NodeSpec, PersistentVolume, Taint};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeError};
use fencecsi_cluster::k8s_openapi::jiff::{SignedDuration, Timestamp};
use fencecsi_cluster::{well_known, Cluster, DeleteOptions, WatchEvent, WatchParams, WatchStream};
use fencecsi_driver::config::Mode;
use fencecsi_driver::kernel::files::is_immutable;
use fencecsi_driver::terms::CTX_GENERATION;
use fencecsi_embedded_cluster::EmbeddedCluster;
use fencecsi_tests::{generation_path, require_root, Env, InProcess};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long a test waits for what must come (normally milliseconds to a couple of
/// seconds): a bound on liveness that a busy machine keeps, never a measure of speed.
const T: Duration = Duration::from_secs(30);

fn fin() -> String {
    well_known::attacher_finalizer(DRIVER)
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let code = out[9..12].parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// Reasons of the events recorded about `va`, in order.
async fn event_reasons(cluster: &Cluster, va: &str) -> Vec<String> {
    va_event_reasons(cluster, va, None).await
}

async fn wait_event(cluster: &Cluster, va: &str, reason: &str) -> Vec<String> {
    wait_va_event(cluster, va, reason, None, T).await
}

/// How many ListVolumes calls the plugin has answered, from its own RPC metrics.
async fn list_volumes_calls(plugin: std::net::SocketAddr) -> u64 {
    let (code, text) = http_get(plugin, "/metrics").await;
    assert_eq!(code, 200, "{text}");
    text.lines()
        .filter(|l| {
            l.starts_with("fencecsi_driver_operations_seconds_count{")
                && l.contains("method_name=\"/csi.v1.Controller/ListVolumes\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The holder a Lease record names, if any (a released Lease names none).
/// The attachError recorded on VolumeAttachment `name`, once there is one.
async fn recorded_attach_error(cluster: &Cluster, name: &str) -> VolumeError {
    let vas = cluster.api::<VolumeAttachment>(None);
    eventually(T, &format!("attachError on {name}"), || {
        let (vas, name) = (vas.clone(), name.to_string());
        async move {
            vas.get(&name)
                .await
                .unwrap()
                .status
                .and_then(|s| s.attach_error)
        }
    })
    .await
}

fn holder(l: &LeaseSpec) -> Option<&str> {
    l.holder_identity.as_deref().filter(|h| !h.is_empty())
}

/// Reads the records of the Lease `name` from `w`, in the order they were written, until
/// `until` accepts one; appends them all to `seen`.
async fn lease_records_until(
    w: &mut WatchStream<Lease>,
    name: &str,
    seen: &mut Vec<LeaseSpec>,
    until: impl Fn(&LeaseSpec) -> bool,
) {
    loop {
        let ev = tokio::time::timeout(T, w.next())
            .await
            .unwrap_or_else(|_| panic!("no Lease change within {T:?}: {seen:?}"))
            .expect("the Lease watch ended");
        let leases = match ev {
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
                return;
            }
        }
    }
}

/// acquireTime of the newest Lease record seen.
fn last_acquire_time(
    history: &[LeaseSpec],
) -> fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime {
    history
        .last()
        .expect("a Lease record")
        .acquire_time
        .clone()
        .expect("acquireTime")
}

/// A plugin in "all" mode serving node-a, a cluster with node-a (Ready) registered, and
/// one volume with its PV.
struct Setup {
    env: Env,
    plugin: Option<InProcess>,
    client: fencecsi_proto::client::CsiClient,
    /// The plugin's `/metrics`: the calls it answered, by method.
    plugin_http: std::net::SocketAddr,
    cluster: EmbeddedCluster,
}

impl Setup {
    async fn new() -> Setup {
        fencecsi_tests::init_tracing();
        let env = Env::new();
        let mut cfg = env.config(Mode::All, Some("node-a"), "all");
        cfg.http_endpoint = Some("127.0.0.1:0".parse().unwrap());
        let (plugin, client, plugin_http) = InProcess::start_with_metrics(cfg).await;
        let cluster = EmbeddedCluster::new();
        register_node(&cluster, "node-a", true).await;
        Setup {
            env,
            plugin: Some(plugin),
            client,
            plugin_http,
            cluster,
        }
    }

    fn socket(&self) -> std::path::PathBuf {
        self.env.socket("all")
    }

    /// A volume, its PV, and a VolumeAttachment to `node`; returns (handle, VA name).
    async fn volume_and_va(&self, pv_name: &str, node: &str) -> (String, String) {
        let handle = create_volume(&self.client, pv_name, true).await;
        self.cluster
            .api::<PersistentVolume>(None)
            .create(&pv(pv_name, &handle, true, "ReadWriteOnce"))
            .await
            .unwrap();
        let va = va(pv_name, &handle, node);
        let name = va.metadata.name.clone().unwrap();
        self.cluster
            .api::<VolumeAttachment>(None)
            .create(&va)
            .await
            .unwrap();
        (handle, name)
    }

    async fn finish(mut self) {
        if let Some(p) = self.plugin.take() {
            p.stop().await;
        }
        self.env.assert_clean();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_then_detach_without_fence_on_a_ready_node() {
    require_root!();
    let s = Setup::new().await;
    let mut a = spawn(s.cluster.cluster(), test_config(&s.socket()));
    assert!(a.wait_active(T).await, "attacher active");
    assert_eq!(a.status().driver.as_deref(), Some(DRIVER));
    let (handle, name) = s.volume_and_va("pv-1", "node-a").await;

    let va = wait_attached(&s.cluster, &name, T).await;
    assert_eq!(finalizers(&va), vec![fin()]);
    let st = va.status.clone().unwrap();
    assert_eq!(st.attach_error, None);
    let meta = st.attachment_metadata.expect("attachmentMetadata");
    assert_eq!(
        meta.get(CTX_GENERATION).map(String::as_str),
        Some("1"),
        "{meta:?}"
    );
    assert_eq!(
        va.metadata.annotations.as_ref().unwrap()[VA_NODE_ID_ANNOTATION],
        "node-a"
    );
    let pv = s
        .cluster
        .api::<PersistentVolume>(None)
        .get("pv-1")
        .await
        .unwrap();
    assert_eq!(
        finalizers(&pv),
        vec![fin()],
        "the PV is held while attached"
    );
    assert_eq!(published_nodes(&s.client, &handle).await, vec!["node-a"]);
    wait_event(&s.cluster, &name, REASON_ATTACHED).await;

    // /healthz, /readyz and /metrics answer.
    let addr = a.status().http_addr.unwrap();
    assert_eq!(http_get(addr, "/healthz").await, (200, "ok\n".into()));
    assert_eq!(http_get(addr, "/readyz").await, (200, "ok\n".into()));
    let (code, metrics) = http_get(addr, "/metrics").await;
    assert_eq!(code, 200);
    assert!(
        metrics
            .contains("fencecsi_attacher_operations_total{kind=\"attach\",result=\"success\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("fencecsi_attacher_active 1"), "{metrics}");
    assert_eq!(http_get(addr, "/nope").await.0, 404);

    // Detach: the node is Ready and does not list the volume in use: no fence.
    s.cluster
        .api::<VolumeAttachment>(None)
        .delete(&name, &DeleteOptions::default())
        .await
        .unwrap();
    wait_gone(&s.cluster, &name, T).await;
    assert!(published_nodes(&s.client, &handle).await.is_empty());
    let pv = s
        .cluster
        .api::<PersistentVolume>(None)
        .get("pv-1")
        .await
        .unwrap();
    assert!(
        finalizers(&pv).is_empty(),
        "PV finalizer released: {:?}",
        finalizers(&pv)
    );
    assert!(
        !is_immutable(&generation_path(&s.env, &handle, 1)).unwrap(),
        "no fence on a Ready node"
    );
    let reasons = wait_event(&s.cluster, &name, REASON_DETACHED).await;
    assert!(!reasons.iter().any(|r| r == REASON_FENCED), "{reasons:?}");
    assert_eq!(a.metrics().operations(DETACH, SUCCESS), 1);
    assert_eq!(a.metrics().fences(SUCCESS), 0);

    a.shutdown().await.unwrap();
    s.finish().await;
}

/// The resync checks attachments against ListVolumes' published nodes, as
/// external-attacher does: an attachment the plugin lost (here: unpublished out of band)
/// is marked not attached, with a Warning, and published again. One that the plugin still
/// lists, checked by the same resync, is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attachment_the_plugin_lost_is_marked_and_published_again() {
    require_root!();
    let s = Setup::new().await;
    let mut a = spawn(s.cluster.cluster(), test_config(&s.socket()));
    assert!(a.wait_active(T).await, "attacher active");
    let (lost, lost_va) = s.volume_and_va("pv-lost", "node-a").await;
    let (kept, kept_va) = s.volume_and_va("pv-kept", "node-a").await;
    wait_attached(&s.cluster, &lost_va, T).await;
    wait_attached(&s.cluster, &kept_va, T).await;

    s.client
        .clone()
        .controller
        .controller_unpublish_volume(fencecsi_proto::v1::ControllerUnpublishVolumeRequest {
            volume_id: lost.clone(),
            node_id: "node-a".into(),
            ..Default::default()
        })
        .await
        .expect("out-of-band unpublish");
    assert!(published_nodes(&s.client, &lost).await.is_empty());

    let reasons = wait_event(&s.cluster, &lost_va, REASON_ATTACHMENT_LOST).await;
    assert!(reasons.iter().any(|r| r == REASON_ATTACHED), "{reasons:?}");
    eventually(T, "published again", || async {
        (published_nodes(&s.client, &lost).await == vec!["node-a"]).then_some(())
    })
    .await;
    let va = wait_attached(&s.cluster, &lost_va, T).await;
    assert_eq!(
        va.status.unwrap().attach_error,
        None,
        "error cleared on re-attach"
    );
    assert!(!event_reasons(&s.cluster, &kept_va)
        .await
        .iter()
        .any(|r| r == REASON_ATTACHMENT_LOST));
    assert_eq!(published_nodes(&s.client, &kept).await, vec!["node-a"]);

    a.shutdown().await.unwrap();
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_fences_a_node_that_may_still_write() {
    require_root!();
    let s = Setup::new().await;
    let mut a = spawn(s.cluster.cluster(), test_config(&s.socket()));
    assert!(a.wait_active(T).await);
    let vas = s.cluster.api::<VolumeAttachment>(None);

    // 1: the node goes NotReady.
    let (h1, va1) = s.volume_and_va("pv-notready", "node-a").await;
    // 2: the node is Ready but still lists the volume in use.
    let (h2, va2) = s.volume_and_va("pv-inuse", "node-a").await;
    let a1 = wait_attached(&s.cluster, &va1, T).await;
    wait_attached(&s.cluster, &va2, T).await;
    let gen1: u64 = a1.status.unwrap().attachment_metadata.unwrap()[CTX_GENERATION]
        .parse()
        .unwrap();

    let nodes = s.cluster.api::<Node>(None);
    let mut n = nodes.get("node-a").await.unwrap();
    n.status.as_mut().unwrap().volumes_in_use =
        Some(vec![format!("kubernetes.io/csi/{DRIVER}^{h2}")]);
    nodes.replace_status(&n).await.unwrap();
    vas.delete(&va2, &DeleteOptions::default()).await.unwrap();
    wait_gone(&s.cluster, &va2, T).await;
    assert!(
        is_immutable(&generation_path(&s.env, &h2, 1)).unwrap(),
        "volume in use: fenced"
    );
    wait_event(&s.cluster, &va2, REASON_FENCED).await;

    set_ready(&s.cluster, "node-a", false).await;
    vas.delete(&va1, &DeleteOptions::default()).await.unwrap();
    wait_gone(&s.cluster, &va1, T).await;
    assert!(published_nodes(&s.client, &h1).await.is_empty());
    assert!(
        is_immutable(&generation_path(&s.env, &h1, gen1)).unwrap(),
        "the fenced generation must carry the immutable flag"
    );
    wait_event(&s.cluster, &va1, REASON_FENCED).await;
    assert_eq!(a.metrics().fences(SUCCESS), 2);

    // 3: a quarantined node that is Ready again, with --fence=never on another instance:
    // no fence. (Re-attach the first volume; it gets a new generation.)
    a.shutdown().await.unwrap();
    let mut cfg = test_config(&s.socket());
    cfg.fence = FencePolicy::Never;
    let mut b = spawn(s.cluster.cluster(), cfg);
    assert!(b.wait_active(T).await);
    set_ready(&s.cluster, "node-a", true).await;
    let mut n = nodes.get("node-a").await.unwrap();
    n.spec = Some(NodeSpec {
        taints: Some(vec![Taint {
            key: well_known::QUARANTINE_TAINT_KEY.into(),
            value: Some(well_known::QUARANTINE_TAINT_VALUE.into()),
            effect: "NoSchedule".into(),
            ..Default::default()
        }]),
        ..Default::default()
    });
    nodes.replace(&n).await.unwrap();
    let va3 = va("pv-notready", &h1, "node-a");
    vas.create(&va3).await.unwrap();
    let name3 = va3.metadata.name.clone().unwrap();
    let attached = wait_attached(&s.cluster, &name3, T).await;
    let gen3: u64 = attached.status.unwrap().attachment_metadata.unwrap()[CTX_GENERATION]
        .parse()
        .unwrap();
    assert!(
        gen3 > gen1,
        "a new generation after the fence ({gen3} > {gen1})"
    );
    vas.delete(&name3, &DeleteOptions::default()).await.unwrap();
    wait_gone(&s.cluster, &name3, T).await;
    assert!(
        !is_immutable(&generation_path(&s.env, &h1, gen3)).unwrap(),
        "--fence=never"
    );
    assert_eq!(b.metrics().fences(SUCCESS), 0);
    b.shutdown().await.unwrap();
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_failures_are_retried_with_growing_backoff_until_the_node_registers() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    // A controller only: node-b's plugin is not running, so the driver does not know it.
    let (controller, client) = InProcess::start(env.config(Mode::Controller, None, "ctrl")).await;
    let cluster = EmbeddedCluster::new().cluster();
    register_node(&cluster, "node-b", true).await;
    let mut cfg = test_config(&env.socket("ctrl"));
    cfg.backoff.initial = Duration::from_millis(100);
    cfg.backoff.max = Duration::from_secs(2);
    // No resync during the test: a resync queues the object at once, past its backoff,
    // and would add an attempt of its own between two retries.
    cfg.resync = Duration::from_secs(3600);
    let mut a = spawn(cluster.clone(), cfg);
    assert!(a.wait_active(T).await);

    let vas = cluster.api::<VolumeAttachment>(None);
    let mut watch = vas.watch(&WatchParams::default()).unwrap();
    let handle = create_volume(&client, "pv-b", true).await;
    cluster
        .api::<PersistentVolume>(None)
        .create(&pv("pv-b", &handle, true, "ReadWriteOnce"))
        .await
        .unwrap();
    let va = va("pv-b", &handle, "node-b");
    let name = va.metadata.name.clone().unwrap();
    vas.create(&va).await.unwrap();

    // The attacher stamps each failed attempt as it records it (attachError.time, its own
    // clock): the first five stamps, in the order written. When the watch delivers them
    // plays no part.
    let mut errors: Vec<(Timestamp, String)> = Vec::new();
    while errors.len() < 5 {
        let ev = tokio::time::timeout(T, watch.next())
            .await
            .expect("event")
            .unwrap();
        let (WatchEvent::Added(v) | WatchEvent::Modified(v)) = ev else {
            continue;
        };
        if let Some(e) = v.status.and_then(|s| s.attach_error) {
            let at = e.time.expect("attachError.time").0;
            if errors.last().is_none_or(|(last, _)| *last != at) {
                errors.push((at, e.message.unwrap_or_default()));
            }
        }
    }
    assert!(
        errors[0].1.contains("NotFound") && errors[0].1.contains("node-b"),
        "{errors:?}"
    );
    let gaps: Vec<Duration> = errors
        .windows(2)
        .map(|w| {
            Duration::try_from(w[1].0.duration_since(w[0].0))
                .expect("attachError times in the order written")
        })
        .collect();
    eprintln!(
        "attachError stamped at {:?}; gaps {gaps:?}",
        errors.iter().map(|e| e.0).collect::<Vec<_>>()
    );
    // 100, 200, 400, 800 ms: each retry waits twice as long as the one before. A retry is
    // queued only after the failure before it was stamped, so its own stamp comes a full
    // backoff later however busy the machine (less 1%: the wall clock of the stamps may
    // be slewed against the monotonic one the queue waits on). A busy machine can only
    // make a retry late; the upper bound, ten times the backoff, is for liveness.
    for (i, g) in gaps.iter().enumerate() {
        let want = Duration::from_millis(100 << i);
        assert!(
            *g >= want - want / 100,
            "retry {i} came before its backoff of {want:?}: gaps {gaps:?}"
        );
        assert!(*g < want * 10, "retry {i} came far too late: gaps {gaps:?}");
    }
    assert!(a.metrics().operations(ATTACH, ERROR) >= 4);
    wait_event(&cluster, &name, REASON_ATTACH_FAILED).await;
    let v = vas.get(&name).await.unwrap();
    assert!(!v.status.unwrap().attached);

    // The node plugin starts and registers node-b: the next retry attaches and clears
    // the error.
    let (node_plugin, _) = InProcess::start(env.config(Mode::Node, Some("node-b"), "node-b")).await;
    let v = wait_attached(&cluster, &name, T).await;
    assert_eq!(v.status.unwrap().attach_error, None, "attachError cleared");
    assert_eq!(published_nodes(&client, &handle).await, vec!["node-b"]);

    vas.delete(&name, &DeleteOptions::default()).await.unwrap();
    wait_gone(&cluster, &name, T).await;
    a.shutdown().await.unwrap();
    node_plugin.stop().await;
    controller.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_for_the_plugin_and_reconnects_when_it_comes_back() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let cfg_plugin = env.config(Mode::All, Some("node-a"), "all");
    let cluster = EmbeddedCluster::new().cluster();
    register_node(&cluster, "node-a", true).await;

    // No plugin answers yet: a stand-in on its socket accepts each connection and drops
    // it, counting the attacher's attempts.
    let socket = env.socket("all");
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let tries = Arc::new(AtomicUsize::new(0));
    let standin = {
        let tries = tries.clone();
        tokio::spawn(async move {
            loop {
                if let Ok((conn, _)) = listener.accept().await {
                    tries.fetch_add(1, Ordering::SeqCst);
                    drop(conn);
                }
            }
        })
    };
    let mut a = spawn(cluster.clone(), test_config(&socket));
    // It tried, failed, and tried again: still starting, neither active nor stopped.
    eventually(T, "the attacher tries the socket twice", || async {
        (tries.load(Ordering::SeqCst) >= 2).then_some(())
    })
    .await;
    assert_eq!(a.status().phase, Phase::Starting);
    standin.abort();
    let _ = standin.await;
    std::fs::remove_file(&socket).unwrap();
    let (plugin, client) = InProcess::start(cfg_plugin.clone()).await;
    assert!(a.wait_active(T).await, "active once the plugin is there");

    let vas = cluster.api::<VolumeAttachment>(None);
    let pvs = cluster.api::<PersistentVolume>(None);
    let h1 = create_volume(&client, "pv-r1", true).await;
    let h2 = create_volume(&client, "pv-r2", true).await;
    pvs.create(&pv("pv-r1", &h1, true, "ReadWriteOnce"))
        .await
        .unwrap();
    pvs.create(&pv("pv-r2", &h2, true, "ReadWriteOnce"))
        .await
        .unwrap();
    let va1 = va("pv-r1", &h1, "node-a");
    vas.create(&va1).await.unwrap();
    wait_attached(&cluster, va1.metadata.name.as_deref().unwrap(), T).await;

    // The plugin goes away: the next attach fails and is recorded...
    plugin.stop().await;
    let va2 = va("pv-r2", &h2, "node-a");
    let name2 = va2.metadata.name.clone().unwrap();
    vas.create(&va2).await.unwrap();
    let err = recorded_attach_error(&cluster, &name2)
        .await
        .message
        .unwrap_or_default();
    // Usually UNAVAILABLE (no socket); a call racing the plugin's exit can end otherwise.
    assert!(err.contains("ControllerPublishVolume"), "{err}");
    eprintln!("attachError while the plugin was down: {err}");

    // ...and retried until the plugin is back.
    let (plugin, client) = InProcess::start(cfg_plugin).await;
    let v = wait_attached(&cluster, &name2, T).await;
    assert_eq!(v.status.unwrap().attach_error, None);
    assert_eq!(published_nodes(&client, &h2).await, vec!["node-a"]);

    for v in [&va1, &va2] {
        vas.delete(
            v.metadata.name.as_deref().unwrap(),
            &DeleteOptions::default(),
        )
        .await
        .unwrap();
    }
    wait_gone(&cluster, va1.metadata.name.as_deref().unwrap(), T).await;
    wait_gone(&cluster, &name2, T).await;
    a.shutdown().await.unwrap();
    plugin.stop().await;
    env.assert_clean();
}

/// An attach that failed while the plugin was away is retried once it answers again, not
/// after the backoff: here an hour, so only that retry can attach it within the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_that_waited_for_the_plugin_is_retried_when_it_answers_not_after_its_backoff() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let cfg_plugin = env.config(Mode::All, Some("node-a"), "all");
    let cluster = EmbeddedCluster::new().cluster();
    register_node(&cluster, "node-a", true).await;
    let (plugin, client) = InProcess::start(cfg_plugin.clone()).await;
    let mut cfg = test_config(&env.socket("all"));
    let hour = Duration::from_secs(3600);
    cfg.backoff.initial = hour;
    cfg.backoff.max = hour;
    // No resync either: it would queue the object past its backoff.
    cfg.resync = hour;
    let mut a = spawn(cluster.clone(), cfg);
    assert!(a.wait_active(T).await);
    let handle = create_volume(&client, "pv-w", true).await;
    cluster
        .api::<PersistentVolume>(None)
        .create(&pv("pv-w", &handle, true, "ReadWriteOnce"))
        .await
        .unwrap();

    plugin.stop().await;
    let vas = cluster.api::<VolumeAttachment>(None);
    let va = va("pv-w", &handle, "node-a");
    let name = va.metadata.name.clone().unwrap();
    vas.create(&va).await.unwrap();
    let code = recorded_attach_error(&cluster, &name).await.error_code;
    assert_eq!(
        code.map(tonic::Code::from),
        Some(tonic::Code::Unavailable),
        "the failure recorded is the plugin's absence"
    );
    assert_eq!(a.metrics().plugin_return_retries(), 0);

    let (plugin, client) = InProcess::start(cfg_plugin).await;
    let v = wait_attached(&cluster, &name, T).await;
    assert_eq!(v.status.unwrap().attach_error, None);
    assert_eq!(published_nodes(&client, &handle).await, vec!["node-a"]);
    assert_eq!(
        a.metrics().plugin_return_retries(),
        1,
        "retried because the plugin answered again"
    );

    vas.delete(&name, &DeleteOptions::default()).await.unwrap();
    wait_gone(&cluster, &name, T).await;
    a.shutdown().await.unwrap();
    plugin.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attacher_killed_mid_detach_is_finished_by_the_next_one() {
    require_root!();
    let s = Setup::new().await;
    // The first attacher talks to the plugin through a proxy that can hold its calls.
    let proxy = GatedProxy::start(s.env.socket("proxy"), s.socket());
    let mut a = spawn(s.cluster.cluster(), test_config(&proxy.socket));
    assert!(a.wait_active(T).await);
    let (handle, name) = s.volume_and_va("pv-k", "node-a").await;
    let attached = wait_attached(&s.cluster, &name, T).await;
    let gen: u64 = attached.status.unwrap().attachment_metadata.unwrap()[CTX_GENERATION]
        .parse()
        .unwrap();

    // The node stops answering; the VolumeAttachment is deleted; the detach (with
    // fence) is sent but held in flight; the attacher dies.
    set_ready(&s.cluster, "node-a", false).await;
    proxy.set_open(false);
    let vas = s.cluster.api::<VolumeAttachment>(None);
    vas.delete(&name, &DeleteOptions::default()).await.unwrap();
    eventually(T, "the unpublish call in flight", || async {
        (proxy.held_bytes() > 0).then_some(())
    })
    .await;
    a.abort().await;
    drop(proxy);
    let v = vas.get(&name).await.unwrap();
    assert_eq!(
        finalizers(&v),
        vec![fin()],
        "still held: the detach never finished"
    );
    assert_eq!(published_nodes(&s.client, &handle).await, vec!["node-a"]);
    assert!(!is_immutable(&generation_path(&s.env, &handle, gen)).unwrap());

    // A new instance finishes the job, fence included.
    let mut b = spawn(s.cluster.cluster(), test_config(&s.socket()));
    assert!(b.wait_active(T).await);
    wait_gone(&s.cluster, &name, T).await;
    assert!(published_nodes(&s.client, &handle).await.is_empty());
    assert!(
        is_immutable(&generation_path(&s.env, &handle, gen)).unwrap(),
        "fenced by the new instance"
    );
    assert_eq!(b.metrics().fences(SUCCESS), 1);
    let pv = s
        .cluster
        .api::<PersistentVolume>(None)
        .get("pv-k")
        .await
        .unwrap();
    assert!(finalizers(&pv).is_empty());
    b.shutdown().await.unwrap();
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_leader_election_one_replica_acts_and_another_takes_over() {
    require_root!();
    let s = Setup::new().await;
    let le = LeaderElectionArgs {
        enabled: true,
        namespace: Some("kube-system".into()),
        lease_duration: Duration::from_secs(2),
        renew_deadline: Duration::from_millis(1500),
        retry_period: Duration::from_millis(200),
        ..Default::default()
    };
    let replica = |id: &str| {
        let mut cfg = test_config(&s.socket());
        cfg.identity = id.into();
        cfg.leader_election = le.clone();
        spawn(s.cluster.cluster(), cfg)
    };
    // a leads before b starts, so that b can only stand by.
    let mut a = replica("replica-a");
    assert!(a.wait_active(T).await, "replica a active");
    let b = replica("replica-b");
    let slots = Arc::new(std::sync::Mutex::new([Some(a), Some(b)]));

    // Watch both, every 2 ms, for the whole test.
    let both_active = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (slots, both, stop) = (slots.clone(), both_active.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                {
                    let g = slots.lock().unwrap();
                    let n = g.iter().flatten().filter(|h| h.is_active()).count();
                    if n > 1 {
                        both.store(true, Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let active = |i: usize| {
        slots.lock().unwrap()[i]
            .as_ref()
            .is_some_and(|h| h.is_active())
    };
    let phase = |i: usize| slots.lock().unwrap()[i].as_ref().map(|h| h.status().phase);
    // b found the plugin and waits for the Lease a holds (the sampler checks all along
    // that the two are never active at once).
    eventually(T, "replica b stands by", || async {
        (phase(1) == Some(Phase::Standby)).then_some(())
    })
    .await;
    assert!(active(0), "replica a still active");
    assert!(!active(1), "replica b must stand by");
    // A standby is alive and ready: readiness means running, not leading.
    let standby_addr = slots.lock().unwrap()[1]
        .as_ref()
        .unwrap()
        .status()
        .http_addr
        .unwrap();
    assert_eq!(
        http_get(standby_addr, "/healthz").await,
        (200, "ok\n".into())
    );
    assert_eq!(
        http_get(standby_addr, "/readyz").await,
        (200, "ok\n".into())
    );

    let (handle, name) = s.volume_and_va("pv-le", "node-a").await;
    wait_attached(&s.cluster, &name, T).await;
    let metrics_a = slots.lock().unwrap()[0].as_ref().unwrap().metrics().clone();
    let metrics_b = slots.lock().unwrap()[1].as_ref().unwrap().metrics().clone();
    assert_eq!(metrics_a.operations(ATTACH, SUCCESS), 1);
    assert_eq!(metrics_b.operations(ATTACH, SUCCESS), 0);

    assert_eq!(phase(1), Some(Phase::Standby), "replica b still stands by");

    // The Lease's history from here on, as the replicas write it.
    let lease_name = lease_name_for(DRIVER);
    let mut lease_watch = s
        .cluster
        .api::<Lease>(Some("kube-system"))
        .watch(&WatchParams::default())
        .unwrap();
    let mut history = Vec::new();
    let lease = SignedDuration::try_from(le.lease_duration).unwrap();

    // a stops gracefully: it releases the lease, b takes over at once, not once the lease
    // has expired: b's acquireTime comes less than a lease duration after the release a
    // recorded (no holder, its renewTime). Both stamps are the replicas' own.
    let a = slots.lock().unwrap()[0].take().unwrap();
    a.shutdown().await.unwrap();
    eventually(T, "replica b active", || async { active(1).then_some(()) }).await;
    lease_records_until(&mut lease_watch, &lease_name, &mut history, |l| {
        holder(l) == Some("replica-b")
    })
    .await;
    let released = history
        .iter()
        .rev()
        .find(|l| holder(l).is_none())
        .and_then(|l| l.renew_time.clone())
        .unwrap_or_else(|| panic!("a's release is not in the Lease's history: {history:?}"));
    let acquired = last_acquire_time(&history);
    let after_release = acquired.0.duration_since(released.0);
    assert!(
        after_release < lease,
        "b took the lease {after_release:?} after a released it: it waited for the expiry"
    );
    s.cluster
        .api::<VolumeAttachment>(None)
        .delete(&name, &DeleteOptions::default())
        .await
        .unwrap();
    wait_gone(&s.cluster, &name, T).await;
    assert_eq!(metrics_b.operations(DETACH, SUCCESS), 1);
    assert!(published_nodes(&s.client, &handle).await.is_empty());

    // b crashes (no release): a new replica c takes over only once the lease has expired.
    // c counts the lease duration on its own clock from when it saw b's last renewal,
    // which came after b stamped it; c stamps acquireTime as the round that finds the
    // lease expired begins, one read earlier. So its acquireTime comes a lease duration
    // after b's last renewTime, less that read: half the lease leaves it a second.
    slots.lock().unwrap()[0] = Some(replica("replica-c"));
    let b = slots.lock().unwrap()[1].take().unwrap();
    b.abort().await;
    eventually(T, "replica c active", || async { active(0).then_some(()) }).await;
    lease_records_until(&mut lease_watch, &lease_name, &mut history, |l| {
        holder(l) == Some("replica-c")
    })
    .await;
    let last_renewal = history
        .iter()
        .rev()
        .find(|l| holder(l) == Some("replica-b"))
        .and_then(|l| l.renew_time.clone())
        .unwrap_or_else(|| panic!("b's renewals are not in the Lease's history: {history:?}"));
    let acquired = last_acquire_time(&history);
    let waited = acquired.0.duration_since(last_renewal.0);
    assert!(
        waited >= SignedDuration::try_from(le.lease_duration / 2).unwrap(),
        "c took the lease {waited:?} after b's last renewal: before it expired ({lease:?})"
    );
    let (_, name2) = s.volume_and_va("pv-le2", "node-a").await;
    wait_attached(&s.cluster, &name2, T).await;

    stop.store(true, Ordering::SeqCst);
    sampler.await.unwrap();
    assert!(
        !both_active.load(Ordering::SeqCst),
        "two replicas were active at once"
    );
    let c = slots.lock().unwrap()[0].take().unwrap();
    s.cluster
        .api::<VolumeAttachment>(None)
        .delete(&name2, &DeleteOptions::default())
        .await
        .unwrap();
    wait_gone(&s.cluster, &name2, T).await;
    c.shutdown().await.unwrap();
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_attachments_of_other_drivers_are_never_touched() {
    require_root!();
    let s = Setup::new().await;
    let mut cfg = test_config(&s.socket());
    cfg.resync = Duration::from_millis(200);
    let mut a = spawn(s.cluster.cluster(), cfg);
    assert!(a.wait_active(T).await);
    let other = "other.example.com";
    let pvs = s.cluster.api::<PersistentVolume>(None);
    let vas = s.cluster.api::<VolumeAttachment>(None);
    pvs.create(&pv_of("pv-other", "handle-x", true, "ReadWriteOnce", other))
        .await
        .unwrap();
    let foreign = va_of("pv-other", "handle-x", "node-a", other);
    let foreign_name = foreign.metadata.name.clone().unwrap();
    vas.create(&foreign).await.unwrap();
    let (_, ours) = s.volume_and_va("pv-ours", "node-a").await;
    wait_attached(&s.cluster, &ours, T).await;
    // Every resync asks the plugin where volumes are published (ListVolumes: ours is
    // attached, so there is something to check). Two more of those, and at least one
    // whole resync, its PV finalizer sweep included, ran after the watch had delivered
    // both attachments (the foreign one first).
    let before = list_volumes_calls(s.plugin_http).await;
    eventually(T, "two more resyncs", || async {
        (list_volumes_calls(s.plugin_http).await >= before + 2).then_some(())
    })
    .await;

    let f = vas.get(&foreign_name).await.unwrap();
    assert!(finalizers(&f).is_empty(), "{:?}", f.metadata.finalizers);
    assert_eq!(f.status, None);
    assert!(f.metadata.annotations.is_none());
    assert!(finalizers(&pvs.get("pv-other").await.unwrap()).is_empty());
    assert!(event_reasons(&s.cluster, &foreign_name).await.is_empty());
    // Deleting it is not held up by us.
    vas.delete(&foreign_name, &DeleteOptions::default())
        .await
        .unwrap();
    assert!(vas.get_opt(&foreign_name).await.unwrap().is_none());
    assert_eq!(a.metrics().operations(ATTACH, SUCCESS), 1);

    vas.delete(&ours, &DeleteOptions::default()).await.unwrap();
    wait_gone(&s.cluster, &ours, T).await;
    a.shutdown().await.unwrap();
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_in_flight_calls_within_the_grace() {
    require_root!();
    let s = Setup::new().await;
    let proxy = GatedProxy::start(s.env.socket("proxy"), s.socket());
    let vas = s.cluster.api::<VolumeAttachment>(None);

    // 1: a detach in flight when the shutdown starts completes, then the instance stops.
    // Neither the call's timeout nor the grace may end the held call before the test lets
    // it through, however busy the machine.
    let mut cfg = test_config(&proxy.socket);
    cfg.timeout = Duration::from_secs(600);
    cfg.shutdown_grace = Duration::from_secs(600);
    let attacher = Attacher::new(s.cluster.cluster(), cfg);
    let mut status = attacher.status();
    let mut a = attacher.spawn();
    assert!(a.wait_active(T).await);
    let (handle, name) = s.volume_and_va("pv-g1", "node-a").await;
    wait_attached(&s.cluster, &name, T).await;
    proxy.set_open(false);
    vas.delete(&name, &DeleteOptions::default()).await.unwrap();
    eventually(T, "the unpublish call in flight", || async {
        (proxy.held_bytes() > 0).then_some(())
    })
    .await;
    let stopping = tokio::spawn(a.shutdown());
    // The shutdown has begun while the call is held: it can only finish after the call.
    tokio::time::timeout(T, status.wait_for(|s| s.phase == Phase::Stopping))
        .await
        .expect("the shutdown begins")
        .unwrap();
    assert!(
        !stopping.is_finished(),
        "shutdown must wait for the in-flight call"
    );
    proxy.set_open(true);
    tokio::time::timeout(T, stopping)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        vas.get_opt(&name).await.unwrap().is_none(),
        "the in-flight detach finished"
    );
    assert!(published_nodes(&s.client, &handle).await.is_empty());

    // 2: one that does not complete within the grace is abandoned (and left to the next
    // instance: the finalizer stays).
    let mut cfg = test_config(&proxy.socket);
    cfg.shutdown_grace = Duration::from_millis(300);
    // The held call has no timeout that could end it within the test: a shutdown that
    // returns while it is held has abandoned it, at the grace.
    cfg.timeout = Duration::from_secs(600);
    let mut b = spawn(s.cluster.cluster(), cfg);
    assert!(b.wait_active(T).await);
    let (handle2, name2) = s.volume_and_va("pv-g2", "node-a").await;
    wait_attached(&s.cluster, &name2, T).await;
    proxy.set_open(false);
    let held = proxy.held_bytes();
    vas.delete(&name2, &DeleteOptions::default()).await.unwrap();
    eventually(T, "the second unpublish in flight", || async {
        (proxy.held_bytes() > held).then_some(())
    })
    .await;
    tokio::time::timeout(T, b.shutdown())
        .await
        .expect("the shutdown is bounded by the grace, not by the held call")
        .unwrap();
    let v = vas.get(&name2).await.unwrap();
    assert_eq!(finalizers(&v), vec![fin()]);
    assert_eq!(
        v.status.and_then(|s| s.detach_error),
        None,
        "abandoned mid-call, not failed"
    );
    drop(proxy);
    let c = spawn(s.cluster.cluster(), test_config(&s.socket()));
    wait_gone(&s.cluster, &name2, T).await;
    assert!(published_nodes(&s.client, &handle2).await.is_empty());
    c.shutdown().await.unwrap();
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_id_from_the_node_annotation_and_a_fenced_detach_after_the_node_is_gone() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let (plugin, client) = InProcess::start(env.config(Mode::All, Some("node-a"), "all")).await;
    let cluster = EmbeddedCluster::new().cluster();
    // No CSINode: only the Node's csi.volume.kubernetes.io/nodeid annotation names the ID.
    let mut n = node("kube-node-7", true);
    n.metadata.annotations = Some(
        [(
            well_known::NODE_ID_ANNOTATION.to_string(),
            format!(r#"{{"{DRIVER}":"node-a","other.example.com":"x"}}"#),
        )]
        .into(),
    );
    let nodes = cluster.api::<Node>(None);
    nodes.create(&n).await.unwrap();
    let mut a = spawn(cluster.clone(), test_config(&env.socket("all")));
    assert!(a.wait_active(T).await);
    let handle = create_volume(&client, "pv-ann", true).await;
    cluster
        .api::<PersistentVolume>(None)
        .create(&pv("pv-ann", &handle, true, "ReadWriteOnce"))
        .await
        .unwrap();
    let v = va("pv-ann", &handle, "kube-node-7");
    let name = v.metadata.name.clone().unwrap();
    let vas = cluster.api::<VolumeAttachment>(None);
    vas.create(&v).await.unwrap();
    let attached = wait_attached(&cluster, &name, T).await;
    assert_eq!(
        attached.metadata.annotations.unwrap()[VA_NODE_ID_ANNOTATION],
        "node-a"
    );
    assert_eq!(published_nodes(&client, &handle).await, vec!["node-a"]);

    // The Node object goes away (the node was deleted): the detach still knows the node
    // ID from the VolumeAttachment, and fences.
    nodes
        .delete("kube-node-7", &DeleteOptions::default())
        .await
        .unwrap();
    vas.delete(&name, &DeleteOptions::default()).await.unwrap();
    wait_gone(&cluster, &name, T).await;
    assert!(published_nodes(&client, &handle).await.is_empty());
    assert!(
        is_immutable(&generation_path(&env, &handle, 1)).unwrap(),
        "node gone: fenced"
    );
    wait_event(&cluster, &name, REASON_FENCED).await;
    wait_event(&cluster, &name, REASON_DETACHED).await;
    a.shutdown().await.unwrap();
    plugin.stop().await;
    env.assert_clean();
}

#[test]
fn the_binary_explains_its_flags() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fencecsi-attacher"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--csi-address",
        "--kubeconfig",
        "--workers",
        "--timeout",
        "--resync-interval",
        "--fence",
        "--leader-election",
        "--leader-election-namespace",
        "--leader-election-lease-name",
        "--http-endpoint",
        "--identity",
        "--log-format",
        "[default: unix:///csi/csi.sock]",
        "- always:",
        "- never:",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}:\n{help}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_turns_unhealthy_while_the_election_is_forbidden() {
    require_root!();
    let s = Setup::new().await;
    // The API server forbids Leases in "locked" (say, RBAC for another namespace).
    s.cluster
        .deny::<fencecsi_cluster::k8s_openapi::api::coordination::v1::Lease>("locked");
    let replica = |id: &str, ns: &str| {
        let mut cfg = test_config(&s.socket());
        cfg.identity = id.into();
        cfg.leader_election = LeaderElectionArgs {
            enabled: true,
            namespace: Some(ns.into()),
            lease_duration: Duration::from_secs(2),
            renew_deadline: Duration::from_millis(1500),
            retry_period: Duration::from_millis(200),
            // Fifteen rounds: the open replica, whose rounds a busy machine may hold up
            // a while, stays healthy; the locked one turns unhealthy all the same.
            unhealthy_after: Duration::from_secs(3),
            ..Default::default()
        };
        spawn(s.cluster.cluster(), cfg)
    };
    let mut open = replica("open", "kube-system");
    let locked = replica("locked", "locked");
    // Control: the same set-up with a Lease it may touch leads and stays healthy.
    assert!(
        open.wait_active(T).await,
        "the replica with a usable Lease leads"
    );
    let locked_addr = eventually(T, "the locked replica serves HTTP", || async {
        locked.status().http_addr
    })
    .await;
    let (code, body) = eventually(T, "/healthz of the locked replica turns 503", || async {
        let r = http_get(locked_addr, "/healthz").await;
        (r.0 == 503).then_some(r)
    })
    .await;
    assert_eq!(code, 503);
    assert!(body.contains("leader election"), "{body}");
    assert_eq!(
        http_get(locked_addr, "/readyz").await.0,
        503,
        "not ready either"
    );
    assert!(
        !locked.is_active(),
        "a replica without its Lease never acts"
    );
    let open_addr = open.status().http_addr.unwrap();
    assert_eq!(http_get(open_addr, "/healthz").await, (200, "ok\n".into()));
    assert_eq!(http_get(open_addr, "/readyz").await, (200, "ok\n".into()));
    locked.shutdown().await.unwrap();
    open.shutdown().await.unwrap();
    s.finish().await;
}
