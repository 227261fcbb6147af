//! A filesystem freeze never outlives the operation that made it
//! (`controller::quiesce`). On an ext4 state dir (no reflinks: a snapshot of
//! a volume in use is a full copy with the volume's filesystem frozen):
//!
//! - the real controller, a separate process, is SIGKILLed while it copies a
//!   volume a writer is appending fsync'ed records to (a stall point holds
//!   the copy with the filesystem frozen). The kernel shows the freeze
//!   outliving the process (the writer is blocked in D state and acknowledges
//!   nothing); the restarted controller thaws it before it serves (the writer
//!   goes on within a bound), the freeze record is gone, a retried
//!   CreateSnapshot succeeds and holds every record acknowledged before it
//!   was asked for, and every acknowledged record is in the volume;
//! - the same kill in the middle of a group snapshot of two volumes in use,
//!   each with its writer: every member is frozen before the first copy, so
//!   one record names both filesystems and both writers are blocked in D
//!   state after the kill; the restarted controller thaws both (each writer
//!   goes on within the bound) and removes the interrupted copy, and the
//!   retried CreateVolumeGroupSnapshot succeeds with each member holding
//!   every record acknowledged before it was asked for;
//! - the same kill in the middle of a live clone (CreateVolume from a volume
//!   in use): the source is thawed at the restart, the interrupted creation
//!   is gone (record and data), and the retried clone succeeds and holds
//!   every record acknowledged before it was asked for;
//! - a filesystem someone else froze is left to them: the snapshot is refused
//!   with that reason (not "a mount this controller cannot see"), and neither
//!   the refusal nor a controller restart thaws it;
//! - a freeze is let go at `--max-freeze` even while the copy is held: the
//!   writer goes on, and the copy is refused and leaves nothing;
//! - a controller paused mid-copy (its cgroup frozen) is taken over by a replica that
//!   leads, through its kill switch: the new leader thaws the filesystem before it
//!   serves, though the paused one still holds the freeze record's lock, and the paused
//!   one dies of the SIGKILL the kernel held for it once it runs again;
//! - a leader that loses its Lease mid-copy thaws what the copy froze as it
//!   gives up, and the abandoned copy is refused and leaves nothing.
//!
//! Writers run in child processes, so a D-state write never hangs the test
//! itself; every test thaws the volume's filesystem as a last resort before
//! its teardown, failing or not.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fencecsi_cluster::k8s_openapi::api::coordination::v1::Lease;
use fencecsi_driver::config::{Config, Mode};
use fencecsi_driver::controller::FP_COPYING;
use fencecsi_driver::failpoint;
use fencecsi_embedded_cluster::EmbeddedCluster;
use fencecsi_fence::kernel::test_freezer::{shared_pending, Freezer, SIGKILL_PENDING};
use fencecsi_proto::client::CsiClient;
use fencecsi_proto::v1::group_controller_client::GroupControllerClient;
use fencecsi_tests::records::{check, missing, RECORD_SIZE};
use fencecsi_tests::replica::{replica_config, Replica, NS};
use fencecsi_tests::rig::{
    create_request, fresh_driver_binary, from_snapshot, from_volume, volume_ids, Placement, Rig,
};
use fencecsi_tests::writer::Writer;
use fencecsi_tests::{
    csi, monotonic_ns, mount_cap, require_root, wait_for_socket, Access, Env, Process,
};
use tonic::Code;

const SIZE: i64 = 256 << 20;
const FIFREEZE: libc::c_ulong = 0xC004_5877;
const FITHAW: libc::c_ulong = 0xC004_5878;
/// How long the writer may take to go on once the restarted controller serves (or the
/// freeze is let go): a bound on liveness, normally well under a second.
const RESUME_BOUND: Duration = Duration::from_secs(60);

fn ioctl(path: &Path, op: libc::c_ulong) -> std::io::Result<()> {
    let dir = File::open(path)?;
    // SAFETY: ioctl on a directory fd we own; the argument is unused.
    if unsafe { libc::ioctl(dir.as_raw_fd(), op, 0) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Thaws the filesystems at these mounts when dropped (the last resort, so
/// that a failing test leaves nothing frozen; EINVAL, not frozen, is fine).
/// Declared after the writer, so it drops first and the writer can be reaped.
struct ThawOnDrop(Vec<PathBuf>);
impl Drop for ThawOnDrop {
    fn drop(&mut self) {
        for m in &self.0 {
            match ioctl(m, FITHAW) {
                Ok(()) => eprintln!("test clean-up thawed {}", m.display()),
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => {}
                Err(e) => eprintln!("test clean-up: cannot thaw {}: {e}", m.display()),
            }
        }
    }
}

fn ext4_backing() -> (Env, Env) {
    fencecsi_tests::init_tracing();
    let outer = Env::new();
    let mnt = fencecsi_tests::backing_fs(&outer, "ext4", 2 << 30);
    let env = Env::new_in(&mnt);
    (outer, env)
}

fn records_file(p: &Placement) -> PathBuf {
    p.target.join("records.log")
}

fn start_writer(p: &Placement) -> Writer {
    Writer::start(
        Path::new(env!("CARGO_BIN_EXE_fencecsi-writer")),
        &records_file(p),
        false,
        &["--interval-ms", "2"],
    )
}

async fn wait_acked(w: &Writer, n: u64, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    while w.acked() < n {
        assert!(
            Instant::now() < deadline,
            "{what}: {} records acknowledged, {n} expected within {within:?}",
            w.acked()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The process state letter (R, S, D, ...) and wait channel of `pid`.
fn proc_state(pid: u32) -> (char, String) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next())
        .unwrap_or('?');
    let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
    (state, wchan)
}

/// Waits until the state dir holds no freeze record: its removal follows the thaw, so a
/// writer that goes on does not say it is done yet.
async fn wait_no_freeze_records(env: &Env, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !freeze_records(env).is_empty() {
        assert!(
            Instant::now() < deadline,
            "{what}: {:?}",
            freeze_records(env)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The freeze records in the state dir.
fn freeze_records(env: &Env) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(env.state_dir().join("freezes"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    v.sort();
    v
}

fn snapshot_dirs(env: &Env) -> Vec<String> {
    std::fs::read_dir(env.state_dir().join("snapshots"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// CreateSnapshot; the future owns what it needs (to be spawned).
fn snapshot(
    mut c: CsiClient,
    name: &str,
    vol: &str,
) -> impl std::future::Future<Output = Result<csi::Snapshot, tonic::Status>> + Send + 'static {
    let req = csi::CreateSnapshotRequest {
        name: name.into(),
        source_volume_id: vol.into(),
        ..Default::default()
    };
    async move {
        c.controller
            .create_snapshot(req)
            .await
            .map(|r| r.into_inner().snapshot.unwrap())
    }
}

/// Whether a thread of `pid` waits at a stall point.
fn stalled(pid: u32) -> bool {
    fencecsi_tests::has_thread_named(pid, failpoint::STALLED_THREAD)
}

/// Records 0..k intact with nothing after k, and k >= `before`.
fn assert_prefix(data: &[u8], before: u64, what: &str) {
    let n = (data.len() / RECORD_SIZE) as u64;
    let at = |s: u64| {
        let o = s as usize * RECORD_SIZE;
        check(&data[o..o + RECORD_SIZE], s)
    };
    let k = (0..n).take_while(|s| at(*s)).count() as u64;
    assert!(
        !(k..n).any(at),
        "{what}: records after a gap: not one instant"
    );
    assert!(
        k >= before && before > 0,
        "{what}: {k} records, {before} acknowledged before it was asked for"
    );
}

// ---------------------------------------------------------------- a controller killed mid-copy

fn log_filter() -> String {
    std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into())
}

/// The real controller binary, a process of its own, with the stall point
/// `quiesce:copying` armed: a copy holds there, its filesystems frozen, until
/// the test SIGKILLs it. Returns its configuration (for the restart) and its
/// client.
async fn crashing_controller(env: &Env) -> (Config, Process, CsiClient) {
    fresh_driver_binary();
    let mut cfg = env.config(Mode::Controller, None, "controller");
    // The kill, not the bound, must end this freeze.
    cfg.max_freeze = Duration::from_secs(600);
    let crashing = Process::spawn_with_env(
        &cfg,
        &[(failpoint::ENV, FP_COPYING), ("RUST_LOG", &log_filter())],
    );
    let ctl = wait_for_socket(&crashing.socket).await;
    (cfg, crashing, ctl)
}

/// Waits until a copy in `controller` holds at its stall point.
async fn wait_stalled(controller: &Process) {
    let pid = controller.child.id();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !stalled(pid) {
        assert!(
            Instant::now() < deadline,
            "the copy never reached its stall point"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The one freeze record in the state dir names the controller `pid` and,
/// for each (volume, staging mount), a filesystem of that volume mounted
/// there, and nothing else: what a restart must thaw.
fn assert_recorded(env: &Env, pid: u32, frozen: &[(&str, &Path)]) {
    let records = freeze_records(env);
    assert_eq!(records.len(), 1, "one freeze record: {records:?}");
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&records[0]).unwrap()).unwrap();
    assert_eq!(rec["owner"]["pid"], pid, "{rec}");
    let filesystems = rec["filesystems"].as_array().unwrap();
    assert_eq!(filesystems.len(), frozen.len(), "{rec}");
    for (vol, staging) in frozen {
        let fs = filesystems
            .iter()
            .find(|f| f["volume"].as_str() == Some(*vol))
            .unwrap_or_else(|| panic!("the record names no filesystem of {vol}: {rec}"));
        let named: Vec<&str> = fs["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["path"].as_str())
            .collect();
        assert!(
            named.contains(&staging.to_str().unwrap()),
            "the record names the staging mount of {vol}: {rec}"
        );
    }
}

/// Positive control, on the kernel: the freeze outlived the killed
/// controller. Each writer sits in D state and acknowledges no write begun
/// since the kill (judged on the writer's own stamps: a line read late from
/// its pipe is no write). Returns what each had acknowledged.
async fn assert_blocked(writers: &[&Writer], killed_at: Instant) -> Vec<u64> {
    // The freeze was in place before the controller was killed.
    let since = monotonic_ns();
    for (i, w) in writers.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (state, wchan) = proc_state(w.pid());
            if state == 'D' {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "writer {i} is not blocked in the kernel (state {state}, wchan {wchan})"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // And stays so a while.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (i, w) in writers.iter().enumerate() {
        let (state, wchan) = proc_state(w.pid());
        assert_eq!(
            w.acked_started_after(since),
            0,
            "writer {i} went on: nothing was frozen (state {state}, wchan {wchan})"
        );
        assert_eq!(
            state, 'D',
            "writer {i} is not blocked in the kernel (wchan {wchan})"
        );
        eprintln!(
            "writer {i} frozen {:?} after the kill: state {state}, wchan {wchan}",
            killed_at.elapsed()
        );
    }
    writers.iter().map(|w| w.acked()).collect()
}

/// Starts the controller again on the same state dir (no failpoint) and
/// waits for every writer to go on: the restart thawed what the killed one
/// froze. Its freeze record is gone. Returns the new controller.
async fn restart_and_resume(
    cfg: &Config,
    rig: &mut Rig,
    env: &Env,
    writers: &[&Writer],
    acked: &[u64],
) -> Process {
    let started = Instant::now();
    let restarted = Process::spawn_with_env(cfg, &[("RUST_LOG", &log_filter())]);
    rig.controller = wait_for_socket(&restarted.socket).await;
    let serving = started.elapsed();
    for (i, (w, a)) in writers.iter().zip(acked).enumerate() {
        wait_acked(
            w,
            a + 20,
            RESUME_BOUND,
            &format!("writer {i} after the controller's restart"),
        )
        .await;
    }
    eprintln!(
        "controller serving {serving:?} after its restart; writers going on {:?} after it",
        started.elapsed()
    );
    wait_no_freeze_records(env, "the settled record is gone").await;
    restarted
}

/// Stops the writer of the volume `p`: it saw no error, and every record it
/// acknowledged is in the volume. Returns how many it acknowledged before
/// `asked` (CLOCK_MONOTONIC ns).
fn stop_and_check(w: Writer, p: &Placement, asked: u64) -> u64 {
    let (acks, errors) = w.stop();
    assert_eq!(errors, 0, "the writer of {} saw errors", p.volume_id);
    let data = std::fs::read(records_file(p)).unwrap();
    let last = acks.last().unwrap().0;
    assert_eq!(
        missing(&data, last),
        Vec::<u64>::new(),
        "acknowledged records missing from {}",
        p.volume_id
    );
    acks.iter().filter(|(_, t)| *t < asked).count() as u64
}

/// The volume `p` read back on node-a: one instant holding the `before`
/// records acknowledged before it was asked for (`what`); then deleted.
async fn assert_holds(rig: &Rig, env: &Env, volume_id: &str, before: u64, what: &str) {
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let p = rig
        .attach(env, volume_id, "node-a", &format!("pod-{volume_id}"), &cap)
        .await
        .unwrap();
    assert_prefix(&std::fs::read(records_file(&p)).unwrap(), before, what);
    rig.detach_and_delete(&p).await.unwrap();
}

/// Restores `snapshot_id` into a new volume and checks it with [`assert_holds`].
async fn assert_snapshot_holds(rig: &Rig, env: &Env, snapshot_id: &str, before: u64, what: &str) {
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let restored = rig
        .create_volume(csi::CreateVolumeRequest {
            volume_content_source: from_snapshot(snapshot_id),
            ..create_request(&format!("restored-{snapshot_id}"), SIZE, &cap)
        })
        .await
        .unwrap();
    assert_holds(rig, env, &restored.volume_id, before, what).await;
}

/// CreateVolumeGroupSnapshot of `vols` on the controller at `socket`; the
/// future owns what it needs (to be spawned).
fn group_snapshot(
    socket: &Path,
    name: &str,
    vols: &[&str],
) -> impl std::future::Future<Output = Result<csi::VolumeGroupSnapshot, tonic::Status>> + Send + 'static
{
    let socket = socket.to_path_buf();
    let req = csi::CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: vols.iter().map(|v| v.to_string()).collect(),
        ..Default::default()
    };
    async move {
        let channel = fencecsi_proto::client::connect(&socket)
            .await
            .map_err(|e| tonic::Status::unavailable(format!("connecting: {e}")))?;
        GroupControllerClient::new(channel)
            .create_volume_group_snapshot(req)
            .await
            .map(|r| r.into_inner().group_snapshot.unwrap())
    }
}

/// CreateVolume `name` as a clone of `source` (a volume); the future owns
/// what it needs (to be spawned).
fn clone_volume(
    mut c: CsiClient,
    name: &str,
    source: &str,
) -> impl std::future::Future<Output = Result<csi::Volume, tonic::Status>> + Send + 'static {
    let req = csi::CreateVolumeRequest {
        volume_content_source: from_volume(source),
        ..create_request(name, SIZE, &mount_cap(Access::SingleNodeWriter, "ext4"))
    };
    async move {
        c.controller
            .create_volume(req)
            .await
            .map(|r| r.into_inner().volume.unwrap())
    }
}

/// The volume directories in the state dir.
fn volume_dirs(env: &Env) -> BTreeSet<String> {
    std::fs::read_dir(env.state_dir().join("volumes"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// A volume on node-a with a writer at work, and a snapshot of it held in its copy.
struct MidCopy {
    rig: Rig,
    vol: String,
    p: Placement,
    writer: Writer,
    thaw: ThawOnDrop,
    call: tokio::task::JoinHandle<Result<csi::Snapshot, tonic::Status>>,
}

/// Attaches a volume on node-a through `controller` (at `ctl`), starts its writer, and asks
/// for a snapshot: it freezes the filesystem and stalls in its copy, and its freeze record
/// names the filesystem and the controller.
async fn stalled_mid_copy(env: &Env, controller: &Process, ctl: CsiClient) -> MidCopy {
    let rig = Rig::start_nodes(env, &["node-a"], ctl).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, p) = rig
        .create_attached(env, "frozen", SIZE, &cap, "node-a", "pod-a")
        .await;
    let vol = vol.volume_id;
    let writer = start_writer(&p);
    let thaw = ThawOnDrop(vec![p.staging.clone(), p.target.clone()]);
    wait_acked(&writer, 50, Duration::from_secs(30), "before the snapshot").await;
    let call = tokio::spawn(snapshot(rig.controller.clone(), "snap", &vol));
    wait_stalled(controller).await;
    assert_recorded(env, controller.child.id(), &[(&vol, &p.staging)]);
    MidCopy {
        rig,
        vol,
        p,
        writer,
        thaw,
        call,
    }
}

/// Stops the writer of [`stalled_mid_copy`]'s volume (nothing acknowledged lost), checks
/// that the retried snapshot `snap` is one instant holding what was acknowledged before it
/// was asked for (`asked`), and removes both.
async fn check_and_remove(
    rig: &Rig,
    env: &Env,
    writer: Writer,
    p: &Placement,
    asked: u64,
    snap: csi::Snapshot,
) {
    let before = stop_and_check(writer, p, asked);
    assert_snapshot_holds(rig, env, &snap.snapshot_id, before, "the retried snapshot").await;
    rig.detach_and_delete(p).await.unwrap();
    rig.delete_snapshot(snap.snapshot_id).await;
}

/// The controller SIGKILLed in the middle of a snapshot's copy, with the
/// volume's filesystem frozen: the restarted controller thaws it before it
/// serves, and the retried snapshot succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freeze_left_by_a_killed_controller_is_thawed_at_its_restart() {
    require_root!();
    let (outer, env) = ext4_backing();
    let (ccfg, mut crashing, ctl) = crashing_controller(&env).await;
    let MidCopy {
        mut rig,
        vol,
        p,
        writer,
        thaw: _thaw,
        call,
    } = stalled_mid_copy(&env, &crashing, ctl).await;

    crashing.kill9();
    let killed_at = Instant::now();
    assert!(
        call.await.unwrap().is_err(),
        "the snapshot must die with the controller"
    );
    let acked = assert_blocked(&[&writer], killed_at).await;
    let restarted = restart_and_resume(&ccfg, &mut rig, &env, &[&writer], &acked).await;

    // The retried snapshot succeeds (no filesystem is still frozen to answer EBUSY).
    let asked = monotonic_ns();
    let snap = snapshot(rig.controller.clone(), "snap", &vol)
        .await
        .expect("the retried snapshot");
    let more = writer.acked() + 20;
    wait_acked(&writer, more, RESUME_BOUND, "the writer after the snapshot").await;
    assert_eq!(freeze_records(&env), Vec::<PathBuf>::new());
    check_and_remove(&rig, &env, writer, &p, asked, snap).await;
    drop(restarted);
    rig.stop().await;
    env.assert_clean();
    drop(env);
    drop(outer);
}

/// The controller frozen (its node paused) in the middle of a snapshot's copy, with the
/// volume's filesystem frozen: it can neither thaw nor let go of the state dir, and its
/// freeze record's lock stays held. A replica that leads takes the state dir over through
/// the frozen controller's kill switch (the kernel then holds SIGKILL pending for it), and
/// thaws the filesystem before it serves, keeping the record while its lock is held. The
/// volume's attachments lock, which the paused
/// controller took for its copy, stays its own until it runs again (not covered: calls that
/// need it are refused meanwhile). Thawed, the former controller dies of that SIGKILL,
/// nothing it held is frozen again, and the retried snapshot succeeds on the new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_controller_is_taken_over_and_its_freeze_thawed_by_the_new_leader() {
    require_root!();
    if !Freezer::available() {
        return;
    }
    let (outer, env) = ext4_backing();
    let (_, mut frozen, ctl) = crashing_controller(&env).await;
    let MidCopy {
        mut rig,
        vol,
        p,
        writer,
        thaw: _thaw,
        call,
    } = stalled_mid_copy(&env, &frozen, ctl).await;
    let pid = frozen.child.id();
    let paused_node = Freezer::new("controller");
    paused_node.add(pid);
    paused_node.freeze();
    // Positive control: the freeze holds while its controller is paused.
    let acked = assert_blocked(&[&writer], Instant::now()).await;
    assert_eq!(
        shared_pending(pid) & SIGKILL_PENDING,
        0,
        "nothing killed it yet"
    );

    let cluster = EmbeddedCluster::new();
    let mut leader = Replica::start_with(replica_config(&env, "leader"), &cluster);
    rig.controller = leader.wait_leading(Duration::from_secs(60)).await;
    assert_ne!(
        shared_pending(pid) & SIGKILL_PENDING,
        0,
        "the kernel holds SIGKILL pending for the paused controller"
    );
    assert_eq!(
        fencecsi_driver::locks::owner_of(&env.state_dir())
            .unwrap()
            .map(|h| h.pid),
        Some(std::process::id()),
        "the state dir is the new leader's"
    );
    // Thawed before the new leader served, though the record's lock is still held.
    wait_acked(
        &writer,
        acked[0] + 20,
        RESUME_BOUND,
        "the writer after the takeover",
    )
    .await;
    // Kept while the paused controller holds its lock (it may still be finishing a
    // FIFREEZE in the kernel); settled once it is gone.
    assert_eq!(freeze_records(&env).len(), 1, "the held record is kept");

    // Not covered: the paused controller still holds the volume's attachments lock (the
    // copy took it), which no one can take from it; calls that need it are refused, within
    // their bound, until it runs again and dies.
    let held = snapshot(rig.controller.clone(), "snap", &vol)
        .await
        .expect_err("the volume's lock is the paused controller's");
    assert_eq!(held.code(), Code::Aborted, "{held:?}");
    assert!(held.message().contains("attachments lock"), "{held:?}");

    // The paused node runs again: its controller dies before it acts, and its locks go.
    paused_node.thaw();
    let status = tokio::task::block_in_place(|| frozen.child.wait()).unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
    assert!(call.await.unwrap().is_err(), "its snapshot died with it");
    let asked = monotonic_ns();
    let snap = snapshot(rig.controller.clone(), "snap", &vol)
        .await
        .expect("the retried snapshot, on the new leader");
    let more = writer.acked() + 20;
    wait_acked(
        &writer,
        more,
        RESUME_BOUND,
        "the writer after the old controller's end",
    )
    .await;
    assert_eq!(freeze_records(&env), Vec::<PathBuf>::new());
    check_and_remove(&rig, &env, writer, &p, asked, snap).await;
    rig.stop().await;
    leader.stop().await;
    drop(paused_node);
    env.assert_clean();
    drop(env);
    drop(outer);
}

/// The same kill in the middle of a group snapshot of two volumes in use:
/// every member's filesystem is frozen together before the first copy, so
/// the kill leaves both frozen (one record naming both); the restarted
/// controller thaws both, and the retried group snapshot succeeds with each
/// member holding what was acknowledged before it was asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_snapshots_freeze_left_by_a_killed_controller_is_thawed_at_its_restart() {
    require_root!();
    let (outer, env) = ext4_backing();
    let (ccfg, mut crashing, ctl) = crashing_controller(&env).await;
    let mut rig = Rig::start_nodes(&env, &["node-a"], ctl).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (va, pa) = rig
        .create_attached(&env, "member-a", SIZE, &cap, "node-a", "pod-a")
        .await;
    let (vb, pb) = rig
        .create_attached(&env, "member-b", SIZE, &cap, "node-a", "pod-b")
        .await;
    let (va, vb) = (va.volume_id, vb.volume_id);
    let wa = start_writer(&pa);
    let wb = start_writer(&pb);
    let _thaw = ThawOnDrop(vec![
        pa.staging.clone(),
        pa.target.clone(),
        pb.staging.clone(),
        pb.target.clone(),
    ]);
    for w in [&wa, &wb] {
        wait_acked(w, 50, Duration::from_secs(30), "before the group snapshot").await;
    }

    // Both members are frozen before the first copy, which stalls.
    let call = tokio::spawn(group_snapshot(&crashing.socket, "group", &[&va, &vb]));
    wait_stalled(&crashing).await;
    assert_recorded(
        &env,
        crashing.child.id(),
        &[(&va, &pa.staging), (&vb, &pb.staging)],
    );

    crashing.kill9();
    let killed_at = Instant::now();
    assert!(
        call.await.unwrap().is_err(),
        "the group snapshot must die with the controller"
    );
    let acked = assert_blocked(&[&wa, &wb], killed_at).await;
    let restarted = restart_and_resume(&ccfg, &mut rig, &env, &[&wa, &wb], &acked).await;
    assert_eq!(
        snapshot_dirs(&env),
        Vec::<String>::new(),
        "the interrupted copy is removed at the restart"
    );

    // The retried group snapshot succeeds.
    let asked = monotonic_ns();
    let group = group_snapshot(&restarted.socket, "group", &[&va, &vb])
        .await
        .expect("the retried group snapshot");
    assert!(group.ready_to_use, "{group:?}");
    for w in [&wa, &wb] {
        let more = w.acked() + 20;
        wait_acked(w, more, RESUME_BOUND, "a writer after the group snapshot").await;
    }
    assert_eq!(freeze_records(&env), Vec::<PathBuf>::new());
    for (w, p, vol) in [(wa, &pa, &va), (wb, &pb, &vb)] {
        let before = stop_and_check(w, p, asked);
        let member = group
            .snapshots
            .iter()
            .find(|s| s.source_volume_id == *vol)
            .unwrap_or_else(|| panic!("no member for {vol}: {group:?}"));
        assert_snapshot_holds(
            &rig,
            &env,
            &member.snapshot_id,
            before,
            &format!("the retried group's member of {vol}"),
        )
        .await;
    }
    GroupControllerClient::new(
        fencecsi_proto::client::connect(&restarted.socket)
            .await
            .unwrap(),
    )
    .delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: group.group_snapshot_id.clone(),
        snapshot_ids: group
            .snapshots
            .iter()
            .map(|s| s.snapshot_id.clone())
            .collect(),
        ..Default::default()
    })
    .await
    .unwrap();
    rig.detach_and_delete(&pa).await.unwrap();
    rig.detach_and_delete(&pb).await.unwrap();
    drop(restarted);
    rig.stop().await;
    env.assert_clean();
    drop(env);
    drop(outer);
}

/// The same kill in the middle of a live clone (CreateVolume from a volume in
/// use): the restarted controller thaws the source before it serves and
/// removes the interrupted creation, and the retried clone succeeds and holds
/// what was acknowledged before it was asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_clones_freeze_left_by_a_killed_controller_is_thawed_at_its_restart() {
    require_root!();
    let (outer, env) = ext4_backing();
    let (ccfg, mut crashing, ctl) = crashing_controller(&env).await;
    let mut rig = Rig::start_nodes(&env, &["node-a"], ctl).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, p) = rig
        .create_attached(&env, "source", SIZE, &cap, "node-a", "pod-a")
        .await;
    let vol = vol.volume_id;
    let writer = start_writer(&p);
    let _thaw = ThawOnDrop(vec![p.staging.clone(), p.target.clone()]);
    wait_acked(&writer, 50, Duration::from_secs(30), "before the clone").await;

    let call = tokio::spawn(clone_volume(rig.controller.clone(), "clone", &vol));
    wait_stalled(&crashing).await;
    assert_recorded(&env, crashing.child.id(), &[(&vol, &p.staging)]);

    crashing.kill9();
    let killed_at = Instant::now();
    assert!(
        call.await.unwrap().is_err(),
        "the clone must die with the controller"
    );
    let acked = assert_blocked(&[&writer], killed_at).await;
    let restarted = restart_and_resume(&ccfg, &mut rig, &env, &[&writer], &acked).await;
    // The creation the kill interrupted is gone, record and data.
    let only_source = BTreeSet::from([vol.clone()]);
    assert_eq!(volume_ids(&mut rig.controller.clone()).await, only_source);
    assert_eq!(
        volume_dirs(&env),
        only_source,
        "the interrupted clone's data"
    );

    // The retried clone (same name) succeeds.
    let asked = monotonic_ns();
    let clone = clone_volume(rig.controller.clone(), "clone", &vol)
        .await
        .expect("the retried clone");
    let more = writer.acked() + 20;
    wait_acked(&writer, more, RESUME_BOUND, "the writer after the clone").await;
    assert_eq!(freeze_records(&env), Vec::<PathBuf>::new());
    let before = stop_and_check(writer, &p, asked);
    assert_holds(&rig, &env, &clone.volume_id, before, "the retried clone").await;
    rig.detach_and_delete(&p).await.unwrap();
    drop(restarted);
    rig.stop().await;
    env.assert_clean();
    drop(env);
    drop(outer);
}

/// A filesystem someone else froze: the snapshot is refused with that
/// reason, and the controller thaws it neither then nor at its restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filesystem_someone_else_froze_is_refused_as_such_and_left_to_them() {
    require_root!();
    let (outer, env) = ext4_backing();
    let mut rig = Rig::start(&env, &["node-a"]).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, p) = rig
        .create_attached(&env, "theirs", 64 << 20, &cap, "node-a", "pod-a")
        .await;
    let vol = vol.volume_id;
    std::fs::write(p.target.join("data"), b"before their freeze").unwrap();
    let _thaw = ThawOnDrop(vec![p.staging.clone()]);
    ioctl(&p.staging, FIFREEZE).expect("freezing it as someone else would");

    let err = snapshot(rig.controller.clone(), "snap", &vol)
        .await
        .expect_err("no point-in-time copy of a filesystem someone else froze, without reflinks");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let msg = err.message();
    assert!(
        msg.contains("already frozen") && msg.contains("EBUSY"),
        "the true reason: {msg}"
    );
    assert!(!msg.contains("cannot see"), "a wrong reason: {msg}");
    assert_eq!(
        snapshot_dirs(&env),
        Vec::<String>::new(),
        "refused, yet left a copy"
    );
    assert_eq!(
        freeze_records(&env),
        Vec::<PathBuf>::new(),
        "their freeze is not in a record"
    );

    // A restart (its start-up pass) leaves it frozen too.
    rig.restart_controller(&env).await;
    ioctl(&p.staging, FITHAW)
        .expect("still frozen: the controller thawed a freeze it did not make");

    // Thawed by whoever froze it: the snapshot goes through.
    let snap = snapshot(rig.controller.clone(), "snap", &vol)
        .await
        .expect("a snapshot once thawed");
    rig.delete_snapshot(snap.snapshot_id).await;
    rig.detach_and_delete(&p).await.unwrap();
    rig.stop().await;
    env.assert_clean();
    drop(env);
    drop(outer);
}

/// A copy held with the filesystem frozen: the watchdog lets the writers go
/// at `--max-freeze` though the call has not ended, and the copy is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freeze_is_let_go_at_its_bound() {
    require_root!();
    let (outer, env) = ext4_backing();
    let bound = Duration::from_secs(1);
    let rig = Rig::start_with(&env, &["node-a"], |c| c.max_freeze = bound).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, p) = rig
        .create_attached(&env, "bounded", 64 << 20, &cap, "node-a", "pod-a")
        .await;
    let vol = vol.volume_id;
    let writer = start_writer(&p);
    let _thaw = ThawOnDrop(vec![p.staging.clone()]);
    wait_acked(&writer, 50, Duration::from_secs(30), "before the snapshot").await;

    let paused = failpoint::arm_pause("snapshot:before-copy", &vol);
    let call = tokio::spawn(snapshot(rig.controller.clone(), "snap", &vol));
    let (reached, paused) =
        tokio::task::spawn_blocking(move || (paused.wait_reached(Duration::from_secs(30)), paused))
            .await
            .unwrap();
    assert!(reached, "the snapshot reached its copy");
    let frozen_seen = Instant::now();
    // Let go at the bound, while the call is still held. (That the writer was held
    // meanwhile is checked on its own stamps below: when the test saw the copy reached,
    // the bound may already have passed on a busy machine.)
    let acked = writer.acked();
    wait_acked(&writer, acked + 20, RESUME_BOUND, "the writer at the bound").await;
    eprintln!(
        "writer went on {:?} after the freeze was seen (bound {bound:?})",
        frozen_seen.elapsed()
    );
    wait_no_freeze_records(&env, "the watchdog removed the record").await;
    assert!(!call.is_finished(), "the call is still held");
    paused.release();
    let err = call
        .await
        .unwrap()
        .expect_err("a copy whose writers were let go is not one instant");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("--max-freeze"), "{err:?}");
    drop(paused);
    assert_eq!(
        snapshot_dirs(&env),
        Vec::<String>::new(),
        "refused, yet left a copy"
    );
    let (acks, errors) = writer.stop();
    assert_eq!(errors, 0);
    // Positive control, on the writer's own stamps: it was held, from the freeze (the
    // watchdog counts the bound from just before it) to the let-go, between two of its
    // acknowledgements; it writes every 2 ms otherwise.
    let longest = acks
        .windows(2)
        .map(|w| Duration::from_nanos(w[1].1.saturating_sub(w[0].1)))
        .max()
        .unwrap_or_default();
    assert!(
        longest >= bound / 4,
        "the writer went on: nothing was frozen (its longest pause {longest:?})"
    );
    rig.detach_and_delete(&p).await.unwrap();
    rig.stop().await;
    env.assert_clean();
    drop(env);
    drop(outer);
}

/// A leader that loses its Lease while a snapshot's copy holds the volume's
/// filesystem frozen thaws it as it gives up (in production, just before it
/// exits): the pod's writers do not wait for a successor to start and thaw it.
/// The abandoned copy finds its filesystem thawed by someone else and is
/// refused, so no snapshot comes of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_loses_its_lease_thaws_its_freezes_as_it_gives_up() {
    require_root!();
    let (_outer, env) = ext4_backing();
    let cluster = EmbeddedCluster::new();
    let mut cfg = replica_config(&env, "leader");
    // Losing the Lease, not the bound, must end this freeze.
    cfg.max_freeze = Duration::from_secs(600);
    let mut leader = Replica::start_with(cfg, &cluster);
    let ctl = leader.wait_leading(Duration::from_secs(20)).await;
    let rig = Rig::start_nodes(&env, &["node-a"], ctl.clone()).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (vol, p) = rig
        .create_attached(&env, "frozen", SIZE, &cap, "node-a", "pod-a")
        .await;
    let thaw = ThawOnDrop(vec![p.staging.clone()]);

    // The snapshot freezes the filesystem and pauses in its copy.
    let paused = failpoint::arm_pause(FP_COPYING, &env.state_dir().to_string_lossy());
    let call = tokio::spawn(snapshot(ctl.clone(), "snap", &vol.volume_id));
    assert!(
        tokio::task::block_in_place(|| paused.wait_reached(Duration::from_secs(60))),
        "the snapshot never reached its copy"
    );
    // Positive control, on the kernel: frozen (a second FIFREEZE answers EBUSY).
    let frozen = ioctl(&p.staging, FIFREEZE).unwrap_err();
    assert_eq!(frozen.raw_os_error(), Some(libc::EBUSY), "{frozen}");

    // The leader's node is cut off: no renewal goes through any more.
    cluster.deny::<Lease>(NS);
    // A bound on liveness (the renew deadline is 1.5 s).
    tokio::time::timeout(Duration::from_secs(60), &mut leader.lost)
        .await
        .expect("the leader gives up without its Lease")
        .unwrap();
    // Thawed by then: a freeze of ours goes through (and is undone at once).
    ioctl(&p.staging, FIFREEZE).expect("the filesystem is thawed once the leader gave up");
    ioctl(&p.staging, FITHAW).unwrap();

    paused.release();
    let err = call
        .await
        .unwrap()
        .expect_err("a copy whose filesystem was thawed under it is refused");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("thawed by someone else"), "{err:?}");
    assert!(
        snapshot_dirs(&env).is_empty(),
        "no snapshot of the abandoned copy: {:?}",
        snapshot_dirs(&env)
    );

    drop(paused);
    drop(thaw);
    rig.detach_and_delete(&p).await.unwrap();
    rig.stop().await;
    leader.stop().await;
    env.assert_clean();
}
