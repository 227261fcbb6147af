//! Fence benchmark (issue 3): fence latency and attach-after-fence latency
//! against volume size, on an ext4 backend (no reflink: sparse copy) and an
//! xfs backend (reflink), both made on loop devices in this run.
//!
//! cargo bench -p fencecsi-tests --bench fence   (needs root, xfsprogs)
//! FENCECSI_BENCH_CYCLES (default 3) fence/attach cycles per volume.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use fencecsi_driver::loopdev::{self, AttachOptions};
use fencecsi_tests::bench::pct_ms;
use fencecsi_tests::rig::{Placement, Rig};
use fencecsi_tests::{block_cap, Access, Env};

/// Makes a filesystem of `kind` on a loop device over a sparse image in
/// `outer` and mounts it; the outer env's teardown unmounts and detaches it.
fn backend(outer: &Env, kind: &str) -> std::path::PathBuf {
    let img = outer.path().join(format!("{kind}-backend.img"));
    fencecsi_driver::fsops::create_sparse(&img, 48 << 30).unwrap();
    let lo = loopdev::attach(
        &img,
        &AttachOptions {
            read_only: false,
            direct_io: false,
            tag: format!("bench-backend-{kind}"),
            size_limit: 0,
        },
    )
    .unwrap();
    fencecsi_driver::fsutil::mkfs(&lo.device, kind).unwrap();
    let mnt = outer.path().join(format!("{kind}-backend"));
    std::fs::create_dir_all(&mnt).unwrap();
    fencecsi_driver::mounts::mount_device(&lo.device, &mnt, kind, &[], false).unwrap();
    mnt
}

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
    let outer = Env::new();
    let ext4 = backend(&outer, "ext4");
    let xfs = backend(&outer, "xfs");
    let mut rows = Vec::new();
    for size in [1u64, 16] {
        rows.push(measure(&ext4, "ext4 (sparse copy)", size, cycles).await);
        rows.push(measure(&xfs, "xfs (reflink)", size, cycles).await);
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
}
