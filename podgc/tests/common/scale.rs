//! podgc at scale on the embedded cluster, against a naive full-list scan doing the same
//! work. Shared by the benchmark (`benches/scale.rs`, `cargo bench -p fencecsi-podgc
//! --bench scale`) and its smoke test (`tests/scale.rs`); not part of the podgc binary.
//!
//! The cluster: `nodes` nodes with `pods_per_node` pods each. Per node, a realistic mix:
//! most pods are stateful with a PVC bound to a CSI PV of the safe-detach driver (and a
//! VolumeAttachment on the node), some use a PV of a driver without safe-detach, the rest
//! have no persistent volume. Then, for each of `rounds` nodes: its pods are deleted
//! gracefully (they turn `Terminating`), and its Ready condition goes `Unknown` with a
//! lastTransitionTime already past the shutdown grace. Measured: the time from that write
//! to the node's selectable pods being force-deleted and their VolumeAttachments deleted,
//! and the peak RSS (VmHWM, reset through /proc/self/clear_refs before each phase).
//!
//! The baseline does the same with one naive pass, run the moment the node turns
//! (its best case): list every node, pod, claim, volume, driver and attachment, join them in
//! memory, delete. That is what a controller without watches and indexes does each period.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::{Duration, Instant};

use fencecsi_cluster::k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Container, Node, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, Pod,
    PodSpec, Volume,
};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{
    CSIDriver, CSIDriverSpec, VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec,
};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use fencecsi_cluster::k8s_openapi::jiff::{SignedDuration, Timestamp};
use fencecsi_cluster::well_known::{
    volume_attachment_name, QUARANTINED_AT_ANNOTATION, QUARANTINE_TAINT_KEY, SAFE_DETACH_ANNOTATION,
};
use fencecsi_cluster::{Cluster, DeleteOptions, ListParams};
use fencecsi_embedded_cluster::sim::ready_node;
use fencecsi_embedded_cluster::EmbeddedCluster;

use fencecsi_podgc::{disrupt_and_delete, PodGc, PodGcConfig};

pub const SAFE_DRIVER: &str = "loop.fencecsi.io";
pub const UNSAFE_DRIVER: &str = "other.example.com";

/// The benchmark's parameters (defaults: 5,000 nodes, 150,000 pods).
#[derive(Debug, Clone)]
pub struct BenchArgs {
    /// Nodes in the embedded cluster.
    pub nodes: usize,
    /// Pods per node.
    pub pods_per_node: usize,
    /// Per node: this many pods use a PV of the safe-detach CSI driver...
    pub safe_per_node: usize,
    /// ...this many a PV of a driver without safe-detach; the rest have no PVC.
    pub unsafe_per_node: usize,
    /// Nodes taken down one after the other, each measured.
    pub rounds: usize,
    /// Give up on a round after this long.
    pub timeout: Duration,
    /// podgc's shutdown grace (production default: 30 s). podgc gives every node a full
    /// grace from when it starts leading, so the rounds begin after one.
    pub grace: Duration,
}

impl Default for BenchArgs {
    fn default() -> Self {
        BenchArgs {
            nodes: 5000,
            pods_per_node: 30,
            safe_per_node: 22,
            unsafe_per_node: 3,
            rounds: 3,
            timeout: Duration::from_secs(60),
            grace: Duration::from_secs(30),
        }
    }
}

/// VmHWM and VmRSS of this process, in MiB.
pub fn memory_mib() -> (f64, f64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let get = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map(|kb| kb / 1024.0)
            .unwrap_or(0.0)
    };
    (get("VmHWM:"), get("VmRSS:"))
}

/// Resets VmHWM to the current RSS (Linux >= 4.0).
pub fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[derive(Debug, Clone, Default)]
pub struct Round {
    pub node: String,
    pub pods_deleted: usize,
    pub vas_deleted: usize,
    pub pods_left: usize,
    pub latency: Duration,
}

#[derive(Debug, Clone, Default)]
pub struct BenchReport {
    pub nodes: usize,
    pub pods: usize,
    pub pvs: usize,
    pub vas: usize,
    pub load_time: Duration,
    pub rss_before_load_mib: f64,
    pub rss_after_load_mib: f64,
    pub hwm_load_mib: f64,
    pub podgc_sync_time: Duration,
    pub hwm_podgc_mib: f64,
    pub rss_podgc_mib: f64,
    pub podgc: Vec<Round>,
    pub naive: Vec<Round>,
    pub hwm_naive_mib: f64,
    pub naive_pass_times: Vec<Duration>,
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "podgc benchmark (embedded cluster)")?;
        writeln!(
            f,
            "  cluster: {} nodes, {} pods, {} PVs/PVCs, {} VolumeAttachments; loaded in {:.1?}",
            self.nodes, self.pods, self.pvs, self.vas, self.load_time
        )?;
        writeln!(
            f,
            "  memory: RSS {:.0} MiB before loading, {:.0} MiB after (peak {:.0} MiB)",
            self.rss_before_load_mib, self.rss_after_load_mib, self.hwm_load_mib
        )?;
        writeln!(f, "  podgc: caches synced in {:.1?}; peak RSS while syncing and acting {:.0} MiB (RSS after: {:.0} MiB)", self.podgc_sync_time, self.hwm_podgc_mib, self.rss_podgc_mib)?;
        for r in &self.podgc {
            writeln!(f, "    podgc  {}: {} pods force-deleted, {} VolumeAttachments deleted, {} pods left alone, in {:.1?}", r.node, r.pods_deleted, r.vas_deleted, r.pods_left, r.latency)?;
        }
        for (r, t) in self.naive.iter().zip(&self.naive_pass_times) {
            writeln!(f, "    naive  {}: {} pods force-deleted, {} VolumeAttachments deleted, {} pods left alone, in {:.1?} (full-list pass {:.1?})", r.node, r.pods_deleted, r.vas_deleted, r.pods_left, r.latency, t)?;
        }
        let p = median(&self.podgc.iter().map(|r| r.latency).collect::<Vec<_>>());
        let n = median(&self.naive.iter().map(|r| r.latency).collect::<Vec<_>>());
        writeln!(
            f,
            "  median time to force-delete + detach: podgc {:.1?}, naive full-list scan {:.1?}",
            p, n
        )?;
        writeln!(
            f,
            "  peak RSS: after loading {:.0} MiB; podgc phase {:.0} MiB; naive phase {:.0} MiB",
            self.hwm_load_mib, self.hwm_podgc_mib, self.hwm_naive_mib
        )?;
        Ok(())
    }
}

fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: ns.map(str::to_string),
        ..Default::default()
    }
}

pub fn node_name(i: usize) -> String {
    format!("node-{i:05}")
}

/// Loads the cluster. Returns (pods, pvs, vas).
pub async fn load(cluster: &Cluster, a: &BenchArgs) -> anyhow::Result<(usize, usize, usize)> {
    let drivers = cluster.api::<CSIDriver>(None);
    for (name, safe) in [(SAFE_DRIVER, true), (UNSAFE_DRIVER, false)] {
        let mut d = CSIDriver {
            metadata: meta(name, None),
            spec: CSIDriverSpec {
                attach_required: Some(true),
                ..Default::default()
            },
        };
        if safe {
            d.metadata.annotations =
                Some([(SAFE_DETACH_ANNOTATION.to_string(), "true".to_string())].into());
        }
        drivers.create(&d).await?;
    }
    let nodes = cluster.api::<Node>(None);
    let pvs = cluster.api::<PersistentVolume>(None);
    let vas = cluster.api::<VolumeAttachment>(None);
    let (mut n_pods, mut n_pvs, mut n_vas) = (0, 0, 0);
    for i in 0..a.nodes {
        let node = node_name(i);
        nodes.create(&ready_node(&node)).await?;
        let ns = format!("app-{}", i % 100);
        let pvcs = cluster.api::<PersistentVolumeClaim>(Some(&ns));
        let pods = cluster.api::<Pod>(Some(&ns));
        for j in 0..a.pods_per_node {
            let pod_name = format!("db-{i}-{j}");
            let mut volumes = vec![Volume {
                name: "config".into(),
                config_map: Some(Default::default()),
                ..Default::default()
            }];
            let driver = if j < a.safe_per_node {
                Some(SAFE_DRIVER)
            } else if j < a.safe_per_node + a.unsafe_per_node {
                Some(UNSAFE_DRIVER)
            } else {
                None
            };
            if let Some(driver) = driver {
                let pv_name = format!("pv-{i}-{j}");
                let claim = format!("data-{pod_name}");
                let handle = format!("vol-{i:05}{j:03}");
                pvs.create(&PersistentVolume {
                    metadata: meta(&pv_name, None),
                    spec: Some(PersistentVolumeSpec {
                        access_modes: Some(vec!["ReadWriteOnce".into()]),
                        csi: Some(CSIPersistentVolumeSource {
                            driver: driver.into(),
                            volume_handle: handle.clone(),
                            fs_type: Some("ext4".into()),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    status: None,
                })
                .await?;
                pvcs.create(&PersistentVolumeClaim {
                    metadata: meta(&claim, Some(&ns)),
                    spec: Some(PersistentVolumeClaimSpec {
                        access_modes: Some(vec!["ReadWriteOnce".into()]),
                        volume_name: Some(pv_name.clone()),
                        ..Default::default()
                    }),
                    status: None,
                })
                .await?;
                vas.create(&VolumeAttachment {
                    metadata: meta(&volume_attachment_name(&handle, driver, &node), None),
                    spec: VolumeAttachmentSpec {
                        attacher: driver.into(),
                        node_name: node.clone(),
                        source: VolumeAttachmentSource {
                            persistent_volume_name: Some(pv_name),
                            ..Default::default()
                        },
                    },
                    status: None,
                })
                .await?;
                volumes.push(Volume {
                    name: "data".into(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: claim,
                        read_only: None,
                    }),
                    ..Default::default()
                });
                n_pvs += 1;
                n_vas += 1;
            }
            pods.create(&Pod {
                metadata: meta(&pod_name, Some(&ns)),
                spec: Some(PodSpec {
                    node_name: Some(node.clone()),
                    containers: vec![Container {
                        name: "main".into(),
                        image: Some("registry.example/db:1".into()),
                        ..Default::default()
                    }],
                    volumes: Some(volumes),
                    ..Default::default()
                }),
                status: None,
            })
            .await?;
            n_pods += 1;
        }
    }
    Ok((n_pods, n_pvs, n_vas))
}

/// Makes every pod of `node` terminating, then its Ready condition Unknown since
/// `grace + 1 s` ago. Returns the moment of the condition write.
pub async fn take_down(cluster: &Cluster, node: &str, grace: Duration) -> anyhow::Result<Instant> {
    for p in cluster
        .api::<Pod>(None)
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?
        .items
    {
        let ns = p.metadata.namespace.clone().unwrap_or_default();
        cluster
            .api::<Pod>(Some(&ns))
            .delete(
                p.metadata.name.as_deref().unwrap_or(""),
                &DeleteOptions::default(),
            )
            .await?;
    }
    let nodes = cluster.api::<Node>(None);
    let mut n = nodes.get(node).await?;
    let since = Timestamp::now() - SignedDuration::try_from(grace + Duration::from_secs(1))?;
    for c in n
        .status
        .as_mut()
        .and_then(|s| s.conditions.as_mut())
        .into_iter()
        .flatten()
    {
        if c.type_ == "Ready" {
            c.status = "Unknown".into();
            c.reason = Some("NodeStatusUnknown".into());
            c.last_transition_time = Some(Time(Timestamp::from_second(since.as_second())?));
        }
    }
    nodes.replace_status(&n).await?;
    Ok(Instant::now())
}

/// What must go from `node`: its pod count and the safe driver's attachments on it.
async fn expectation(
    cluster: &Cluster,
    node: &str,
    safe_per_node: usize,
) -> anyhow::Result<(usize, Vec<String>)> {
    let before = cluster
        .api::<Pod>(None)
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?
        .items;
    let va_names = before
        .iter()
        .filter_map(|p| {
            let (_, i, j) = parse_pod(p.metadata.name.as_deref()?)?;
            (j < safe_per_node).then_some(())?;
            Some(volume_attachment_name(
                &format!("vol-{i:05}{j:03}"),
                SAFE_DRIVER,
                node,
            ))
        })
        .collect();
    Ok((before.len(), va_names))
}

/// Waits until the node holds only the pods podgc must leave alone and none of the
/// attachments in `expect`.
async fn wait_done(
    cluster: &Cluster,
    node: &str,
    expect_left: usize,
    expect: (usize, Vec<String>),
    timeout: Duration,
    start: Instant,
) -> anyhow::Result<Round> {
    let vas = cluster.api::<VolumeAttachment>(None);
    let (before, va_names) = expect;
    loop {
        let pods = cluster
            .api::<Pod>(None)
            .list_filtered(
                &ListParams::default().fields(&format!("spec.nodeName={node}")),
                |_| true,
            )
            .await?;
        let mut va_left = 0;
        if pods.len() <= expect_left {
            for n in &va_names {
                if vas.get_opt(n).await?.is_some() {
                    va_left += 1;
                }
            }
            if va_left == 0 {
                return Ok(Round {
                    node: node.to_string(),
                    pods_deleted: before - pods.len(),
                    vas_deleted: va_names.len(),
                    pods_left: pods.len(),
                    latency: start.elapsed(),
                });
            }
        }
        if start.elapsed() > timeout {
            anyhow::bail!("{node}: not done after {timeout:?}: {} pods left (want {expect_left}), {va_left} attachments left", pods.len());
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    }
}

/// (namespace index unused, node index, pod index) from `db-<i>-<j>`; only safe-driver pods
/// have a VolumeAttachment, the caller filters by index.
fn parse_pod(name: &str) -> Option<((), usize, usize)> {
    let rest = name.strip_prefix("db-")?;
    let (i, j) = rest.split_once('-')?;
    Some(((), i.parse().ok()?, j.parse().ok()?))
}

/// One naive pass: full lists of everything, joined in memory, then the same deletions.
pub async fn naive_pass(cluster: &Cluster, grace: Duration) -> anyhow::Result<(usize, usize)> {
    let now = Timestamp::now();
    let grace = SignedDuration::try_from(grace)?;
    let nodes = cluster
        .api::<Node>(None)
        .list(&ListParams::default())
        .await?
        .items;
    let down: HashSet<String> = nodes
        .iter()
        .filter(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                .is_some_and(|c| {
                    c.status != "True"
                        && c.last_transition_time
                            .as_ref()
                            .is_some_and(|t| now.duration_since(t.0) > grace)
                })
        })
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    let pods = cluster
        .api::<Pod>(None)
        .list(&ListParams::default())
        .await?
        .items;
    let pvcs: HashMap<(String, String), PersistentVolumeClaim> = cluster
        .api::<PersistentVolumeClaim>(None)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|c| {
            (
                (
                    c.metadata.namespace.clone().unwrap_or_default(),
                    c.metadata.name.clone().unwrap_or_default(),
                ),
                c,
            )
        })
        .collect();
    let pvs: HashMap<String, PersistentVolume> = cluster
        .api::<PersistentVolume>(None)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .map(|p| (p.metadata.name.clone().unwrap_or_default(), p))
        .collect();
    let safe: HashSet<String> = cluster
        .api::<CSIDriver>(None)
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|d| {
            d.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SAFE_DETACH_ANNOTATION))
                .is_some_and(|v| v == "true")
        })
        .filter_map(|d| d.metadata.name)
        .collect();
    let vas = cluster
        .api::<VolumeAttachment>(None)
        .list(&ListParams::default())
        .await?
        .items;
    let mut freed: HashSet<(String, String)> = HashSet::new();
    let mut deleted = 0;
    let mut quarantined: HashSet<String> = HashSet::new();
    for pod in pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_some())
    {
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        if !down.contains(&node) {
            continue;
        }
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let mut ok = true;
        let mut mine = Vec::new();
        for v in pod
            .spec
            .as_ref()
            .and_then(|s| s.volumes.as_ref())
            .into_iter()
            .flatten()
        {
            let Some(c) = &v.persistent_volume_claim else {
                continue;
            };
            let pv = pvcs
                .get(&(ns.clone(), c.claim_name.clone()))
                .and_then(|c| c.spec.as_ref()?.volume_name.clone())
                .and_then(|n| pvs.get(&n));
            match pv.and_then(|p| p.spec.as_ref()?.csi.as_ref()) {
                Some(csi) if safe.contains(&csi.driver) => {
                    mine.push(pv.unwrap().metadata.name.clone().unwrap_or_default())
                }
                _ => ok = false,
            }
        }
        if !ok {
            continue;
        }
        if quarantined.insert(node.clone()) {
            let api = cluster.api::<Node>(None);
            let mut n = api.get(&node).await?;
            n.spec
                .get_or_insert_with(Default::default)
                .taints
                .get_or_insert_with(Vec::new)
                .push(fencecsi_cluster::k8s_openapi::api::core::v1::Taint {
                    key: QUARANTINE_TAINT_KEY.into(),
                    effect: "NoSchedule".into(),
                    ..Default::default()
                });
            n.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(QUARANTINED_AT_ANNOTATION.into(), now.to_string());
            api.replace(&n).await?;
        }
        disrupt_and_delete(cluster, pod, "naive pass").await?;
        deleted += 1;
        for pv in mine {
            freed.insert((node.clone(), pv));
        }
    }
    let mut va_deleted = 0;
    for va in vas {
        let key = (
            va.spec.node_name.clone(),
            va.spec
                .source
                .persistent_volume_name
                .clone()
                .unwrap_or_default(),
        );
        if freed.contains(&key) {
            cluster
                .api::<VolumeAttachment>(None)
                .delete(
                    va.metadata.name.as_deref().unwrap_or(""),
                    &DeleteOptions::default(),
                )
                .await?;
            va_deleted += 1;
        }
    }
    Ok((deleted, va_deleted))
}

/// Runs the whole benchmark.
pub async fn run(a: BenchArgs) -> anyhow::Result<BenchReport> {
    anyhow::ensure!(
        a.safe_per_node + a.unsafe_per_node <= a.pods_per_node,
        "safe_per_node ({}) + unsafe_per_node ({}) > pods_per_node ({})",
        a.safe_per_node,
        a.unsafe_per_node,
        a.pods_per_node
    );
    anyhow::ensure!(a.rounds * 2 <= a.nodes, "need at least 2 nodes per round");
    let mut r = BenchReport::default();
    let cluster = EmbeddedCluster::new().cluster();
    reset_peak();
    r.rss_before_load_mib = memory_mib().1;
    let t = Instant::now();
    let (pods, pvs, vas) = load(&cluster, &a).await?;
    r.load_time = t.elapsed();
    (r.nodes, r.pods, r.pvs, r.vas) = (a.nodes, pods, pvs, vas);
    (r.hwm_load_mib, r.rss_after_load_mib) = memory_mib();
    eprintln!(
        "loaded {} nodes, {pods} pods, {pvs} PVs, {vas} VolumeAttachments in {:.1?}; RSS {:.0} MiB",
        a.nodes, r.load_time, r.rss_after_load_mib
    );

    let grace = a.grace;
    let left_alone = a.unsafe_per_node;
    reset_peak();
    let t = Instant::now();
    let handle = PodGc::new(
        cluster.clone(),
        PodGcConfig {
            shutdown_grace: grace,
            node_lease_grace: None,
            resync_interval: Duration::from_secs(5),
            debounce: Duration::from_millis(10),
            ..Default::default()
        },
    )
    .spawn();
    handle.next_pass().await;
    r.podgc_sync_time = t.elapsed();
    // Nodes taken down are NotReady since before podgc started: it acts on them only a
    // grace after it started leading.
    tokio::time::sleep((t + grace).saturating_duration_since(Instant::now())).await;
    for k in 0..a.rounds {
        let node = node_name(a.nodes / 2 + k * 7);
        let expect = expectation(&cluster, &node, a.safe_per_node).await?;
        let start = take_down(&cluster, &node, grace).await?;
        let round = wait_done(&cluster, &node, left_alone, expect, a.timeout, start).await?;
        eprintln!("podgc {node}: {:.1?}", round.latency);
        r.podgc.push(round);
    }
    (r.hwm_podgc_mib, r.rss_podgc_mib) = memory_mib();
    handle.shutdown().await?;

    reset_peak();
    for k in 0..a.rounds {
        let node = node_name(a.nodes / 4 + k * 7);
        let expect = expectation(&cluster, &node, a.safe_per_node).await?;
        let start = take_down(&cluster, &node, grace).await?;
        let t = Instant::now();
        naive_pass(&cluster, grace).await?;
        r.naive_pass_times.push(t.elapsed());
        let round = wait_done(&cluster, &node, left_alone, expect, a.timeout, start).await?;
        eprintln!("naive {node}: {:.1?}", round.latency);
        r.naive.push(round);
    }
    r.hwm_naive_mib = memory_mib().0;
    Ok(r)
}
