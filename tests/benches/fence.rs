//! Fence benchmark: fence latency and attach-after-fence latency against
//! volume size, on ext4 (no reflink: sparse copy), xfs and btrfs (reflink)
//! backing filesystems, all made on loop devices in this run. Then the gated
//! fence (every node's device now) against the fence before gates (a device
//! straight over the image, with its settle), alternating in the same run.
//!
//! cargo bench -p fencecsi-tests --bench fence   (needs root, xfsprogs, btrfs-progs)
//! FENCECSI_BENCH_CYCLES (default 3) fence/attach cycles per volume;
//! FENCECSI_BENCH_PRIMITIVE_RUNS (default 20) runs of each fence primitive.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use fencecsi_driver::fence::{self, TRAILER_BYTES};
use fencecsi_driver::kernel::loop_device::{self, AttachOptions};
use fencecsi_driver::kernel::loop_gate;
use fencecsi_tests::bench::pct_ms;
use fencecsi_tests::rig::{Placement, Rig};
use fencecsi_tests::{block_cap, Access, Env};

/// Writes `bytes` of data from the start of the published block device.
fn fill(p: &Placement, bytes: u64) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&p.target)
        .unwrap();
    let layout = std::alloc::Layout::from_size_align(1 << 20, 4096).unwrap();
    // SAFETY: non-zero layout, buffer used only here and leaked (benchmark).
    let buf = unsafe { std::slice::from_raw_parts_mut(std::alloc::alloc(layout), 1 << 20) };
    buf.iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i % 253) as u8 | 1);
    let mut off = 0;
    while off < bytes {
        f.write_all_at(buf, off).unwrap();
        off += 1 << 20;
    }
    f.sync_all().unwrap();
}

struct Row {
    backend: &'static str,
    size_gib: u64,
    fence: Vec<Duration>,
    attach_after: Vec<Duration>,
    first_attach: Duration,
}

async fn measure(backend_dir: &Path, backend: &'static str, size_gib: u64, cycles: usize) -> Row {
    let env = Env::new_in(backend_dir);
    let rig = Rig::start(&env, &["node-a", "node-b"]).await;
    let cap = block_cap(Access::SingleNodeWriter);
    let vol = rig
        .create(
            &format!("fence-bench-{size_gib}"),
            (size_gib << 30) as i64,
            &cap,
        )
        .await;
    let t = Instant::now();
    let mut holder = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-0", &cap)
        .await
        .unwrap();
    let first_attach = t.elapsed();
    fill(&holder, (size_gib << 30) / 10);
    let (mut fence, mut attach_after) = (Vec::new(), Vec::new());
    for i in 0..cycles {
        let t = Instant::now();
        rig.unpublish(&vol.volume_id, &holder.node, true)
            .await
            .expect("fence");
        fence.push(t.elapsed());
        let next = if holder.node == "node-a" {
            "node-b"
        } else {
            "node-a"
        };
        let t = Instant::now();
        rig.controller
            .clone()
            .controller
            .controller_publish_volume(fencecsi_tests::csi::ControllerPublishVolumeRequest {
                volume_id: vol.volume_id.clone(),
                node_id: next.into(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await
            .expect("attach after fence");
        attach_after.push(t.elapsed());
        // The fenced node returns and cleans up; the new holder stages.
        rig.node_teardown(&holder, true).await.unwrap();
        holder = rig
            .attach(&env, &vol.volume_id, next, &format!("pod-{}", i + 1), &cap)
            .await
            .unwrap();
    }
    rig.node_teardown(&holder, false).await.unwrap();
    rig.unpublish(&vol.volume_id, &holder.node, false)
        .await
        .unwrap();
    rig.delete(&vol.volume_id).await.unwrap();
    rig.stop().await;
    env.assert_clean();
    Row {
        backend,
        size_gib,
        fence,
        attach_after,
        first_attach,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !fencecsi_tests::can_run_kernel_tests() {
        eprintln!("SKIPPED: the fence benchmark needs root and loop devices");
        return;
    }
    let cycles: usize = std::env::var("FENCECSI_BENCH_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let runs: usize = std::env::var("FENCECSI_BENCH_PRIMITIVE_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let outer = Env::new();
    let kinds = [
        ("ext4", "ext4 (sparse copy)"),
        ("xfs", "xfs (reflink)"),
        ("btrfs", "btrfs (reflink)"),
    ];
    let dirs: Vec<_> = kinds
        .iter()
        .map(|(k, _)| fencecsi_tests::backing_fs(&outer, k, 48 << 30))
        .collect();
    let mut rows = Vec::new();
    for size in [1u64, 16] {
        for ((_, label), dir) in kinds.iter().zip(&dirs) {
            rows.push(measure(dir, label, size, cycles).await);
        }
    }
    let mut primitives = Vec::new();
    for ((kind, _), dir) in kinds.iter().zip(&dirs) {
        primitives.push((*kind, primitive_costs(dir, runs)));
    }
    println!(
        "## Fence and attach-after-fence ({cycles} cycles each; a tenth of each volume written)\n"
    );
    println!("| backend | volume | fence p50 ms | fence max ms | attach-after-fence p50 ms | max ms | first attach ms |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} GiB | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.backend,
            r.size_gib,
            pct_ms(&r.fence, 50.0),
            pct_ms(&r.fence, 100.0),
            pct_ms(&r.attach_after, 50.0),
            pct_ms(&r.attach_after, 100.0),
            r.first_attach.as_secs_f64() * 1e3
        );
    }
    println!("\n## The gated fence against the fence before gates ({runs} runs each; 64 MiB written and fsynced through the device just before)\n");
    println!("| backing fs | before gates (shrink, settle, move) p50 ms | p99 ms | max ms | gated (shut, drain, move) p50 ms | p99 ms | max ms | gated / before |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (kind, (old, new)) in &primitives {
        println!(
            "| {kind} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3}x |",
            pct_ms(old, 50.0),
            pct_ms(old, 99.0),
            pct_ms(old, 100.0),
            pct_ms(new, 50.0),
            pct_ms(new, 99.0),
            pct_ms(new, 100.0),
            pct_ms(new, 50.0) / pct_ms(old, 50.0)
        );
    }
}

/// The fence before gates (a device straight over the image: shrink,
/// settle, move) against the gated fence (shut, drain, move), alternating,
/// each on a fresh 256 MiB image with its trailer, a buffered loop device,
/// and 64 MiB written and fsynced through it just before.
fn primitive_costs(dir: &Path, runs: usize) -> (Vec<Duration>, Vec<Duration>) {
    const DATA: u64 = 256 << 20;
    let env = Env::new_in(dir);
    let (mut old, mut new) = (Vec::new(), Vec::new());
    for i in 0..runs * 2 {
        let img = env.path().join(format!("p{i}.img"));
        fencecsi_driver::kernel::files::create_sparse(&img, DATA + TRAILER_BYTES).unwrap();
        let opts = AttachOptions {
            tag: format!("bench-prim-{i}"),
            size_limit: DATA,
            ..Default::default()
        };
        let gated = i % 2 == 1;
        let lo = if gated {
            loop_gate::attach_gated(&img, &opts).unwrap()
        } else {
            loop_device::attach(&img, &opts).unwrap()
        };
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&lo.device)
            .unwrap();
        let buf = vec![0xA5u8; 1 << 20];
        for m in 0..64u64 {
            f.write_all_at(&buf, m << 20).unwrap();
        }
        f.sync_all().unwrap();
        drop(f);
        let t = Instant::now();
        fence::freeze(&img, DATA, fence::SETTLE).unwrap();
        if gated {
            new.push(t.elapsed());
        } else {
            old.push(t.elapsed());
        }
        loop_device::detach(&lo.device).unwrap();
        fencecsi_driver::kernel::files::set_immutable(&img, false).unwrap();
        std::fs::remove_file(&img).unwrap();
    }
    env.assert_clean();
    (old, new)
}
