//! No path gives two nodes one generation. Each test takes one of the
//! sequences a standard CO, the upstream attacher or a careless admin
//! produces (not only the path fencecsi's own attacher takes), shows first
//! that writes were landing (positive control), then that after the step
//! nothing written by the first holder reaches the data the next node gets.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use fencecsi_driver::fence::{holders, is_fenced_device};
use fencecsi_driver::loopdev::{self, AttachOptions};
use fencecsi_tests::rig::{Placement, Rig};
use fencecsi_tests::{csi, generation_path, mount_cap, region_hash, require_root, Access, Env};
use tonic::Code;

const SIZE: i64 = 64 << 20;

/// Detaches a loop device this test attached itself, failing or not.
struct Detach(std::path::PathBuf);
impl Drop for Detach {
    fn drop(&mut self) {
        let _ = loopdev::detach(&self.0);
    }
}

/// A holder the records know nothing of: an admin's `losetup` on the image's data.
fn admin_losetup(image: &Path) -> (loopdev::LoopInfo, Detach) {
    let stray = loopdev::attach(
        image,
        &AttachOptions {
            tag: "admin-losetup".into(),
            size_limit: SIZE as u64,
            ..Default::default()
        },
    )
    .unwrap();
    let guard = Detach(stray.device.clone());
    (stray, guard)
}

fn write_and_sync(dir: &Path, name: &str) -> std::io::Result<()> {
    std::fs::write(dir.join(name), vec![0x5A; 256 << 10])?;
    std::fs::File::open(dir.join(name))?.sync_all()
}

async fn delete_eventually(rig: &Rig, vol: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match rig.delete(vol).await {
            Ok(()) => return,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(e) => panic!("delete: {e:?}"),
        }
    }
}

async fn cleanup(rig: &Rig, vol: &str, a: &Placement, b: Option<&Placement>) {
    rig.node_teardown(a, true).await.unwrap();
    if let Some(b) = b {
        rig.node_teardown(b, false).await.unwrap();
        rig.unpublish(vol, "node-b", false).await.unwrap();
    }
    delete_eventually(rig, vol).await;
}

/// The upstream attacher, the attach-detach controller's forced detach,
/// `--fence never` or `kubectl delete volumeattachment`: an unpublish without
/// `fence` while the node still has the volume staged and written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfenced_unpublish_while_held_fences_anyway() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let rig = Rig::start(&env, &["node-a", "node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("held", SIZE, &cap).await;
    let a = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-a", &cap)
        .await
        .unwrap();
    let image = generation_path(&env, &vol.volume_id, a.generation());
    let h0 = region_hash(&image, SIZE as u64);
    write_and_sync(&a.target, "before").expect("control: node A writes");
    assert_ne!(
        region_hash(&image, SIZE as u64),
        h0,
        "control: the write reached the data"
    );

    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .expect("the unpublish succeeds, by fencing");
    let at = region_hash(&image, SIZE as u64);
    let held = holders(&image).unwrap();
    assert!(!held.is_empty(), "node A still holds the generation");
    assert!(
        held.iter().all(|l| is_fenced_device(l, SIZE as u64)),
        "every holder is remapped out of the data: {held:?}"
    );
    assert!(
        write_and_sync(&a.target, "after").is_err(),
        "node A can no longer write"
    );
    assert_eq!(
        region_hash(&image, SIZE as u64),
        at,
        "the data did not change"
    );
    let cond = rig
        .controller
        .clone()
        .controller
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: vol.volume_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(
        cond.message.contains("did not ask"),
        "the condition says why it was fenced: {cond:?}"
    );

    let b = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b", &cap)
        .await
        .expect("node B gets the volume");
    assert!(
        b.generation() > a.generation(),
        "node B writes a new generation"
    );
    assert!(
        b.target.join("before").exists(),
        "what A wrote before is there"
    );
    cleanup(&rig, &vol.volume_id, &a, Some(&b)).await;
    rig.stop().await;
    env.assert_clean();
}

/// A NodeStageVolume on a node the controller never published to, with a
/// publish context naming another node's generation (stale or forged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_publish_context_is_refused() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let rig = Rig::start(&env, &["node-a", "node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("forged", SIZE, &cap).await;
    let a = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-a", &cap)
        .await
        .unwrap();
    let loops_before = env.loops();
    let staging = env.staging_path("node-b", &vol.volume_id);
    let err = rig
        .node("node-b")
        .node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            publish_context: [(
                "loop.fencecsi.io/generation".to_string(),
                a.generation().to_string(),
            )]
            .into(),
            staging_target_path: staging.to_string_lossy().into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(env.loops(), loops_before, "nothing was attached on node B");
    assert!(!staging.exists() || std::fs::read_dir(&staging).unwrap().next().is_none());
    // Publishing to B while A has it is refused too (single-node access).
    let refused = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b", &cap)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");

    // Positive control: the same stage succeeds once the controller has
    // published the volume to node B.
    rig.node_teardown(&a, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .unwrap();
    let b = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b2", &cap)
        .await
        .expect("node B stages once published to it");
    rig.node_teardown(&b, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-b", false)
        .await
        .unwrap();
    delete_eventually(&rig, &vol.volume_id).await;
    rig.stop().await;
    env.assert_clean();
}

/// A holder the records know nothing of (here an admin's losetup on the
/// image; equally a node whose attachment record was lost) when the volume
/// is published to another node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_fences_a_holder_no_attachment_entitles() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let rig = Rig::start(&env, &["node-a", "node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("stray", SIZE, &cap).await;
    let a = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-a", &cap)
        .await
        .unwrap();
    write_and_sync(&a.target, "from-a").unwrap();
    rig.node_teardown(&a, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .unwrap();

    let image = generation_path(&env, &vol.volume_id, a.generation());
    let (stray, _guard) = admin_losetup(&image);
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&stray.device)
        .unwrap();
    let h0 = region_hash(&image, SIZE as u64);
    dev.write_all_at(&[0x77; 4096], 60 << 20).unwrap();
    dev.sync_all().unwrap();
    assert_ne!(
        region_hash(&image, SIZE as u64),
        h0,
        "control: the stray writes the data"
    );

    let b = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b", &cap)
        .await
        .expect("node B gets the volume");
    assert!(
        b.generation() > a.generation(),
        "a new generation for node B"
    );
    let now = loopdev::status(&stray.device).unwrap();
    assert!(
        is_fenced_device(&now, SIZE as u64),
        "the stray is fenced: {now:?}"
    );
    let at = region_hash(&image, SIZE as u64);
    let late = dev
        .write_all_at(&[0x99; 4096], 60 << 20)
        .and_then(|_| dev.sync_all());
    assert!(late.is_err(), "the stray can no longer write");
    assert_eq!(region_hash(&image, SIZE as u64), at);
    assert!(b.target.join("from-a").exists());
    drop(dev);
    drop(_guard);
    rig.node_teardown(&b, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-b", false)
        .await
        .unwrap();
    delete_eventually(&rig, &vol.volume_id).await;
    rig.stop().await;
    env.assert_clean();
}

/// An attachment made before images carried a trailer: the node's loop device
/// shows the whole file (no size limit), so it reaches past the data. The fence
/// gives the image a trailer behind everything that device shows and moves it
/// there: nothing it writes afterwards reaches what it showed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attachment_from_before_the_trailer_is_fenced_too() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let rig = Rig::start(&env, &["node-a", "node-b"]).await;
    let cap = fencecsi_tests::block_cap(Access::SingleNodeWriter);
    let vol = rig.create("legacy", SIZE, &cap).await;
    rig.controller
        .clone()
        .controller
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: "node-a".into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    let image = generation_path(&env, &vol.volume_id, 1);
    let id = match fencecsi_driver::ids::VolumeId::parse(&vol.volume_id).unwrap() {
        fencecsi_driver::ids::Parsed::Ours(v) => v,
        _ => unreachable!(),
    };
    // What an older node plugin made: node A's tag, no size limit.
    let old = loopdev::attach(
        &image,
        &AttachOptions {
            tag: fencecsi_driver::node::loop_tag(&id, 1, "node-a"),
            size_limit: 0,
            ..Default::default()
        },
    )
    .unwrap();
    let _guard = Detach(old.device.clone());
    let shown = old.size_bytes;
    assert!(
        shown > SIZE as u64,
        "the old device shows the trailer too ({shown} bytes)"
    );
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&old.device)
        .unwrap();
    let h0 = region_hash(&image, shown);
    dev.write_all_at(&[0x42; 4096], shown - 4096).unwrap();
    dev.sync_all().unwrap();
    assert_ne!(
        region_hash(&image, shown),
        h0,
        "control: the old device writes"
    );

    rig.unpublish(&vol.volume_id, "node-a", true)
        .await
        .expect("the fence holds for an old-style attachment");
    let now = loopdev::status(&old.device).unwrap();
    assert!(
        now.offset >= shown && now.size_bytes <= 512,
        "moved past all it showed: {now:?}"
    );
    let at = region_hash(&image, shown);
    for off in [0u64, 4096, shown - 4096] {
        let w = dev
            .write_all_at(&[0x99; 4096], off)
            .and_then(|_| dev.sync_all());
        assert!(w.is_err(), "a write at {off} after the fence must fail");
    }
    assert_eq!(region_hash(&image, shown), at, "nothing it showed changed");
    let b = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b", &cap)
        .await
        .expect("node B gets a new generation");
    assert!(b.generation() > 1);
    drop(dev);
    drop(_guard);
    rig.node_teardown(&b, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-b", false)
        .await
        .unwrap();
    delete_eventually(&rig, &vol.volume_id).await;
    rig.stop().await;
    env.assert_clean();
}

/// A stray holder fenced while the volume stays published to another node is a partial
/// fence: its window sits just past the data. Growing the data would put that window
/// onto volume bytes, so ControllerExpandVolume refuses while such a device exists.
/// Control: once the stray is gone, the same expansion succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expansion_waits_while_a_fenced_stray_holds_the_generation() {
    require_root!();
    let env = Env::new();
    let rig = Rig::start(&env, &["node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("grow-stray", SIZE, &cap).await;
    let b = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b", &cap)
        .await
        .unwrap();
    let image = generation_path(&env, &vol.volume_id, b.generation());
    let (stray, guard) = admin_losetup(&image);
    // The controller's partial fence (as for a holder no attachment entitles while B
    // keeps writing): only the stray is remapped.
    let stray_dev = stray.device.clone();
    fencecsi_driver::fence::fence_devices(&image, SIZE as u64, &|l| l.device == stray_dev).unwrap();
    assert!(is_fenced_device(
        &loopdev::status(&stray.device).unwrap(),
        SIZE as u64
    ));
    std::fs::write(b.target.join("still-b"), b"B keeps writing").unwrap();
    let expand = |size: i64| {
        let mut c = rig.controller.clone();
        let id = vol.volume_id.clone();
        async move {
            c.controller
                .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                    volume_id: id,
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: size,
                        limit_bytes: 0,
                    }),
                    ..Default::default()
                })
                .await
        }
    };
    let e = expand(2 * SIZE).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(
        std::fs::metadata(&image).unwrap().len(),
        SIZE as u64 + (1 << 20),
        "the image did not grow"
    );
    drop(guard);
    assert_eq!(
        expand(2 * SIZE).await.unwrap().into_inner().capacity_bytes,
        2 * SIZE
    );
    rig.node_teardown(&b, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-b", false)
        .await
        .unwrap();
    delete_eventually(&rig, &vol.volume_id).await;
    rig.stop().await;
    env.assert_clean();
}
