//! Capacity accounting (driver/src/backend/capacity.rs) on a real, small state-dir
//! filesystem: a 256 MiB ext4 that each test makes on a loop device of its own and tears
//! down again. GetCapacity never reports more than the filesystem can give to images written
//! in full, and creating volumes takes exactly their size (plus the fence trailer) from it;
//! CreateVolume (plain, clone) and ControllerExpandVolume refuse what does not fit with
//! RESOURCE_EXHAUSTED and leave nothing behind; --overcommit-ratio lets the same request
//! fit; a fenced generation counts until garbage collection frees it (also as a reflink
//! clone on xfs, where the copy is free at first); and the fence, with the copy the next
//! publish makes, is never refused for capacity; a snapshot in the making holds its space
//! from its check on, but no other call that takes capacity.

use std::path::Path;
use std::time::{Duration, Instant};

use fencecsi_driver::backend::meta::MetaStore;
use fencecsi_driver::config::CapacityReserve;
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::rig::{Placement, Rig};
use fencecsi_tests::{
    block_cap, csi, generation_path, mount_cap, require_root, sha256_file, Access, Env,
};
use tonic::Code;

const MIB: i64 = 1 << 20;
const TRAILER: i64 = fencecsi_driver::fence::TRAILER_BYTES as i64;
/// What metadata writes (records, directories, the journal) may move the free space by
/// between two readings on the test filesystem.
const SLACK: i64 = MIB / 2;

/// A 256 MiB ext4 state-dir filesystem below `outer`, and a test env on it.
fn small_backing(outer: &Env) -> Env {
    backing(outer, "ext4", 256 << 20)
}

fn backing(outer: &Env, kind: &str, size: u64) -> Env {
    let mnt = fencecsi_tests::backing_fs(outer, kind, size);
    let env = Env::new_in(&mnt);
    assert_eq!(fencecsi_driver::fence::fs_name(env.path()), kind);
    env
}

async fn start(env: &Env, ratio: f64) -> Rig {
    fencecsi_tests::init_tracing();
    Rig::start_with(env, &["node-a", "node-b"], |c| c.overcommit_ratio = ratio).await
}

async fn get_capacity(c: &CsiClient) -> csi::GetCapacityResponse {
    c.clone()
        .controller
        .get_capacity(csi::GetCapacityRequest {
            volume_capabilities: vec![mount_cap(Access::SingleNodeWriter, "ext4")],
            ..Default::default()
        })
        .await
        .expect("GetCapacity")
        .into_inner()
}

async fn available(c: &CsiClient) -> i64 {
    get_capacity(c).await.available_capacity
}

/// (size, free space for unprivileged users) of the filesystem holding `dir`.
fn statvfs(dir: &Path) -> (i64, i64) {
    let st = nix::sys::statvfs::statvfs(dir).unwrap();
    let f = st.fragment_size() as i64;
    (st.blocks() as i64 * f, st.blocks_available() as i64 * f)
}

use fencecsi_tests::rig::{create_request as create_req, from_volume};

/// Volume directories (records and images) in the state dir.
fn volume_dirs(env: &Env) -> usize {
    std::fs::read_dir(env.state_dir().join("volumes"))
        .map(|d| d.count())
        .unwrap_or(0)
}

async fn listed(c: &CsiClient) -> usize {
    c.clone()
        .controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .len()
}

fn assert_near(got: i64, want: i64, what: &str) {
    assert!(
        (got - want).abs() <= SLACK,
        "{what}: {got} bytes, expected {want} (± {SLACK})"
    );
}

/// Writes `len` bytes of a pattern into a file on a published mount, durably.
fn write_payload(p: &Placement, len: usize) -> String {
    use std::io::Write;
    let path = p.target.join("payload.bin");
    let data: Vec<u8> = (0..len as u32).map(|i| (i * 31 % 253) as u8 + 1).collect();
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    sha256_file(&path)
}

/// Waits until the controller's garbage collection has removed `image`.
async fn wait_collected(image: &Path) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while image.exists() {
        assert!(
            Instant::now() < deadline,
            "{} was not collected",
            image.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A volume of `size` bytes (ext4) in use on node-a as pod-a, with `payload` bytes
/// written to it: the placement and the payload's hash.
async fn in_use_on_node_a(
    rig: &Rig,
    env: &Env,
    name: &str,
    size: i64,
    payload: usize,
) -> (Placement, String) {
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (_, a) = rig
        .create_attached(env, name, size, &cap, "node-a", "pod-a")
        .await;
    let hash = write_payload(&a, payload);
    (a, hash)
}

/// Fences `a`'s volume away from node-a: ControllerUnpublish with fence.
async fn fence(rig: &Rig, a: &Placement) -> Result<(), tonic::Status> {
    rig.unpublish(&a.volume_id, &a.node, true).await
}

/// Publishes `a`'s volume on node-b as pod-b (after a fence: a copy of it).
async fn move_to_node_b(rig: &Rig, env: &Env, a: &Placement) -> Result<Placement, tonic::Status> {
    rig.attach(env, &a.volume_id, "node-b", "pod-b", &a.cap)
        .await
}

/// Node A lets go of the fenced `a`; waits until its generation 1 is collected: its
/// image gone and the volume's record written without it. (Collection removes the image
/// before it writes the record, so until then GetCapacity still counts the generation.)
async fn release_fenced(rig: &Rig, env: &Env, a: &Placement) {
    rig.node_teardown(a, true).await.unwrap();
    wait_collected(&generation_path(env, &a.volume_id, 1)).await;
    let record = MetaStore::volume_path(&env.state_dir(), &a.volume_id);
    let deadline = Instant::now() + Duration::from_secs(20);
    while recorded_generations(&record).contains(&"1".to_string()) {
        assert!(
            Instant::now() < deadline,
            "{} still lists generation 1 after its image was collected",
            record.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The generations a volume record lists (it is written atomically).
fn recorded_generations(record: &Path) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(record).unwrap()).unwrap();
    v["generations"]
        .as_object()
        .expect("a volume record lists its generations")
        .keys()
        .cloned()
        .collect()
}

/// Waits until GetCapacity answers `want` (± SLACK): the controller reads its records
/// from memory, updated just after each record file is written, and the free space
/// of the filesystem, which may lag an unlink (xfs frees blocks in the background).
/// A bound on liveness only; the accounting itself is what is asserted.
async fn assert_available_settles(c: &CsiClient, want: i64, limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    let mut now = available(c).await;
    while (now - want).abs() > SLACK && Instant::now() < deadline {
        nix::unistd::sync();
        tokio::time::sleep(Duration::from_millis(100)).await;
        now = available(c).await;
    }
    assert_near(now, want, what);
}

/// Detaches and deletes the volume in use at `last`, stops the rig, and checks that
/// nothing of `env` is left mounted or attached.
async fn finish(rig: Rig, env: &Env, last: &Placement) {
    rig.detach_and_delete(last).await.unwrap();
    rig.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_capacity_is_honest_and_volumes_take_their_size() {
    require_root!();
    let outer = Env::new();
    let env = small_backing(&outer);
    let rig = start(&env, 1.0).await;
    let c = &rig.controller;

    let (total, free) = statvfs(&env.state_dir());
    let reserve = CapacityReserve::Percent(5.0).bytes_of(total as u64) as i64;
    let r = get_capacity(c).await;
    let a0 = r.available_capacity;
    assert!(
        a0 > 100 * MIB && a0 <= free - reserve - TRAILER,
        "available {a0} on a filesystem of {total} bytes with {free} free (reserve {reserve})"
    );
    assert_eq!(
        r.maximum_volume_size,
        Some(a0),
        "the largest volume is what is available"
    );
    assert_eq!(r.minimum_volume_size, Some(16 * MIB));

    // Sparse volumes take their full size (plus the trailer) from the capacity, though
    // they take almost nothing from the filesystem.
    let ext4 = mount_cap(Access::SingleNodeWriter, "ext4");
    let v1 = rig.create("cap-1", 32 * MIB, &ext4).await;
    let a1 = available(c).await;
    assert_near(a0 - a1, 32 * MIB + TRAILER, "first volume");
    let v2 = rig
        .create("cap-2", 48 * MIB, &block_cap(Access::SingleNodeWriter))
        .await;
    let a2 = available(c).await;
    assert_near(a1 - a2, 48 * MIB + TRAILER, "second volume");
    let (_, free_now) = statvfs(&env.state_dir());
    assert!(
        free - free_now < 2 * MIB,
        "the images are sparse: {} bytes used",
        free - free_now
    );
    // Writing a volume's data does not change what is available: it was promised already.
    let p = rig
        .attach(&env, &v1.volume_id, "node-a", "pod-1", &ext4)
        .await
        .unwrap();
    write_payload(&p, 8 << 20);
    assert_near(available(c).await, a2, "after writing 8 MiB into a volume");

    // The topology the nodes report is served; a segment of another state dir is not.
    let ours = rig
        .node("node-a")
        .node
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .accessible_topology
        .unwrap();
    let here = get_capacity_in(c, &ours).await.available_capacity;
    assert_near(here, a2, "in the nodes' topology");
    let foreign = get_capacity_in(c, &fencecsi_driver::terms::topology_of("another")).await;
    assert_eq!(foreign.available_capacity, 0);

    rig.detach_and_delete(&p).await.unwrap();
    rig.delete(&v2.volume_id).await.unwrap();
    assert_near(available(c).await, a0, "after deleting both");
    rig.stop().await;
    env.assert_clean();
}

async fn get_capacity_in(c: &CsiClient, topology: &csi::Topology) -> csi::GetCapacityResponse {
    c.clone()
        .controller
        .get_capacity(csi::GetCapacityRequest {
            accessible_topology: Some(topology.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_does_not_fit_is_refused_and_leaves_nothing_behind() {
    require_root!();
    let outer = Env::new();
    let env = small_backing(&outer);
    let rig = start(&env, 1.0).await;
    let c = &rig.controller;
    let block = block_cap(Access::SingleNodeWriter);

    let a0 = available(c).await;
    let small = rig.create("fits-first", 16 * MIB, &block).await;
    let a = available(c).await;
    let (dirs, n) = (volume_dirs(&env), listed(c).await);

    // One MiB more than is available: not now (RESOURCE_EXHAUSTED), nothing written.
    let too_big = (a / MIB + 1) * MIB;
    let e = rig
        .create_volume(create_req("too-big", too_big, &block))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("out of capacity"), "{e:?}");
    // Larger than the backend could ever hold: OUT_OF_RANGE.
    let e = rig
        .create_volume(create_req("never", 1 << 40, &block))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
    // A clone needs as much again: refused the same way.
    let big = rig.create("big-source", a / 2 + 8 * MIB, &block).await;
    let e = rig
        .create_volume(csi::CreateVolumeRequest {
            volume_content_source: from_volume(&big.volume_id),
            ..create_req("clone", big.capacity_bytes, &block)
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "clone: {e:?}");
    rig.delete(&big.volume_id).await.unwrap();
    assert_eq!(volume_dirs(&env), dirs, "no image or record left behind");
    assert_eq!(listed(c).await, n, "no record left behind");
    assert_near(available(c).await, a, "nothing taken by the refusals");

    // Positive control: what is available fits exactly, and then nothing does.
    let fits = (a / MIB) * MIB;
    let full = rig
        .create_volume(create_req("too-big", fits, &block))
        .await
        .expect("the largest size reported available fits (and the refused name is free)");
    assert_eq!(full.capacity_bytes, fits);
    assert!(available(c).await < MIB, "the backend is full");
    let e = rig
        .create_volume(create_req("one-more", MIB, &block))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    // An idempotent repeat of an existing volume still succeeds when full.
    let again = rig
        .create_volume(create_req("too-big", fits, &block))
        .await
        .expect("a repeat of an existing volume is not a new promise");
    assert_eq!(again.volume_id, full.volume_id);

    // Growth counts too.
    let expand = |id: &str, size: i64| {
        let mut c = c.clone();
        let req = csi::ControllerExpandVolumeRequest {
            volume_id: id.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: size,
                limit_bytes: 0,
            }),
            ..Default::default()
        };
        async move { c.controller.controller_expand_volume(req).await }
    };
    let e = expand(&small.volume_id, 32 * MIB).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let img = generation_path(&env, &small.volume_id, 1);
    assert_eq!(
        std::fs::metadata(&img).unwrap().len() as i64,
        16 * MIB + TRAILER,
        "a refused expansion leaves the image as it was"
    );
    rig.delete(&full.volume_id).await.unwrap();
    let before = available(c).await;
    let r = expand(&small.volume_id, 32 * MIB)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, 32 * MIB);
    assert_near(before - available(c).await, 16 * MIB, "growth taken");

    rig.delete(&small.volume_id).await.unwrap();
    assert_near(available(c).await, a0, "all given back");
    rig.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overcommit_ratio_lets_the_same_request_fit() {
    require_root!();
    let outer = Env::new();
    let env = small_backing(&outer);
    let block = block_cap(Access::SingleNodeWriter);
    let rig = start(&env, 1.0).await;
    let a1 = available(&rig.controller).await;
    // 8 MiB more than is available: refused without over-commit...
    let size = (a1 / MIB + 8) * MIB;
    let e = rig
        .create_volume(create_req("thin", size, &block))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    rig.stop().await;
    assert_eq!(volume_dirs(&env), 0);

    // ... and taken with --overcommit-ratio 2, which doubles what is available.
    let rig = start(&env, 2.0).await;
    let a2 = available(&rig.controller).await;
    assert_near(a2, 2 * (a1 + TRAILER) - TRAILER, "ratio 2");
    let v = rig
        .create_volume(create_req("thin", size, &block))
        .await
        .expect("fits with over-commit");
    assert_near(
        available(&rig.controller).await,
        a2 - size - TRAILER,
        "after the thin volume",
    );
    rig.delete(&v.volume_id).await.unwrap();
    rig.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_generation_counts_until_it_is_collected() {
    require_root!();
    let outer = Env::new();
    let env = small_backing(&outer);
    let rig = start(&env, 1.0).await;
    let c = &rig.controller;
    let size = 48 * MIB;
    let (a, hash) = in_use_on_node_a(&rig, &env, "fenced", size, 8 << 20).await;
    let before = available(c).await;

    // The fence promises the copy the next publish makes (ext4: a full sparse copy).
    fence(&rig, &a).await.unwrap();
    let fenced = available(c).await;
    assert_near(before - fenced, size + TRAILER, "after the fence");
    // The copy takes what was promised, no more.
    let b = move_to_node_b(&rig, &env, &a).await.unwrap();
    assert_eq!(b.generation(), 2);
    assert_eq!(sha256_file(&b.target.join("payload.bin")), hash);
    let copied = available(c).await;
    assert_near(copied, fenced, "after the copy");

    // Node A still holds generation 1: it stays, and keeps counting.
    let gen1 = generation_path(&env, &a.volume_id, 1);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(gen1.exists(), "a held generation is not collected");
    assert_near(available(c).await, copied, "while node A holds it");

    // Node A lets go; garbage collection frees generation 1 and its space comes back.
    release_fenced(&rig, &env, &a).await;
    assert_available_settles(c, before, Duration::from_secs(20), "after collection").await;

    finish(rig, &env, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_is_never_refused_for_capacity() {
    require_root!();
    let outer = Env::new();
    let env = small_backing(&outer);
    let rig = start(&env, 1.0).await;
    let c = &rig.controller;
    let block = block_cap(Access::SingleNodeWriter);
    let (a, hash) = in_use_on_node_a(&rig, &env, "fence-when-full", 32 * MIB, 4 << 20).await;

    // Fill the budget.
    let left = available(c).await;
    let filler = rig.create("filler", (left / MIB) * MIB, &block).await;
    assert!(available(c).await < MIB, "the backend is full");

    // The fence and the publish that copies the volume both succeed...
    fence(&rig, &a)
        .await
        .expect("the fence is never refused for capacity");
    let b = move_to_node_b(&rig, &env, &a)
        .await
        .expect("the copy after a fence is never refused for capacity");
    assert_eq!(b.generation(), 2);
    assert_eq!(sha256_file(&b.target.join("payload.bin")), hash);
    // ... and new volumes are refused instead while the fenced generation is kept.
    assert_eq!(available(c).await, 0);
    let e = rig
        .create_volume(create_req("after-fence", MIB, &block))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");

    release_fenced(&rig, &env, &a).await;
    rig.delete(&filler.volume_id).await.unwrap();
    assert!(
        available(c).await > left - MIB,
        "the space is back once the fenced generation is gone"
    );
    finish(rig, &env, &b).await;
}

/// On xfs the generation after a fence is a reflink clone: no space at first, but both
/// sides get their own blocks as they are written. Both count in full while both exist
/// (extents they share count as held by neither), and the space comes back when the fenced
/// one is collected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflinked_generations_count_in_full_until_collected() {
    require_root!();
    let outer = Env::new();
    let env = backing(&outer, "xfs", 512 << 20);
    let rig = start(&env, 1.0).await;
    let c = &rig.controller;
    let size = 48 * MIB;
    let (a, hash) = in_use_on_node_a(&rig, &env, "reflinked", size, 8 << 20).await;
    let before = available(c).await;
    let (_, free_before) = statvfs(&env.state_dir());

    fence(&rig, &a).await.unwrap();
    let b = move_to_node_b(&rig, &env, &a).await.unwrap();
    assert_eq!(sha256_file(&b.target.join("payload.bin")), hash);
    let (_, free_after) = statvfs(&env.state_dir());
    assert!(
        free_before - free_after < 4 * MIB,
        "the new generation is a reflink: {} bytes taken",
        free_before - free_after
    );
    let copied = available(c).await;
    assert!(
        before - copied >= size + TRAILER - SLACK,
        "the reflinked generation counts in full: {before} -> {copied}"
    );

    release_fenced(&rig, &env, &a).await;
    // Generation 2 now holds its blocks alone: what was written counts as written again.
    // xfs frees an unlinked file's blocks in the background (inode inactivation), so
    // the free space the formula reads converges shortly after the unlink.
    assert_available_settles(c, before, Duration::from_secs(60), "after collection").await;

    finish(rig, &env, &b).await;
}

/// A snapshot's copy takes its space from the moment it is checked (a reservation,
/// until its record is written), yet holds up no other call that takes capacity: a
/// CreateVolume while the copy is held completes, and both are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_in_the_making_holds_its_space_but_no_other_call() {
    require_root!();
    let outer = Env::new();
    let env = small_backing(&outer);
    let rig = start(&env, 1.0).await;
    let c = &rig.controller;
    let ext4 = mount_cap(Access::SingleNodeWriter, "ext4");
    let v1 = rig.create("source", 32 * MIB, &ext4).await;
    let a0 = available(c).await;

    let paused = fencecsi_driver::failpoint::arm_pause("snapshot:before-copy", &v1.volume_id);
    let mut s = c.clone();
    let req = csi::CreateSnapshotRequest {
        name: "snap".into(),
        source_volume_id: v1.volume_id.clone(),
        ..Default::default()
    };
    let snapshot = tokio::spawn(async move { s.controller.create_snapshot(req).await });
    assert!(
        tokio::task::block_in_place(|| paused.wait_reached(Duration::from_secs(30))),
        "the snapshot never reached its copy"
    );
    let a1 = available(c).await;
    assert_near(a0 - a1, 32 * MIB, "a snapshot in the making");
    let v2 = tokio::time::timeout(
        Duration::from_secs(10),
        rig.create("beside", 16 * MIB, &ext4),
    )
    .await
    .expect("a CreateVolume is not held up by a snapshot's copy");
    assert_near(
        a1 - available(c).await,
        16 * MIB + TRAILER,
        "the volume beside it",
    );

    paused.release();
    let snap = snapshot
        .await
        .unwrap()
        .expect("the snapshot")
        .into_inner()
        .snapshot
        .unwrap();
    assert_near(
        a0 - available(c).await,
        32 * MIB + 16 * MIB + TRAILER,
        "the snapshot recorded (its reservation given back)",
    );
    drop(paused);
    c.clone()
        .controller
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id,
            ..Default::default()
        })
        .await
        .unwrap();
    rig.delete(&v2.volume_id).await.unwrap();
    rig.delete(&v1.volume_id).await.unwrap();
    assert_near(
        available(c).await,
        a0 + 32 * MIB + TRAILER,
        "after deleting all",
    );
    rig.stop().await;
    env.assert_clean();
}
