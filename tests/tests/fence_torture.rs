//! The fence under fire. A writer process appends numbered, checksummed,
//! fsync'ed records on node A; at a random moment the controller fences node
//! A. Every run must show:
//! - the writer gets errors after the fence;
//! - the fenced generation's bytes do not change after the fence RPC
//!   returned (hashed at once and again after the writer kept going);
//! - the volume published on node B (a new generation) mounts cleanly and
//!   holds every record whose fsync succeeded, intact.
//!
//! Runs per mode: FENCECSI_TORTURE_RUNS (default 30). Seed: FENCECSI_TORTURE_SEED.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencecsi_tests::records::{missing, RECORD_SIZE};
use fencecsi_tests::rig::{Rig, Rng};
use fencecsi_tests::{
    block_cap, generation_path, mount_cap, require_root, sparse_hash, Access, Env,
};

/// Acknowledged records and errors, as the writer reports them.
#[derive(Default)]
struct WriterLog {
    acked: AtomicU64,
    errors: Mutex<Vec<(u64, i32, Instant)>>,
}

struct Writer {
    child: std::process::Child,
    log: Arc<WriterLog>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn start(path: &std::path::Path, direct: bool) -> Writer {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_fencecsi-writer"));
        cmd.arg(path)
            .args(["--max-errors", "1000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if direct {
            cmd.arg("--direct");
        }
        let mut child = cmd.spawn().expect("spawning the writer");
        let out = child.stdout.take().unwrap();
        let log = Arc::new(WriterLog::default());
        let l = log.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let mut parts = line.split_whitespace();
                match (
                    parts.next(),
                    parts.next().and_then(|s| s.parse::<u64>().ok()),
                ) {
                    (Some("ok"), Some(seq)) => l.acked.store(seq + 1, Ordering::SeqCst),
                    (Some("err"), Some(seq)) => {
                        let errno = parts.next().and_then(|s| s.parse().ok()).unwrap_or(0);
                        l.errors.lock().unwrap().push((seq, errno, Instant::now()));
                    }
                    _ => {}
                }
            }
        });
        Writer {
            child,
            log,
            reader: Some(reader),
        }
    }

    fn acked(&self) -> u64 {
        self.log.acked.load(Ordering::SeqCst)
    }

    /// Kills the writer and returns (records acknowledged, errors seen).
    fn stop(mut self) -> (u64, Vec<(u64, i32, Instant)>) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        (self.acked(), self.log.errors.lock().unwrap().clone())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn torture(mode: &str) {
    require_root!();
    fencecsi_tests::init_tracing();
    let runs: u64 = std::env::var("FENCECSI_TORTURE_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let (mut rng, seed) = Rng::from_env("FENCECSI_TORTURE_SEED");
    eprintln!("fence torture {mode}: {runs} runs, seed {seed}");
    let env = Env::new();
    // Half the runs on buffered loop devices (the default), half with the
    // loop devices doing direct I/O to the image: the fence must hold in both.
    let mut loop_dio = false;
    let mut rig = Rig::start_with(&env, &["node-a", "node-b"], |c| c.direct_io = false).await;
    let (cap, size) = match mode {
        "block" => (block_cap(Access::SingleNodeWriter), 64 << 20),
        "xfs" => (mount_cap(Access::SingleNodeWriter, "xfs"), 300 << 20),
        fs => (mount_cap(Access::SingleNodeWriter, fs), 64 << 20),
    };
    let mut fence_ms = Vec::new();
    for run in 0..runs {
        if run == runs / 2 {
            rig.stop().await;
            loop_dio = true;
            rig = Rig::start_with(&env, &["node-a", "node-b"], |c| c.direct_io = true).await;
        }
        let vol = rig
            .create(&format!("torture-{mode}-{run}"), size, &cap)
            .await;
        let a = rig
            .attach(
                &env,
                &vol.volume_id,
                "node-a",
                &format!("pod-a-{run}"),
                &cap,
            )
            .await
            .expect("attach on node A");
        let path = if mode == "block" {
            a.target.clone()
        } else {
            a.target.join("records.log")
        };
        let direct = rng.next() % 2 == 0;
        let writer = Writer::start(&path, direct);
        let warmup = rng.range(3, 40);
        wait_until(
            "the writer's first records",
            Duration::from_secs(20),
            || writer.acked() >= warmup,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rng.range(0, 150))).await;

        let t = Instant::now();
        rig.unpublish(&vol.volume_id, "node-a", true)
            .await
            .expect("fence must succeed on this backend");
        fence_ms.push(t.elapsed().as_secs_f64() * 1e3);
        let fenced = generation_path(&env, &vol.volume_id, a.generation());
        let at_fence = sparse_hash(&fenced);
        assert!(
            fencecsi_driver::fsops::is_immutable(&fenced).unwrap(),
            "run {run}: fenced generation must carry the immutable flag"
        );

        // The writer keeps going on node A; it must start failing, and the
        // fenced bytes must not move.
        let fence_returned = Instant::now();
        wait_until(
            "the writer to see an error after the fence",
            Duration::from_secs(20),
            || {
                writer
                    .log
                    .errors
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|(_, _, at)| *at >= fence_returned)
                    || writer.child.id() == 0
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rng.range(100, 400))).await;
        let (acked, errors) = writer.stop();
        assert_eq!(sparse_hash(&fenced), at_fence, "run {run} ({mode}, direct={direct}, loop dio={loop_dio}, seed {seed}): fenced generation changed after the fence returned");
        assert!(
            !errors.is_empty(),
            "run {run}: the writer saw no error after the fence"
        );

        if run == 0 {
            // Quarantine: node A still holds the fenced generation, so it cannot have the volume back yet.
            let again = rig
                .attach(&env, &vol.volume_id, "node-a", "pod-a-again", &cap)
                .await
                .unwrap_err();
            assert_eq!(again.code(), tonic::Code::FailedPrecondition, "{again:?}");
        }

        let b = rig
            .attach(
                &env,
                &vol.volume_id,
                "node-b",
                &format!("pod-b-{run}"),
                &cap,
            )
            .await
            .expect("the volume must attach and mount on node B");
        assert!(
            b.generation() > a.generation(),
            "node B must get a new generation"
        );
        let data = if mode == "block" {
            let mut buf = vec![0u8; acked as usize * RECORD_SIZE];
            use std::os::unix::fs::FileExt;
            std::fs::File::open(&b.target)
                .unwrap()
                .read_exact_at(&mut buf, 0)
                .unwrap();
            buf
        } else {
            std::fs::read(b.target.join("records.log")).unwrap_or_default()
        };
        if acked > 0 {
            let lost = missing(&data, acked - 1);
            assert!(lost.is_empty(), "run {run} ({mode}, direct={direct}, loop dio={loop_dio}, seed {seed}): {} of {acked} acknowledged records missing or damaged on node B: {:?}", lost.len(), &lost[..lost.len().min(10)]);
        }

        // Node A returns: force teardown of the fenced attachment; node B detaches normally.
        rig.node_teardown(&a, true)
            .await
            .expect("force teardown on node A");
        rig.node_teardown(&b, false)
            .await
            .expect("teardown on node B");
        rig.unpublish(&vol.volume_id, "node-b", false)
            .await
            .unwrap();
        rig.delete(&vol.volume_id)
            .await
            .expect("delete after cleanup");
        env.assert_clean();
        eprintln!("  run {run:>2}: {acked:>5} records acknowledged, {:>4} errors after fence, fence {:.1} ms, writer O_DIRECT={direct}, loop dio={loop_dio}", errors.len(), fence_ms.last().unwrap());
    }
    fence_ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    eprintln!(
        "fence torture {mode}: {runs} runs ok; fence latency p50 {:.1} ms, max {:.1} ms",
        fence_ms[fence_ms.len() / 2],
        fence_ms.last().unwrap()
    );
    rig.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_torture_ext4() {
    torture("ext4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_torture_xfs() {
    torture("xfs").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_torture_block() {
    torture("block").await;
}
