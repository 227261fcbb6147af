//! FORCE_UNPUBLISH: NodeUnpublishVolume / NodeUnstageVolume with force=true
//! tear down busy, fenced (EIO) and stale mounts; without force a busy
//! volume is FAILED_PRECONDITION and nothing changes. Every case ends with no
//! mount, no loop device and no directory, and a repeated call succeeds.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use fencecsi_driver::kernel::mounts::{self, PathState};
use fencecsi_tests::rig::{Placement, Rig};
use fencecsi_tests::{csi, mount_cap, require_root, Access, Env};
use tonic::Code;

/// Processes that keep a mount busy: one with an open file, one with its
/// working directory inside. Killed on drop.
struct Holders(Vec<Child>);

impl Holders {
    fn on(dir: &std::path::Path) -> Holders {
        std::fs::write(dir.join("held.txt"), b"held").unwrap();
        let open_file = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "exec 3<'{}/held.txt'; exec sleep 600",
                dir.display()
            ))
            .spawn()
            .unwrap();
        // Its working directory is set before spawn returns (before the exec).
        let cwd = Command::new("sleep")
            .arg("600")
            .current_dir(dir)
            .spawn()
            .unwrap();
        // The shell opens the file after its exec: wait until the kernel shows it open.
        let fd = format!("/proc/{}/fd/3", open_file.id());
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::fs::read_link(&fd).is_ok_and(|t| t.ends_with("held.txt")) {
            assert!(
                Instant::now() < deadline,
                "the holder never opened the file"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        Holders(vec![open_file, cwd])
    }
}

impl Drop for Holders {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn unpublish(rig: &Rig, p: &Placement, force: bool) -> Result<(), tonic::Status> {
    rig.node(&p.node)
        .node
        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: p.volume_id.clone(),
            target_path: p.target.to_string_lossy().into(),
            force,
        })
        .await
        .map(|_| ())
}

async fn unstage(rig: &Rig, p: &Placement, force: bool) -> Result<(), tonic::Status> {
    rig.node(&p.node)
        .node
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: p.volume_id.clone(),
            staging_target_path: p.staging.to_string_lossy().into(),
            force,
        })
        .await
        .map(|_| ())
}

/// After a force teardown: the loop device goes once its last user is gone.
async fn assert_clean_soon(env: &Env, p: &Placement) {
    // A bound on liveness only.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !env.loops().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.assert_clean();
    assert!(!p.target.exists(), "target dir removed");
    assert!(!p.staging.exists(), "staging dir removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_volume_needs_force_and_force_tears_it_down() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let rig = Rig::start(&env, &["node-a"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("busy", 64 << 20, &cap).await;
    let p = rig
        .attach(&env, &vol.volume_id, "node-a", "pod", &cap)
        .await
        .unwrap();
    let holders = Holders::on(&p.target);

    // Without force: refused, and nothing changed.
    let err = unpublish(&rig, &p, false).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(mounts::is_mountpoint(&p.target).unwrap(), "still published");
    let err = unstage(&rig, &p, false).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(mounts::is_mountpoint(&p.staging).unwrap(), "still staged");
    assert_eq!(std::fs::read(p.target.join("held.txt")).unwrap(), b"held");

    // With force: torn down while the holders still run.
    unpublish(&rig, &p, true).await.unwrap();
    unstage(&rig, &p, true).await.unwrap();
    assert!(
        !mounts::is_mountpoint(&p.target).unwrap() && !mounts::is_mountpoint(&p.staging).unwrap()
    );
    unpublish(&rig, &p, true)
        .await
        .expect("repeated force unpublish succeeds");
    unstage(&rig, &p, true)
        .await
        .expect("repeated force unstage succeeds");
    drop(holders);
    assert_clean_soon(&env, &p).await;

    // The data written before is intact for the next user.
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .unwrap();
    let p2 = rig
        .attach(&env, &vol.volume_id, "node-a", "pod2", &cap)
        .await
        .unwrap();
    assert_eq!(std::fs::read(p2.target.join("held.txt")).unwrap(), b"held");
    rig.node_teardown(&p2, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .unwrap();
    rig.delete(&vol.volume_id).await.unwrap();
    rig.stop().await;
    env.assert_clean();
}

/// Fences a published volume, then force-tears it down on the fenced node.
async fn fenced_teardown(fs: &str, expect_stale: bool) {
    let env = Env::new();
    let rig = Rig::start(&env, &["node-a"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, fs);
    let size = if fs == "xfs" { 300 << 20 } else { 64 << 20 };
    let vol = rig.create(&format!("fenced-{fs}"), size, &cap).await;
    let p = rig
        .attach(&env, &vol.volume_id, "node-a", "pod", &cap)
        .await
        .unwrap();
    // Only what was synced before the fence is promised to survive it.
    std::fs::write(p.target.join("before.txt"), b"before the fence").unwrap();
    std::fs::File::open(p.target.join("before.txt"))
        .unwrap()
        .sync_all()
        .unwrap();
    std::fs::File::open(&p.target).unwrap().sync_all().unwrap();
    rig.unpublish(&vol.volume_id, "node-a", true)
        .await
        .expect("fence");

    // Writes through the fenced attachment fail, and the filesystem gives up.
    let write = std::fs::write(p.target.join("after.txt"), vec![7u8; 1 << 20])
        .and_then(|_| std::fs::File::open(p.target.join("after.txt"))?.sync_all());
    assert!(write.is_err(), "a synced write after the fence must fail");
    if expect_stale {
        // A failed data write alone does not shut xfs down; a metadata change
        // forced to the log does (its log write fails).
        let _ = std::fs::create_dir(p.target.join("after-dir"));
        if let Ok(d) = std::fs::File::open(&p.target) {
            let _ = nix::unistd::syncfs(&d);
        }
        // A shut-down xfs answers even stat() on its root with EIO.
        // A bound on liveness only.
        let deadline = Instant::now() + Duration::from_secs(60);
        while !matches!(mounts::path_state(&p.target), PathState::Stale(_)) {
            assert!(
                Instant::now() < deadline,
                "xfs mountpoint never went stale: {:?}",
                mounts::path_state(&p.target)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Staging a fenced generation again is refused.
    let restage = rig
        .node("node-a")
        .node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            publish_context: p.publish_context.clone(),
            staging_target_path: env
                .staging_path("node-a", "elsewhere")
                .to_string_lossy()
                .into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(restage.code(), Code::FailedPrecondition, "{restage:?}");

    unpublish(&rig, &p, true).await.unwrap();
    unstage(&rig, &p, true).await.unwrap();
    unpublish(&rig, &p, true)
        .await
        .expect("repeated force unpublish");
    unstage(&rig, &p, true)
        .await
        .expect("repeated force unstage");
    assert_clean_soon(&env, &p).await;

    // Released: the node may have the volume again, on a new generation, with the pre-fence data.
    let p2 = rig
        .attach(&env, &vol.volume_id, "node-a", "pod2", &cap)
        .await
        .expect("publish after the node cleaned up");
    assert!(p2.generation() > p.generation());
    assert_eq!(
        std::fs::read(p2.target.join("before.txt")).unwrap(),
        b"before the fence"
    );
    rig.node_teardown(&p2, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .unwrap();
    rig.delete(&vol.volume_id).await.unwrap();
    rig.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_ext4_is_torn_down_by_force() {
    require_root!();
    fencecsi_tests::init_tracing();
    fenced_teardown("ext4", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_xfs_mountpoint_is_torn_down_by_force() {
    require_root!();
    fencecsi_tests::init_tracing();
    fenced_teardown("xfs", true).await;
}
