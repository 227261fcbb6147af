//! Data written through a published mount survives unpublish, unstage,
//! stage and publish again; nothing is left behind.

use fencecsi_driver::config::Mode;
use fencecsi_tests::{csi, mount_cap, require_root, sha256_file, Access, Env, InProcess};

async fn round_trip(fs: &str) {
    let env = Env::new();
    let (plugin, mut c) = InProcess::start(env.config(Mode::All, Some("node-a"), "all")).await;
    let cap = mount_cap(Access::SingleNodeWriter, fs);
    let vol = c
        .controller
        .create_volume(csi::CreateVolumeRequest {
            name: format!("pvc-roundtrip-{fs}"),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 400 << 20,
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
    let ctx = c
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
    let target = env.target_path("node-a", "pod-1", "pv-1");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let stage = csi::NodeStageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        publish_context: ctx.clone(),
        staging_target_path: staging.to_string_lossy().into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    let publish = csi::NodePublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        publish_context: ctx.clone(),
        staging_target_path: staging.to_string_lossy().into(),
        target_path: target.to_string_lossy().into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    c.node.node_stage_volume(stage.clone()).await.unwrap();
    c.node
        .node_stage_volume(stage.clone())
        .await
        .expect("stage is idempotent");
    c.node.node_publish_volume(publish.clone()).await.unwrap();
    c.node
        .node_publish_volume(publish.clone())
        .await
        .expect("publish is idempotent");
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(target.join("payload.bin"), &data).unwrap();
    let before = sha256_file(&target.join("payload.bin"));
    let inode_stat = nix::sys::statvfs::statvfs(&target).unwrap();
    assert!(inode_stat.blocks() > 0);

    let unpublish = csi::NodeUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: target.to_string_lossy().into(),
        force: false,
    };
    let unstage = csi::NodeUnstageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.to_string_lossy().into(),
        force: false,
    };
    c.node
        .node_unpublish_volume(unpublish.clone())
        .await
        .unwrap();
    c.node
        .node_unpublish_volume(unpublish.clone())
        .await
        .expect("unpublish is idempotent");
    c.node.node_unstage_volume(unstage.clone()).await.unwrap();
    c.node
        .node_unstage_volume(unstage.clone())
        .await
        .expect("unstage is idempotent");
    env.assert_clean();
    assert!(!target.exists(), "target removed");

    c.node.node_stage_volume(stage).await.unwrap();
    c.node.node_publish_volume(publish).await.unwrap();
    assert_eq!(
        sha256_file(&target.join("payload.bin")),
        before,
        "data survived the round trip"
    );
    c.node.node_unpublish_volume(unpublish).await.unwrap();
    c.node.node_unstage_volume(unstage).await.unwrap();
    c.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: "node-a".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    c.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    env.assert_clean();
    plugin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext4_data_survives_unstage_and_restage() {
    require_root!();
    fencecsi_tests::init_tracing();
    round_trip("ext4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfs_data_survives_unstage_and_restage() {
    require_root!();
    fencecsi_tests::init_tracing();
    round_trip("xfs").await;
}
