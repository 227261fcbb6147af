//! Snapshots and clones of a volume in use are point-in-time, on every backing
//! filesystem. A record writer appends fsync'ed records on node A while the
//! copy is made; the copy then passes `fsck -n` (for a filesystem volume),
//! and its records are a prefix: every record from 0 up to some k is intact,
//! nothing after k is, and k covers every record acknowledged before the
//! copy was asked for. A raw block volume in use has no filesystem to
//! freeze: it is copied atomically where the backing filesystem makes reflinks,
//! and refused (FAILED_PRECONDITION, nothing made) where it does not.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use fencecsi_driver::kernel::loop_device::{self, AttachOptions};
use fencecsi_tests::csi::volume_capability::AccessType;
use fencecsi_tests::records::{check, RECORD_SIZE};
use fencecsi_tests::rig::{create_request, from_snapshot, from_volume, Placement, Rig};
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

/// Where the records go on the volume `p`: a file on a filesystem volume,
/// the device (from byte 0) of a raw block one.
fn records(p: &Placement) -> PathBuf {
    match p.cap.access_type {
        Some(AccessType::Block(_)) => p.target.clone(),
        _ => p.target.join("records.log"),
    }
}

/// Runs `copy` while a writer appends fsync'ed records to the volume `p`: its
/// outcome, and how many records were acknowledged before it was asked for.
/// A copy that succeeds must not stop the writer: it goes on for `more`.
async fn while_writing<T, E>(
    p: &Placement,
    more: u64,
    copy: impl Future<Output = Result<T, E>>,
) -> (Result<T, E>, u64) {
    let writer_exe = Path::new(env!("CARGO_BIN_EXE_fencecsi-writer"));
    let w = Writer::start(writer_exe, &records(p), false, &[]);
    wait_acked(&w, 20).await;
    let asked = monotonic_ns();
    let got = copy.await;
    if got.is_ok() {
        wait_acked(&w, w.acked() + more).await;
    }
    let (acks, _) = w.stop();
    let before = acks.iter().filter(|(_, t)| *t < asked).count() as u64;
    (got, before)
}

/// A new volume `name` in use on node-a as `pod`.
async fn in_use(
    rig: &Rig,
    env: &Env,
    name: &str,
    cap: &csi::VolumeCapability,
    pod: &str,
) -> (csi::Volume, Placement) {
    rig.create_attached(env, name, SIZE, cap, "node-a", pod)
        .await
}

/// Records 0..k intact, nothing after k, and k covering the `before` records
/// acknowledged before the copy (`what`) was asked for.
fn assert_one_instant(bytes: &[u8], before: u64, backing: &str, what: &str) {
    let (k, after) = prefix(bytes);
    assert!(!after, "{backing}: records after a gap: not one instant");
    assert!(
        k >= before && before > 0,
        "{backing}: {k} records in the {what}, {before} acknowledged before it was asked for"
    );
}

/// The same check on a raw block copy's data (the records from byte 0).
fn assert_block_one_instant(data: &[u8], before: u64, backing: &str, what: &str) {
    let (k, after) = prefix(data);
    assert!(!after, "{backing}: raw block {what} is not one instant");
    assert!(k >= before && before > 0, "{backing}: {k} < {before}");
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

/// Attaches a copy's data read-only on a loop device of this test.
struct ReadOnly(PathBuf);
impl ReadOnly {
    /// `size_limit`: how much of `file` the device shows (0: all of it).
    fn attach(file: &Path, tag: &str, size_limit: u64) -> ReadOnly {
        let lo = loop_device::attach(
            file,
            &AttachOptions {
                read_only: true,
                tag: tag.into(),
                size_limit,
                ..Default::default()
            },
        )
        .unwrap();
        ReadOnly(lo.device)
    }
}
impl Drop for ReadOnly {
    fn drop(&mut self) {
        let _ = loop_device::detach(&self.0);
    }
}

/// `e2fsck -n` finds nothing to fix in a copy (`what`) of a filesystem
/// volume, through a read-only loop device of this test.
fn assert_fsck_clean(file: &Path, tag: &str, size_limit: u64, what: &str) {
    let ro = ReadOnly::attach(file, tag, size_limit);
    let fsck = Command::new("e2fsck")
        .args(["-n", "-f"])
        .arg(&ro.0)
        .output()
        .expect("e2fsck runs");
    assert!(
        fsck.status.success(),
        "{what}: {}\n{}",
        fsck.status,
        String::from_utf8_lossy(&fsck.stdout)
    );
}

/// A rig with node-a on an env on a new `backing` filesystem made in the
/// outer env, whose teardown removes that filesystem, failing or not.
async fn on_backing(backing: &str) -> (Env, Env, Rig) {
    fencecsi_tests::init_tracing();
    let outer = Env::new();
    let mnt = fencecsi_tests::backing_fs(&outer, backing, 4 << 30);
    let env = Env::new_in(&mnt);
    let rig = Rig::start(&env, &["node-a"]).await;
    (outer, env, rig)
}

/// The records a copy holds, read through the product's own path: the
/// volume `vol` is attached on node-a as `pod`, read, then removed.
async fn records_of(
    rig: &Rig,
    env: &Env,
    vol: &str,
    cap: &csi::VolumeCapability,
    pod: &str,
) -> Vec<u8> {
    let p = rig.attach(env, vol, "node-a", pod, cap).await.unwrap();
    let bytes = std::fs::read(records(&p)).unwrap();
    rig.detach_and_delete(&p).await.unwrap();
    bytes
}

async fn live(backing: &str) {
    require_root!();
    let (outer, env, rig) = on_backing(backing).await;

    // A filesystem volume: frozen for the copy on every backing filesystem.
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, a) = in_use(&rig, &env, &format!("live-fs-{backing}"), &cap, "pod-a").await;
    let (got, before) = while_writing(
        &a,
        5,
        snapshot(&rig, &format!("snap-fs-{backing}"), &vol.volume_id),
    )
    .await;
    let snap = got.expect("a snapshot of a mounted filesystem volume");
    let data_img = env
        .state_dir()
        .join("snapshots")
        .join(&snap.snapshot_id)
        .join("data.img");
    assert_eq!(std::fs::metadata(&data_img).unwrap().len() as i64, SIZE);
    assert_fsck_clean(
        &data_img,
        &format!("snap-fsck-{backing}"),
        0,
        &format!("{backing}: fsck -n of the snapshot"),
    );
    // Restore it and read the records through the product's own path.
    let restored = rig
        .create_volume(csi::CreateVolumeRequest {
            volume_content_source: from_snapshot(&snap.snapshot_id),
            ..create_request(&format!("restored-{backing}"), SIZE, &cap)
        })
        .await
        .unwrap();
    rig.detach(&a).await.unwrap();
    let bytes = records_of(&rig, &env, &restored.volume_id, &cap, "pod-r").await;
    assert_one_instant(&bytes, before, backing, "snapshot");

    // A raw block volume in use.
    let bcap = block_cap(Access::SingleNodeWriter);
    let (bvol, b) = in_use(&rig, &env, &format!("live-block-{backing}"), &bcap, "pod-b").await;
    let (got, before) = while_writing(
        &b,
        0,
        snapshot(&rig, &format!("snap-block-{backing}"), &bvol.volume_id),
    )
    .await;
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
        assert_block_one_instant(&bytes, before, backing, "snapshot");
        rig.delete_snapshot(s.snapshot_id).await;
    }
    rig.detach_and_delete(&b).await.unwrap();
    rig.delete_snapshot(snap.snapshot_id).await;
    rig.delete(&vol.volume_id).await.unwrap();
    rig.stop().await;
    env.assert_clean();
    drop(env);
    drop(outer);
}

async fn clone_of(
    rig: &Rig,
    name: &str,
    vol: &str,
    cap: &csi::VolumeCapability,
) -> Result<csi::Volume, tonic::Status> {
    rig.create_volume(csi::CreateVolumeRequest {
        volume_content_source: from_volume(vol),
        ..create_request(name, SIZE, cap)
    })
    .await
}

/// The data region of a volume's generation 1 (without the fence trailer).
fn data_of(env: &Env, vol: &str) -> Vec<u8> {
    let mut bytes = std::fs::read(fencecsi_tests::generation_path(env, vol, 1)).unwrap();
    bytes.truncate(SIZE as usize);
    bytes
}

/// Clones of a volume in use are point-in-time exactly as snapshots are
/// (same checks as [`live`]); a raw block clone that cannot be one instant
/// is refused and leaves no volume behind.
async fn live_clone(backing: &str) {
    require_root!();
    let (outer, env, rig) = on_backing(backing).await;
    let volumes_dir = env.state_dir().join("volumes");
    let volume_dirs = || std::fs::read_dir(&volumes_dir).unwrap().count();

    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, a) = in_use(
        &rig,
        &env,
        &format!("clone-src-fs-{backing}"),
        &cap,
        "pod-a",
    )
    .await;
    let (got, before) = while_writing(
        &a,
        5,
        clone_of(&rig, &format!("clone-fs-{backing}"), &vol.volume_id, &cap),
    )
    .await;
    let clone = got.expect("a clone of a mounted filesystem volume");
    assert_fsck_clean(
        &fencecsi_tests::generation_path(&env, &clone.volume_id, 1),
        &format!("clone-fsck-{backing}"),
        SIZE as u64,
        &format!("{backing}: fsck -n of the clone"),
    );
    // Read the records through the product's own path.
    rig.detach(&a).await.unwrap();
    let bytes = records_of(&rig, &env, &clone.volume_id, &cap, "pod-c").await;
    assert_one_instant(&bytes, before, backing, "clone");
    rig.delete(&vol.volume_id).await.unwrap();

    // A raw block volume in use: nothing to freeze.
    let bcap = block_cap(Access::SingleNodeWriter);
    let (bvol, b) = in_use(
        &rig,
        &env,
        &format!("clone-src-block-{backing}"),
        &bcap,
        "pod-b",
    )
    .await;
    let dirs = volume_dirs();
    let (got, before) = while_writing(
        &b,
        0,
        clone_of(
            &rig,
            &format!("clone-block-{backing}"),
            &bvol.volume_id,
            &bcap,
        ),
    )
    .await;
    if backing == "ext4" {
        let err = got.expect_err("no point-in-time clone of raw block in use without reflinks");
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
        assert_eq!(volume_dirs(), dirs, "the refused clone left no volume");
    } else {
        let cl = got.expect("a reflink clone of raw block in use");
        assert_block_one_instant(&data_of(&env, &cl.volume_id), before, backing, "clone");
        rig.delete(&cl.volume_id).await.unwrap();
    }
    rig.detach_and_delete(&b).await.unwrap();
    rig.stop().await;
    env.assert_clean();
    drop(env);
    drop(outer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_clone_on_ext4_backing() {
    live_clone("ext4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_clone_on_xfs_backing() {
    live_clone("xfs").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_clone_on_btrfs_backing() {
    live_clone("btrfs").await;
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

/// A volume published to a node but not yet staged has no holder to freeze
/// or to reflink around, so a stage that started during the copy would write
/// into it (here: mkfs). The copy holds the volume's publish lock, so such a
/// stage waits for it: the snapshot is the volume before the stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_waits_for_a_snapshot_being_copied() {
    require_root!();
    let env = Env::new();
    let rig = Rig::start(&env, &["node-a"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("copy-vs-stage", SIZE, &cap).await.volume_id;
    let ctx = rig.publish(&vol, "node-a", &cap).await.unwrap();
    // ext4's magic at byte 1080 of the volume: there once the stage made the
    // filesystem, absent from a fresh volume.
    let has_ext4 = |bytes: &[u8]| bytes.len() > 1081 && bytes[1080..1082] == [0x53, 0xef];
    assert!(
        !has_ext4(&data_of(&env, &vol)),
        "a fresh volume has no filesystem"
    );

    let paused = fencecsi_driver::failpoint::arm_pause("snapshot:before-copy", &vol);
    let snap = {
        let (rig_c, vol) = (rig.controller.clone(), vol.clone());
        tokio::spawn(async move {
            rig_c
                .clone()
                .controller
                .create_snapshot(csi::CreateSnapshotRequest {
                    name: "copy-vs-stage".into(),
                    source_volume_id: vol,
                    ..Default::default()
                })
                .await
                .map(|r| r.into_inner().snapshot.unwrap())
        })
    };
    let reached = tokio::task::spawn_blocking({
        let p = paused;
        move || (p.wait_reached(Duration::from_secs(30)), p)
    });
    let (ok, paused) = reached.await.unwrap();
    assert!(ok, "the snapshot reached its copy");
    let staging = env.staging_path("node-a", &vol);
    let stage = {
        let mut node = rig.node("node-a");
        let req = fencecsi_tests::rig::stage_request(&vol, &staging, &cap, &ctx);
        tokio::spawn(async move { node.node.node_stage_volume(req).await })
    };
    // The kernel shows the stage blocked on the volume's lock.
    let vol_dir = env.state_dir().join("volumes").join(&vol);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !fencecsi_tests::flock_waiter_on(&vol_dir) {
        assert!(
            Instant::now() < deadline,
            "the stage must wait for the copy"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    paused.release();
    let snap = snap.await.unwrap().expect("the snapshot is made");
    stage
        .await
        .unwrap()
        .expect("the stage goes on after the copy");
    drop(paused);
    // Positive control: the stage did write the volume...
    assert!(
        has_ext4(&data_of(&env, &vol)),
        "control: the stage made a filesystem"
    );
    // ...after the copy, which is the volume as it was before.
    let copy = std::fs::read(
        env.state_dir()
            .join("snapshots")
            .join(&snap.snapshot_id)
            .join("data.img"),
    )
    .unwrap();
    assert!(
        !has_ext4(&copy),
        "the snapshot holds what the stage wrote later"
    );

    rig.node("node-a")
        .node
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: vol.clone(),
            staging_target_path: staging.to_string_lossy().into(),
            force: false,
        })
        .await
        .unwrap();
    rig.unpublish(&vol, "node-a", false).await.unwrap();
    rig.delete_snapshot(snap.snapshot_id).await;
    rig.delete(&vol).await.unwrap();
    rig.stop().await;
    env.assert_clean();
}
