//! The drill's scenario: set up, shut node A down, watch the failover, bring A back.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use fencecsi_cluster::k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Node, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeSpec, Pod, VolumeResourceRequirements,
};
use fencecsi_cluster::k8s_openapi::api::events::v1::Event;
use fencecsi_cluster::k8s_openapi::api::storage::v1::{
    CSIDriver, CSIDriverSpec, CSINode, CSINodeDriver, CSINodeSpec, VolumeAttachment,
};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use fencecsi_cluster::sim::{self, ready_condition};
use fencecsi_cluster::well_known::*;
use fencecsi_cluster::{Cluster, DeleteOptions, ListParams, WatchEvent, WatchParams};
use fencecsi_driver::config::Mode;
use fencecsi_driver::node::recover::{CleanReporter, RecoveryHandle};
use fencecsi_driver::node::report::NodeCleanReporter;
use fencecsi_driver::server::{serve_with, ServeHooks};
use fencecsi_podgc::{PodGc, PodGcConfig};
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::{records, wait_for_socket, Env, InProcess};
use futures::StreamExt;

use crate::kubelet::{Board, Kubelet};
use crate::procs::Procs;
use crate::report::{Comparison, Report, Step, TimelineEntry, UnsafePodResult, VolumeResult};
use crate::standins::{self, StorageClass, Task};
use crate::{node_names, Options, Progress, NAMESPACE, STORAGE_CLASS, UNSAFE_DRIVER};

/// A node plugin served in this process with recovery and a clean reporter. Stopped on drop.
struct NodePlugin {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    recovery: RecoveryHandle,
    client: CsiClient,
}

impl NodePlugin {
    async fn start(env: &Env, cluster: &Cluster, node: &str) -> anyhow::Result<Self> {
        let mut cfg = env.config(Mode::Node, Some(node), &format!("node-{node}"));
        cfg.recover_interval = Duration::from_secs(1);
        let socket = cfg.socket_path().map_err(|e| anyhow!(e))?;
        let reporter: Arc<dyn CleanReporter> = Arc::new(NodeCleanReporter::new(cluster, node));
        let (rec_tx, rec_rx) = tokio::sync::oneshot::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            if let Err(e) = serve_with(
                cfg,
                async {
                    let _ = stop_rx.await;
                },
                ServeHooks {
                    clean_reporter: Some(reporter),
                    recovery: Some(rec_tx),
                },
            )
            .await
            {
                tracing::error!(error = %e, "node plugin failed");
            }
        });
        let client = wait_for_socket(&socket).await;
        Ok(NodePlugin {
            stop: Some(stop),
            task: Some(task),
            recovery: rec_rx.await.context("recovery handle")?,
            client,
        })
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for NodePlugin {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// What the observer knows about one volume.
#[derive(Clone, Default)]
struct VolObs {
    pod: String,
    pv: String,
    handle: String,
    old_uid: String,
    old_generation: u64,
    va_a: String,
    t: BTreeMap<Step, f64>,
    new_uid: Option<String>,
    new_node: Option<String>,
    fenced_copy: Option<PathBuf>,
    fenced_path: Option<PathBuf>,
    fenced_immutable: bool,
    deleted_with_condition: bool,
}

#[derive(Default)]
struct Obs {
    steps: BTreeMap<Step, f64>,
    vols: Vec<VolObs>,
    problems: Vec<String>,
}

type Shared = Arc<Mutex<Obs>>;

fn mark(o: &mut Obs, step: Step, t: f64, p: &Progress, detail: &str) {
    if !o.steps.contains_key(&step) {
        o.steps.insert(step, t);
        p.say(format!("STEP {:?}: {}{detail}", step, step.describe()));
    }
}

fn has_taint(n: &Node, key: &str) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key))
}

/// Polls the cluster and records when each step was first seen.
#[allow(clippy::too_many_arguments)]
fn observer(
    cluster: Cluster,
    node_a: String,
    state_dir: PathBuf,
    evidence: PathBuf,
    board: Board,
    shared: Shared,
    progress: Progress,
) -> Task {
    let c = cluster.clone();
    let sh = shared.clone();
    let prog = progress.clone();
    // Pod deletions, with the object as deleted (condition, grace period).
    let deletions: Arc<Mutex<HashMap<String, (f64, bool)>>> = Arc::default();
    let del = deletions.clone();
    let watch = tokio::spawn(async move {
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
                        cs.iter().any(|c| {
                            c.type_ == DISRUPTION_TARGET_CONDITION
                                && c.reason.as_deref() == Some(DELETION_BY_PODGC_REASON)
                        })
                    })
                    && p.metadata.deletion_grace_period_seconds == Some(0);
                del.lock().unwrap().insert(
                    p.metadata.uid.clone().unwrap_or_default(),
                    (prog.elapsed().as_secs_f64(), cond),
                );
            }
        }
    });
    let _ = sh;
    // Node A's transitions, timed as the watch delivers them.
    let node_times: Arc<Mutex<BTreeMap<Step, f64>>> = Arc::default();
    let (nt, c2, prog2, na) = (
        node_times.clone(),
        cluster.clone(),
        progress.clone(),
        node_a.clone(),
    );
    let node_watch = tokio::spawn(async move {
        let params = WatchParams::default().fields(&format!("metadata.name={na}"));
        let Ok(mut w) = c2.api::<Node>(None).watch(&params) else {
            return;
        };
        while let Some(ev) = w.next().await {
            let nodes = match ev {
                WatchEvent::Listed(v) => v,
                WatchEvent::Added(n) | WatchEvent::Modified(n) => vec![n],
                WatchEvent::Deleted(_) => vec![],
            };
            let t = prog2.elapsed().as_secs_f64();
            let mut m = nt.lock().unwrap();
            for n in nodes {
                if ready_condition(&n).is_some_and(|c| c.status != "True") {
                    m.entry(Step::NotReady).or_insert(t);
                }
                let q = has_taint(&n, QUARANTINE_TAINT_KEY);
                if q {
                    m.entry(Step::Quarantined).or_insert(t);
                }
                if m.contains_key(&Step::Quarantined) {
                    // A report counts once it is newer than quarantined-at, which podgc
                    // re-stamps when the fences are done (an earlier report is stale).
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
            }
        }
    });
    Task(tokio::spawn(async move {
        let _watch = Task(watch);
        let _node_watch = Task(node_watch);
        loop {
            if let Err(e) = observe_once(
                &cluster,
                &node_a,
                &state_dir,
                &evidence,
                &board,
                &shared,
                &progress,
                &deletions,
                &node_times,
            )
            .await
            {
                tracing::debug!(error = %format!("{e:#}"), "observer");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }))
}

#[allow(clippy::too_many_arguments)]
async fn observe_once(
    cluster: &Cluster,
    node_a: &str,
    state_dir: &std::path::Path,
    evidence: &std::path::Path,
    board: &Board,
    shared: &Shared,
    progress: &Progress,
    deletions: &Arc<Mutex<HashMap<String, (f64, bool)>>>,
    node_times: &Arc<Mutex<BTreeMap<Step, f64>>>,
) -> anyhow::Result<()> {
    let t = progress.elapsed().as_secs_f64();
    let (armed, mut vols) = {
        let o = shared.lock().unwrap();
        (o.steps.contains_key(&Step::NodeDown), o.vols.clone())
    };
    if !armed {
        return Ok(());
    }
    let node = cluster.api::<Node>(None).get(node_a).await?;
    let fenced_events = cluster
        .api::<Event>(None)
        .list_filtered(&ListParams::default(), |e| {
            e.reason.as_deref() == Some(fencecsi_attacher::REASON_FENCED)
        })
        .await?;
    let pods = cluster.api::<Pod>(Some(NAMESPACE));
    let vas = cluster.api::<VolumeAttachment>(None);
    for v in vols.iter_mut() {
        if !v.t.contains_key(&Step::ForceDeleted) {
            if let Some((dt, cond)) = deletions.lock().unwrap().get(&v.old_uid).copied() {
                v.t.insert(Step::ForceDeleted, dt);
                v.deleted_with_condition = cond;
            }
        }
        if !v.t.contains_key(&Step::AttachmentDeleted) && vas.get_opt(&v.va_a).await?.is_none() {
            v.t.insert(Step::AttachmentDeleted, t);
        }
        if !v.t.contains_key(&Step::Fenced)
            && fenced_events.iter().any(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(v.va_a.as_str())
            })
        {
            v.t.insert(Step::Fenced, t);
            // Evidence: the fenced generation as it is right now.
            let src = state_dir
                .join("volumes")
                .join(&v.handle)
                .join(format!("gen-{:06}.img", v.old_generation));
            let dst = evidence.join(format!("{}-gen-{}.img", v.handle, v.old_generation));
            let (s2, d2) = (src.clone(), dst.clone());
            let r = tokio::task::spawn_blocking(move || {
                std::fs::create_dir_all(d2.parent().unwrap())?;
                let imm = fencecsi_driver::fsops::is_immutable(&s2)?;
                // The data region only: the fence trailer behind it may take
                // a racing request by design, and is never volume data.
                let data = std::fs::metadata(&s2)?
                    .len()
                    .saturating_sub(fencecsi_driver::fence::TRAILER_BYTES);
                fencecsi_driver::fsops::clone_file(&s2, &d2, data, data)?;
                Ok::<_, std::io::Error>(imm)
            })
            .await?;
            match r {
                Ok(imm) => {
                    v.fenced_immutable = imm;
                    v.fenced_copy = Some(dst);
                    v.fenced_path = Some(src.clone());
                    progress.say(format!(
                        "observer: {} fenced: generation {} ({}) immutable={imm}, copied for comparison",
                        v.pod,
                        v.old_generation,
                        src.display()
                    ));
                }
                Err(e) => shared.lock().unwrap().problems.push(format!(
                    "copying the fenced generation {}: {e}",
                    src.display()
                )),
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
        if let (Some(u), false) = (&v.new_uid, v.t.contains_key(&Step::PublishedOnB)) {
            if let Some(p) = board.by_uid(u) {
                v.t.insert(Step::PublishedOnB, p.published_at.as_secs_f64());
            }
        }
    }
    let nt = node_times.lock().unwrap().clone();
    let mut o = shared.lock().unwrap();
    o.vols = vols.clone();
    let clean = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NODE_CLEAN_ANNOTATION))
        .cloned()
        .unwrap_or_default();
    for (step, when) in nt {
        let detail = if step == Step::NodeCleaned {
            format!(" ({NODE_CLEAN_ANNOTATION}={clean})")
        } else {
            String::new()
        };
        if step != Step::QuarantineLifted || o.steps.contains_key(&Step::NodeCleaned) {
            mark(&mut o, step, when, progress, &detail);
        }
    }
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
                        .map(|v| format!("{} on {}", v.pod, v.new_node.clone().unwrap_or_default()))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                _ => String::new(),
            };
            if !o.steps.contains_key(&step) {
                o.steps.insert(step, when);
                progress.say(format!("STEP {step:?}: {}{detail}", step.describe()));
            }
        }
    }
    Ok(())
}

async fn wait_step(shared: &Shared, step: Step, timeout: Duration) -> anyhow::Result<f64> {
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

async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    while !f().await? {
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(Into::into),
        ..Default::default()
    }
}

/// Byte-by-byte comparison: bytes that differ (plus any length difference).
fn differing_bytes(a: &std::path::Path, b: &std::path::Path) -> std::io::Result<u64> {
    use std::io::Read;
    let mut fa = std::fs::File::open(a)?;
    let mut fb = std::fs::File::open(b)?;
    // `b` is a copy of `a`'s data region; `a` may be longer by its trailer.
    let (la, lb) = (fa.metadata()?.len(), fb.metadata()?.len());
    let mut diff = 0;
    let mut ba = vec![0u8; 1 << 20];
    let mut bb = vec![0u8; 1 << 20];
    let mut left = la.min(lb);
    while left > 0 {
        let n = left.min(ba.len() as u64) as usize;
        fa.read_exact(&mut ba[..n])?;
        fb.read_exact(&mut bb[..n])?;
        if ba[..n] != bb[..n] {
            diff += ba[..n].iter().zip(&bb[..n]).filter(|(x, y)| x != y).count() as u64;
        }
        left -= n as u64;
    }
    Ok(diff)
}

/// Runs the drill until it ends or `cancel` resolves; in both cases tears everything
/// down (writers killed first, then every mount and loop device below the temp dir).
pub async fn run(opts: Options, cancel: impl Future<Output = ()>) -> anyhow::Result<Report> {
    if opts.nodes < 2 {
        bail!("--nodes must be at least 2");
    }
    if opts.volumes == 0 {
        bail!("--volumes must be at least 1");
    }
    if opts.fs != "ext4" && opts.fs != "xfs" {
        bail!("--fs must be ext4 or xfs");
    }
    if !fencecsi_tests::can_run_kernel_tests() {
        bail!("the drill needs root and /dev/loop-control (loop devices, mounts)");
    }
    let started = Instant::now();
    opts.progress.reset();
    let env = Env::new();
    let procs = Procs::default();
    let board = Board::default();
    let shared: Shared = Arc::default();
    opts.progress.say(format!(
        "fencecsi drill: {} nodes, {} volume(s), {}; everything under {}",
        opts.nodes,
        opts.volumes,
        opts.fs,
        env.path().display()
    ));
    let result = tokio::select! {
        r = scenario(&env, &opts, &procs, &board, &shared) => r,
        _ = cancel => Err(anyhow!("interrupted")),
    };
    // Everything the scenario started is dropped by now (tasks aborted, servers told to
    // stop). Kill writers first so nothing keeps a file busy, let in-flight calls settle,
    // then the Env guard's teardown.
    let killed = procs.kill_all_and_wait();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (m, l) = env.teardown();
    if killed + m + l > 0 {
        opts.progress.say(format!(
            "cleanup: killed {killed} writer(s); the Env guard removed {m} mount(s) and {l} loop device(s)"
        ));
    }
    let leftover_mounts = env.mounts().len();
    let leftover_loops = env.loops().len();
    let env_dir = env.path().display().to_string();
    drop(env);
    let mut report = result?;
    report.leftover_mounts = leftover_mounts;
    report.leftover_loop_devices = leftover_loops;
    report.writers_left = procs.len();
    report.env_dir = env_dir;
    report.duration_s = started.elapsed().as_secs_f64();
    if leftover_mounts + leftover_loops > 0 {
        report.failures.push(format!(
            "{leftover_mounts} mount(s) / {leftover_loops} loop device(s) left"
        ));
    }
    report.ok = report.failures.is_empty();
    Ok(report)
}

async fn scenario(
    env: &Env,
    opts: &Options,
    procs: &Procs,
    board: &Board,
    shared: &Shared,
) -> anyhow::Result<Report> {
    let p = &opts.progress;
    let names = node_names(opts.nodes);
    let node_a = names[0].clone();
    let cluster = Cluster::embedded();
    let mut failures: Vec<String> = vec![];

    // --- cluster objects and simulations -------------------------------------------------
    let mut drv = CSIDriver {
        metadata: meta(DRIVER_NAME, None),
        spec: CSIDriverSpec {
            attach_required: Some(true),
            ..Default::default()
        },
    };
    drv.metadata.annotations = Some([(SAFE_DETACH_ANNOTATION.into(), "true".into())].into());
    cluster.api::<CSIDriver>(None).create(&drv).await?;
    if opts.unsafe_pod {
        cluster
            .api::<CSIDriver>(None)
            .create(&CSIDriver {
                metadata: meta(UNSAFE_DRIVER, None),
                spec: CSIDriverSpec::default(),
            })
            .await?;
    }
    let sc = StorageClass {
        name: STORAGE_CLASS.into(),
        provisioner: DRIVER_NAME.into(),
        parameters: [("fsType".to_string(), opts.fs.clone())].into(),
    };
    p.say(format!(
        "CSIDriver {DRIVER_NAME} ({SAFE_DETACH_ANNOTATION}=true), StorageClass {} (fsType={})",
        sc.name, opts.fs
    ));
    let hb_cfg = sim::HeartbeatConfig {
        interval: Duration::from_millis(250),
        lease_duration_seconds: 1,
        finish_terminating_pods: false, // the mini kubelets finish their pods
    };
    let hbs: Vec<_> = names
        .iter()
        .map(|n| sim::KubeletHeartbeat::new(&cluster, n, hb_cfg.clone()).spawn())
        .collect();
    let nodes_api = cluster.api::<Node>(None);
    wait_until("nodes registered", Duration::from_secs(10), || async {
        Ok(nodes_api.list(&ListParams::default()).await?.items.len() == names.len())
    })
    .await?;
    for n in &names {
        cluster
            .api::<CSINode>(None)
            .create(&CSINode {
                metadata: meta(n, None),
                spec: CSINodeSpec {
                    drivers: vec![CSINodeDriver {
                        name: DRIVER_NAME.into(),
                        node_id: n.clone(),
                        ..Default::default()
                    }],
                },
                ..Default::default()
            })
            .await?;
    }
    p.say(format!(
        "nodes {} registered (Ready), CSINodes created",
        names.join(", ")
    ));
    let _lifecycle = sim::NodeLifecycle::new(
        &cluster,
        sim::NodeLifecycleConfig {
            grace: opts.node_monitor_grace,
            interval: Duration::from_millis(100),
        },
    )
    .spawn();
    let _eviction = sim::TaintEviction::new(
        &cluster,
        sim::TaintEvictionConfig {
            interval: Duration::from_millis(100),
            default_toleration_seconds: 300,
        },
    )
    .spawn();

    // --- driver ----------------------------------------------------------------------------
    let (controller, controller_client) =
        InProcess::start(env.config(Mode::Controller, None, "controller")).await;
    let mut plugins = Vec::new();
    for n in &names {
        plugins.push(NodePlugin::start(env, &cluster, n).await?);
    }
    p.say(format!(
        "driver: controller plugin + {} node plugins (recovery every 1 s, clean reports to the Node)",
        names.len()
    ));

    // --- attacher and podgc ------------------------------------------------------------------
    let mut acfg = fencecsi_attacher::Config::new(env.socket("controller"));
    acfg.resync = Duration::from_secs(2);
    acfg.timeout = Duration::from_secs(30);
    acfg.backoff = fencecsi_attacher::Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(1),
    };
    acfg.fence = fencecsi_attacher::FencePolicy::Auto;
    acfg.identity = "drill-attacher".into();
    let mut attacher = fencecsi_attacher::Attacher::new(cluster.clone(), acfg).spawn();
    if !attacher.wait_active(Duration::from_secs(20)).await {
        bail!("the attacher did not become active");
    }
    let podgc = PodGc::new(
        cluster.clone(),
        PodGcConfig {
            shutdown_grace: opts.podgc_shutdown_grace,
            node_lease_grace: Some(opts.node_monitor_grace),
            out_of_service_taint: true,
            resync_interval: Duration::from_millis(250),
            debounce: Duration::from_millis(20),
            identity: "drill-podgc".into(),
            leader_election: None,
            ..Default::default()
        },
    )
    .spawn();
    p.say("attacher (fence auto) and podgc (out-of-service taint on) running");

    // --- stand-ins ----------------------------------------------------------------------------
    let size: i64 = if opts.fs == "xfs" {
        320 << 20
    } else {
        64 << 20
    };
    let provisioner = standins::provisioner(
        &cluster,
        controller_client.clone(),
        sc.clone(),
        size,
        p.clone(),
    );
    let adc = standins::attach_detach(&cluster, vec![DRIVER_NAME.to_string()], p.clone());
    let mut kubelets = Vec::new();
    for (i, n) in names.iter().enumerate() {
        kubelets.push(Kubelet::spawn(
            &cluster,
            n,
            env.kubelet_dir(n),
            plugins[i].client.clone(),
            board.clone(),
            procs.clone(),
            opts.writer_exe.clone(),
            opts.write_interval_ms,
            p.clone(),
        ));
    }
    let pvcs = cluster.api::<PersistentVolumeClaim>(Some(NAMESPACE));
    for i in 0..opts.volumes {
        pvcs.create(&PersistentVolumeClaim {
            metadata: meta(&format!("data-writer-{i}"), Some(NAMESPACE)),
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                storage_class_name: Some(STORAGE_CLASS.into()),
                resources: Some(VolumeResourceRequirements {
                    requests: Some(
                        [("storage".to_string(), Quantity(format!("{}Mi", size >> 20)))].into(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        })
        .await?;
    }
    let sts = standins::statefulset(
        &cluster,
        NAMESPACE,
        opts.volumes,
        &node_a,
        opts.toleration_seconds,
        p.clone(),
    );
    if opts.unsafe_pod {
        create_unsafe_pod(&cluster, &node_a, opts.toleration_seconds).await?;
        p.say(format!(
            "pod other-0 on {node_a} with a PV of {UNSAFE_DRIVER} (no safe-detach annotation)"
        ));
    }

    // --- writers running on A ------------------------------------------------------------------
    let pods = cluster.api::<Pod>(Some(NAMESPACE));
    let min = opts.min_records as i64;
    wait_until(
        "every writer on node A acknowledging records",
        opts.step_timeout,
        || async {
            let pb = board.published.lock().unwrap().clone();
            Ok(
                pb.len() >= opts.volumes
                    && pb.iter().all(|x| x.acked.load(Ordering::SeqCst) >= min),
            )
        },
    )
    .await?;
    let mut vols = Vec::new();
    for i in 0..opts.volumes {
        let name = format!("writer-{i}");
        let pod = pods.get(&name).await?;
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let pubd = board
            .by_uid(&uid)
            .ok_or_else(|| anyhow!("{name} not published"))?;
        vols.push(VolObs {
            pod: name,
            pv: pubd.pv.clone(),
            handle: pubd.handle.clone(),
            old_uid: uid,
            old_generation: pubd.generation,
            va_a: volume_attachment_name(&pubd.handle, DRIVER_NAME, &node_a),
            ..Default::default()
        });
    }
    {
        let mut o = shared.lock().unwrap();
        o.vols = vols.clone();
        let t = p.elapsed().as_secs_f64();
        mark(&mut o, Step::WritersAcked, t, p, "");
    }
    let _observer = observer(
        cluster.clone(),
        node_a.clone(),
        env.state_dir(),
        env.path().join("evidence"),
        board.clone(),
        shared.clone(),
        p.clone(),
    );

    // --- node A shuts down ----------------------------------------------------------------------
    hbs[0].stop();
    kubelets[0].stop();
    {
        let mut o = shared.lock().unwrap();
        let t = p.elapsed().as_secs_f64();
        mark(&mut o, Step::NodeDown, t, p, "");
    }
    let chain = wait_step(shared, Step::PublishedOnB, opts.step_timeout).await;
    if let Err(e) = chain {
        failures.push(format!("{e:#}"));
    }

    let mut per_volume: Vec<VolumeResult> = vec![];
    let mut unsafe_result = None;
    if failures.is_empty() {
        // --- verify on B -------------------------------------------------------------------------
        let vols = shared.lock().unwrap().vols.clone();
        let mut lost_now = 0;
        for v in &vols {
            let a = board.by_uid(&v.old_uid).unwrap();
            let b = board.by_uid(v.new_uid.as_deref().unwrap()).unwrap();
            let acked = a.acked.load(Ordering::SeqCst);
            if acked >= 0 {
                lost_now += records::missing(&b.found, acked as u64).len();
            }
        }
        {
            let mut o = shared.lock().unwrap();
            let t = p.elapsed().as_secs_f64();
            mark(
                &mut o,
                Step::RecordsVerified,
                t,
                p,
                &format!(" ({lost_now} missing so far)"),
            );
        }
        // The writers on B work.
        let new_uids: Vec<String> = vols.iter().filter_map(|v| v.new_uid.clone()).collect();
        if let Err(e) = wait_until(
            "writers on B acknowledging records",
            opts.step_timeout,
            || async {
                Ok(new_uids.iter().all(|u| {
                    board.by_uid(u).is_some_and(|b| {
                        b.acked.load(Ordering::SeqCst) >= b.resumed_at.load(Ordering::SeqCst) + 5
                    })
                }))
            },
        )
        .await
        {
            failures.push(format!("{e:#}"));
        }
        // Let A's writers run into the fence a little longer, then compare the fenced
        // generation with the copy taken when the fence was observed.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut fenced_diff: HashMap<String, u64> = HashMap::new();
        for v in &vols {
            match (&v.fenced_path, &v.fenced_copy) {
                (Some(a), Some(b)) => {
                    let (a, b) = (a.clone(), b.clone());
                    let d = tokio::task::spawn_blocking(move || differing_bytes(&a, &b)).await?;
                    match d {
                        Ok(d) => {
                            fenced_diff.insert(v.pod.clone(), d);
                        }
                        Err(e) => failures.push(format!("comparing fenced generation: {e}")),
                    }
                }
                _ => failures.push(format!("{}: no copy of the fenced generation", v.pod)),
            }
        }
        if opts.unsafe_pod {
            let other = pods.get_opt("other-0").await?;
            let ev = cluster
                .api::<Event>(None)
                .list_filtered(&ListParams::default(), |e| {
                    e.reason.as_deref() == Some("ForceDeleteSkipped")
                        && e.type_.as_deref() == Some("Warning")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("other-0")
                })
                .await?;
            let r = UnsafePodResult {
                still_terminating: other.is_some_and(|o| o.metadata.deletion_timestamp.is_some()),
                warning_event: ev.first().and_then(|e| e.note.clone()),
            };
            p.say(format!(
                "pod other-0 (driver without safe-detach): still terminating={}, Warning event: {}",
                r.still_terminating,
                r.warning_event.as_deref().unwrap_or("none")
            ));
            unsafe_result = Some(r);
        }

        // --- node A returns --------------------------------------------------------------------------
        kubelets[0].reboot().await;
        hbs[0].start();
        {
            let mut o = shared.lock().unwrap();
            let t = p.elapsed().as_secs_f64();
            mark(&mut o, Step::NodeBack, t, p, "");
        }
        let rec = plugins[0].recovery.clone();
        let mut released_logged = false;
        let lifted = wait_step(shared, Step::QuarantineLifted, opts.step_timeout).await;
        if let Some(r) = rec.latest() {
            if r.clean {
                released_logged = true;
            }
        }
        if let Err(e) = lifted {
            failures.push(format!("{e:#}"));
        }
        let _ = released_logged;

        // --- figures -----------------------------------------------------------------------------
        let vols = shared.lock().unwrap().vols.clone();
        for v in &vols {
            let a = board.by_uid(&v.old_uid).unwrap();
            let b = board.by_uid(v.new_uid.as_deref().unwrap()).unwrap();
            let acked = a.acked.load(Ordering::SeqCst);
            let lost = if acked >= 0 {
                records::missing(&b.found, acked as u64)
            } else {
                vec![]
            };
            if !v.deleted_with_condition {
                failures.push(format!(
                    "{}: deleted without a DisruptionTarget/{DELETION_BY_PODGC_REASON} condition or not force-deleted",
                    v.pod
                ));
            }
            per_volume.push(VolumeResult {
                pod: v.pod.clone(),
                pv: v.pv.clone(),
                volume_id: v.handle.clone(),
                old_uid: v.old_uid.clone(),
                new_uid: b.uid.clone(),
                new_node: b.node.clone(),
                old_generation: v.old_generation,
                new_generation: b.generation,
                acked_on_a: acked,
                lost,
                failed_writes_on_a: a.errors.load(Ordering::SeqCst),
                fenced_generation_immutable: v.fenced_immutable,
                bytes_after_fence: fenced_diff.get(&v.pod).copied().unwrap_or(0),
                acked_on_b: b.acked.load(Ordering::SeqCst),
            });
        }
    }
    {
        let o = shared.lock().unwrap();
        failures.extend(o.problems.iter().cloned());
    }

    // --- graceful teardown ------------------------------------------------------------------------
    drop(sts);
    for i in 0..opts.volumes {
        let _ = pods
            .delete(&format!("writer-{i}"), &DeleteOptions::default())
            .await;
    }
    let vas = cluster.api::<VolumeAttachment>(None);
    if let Err(e) = wait_until(
        "pods and attachments gone",
        Duration::from_secs(30),
        || async {
            Ok(pods
                .list_filtered(&ListParams::default(), |p| {
                    p.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.starts_with("writer-"))
                })
                .await?
                .is_empty()
                && vas
                    .list_filtered(&ListParams::default(), |v| v.spec.attacher == DRIVER_NAME)
                    .await?
                    .is_empty())
        },
    )
    .await
    {
        p.say(format!("teardown: {e:#} (the Env guard cleans up)"));
    } else {
        p.say("teardown: pods deleted, volumes unpublished, unstaged and detached");
    }
    drop(_observer);
    for k in kubelets {
        k.shutdown().await;
    }
    drop(adc);
    drop(provisioner);
    let _ = podgc.shutdown().await;
    let _ = attacher.shutdown().await;
    for hb in hbs {
        hb.shutdown().await;
    }
    for pl in plugins {
        pl.stop().await;
    }
    controller.stop().await;

    // --- report -----------------------------------------------------------------------------------
    let o = shared.lock().unwrap();
    let timeline: Vec<TimelineEntry> = o
        .steps
        .iter()
        .map(|(s, t)| TimelineEntry { step: *s, t: *t })
        .collect();
    let mut sorted = timeline.clone();
    sorted.sort_by(|a, b| a.t.total_cmp(&b.t));
    let records_lost: u64 = per_volume.iter().map(|v| v.lost.len() as u64).sum();
    let bytes_after_fence: u64 = per_volume.iter().map(|v| v.bytes_after_fence).sum();
    if records_lost > 0 {
        failures.push(format!("{records_lost} acknowledged record(s) lost"));
    }
    if bytes_after_fence > 0 {
        failures.push(format!(
            "{bytes_after_fence} byte(s) reached the fenced generation after the fence"
        ));
    }
    let get = |s: Step| o.steps.get(&s).copied();
    let failover_s = match (get(Step::NotReady), get(Step::PublishedOnB)) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let comparison = match (
        get(Step::NodeDown),
        get(Step::Quarantined),
        get(Step::PublishedOnB),
    ) {
        (Some(down), Some(q), Some(pb)) => {
            let k8s = 40.0 + 300.0 + 360.0;
            let mech = pb - q;
            let proj = 40.0 + 30.0 + mech;
            Some(Comparison {
                kubernetes_deployment_s: k8s,
                kubernetes_statefulset: "never, without a human (pods stay Terminating)",
                fencecsi_measured_from_shutdown_s: pb - down,
                fencecsi_mechanics_s: mech,
                fencecsi_projected_production_s: proj,
                ratio: k8s / proj,
            })
        }
        _ => None,
    };
    Ok(Report {
        ok: failures.is_empty(),
        failures,
        nodes: opts.nodes,
        volumes: opts.volumes,
        fs: opts.fs.clone(),
        timeline: sorted,
        failover_s,
        records_lost,
        bytes_after_fence,
        quarantine_lifted: o.steps.contains_key(&Step::QuarantineLifted),
        per_volume,
        comparison,
        unsafe_pod: unsafe_result,
        env_dir: String::new(),
        leftover_mounts: 0,
        leftover_loop_devices: 0,
        writers_left: 0,
        duration_s: 0.0,
    })
}

async fn create_unsafe_pod(cluster: &Cluster, node: &str, tol: i64) -> anyhow::Result<()> {
    cluster
        .api::<PersistentVolume>(None)
        .create(&PersistentVolume {
            metadata: meta("pv-other", None),
            spec: Some(PersistentVolumeSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                csi: Some(CSIPersistentVolumeSource {
                    driver: UNSAFE_DRIVER.into(),
                    volume_handle: "other-1".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        })
        .await?;
    cluster
        .api::<PersistentVolumeClaim>(Some(NAMESPACE))
        .create(&PersistentVolumeClaim {
            metadata: meta("data-other-0", Some(NAMESPACE)),
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                volume_name: Some("pv-other".into()),
                ..Default::default()
            }),
            status: None,
        })
        .await?;
    cluster
        .api::<Pod>(Some(NAMESPACE))
        .create(&standins::writer_pod(
            NAMESPACE,
            "other-0",
            node,
            "data-other-0",
            tol,
        ))
        .await?;
    Ok(())
}
