//! Node recovery and a state dir that looks wrong, with real loop devices and mounts.
//!
//! Recovery acts on what the state dir's metadata says, so a wrong state dir (missing, an
//! empty one a `DirectoryOrCreate` hostPath made, another machine's) must stop it before it
//! touches anything: live volumes keep their mounts, loop devices and data, Probe answers
//! not ready, the node is not reported clean. Each refusal has a positive control: the same
//! recovery with the right state dir does release a fenced volume.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fencecsi_driver::config::{Config, Mode};
use fencecsi_driver::node::recover::PassReport;
use fencecsi_tests::recovering::RecoveringNode;
use fencecsi_tests::rig::{Placement, Rig};
use fencecsi_tests::{csi, generation_path, mount_cap, require_root, Access, Env, InProcess};

fn cap() -> csi::VolumeCapability {
    mount_cap(Access::SingleNodeWriter, "ext4")
}

/// node-a's configuration: recovery passes at start and on demand only.
fn node_cfg(env: &Env, generation: u32, state_dir: Option<PathBuf>) -> Config {
    let mut cfg = env.config(Mode::Node, Some("node-a"), &format!("node-a-{generation}"));
    cfg.recover_interval = Duration::ZERO;
    if let Some(d) = state_dir {
        cfg.state_dir = d;
    }
    cfg
}

/// Writes 1 MiB of data through the published target, fsynced; returns its sha256.
fn write_data(p: &Placement, seed: u8) -> String {
    use std::io::Write;
    let data: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8 ^ seed)
        .collect();
    let mut f = std::fs::File::create(p.target.join("data")).unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    fencecsi_tests::sha256_file(&p.target.join("data"))
}

/// Loop devices attached to a generation's image.
fn loops_on(env: &Env, vol: &str, gen: u64) -> Vec<PathBuf> {
    let img = generation_path(env, vol, gen);
    let mut out = vec![];
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            if Path::new(b.trim().trim_end_matches(" (deleted)")) == img {
                out.push(e.path());
            }
        }
    }
    out
}

fn is_mount(p: &Path) -> bool {
    fencecsi_driver::kernel::mounts::is_mountpoint(p).unwrap()
}

/// The volume is still staged, published and attached on node-a.
fn assert_in_place(env: &Env, p: &Placement, what: &str) {
    assert!(is_mount(&p.target), "{what}: target unmounted");
    assert!(is_mount(&p.staging), "{what}: staging unmounted");
    assert_eq!(
        loops_on(env, &p.volume_id, p.generation()).len(),
        1,
        "{what}: loop device detached"
    );
}

fn assert_released(env: &Env, p: &Placement) {
    assert!(!p.target.exists(), "target {} left", p.target.display());
    assert!(
        !p.staging.exists(),
        "globalmount {} left",
        p.staging.display()
    );
    assert_eq!(
        loops_on(env, &p.volume_id, p.generation()),
        Vec::<PathBuf>::new(),
        "loop devices left on the fenced generation"
    );
}

/// The report of the pass a plugin runs at start.
async fn first_pass(n: &RecoveringNode) -> PassReport {
    let mut rx = n.recovery.subscribe();
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            if let Some(r) = rx.borrow_and_update().as_ref() {
                return r.clone();
            }
            rx.changed().await.unwrap();
        }
    })
    .await
    .expect("the pass at start in time")
}

/// A controller, and node-a (recovering) with two volumes in use on it, `pv-{kept}` and
/// `pv-fenced`, each with 1 MiB of data (`seed`, `seed + 1`): the rig, node-a, the kept
/// volume's placement and data hash, and the other's placement.
async fn two_volumes_on_node_a(
    env: &Env,
    kept: &str,
    seed: u8,
) -> (Rig, RecoveringNode, Placement, String, Placement) {
    fencecsi_tests::init_tracing();
    let mut rig = Rig::start(env, &[]).await;
    let a = RecoveringNode::start(node_cfg(env, 1, None)).await;
    rig.nodes.insert("node-a".into(), a.client.clone());
    let kept_id = rig
        .create(&format!("pv-{kept}"), 64 << 20, &cap())
        .await
        .volume_id;
    let fenced_id = rig.create("pv-fenced", 64 << 20, &cap()).await.volume_id;
    let kept = rig
        .attach(env, &kept_id, "node-a", &format!("pod-{kept}"), &cap())
        .await
        .unwrap();
    let fenced = rig
        .attach(env, &fenced_id, "node-a", "pod-fenced", &cap())
        .await
        .unwrap();
    let kept_sum = write_data(&kept, seed);
    write_data(&fenced, seed + 1);
    (rig, a, kept, kept_sum, fenced)
}

/// Detaches `kept` from node-a, stops node-a, deletes both volumes, stops the rig and
/// checks that nothing of `env` is left mounted or attached.
async fn finish(env: &Env, rig: Rig, a: RecoveringNode, kept: &Placement, fenced_id: &str) {
    rig.detach(kept).await.unwrap();
    a.stop().await;
    rig.delete_once_free(&kept.volume_id).await;
    rig.delete_once_free(fenced_id).await;
    rig.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_refuses_a_wrong_state_dir_and_acts_on_the_right_one() {
    require_root!();
    let env = Env::new();
    let (mut rig, a, live, live_sum, fenced) = two_volumes_on_node_a(&env, "live", 1).await;
    let fenced_id = fenced.volume_id.clone();
    let r = a.recovery.run_now().await;
    assert!(
        r.clean && r.refused.is_none() && r.released.is_empty(),
        "{r:?}"
    );
    assert_eq!(a.ready().await, Some(true));
    // node-a goes away; meanwhile one of its volumes is fenced away from it.
    a.stop().await;
    rig.unpublish(&fenced_id, "node-a", true).await.unwrap();

    // It comes back with a wrong state dir: missing, empty (what a DirectoryOrCreate
    // hostPath makes of an unmounted disk), or another one with an identity of its own.
    let other = env.path().join("other-state");
    {
        let mut cfg = env.config(Mode::Controller, None, "other-controller");
        cfg.state_dir = other.clone();
        let (c, _) = InProcess::start(cfg).await;
        c.stop().await;
    }
    let empty = env.path().join("empty-state");
    std::fs::create_dir(&empty).unwrap();
    let cases = [
        (env.path().join("missing-state"), "has no identity file"),
        (empty, "has no identity file"),
        (
            other,
            "but this node's volumes live in the state dir with identity",
        ),
    ];
    for (generation, (dir, why)) in (2..).zip(cases) {
        let what = format!("state dir {}", dir.display());
        let a = RecoveringNode::start(node_cfg(&env, generation, Some(dir))).await;
        for r in [first_pass(&a).await, a.recovery.run_now().await] {
            assert!(
                r.refused.as_deref().is_some_and(|w| w.contains(why)),
                "{what}: {r:?}"
            );
            assert!(
                !r.clean && r.released.is_empty() && r.reported.is_none(),
                "{what}: {r:?}"
            );
        }
        assert_eq!(a.ready().await, Some(false), "{what}: Probe");
        assert!(
            a.reporter.calls.lock().unwrap().is_empty(),
            "{what}: reported clean"
        );
        assert_in_place(&env, &live, &what);
        assert_in_place(&env, &fenced, &what);
        assert_eq!(
            fencecsi_tests::sha256_file(&live.target.join("data")),
            live_sum,
            "{what}"
        );
        a.stop().await;
    }

    // Positive control: with the right state dir the same recovery releases the fenced
    // volume, and only that one.
    let a = RecoveringNode::start(node_cfg(&env, 9, None)).await;
    rig.nodes.insert("node-a".into(), a.client.clone());
    let r = first_pass(&a).await;
    assert!(r.refused.is_none() && r.clean, "{r:?}");
    assert_eq!(
        r.released
            .iter()
            .map(|x| x.volume_id.as_str())
            .collect::<Vec<_>>(),
        [fenced_id.as_str()],
        "{r:?}"
    );
    assert_released(&env, &fenced);
    assert_in_place(&env, &live, "right state dir");
    assert_eq!(
        fencecsi_tests::sha256_file(&live.target.join("data")),
        live_sum
    );
    assert_eq!(a.ready().await, Some(true));
    assert!(!a.reporter.calls.lock().unwrap().is_empty());

    finish(&env, rig, a, &live, &fenced_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_without_metadata_keeps_its_mount() {
    require_root!();
    let env = Env::new();
    let (rig, a, kept, kept_sum, fenced) = two_volumes_on_node_a(&env, "kept", 3).await;
    let (kept_id, fenced_id) = (kept.volume_id.clone(), fenced.volume_id.clone());
    rig.unpublish(&fenced_id, "node-a", true).await.unwrap();

    // The kept volume's record goes missing (the state dir itself is the right one).
    let record = env
        .state_dir()
        .join("volumes")
        .join(&kept_id)
        .join("volume.json");
    let aside = env.path().join("kept-volume.json");
    std::fs::rename(&record, &aside).unwrap();
    for pass in 1..=2 {
        let r = a.recovery.run_now().await;
        assert!(r.refused.is_none(), "pass {pass}: {r:?}");
        assert!(
            r.pending
                .get(&kept_id)
                .is_some_and(|w| w.contains("no metadata")),
            "pass {pass}: {r:?}"
        );
        assert!(!r.clean, "not clean while it is unexplained: {r:?}");
        assert!(
            r.released.iter().all(|x| x.volume_id != kept_id),
            "pass {pass}: {r:?}"
        );
        if pass == 1 {
            // Positive control, in the same pass: the fenced volume is released.
            assert_eq!(r.released.len(), 1, "{r:?}");
            assert_eq!(r.released[0].volume_id, fenced_id);
        }
        assert_in_place(&env, &kept, "kept");
        assert_eq!(
            fencecsi_tests::sha256_file(&kept.target.join("data")),
            kept_sum
        );
    }
    assert_released(&env, &fenced);

    // The record is back: clean, and the volume is still in place.
    std::fs::rename(&aside, &record).unwrap();
    let r = a.recovery.run_now().await;
    assert!(
        r.clean && r.released.is_empty() && r.pending.is_empty(),
        "{r:?}"
    );
    assert_in_place(&env, &kept, "record restored");

    finish(&env, rig, a, &kept, &fenced_id).await;
}
