//! Driver benchmark (issue 2): RPC latencies over many volumes, and write
//! throughput through a published mount against the same I/O on a plain file
//! of the backing filesystem, measured in the same run.
//!
//! cargo bench -p fencecsi-tests --bench driver   (needs root)
//! FENCECSI_BENCH_VOLUMES (default 50); FENCECSI_BENCH_LOOP_DIO=1 for loop devices in direct-I/O mode

use std::time::Instant;

use fencecsi_tests::bench::{pct_ms, rand_write, seq_write};
use fencecsi_tests::rig::Rig;
use fencecsi_tests::{csi, mount_cap, Access, Env};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !fencecsi_tests::can_run_kernel_tests() {
        eprintln!("SKIPPED: the driver benchmark needs root and loop devices");
        return;
    }
    let n: usize = std::env::var("FENCECSI_BENCH_VOLUMES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let env = Env::new();
    // FENCECSI_BENCH_LOOP_DIO=1 measures loop devices in direct-I/O mode.
    let loop_dio = std::env::var("FENCECSI_BENCH_LOOP_DIO").is_ok_and(|v| v == "1");
    println!(
        "loop devices: {}\n",
        if loop_dio {
            "direct I/O (--direct-io=true)"
        } else {
            "buffered (default)"
        }
    );
    let rig = Rig::start_with(&env, &["node-a"], |c| c.direct_io = loop_dio).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let mut node = rig.node("node-a");
    let mut ctl = rig.controller.clone();

    let (mut create, mut publish_ctl, mut stage, mut publish, mut unpublish, mut unstage) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for i in 0..n {
        let t = Instant::now();
        let vol = rig.create(&format!("bench-{i}"), 64 << 20, &cap).await;
        create.push(t.elapsed());
        let t = Instant::now();
        let ctx = ctl
            .controller
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: vol.volume_id.clone(),
                node_id: "node-a".into(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .publish_context;
        publish_ctl.push(t.elapsed());
        let staging = env
            .staging_path("node-a", &vol.volume_id)
            .to_string_lossy()
            .to_string();
        let target = env.target_path("node-a", &format!("pod-{i}"), &vol.volume_id);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        let target = target.to_string_lossy().to_string();
        let t = Instant::now();
        node.node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: vol.volume_id.clone(),
                publish_context: ctx.clone(),
                staging_target_path: staging.clone(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await
            .unwrap();
        stage.push(t.elapsed());
        let t = Instant::now();
        node.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: vol.volume_id.clone(),
                publish_context: ctx,
                staging_target_path: staging.clone(),
                target_path: target.clone(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await
            .unwrap();
        publish.push(t.elapsed());
        let t = Instant::now();
        node.node
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: vol.volume_id.clone(),
                target_path: target,
                force: false,
            })
            .await
            .unwrap();
        unpublish.push(t.elapsed());
        let t = Instant::now();
        node.node
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: vol.volume_id.clone(),
                staging_target_path: staging,
                force: false,
            })
            .await
            .unwrap();
        unstage.push(t.elapsed());
        rig.unpublish(&vol.volume_id, "node-a", false)
            .await
            .unwrap();
        rig.delete(&vol.volume_id).await.unwrap();
    }
    println!("## RPC latency over {n} volumes (64 MiB ext4, first stage includes mkfs)\n");
    println!("| RPC | p50 ms | p99 ms |\n|---|---:|---:|");
    for (name, v) in [
        ("CreateVolume", &create),
        ("ControllerPublishVolume", &publish_ctl),
        ("NodeStageVolume", &stage),
        ("NodePublishVolume", &publish),
        ("NodeUnpublishVolume", &unpublish),
        ("NodeUnstageVolume", &unstage),
    ] {
        println!(
            "| {name} | {:.2} | {:.2} |",
            pct_ms(v, 50.0),
            pct_ms(v, 99.0)
        );
    }

    // Throughput: a 2 GiB volume published on node-a against a plain file
    // next to the images (same backing filesystem), same I/O pattern.
    let vol = rig.create("bench-io", 2 << 30, &cap).await;
    let p = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-io", &cap)
        .await
        .unwrap();
    let plain_dir = env.state_dir().join("plain");
    std::fs::create_dir_all(&plain_dir).unwrap();
    let seq_total: u64 = 512 << 20;
    let (span, count) = (256u64 << 20, 20_000u64);
    // (plain seq, volume seq, plain QD1, volume QD1, plain 4 writers, volume 4 writers)
    let mut rows: Vec<[f64; 6]> = Vec::new();
    for round in 0..3 {
        let mut r = [0f64; 6];
        r[0] = seq_write(&plain_dir.join("seq"), seq_total);
        r[1] = seq_write(&p.target.join("seq"), seq_total);
        r[2] = rand_write(&plain_dir.join("rand"), span, count, 1, 7 + round);
        r[3] = rand_write(&p.target.join("rand"), span, count, 1, 7 + round);
        r[4] = rand_write(&plain_dir.join("rand4"), span, count, 4, 11 + round);
        r[5] = rand_write(&p.target.join("rand4"), span, count, 4, 11 + round);
        rows.push(r);
        for f in ["seq", "rand", "rand4"] {
            let _ = std::fs::remove_file(plain_dir.join(f));
            let _ = std::fs::remove_file(p.target.join(f));
        }
    }
    let med = |i: usize| {
        let mut v: Vec<f64> = rows.iter().map(|r| r[i]).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    println!("\n## Write throughput through the published mount vs a plain file on the backing filesystem (median of 3)\n");
    println!("| workload | plain file | fencecsi volume | ratio |\n|---|---:|---:|---:|");
    println!(
        "| sequential 1 MiB O_DIRECT, 512 MiB + fdatasync | {:.0} MiB/s | {:.0} MiB/s | {:.0}% |",
        med(0),
        med(1),
        med(1) / med(0) * 100.0
    );
    println!("| random 4 KiB O_DIRECT overwrite, 1 writer (QD1), 20k in 256 MiB | {:.0} IOPS | {:.0} IOPS | {:.0}% |", med(2), med(3), med(3) / med(2) * 100.0);
    println!("| random 4 KiB O_DIRECT overwrite, 4 writers, 20k in 256 MiB | {:.0} IOPS | {:.0} IOPS | {:.0}% |", med(4), med(5), med(5) / med(4) * 100.0);
    rig.node_teardown(&p, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .unwrap();
    rig.delete(&vol.volume_id).await.unwrap();
    let _ = std::fs::remove_dir_all(&plain_dir);
    rig.stop().await;
    env.assert_clean();
}
