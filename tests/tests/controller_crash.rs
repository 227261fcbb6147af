//! The controller plugin killed between two steps of a fenced
//! ControllerUnpublish, a ControllerPublish that makes a new generation,
//! ControllerExpand and garbage collection (a failpoint aborts the real
//! driver binary there), then restarted: the fence held through the crash,
//! the retried call completes, every record the node had synced is on the
//! node that gets the volume, and nothing is left behind. And SIGTERM while a
//! call whose client gave up still runs (stalled in a snapshot's copy): the
//! process stops serving but keeps the state dir, so a second controller is
//! refused until the first is gone.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fencecsi_driver::backend::meta::{MetaStore, VolumeMeta};
use fencecsi_driver::config::Mode;
use fencecsi_driver::failpoint;
use fencecsi_driver::fence::{holders, is_fenced_device, marker_path};
use fencecsi_driver::ids::{Parsed, VolumeId};
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::rig::{create_request, fresh_driver_binary, from_snapshot, Placement, Rig};
use fencecsi_tests::{
    csi, generation_path, mount_cap, region_hash, require_root, wait_for_socket, Access, Env,
    Process,
};

const SIZE: i64 = 64 << 20;
/// xfs' smallest filesystem.
const XFS_SIZE: i64 = 300 << 20;

/// A controller plugin in its own process, `failpoints` armed.
async fn controller(env: &Env, failpoints: &str, gc: Duration) -> (Process, CsiClient) {
    let mut cfg = env.config(Mode::Controller, None, "controller");
    cfg.gc_interval = gc;
    let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
    let p = Process::spawn_with_env(&cfg, &[(failpoint::ENV, failpoints), ("RUST_LOG", &log)]);
    let c = wait_for_socket(&p.socket).await;
    (p, c)
}

/// Waits (bounded) for a plugin that hit its failpoint; checks it aborted.
fn assert_aborted(mut p: Process, fp: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = p.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "{fp}: the controller never crashed"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        status.signal(),
        Some(libc::SIGABRT),
        "{fp}: the controller must have crashed at the failpoint ({status})"
    );
}

/// `n` numbered records written and synced into `dir`, each its own file.
fn write_records(dir: &Path, n: usize) -> Vec<(PathBuf, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let path = dir.join(format!("record-{i}"));
            let body = format!("record {i} ").repeat(2048).into_bytes();
            std::fs::write(&path, &body).unwrap();
            std::fs::File::open(&path).unwrap().sync_all().unwrap();
            (path, body)
        })
        .collect()
}

/// Every record is in `dir`, byte for byte.
fn assert_records(dir: &Path, records: &[(PathBuf, Vec<u8>)], what: &str) {
    for (path, body) in records {
        let here = dir.join(path.file_name().unwrap());
        let got = std::fs::read(&here).unwrap_or_else(|e| panic!("{what}: {here:?}: {e}"));
        assert!(got == *body, "{what}: {here:?} differs");
    }
}

fn write_and_sync(dir: &Path, name: &str) -> std::io::Result<()> {
    std::fs::write(dir.join(name), vec![0x5A; 256 << 10])?;
    std::fs::File::open(dir.join(name))?.sync_all()
}

fn record(env: &Env, vol: &str) -> VolumeMeta {
    let Parsed::Ours(id) = VolumeId::parse(vol).unwrap() else {
        unreachable!()
    };
    MetaStore::read_volume(&env.state_dir(), &id)
        .unwrap()
        .expect("the volume's record")
}

/// The file name of generation `gen`'s image, and of its fence marker.
fn image_name(env: &Env, vol: &str, gen: u64) -> String {
    let p = generation_path(env, vol, gen);
    p.file_name().unwrap().to_string_lossy().into_owned()
}

fn marker_name(env: &Env, vol: &str, gen: u64) -> String {
    let p = marker_path(&generation_path(env, vol, gen));
    p.file_name().unwrap().to_string_lossy().into_owned()
}

/// The generation images and fence markers in the volume's directory.
fn generation_files(env: &Env, vol: &str) -> Vec<String> {
    let dir = generation_path(env, vol, 1).parent().unwrap().to_path_buf();
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("gen-"))
        .collect();
    names.sort();
    names
}

/// One run: a controller process, node plugins A and B in this process, a
/// volume in use on A with synced records.
struct Run {
    env: Env,
    rig: Rig,
    ctl: Option<Process>,
    vol: String,
    a: Placement,
    records: Vec<(PathBuf, Vec<u8>)>,
    cap: csi::VolumeCapability,
    size: i64,
}

impl Run {
    async fn start(failpoints: &str, fs: &str, size: i64, gc: Duration) -> Run {
        fresh_driver_binary();
        fencecsi_tests::init_tracing();
        let env = Env::new();
        let (ctl, client) = controller(&env, failpoints, gc).await;
        let rig = Rig::start_nodes(&env, &["node-a", "node-b"], client).await;
        let cap = mount_cap(Access::SingleNodeWriter, fs);
        let (vol, a) = rig
            .create_attached(&env, "crash", size, &cap, "node-a", "pod-a")
            .await;
        let image = generation_path(&env, &vol.volume_id, a.generation());
        let before = region_hash(&image, size as u64);
        let records = write_records(&a.target, 8);
        assert_ne!(
            region_hash(&image, size as u64),
            before,
            "control: A's records reach the data"
        );
        Run {
            env,
            rig,
            ctl: Some(ctl),
            vol: vol.volume_id,
            a,
            records,
            cap,
            size,
        }
    }

    /// Waits for the crash at `fp`, then starts the controller again with
    /// no failpoint, as its Deployment would.
    async fn restart_after_crash(&mut self, fp: &str, gc: Duration) {
        assert_aborted(self.ctl.take().unwrap(), fp);
        let (ctl, client) = controller(&self.env, "", gc).await;
        self.ctl = Some(ctl);
        self.rig.controller = client;
    }

    /// A's device remapped out of the data, and A's writes fail.
    fn assert_a_fenced(&self, what: &str) {
        let image = generation_path(&self.env, &self.vol, self.a.generation());
        let bytes = self.size as u64;
        let held = holders(&image).unwrap();
        assert!(
            !held.is_empty() && held.iter().all(|l| is_fenced_device(l, bytes)),
            "{what}: A's device is out of the data: {held:?}"
        );
        let at = region_hash(&image, bytes);
        assert!(
            write_and_sync(&self.a.target, "after-fence").is_err(),
            "{what}: A can no longer write"
        );
        assert_eq!(
            region_hash(&image, bytes),
            at,
            "{what}: nothing reached the fenced data"
        );
    }

    /// Node B gets the volume on a new generation with every record.
    async fn b_gets_everything(&self, what: &str) -> Placement {
        let b = self
            .rig
            .attach(&self.env, &self.vol, "node-b", "pod-b", &self.cap)
            .await
            .unwrap_or_else(|e| panic!("{what}: B gets the volume: {e:?}"));
        assert!(
            b.generation() > self.a.generation(),
            "{what}: a new generation"
        );
        assert_records(&b.target, &self.records, what);
        b
    }

    async fn finish(mut self, b: Option<Placement>) {
        match &b {
            Some(b) => {
                // A was fenced: it lets go by force (a no-op when it did).
                self.rig.node_teardown(&self.a, true).await.unwrap();
                self.rig.detach(b).await.unwrap();
            }
            None => self.rig.detach(&self.a).await.unwrap(),
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(e) = self.rig.delete(&self.vol).await {
            assert!(Instant::now() < deadline, "delete: {e:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if let Some(mut c) = self.ctl.take() {
            c.sigterm();
        }
        self.rig.stop().await;
        self.env.assert_clean();
    }
}

const NO_GC: Duration = Duration::from_secs(3600);

/// Killed after the fence, before the record of it: the devices stay fenced
/// through the crash (the kernel holds the remap, not the process), the next
/// start records the fence, and the retried unpublish answers OK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_fence_and_its_record() {
    require_root!();
    const FP: &str = "unpublish:after-fence";
    let mut run = Run::start(FP, "ext4", SIZE, NO_GC).await;
    run.rig
        .unpublish(&run.vol, "node-a", true)
        .await
        .expect_err("the unpublish dies with the controller");
    run.restart_after_crash(FP, NO_GC).await;
    run.assert_a_fenced(FP);
    let gen = run.a.generation();
    assert!(
        record(&run.env, &run.vol).generations[&gen]
            .fenced_at
            .is_some(),
        "the start-up pass recorded the interrupted fence"
    );
    run.rig
        .unpublish(&run.vol, "node-a", true)
        .await
        .expect("the retried unpublish");
    let b = run.b_gets_everything(FP).await;
    run.finish(Some(b)).await;
}

/// Killed after the new generation was copied and recorded, before the
/// attachment: the retried publish hands out that generation, and no other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_new_generation_and_the_attachment() {
    require_root!();
    const FP: &str = "cpublish:after-new-generation";
    let mut run = Run::start(FP, "ext4", SIZE, NO_GC).await;
    run.rig
        .unpublish(&run.vol, "node-a", true)
        .await
        .expect("the fenced unpublish");
    run.assert_a_fenced(FP);
    run.rig
        .publish(&run.vol, "node-b", &run.cap)
        .await
        .expect_err("the publish dies with the controller");
    run.restart_after_crash(FP, NO_GC).await;
    run.assert_a_fenced(FP);
    let b = run.b_gets_everything(FP).await;
    assert_eq!(b.generation(), 2, "the generation the crashed call made");
    assert_eq!(
        generation_files(&run.env, &run.vol),
        [
            image_name(&run.env, &run.vol, 1),
            marker_name(&run.env, &run.vol, 1),
            image_name(&run.env, &run.vol, 2)
        ],
        "no copy made twice"
    );
    run.finish(Some(b)).await;
}

/// Killed after the image grew (before its record) and after the record
/// (before the devices were widened): the retried ControllerExpand and then
/// NodeExpand give the filesystem its new size, with every record intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_in_the_middle_of_an_expansion() {
    require_root!();
    for fp in ["expand:after-grow", "expand:after-record"] {
        let mut run = Run::start(fp, "xfs", XFS_SIZE, NO_GC).await;
        let expand = csi::ControllerExpandVolumeRequest {
            volume_id: run.vol.clone(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 2 * XFS_SIZE,
                limit_bytes: 0,
            }),
            ..Default::default()
        };
        let mut c = run.rig.controller.clone();
        c.controller
            .controller_expand_volume(expand.clone())
            .await
            .expect_err("the expansion dies with the controller");
        run.restart_after_crash(fp, NO_GC).await;
        let mut c = run.rig.controller.clone();
        let got = c
            .controller
            .controller_expand_volume(expand)
            .await
            .unwrap_or_else(|e| panic!("{fp}: the retried expansion: {e:?}"))
            .into_inner();
        assert_eq!(got.capacity_bytes, 2 * XFS_SIZE, "{fp}");
        let mut n = run.rig.node("node-a");
        let grown = n
            .node
            .node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: run.vol.clone(),
                volume_path: run.a.target.to_string_lossy().into(),
                staging_target_path: run.a.staging.to_string_lossy().into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: 2 * XFS_SIZE,
                    limit_bytes: 0,
                }),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("{fp}: NodeExpand: {e:?}"))
            .into_inner();
        assert_eq!(
            grown.capacity_bytes,
            2 * XFS_SIZE,
            "{fp}: the device shows it all"
        );
        let fs = nix::sys::statvfs::statvfs(&run.a.target).unwrap();
        let bytes = fs.blocks() as u64 * fs.fragment_size() as u64;
        assert!(
            bytes > XFS_SIZE as u64,
            "{fp}: the filesystem grew past the old size: {bytes}"
        );
        assert_records(&run.a.target, &run.records, fp);
        write_and_sync(&run.a.target, "after-expand").expect("A still writes");
        run.finish(None).await;
    }
}

/// Garbage collection killed after it removed a released fenced image and
/// before the record (and, at the other failpoint, before the marker): the
/// next start's collection finishes the job, and neither the generation nor
/// its marker is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_in_the_middle_of_garbage_collection() {
    require_root!();
    const GC: Duration = Duration::from_millis(300);
    for fp in ["gc:after-image-removed", "gc:after-remove"] {
        // GC armed from the start: it finds nothing to collect until A lets go.
        let mut run = Run::start(fp, "ext4", SIZE, GC).await;
        run.rig
            .unpublish(&run.vol, "node-a", true)
            .await
            .expect("the fenced unpublish");
        let b = run.b_gets_everything(fp).await;
        let old = generation_path(&run.env, &run.vol, run.a.generation());
        // A comes back and lets go of the fenced generation: now collectable.
        run.rig.node_teardown(&run.a, true).await.unwrap();
        run.restart_after_crash(fp, GC).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        while record(&run.env, &run.vol)
            .generations
            .contains_key(&run.a.generation())
        {
            assert!(Instant::now() < deadline, "{fp}: never collected");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!old.exists(), "{fp}: the image is gone");
        assert!(!marker_path(&old).exists(), "{fp}: so is its marker");
        assert_eq!(
            generation_files(&run.env, &run.vol),
            [image_name(&run.env, &run.vol, 2)],
            "{fp}: only B's generation is left"
        );
        assert_records(&b.target, &run.records, fp);
        run.finish(Some(b)).await;
    }
}

/// The snapshot directories in the state dir.
fn snapshot_dirs(env: &Env) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(env.state_dir().join("snapshots"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Killed after a snapshot's copy, before its record: the next start removes
/// the copy nobody recorded, and the retried CreateSnapshot makes one snapshot
/// that holds every record. The volume was thawed before the crash: A writes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_snapshot_copy_and_its_record() {
    require_root!();
    const FP: &str = "snapshot:after-copy";
    let mut run = Run::start(FP, "ext4", SIZE, NO_GC).await;
    let request = csi::CreateSnapshotRequest {
        name: "snap-crash".into(),
        source_volume_id: run.vol.clone(),
        ..Default::default()
    };
    run.rig
        .controller
        .controller
        .create_snapshot(request.clone())
        .await
        .expect_err("the snapshot dies with the controller");
    assert_eq!(
        snapshot_dirs(&run.env).len(),
        1,
        "control: the crash left the copy behind"
    );
    let freezes: Vec<_> = std::fs::read_dir(run.env.state_dir().join("freezes"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        freezes.is_empty(),
        "the volume was thawed (its record removed) before the crash: {freezes:?}"
    );
    run.restart_after_crash(FP, NO_GC).await;
    assert_eq!(
        snapshot_dirs(&run.env),
        Vec::<String>::new(),
        "the start-up pass removed the unrecorded copy"
    );
    write_and_sync(&run.a.target, "after-crash").expect("A writes after the crash");
    // The retried snapshot must hold this one too: a fresh copy, not the
    // crashed call's.
    run.records
        .push((run.a.target.join("after-crash"), vec![0x5A; 256 << 10]));
    let snap = run
        .rig
        .controller
        .controller
        .create_snapshot(request)
        .await
        .expect("the retried snapshot")
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(
        snapshot_dirs(&run.env),
        std::slice::from_ref(&snap.snapshot_id)
    );
    let restored = run
        .rig
        .create_volume(csi::CreateVolumeRequest {
            volume_content_source: from_snapshot(&snap.snapshot_id),
            ..create_request("restored", SIZE, &run.cap)
        })
        .await
        .unwrap();
    let b = run
        .rig
        .attach(&run.env, &restored.volume_id, "node-b", "pod-b", &run.cap)
        .await
        .unwrap();
    assert_records(&b.target, &run.records, FP);
    run.rig.detach_and_delete(&b).await.unwrap();
    run.rig.delete_snapshot(snap.snapshot_id).await;
    run.finish(None).await;
}

/// Whether a thread of `pid` waits at a stall point.
fn stalled(pid: u32) -> bool {
    fencecsi_tests::has_thread_named(pid, failpoint::STALLED_THREAD)
}

/// Whether no process holds the state dir's ownership lock now (asked of the kernel).
fn ownership_is_free(env: &Env) -> bool {
    fencecsi_driver::locks::owner_of(&env.state_dir())
        .expect("reading the ownership lock")
        .is_none()
}

/// SIGTERM while a call whose client gave up still runs: the controller stops
/// serving but keeps the state dir until that call has returned, so a second
/// controller started meanwhile is refused (it could otherwise write records the
/// old call then overwrites). Once the old process is gone, the second starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_an_abandoned_call_keeps_the_state_dir_until_it_returns() {
    require_root!();
    fresh_driver_binary();
    let env = Env::new();
    // A snapshot's copy stalls for good (no filesystem frozen: the volume is idle).
    let (mut first, mut ctl) = controller(&env, "quiesce:copying", Duration::from_secs(3600)).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = ctl
        .controller
        .create_volume(fencecsi_tests::rig::create_request("idle", SIZE, &cap))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let req = csi::CreateSnapshotRequest {
        name: "snap".into(),
        source_volume_id: vol.clone(),
        ..Default::default()
    };
    let mut c = ctl.clone();
    let abandoned = tokio::spawn(async move { c.controller.create_snapshot(req).await });
    let pid = first.child.id();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !stalled(pid) {
        assert!(
            Instant::now() < deadline,
            "the snapshot never reached its copy"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The client gives up on the call; its thread runs on in the controller.
    abandoned.abort();
    let _ = abandoned.await;
    // Our connection goes too, so the server's drain does not wait for it.
    drop(ctl);

    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    // The server stops (its socket goes last, after it gave up what it may)...
    let deadline = Instant::now() + Duration::from_secs(30);
    while first.socket.exists() {
        assert!(
            Instant::now() < deadline,
            "the controller never stopped serving"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...but the process lives on with the call, and keeps the state dir.
    assert!(
        first.child.try_wait().unwrap().is_none(),
        "the process exited with a call still running"
    );
    assert!(
        !ownership_is_free(&env),
        "the state dir was given up with a call still running"
    );
    let mut cfg = env.config(Mode::Controller, None, "second");
    cfg.gc_interval = Duration::from_secs(3600);
    let mut second = Process::spawn(&cfg);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = second.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "a second controller started beside one still running a call"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        !status.success(),
        "the second controller is refused: {status}"
    );
    // Refused for the ownership, not for anything else: it never served, and the
    // lock still names the first.
    assert!(
        !second.socket.exists(),
        "the refused controller made its socket"
    );
    let owner = fencecsi_driver::locks::owner_of(&env.state_dir()).unwrap();
    assert_eq!(
        owner.map(|h| h.pid),
        Some(pid),
        "the ownership lock names its owner"
    );

    // Positive control: with the old process gone, the state dir is free and a
    // controller starts on it and serves its volume.
    first.kill9();
    assert!(
        ownership_is_free(&env),
        "the kernel let go with the process"
    );
    let mut third = Process::spawn(&cfg);
    let mut c3 = wait_for_socket(&third.socket).await;
    let listed = c3
        .controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert!(
        listed
            .iter()
            .any(|e| e.volume.as_ref().is_some_and(|v| v.volume_id == vol)),
        "the new controller serves the volume: {listed:?}"
    );
    c3.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: vol,
            ..Default::default()
        })
        .await
        .unwrap();
    third.sigterm();
    env.assert_clean();
}
