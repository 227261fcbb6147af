//! No path gives two nodes one generation. Each test takes one of the
//! sequences a standard CO, the upstream attacher or a careless admin
//! produces (not only the path fencecsi's own attacher takes), shows first
//! that writes were landing (positive control), then that after the step
//! nothing written by the first holder reaches the data the next node gets.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fencecsi_driver::failpoint;
use fencecsi_driver::fence::{holders, is_fenced_device};
use fencecsi_driver::kernel::loop_device::{self, AttachOptions, LoopInfo};
use fencecsi_driver::terms::loop_tag;
use fencecsi_tests::rig::{stage_request, Placement, Rig};
use fencecsi_tests::{
    block_cap, csi, generation_path, mount_cap, region_hash, require_root, Access, Env,
};
use tonic::Code;

const SIZE: i64 = 64 << 20;

/// Detaches a loop device this test attached itself, failing or not.
struct Detach(PathBuf);
impl Drop for Detach {
    fn drop(&mut self) {
        let _ = loop_device::detach(&self.0);
    }
}

/// A loop device on `image` made by this test, not by today's node plugin
/// (an admin, an older driver, a node whose record was lost); detached when
/// the guard drops.
fn losetup(image: &Path, tag: String, size_limit: u64) -> (LoopInfo, Detach) {
    let dev = loop_device::attach(
        image,
        &AttachOptions {
            tag,
            size_limit,
            ..Default::default()
        },
    )
    .unwrap();
    let guard = Detach(dev.device.clone());
    (dev, guard)
}

/// A holder the records know nothing of: an admin's `losetup` on the image's data.
fn admin_losetup(image: &Path) -> (LoopInfo, Detach) {
    losetup(image, "admin-losetup".into(), SIZE as u64)
}

/// [`losetup`] tagged as `node`'s device for generation 1 of `vol`.
fn node_losetup(image: &Path, vol: &str, node: &str, size_limit: u64) -> (LoopInfo, Detach) {
    losetup(image, node_tag(vol, 1, node), size_limit)
}

/// A holder's device, opened for writing as its application has it.
fn open_rw(device: &Path) -> File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(device)
        .unwrap()
}

/// 4 KiB of `fill` at `off` through `dev`, synced: whether it got through.
fn write_through(dev: &File, fill: u8, off: u64) -> std::io::Result<()> {
    dev.write_all_at(&[fill; 4096], off)
        .and_then(|_| dev.sync_all())
}

/// Positive control: `write` changes the first `limit` bytes of `image`, so
/// the holder's writes were reaching the data before the step under test.
fn assert_write_lands(image: &Path, limit: u64, what: &str, write: impl FnOnce()) {
    let h0 = region_hash(image, limit);
    write();
    assert_ne!(region_hash(image, limit), h0, "{what}");
}

/// Runs `attempt` (writes of a fenced holder) and asserts the first `limit`
/// bytes of `image` did not change; their hash.
fn assert_data_unchanged(image: &Path, limit: u64, what: &str, attempt: impl FnOnce()) -> String {
    let at = region_hash(image, limit);
    attempt();
    assert_eq!(region_hash(image, limit), at, "{what}");
    at
}

/// Writes through `dev` at each of `offsets` fail: the step named `after`
/// moved the device out of the data.
fn assert_writes_fail(dev: &File, offsets: &[u64], after: &str) {
    for &off in offsets {
        let w = write_through(dev, 0x99, off);
        assert!(w.is_err(), "a write at {off} after the {after} must fail");
    }
}

fn write_and_sync(dir: &Path, name: &str) -> std::io::Result<()> {
    std::fs::write(dir.join(name), vec![0x5A; 256 << 10])?;
    std::fs::File::open(dir.join(name))?.sync_all()
}

/// Polls `done` until it holds; fails the test with `what` after `secs`.
async fn wait_until(secs: u64, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Tracing, a test env, and a controller with node plugins `nodes`.
async fn start(nodes: &[&str]) -> (Env, Rig) {
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let rig = Rig::start(&env, nodes).await;
    (env, rig)
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

/// Ends a test: deletes the volume ([`delete_eventually`]), stops the
/// plugins and checks nothing is left mounted or attached.
async fn delete_and_stop(env: &Env, rig: Rig, vol: &str) {
    delete_eventually(&rig, vol).await;
    rig.stop().await;
    env.assert_clean();
}

/// Ends a test whose volume is in use on `b`: its detach, then
/// [`delete_and_stop`].
async fn detach_delete_and_stop(env: &Env, rig: Rig, b: &Placement) {
    rig.detach(b).await.unwrap();
    delete_and_stop(env, rig, &b.volume_id).await;
}

/// The volume's condition as ControllerGetVolume reports it.
async fn condition(rig: &Rig, vol: &str) -> csi::VolumeCondition {
    rig.volume_status(vol).await.volume_condition.unwrap()
}

/// Node B gets the volume, on a generation after the first.
async fn b_gets_a_new_generation(
    env: &Env,
    rig: &Rig,
    vol: &str,
    cap: &csi::VolumeCapability,
) -> Placement {
    let b = rig
        .attach(env, vol, "node-b", "pod-b", cap)
        .await
        .expect("node B gets a new generation");
    assert!(b.generation() > 1, "a new generation for node B");
    b
}

/// The upstream attacher, the attach-detach controller's forced detach,
/// `--fence never` or `kubectl delete volumeattachment`: an unpublish without
/// `fence` while the node still has the volume staged and written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfenced_unpublish_while_held_fences_anyway() {
    require_root!();
    let (env, rig) = start(&["node-a", "node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, a) = rig
        .create_attached(&env, "held", SIZE, &cap, "node-a", "pod-a")
        .await;
    let image = generation_path(&env, &vol.volume_id, a.generation());
    assert_write_lands(
        &image,
        SIZE as u64,
        "control: the write reached the data",
        || write_and_sync(&a.target, "before").expect("control: node A writes"),
    );

    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .expect("the unpublish succeeds, by fencing");
    let held = holders(&image).unwrap();
    assert!(!held.is_empty(), "node A still holds the generation");
    assert!(
        held.iter().all(|l| is_fenced_device(l, SIZE as u64)),
        "every holder is remapped out of the data: {held:?}"
    );
    assert_data_unchanged(&image, SIZE as u64, "the data did not change", || {
        assert!(
            write_and_sync(&a.target, "after").is_err(),
            "node A can no longer write"
        )
    });
    let cond = condition(&rig, &vol.volume_id).await;
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
    rig.node_teardown(&a, true).await.unwrap();
    detach_delete_and_stop(&env, rig, &b).await;
}

/// A process of node A's that holds one of the locks a node takes (the
/// volume dir's, as a stage does around its attach; the image's, as an
/// attach does), shared, and never lets go: a node frozen mid-call. In a
/// process group of its own: flock(1) runs its command as a child, which the
/// drop kills with it.
struct StuckLockHolder(std::process::Child);

impl StuckLockHolder {
    fn on(path: &Path) -> Self {
        use std::os::unix::process::CommandExt;
        let child = std::process::Command::new("flock")
            .arg("-s")
            .arg(path)
            .args(["sleep", "600"])
            .process_group(0)
            .spawn()
            .expect("flock(1) from util-linux");
        let holder = StuckLockHolder(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        // Held once an exclusive try fails.
        while File::open(path).unwrap().try_lock().is_ok() {
            assert!(Instant::now() < deadline, "flock never took {path:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
        holder
    }
}

impl Drop for StuckLockHolder {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.0.wait();
    }
}

/// A node that hangs holding a lock must not decide whether it is fenced:
/// whatever lock a node-side process holds, ControllerUnpublishVolume with
/// `fence` answers within its bound, the node's writes fail from then on,
/// and node B gets the volume with what A wrote before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_unpublish_answers_whatever_lock_a_node_process_holds() {
    require_root!();
    for lock in ["volume dir", "image"] {
        let (env, rig) = start(&["node-a", "node-b"]).await;
        let cap = mount_cap(Access::SingleNodeWriter, "ext4");
        let (vol, a) = rig
            .create_attached(&env, "stuck", SIZE, &cap, "node-a", "pod-a")
            .await;
        let image = generation_path(&env, &vol.volume_id, a.generation());
        assert_write_lands(
            &image,
            SIZE as u64,
            "control: the write reached the data",
            || write_and_sync(&a.target, "before").expect("control: node A writes"),
        );
        let locked = match lock {
            "volume dir" => env.state_dir().join("volumes").join(&vol.volume_id),
            _ => image.clone(),
        };
        let holder = StuckLockHolder::on(&locked);

        // It answers while the holder still holds the lock (the holder never lets go
        // before it is dropped below): it waited for the lock at most its bound. How
        // long it took is a figure; the test only bounds liveness, for a busy machine.
        let started = Instant::now();
        tokio::time::timeout(
            Duration::from_secs(120),
            rig.unpublish(&vol.volume_id, "node-a", true),
        )
        .await
        .unwrap_or_else(|_| panic!("{lock}: the fence never answered"))
        .unwrap_or_else(|e| panic!("{lock}: the fence is made without the lock: {e:?}"));
        let took = started.elapsed();
        let held = holders(&image).unwrap();
        assert!(
            !held.is_empty() && held.iter().all(|l| is_fenced_device(l, SIZE as u64)),
            "{lock}: node A's device is remapped out of the data: {held:?}"
        );
        assert_data_unchanged(&image, SIZE as u64, "the data did not change", || {
            assert!(
                write_and_sync(&a.target, "after").is_err(),
                "{lock}: node A can no longer write"
            )
        });
        let b = b_gets_a_new_generation(&env, &rig, &vol.volume_id, &cap).await;
        assert!(
            b.target.join("before").exists(),
            "{lock}: what A wrote before the fence is on B"
        );
        eprintln!("stuck {lock} lock: fenced unpublish answered in {took:?}");
        drop(holder);
        rig.node_teardown(&a, true).await.unwrap();
        detach_delete_and_stop(&env, rig, &b).await;
    }
}

/// A NodeStageVolume on a node the controller never published to, with a
/// publish context naming another node's generation (stale or forged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_publish_context_is_refused() {
    require_root!();
    let (env, rig) = start(&["node-a", "node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, a) = rig
        .create_attached(&env, "forged", SIZE, &cap, "node-a", "pod-a")
        .await;
    let loops_before = env.loops();
    let staging = env.staging_path("node-b", &vol.volume_id);
    let forged = [(
        "loop.fencecsi.io/generation".to_string(),
        a.generation().to_string(),
    )];
    let err = rig
        .node("node-b")
        .node
        .node_stage_volume(stage_request(
            &vol.volume_id,
            &staging,
            &cap,
            &forged.into(),
        ))
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
    rig.detach(&a).await.unwrap();
    let b = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b2", &cap)
        .await
        .expect("node B stages once published to it");
    detach_delete_and_stop(&env, rig, &b).await;
}

/// A holder the records know nothing of (here an admin's losetup on the
/// image; equally a node whose attachment record was lost) when the volume
/// is published to another node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_fences_a_holder_no_attachment_entitles() {
    require_root!();
    let (env, rig) = start(&["node-a", "node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, a) = rig
        .create_attached(&env, "stray", SIZE, &cap, "node-a", "pod-a")
        .await;
    write_and_sync(&a.target, "from-a").unwrap();
    rig.detach(&a).await.unwrap();

    let image = generation_path(&env, &vol.volume_id, a.generation());
    let (stray, guard) = admin_losetup(&image);
    let dev = open_rw(&stray.device);
    assert_write_lands(
        &image,
        SIZE as u64,
        "control: the stray writes the data",
        || write_through(&dev, 0x77, 60 << 20).unwrap(),
    );

    let b = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b", &cap)
        .await
        .expect("node B gets the volume");
    assert!(
        b.generation() > a.generation(),
        "a new generation for node B"
    );
    let now = loop_device::status(&stray.device).unwrap();
    assert!(
        is_fenced_device(&now, SIZE as u64),
        "the stray is fenced: {now:?}"
    );
    assert_data_unchanged(&image, SIZE as u64, "the data did not change", || {
        let late = write_through(&dev, 0x99, 60 << 20);
        assert!(late.is_err(), "the stray can no longer write");
    });
    assert!(b.target.join("from-a").exists());
    drop(dev);
    drop(guard);
    detach_delete_and_stop(&env, rig, &b).await;
}

/// An admin's `losetup` made while the volume is in use on A, with no
/// publish to come: the controller's next pass fences that device (only it),
/// and node A keeps writing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_made_after_the_publish_is_fenced_at_the_next_pass() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let rig = Rig::start_with(&env, &["node-a"], |c| {
        c.gc_interval = Duration::from_millis(200)
    })
    .await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, a) = rig
        .create_attached(&env, "late-stray", SIZE, &cap, "node-a", "pod-a")
        .await;
    let image = generation_path(&env, &vol.volume_id, a.generation());
    // The pass that finds the stray is held before it fences, so the control
    // below is not a race with it.
    let paused = failpoint::arm_pause("gc:before-stray-fence", &vol.volume_id);
    let (stray, guard) = admin_losetup(&image);
    let dev = open_rw(&stray.device);
    let reached = tokio::task::block_in_place(|| paused.wait_reached(Duration::from_secs(30)));
    assert!(reached, "a pass found the stray");
    assert_write_lands(
        &image,
        SIZE as u64,
        "control: the stray writes the data until it is fenced",
        || write_through(&dev, 0x77, 60 << 20).unwrap(),
    );
    paused.release();
    wait_until(30, "the stray is fenced by a pass", || {
        is_fenced_device(&loop_device::status(&stray.device).unwrap(), SIZE as u64)
    })
    .await;
    assert_data_unchanged(&image, SIZE as u64, "the data did not change", || {
        let late = write_through(&dev, 0x99, 60 << 20);
        assert!(late.is_err(), "the stray can no longer write");
    });
    let a_dev = holders(&image)
        .unwrap()
        .into_iter()
        .find(|l| l.tag == node_tag(&vol.volume_id, a.generation(), "node-a"))
        .expect("A's device");
    assert!(
        !is_fenced_device(&a_dev, SIZE as u64),
        "A's own device is untouched"
    );
    assert_write_lands(&image, SIZE as u64, "A still writes its volume", || {
        write_and_sync(&a.target, "after-stray").expect("A writes")
    });
    drop(dev);
    drop(guard);
    detach_delete_and_stop(&env, rig, &a).await;
}

/// A raw block volume published to node A (ControllerPublish alone, no
/// stage: the test attaches node A's device itself), and its generation 1.
async fn published_to_a(
    env: &Env,
    rig: &Rig,
    name: &str,
    cap: &csi::VolumeCapability,
) -> (String, PathBuf) {
    let vol = rig.create(name, SIZE, cap).await.volume_id;
    publish_to(rig, &vol, "node-a", cap).await;
    let image = generation_path(env, &vol, 1);
    (vol, image)
}

/// An attachment made before images carried a trailer: the node's loop device
/// shows the whole file (no size limit), so it reaches past the data. The fence
/// gives the image a trailer behind everything that device shows and moves it
/// there: nothing it writes afterwards reaches what it showed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attachment_from_before_the_trailer_is_fenced_too() {
    require_root!();
    let (env, rig) = start(&["node-a", "node-b"]).await;
    let cap = block_cap(Access::SingleNodeWriter);
    let (vol, image) = published_to_a(&env, &rig, "legacy", &cap).await;
    // What an older node plugin made: node A's tag, no size limit.
    let (old, guard) = node_losetup(&image, &vol, "node-a", 0);
    let shown = old.size_bytes;
    assert!(
        shown > SIZE as u64,
        "the old device shows the trailer too ({shown} bytes)"
    );
    let dev = open_rw(&old.device);
    assert_write_lands(&image, shown, "control: the old device writes", || {
        write_through(&dev, 0x42, shown - 4096).unwrap()
    });

    rig.unpublish(&vol, "node-a", true)
        .await
        .expect("the fence holds for an old-style attachment");
    let now = loop_device::status(&old.device).unwrap();
    assert!(
        now.offset >= shown && now.size_bytes <= 512,
        "moved past all it showed: {now:?}"
    );
    assert_data_unchanged(&image, shown, "nothing it showed changed", || {
        assert_writes_fail(&dev, &[0, 4096, shown - 4096], "fence")
    });
    let b = b_gets_a_new_generation(&env, &rig, &vol, &cap).await;
    drop(dev);
    drop(guard);
    detach_delete_and_stop(&env, rig, &b).await;
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
    let (vol, b) = rig
        .create_attached(&env, "grow-stray", SIZE, &cap, "node-b", "pod-b")
        .await;
    let image = generation_path(&env, &vol.volume_id, b.generation());
    let (stray, guard) = admin_losetup(&image);
    // The controller's partial fence (as for a holder no attachment entitles while B
    // keeps writing): only the stray is remapped.
    let stray_dev = stray.device.clone();
    fencecsi_driver::fence::fence_devices(
        &image,
        SIZE as u64,
        &|l| l.device == stray_dev,
        fencecsi_driver::fence::SETTLE,
    )
    .unwrap();
    assert!(is_fenced_device(
        &loop_device::status(&stray.device).unwrap(),
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
    detach_delete_and_stop(&env, rig, &b).await;
}

/// The tag `node`'s plugin gives its loop device on generation `gen` of `vol`.
fn node_tag(vol: &str, gen: u64, node: &str) -> String {
    let id = match fencecsi_driver::ids::VolumeId::parse(vol).unwrap() {
        fencecsi_driver::ids::Parsed::Ours(v) => v,
        _ => unreachable!("a volume of this driver"),
    };
    loop_tag(&id, gen, node)
}

/// ControllerPublish alone (the stage is driven step by step).
async fn publish_to(
    rig: &Rig,
    vol: &str,
    node: &str,
    cap: &csi::VolumeCapability,
) -> HashMap<String, String> {
    rig.controller
        .clone()
        .controller
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: vol.into(),
            node_id: node.into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .expect("ControllerPublish")
        .into_inner()
        .publish_context
}

fn ctx_generation(ctx: &HashMap<String, String>) -> u64 {
    ctx[fencecsi_driver::terms::CTX_GENERATION].parse().unwrap()
}

/// Node A's stage of one volume, driven step by step (published to it with
/// [`publish_to`], its request built from the publish context).
struct StageOnA<'a> {
    rig: &'a Rig,
    vol: &'a str,
    staging: PathBuf,
    cap: csi::VolumeCapability,
}

impl<'a> StageOnA<'a> {
    fn new(env: &Env, rig: &'a Rig, vol: &'a str, cap: &csi::VolumeCapability) -> Self {
        StageOnA {
            rig,
            vol,
            staging: env.staging_path("node-a", vol),
            cap: cap.clone(),
        }
    }

    /// NodeStage with `ctx`, held at pause point `point` on its own task.
    fn pause_at(&self, point: &str, ctx: &HashMap<String, String>) -> PausedStage {
        PausedStage::start(
            point,
            self.rig.node("node-a"),
            stage_request(self.vol, &self.staging, &self.cap, ctx),
        )
    }

    /// The positive control of a race test: published to A, A's stage held
    /// at `point` and let go with nothing in between succeeds, and A holds
    /// the generation; then unstaged (A stays published). The generation
    /// and its image.
    async fn control_at(&self, env: &Env, point: &str) -> (u64, PathBuf) {
        let ctx = publish_to(self.rig, self.vol, "node-a", &self.cap).await;
        let gen = ctx_generation(&ctx);
        let image = generation_path(env, self.vol, gen);
        self.pause_at(point, &ctx)
            .finish()
            .await
            .expect("control: A's stage succeeds with nothing in between");
        assert_eq!(holder_tags(&image), vec![node_tag(self.vol, gen, "node-a")]);
        self.unstage(false).await;
        (gen, image)
    }

    async fn unstage(&self, force: bool) {
        self.rig
            .node("node-a")
            .node
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: self.vol.into(),
                staging_target_path: self.staging.to_string_lossy().into(),
                force,
            })
            .await
            .expect("NodeUnstage");
    }
}

/// A NodeStage on its own task, held at pause point `point`. Dropped (a
/// failing test), it lets the stage go on and waits for it, so the env's
/// teardown, which runs later, finds whatever the stage made.
struct PausedStage {
    paused: failpoint::Paused,
    stage: Option<tokio::task::JoinHandle<Result<(), tonic::Status>>>,
}

impl PausedStage {
    fn start(
        point: &str,
        mut node: fencecsi_proto::client::CsiClient,
        req: csi::NodeStageVolumeRequest,
    ) -> PausedStage {
        let paused = failpoint::arm_pause(point, &req.staging_target_path);
        let s = PausedStage {
            paused,
            stage: Some(tokio::spawn(async move {
                node.node.node_stage_volume(req).await.map(|_| ())
            })),
        };
        let reached =
            tokio::task::block_in_place(|| s.paused.wait_reached(Duration::from_secs(30)));
        assert!(reached, "the stage did not reach {point}");
        s
    }

    /// Lets the stage go on; its outcome.
    async fn finish(mut self) -> Result<(), tonic::Status> {
        self.paused.release();
        self.stage.take().unwrap().await.unwrap()
    }
}

impl Drop for PausedStage {
    fn drop(&mut self) {
        self.paused.release();
        if let Some(s) = self.stage.take() {
            let _ = tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(s));
        }
    }
}

/// Tags of the loop devices the kernel shows holding `image` (by inode).
fn holder_tags(image: &Path) -> Vec<String> {
    let mut t: Vec<String> = holders(image).unwrap().into_iter().map(|l| l.tag).collect();
    t.sort();
    t
}

/// NodeStage reads the record, then attaches. An unpublish of A (nothing
/// holds the generation yet, so nothing to fence) and a publish to B in
/// between would give both nodes one generation; the stage checks again
/// under the lock the controller holds for those, so A attaches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_whose_attachment_moved_before_its_attach_is_refused() {
    require_root!();
    let (env, rig) = start(&["node-a", "node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("moved", SIZE, &cap).await;
    let stage_a = StageOnA::new(&env, &rig, &vol.volume_id, &cap);
    // After the stage read the record, before it locks and attaches.
    const POINT: &str = "stage:before-attach";

    // Positive control: paused at the same point and let go with nothing in
    // between, A's stage succeeds and A holds the generation.
    let (gen, image) = stage_a.control_at(&env, POINT).await;
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .unwrap();

    // The interleaving: A passes its check, then loses the volume to B.
    let ctx = publish_to(&rig, &vol.volume_id, "node-a", &cap).await;
    assert_eq!(ctx_generation(&ctx), gen);
    let stage = stage_a.pause_at(POINT, &ctx);
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .expect("nothing holds the generation yet: a plain unpublish");
    let b = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b", &cap)
        .await
        .expect("node B gets the volume");
    assert_eq!(
        b.generation(),
        gen,
        "precondition: B holds the generation A is about to attach"
    );
    let err = stage
        .finish()
        .await
        .expect_err("A's stage must be refused after it lost the attachment");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(
        holder_tags(&image),
        vec![node_tag(&vol.volume_id, gen, "node-b")],
        "the kernel shows only B's device on the generation"
    );
    assert!(
        !env.mounts().contains(&stage_a.staging),
        "nothing was mounted for A"
    );
    write_and_sync(&b.target, "from-b").expect("B writes its volume");

    drop(stage_a);
    detach_delete_and_stop(&env, rig, &b).await;
}

/// The other half of the same lock: a stage that passed its check under the
/// lock holds it until its device exists. A node that hangs right there
/// must not hold up the unpublish: past its bound the unpublish fences the
/// generation whole without the lock, the stage that goes on later is
/// refused by the fence's marker, and node B gets a new generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpublish_does_not_wait_for_a_stuck_stage_and_fences_its_generation() {
    require_root!();
    let (env, rig) = start(&["node-a", "node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("waits", SIZE, &cap).await;
    let stage_a = StageOnA::new(&env, &rig, &vol.volume_id, &cap);
    let vol_dir = env.state_dir().join("volumes").join(&vol.volume_id);

    // Positive control: with no stage under way the same unpublish fences
    // nothing, so the fence below is owed to A's stuck stage.
    publish_to(&rig, &vol.volume_id, "node-a", &cap).await;
    rig.unpublish(&vol.volume_id, "node-a", false)
        .await
        .unwrap();
    assert!(
        !condition(&rig, &vol.volume_id).await.abnormal,
        "control: nothing fenced"
    );

    let ctx = publish_to(&rig, &vol.volume_id, "node-a", &cap).await;
    let gen = ctx_generation(&ctx);
    let image = generation_path(&env, &vol.volume_id, gen);
    // After the re-check under the lock, before the attach: held there.
    let stage = stage_a.pause_at("stage:locked-before-attach", &ctx);
    let mut c = rig.controller.clone();
    let req = csi::ControllerUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: "node-a".into(),
        fence: false,
        ..Default::default()
    };
    let started = Instant::now();
    let unpublish =
        tokio::spawn(async move { c.controller.controller_unpublish_volume(req).await });
    // The kernel shows the unpublish waiting for the lock the stage holds...
    wait_until(30, "the unpublish waits for the stage's lock first", || {
        fencecsi_tests::flock_waiter_on(&vol_dir)
    })
    .await;
    // ...and it answers while the stage is still stuck (held at its failpoint until
    // released below). The bound is for liveness only.
    tokio::time::timeout(Duration::from_secs(120), unpublish)
        .await
        .expect("the unpublish never answered")
        .unwrap()
        .expect("the unpublish succeeds, by fencing, with the stage still stuck");
    eprintln!("the unpublish answered in {:?}", started.elapsed());
    let id = match fencecsi_driver::ids::VolumeId::parse(&vol.volume_id).unwrap() {
        fencecsi_driver::ids::Parsed::Ours(id) => id,
        _ => unreachable!(),
    };
    let record = fencecsi_driver::backend::meta::MetaStore::read_volume(&env.state_dir(), &id)
        .unwrap()
        .unwrap();
    let why = record.generations[&gen]
        .fence_reason
        .clone()
        .unwrap_or_default();
    assert!(
        why.contains("attachments lock"),
        "the record says why the fence was made: {why:?}"
    );
    let b = rig
        .attach(&env, &vol.volume_id, "node-b", "pod-b", &cap)
        .await
        .expect("node B gets the volume while A's stage is still stuck");
    assert!(b.generation() > gen, "node B writes a new generation");
    let err = stage
        .finish()
        .await
        .expect_err("A's stage, let go, is refused by the fence");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        holders(&image)
            .unwrap()
            .iter()
            .all(|l| l.read_only || is_fenced_device(l, SIZE as u64)),
        "nothing can write the fenced generation"
    );
    write_and_sync(&b.target, "from-b").expect("B writes its volume");

    stage_a.unstage(true).await;
    drop(stage_a);
    detach_delete_and_stop(&env, rig, &b).await;
}

/// The stage stuck one step later, inside its attach (holding the image's
/// lock too, after its check of the fence marker): the fence goes on without
/// either lock, and the attach that follows sees the marker after its device
/// exists, fences and releases that device, and is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_a_fence_overtook_fences_and_releases_its_own_device() {
    require_root!();
    let (env, rig) = start(&["node-a", "node-b"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = rig.create("overtaken", SIZE, &cap).await;
    let stage_a = StageOnA::new(&env, &rig, &vol.volume_id, &cap);
    const POINT: &str = "stage:attach-checked";

    // Positive control: held at the same point and let go with nothing in
    // between, the stage attaches and stages.
    let (_, image) = stage_a.control_at(&env, POINT).await;
    assert!(holder_tags(&image).is_empty(), "control: unstaged");
    // A is still published: the same context again.
    let ctx = publish_to(&rig, &vol.volume_id, "node-a", &cap).await;

    let stage = stage_a.pause_at(POINT, &ctx);
    // It answers while the stage is stuck (held at its failpoint until released below).
    // The bound is for liveness only.
    let started = Instant::now();
    tokio::time::timeout(
        Duration::from_secs(120),
        rig.unpublish(&vol.volume_id, "node-a", true),
    )
    .await
    .expect("the fenced unpublish never answered")
    .expect("the fenced unpublish answers with the stage stuck inside its attach");
    eprintln!("the fenced unpublish answered in {:?}", started.elapsed());
    // The immutable flag is a second layer the fence sets where it can; a
    // backing filesystem without it leaves the marker alone to keep the
    // attach out, which is what is tested here.
    fencecsi_driver::kernel::files::set_immutable(&image, false).unwrap();
    let err = stage
        .finish()
        .await
        .expect_err("the attach the fence overtook is refused");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("fenced while this node attached it"),
        "refused by the check after the attach: {err:?}"
    );
    assert!(
        holders(&image)
            .unwrap()
            .iter()
            .all(|l| is_fenced_device(l, SIZE as u64)),
        "no device shows the fenced generation's data"
    );
    assert!(
        !env.mounts().contains(&stage_a.staging),
        "nothing was mounted for A"
    );
    let b = b_gets_a_new_generation(&env, &rig, &vol.volume_id, &cap).await;

    drop(stage_a);
    detach_delete_and_stop(&env, rig, &b).await;
}

/// ControllerUnpublishVolume with `fence` for a node that has no attachment
/// record (lost, or never written) while loop devices hold the generation:
/// one tagged as that node's, one an admin's. Both are fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_for_a_node_without_a_record_fences_the_holders() {
    require_root!();
    let (env, rig) = start(&["node-b"]).await;
    let cap = block_cap(Access::SingleNodeWriter);
    let vol = rig.create("no-record", SIZE, &cap).await.volume_id;
    let image = generation_path(&env, &vol, 1);
    let (tagged, tagged_guard) = node_losetup(&image, &vol, "node-c", SIZE as u64);
    let (admin, admin_guard) = admin_losetup(&image);
    let devs: Vec<File> = [&tagged, &admin]
        .iter()
        .map(|l| open_rw(&l.device))
        .collect();
    // Positive control: both write the data.
    for (i, d) in devs.iter().enumerate() {
        assert_write_lands(&image, SIZE as u64, &format!("control: holder {i}"), || {
            write_through(d, 0x30 + i as u8, (i as u64 + 1) << 20)
                .expect("control: the holder writes")
        });
    }

    rig.unpublish(&vol, "node-c", true)
        .await
        .expect("the fence is made");
    for l in [&tagged, &admin] {
        let now = loop_device::status(&l.device).unwrap();
        assert!(is_fenced_device(&now, SIZE as u64), "fenced: {now:?}");
    }
    assert_data_unchanged(&image, SIZE as u64, "the data did not change", || {
        for d in &devs {
            assert_writes_fail(d, &[0, 1 << 20, SIZE as u64 - 4096], "fence");
        }
    });
    let b = b_gets_a_new_generation(&env, &rig, &vol, &cap).await;

    drop(devs);
    drop(tagged_guard);
    drop(admin_guard);
    detach_delete_and_stop(&env, rig, &b).await;
}

/// An image from before the trailer existed is exactly its data size, and an
/// old node's device (no size limit) shows all of it. The fence must give
/// the file a trailer while that device holds it and move the device there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_trailer_image_of_exactly_the_data_size_is_fenced() {
    require_root!();
    let (env, rig) = start(&["node-a", "node-b"]).await;
    let cap = block_cap(Access::SingleNodeWriter);
    let (vol, image) = published_to_a(&env, &rig, "pre-trailer", &cap).await;
    // What an older controller left: no trailer at all.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .unwrap()
        .set_len(SIZE as u64)
        .unwrap();
    let (old, guard) = node_losetup(&image, &vol, "node-a", 0);
    assert_eq!(
        old.size_bytes, SIZE as u64,
        "the device shows exactly the data"
    );
    let dev = open_rw(&old.device);
    assert_write_lands(&image, SIZE as u64, "control: it writes", || {
        write_through(&dev, 0x42, SIZE as u64 - 4096).unwrap()
    });

    rig.unpublish(&vol, "node-a", true)
        .await
        .expect("the fence holds for an image without a trailer");
    let now = loop_device::status(&old.device).unwrap();
    assert!(
        is_fenced_device(&now, SIZE as u64),
        "moved into the new trailer: {now:?}"
    );
    assert!(
        std::fs::metadata(&image).unwrap().len() > SIZE as u64,
        "a trailer was added"
    );
    assert_data_unchanged(&image, SIZE as u64, "the data did not change", || {
        assert_writes_fail(&dev, &[0, 4096, SIZE as u64 - 4096], "fence")
    });
    let b = b_gets_a_new_generation(&env, &rig, &vol, &cap).await;

    drop(dev);
    drop(guard);
    detach_delete_and_stop(&env, rig, &b).await;
}

/// A holder left over from an older driver's fence, on an xfs state dir.
struct OldFence {
    vol: String,
    image: PathBuf,
    /// Node A's device: recorded fenced away, still showing the data.
    device: PathBuf,
    _guard: Detach,
}

/// What a driver whose fence was `FS_IMMUTABLE_FL` alone left behind: the
/// generation recorded fenced from node A (fenced_at, fenced-from mark, no
/// attachment) with the flag set, but node A's loop device never remapped,
/// still over the data. Made with today's fence, then undoing its remap
/// (and its marker, which that driver did not write).
async fn old_flag_only_fence(env: &Env, rig: &Rig, name: &str) -> OldFence {
    let cap = block_cap(Access::SingleNodeWriter);
    let (vol, image) = published_to_a(env, rig, name, &cap).await;
    let (old, guard) = node_losetup(&image, &vol, "node-a", SIZE as u64);
    rig.unpublish(&vol, "node-a", true).await.unwrap();
    let undone = loop_device::remap(&old.device, 0, SIZE as u64).unwrap();
    assert!(
        !is_fenced_device(&undone, SIZE as u64) && undone.size_bytes == SIZE as u64,
        "node A's device shows the data again: {undone:?}"
    );
    std::fs::remove_file(fencecsi_driver::fence::marker_path(&image)).unwrap();
    assert!(
        fencecsi_driver::fence::is_frozen(&image).unwrap(),
        "the old fence's flag is set"
    );
    OldFence {
        vol,
        image,
        device: old.device,
        _guard: guard,
    }
}

/// An xfs state dir (the immutable flag does not stop writes through an
/// open file there) under `outer`, and an env on it.
fn xfs_env(outer: &Env) -> Env {
    let mnt = fencecsi_tests::backing_fs(outer, "xfs", 1 << 30);
    let env = Env::new_in(&mnt);
    assert_eq!(fencecsi_driver::fence::fs_name(env.path()), "xfs");
    env
}

/// Ends a test on an [`OldFence`] whose volume was published to node B:
/// detaches node A's device, unpublishes node B, then [`delete_and_stop`].
async fn unpublish_b_delete_and_stop(env: &Env, rig: Rig, old: OldFence) {
    let vol = old.vol.clone();
    drop(old);
    rig.unpublish(&vol, "node-b", false).await.unwrap();
    delete_and_stop(env, rig, &vol).await;
}

/// Records `seqs` as they are in the first bytes of an image (a raw block
/// volume: record `s` at `s * RECORD_SIZE`); those missing or damaged.
fn missing_in(image: &Path, seqs: &[u64]) -> Vec<u64> {
    use fencecsi_tests::records::{missing, RECORD_SIZE};
    let Some(last) = seqs.iter().max().copied() else {
        return Vec::new();
    };
    let mut buf = vec![0u8; (last as usize + 1) * RECORD_SIZE];
    std::fs::File::open(image)
        .unwrap()
        .read_exact_at(&mut buf, 0)
        .unwrap();
    let lost = missing(&buf, last);
    seqs.iter().copied().filter(|s| lost.contains(s)).collect()
}

/// A generation fenced by an older driver (flag only) with node A's device
/// still writing its data, on xfs where the flag does not stop that. The
/// publish to node B must fence that device before it copies the data: the
/// copy is not torn, and nothing A writes from then on reaches the data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_fences_again_what_an_older_drivers_fence_left_writing() {
    require_root!();
    fencecsi_tests::init_tracing();
    let outer = Env::new();
    let env = xfs_env(&outer);
    // No background pass in between: the publish itself must find it.
    let rig = Rig::start_with(&env, &["node-a", "node-b"], |c| {
        c.gc_interval = Duration::from_secs(3600)
    })
    .await;
    let old = old_flag_only_fence(&env, &rig, "old-fence-publish").await;
    let h0 = region_hash(&old.image, SIZE as u64);
    // Node A's application keeps writing fsync'ed records, and discards.
    let writer = fencecsi_tests::writer::Writer::start(
        Path::new(env!("CARGO_BIN_EXE_fencecsi-writer")),
        &old.device,
        false,
        &["--churn", &(40u64 << 20).to_string()],
    );
    wait_until(30, "control: node A's writer runs", || writer.acked() >= 8).await;
    assert_ne!(
        region_hash(&old.image, SIZE as u64),
        h0,
        "control: through the old fence, node A still writes the data"
    );

    let cap = block_cap(Access::SingleNodeWriter);
    let sent = fencecsi_tests::monotonic_ns();
    let ctx = publish_to(&rig, &old.vol, "node-b", &cap).await;
    let returned = fencecsi_tests::monotonic_ns();
    let at = region_hash(&old.image, SIZE as u64);
    let now = loop_device::status(&old.device).unwrap();
    assert!(
        is_fenced_device(&now, SIZE as u64),
        "node A's device is remapped into the trailer: {now:?}"
    );
    let gen_b = ctx_generation(&ctx);
    assert!(gen_b > 1, "node B gets a new generation");
    let image_b = generation_path(&env, &old.vol, gen_b);
    assert_eq!(
        region_hash(&image_b, SIZE as u64),
        at,
        "node B's generation is the fenced data, not a torn copy"
    );
    wait_until(20, "node A's writer must fail after the publish", || {
        writer.errors_since(returned) > 0
    })
    .await;
    assert_eq!(
        region_hash(&old.image, SIZE as u64),
        at,
        "nothing node A wrote after the publish reached the data"
    );
    let report = writer.finish();
    assert!(
        report
            .churn
            .iter()
            .any(|c| c.kind == "discard" && c.ok && c.at < sent),
        "control: a discard through the old fence zeroed data: {:?}",
        report.churn
    );
    // Acknowledged before the publish was sent, or after it returned (then
    // only if durable before the fence): on node B.
    let owed: Vec<u64> = report
        .acks
        .iter()
        .filter(|(_, t)| *t < sent || *t > returned)
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(
        missing_in(&image_b, &owed),
        Vec::<u64>::new(),
        "acknowledged records missing on node B"
    );

    unpublish_b_delete_and_stop(&env, rig, old).await;
}

/// The same leftover found by a controller start: it is fenced before the
/// controller serves, whatever is published next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_start_fences_again_what_an_older_drivers_fence_left_writing() {
    require_root!();
    fencecsi_tests::init_tracing();
    let outer = Env::new();
    let env = xfs_env(&outer);
    let mut rig = Rig::start(&env, &["node-a", "node-b"]).await;
    let old = old_flag_only_fence(&env, &rig, "old-fence-start").await;
    let dev = open_rw(&old.device);
    assert_write_lands(
        &old.image,
        SIZE as u64,
        "control: the write reached the data",
        || {
            write_through(&dev, 0x42, 1 << 20)
                .expect("control: node A writes through the old fence")
        },
    );

    rig.restart_controller(&env).await;
    let now = loop_device::status(&old.device).unwrap();
    assert!(
        is_fenced_device(&now, SIZE as u64),
        "remapped by the time the new controller serves: {now:?}"
    );
    let at = assert_data_unchanged(&old.image, SIZE as u64, "the data did not change", || {
        assert_writes_fail(&dev, &[0, 1 << 20, SIZE as u64 - 4096], "start")
    });
    let cap = block_cap(Access::SingleNodeWriter);
    let gen_b = ctx_generation(&publish_to(&rig, &old.vol, "node-b", &cap).await);
    assert!(gen_b > 1, "node B gets a new generation");
    assert_eq!(
        region_hash(&generation_path(&env, &old.vol, gen_b), SIZE as u64),
        at,
        "node B's generation is the fenced data"
    );

    drop(dev);
    unpublish_b_delete_and_stop(&env, rig, old).await;
}
