//! The fence against writes already under way when it starts: writes that
//! passed the block layer's end-of-device check with the data's size, then
//! waited (for the queue the fence freezes, or for a CPU) while the fence
//! ran. Such a write may land in the data before the fence returns, or fail;
//! it must never be reported written after the fence returned without being
//! in the data (it would then be an acknowledged write node B never sees).
//!
//! Writer threads, held to a small CPU share by a cgroup v1 `cpu` quota so
//! that they are often off-CPU in the middle of a submission, write
//! distinct 4 KiB blocks with O_DIRECT to a gated loop device (as nodes
//! attach) while the controller's fence (`fence::freeze`) runs, with no
//! settle: the gate's fence has none. Every write that completed without
//! error after the fence returned must be found in the image's data region,
//! and `fence::late_write_at` (what garbage collection reports) finds
//! nothing past the window. Positive controls: writes reached the data
//! before the fence, and the writers saw errors after it; on a device
//! attached straight onto the image (no gate) with no settle, rounds lose
//! such writes and `late_write_at` finds them. (tests/tests/fence_held.rs
//! holds requests much longer, in blk-throttle.)
//!
//! Rounds: FENCECSI_INFLIGHT_ROUNDS (default 20) per backing filesystem and
//! loop mode. On btrfs and xfs backing, the positive control then runs rounds
//! until one loses a write (on ext4 the immutable flag fails such writes
//! anyway).

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fencecsi_driver::fence;
use fencecsi_driver::kernel::loop_device::{self, AttachOptions};
use fencecsi_driver::kernel::loop_gate;
use fencecsi_tests::rig::Rng;
use fencecsi_tests::{monotonic_ns, require_root, Env};

const BLOCK: usize = 4096;
// Large enough that a writer rarely runs through its slice before a late fence.
const DATA: u64 = 256 << 20;
const WRITERS: usize = 6;

/// One write as its thread saw it.
struct Write {
    offset: u64,
    started: u64,
    ended: u64,
    ok: bool,
    content: [u8; 16],
}

/// A cgroup v1 `cpu` group this test made, with a quota; removed on drop
/// (its threads have exited or been moved out by then).
struct CpuQuota {
    dir: PathBuf,
}

impl CpuQuota {
    /// `quota_us` of CPU time every `period_us`, or None where the cpu
    /// controller is not mounted at /sys/fs/cgroup/cpu (v1).
    fn new(name: &str, period_us: u64, quota_us: u64) -> Option<CpuQuota> {
        let root = Path::new("/sys/fs/cgroup/cpu");
        if !root.join("cpu.cfs_quota_us").exists() {
            return None;
        }
        let dir = root.join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir(&dir).ok()?;
        let q = CpuQuota { dir };
        std::fs::write(q.dir.join("cpu.cfs_period_us"), period_us.to_string()).ok()?;
        std::fs::write(q.dir.join("cpu.cfs_quota_us"), quota_us.to_string()).ok()?;
        Some(q)
    }

    /// Moves the calling thread into the group.
    fn enter(&self) {
        let tid = nix::unistd::gettid().as_raw();
        std::fs::write(self.dir.join("tasks"), tid.to_string())
            .unwrap_or_else(|e| panic!("moving thread {tid} into {}: {e}", self.dir.display()));
    }
}

impl Drop for CpuQuota {
    fn drop(&mut self) {
        // The writer threads have exited; rmdir fails (EBUSY) only while a
        // task is left in the group, and then says so.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("could not remove cgroup {}", self.dir.display());
    }
}

fn block_content(round: u64, thread: usize, seq: u64) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[..8].copy_from_slice(&round.to_le_bytes());
    c[8..12].copy_from_slice(&(thread as u32).to_le_bytes());
    c[12..].copy_from_slice(&(seq as u32).to_le_bytes());
    c
}

/// Writes distinct blocks to `device` with O_DIRECT, round-robin over this
/// thread's slice of the data, until `stop`.
fn write_blocks(
    device: PathBuf,
    round: u64,
    thread: usize,
    quota: Option<Arc<CpuQuota>>,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicUsize>,
) -> Vec<Write> {
    if let Some(q) = &quota {
        q.enter();
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&device)
        .unwrap_or_else(|e| panic!("opening {}: {e}", device.display()));
    let layout = std::alloc::Layout::from_size_align(BLOCK, BLOCK).unwrap();
    // SAFETY: a non-zero, aligned layout; freed below.
    let ptr = unsafe { std::alloc::alloc(layout) };
    // SAFETY: `ptr` is valid for BLOCK bytes until dealloc.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, BLOCK) };
    // Block 0 is left out: a late write there would land in the fence
    // window's own block, which `late_write_at` does not look at.
    let slice = (DATA / BLOCK as u64 - 1) / WRITERS as u64;
    let mut log = Vec::new();
    let mut seq = 0u64;
    while !stop.load(Ordering::Relaxed) {
        if seq == slice {
            // Every block of the slice written once (a busy machine delayed
            // the fence): writing on would overwrite one and could hide a
            // lost write, so this thread just waits for the stop.
            eprintln!("round {round}: writer {thread} wrote all {slice} blocks of its slice before the stop");
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
            }
            break;
        }
        let content = block_content(round, thread, seq);
        for chunk in buf.chunks_mut(16) {
            chunk.copy_from_slice(&content);
        }
        let offset = (1 + thread as u64 * slice + seq % slice) * BLOCK as u64;
        let started = monotonic_ns();
        let ok = file.write_all_at(buf, offset).is_ok();
        let ended = monotonic_ns();
        if ok {
            done.fetch_add(1, Ordering::Relaxed);
        } else {
            // A fenced device fails at once: no need for thousands of them.
            std::thread::sleep(Duration::from_millis(1));
        }
        log.push(Write {
            offset,
            started,
            ended,
            ok,
            content,
        });
        // A failed write is tried again at the same block: each block is
        // written done at most once, so its content says which write it holds.
        seq += u64::from(ok);
    }
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(ptr, layout) };
    log
}

/// The writer threads of one round; stopped and joined on drop too, so a
/// failing round leaves no thread writing (nor one in the test's cgroup).
struct Writers {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<Vec<Write>>>,
}

impl Writers {
    fn start(
        device: &Path,
        round: u64,
        quota: &Option<Arc<CpuQuota>>,
        done: &Arc<AtomicUsize>,
    ) -> Writers {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..WRITERS)
            .map(|t| {
                let (d, q, s, n) = (
                    device.to_path_buf(),
                    quota.clone(),
                    stop.clone(),
                    done.clone(),
                );
                std::thread::spawn(move || write_blocks(d, round, t, q, s, n))
            })
            .collect();
        Writers { stop, threads }
    }

    /// Stops the writers; every write they made, as each saw it.
    fn stop(&mut self) -> Vec<Write> {
        self.stop.store(true, Ordering::Relaxed);
        self.threads
            .drain(..)
            .flat_map(|t| t.join().expect("writer thread"))
            .collect()
    }
}

impl Drop for Writers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

struct RoundResult {
    before_ok: usize,
    errors_after: usize,
    /// Completed without error after the fence returned, and not in the data.
    lost: Vec<u64>,
    /// Began after the fence returned and completed without error.
    begun_after: usize,
    /// `fence::late_write_at` on the image once the writers stopped.
    late: Option<u64>,
}

#[allow(clippy::too_many_arguments)]
fn one_round(
    env: &Env,
    round: u64,
    gated: bool,
    direct_io: bool,
    delay_ms: u64,
    quota: &Option<Arc<CpuQuota>>,
    settle: Duration,
    after: Duration,
) -> RoundResult {
    let image = env.path().join(format!("inflight-{round}.img"));
    fencecsi_driver::kernel::files::create_sparse(&image, DATA).unwrap();
    fence::ensure_trailer(&image, DATA).unwrap();
    let opts = AttachOptions {
        read_only: false,
        direct_io,
        tag: format!("fcsi-test-inflight-{round}"),
        size_limit: DATA,
        logical_block_size: 0,
    };
    // Nodes attach through a gate; the race control attaches straight onto
    // the image, as before gates, where the fence's settle is all there is.
    let lo = if gated {
        loop_gate::attach_gated(&image, &opts).unwrap()
    } else {
        loop_device::attach(&image, &opts).unwrap()
    };
    let done = Arc::new(AtomicUsize::new(0));
    let mut writers = Writers::start(&lo.device, round, quota, &done);
    // Writes reach the data first (the positive control), then the fence
    // comes at a random moment.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while done.load(Ordering::Relaxed) < WRITERS {
        assert!(
            std::time::Instant::now() < deadline,
            "round {round}: no writes within 20 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(delay_ms));
    let fenced = fence::freeze(&image, DATA, settle);
    let returned = monotonic_ns();
    // The writers go on for a while against the fenced device.
    std::thread::sleep(after);
    let logs = writers.stop();
    let report = fenced.unwrap_or_else(|e| panic!("round {round}: the fence must be made: {e}"));
    assert_eq!(report.fenced.len(), 1, "round {round}: one holder fenced");
    let data = std::fs::File::open(&image).unwrap();
    let in_data = |w: &Write| {
        let mut got = [0u8; 16];
        data.read_exact_at(&mut got, w.offset).unwrap();
        got == w.content
    };
    // What the controller's collection would find in the image: data past
    // the window exactly when writes landed there.
    let late = fence::late_write_at(&image, DATA).unwrap();
    let result = RoundResult {
        before_ok: logs.iter().filter(|w| w.ok && w.ended < returned).count(),
        errors_after: logs.iter().filter(|w| !w.ok && w.ended > returned).count(),
        // Any write reported done whose block does not hold it (no thread
        // writes a block twice in a round: `write_blocks` checks).
        lost: logs
            .iter()
            .filter(|w| w.ok && !in_data(w))
            .map(|w| w.offset)
            .collect(),
        begun_after: logs.iter().filter(|w| w.ok && w.started > returned).count(),
        late,
    };
    loop_device::detach(&lo.device).unwrap();
    fence::thaw(&image).unwrap();
    std::fs::remove_file(&image).unwrap();
    let _ = std::fs::remove_file(fence::marker_path(&image));
    result
}

fn inflight(backing: &str) {
    require_root!();
    let rounds: u64 = std::env::var("FENCECSI_INFLIGHT_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let (mut rng, seed) = Rng::from_env("FENCECSI_TORTURE_SEED");
    let outer = Env::new();
    let mnt = fencecsi_tests::backing_fs(&outer, backing, 2 << 30);
    let env = Env::new_in(&mnt);
    // 1 ms of CPU every 5 ms for the writers: often off-CPU mid-submission.
    let Some(quota) = CpuQuota::new(&format!("fcsi-test-inflight-{backing}"), 5000, 1000) else {
        // Unthrottled writers rarely race the fence: the rounds would prove little.
        eprintln!("SKIPPED: fence with writes in flight on {backing}: no cgroup v1 cpu controller at /sys/fs/cgroup/cpu to throttle the writers");
        return;
    };
    let quota = Some(Arc::new(quota));
    eprintln!(
        "fence with writes in flight on {backing}: {rounds} rounds per loop mode, seed {seed}, writers CPU-throttled (1 ms per 5 ms)"
    );
    let mut lost_total = Vec::new();
    for direct_io in [false, true] {
        let (mut before, mut errors, mut late) = (0, 0, 0);
        for r in 0..rounds {
            let round = r + u64::from(direct_io) * rounds;
            let res = one_round(
                &env,
                round,
                true,
                direct_io,
                rng.range(5, 40),
                &quota,
                // A gated device's fence has no settle to give.
                Duration::ZERO,
                Duration::from_millis(150),
            );
            assert!(
                res.before_ok > 0,
                "round {round}: control: writes reached the data before the fence"
            );
            assert_eq!(
                res.begun_after, 0,
                "round {round}: writes that began after the fence returned were acknowledged"
            );
            assert_eq!(
                res.late.is_some(),
                !res.lost.is_empty(),
                "round {round}: data past the window ({:?}) exactly when writes were lost",
                res.late
            );
            before += res.before_ok;
            errors += res.errors_after;
            late += res.lost.len();
            if !res.lost.is_empty() {
                eprintln!(
                    "  round {round} (loop dio={direct_io}): {} writes reported done after the fence are not in the data: offsets {:?}",
                    res.lost.len(),
                    &res.lost[..res.lost.len().min(5)]
                );
                lost_total.extend(res.lost);
            }
        }
        eprintln!(
            "  {backing}, loop dio={direct_io}: {before} writes before the fence, {errors} errors after it, {late} lost"
        );
        assert!(
            errors > 0,
            "control: the writers saw errors after the fence"
        );
    }
    // On ext4 backing the immutable flag makes such late writes fail anyway
    // (ext4 checks it on every write): no race to show there.
    if backing != "ext4" {
        race_control(&env, &mut rng, &quota);
    }
    drop(quota);
    env.assert_clean();
    drop(env);
    drop(outer);
    assert!(
        lost_total.is_empty(),
        "{backing}: {} writes were reported done after the fence returned but are not in the data (seed {seed})",
        lost_total.len()
    );
}

/// Positive control: the same rounds with a zero settle (the window moves
/// into the trailer right after the shrink) do lose writes, so these rounds
/// do put writes in flight across the fence. Stops at the first loss.
fn race_control(env: &Env, rng: &mut Rng, quota: &Option<Arc<CpuQuota>>) {
    // About one round in 20 to 90 loses a write here.
    const MAX_ROUNDS: u64 = 1000;
    for r in 0..MAX_ROUNDS {
        let direct_io = r % 2 == 1;
        let res = one_round(
            env,
            10_000 + r,
            false,
            direct_io,
            rng.range(5, 40),
            quota,
            Duration::ZERO,
            Duration::from_millis(30),
        );
        if !res.lost.is_empty() {
            assert!(
                res.late.is_some(),
                "control: the lost writes of round {r} are seen in the image by fence::late_write_at"
            );
            eprintln!(
                "  control: with no settle, round {r} (loop dio={direct_io}) lost {} writes reported done after the fence",
                res.lost.len()
            );
            return;
        }
    }
    panic!("control: {MAX_ROUNDS} rounds without a settle lost no write: these rounds do not race the fence");
}

#[test]
fn fence_with_writes_in_flight_backing_btrfs() {
    inflight("btrfs");
}

#[test]
fn fence_with_writes_in_flight_backing_xfs() {
    inflight("xfs");
}

#[test]
fn fence_with_writes_in_flight_backing_ext4() {
    inflight("ext4");
}

/// The controller's `--fence-settle` reaches its fences, and only devices
/// without a gate wait for it: with a 3 s settle, a fenced unpublish of a
/// generation that a device attached straight onto the image (as an older
/// driver attached) also holds takes at least that long. A gated device's
/// fence records no settle at all (`FenceReport::settled`), whatever the
/// settle given; a plain device's records the settle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_fence_settle_is_what_it_was_given() {
    require_root!();
    const SETTLE: Duration = Duration::from_secs(3);
    let env = Env::new();
    let took = fenced_unpublish_with_a_plain_holder_takes(&env, SETTLE).await;
    assert!(
        took >= SETTLE,
        "the fence took {took:?}, less than its settle"
    );
    for gated in [true, false] {
        let image = env.path().join(format!("settle-{gated}.img"));
        fencecsi_driver::kernel::files::create_sparse(&image, 1 << 20).unwrap();
        fence::ensure_trailer(&image, 1 << 20).unwrap();
        let opts = AttachOptions {
            read_only: false,
            direct_io: false,
            tag: format!("fcsi-test-settle-{gated}"),
            size_limit: 1 << 20,
            logical_block_size: 0,
        };
        let lo = if gated {
            loop_gate::attach_gated(&image, &opts).unwrap()
        } else {
            loop_device::attach(&image, &opts).unwrap()
        };
        let report = fence::fence_devices(&image, 1 << 20, &|_| true, SETTLE);
        loop_device::detach(&lo.device).unwrap();
        let report = report.unwrap();
        if gated {
            assert_eq!(
                report.settled,
                Duration::ZERO,
                "a gated device's fence settles nothing"
            );
        } else {
            assert!(
                report.settled >= SETTLE,
                "control: a plain device's fence settled {:?}",
                report.settled
            );
        }
    }
    env.assert_clean();
}

/// How long one fenced unpublish takes on a controller with `settle` when a
/// plain device (no gate, attached by the test) also holds the generation.
async fn fenced_unpublish_with_a_plain_holder_takes(env: &Env, settle: Duration) -> Duration {
    use fencecsi_tests::rig::Rig;
    use fencecsi_tests::{block_cap, generation_path, Access};
    let rig = Rig::start_with(env, &["node-a"], |c| c.fence_settle = settle).await;
    let cap = block_cap(Access::SingleNodeWriter);
    let vol = rig.create("settle", 16 << 20, &cap).await;
    let a = rig
        .attach(env, &vol.volume_id, "node-a", "pod-a", &cap)
        .await
        .unwrap();
    let plain = loop_device::attach(
        &generation_path(env, &vol.volume_id, 1),
        &AttachOptions {
            read_only: false,
            direct_io: false,
            tag: "fcsi-test-settle-plain".into(),
            size_limit: 16 << 20,
            logical_block_size: 0,
        },
    )
    .unwrap();
    let start = std::time::Instant::now();
    rig.unpublish(&vol.volume_id, "node-a", true).await.unwrap();
    let took = start.elapsed();
    loop_device::detach(&plain.device).unwrap();
    rig.node_teardown(&a, true).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while let Err(e) = rig.delete(&vol.volume_id).await {
        assert!(std::time::Instant::now() < deadline, "delete: {e:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    rig.stop().await;
    took
}
