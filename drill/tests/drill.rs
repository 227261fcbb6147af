//! The local failover drill, end to end, through the library: embedded cluster, the real
//! driver (controller + two node plugins), attacher and podgc on real loop devices.
//! Also issue 5's end-to-end test.

use std::path::Path;
use std::time::Duration;

use fencecsi_drill::{Options, Progress, Report, Step};

fn opts(volumes: usize, fs: &str) -> Options {
    let mut o = Options::new(env!("CARGO_BIN_EXE_fencecsi-drill").into());
    o.volumes = volumes;
    o.fs = fs.into();
    o.step_timeout = Duration::from_secs(45);
    // A failover that waits on the attach-detach controller's verification would time
    // out: the figures must come from podgc telling the controller, not from the clock.
    o.adc_sync_period = Duration::from_secs(3600);
    o.progress = Progress::new(|s| eprintln!("{s}"));
    o
}

/// Loop devices and mounts anywhere below `dir` (the run's temp dir, gone by now).
fn leftovers(dir: &str) -> (Vec<String>, Vec<String>) {
    let mut loops = vec![];
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            if Path::new(b.trim().trim_end_matches(" (deleted)")).starts_with(dir) {
                loops.push(e.file_name().to_string_lossy().to_string());
            }
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| {
            l.split(' ')
                .nth(4)
                .is_some_and(|m| Path::new(m).starts_with(dir))
        })
        .map(str::to_string)
        .collect();
    (loops, mounts)
}

fn check(r: &Report) {
    assert!(r.ok, "drill failed: {:?}", r.failures);
    assert_eq!(r.records_lost, 0);
    assert_eq!(r.bytes_after_fence, 0);
    assert!(r.quarantine_lifted);
    use Step::*;
    let t = |s: Step| {
        r.time_of(s)
            .unwrap_or_else(|| panic!("step {s:?} missing: {:?}", r.timeline))
    };
    // podgc acts on the stale Lease, so NotReady (the node lifecycle controller's) may
    // come before or after the quarantine; it is not in the chain.
    // Quarantined and ForceDeleted come from two watch streams (Node, Pod) written in
    // the same pass microseconds apart; their delivery order says nothing. That podgc
    // writes the quarantine before the delete is checked by resourceVersion in
    // podgc/tests/podgc.rs. Here each must follow the shutdown and precede the detach.
    assert!(t(NodeDown) <= t(Quarantined) && t(Quarantined) <= t(AttachmentDeleted));
    let chain = [
        WritersAcked,
        NodeDown,
        ForceDeleted,
        AttachmentDeleted,
        AttachedOnB,
        PublishedOnB,
        RecordsVerified,
        NodeBack,
        NodeCleaned,
        QuarantineLifted,
    ];
    for w in chain.windows(2) {
        assert!(
            t(w[0]) <= t(w[1]),
            "{:?} after {:?}: {:?}",
            w[0],
            w[1],
            r.timeline
        );
    }
    // The fence happens between the delete of the old attachment's pod and the attach on B.
    assert!(
        t(ForceDeleted) <= t(Fenced) && t(Fenced) <= t(AttachedOnB),
        "{:?}",
        r.timeline
    );
    assert!(t(ForceDeleted) <= t(PodRecreated) && t(PodRecreated) <= t(PublishedOnB));
    assert!(t(NodeDown) <= t(NotReady));
    assert!(r.power_off_to_published_s.unwrap() > 0.0);
    assert_eq!(r.per_volume.len(), r.volumes);
    for v in &r.per_volume {
        assert_ne!(v.old_uid, v.new_uid, "re-created pod has a new UID");
        assert_eq!(v.new_node, "node-b");
        assert!(v.new_generation > v.old_generation, "{v:?}");
        assert!(v.fenced_generation_immutable, "{v:?}");
        assert!(v.acked_on_a >= 19, "{v:?}");
        assert!(v.lost.is_empty(), "{v:?}");
        assert!(
            v.acked_on_b > v.acked_on_a,
            "B resumed after A's records: {v:?}"
        );
    }
    let c = r.comparison.as_ref().unwrap();
    assert_eq!(c.kubernetes_deployment_s, 700.0);
    assert!(c.ratio > 1.0);
    assert_eq!(
        (r.leftover_mounts, r.leftover_loop_devices, r.writers_left),
        (0, 0, 0)
    );
    let (loops, mounts) = leftovers(&r.env_dir);
    assert!(
        loops.is_empty() && mounts.is_empty(),
        "{loops:?} {mounts:?}"
    );
    assert!(!Path::new(&r.env_dir).exists(), "temp dir removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ext4_two_volumes_fail_over_without_loss_and_an_unsafe_pod_stays() {
    fencecsi_tests::require_root!();
    let mut o = opts(2, "ext4");
    o.unsafe_pod = true;
    let r = fencecsi_drill::run(o, std::future::pending())
        .await
        .unwrap();
    r.print(&Progress::new(|s| eprintln!("{s}")));
    check(&r);
    let u = r.unsafe_pod.as_ref().unwrap();
    assert!(
        u.untouched && u.attachment_kept && u.no_out_of_service_taint,
        "a pod of a driver without safe-detach, and its volume, are left alone: {u:?}"
    );
    let note = u
        .warning_event
        .as_deref()
        .expect("OutOfServiceTaintWithheld Warning event");
    assert!(note.contains("other.example.com"), "{note}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn xfs_one_volume_fails_over_without_loss() {
    fencecsi_tests::require_root!();
    let r = fencecsi_drill::run(opts(1, "xfs"), std::future::pending())
        .await
        .unwrap();
    r.print(&Progress::new(|s| eprintln!("{s}")));
    check(&r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_interrupted_drill_leaves_nothing_behind() {
    fencecsi_tests::require_root!();
    // Interrupt while node A is down and its writer is still writing (mounts, loop
    // devices and a fenced generation in place).
    let dir = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let d = dir.clone();
    let down = std::sync::Arc::new(tokio::sync::Notify::new());
    let n = down.clone();
    let mut o = opts(1, "ext4");
    o.progress = Progress::new(move |s| {
        eprintln!("{s}");
        if let Some(rest) = s.split("everything under ").nth(1) {
            *d.lock().unwrap() = rest.trim().to_string();
        }
        if s.contains("STEP Fenced") {
            n.notify_one();
        }
    });
    let err = fencecsi_drill::run(o, async move { down.notified().await })
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "interrupted");
    let dir = dir.lock().unwrap().clone();
    assert!(!dir.is_empty());
    let (loops, mounts) = leftovers(&dir);
    assert!(
        loops.is_empty() && mounts.is_empty(),
        "{loops:?} {mounts:?}"
    );
    assert!(!Path::new(&dir).exists());
}
