//! ControllerModifyVolume (VolumeAttributesClass) and CreateVolume's mutable parameters:
//! `directIO` switches the loop devices that hold a volume, at once and at every later
//! attach; bad requests change nothing.

use std::collections::HashMap;

use fencecsi_driver::kernel::loop_device::{self, LoopInfo};
use fencecsi_tests::rig::Rig;
use fencecsi_tests::{csi, generation_path, mount_cap, require_root, Access, Env};
use tonic::Code;

const SIZE: i64 = 64 << 20;

/// The loop devices the kernel shows on generation `gen` of `vol`.
fn devices(env: &Env, vol: &str, gen: u64) -> Vec<LoopInfo> {
    let image = generation_path(env, vol, gen);
    let (dev, ino) = fencecsi_driver::kernel::files::dev_ino(&image).unwrap();
    loop_device::find_by_inode(dev, ino).unwrap()
}

fn params(kv: &[(&str, &str)]) -> HashMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn modify(rig: &Rig, vol: &str, kv: &[(&str, &str)]) -> Result<(), tonic::Status> {
    rig.controller
        .clone()
        .controller
        .controller_modify_volume(csi::ControllerModifyVolumeRequest {
            volume_id: vol.into(),
            mutable_parameters: params(kv),
            ..Default::default()
        })
        .await
        .map(|_| ())
}

fn dio(env: &Env, vol: &str) -> Vec<bool> {
    devices(env, vol, 1).iter().map(|l| l.direct_io).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modify_switches_direct_io_online_and_for_later_attaches() {
    require_root!();
    let env = Env::new();
    let rig = Rig::start(&env, &["node-a"]).await;
    let caps = rig
        .controller
        .clone()
        .controller
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(caps.capabilities.iter().any(|c| matches!(
        c.r#type,
        Some(csi::controller_service_capability::Type::Rpc(ref r))
            if r.r#type == csi::controller_service_capability::rpc::Type::ModifyVolume as i32
    )));

    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("modify", SIZE, &cap).await.volume_id;
    let p = rig
        .attach(&env, &vol, "node-a", "pod-1", &cap)
        .await
        .unwrap();
    assert_eq!(
        dio(&env, &vol),
        vec![false],
        "the node's default (buffered)"
    );

    // On, then off: the kernel's device follows at once.
    modify(&rig, &vol, &[("directIO", "true")]).await.unwrap();
    assert_eq!(dio(&env, &vol), vec![true]);
    std::fs::write(p.target.join("after-dio"), b"written through direct I/O").unwrap();
    modify(&rig, &vol, &[("directIO", "false")]).await.unwrap();
    assert_eq!(dio(&env, &vol), vec![false]);

    // Bad requests: the right code, and nothing changes.
    for (kv, code) in [
        (vec![("directIO", "maybe")], Code::InvalidArgument),
        (vec![("readAhead", "1")], Code::InvalidArgument),
        (vec![], Code::InvalidArgument),
    ] {
        let e = modify(&rig, &vol, &kv).await.unwrap_err();
        assert_eq!(e.code(), code, "{kv:?}: {e:?}");
        assert_eq!(dio(&env, &vol), vec![false], "{kv:?} changed the device");
    }
    let e = modify(
        &rig,
        "vol-0123456789abcdef0123456789abcdef",
        &[("directIO", "true")],
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");

    // Set on, then re-attach: the new device is made with direct I/O.
    modify(&rig, &vol, &[("directIO", "true")]).await.unwrap();
    rig.node_teardown(&p, false).await.unwrap();
    assert!(devices(&env, &vol, 1).is_empty());
    rig.unpublish(&vol, "node-a", false).await.unwrap();
    let p = rig
        .attach(&env, &vol, "node-a", "pod-2", &cap)
        .await
        .unwrap();
    assert_eq!(dio(&env, &vol), vec![true]);
    assert_eq!(
        std::fs::read(p.target.join("after-dio")).unwrap(),
        b"written through direct I/O"
    );
    rig.node_teardown(&p, false).await.unwrap();
    rig.unpublish(&vol, "node-a", false).await.unwrap();
    rig.delete(&vol).await.unwrap();
    rig.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_takes_mutable_parameters_and_refuses_unknown_ones() {
    require_root!();
    let env = Env::new();
    let rig = Rig::start(&env, &["node-a"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let create = |name: &str, kv: &[(&str, &str)]| csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: SIZE,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap.clone()],
        mutable_parameters: params(kv),
        ..Default::default()
    };
    let e = rig
        .controller
        .clone()
        .controller
        .create_volume(create("bad", &[("directIO", "yes")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let listed = rig
        .controller
        .clone()
        .controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(listed.entries.is_empty(), "nothing created: {listed:?}");

    let vol = rig
        .controller
        .clone()
        .controller
        .create_volume(create("dio", &[("directIO", "true")]))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let p = rig
        .attach(&env, &vol, "node-a", "pod-1", &cap)
        .await
        .unwrap();
    assert_eq!(dio(&env, &vol), vec![true], "made with direct I/O");
    rig.node_teardown(&p, false).await.unwrap();
    rig.unpublish(&vol, "node-a", false).await.unwrap();
    rig.delete(&vol).await.unwrap();
    rig.stop().await;
    env.assert_clean();
}
