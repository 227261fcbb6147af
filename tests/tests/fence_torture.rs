//! The fence under fire, on every supported backing filesystem (ext4, xfs,
//! btrfs, each made by the test on a loop-mounted image), for ext4, xfs and
//! raw block volumes, on buffered and direct-I/O loop devices. A writer on
//! node A appends numbered, fsync'ed records and churns a scratch area with
//! writes, discards and write-zeroes (BLKDISCARD/BLKZEROOUT on raw block,
//! punch-hole/zero-range plus FITRIM on filesystems); at a random moment the
//! controller fences node A. Every run shows:
//! - positive control: the data region was changing before the fence;
//! - the data region of the fenced generation is byte-identical at +0 s,
//!   +3 s and +10 s after the RPC returned, while node A keeps writing and,
//!   after the fence, also discards and zeroes the record area on purpose;
//! - no record is acknowledged after the RPC returned;
//! - every acknowledged record is intact on node B (a new generation).
//!
//! Runs per backing filesystem: FENCECSI_TORTURE_RUNS (default 30), run in
//! batches of five at once. Seed: FENCECSI_TORTURE_SEED.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencecsi_tests::records::{missing, RECORD_SIZE};
use fencecsi_tests::rig::{Rig, Rng};
use fencecsi_tests::writer::Writer;
use fencecsi_tests::{
    block_cap, generation_path, monotonic_ns, mount_cap, region_hash, require_root, Access, Env,
};

const BATCH: usize = 5;
/// Where the writer's scratch area starts (inside every volume size used).
const SCRATCH_AT: u64 = 40 << 20;

/// FITRIM on a mounted filesystem, over and over, until stopped: the discards
/// a periodic fstrim sends.
struct Trimmer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Trimmer {
    fn start(mount: &Path) -> Trimmer {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, m) = (stop.clone(), mount.to_path_buf());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                fitrim(&m);
                std::thread::sleep(Duration::from_millis(30));
            }
        });
        Trimmer {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Trimmer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn fitrim(mount: &Path) -> bool {
    // struct fstrim_range { start, len, minlen }; FITRIM = _IOWR('X', 121, it).
    let Ok(dir) = std::fs::File::open(mount) else {
        return false;
    };
    let mut range = [0u64, u64::MAX, 0];
    // SAFETY: ioctl on our fd with a valid fstrim_range.
    unsafe { libc::ioctl(dir.as_raw_fd(), 0xC018_5879, range.as_mut_ptr()) == 0 }
}

/// What node A does once fenced, on purpose: discard and zero the record
/// area, write over it, and trim. None of it may reach the data.
fn attack(target: &Path, block: bool) {
    if block {
        if let Ok(f) = std::fs::OpenOptions::new().write(true).open(target) {
            let range = [0u64, 8 << 20];
            // SAFETY: ioctls on our fd with a valid 16-byte range.
            unsafe {
                libc::ioctl(f.as_raw_fd(), 0x1277, range.as_ptr());
                libc::ioctl(f.as_raw_fd(), 0x127f, range.as_ptr());
            }
            use std::os::unix::fs::FileExt;
            let _ = f.write_all_at(&[0xEE; 8192], 0);
            let _ = f.sync_all();
        }
    } else {
        let _ = std::fs::write(target.join("late"), vec![0xEE; 1 << 20]);
        if let Ok(f) = std::fs::File::open(target.join("late")) {
            let _ = f.sync_all();
        }
        fitrim(target);
    }
}

struct Outcome {
    acked: usize,
    racing_lost: usize,
    errors: usize,
    fence_ms: f64,
}

async fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[allow(clippy::too_many_arguments)]
async fn one_run(
    rig: &Rig,
    env: &Env,
    backing: &str,
    run: u64,
    mode: &str,
    loop_dio: bool,
    direct: bool,
    warmup: u64,
    delay_ms: u64,
    seed: u64,
) -> Outcome {
    let label = format!("{backing} run {run} ({mode} volume, loop dio={loop_dio}, writer O_DIRECT={direct}, seed {seed})");
    let (cap, size) = match mode {
        "block" => (block_cap(Access::SingleNodeWriter), 64 << 20),
        "xfs" => (mount_cap(Access::SingleNodeWriter, "xfs"), 300 << 20),
        fs => (mount_cap(Access::SingleNodeWriter, fs), 64 << 20),
    };
    let vol = rig
        .create(&format!("torture-{backing}-{run}"), size, &cap)
        .await;
    let a = rig
        .attach(env, &vol.volume_id, "node-a", &format!("pod-a-{run}"), &cap)
        .await
        .unwrap_or_else(|e| panic!("{label}: attach on node A: {e:?}"));
    let block = mode == "block";
    let path = if block {
        a.target.clone()
    } else {
        a.target.join("records.log")
    };
    let image = generation_path(env, &vol.volume_id, a.generation());
    let data = size as u64;
    let writer = Writer::start(
        Path::new(env!("CARGO_BIN_EXE_fencecsi-writer")),
        &path,
        direct,
        &["--churn", &SCRATCH_AT.to_string()],
    );
    let trimmer = (!block).then(|| Trimmer::start(&a.target));
    wait_until(
        &format!("{label}: first records"),
        Duration::from_secs(30),
        || writer.acked() >= warmup,
    )
    .await;
    // Positive control: the data region changes while the writer runs.
    let h1 = region_hash(&image, data);
    let n = writer.acked();
    wait_until(
        &format!("{label}: more records"),
        Duration::from_secs(30),
        || writer.acked() >= n + 3,
    )
    .await;
    let h2 = region_hash(&image, data);
    assert_ne!(
        h1, h2,
        "{label}: control: the data did not change while the writer ran"
    );
    tokio::time::sleep(Duration::from_millis(delay_ms)).await;

    let sent = Instant::now();
    rig.unpublish(&vol.volume_id, "node-a", true)
        .await
        .unwrap_or_else(|e| panic!("{label}: the fence must be made: {e:?}"));
    let returned = monotonic_ns();
    let fence_ms = sent.elapsed().as_secs_f64() * 1e3;
    let h0 = region_hash(&image, data);
    attack(&a.target, block);
    wait_until(
        &format!("{label}: the writer to fail after the fence"),
        Duration::from_secs(20),
        || writer.errors_since(returned) > 0,
    )
    .await;
    let at = |s: u64| Instant::now() + Duration::from_secs(s) - sent.elapsed();
    tokio::time::sleep_until(at(3).into()).await;
    assert_eq!(
        region_hash(&image, data),
        h0,
        "{label}: data changed by +3 s"
    );
    tokio::time::sleep_until(at(10).into()).await;
    assert_eq!(
        region_hash(&image, data),
        h0,
        "{label}: data changed by +10 s"
    );
    drop(trimmer);
    let (acks, errors) = writer.stop();
    // An acknowledgement is stamped the moment its fsync returned; allow for
    // the stamp to be taken a little after (scheduling), not for a write after.
    let late: Vec<_> = acks
        .iter()
        .filter(|(_, t)| *t > returned + 20_000_000)
        .collect();
    assert!(
        late.is_empty(),
        "{label}: records acknowledged after the fence returned: {late:?}"
    );

    let b = rig
        .attach(env, &vol.volume_id, "node-b", &format!("pod-b-{run}"), &cap)
        .await
        .unwrap_or_else(|e| panic!("{label}: attach on node B: {e:?}"));
    assert!(
        b.generation() > a.generation(),
        "{label}: node B must get a new generation"
    );
    // Every record acknowledged before the RPC was sent must be on node B.
    // Records acknowledged while it ran may or may not be (a write racing a
    // cut): counted and reported, not required.
    let sent_ns = returned - (fence_ms * 1e6) as u64;
    let before: Vec<u64> = acks
        .iter()
        .filter(|(_, t)| *t < sent_ns)
        .map(|(s, _)| *s)
        .collect();
    let last = acks.iter().map(|(s, _)| *s).max();
    let mut racing_lost = 0;
    if let Some(last) = last {
        let bytes = if block {
            let mut buf = vec![0u8; (last as usize + 1) * RECORD_SIZE];
            use std::os::unix::fs::FileExt;
            std::fs::File::open(&b.target)
                .unwrap()
                .read_exact_at(&mut buf, 0)
                .unwrap();
            buf
        } else {
            std::fs::read(b.target.join("records.log")).unwrap_or_default()
        };
        let lost = missing(&bytes, last);
        let lost_before: Vec<_> = lost.iter().filter(|s| before.contains(s)).collect();
        racing_lost = lost.len() - lost_before.len();
        assert!(
            lost_before.is_empty(),
            "{label}: {} of {} records acknowledged before the fence was sent are missing or damaged on node B: {:?}",
            lost_before.len(),
            before.len(),
            &lost_before[..lost_before.len().min(10)]
        );
    }
    rig.node_teardown(&a, true)
        .await
        .unwrap_or_else(|e| panic!("{label}: force teardown on node A: {e:?}"));
    rig.node_teardown(&b, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-b", false)
        .await
        .unwrap();
    // The fenced generation goes once node A let go (GC); delete waits for it.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match rig.delete(&vol.volume_id).await {
            Ok(()) => break,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{label}: delete after cleanup: {e:?}"),
        }
    }
    let _: PathBuf = image;
    Outcome {
        acked: acks.len(),
        racing_lost,
        errors,
        fence_ms,
    }
}

async fn torture(backing: &str) {
    require_root!();
    fencecsi_tests::init_tracing();
    let runs: u64 = std::env::var("FENCECSI_TORTURE_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let (mut rng, seed) = Rng::from_env("FENCECSI_TORTURE_SEED");
    eprintln!("fence torture on {backing}: {runs} runs, seed {seed}");
    let outer = Env::new();
    let mnt = fencecsi_tests::backing_fs(&outer, backing, 16 << 30);
    let env = Env::new_in(&mnt);
    assert_eq!(fencecsi_driver::fence::fs_name(env.path()), backing);
    let modes = ["ext4", "xfs", "block"];
    let mut fence_ms = Vec::new();
    let mut run = 0;
    // First half on buffered loop devices (the default), second half with
    // direct I/O to the image.
    for loop_dio in [false, true] {
        let rig = Rig::start_with(&env, &["node-a", "node-b"], |c| c.direct_io = loop_dio).await;
        let end = if loop_dio { runs } else { runs / 2 };
        while run < end {
            let batch: Vec<u64> = (run..end.min(run + BATCH as u64)).collect();
            run += batch.len() as u64;
            let params: Vec<_> = batch
                .iter()
                .map(|r| {
                    (
                        *r,
                        modes[(*r % 3) as usize],
                        rng.next() % 2 == 0,
                        rng.range(3, 30),
                        rng.range(0, 150),
                    )
                })
                .collect();
            let outcomes =
                futures::future::join_all(params.iter().map(|(r, mode, direct, warmup, delay)| {
                    one_run(
                        &rig, &env, backing, *r, mode, loop_dio, *direct, *warmup, *delay, seed,
                    )
                }))
                .await;
            for ((r, mode, direct, _, _), o) in params.iter().zip(&outcomes) {
                eprintln!("  {backing} run {r:>2}: {mode:>5} volume, loop dio={loop_dio:<5}, writer O_DIRECT={direct:<5}: {:>5} records acknowledged, {:>5} errors after the fence, {} acknowledged during the RPC and not on B, fence {:.1} ms", o.acked, o.errors, o.racing_lost, o.fence_ms);
                fence_ms.push(o.fence_ms);
            }
        }
        rig.stop().await;
    }
    env.assert_clean();
    fence_ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    eprintln!(
        "fence torture on {backing}: {runs} runs ok; fence latency p50 {:.1} ms, max {:.1} ms",
        fence_ms[fence_ms.len() / 2],
        fence_ms.last().unwrap()
    );
    drop(env);
    drop(outer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_torture_backing_ext4() {
    torture("ext4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_torture_backing_xfs() {
    torture("xfs").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_torture_backing_btrfs() {
    torture("btrfs").await;
}
