//! The fence's bookkeeping: a fence that cannot be made is refused and
//! changes nothing; fenced generations, quarantines and holders survive a
//! controller restart; a fenced generation is deleted once nothing holds it.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fencecsi_driver::config::Mode;
use fencecsi_tests::rig::Rig;
use fencecsi_tests::{csi, generation_path, mount_cap, require_root, wait_for_socket, Access, Env};
use tonic::Code;

async fn volume_status(rig: &Rig, vol: &str) -> csi::controller_get_volume_response::VolumeStatus {
    rig.controller
        .clone()
        .controller
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: vol.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap()
}

/// A controller plugin in its own process (`cmd`, already pointed at the
/// driver binary), a node plugin in this one, and one ext4 volume published
/// to node-a and staged there.
struct Staged {
    child: std::process::Child,
    ctl: fencecsi_proto::client::CsiClient,
    node_plugin: fencecsi_tests::InProcess,
    node: fencecsi_proto::client::CsiClient,
    volume_id: String,
    staging: std::path::PathBuf,
}

async fn stage_with(env: &Env, mut cmd: Command) -> Staged {
    let cfg = env.config(Mode::Controller, None, "weak-controller");
    let child = cmd
        .args(["--mode", "controller", "--endpoint", &cfg.endpoint])
        .arg("--state-dir")
        .arg(&cfg.state_dir)
        .stdin(Stdio::null())
        .spawn()
        .expect("the driver runs");
    let mut ctl = wait_for_socket(&cfg.socket_path().unwrap()).await;
    let (node_plugin, mut node) =
        fencecsi_tests::InProcess::start(env.config(Mode::Node, Some("node-a"), "node-a")).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = ctl
        .controller
        .create_volume(csi::CreateVolumeRequest {
            name: "weak".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 64 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
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
    let staging = env.staging_path("node-a", &vol.volume_id);
    node.node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            publish_context: ctx,
            staging_target_path: staging.to_string_lossy().into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap();

    Staged {
        child,
        ctl,
        node_plugin,
        node,
        volume_id: vol.volume_id,
        staging,
    }
}

impl Staged {
    /// Unstages (with `force` after a fence), unpublishes, deletes, stops.
    async fn finish(mut self, env: &Env, force: bool) {
        self.node
            .node
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: self.volume_id.clone(),
                staging_target_path: self.staging.to_string_lossy().into(),
                force,
            })
            .await
            .unwrap();
        self.ctl
            .controller
            .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                volume_id: self.volume_id.clone(),
                node_id: "node-a".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        self.ctl
            .controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: self.volume_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.node_plugin.stop().await;
        env.assert_clean();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_fence_probe_claims_no_fence_and_changes_nothing() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    // A controller whose start-up probe could not prove the fence on its
    // state dir (simulated by a failpoint) must not advertise it, must
    // refuse a fence request saying why, and must change nothing.
    let mut cmd = Command::new(fencecsi_tests::rig::fresh_driver_binary());
    cmd.env(fencecsi_driver::failpoint::ENV, "fence-probe:fail");
    let mut w = stage_with(&env, cmd).await;
    let mut ask = tonic::Request::new(csi::ControllerGetCapabilitiesRequest {});
    ask.metadata_mut()
        .insert("x-fencecsi-extensions", "1".parse().unwrap());
    let caps = w
        .ctl
        .controller
        .controller_get_capabilities(ask)
        .await
        .unwrap()
        .into_inner();
    assert!(
        !format!("{caps:?}").contains("UnpublishFence") && !format!("{caps:?}").contains("1000"),
        "a fence the probe could not prove is not advertised: {caps:?}"
    );
    let err = w
        .ctl
        .controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: w.volume_id.clone(),
            node_id: "node-a".into(),
            fence: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("probe"),
        "the message says why: {}",
        err.message()
    );
    // Nothing changed: still published, generation not frozen, writes still land.
    let status = w
        .ctl
        .controller
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: w.volume_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap();
    assert_eq!(status.published_node_ids, vec!["node-a".to_string()]);
    assert!(
        !fencecsi_driver::kernel::files::is_immutable(&generation_path(&env, &w.volume_id, 1))
            .unwrap()
    );
    std::fs::write(w.staging.join("still-writable"), b"yes").unwrap();
    std::fs::File::open(w.staging.join("still-writable"))
        .unwrap()
        .sync_all()
        .expect("the attachment is intact");

    w.finish(&env, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_without_immutable_capability_still_holds() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    // A controller that lacks CAP_LINUX_IMMUTABLE (as in a container that
    // dropped it) cannot set the flag, the second layer; the remap alone
    // must still fence: no write reaches the data after the RPC.
    let mut cmd = Command::new("setpriv");
    cmd.args(["--bounding-set", "-linux_immutable", "--"])
        .arg(fencecsi_tests::driver_binary());
    let mut w = stage_with(&env, cmd).await;
    // Positive control: before the fence, writes reach the image.
    let image = generation_path(&env, &w.volume_id, 1);
    let data = 64u64 << 20;
    let before = fencecsi_tests::region_hash(&image, data);
    std::fs::write(w.staging.join("before"), vec![7u8; 1 << 20]).unwrap();
    std::fs::File::open(w.staging.join("before"))
        .unwrap()
        .sync_all()
        .unwrap();
    let changed = fencecsi_tests::region_hash(&image, data);
    assert_ne!(
        before, changed,
        "control: a write before the fence changes the data"
    );
    w.ctl
        .controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: w.volume_id.clone(),
            node_id: "node-a".into(),
            fence: true,
            ..Default::default()
        })
        .await
        .expect("the remap fences without the immutable flag");
    let at_fence = fencecsi_tests::region_hash(&image, data);
    assert!(!fencecsi_driver::kernel::files::is_immutable(&image).unwrap());
    let late = std::fs::write(w.staging.join("after"), vec![9u8; 1 << 20])
        .and_then(|_| std::fs::File::open(w.staging.join("after"))?.sync_all());
    assert!(late.is_err(), "a write after the fence must fail");
    assert_eq!(
        fencecsi_tests::region_hash(&image, data),
        at_fence,
        "the data changed after the fence returned"
    );
    w.finish(&env, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_state_survives_restart_and_released_generations_are_collected() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let mut rig = Rig::start(&env, &["node-a", "node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("restart", 64 << 20, &cap).await;
    let a = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-a", &cap)
        .await
        .unwrap();
    rig.unpublish(&vol.volume_id, "node-a", true).await.unwrap();
    let fenced = generation_path(&env, &vol.volume_id, a.generation());

    rig.restart_controller(&env).await;
    let status = volume_status(&rig, &vol.volume_id).await;
    let cond = status.volume_condition.unwrap();
    assert!(
        cond.abnormal && cond.message.contains("fenced generation"),
        "usage detection after restart: {cond:?}"
    );
    assert!(
        cond.message.contains("/dev/loop"),
        "names the holder: {cond:?}"
    );
    let refused = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-a2", &cap)
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Code::FailedPrecondition,
        "quarantine survives a restart: {refused:?}"
    );

    let b = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b", &cap)
        .await
        .unwrap();
    assert!(
        fenced.exists() && fencecsi_driver::kernel::files::is_immutable(&fenced).unwrap(),
        "kept frozen while node A holds it"
    );
    rig.node_teardown(&a, true).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while fenced.exists() {
        assert!(
            Instant::now() < deadline,
            "released fenced generation was not collected"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cond = volume_status(&rig, &vol.volume_id)
        .await
        .volume_condition
        .unwrap();
    assert!(!cond.abnormal, "{cond:?}");

    rig.node_teardown(&b, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-b", false)
        .await
        .unwrap();
    let back = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-a3", &cap)
        .await
        .expect("node A may have the volume again");
    rig.node_teardown(&back, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .unwrap();
    rig.delete(&vol.volume_id).await.unwrap();
    rig.stop().await;
    env.assert_clean();
}
