//! Node return with real loop devices: the node plugin's recovery releases volumes fenced
//! away from it and reports the node clean (through podgc's NodeCleanReporter on an
//! embedded cluster).
//!
//! The controller and node-b come from the harness' `Rig`; node-a is served in this
//! process (the harness' `RecoveringNode`), so its recovery loop runs inside the very
//! plugin the "kubelet" calls (same in-flight locks), with a reporter, and can be stopped
//! and started again as a node that goes away and comes back.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fencecsi_cluster::k8s_openapi::api::core::v1::Node;
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::well_known::{NODE_CLEAN_ANNOTATION, QUARANTINED_AT_ANNOTATION};
use fencecsi_cluster::{Cluster, MetadataPatch};
use fencecsi_driver::config::Mode;
use fencecsi_driver::node::recover::{PassReport, RecoveryHandle};
use fencecsi_driver::node::report::NodeCleanReporter;
use fencecsi_embedded_cluster::sim::ready_node;
use fencecsi_embedded_cluster::EmbeddedCluster;
use fencecsi_tests::recovering::{RecordingReporter, RecoveringNode};
use fencecsi_tests::rig::{Placement, Rig};
use fencecsi_tests::{csi, generation_path, mount_cap, require_root, Access, Env};
use tonic::Code;

struct Setup {
    env: Env,
    rig: Rig,
    cluster: EmbeddedCluster,
    tee: Arc<RecordingReporter>,
}

async fn setup() -> Setup {
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let rig = Rig::start(&env, &["node-b"]).await;
    let cluster = EmbeddedCluster::new();
    cluster
        .api::<Node>(None)
        .create(&ready_node("node-a"))
        .await
        .unwrap();
    let tee = Arc::new(RecordingReporter::passing_to(NodeCleanReporter::new(
        &cluster, "node-a",
    )));
    Setup {
        env,
        rig,
        cluster,
        tee,
    }
}

impl Setup {
    /// node-a's plugin (its `generation`-th start), reachable through the rig.
    async fn start_node_a(
        &mut self,
        generation: u32,
        reporter: Arc<RecordingReporter>,
        interval: Duration,
    ) -> RecoveringNode {
        let mut cfg = self
            .env
            .config(Mode::Node, Some("node-a"), &format!("node-a-{generation}"));
        cfg.recover_interval = interval;
        let a = RecoveringNode::start_reporting_to(cfg, reporter).await;
        self.rig.nodes.insert("node-a".into(), a.client.clone());
        a
    }

    /// A new volume `name`, attached on node-a for `pod`, with `text` fsynced in it.
    async fn volume_on_a(&self, name: &str, pod: &str, text: &str) -> (String, Placement) {
        let vol = self.rig.create(name, 64 << 20, &cap()).await.volume_id;
        let p = self
            .rig
            .attach(&self.env, &vol, "node-a", pod, &cap())
            .await
            .unwrap();
        write_record(&p, text);
        (vol, p)
    }

    /// Stops node-a's plugin, deletes `volumes`, stops the rig, and checks nothing is left.
    async fn finish(self, a: RecoveringNode, volumes: &[&str]) {
        a.stop().await;
        for vol in volumes {
            self.rig.delete_once_free(vol).await;
        }
        self.rig.stop().await;
        self.env.assert_clean();
    }
}

fn cap() -> csi::VolumeCapability {
    mount_cap(Access::SingleNodeWriter, "ext4")
}

/// podgc's side of the shutdown: quarantined-at on the Node.
async fn quarantine(cluster: &Cluster) -> Timestamp {
    let t = Timestamp::now();
    cluster
        .api::<Node>(None)
        .patch_metadata(
            "node-a",
            &MetadataPatch::new().set_annotation(QUARANTINED_AT_ANNOTATION, &t.to_string()),
        )
        .await
        .unwrap();
    t
}

async fn clean_annotation(cluster: &Cluster) -> Option<Timestamp> {
    let n = cluster.api::<Node>(None).get("node-a").await.unwrap();
    n.metadata
        .annotations
        .and_then(|a| a.get(NODE_CLEAN_ANNOTATION).cloned())
        .map(|s| s.parse().unwrap())
}

/// Writes and fsyncs a file through the published target.
fn write_record(p: &Placement, text: &str) {
    use std::io::Write;
    let mut f = std::fs::File::create(p.target.join("record")).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.sync_all().unwrap();
}

/// Loop devices attached to a generation's image.
fn loops_on(env: &Env, vol: &str, gen: u64) -> Vec<PathBuf> {
    let img = generation_path(env, vol, gen);
    let mut out = vec![];
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            if std::path::Path::new(b.trim().trim_end_matches(" (deleted)")) == img {
                out.push(e.path());
            }
        }
    }
    out
}

fn assert_released(env: &Env, p: &Placement, gen: u64) {
    assert_eq!(env.mounts(), Vec::<PathBuf>::new(), "mounts left");
    assert_eq!(
        loops_on(env, &p.volume_id, gen),
        Vec::<PathBuf>::new(),
        "loop devices left on the fenced generation"
    );
    assert!(!p.target.exists(), "target {} left", p.target.display());
    assert!(
        !p.staging.exists(),
        "globalmount {} left",
        p.staging.display()
    );
}

/// A ControllerPublish to node-a is accepted again, the data fsynced before the fence is
/// there, then everything is torn down cleanly.
async fn reattach_and_check(s: &Setup, vol: &str, text: &str) {
    let p2 = s
        .rig
        .attach(&s.env, vol, "node-a", "pod-2", &cap())
        .await
        .expect("ControllerPublish to node-a after node return");
    assert!(p2.generation() > 1, "a new generation after the fence");
    assert_eq!(
        std::fs::read_to_string(p2.target.join("record")).unwrap(),
        text
    );
    s.rig.node_teardown(&p2, false).await.unwrap();
    s.rig.unpublish(vol, "node-a", false).await.unwrap();
}

/// Calls `call` until it answers other than ABORTED, as a CO retries; panics on any
/// other error, or when it is still ABORTED after [`ABORTED_AT_MOST`]. Returns how many
/// times it was ABORTED.
async fn until_not_aborted<F, Fut>(what: &str, call: F) -> u32
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), tonic::Status>>,
{
    let deadline = tokio::time::Instant::now() + ABORTED_AT_MOST;
    let mut aborted = 0;
    loop {
        match call().await {
            Ok(()) => return aborted,
            Err(e) if e.code() == Code::Aborted => {
                aborted += 1;
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{what}: still ABORTED after {ABORTED_AT_MOST:?} ({aborted} answers): {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(e) => panic!("{what}: {e:?}"),
        }
    }
}

/// How long a call may keep answering ABORTED (the recovery pass holding the volume):
/// for liveness only, far above what a loaded machine takes.
const ABORTED_AT_MOST: Duration = Duration::from_secs(60);

async fn wait_report(rec: &RecoveryHandle, want: impl Fn(&PassReport) -> bool) -> PassReport {
    let mut rx = rec.subscribe();
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Some(r) = rx.borrow_and_update().as_ref() {
                if want(r) {
                    return r.clone();
                }
            }
            rx.changed().await.unwrap();
        }
    })
    .await
    .expect("recovery report in time")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_releases_a_fenced_volume_and_reports_the_node_clean() {
    require_root!();
    let mut s = setup().await;
    // Passes only when asked (and one at start): a periodic pass could release
    // the fenced device during the fence (it takes its settle, 250 ms), and the
    // refusal below needs node-a still holding it.
    let a = s
        .start_node_a(1, s.tee.clone(), Duration::from_secs(3600))
        .await;
    let (vol, p) = s.volume_on_a("pv-db", "pod-1", "before the fence").await;
    // Unfenced volumes are never touched by the periodic passes.
    let r = a.recovery.run_now().await;
    assert!(r.released.is_empty() && r.clean, "{r:?}");
    assert!(p.target.join("record").exists());

    // node-a is gone: podgc quarantines, the attacher fences.
    let qa = quarantine(&s.cluster).await;
    s.rig.unpublish(&vol, "node-a", true).await.unwrap();
    // The controller refuses node-a while it still holds the fenced generation.
    let refused = s
        .rig
        .attach(&s.env, &vol, "node-a", "pod-x", &cap())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");

    // Node return: a recovery pass releases it.
    let r = a.recovery.run_now().await;
    assert!(r.clean, "{r:?}");
    assert_eq!(r.released.len(), 1);
    assert_eq!(r.released[0].volume_id, vol);
    assert_eq!(r.released[0].generation, p.generation());
    assert!(
        r.released[0].unmounted.contains(&p.target) && r.released[0].unmounted.contains(&p.staging),
        "{r:?}"
    );
    assert!(matches!(r.reported, Some(Ok(true))), "{r:?}");
    assert_released(&s.env, &p, p.generation());
    let clean = clean_annotation(&s.cluster)
        .await
        .expect("node-clean written");
    assert!(clean > qa, "{clean} > {qa}");
    assert!(s.tee.calls.lock().unwrap().len() >= 2);
    // Later passes have nothing to do and do not rewrite the report.
    let r = a.recovery.run_now().await;
    assert!(
        r.released.is_empty() && r.clean && r.pending.is_empty(),
        "{r:?}"
    );
    assert_eq!(clean_annotation(&s.cluster).await, Some(clean));

    reattach_and_check(&s, &vol, "before the fence").await;
    s.finish(a, &[&vol]).await;
}

/// Issue 18: in a network cut the node plugin's Node watch died without a sign, so the
/// quarantine written meanwhile never reached its reporter, and the node was not reported
/// clean for minutes. Now the periodic passes of the node that comes back report it
/// within the reporter's cache age (short here) whatever the watch does. The same run with
/// a live watch is `recovery_releases_a_fenced_volume_and_reports_the_node_clean`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_watch_died_in_the_cut_is_reported_clean_within_the_cache_age() {
    require_root!();
    let mut s = setup().await;
    let age = Duration::from_secs(1);
    let tee = Arc::new(RecordingReporter::passing_to(
        NodeCleanReporter::new(&s.cluster, "node-a").with_max_cache_age(age),
    ));
    let a = s.start_node_a(1, tee, Duration::from_millis(300)).await;
    let (vol, p) = s.volume_on_a("pv-db", "pod-1", "before the cut").await;
    let r = a.recovery.run_now().await;
    assert!(r.clean && matches!(r.reported, Some(Ok(true))), "{r:?}");
    assert_eq!(clean_annotation(&s.cluster).await, None);

    // The cut: the watch goes silent for good; podgc quarantines, the attacher fences,
    // and podgc re-stamps quarantined-at once the attachment is gone.
    s.cluster.cut_watches::<Node>();
    quarantine(&s.cluster).await;
    s.rig.unpublish(&vol, "node-a", true).await.unwrap();
    let qa = quarantine(&s.cluster).await;

    // Back: the passes release the volume and report it, newer than the re-stamp.
    let r = wait_report(&a.recovery, |r| !r.released.is_empty()).await;
    assert!(r.clean, "{r:?}");
    assert_released(&s.env, &p, p.generation());
    // Expected within the cache age and a pass or two (about 1.5 s here). The bound is
    // for liveness, yet well below the reporter's default cache age (15 s, counted from
    // before the cut), so a reporter that went by that instead of `age` would miss it.
    let bound = age + Duration::from_secs(9);
    let clean = tokio::time::timeout(bound, async {
        loop {
            if let Some(c) = clean_annotation(&s.cluster).await.filter(|c| *c > qa) {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("node-clean newer than {qa} not written within {bound:?}"));
    assert!(clean > qa);

    reattach_and_check(&s, &vol, "before the cut").await;
    s.finish(a, &[&vol]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_plugin_that_comes_back_releases_at_start() {
    require_root!();
    let mut s = setup().await;
    let a = s.start_node_a(1, s.tee.clone(), Duration::ZERO).await;
    let (vol, p) = s.volume_on_a("pv-db", "pod-1", "kept").await;
    // The plugin goes away with the node; meanwhile the volume is fenced away.
    a.stop().await;
    quarantine(&s.cluster).await;
    s.rig.unpublish(&vol, "node-a", true).await.unwrap();
    // Back: the pass at start releases it.
    let a = s.start_node_a(2, s.tee.clone(), Duration::ZERO).await;
    let r = wait_report(&a.recovery, |r| r.seq == 1).await;
    assert_eq!(r.released.len(), 1, "{r:?}");
    assert!(r.clean && matches!(r.reported, Some(Ok(true))), "{r:?}");
    assert_released(&s.env, &p, p.generation());
    assert!(clean_annotation(&s.cluster).await.is_some());
    reattach_and_check(&s, &vol, "kept").await;
    s.finish(a, &[&vol]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_force_teardown_first_then_recovery_finds_nothing() {
    require_root!();
    let mut s = setup().await;
    let a = s.start_node_a(1, s.tee.clone(), Duration::ZERO).await;
    let (vol, p) = s.volume_on_a("pv-db", "pod-1", "kubelet first").await;
    let qa = quarantine(&s.cluster).await;
    s.rig.unpublish(&vol, "node-a", true).await.unwrap();
    // The returning kubelet cleans up first: NodeUnpublish + NodeUnstage with force.
    s.rig
        .node_teardown(&p, true)
        .await
        .expect("force teardown of a fenced volume");
    let r = a.recovery.run_now().await;
    assert!(r.released.is_empty(), "nothing left for recovery: {r:?}");
    assert!(r.clean && matches!(r.reported, Some(Ok(true))), "{r:?}");
    assert!(clean_annotation(&s.cluster).await.is_some_and(|c| c > qa));
    assert_released(&s.env, &p, p.generation());
    // And the other way round is fine too: the kubelet's calls after recovery are OK.
    s.rig
        .node_teardown(&p, true)
        .await
        .expect("idempotent after cleanup");
    reattach_and_check(&s, &vol, "kubelet first").await;
    s.finish(a, &[&vol]).await;
}

/// Recovery and kubelet calls at the same time: whichever holds the volume's in-flight
/// lock first works, the other gets ABORTED (the kubelet retries as a CO does) or skips the
/// volume until its next pass; both end OK and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_racing_kubelet_calls_both_end_ok() {
    require_root!();
    let mut s = setup().await;
    let a = s.start_node_a(1, s.tee.clone(), Duration::ZERO).await;
    let mut placements = vec![];
    for i in 0..3 {
        let (_, p) = s
            .volume_on_a(
                &format!("pv-{i}"),
                &format!("pod-{i}"),
                &format!("record {i}"),
            )
            .await;
        placements.push(p);
    }
    quarantine(&s.cluster).await;
    for p in &placements {
        s.rig.unpublish(&p.volume_id, "node-a", true).await.unwrap();
    }
    let mut aborted = 0;
    let kubelet = {
        let client = a.client.clone();
        let ps = placements.clone();
        tokio::spawn(async move {
            let mut aborted = 0;
            for p in &ps {
                aborted += until_not_aborted("NodeUnpublish", || {
                    let mut c = client.clone();
                    let req = csi::NodeUnpublishVolumeRequest {
                        volume_id: p.volume_id.clone(),
                        target_path: p.target.to_string_lossy().into(),
                        force: true,
                    };
                    async move { c.node.node_unpublish_volume(req).await.map(|_| ()) }
                })
                .await;
                aborted += until_not_aborted("NodeUnstage", || {
                    let mut c = client.clone();
                    let req = csi::NodeUnstageVolumeRequest {
                        volume_id: p.volume_id.clone(),
                        staging_target_path: p.staging.to_string_lossy().into(),
                        force: true,
                    };
                    async move { c.node.node_unstage_volume(req).await.map(|_| ()) }
                })
                .await;
            }
            aborted
        })
    };
    // Recovery passes until clean (a pass skips volumes the kubelet holds).
    let mut released = 0;
    let mut passes = 0;
    let started = std::time::Instant::now();
    loop {
        let r = a.recovery.run_now().await;
        passes += 1;
        released += r.released.len();
        for why in r.pending.values() {
            assert!(
                why.contains("in progress"),
                "only in-flight conflicts may be pending: {r:?}"
            );
        }
        if r.clean {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "recovery never got clean: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    aborted += kubelet.await.unwrap();
    eprintln!("race: recovery released {released}, kubelet calls ABORTED {aborted} times, {passes} passes in {:.1?}", started.elapsed());
    let r = a.recovery.run_now().await;
    assert!(r.clean && r.released.is_empty(), "{r:?}");
    for p in &placements {
        assert_released(&s.env, p, p.generation());
    }
    for (i, p) in placements.iter().enumerate() {
        reattach_and_check(&s, &p.volume_id, &format!("record {i}")).await;
    }
    let volumes: Vec<&str> = placements.iter().map(|p| p.volume_id.as_str()).collect();
    s.finish(a, &volumes).await;
}
