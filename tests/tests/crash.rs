//! The node plugin killed between any two steps of NodeStage, NodePublish
//! and NodeUnstage (a failpoint aborts the real driver binary there), then
//! restarted and the call retried: the retry completes, with exactly one loop
//! device and one mount, and teardown through the RPCs leaves nothing. Also:
//! SIGTERM removes the socket and leaves staged volumes mounted.

use fencecsi_tests::rig::{fresh_driver_binary, volume_ids};
use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

use fencecsi_driver::config::Mode;
use fencecsi_driver::failpoint;
use fencecsi_driver::kernel::mounts;
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::{
    block_cap, csi, mount_cap, require_root, sha256_file, wait_for_socket, Access, Env, InProcess,
    Process,
};

const MIB: i64 = 1 << 20;

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Step {
    Stage,
    Publish,
    Unstage,
}

struct Scenario {
    env: Env,
    controller: InProcess,
    ctl: CsiClient,
    id: String,
    cap: csi::VolumeCapability,
    ctx: HashMap<String, String>,
    staging: PathBuf,
    target: PathBuf,
    block: bool,
}

impl Scenario {
    /// A controller in this process; a volume created and ControllerPublished to node-a.
    async fn new(block: bool) -> Self {
        fresh_driver_binary();
        fencecsi_tests::init_tracing();
        let env = Env::new();
        let (controller, mut ctl) =
            InProcess::start(env.config(Mode::All, Some("node-a"), "controller")).await;
        let cap = if block {
            block_cap(Access::SingleNodeWriter)
        } else {
            mount_cap(Access::SingleNodeWriter, "ext4")
        };
        let id = ctl
            .controller
            .create_volume(csi::CreateVolumeRequest {
                name: "pvc-crash".into(),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: 32 * MIB,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap()
            .volume_id;
        let ctx = ctl
            .controller
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: id.clone(),
                node_id: "node-a".into(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .publish_context;
        let staging = env.staging_path("node-a", &id);
        let target = if block {
            env.kubelet_dir("node-a")
                .join("plugins/kubernetes.io/csi/volumeDevices/publish/pv-crash/pod-1")
        } else {
            env.target_path("node-a", "pod-1", "pv-crash")
        };
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        Scenario {
            env,
            controller,
            ctl,
            id,
            cap,
            ctx,
            staging,
            target,
            block,
        }
    }

    /// A node plugin for node-a in its own process, with failpoints armed.
    async fn node(&self, failpoints: &str) -> (Process, CsiClient) {
        let cfg = self.env.config(Mode::Node, Some("node-a"), "node");
        // The plugin logs to our stderr: warnings only, unless asked.
        let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
        let p = Process::spawn_with_env(&cfg, &[(failpoint::ENV, failpoints), ("RUST_LOG", &log)]);
        let c = wait_for_socket(&p.socket).await;
        (p, c)
    }

    fn stage_req(&self) -> csi::NodeStageVolumeRequest {
        csi::NodeStageVolumeRequest {
            volume_id: self.id.clone(),
            publish_context: self.ctx.clone(),
            staging_target_path: s(&self.staging),
            volume_capability: Some(self.cap.clone()),
            ..Default::default()
        }
    }

    fn publish_req(&self, readonly: bool) -> csi::NodePublishVolumeRequest {
        csi::NodePublishVolumeRequest {
            volume_id: self.id.clone(),
            publish_context: self.ctx.clone(),
            staging_target_path: s(&self.staging),
            target_path: s(&self.target),
            volume_capability: Some(self.cap.clone()),
            readonly,
            ..Default::default()
        }
    }

    fn unpublish_req(&self) -> csi::NodeUnpublishVolumeRequest {
        csi::NodeUnpublishVolumeRequest {
            volume_id: self.id.clone(),
            target_path: s(&self.target),
            force: false,
        }
    }

    fn unstage_req(&self) -> csi::NodeUnstageVolumeRequest {
        csi::NodeUnstageVolumeRequest {
            volume_id: self.id.clone(),
            staging_target_path: s(&self.staging),
            force: false,
        }
    }

    /// Where the staged volume is mounted: the staging dir, or the device
    /// file inside it for a raw block volume.
    fn staged_mount(&self) -> PathBuf {
        if self.block {
            self.staging.join(&self.id)
        } else {
            self.staging.clone()
        }
    }

    fn assert_staged_once(&self, what: &str) {
        assert_eq!(
            self.env.loops().len(),
            1,
            "{what}: exactly one loop device: {:?}",
            self.env.loops()
        );
        assert_eq!(
            mounts::mounts_at(&self.staged_mount()).unwrap().len(),
            1,
            "{what}: exactly one staging mount"
        );
    }

    /// Data goes in and out through the published target.
    fn exercise(&self, what: &str) {
        if self.block {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&self.target)
                .unwrap();
            f.write_all_at(b"fencecsi crash test", 1 << 20).unwrap();
            f.sync_all().unwrap();
            let mut back = [0u8; 19];
            f.read_exact_at(&mut back, 1 << 20).unwrap();
            assert_eq!(&back, b"fencecsi crash test", "{what}");
        } else {
            let p = self.target.join("after-crash");
            std::fs::write(&p, what.as_bytes()).unwrap();
            assert_eq!(std::fs::read(&p).unwrap(), what.as_bytes());
        }
    }

    async fn finish(self, mut node: CsiClient, proc_: Process) {
        node.node
            .node_unpublish_volume(self.unpublish_req())
            .await
            .unwrap();
        node.node
            .node_unstage_volume(self.unstage_req())
            .await
            .unwrap();
        self.env.assert_clean();
        drop(proc_);
        let mut ctl = self.ctl.clone();
        ctl.controller
            .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                volume_id: self.id.clone(),
                node_id: "node-a".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        ctl.controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: self.id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        self.controller.stop().await;
        self.env.assert_clean();
    }
}

/// Waits for a plugin that hit its failpoint; checks that it aborted.
fn assert_aborted(mut p: Process, fp: &str) {
    let status = p.child.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(libc::SIGABRT),
        "{fp}: the plugin must have crashed at the failpoint ({status})"
    );
}

/// Crash at `fp` during `step`, restart, retry, check, tear down.
async fn crash_once(fp: &str, step: Step, block: bool, readonly: bool) {
    let sc = Scenario::new(block).await;
    let what = format!("{fp} ({step:?}, block={block}, readonly={readonly})");

    let (crashing, mut n) = sc.node(fp).await;
    if step != Step::Stage {
        n.node.node_stage_volume(sc.stage_req()).await.unwrap();
    }
    if step == Step::Unstage {
        n.node
            .node_publish_volume(sc.publish_req(readonly))
            .await
            .unwrap();
        n.node
            .node_unpublish_volume(sc.unpublish_req())
            .await
            .unwrap();
    }
    let err = match step {
        Step::Stage => n.node.node_stage_volume(sc.stage_req()).await.map(|_| ()),
        Step::Publish => n
            .node
            .node_publish_volume(sc.publish_req(readonly))
            .await
            .map(|_| ()),
        Step::Unstage => n
            .node
            .node_unstage_volume(sc.unstage_req())
            .await
            .map(|_| ()),
    }
    .expect_err("the call must die with the plugin");
    eprintln!(
        "{what}: the call failed with {:?} as the plugin died",
        err.code()
    );
    assert_aborted(crashing, fp);
    assert!(
        sc.env.socket("node").exists(),
        "a crash leaves the socket behind"
    );

    // Restart without the failpoint and retry, as the CO does.
    let (plugin, mut n) = sc.node("").await;
    match step {
        Step::Stage => {
            n.node
                .node_stage_volume(sc.stage_req())
                .await
                .unwrap_or_else(|e| panic!("{what}: retry: {e}"));
            sc.assert_staged_once(&what);
            n.node.node_stage_volume(sc.stage_req()).await.unwrap();
            sc.assert_staged_once(&what);
            n.node
                .node_publish_volume(sc.publish_req(readonly))
                .await
                .unwrap();
        }
        Step::Publish => {
            n.node
                .node_publish_volume(sc.publish_req(readonly))
                .await
                .unwrap_or_else(|e| panic!("{what}: retry: {e}"));
            let m = mounts::mounts_at(&sc.target).unwrap();
            assert_eq!(m.len(), 1, "{what}: exactly one target mount");
            assert_eq!(m[0].read_only, readonly, "{what}: target mode");
            if block && readonly {
                // The staged device plus one read-only twin for this target,
                // reused by the retry rather than made again.
                assert_eq!(sc.env.loops().len(), 2, "{what}: {:?}", sc.env.loops());
                assert_eq!(mounts::mounts_at(&sc.staged_mount()).unwrap().len(), 1);
            } else {
                sc.assert_staged_once(&what);
            }
        }
        Step::Unstage => {
            n.node
                .node_unstage_volume(sc.unstage_req())
                .await
                .unwrap_or_else(|e| panic!("{what}: retry: {e}"));
            sc.env.assert_clean();
            assert!(!sc.staging.exists(), "{what}: staging dir removed");
            // And the volume stages again from scratch.
            n.node.node_stage_volume(sc.stage_req()).await.unwrap();
            sc.assert_staged_once(&what);
            n.node
                .node_publish_volume(sc.publish_req(readonly))
                .await
                .unwrap();
        }
    }
    if readonly {
        let probe = if block {
            sc.target.clone()
        } else {
            sc.target.join("x")
        };
        let refused = if block {
            use std::os::unix::fs::FileExt;
            match std::fs::OpenOptions::new().write(true).open(&probe) {
                Err(_) => true,
                Ok(f) => f
                    .write_all_at(&[1; 4096], 0)
                    .and_then(|_| f.sync_all())
                    .is_err(),
            }
        } else {
            std::fs::write(&probe, b"x").is_err()
        };
        assert!(refused, "{what}: a read-only target refuses writes");
    } else {
        sc.exercise(&what);
        assert_eq!(sc.env.loops().len(), 1, "{what}");
    }
    sc.finish(n, plugin).await;
}

macro_rules! crash_tests {
    ($($name:ident: $fp:expr, $step:expr, $block:expr, $ro:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            require_root!();
            crash_once($fp, $step, $block, $ro).await;
        }
    )*};
}

crash_tests! {
    stage_fs_crash_after_attach: "stage:after-attach", Step::Stage, false, false;
    stage_fs_crash_after_mkfs: "stage:after-mkfs", Step::Stage, false, false;
    stage_fs_crash_after_mkdir: "stage:after-mkdir", Step::Stage, false, false;
    stage_fs_crash_after_mount: "stage:after-mount", Step::Stage, false, false;
    stage_block_crash_after_attach: "stage:after-attach", Step::Stage, true, false;
    stage_block_crash_after_mkdir: "stage:after-mkdir", Step::Stage, true, false;
    stage_block_crash_after_mkfile: "stage:after-mkfile", Step::Stage, true, false;
    stage_block_crash_after_mount: "stage:after-mount", Step::Stage, true, false;
    publish_fs_crash_after_mkdir: "publish:after-mkdir", Step::Publish, false, false;
    publish_fs_crash_after_bind: "publish:after-bind", Step::Publish, false, false;
    publish_fs_read_only_crash_after_bind: "publish:after-bind", Step::Publish, false, true;
    publish_block_crash_after_mkdir: "publish:after-mkdir", Step::Publish, true, false;
    publish_block_crash_after_bind: "publish:after-bind", Step::Publish, true, false;
    publish_block_read_only_crash_after_bind: "publish:after-bind", Step::Publish, true, true;
    unstage_fs_crash_after_unmount: "unstage:after-unmount", Step::Unstage, false, false;
    unstage_fs_crash_after_detach: "unstage:after-detach", Step::Unstage, false, false;
    unstage_block_crash_after_unmount: "unstage:after-unmount", Step::Unstage, true, false;
}

/// One crash after another, at each step of NodeStage in turn: every restart
/// picks up what the previous attempts left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stage_survives_a_crash_at_every_step_in_turn() {
    require_root!();
    let sc = Scenario::new(false).await;
    for fp in [
        "stage:after-attach",
        "stage:after-mkfs",
        "stage:after-mkdir",
        "stage:after-mount",
    ] {
        let (crashing, mut n) = sc.node(fp).await;
        n.node
            .node_stage_volume(sc.stage_req())
            .await
            .expect_err(fp);
        assert_aborted(crashing, fp);
        assert!(
            sc.env.loops().len() <= 1,
            "{fp}: never a second loop device"
        );
    }
    let (plugin, mut n) = sc.node("").await;
    n.node.node_stage_volume(sc.stage_req()).await.unwrap();
    sc.assert_staged_once("after four crashes");
    n.node
        .node_publish_volume(sc.publish_req(false))
        .await
        .unwrap();
    sc.exercise("after four crashes");
    sc.finish(n, plugin).await;
}

/// SIGTERM: the plugin finishes, removes its socket, and leaves what it
/// staged and published mounted (pods keep their data across a plugin
/// restart); a new plugin picks the volume up as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_removes_the_socket_and_keeps_volumes_mounted() {
    require_root!();
    let sc = Scenario::new(false).await;
    let (mut p, mut n) = sc.node("").await;
    n.node.node_stage_volume(sc.stage_req()).await.unwrap();
    n.node
        .node_publish_volume(sc.publish_req(false))
        .await
        .unwrap();
    let sum = {
        let f = sc.target.join("before-sigterm");
        std::fs::write(&f, vec![7u8; 1 << 20]).unwrap();
        sha256_file(&f)
    };
    let status = p.sigterm();
    assert!(status.success(), "clean exit on SIGTERM: {status}");
    assert!(!sc.env.socket("node").exists(), "socket removed");
    sc.assert_staged_once("after SIGTERM");
    assert_eq!(
        mounts::mounts_at(&sc.target).unwrap().len(),
        1,
        "still published"
    );
    assert_eq!(sha256_file(&sc.target.join("before-sigterm")), sum);
    std::fs::write(sc.target.join("while-down"), b"pods keep writing").unwrap();

    let (plugin, mut n) = sc.node("").await;
    n.node.node_stage_volume(sc.stage_req()).await.unwrap();
    n.node
        .node_publish_volume(sc.publish_req(false))
        .await
        .unwrap();
    sc.assert_staged_once("after restart");
    assert_eq!(mounts::mounts_at(&sc.target).unwrap().len(), 1);
    drop(p);
    sc.finish(n, plugin).await;
}

/// Which controller call a crash interrupts.
#[derive(Clone, Copy, Debug)]
enum CtlOp {
    Create,
    Delete,
    Snapshot,
    DeleteSnapshot,
}

async fn snapshot_ids(ctl: &mut CsiClient) -> std::collections::BTreeSet<String> {
    ctl.controller
        .list_snapshots(csi::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .filter_map(|e| e.snapshot.map(|s| s.snapshot_id))
        .collect()
}

fn dirs_in(dir: &Path) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Files a crash can leave half-made: temp files of atomic writes, copies
/// never renamed into place.
fn temp_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(temp_files(&p));
        } else {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.contains(".tmp-") || n.ends_with(".partial") {
                out.push(p);
            }
        }
    }
    out
}

/// The controller killed inside CreateVolume, DeleteVolume, CreateSnapshot
/// and DeleteSnapshot (a failpoint at each step that writes the state dir);
/// after a restart the state dir holds exactly what ListVolumes and
/// ListSnapshots report, and no half-made file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_restart_leaves_exactly_what_it_lists() {
    require_root!();
    fresh_driver_binary();
    fencecsi_tests::init_tracing();
    let cases = [
        ("write-atomic:after-temp", CtlOp::Create),
        ("create:after-record", CtlOp::Create),
        ("create:after-data", CtlOp::Create),
        ("delete:after-data", CtlOp::Delete),
        ("write-atomic:after-temp", CtlOp::Snapshot),
        ("snapshot:after-copy", CtlOp::Snapshot),
        ("snapshot-delete:after-record", CtlOp::DeleteSnapshot),
    ];
    let cap = block_cap(Access::SingleNodeWriter);
    for (fp, op) in cases {
        let env = Env::new();
        let cfg = env.config(Mode::Controller, None, "controller");
        // Set-up without failpoints: one volume to keep, one to work on, a snapshot.
        let (keep, work, snap) = {
            let (c, mut ctl) = InProcess::start(cfg.clone()).await;
            let mk = |name: &'static str| {
                let mut ctl = ctl.clone();
                let cap = cap.clone();
                async move {
                    ctl.controller
                        .create_volume(csi::CreateVolumeRequest {
                            name: name.into(),
                            capacity_range: Some(csi::CapacityRange {
                                required_bytes: 16 * MIB,
                                limit_bytes: 0,
                            }),
                            volume_capabilities: vec![cap],
                            ..Default::default()
                        })
                        .await
                        .unwrap()
                        .into_inner()
                        .volume
                        .unwrap()
                        .volume_id
                }
            };
            let keep = mk("keep").await;
            let work = mk("work").await;
            let snap = ctl
                .controller
                .create_snapshot(csi::CreateSnapshotRequest {
                    name: "snap-keep".into(),
                    source_volume_id: keep.clone(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .snapshot
                .unwrap()
                .snapshot_id;
            c.stop().await;
            (keep, work, snap)
        };
        // The crashing run.
        let crashing = Process::spawn_with_env(&cfg, &[(failpoint::ENV, fp)]);
        let mut ctl = wait_for_socket(&crashing.socket).await;
        let call = match op {
            CtlOp::Create => ctl
                .controller
                .create_volume(csi::CreateVolumeRequest {
                    name: "new".into(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: 16 * MIB,
                        limit_bytes: 0,
                    }),
                    volume_capabilities: vec![cap.clone()],
                    ..Default::default()
                })
                .await
                .map(|_| ()),
            CtlOp::Delete => ctl
                .controller
                .delete_volume(csi::DeleteVolumeRequest {
                    volume_id: work.clone(),
                    ..Default::default()
                })
                .await
                .map(|_| ()),
            CtlOp::Snapshot => ctl
                .controller
                .create_snapshot(csi::CreateSnapshotRequest {
                    name: "snap-new".into(),
                    source_volume_id: work.clone(),
                    ..Default::default()
                })
                .await
                .map(|_| ()),
            CtlOp::DeleteSnapshot => ctl
                .controller
                .delete_snapshot(csi::DeleteSnapshotRequest {
                    snapshot_id: snap.clone(),
                    ..Default::default()
                })
                .await
                .map(|_| ()),
        };
        assert!(
            call.is_err(),
            "{fp} ({op:?}): the call must die with the plugin"
        );
        assert_aborted(crashing, fp);

        let (c, mut ctl) = InProcess::start(cfg.clone()).await;
        let vols = volume_ids(&mut ctl).await;
        let snaps = snapshot_ids(&mut ctl).await;
        let state = env.state_dir();
        assert_eq!(
            dirs_in(&state.join("volumes")),
            vols,
            "{fp} ({op:?}): volume dirs vs ListVolumes"
        );
        assert_eq!(
            dirs_in(&state.join("snapshots")),
            snaps,
            "{fp} ({op:?}): snapshot dirs vs ListSnapshots"
        );
        assert_eq!(
            temp_files(&state),
            Vec::<PathBuf>::new(),
            "{fp} ({op:?}): half-made files"
        );
        // Positive control: what existed before the crash and was not being
        // changed is still there.
        assert!(vols.contains(&keep), "{fp}: the untouched volume survived");
        if !matches!(op, CtlOp::DeleteSnapshot) {
            assert!(
                snaps.contains(&snap),
                "{fp}: the untouched snapshot survived"
            );
        }
        // Everything left can be deleted through the RPCs.
        for s in &snaps {
            ctl.controller
                .delete_snapshot(csi::DeleteSnapshotRequest {
                    snapshot_id: s.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        for v in &vols {
            ctl.controller
                .delete_volume(csi::DeleteVolumeRequest {
                    volume_id: v.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
        c.stop().await;
        env.assert_clean();
        eprintln!("{fp} ({op:?}): state dir matches the lists after restart");
    }
}
