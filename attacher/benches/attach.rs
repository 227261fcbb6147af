//! Attach and detach 1,000 VolumeAttachments with 10 workers against the real driver
//! (in this process, real sparse image files) on the embedded cluster, and compare with
//! the same ControllerPublish/Unpublish calls made directly.
//!
//! ```text
//! cargo bench -p fencecsi-attacher --bench attach
//! ATTACH_BENCH_N=200 ATTACH_BENCH_WORKERS=4 cargo bench -p fencecsi-attacher --bench attach
//! ```
//!
//! Needs root (the driver's state lives in a test env that is torn down at the end).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use fencecsi_attacher::metrics::{ATTACH, DETACH, ERROR, SUCCESS};
use fencecsi_attacher::Backoff;
use fencecsi_cluster::k8s_openapi::api::core::v1::PersistentVolume;
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::{DeleteOptions, WatchEvent, WatchParams};
use fencecsi_driver::config::Mode;
use fencecsi_embedded_cluster::EmbeddedCluster;
use fencecsi_tests::{block_cap, csi, Access, Env, InProcess};
use futures::StreamExt;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn vm_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Figures {
    label: String,
    n: usize,
    wall: Duration,
    lat: Vec<Duration>,
}

impl Figures {
    fn new(label: &str, n: usize, wall: Duration, mut lat: Vec<Duration>) -> Self {
        lat.sort();
        Figures {
            label: label.into(),
            n,
            wall,
            lat,
        }
    }
    fn print(&self) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "{:<46} {:>6} {:>10.1} {:>10.0} {:>9.2} {:>9.2} {:>9.2}",
            self.label,
            self.n,
            ms(self.wall),
            self.n as f64 / self.wall.as_secs_f64(),
            ms(pct(&self.lat, 0.5)),
            ms(pct(&self.lat, 0.99)),
            ms(*self.lat.last().unwrap_or(&Duration::ZERO)),
        );
    }
}

fn header() {
    println!(
        "{:<46} {:>6} {:>10} {:>10} {:>9} {:>9} {:>9}",
        "", "ops", "wall ms", "ops/s", "p50 ms", "p99 ms", "max ms"
    );
}

async fn direct(
    c: &fencecsi_proto::client::CsiClient,
    vols: &[String],
    concurrency: usize,
) -> (Figures, Figures) {
    let cap = block_cap(Access::SingleNodeWriter);
    let run = |unpublish: bool| {
        let cap = cap.clone();
        async move {
            let t0 = Instant::now();
            let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(concurrency));
            let mut tasks = Vec::new();
            for v in vols {
                let permit = sem.clone().acquire_owned().await.unwrap();
                let mut c = c.clone();
                let v = v.clone();
                let cap = cap.clone();
                tasks.push(tokio::spawn(async move {
                    let t = Instant::now();
                    if unpublish {
                        c.controller
                            .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                                volume_id: v,
                                node_id: "node-a".into(),
                                ..Default::default()
                            })
                            .await
                            .expect("ControllerUnpublishVolume");
                    } else {
                        c.controller
                            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                                volume_id: v,
                                node_id: "node-a".into(),
                                volume_capability: Some(cap),
                                ..Default::default()
                            })
                            .await
                            .expect("ControllerPublishVolume");
                    }
                    drop(permit);
                    t.elapsed()
                }));
            }
            let mut lat = Vec::new();
            for t in tasks {
                lat.push(t.await.unwrap());
            }
            (t0.elapsed(), lat)
        }
    };
    let (w, l) = run(false).await;
    let p = Figures::new(
        &format!("direct ControllerPublish, concurrency {concurrency}"),
        vols.len(),
        w,
        l,
    );
    let (w, l) = run(true).await;
    let u = Figures::new(
        &format!("direct ControllerUnpublish, concurrency {concurrency}"),
        vols.len(),
        w,
        l,
    );
    (p, u)
}

async fn bench(n: usize, workers: usize) {
    let env = Env::new();
    let mut pcfg = env.config(Mode::All, Some("node-a"), "all");
    pcfg.max_volumes_per_node = 0; // 1,000 attachments on one node
    pcfg.gc_interval = std::time::Duration::from_secs(3600); // no GC pass taking volume locks mid-run
    let (plugin, client) = InProcess::start(pcfg).await;

    let t = Instant::now();
    let mut vols = Vec::with_capacity(n);
    for i in 0..n {
        vols.push(create_volume(&client, &format!("pv-bench-{i:05}"), true).await);
    }
    let create_wall = t.elapsed();
    println!(
        "created {n} block volumes (1 MiB sparse) through the driver in {:.2} s ({:.0}/s)",
        create_wall.as_secs_f64(),
        n as f64 / create_wall.as_secs_f64()
    );

    // Baselines: the same calls without the attacher.
    let (seq_pub, seq_unpub) = direct(&client, &vols, 1).await;
    let (par_pub, par_unpub) = direct(&client, &vols, workers).await;
    let hwm_baseline = vm_kib("VmHWM:");

    // The cluster: node-a Ready with its CSINode, one PV per volume.
    let cluster = EmbeddedCluster::new().cluster();
    register_node(&cluster, "node-a", true).await;
    let pvs = cluster.api::<PersistentVolume>(None);
    for (i, h) in vols.iter().enumerate() {
        pvs.create(&pv(&format!("pv-bench-{i:05}"), h, true, "ReadWriteOnce"))
            .await
            .unwrap();
    }

    let mut cfg = test_config(&env.socket("all"));
    cfg.workers = workers;
    cfg.timeout = Duration::from_secs(30);
    cfg.resync = Duration::from_secs(60);
    cfg.backoff = Backoff::default();
    cfg.http_endpoint = None;
    let mut attacher = fencecsi_attacher::spawn(cluster.clone(), cfg);
    assert!(attacher.wait_active(Duration::from_secs(10)).await);

    // Observe attach and delete completions on a watch.
    let vas = cluster.api::<VolumeAttachment>(None);
    let mut watch = vas.watch(&WatchParams::default()).unwrap();
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<(String, bool, Instant)>();
    let watcher = tokio::spawn(async move {
        while let Some(ev) = watch.next().await {
            let now = Instant::now();
            match ev {
                WatchEvent::Added(v) | WatchEvent::Modified(v) => {
                    if v.status.as_ref().is_some_and(|s| s.attached) {
                        let _ = done_tx.send((v.metadata.name.unwrap(), true, now));
                    }
                }
                WatchEvent::Deleted(v) => {
                    let _ = done_tx.send((v.metadata.name.unwrap(), false, now));
                }
                WatchEvent::Listed(items) => {
                    for v in items {
                        if v.status.as_ref().is_some_and(|s| s.attached) {
                            let _ = done_tx.send((v.metadata.name.unwrap(), true, now));
                        }
                    }
                }
            }
        }
    });

    // Attach.
    let mut created: HashMap<String, Instant> = HashMap::with_capacity(n);
    let t_attach = Instant::now();
    for (i, h) in vols.iter().enumerate() {
        let va = va(&format!("pv-bench-{i:05}"), h, "node-a");
        let name = va.metadata.name.clone().unwrap();
        created.insert(name, Instant::now());
        vas.create(&va).await.unwrap();
    }
    let create_vas = t_attach.elapsed();
    let mut attached: HashMap<String, Instant> = HashMap::with_capacity(n);
    while attached.len() < n {
        let (name, is_attach, at) = tokio::time::timeout(Duration::from_secs(120), done_rx.recv())
            .await
            .expect("attach progress")
            .unwrap();
        if is_attach {
            attached.entry(name).or_insert(at);
        }
    }
    let attach_wall = attached.values().max().unwrap().duration_since(t_attach);
    let attach_lat: Vec<Duration> = attached
        .iter()
        .map(|(k, at)| at.duration_since(created[k]))
        .collect();
    let attach = Figures::new(
        &format!("attacher: VA create -> attached, {workers} workers"),
        n,
        attach_wall,
        attach_lat,
    );
    let hwm_attached = vm_kib("VmHWM:");
    let published = {
        let mut c = client.clone();
        let mut all = 0;
        for v in &vols {
            let st = c
                .controller
                .controller_get_volume(csi::ControllerGetVolumeRequest {
                    volume_id: v.clone(),
                })
                .await
                .unwrap()
                .into_inner()
                .status
                .unwrap();
            all += (st.published_node_ids == ["node-a"]) as usize;
        }
        all
    };
    assert_eq!(published, n, "every volume published to node-a");

    // Detach.
    let names: Vec<String> = created.keys().cloned().collect();
    let mut deleted_at: HashMap<String, Instant> = HashMap::with_capacity(n);
    let t_detach = Instant::now();
    for name in &names {
        deleted_at.insert(name.clone(), Instant::now());
        vas.delete(name, &DeleteOptions::default()).await.unwrap();
    }
    let mut gone: HashMap<String, Instant> = HashMap::with_capacity(n);
    while gone.len() < n {
        let (name, is_attach, at) = tokio::time::timeout(Duration::from_secs(120), done_rx.recv())
            .await
            .expect("detach progress")
            .unwrap();
        if !is_attach {
            gone.insert(name, at);
        }
    }
    let detach_wall = gone.values().max().unwrap().duration_since(t_detach);
    let detach_lat: Vec<Duration> = gone
        .iter()
        .map(|(k, at)| at.duration_since(deleted_at[k]))
        .collect();
    let detach = Figures::new(
        &format!("attacher: VA delete -> gone, {workers} workers"),
        n,
        detach_wall,
        detach_lat,
    );
    let hwm_end = vm_kib("VmHWM:");
    let m = attacher.metrics().clone();
    watcher.abort();
    attacher.shutdown().await.unwrap();
    plugin.stop().await;
    env.assert_clean();

    println!();
    header();
    seq_pub.print();
    seq_unpub.print();
    par_pub.print();
    par_unpub.print();
    attach.print();
    detach.print();
    println!();
    println!(
        "creating the {n} VolumeAttachments took {:.1} ms of the attach wall time",
        create_vas.as_secs_f64() * 1e3
    );
    println!(
        "attacher CSI calls: attach ok {} / error {}, detach ok {} / error {} (errors are retried with backoff)",
        m.operations(ATTACH, SUCCESS),
        m.operations(ATTACH, ERROR),
        m.operations(DETACH, SUCCESS),
        m.operations(DETACH, ERROR)
    );
    println!(
        "attach overhead vs direct sequential: {:.2}x wall; per object p50 {:.2} ms vs {:.2} ms per direct call",
        attach.wall.as_secs_f64() / seq_pub.wall.as_secs_f64(),
        pct(&attach.lat, 0.5).as_secs_f64() * 1e3,
        pct(&seq_pub.lat, 0.5).as_secs_f64() * 1e3,
    );
    println!(
        "peak RSS (VmHWM, whole process: driver + embedded cluster + attacher): after direct baselines {:.1} MiB, after attach {:.1} MiB, at end {:.1} MiB",
        hwm_baseline as f64 / 1024.0,
        hwm_attached as f64 / 1024.0,
        hwm_end as f64 / 1024.0
    );
}

fn main() {
    // `cargo bench` passes --bench; nothing to parse.
    if !fencecsi_tests::can_run_kernel_tests() {
        eprintln!("SKIPPED: needs root and /dev/loop-control");
        return;
    }
    let n = env_usize("ATTACH_BENCH_N", 1000);
    let workers = env_usize("ATTACH_BENCH_WORKERS", 10);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(bench(n, workers));
}
