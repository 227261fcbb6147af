//! Snapshots of a volume in use are point-in-time, on every backing
//! filesystem. A record writer appends fsync'ed records on node A while the
//! snapshot is taken; the snapshot then passes `fsck -n` (for a filesystem
//! volume), and its records are a prefix: every record from 0 up to some k is
//! intact, nothing after k is, and k covers every record acknowledged before
//! the snapshot was asked for. A raw block volume in use has no filesystem to
//! freeze: it is copied atomically where the backing filesystem makes reflinks,
//! and refused (FAILED_PRECONDITION, nothing made) where it does not.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use fencecsi_driver::loopdev::{self, AttachOptions};
use fencecsi_tests::records::{check, RECORD_SIZE};
use fencecsi_tests::rig::Rig;
use fencecsi_tests::writer::Writer;
use fencecsi_tests::{block_cap, csi, monotonic_ns, mount_cap, require_root, Access, Env};
use tonic::Code;

const SIZE: i64 = 64 << 20;

/// Records 0..k that are intact, and whether anything after k is a record.
fn prefix(data: &[u8]) -> (u64, bool) {
    let n = (data.len() / RECORD_SIZE) as u64;
    let at = |s: u64| {
        let o = s as usize * RECORD_SIZE;
        check(&data[o..o + RECORD_SIZE], s)
    };
    let k = (0..n).take_while(|s| at(*s)).count() as u64;
    let after = (k..n).any(at);
    (k, after)
}

async fn wait_acked(w: &Writer, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while w.acked() < n {
        assert!(Instant::now() < deadline, "writer too slow");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn snapshot(rig: &Rig, name: &str, vol: &str) -> Result<csi::Snapshot, tonic::Status> {
    rig.controller
        .clone()
        .controller
        .create_snapshot(csi::CreateSnapshotRequest {
            name: name.into(),
            source_volume_id: vol.into(),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().snapshot.unwrap())
}

/// Attaches the snapshot's data read-only on a loop device of this test.
struct ReadOnly(std::path::PathBuf);
impl ReadOnly {
    fn attach(file: &Path, tag: &str) -> ReadOnly {
        let lo = loopdev::attach(
            file,
            &AttachOptions {
                read_only: true,
                tag: tag.into(),
                ..Default::default()
            },
        )
        .unwrap();
        ReadOnly(lo.device)
    }
}
impl Drop for ReadOnly {
    fn drop(&mut self) {
        let _ = loopdev::detach(&self.0);
    }
}

async fn live(backing: &str) {
    require_root!();
    fencecsi_tests::init_tracing();
    let outer = Env::new();
    let mnt = fencecsi_tests::backing_fs(&outer, backing, 4 << 30);
    let env = Env::new_in(&mnt);
    let rig = Rig::start(&env, &["node-a"]).await;
    let writer_exe = Path::new(env!("CARGO_BIN_EXE_fencecsi-writer"));

    // A filesystem volume: frozen for the copy on every backing filesystem.
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create(&format!("live-fs-{backing}"), SIZE, &cap).await;
    let a = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-a", &cap)
        .await
        .unwrap();
    let w = Writer::start(writer_exe, &a.target.join("records.log"), false, &[]);
    wait_acked(&w, 20).await;
    let asked = monotonic_ns();
    let snap = snapshot(&rig, &format!("snap-fs-{backing}"), &vol.volume_id)
        .await
        .expect("a snapshot of a mounted filesystem volume");
    wait_acked(&w, w.acked() + 5).await; // the writer kept going after the snapshot
    let (acks, _) = w.stop();
    let before = acks.iter().filter(|(_, t)| *t < asked).count() as u64;
    let data_img = env
        .state_dir()
        .join("snapshots")
        .join(&snap.snapshot_id)
        .join("data.img");
    assert_eq!(std::fs::metadata(&data_img).unwrap().len() as i64, SIZE);
    {
        let ro = ReadOnly::attach(&data_img, &format!("snap-fsck-{backing}"));
        let fsck = Command::new("e2fsck")
            .args(["-n", "-f"])
            .arg(&ro.0)
            .output()
            .expect("e2fsck runs");
        assert!(
            fsck.status.success(),
            "{backing}: fsck -n of the snapshot: {}\n{}",
            fsck.status,
            String::from_utf8_lossy(&fsck.stdout)
        );
    }
    // Restore it and read the records through the product's own path.
    let restored = rig
        .controller
        .clone()
        .controller
        .create_volume(csi::CreateVolumeRequest {
            name: format!("restored-{backing}"),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: SIZE,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            volume_content_source: Some(csi::VolumeContentSource {
                r#type: Some(csi::volume_content_source::Type::Snapshot(
                    csi::volume_content_source::SnapshotSource {
                        snapshot_id: snap.snapshot_id.clone(),
                    },
                )),
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    rig.node_teardown(&a, false).await.unwrap();
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .unwrap();
    let r = rig
        .attach(&env, &restored.volume_id, "node-a", "pod-r", &cap)
        .await
        .unwrap();
    let bytes = std::fs::read(r.target.join("records.log")).unwrap();
    let (k, after) = prefix(&bytes);
    assert!(!after, "{backing}: records after a gap: not one instant");
    assert!(
        k >= before && before > 0,
        "{backing}: {k} records in the snapshot, {before} acknowledged before it was asked for"
    );
    rig.node_teardown(&r, false).await.unwrap();
    rig.unpublish(&restored.volume_id, "node-a", false)
        .await
        .unwrap();
    rig.delete(&restored.volume_id).await.unwrap();

    // A raw block volume in use.
    let bcap = block_cap(Access::SingleNodeWriter);
    let bvol = rig
        .create(&format!("live-block-{backing}"), SIZE, &bcap)
        .await;
    let b = rig
        .attach(&env, &bvol.volume_id, "node-a", "pod-b", &bcap)
        .await
        .unwrap();
    let w = Writer::start(writer_exe, &b.target, false, &[]);
    wait_acked(&w, 20).await;
    let asked = monotonic_ns();
    let got = snapshot(&rig, &format!("snap-block-{backing}"), &bvol.volume_id).await;
    let (acks, _) = w.stop();
    let before = acks.iter().filter(|(_, t)| *t < asked).count() as u64;
    let snaps_dir = env.state_dir().join("snapshots");
    if backing == "ext4" {
        let err = got.expect_err("no point-in-time copy of raw block in use without reflinks");
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
        assert!(
            std::fs::read_dir(&snaps_dir)
                .unwrap()
                .flatten()
                .all(|e| e.file_name().to_string_lossy() == snap.snapshot_id),
            "the refused snapshot left nothing"
        );
    } else {
        let s = got.expect("a reflink copy of raw block in use");
        let bytes = std::fs::read(snaps_dir.join(&s.snapshot_id).join("data.img")).unwrap();
        let (k, after) = prefix(&bytes);
        assert!(!after, "{backing}: raw block snapshot is not one instant");
        assert!(k >= before && before > 0, "{backing}: {k} < {before}");
        rig.controller
            .clone()
            .controller
            .delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: s.snapshot_id,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    rig.node_teardown(&b, false).await.unwrap();
    rig.unpublish(&bvol.volume_id, "node-a", false)
        .await
        .unwrap();
    rig.delete(&bvol.volume_id).await.unwrap();
    rig.controller
        .clone()
        .controller
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id,
            ..Default::default()
        })
        .await
        .unwrap();
    rig.delete(&vol.volume_id).await.unwrap();
    rig.stop().await;
    env.assert_clean();
    drop(env);
    drop(outer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_snapshot_on_ext4_backing() {
    live("ext4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_snapshot_on_xfs_backing() {
    live("xfs").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_snapshot_on_btrfs_backing() {
    live("btrfs").await;
}
