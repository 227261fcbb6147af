//! CSI ephemeral inline volumes on real loop devices and mounts: a NodePublishVolume
//! marked `csi.storage.k8s.io/ephemeral: "true"` makes a node-local image, attaches,
//! formats and mounts it; NodeUnpublishVolume removes mount, loop device and image. A
//! plugin killed at any step of either leaves nothing behind once it restarts, except a
//! volume that was mounted: that one is in use and keeps its data.
//!
//! Every check of "gone" asks the kernel: /proc/self/mountinfo, the loop devices'
//! backing files in /sys/block, and the image path.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

use fencecsi_driver::config::{Mode, DEFAULT_DRIVER_NAME};
use fencecsi_driver::failpoint;
use fencecsi_driver::node::ephemeral::{self, CTX_EPHEMERAL, IMAGE};
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::rig::{
    create_request, fresh_driver_binary, publish_request, stage_request, unpublish_request,
    unstage_request,
};
use fencecsi_tests::{
    block_cap, csi, mount_cap, require_root, sha256_file, wait_for_socket, Access, Env, InProcess,
    Process,
};
use sha2::{Digest, Sha256};
use tonic::Code;

const NODE: &str = "node-a";
const MIB: u64 = 1 << 20;

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// One pod's inline volume, named as kubelet names it.
struct Pod {
    uid: String,
    volume_id: String,
    target: PathBuf,
}

impl Pod {
    fn new(env: &Env, uid: &str) -> Pod {
        let spec_name = "scratch";
        let volume_id = format!(
            "csi-{}",
            hex::encode(Sha256::digest(format!("{uid}{spec_name}").as_bytes()))
        );
        let target = env.target_path(NODE, uid, spec_name);
        // kubelet makes the target's parent; the plugin makes the target.
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        Pod {
            uid: uid.into(),
            volume_id,
            target,
        }
    }

    /// kubelet's request: the pod's volumeAttributes plus its pod info.
    fn publish(&self, attrs: &[(&str, &str)], cap_fs: &str) -> csi::NodePublishVolumeRequest {
        let mut ctx: HashMap<String, String> = [
            (CTX_EPHEMERAL, "true"),
            ("csi.storage.k8s.io/pod.name", "writer"),
            ("csi.storage.k8s.io/pod.namespace", "default"),
            ("csi.storage.k8s.io/pod.uid", self.uid.as_str()),
            ("csi.storage.k8s.io/serviceAccount.name", "default"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        ctx.extend(attrs.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        csi::NodePublishVolumeRequest {
            volume_id: self.volume_id.clone(),
            target_path: s(&self.target),
            volume_capability: Some(mount_cap(Access::SingleNodeWriter, cap_fs)),
            volume_context: ctx,
            ..Default::default()
        }
    }

    fn unpublish(&self) -> csi::NodeUnpublishVolumeRequest {
        csi::NodeUnpublishVolumeRequest {
            volume_id: self.volume_id.clone(),
            target_path: s(&self.target),
            force: false,
        }
    }

    fn stats(&self) -> csi::NodeGetVolumeStatsRequest {
        csi::NodeGetVolumeStatsRequest {
            volume_id: self.volume_id.clone(),
            volume_path: s(&self.target),
            staging_target_path: String::new(),
        }
    }

    fn dir(&self, env: &Env) -> PathBuf {
        ephemeral::volume_dir(&node_state_dir(env), &self.volume_id)
    }

    fn image(&self, env: &Env) -> PathBuf {
        self.dir(env).join(IMAGE)
    }
}

fn node_state_dir(env: &Env) -> PathBuf {
    env.kubelet_dir(NODE)
        .join("plugins")
        .join(DEFAULT_DRIVER_NAME)
}

/// The volume dirs under the node's ephemeral root.
fn ephemeral_dirs(env: &Env) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(node_state_dir(env).join(ephemeral::DIR))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Mount points in /proc/self/mountinfo equal to `path` (read here, not through the driver).
fn mountinfo_at(path: &Path) -> Vec<(String, bool)> {
    let raw = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    raw.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            (Path::new(f[4]) == path)
                .then(|| (f[sep + 1].to_string(), f[5].split(',').any(|o| o == "ro")))
        })
        .collect()
}

/// Loop devices whose backing file (as /sys/block reports it) is `image`.
fn loops_on(image: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            if Path::new(b.trim().trim_end_matches(" (deleted)")) == image {
                out.push(PathBuf::from("/dev").join(&name));
            }
        }
    }
    out
}

/// Everything of `pod`'s volume is gone: mount, loop device, image, dir, target.
fn assert_gone(env: &Env, pod: &Pod, what: &str) {
    assert_eq!(
        mountinfo_at(&pod.target),
        vec![],
        "{what}: target still mounted"
    );
    assert_eq!(
        loops_on(&pod.image(env)),
        Vec::<PathBuf>::new(),
        "{what}: loop device left"
    );
    assert!(!pod.image(env).exists(), "{what}: image left");
    assert!(!pod.dir(env).exists(), "{what}: volume dir left");
    assert!(!pod.target.exists(), "{what}: target left");
}

/// Mounted once at its target with `fs`, on exactly one loop device over its image.
fn assert_published(env: &Env, pod: &Pod, fs: &str, size: u64, readonly: bool, what: &str) {
    assert_eq!(
        mountinfo_at(&pod.target),
        vec![(fs.to_string(), readonly)],
        "{what}: one {fs} mount at the target"
    );
    let loops = loops_on(&pod.image(env));
    assert_eq!(loops.len(), 1, "{what}: one loop device: {loops:?}");
    assert_eq!(
        std::fs::metadata(pod.image(env)).unwrap().len(),
        size,
        "{what}: image size"
    );
    assert_eq!(
        fencecsi_driver::kernel::filesystem::block_device_size(&loops[0]).unwrap(),
        size,
        "{what}: device size"
    );
}

/// Writes a file with fsync through the target; returns its hash.
fn write_data(pod: &Pod, name: &str, len: usize) -> String {
    let p = pod.target.join(name);
    let mut f = std::fs::File::create(&p).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(std::fs::read(&p).unwrap(), data, "read back");
    sha256_file(&p)
}

async fn start(env: &Env) -> (InProcess, CsiClient) {
    InProcess::start(env.config(Mode::Node, Some(NODE), "node")).await
}

fn code<T>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(e) => e.code(),
    }
}

// ------------------------------------------------------------------ lifecycle

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext4_and_xfs_volumes_live_from_publish_to_unpublish() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let (plugin, mut c) = start(&env).await;
    // fsType as a volume attribute, and as the inline volume's csi.fsType (the capability).
    for (uid, fs, size, attrs, cap_fs) in [
        (
            "pod-ext4",
            "ext4",
            64 * MIB,
            vec![("size", "64Mi"), ("fsType", "ext4")],
            "",
        ),
        ("pod-xfs", "xfs", 300 * MIB, vec![("size", "300Mi")], "xfs"),
    ] {
        let pod = Pod::new(&env, uid);
        let req = pod.publish(&attrs, cap_fs);
        c.node.node_publish_volume(req.clone()).await.unwrap();
        assert_published(&env, &pod, fs, size, false, fs);
        let sum = write_data(&pod, "data", 3 << 20);

        // The same call again: OK, nothing doubled.
        c.node.node_publish_volume(req.clone()).await.unwrap();
        assert_published(&env, &pod, fs, size, false, fs);

        // The same target with other arguments: ALREADY_EXISTS, nothing changed.
        let mut bigger = pod.publish(&[("size", "400Mi")], cap_fs);
        if cap_fs.is_empty() {
            bigger.volume_context.insert("fsType".into(), "ext4".into());
        }
        let mut ro = req.clone();
        ro.readonly = true;
        let other_fs = pod.publish(
            &[
                ("size", "300Mi"),
                ("fsType", if fs == "xfs" { "ext4" } else { "xfs" }),
            ],
            "",
        );
        for (what, r) in [("size", bigger), ("read-only", ro), ("fsType", other_fs)] {
            assert_eq!(
                code(c.node.node_publish_volume(r).await),
                Code::AlreadyExists,
                "{fs}: other {what}"
            );
        }
        // One ephemeral volume has one target.
        let mut second = req.clone();
        second.target_path = s(&env.target_path(NODE, uid, "elsewhere"));
        std::fs::create_dir_all(Path::new(&second.target_path).parent().unwrap()).unwrap();
        assert_eq!(
            code(c.node.node_publish_volume(second).await),
            Code::FailedPrecondition,
            "{fs}: a second target"
        );
        assert_published(&env, &pod, fs, size, false, fs);
        assert_eq!(sha256_file(&pod.target.join("data")), sum);

        let stats = c
            .node
            .node_get_volume_stats(pod.stats())
            .await
            .unwrap()
            .into_inner();
        let bytes = &stats.usage[0];
        assert!(
            bytes.total > 0 && bytes.total as u64 <= size && bytes.used >= 3 << 20,
            "{fs}: {bytes:?}"
        );
        assert_eq!(stats.volume_condition.map(|v| v.abnormal), Some(false));

        c.node.node_unpublish_volume(pod.unpublish()).await.unwrap();
        assert_gone(&env, &pod, fs);
        // Again, as kubelet does after a restart: OK.
        c.node.node_unpublish_volume(pod.unpublish()).await.unwrap();
        assert_gone(&env, &pod, fs);
        assert_eq!(
            code(c.node.node_get_volume_stats(pod.stats()).await),
            Code::NotFound
        );
    }
    assert_eq!(ephemeral_dirs(&env), Vec::<String>::new());
    plugin.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_ephemeral_volume_refuses_writes() {
    require_root!();
    let env = Env::new();
    let (plugin, mut c) = start(&env).await;
    let pod = Pod::new(&env, "pod-ro");
    let mut req = pod.publish(&[("size", "32Mi")], "ext4");
    req.readonly = true;
    c.node.node_publish_volume(req.clone()).await.unwrap();
    assert_published(&env, &pod, "ext4", 32 * MIB, true, "read-only");
    let err = std::fs::write(pod.target.join("x"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    c.node.node_publish_volume(req).await.unwrap();
    c.node.node_unpublish_volume(pod.unpublish()).await.unwrap();
    assert_gone(&env, &pod, "read-only");
    plugin.stop().await;
    env.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_attributes_are_invalid_and_create_nothing() {
    require_root!();
    let env = Env::new();
    let (plugin, mut c) = start(&env).await;
    let pod = Pod::new(&env, "pod-bad");
    let mut cases: Vec<(String, csi::NodePublishVolumeRequest)> = Vec::new();
    for attrs in [
        vec![("sizee", "64Mi")],
        vec![("size", "64Mi"), ("storageClass", "fast")],
        vec![("size", "lots")],
        vec![("size", "0")],
        vec![("size", "-1Gi")],
        vec![("size", "64MB")],
        vec![("size", "65Gi")],
        vec![("size", "8Mi")],
        vec![("size", "64Mi"), ("fsType", "btrfs")],
        vec![("size", "64Mi"), ("fsType", "xfs")], // below xfs's 300 MiB
    ] {
        cases.push((format!("{attrs:?}"), pod.publish(&attrs, "")));
    }
    cases.push((
        "fsType attribute against csi.fsType".into(),
        pod.publish(&[("fsType", "xfs")], "ext4"),
    ));
    cases.push(("fs_type btrfs".into(), pod.publish(&[], "btrfs")));
    let mut block = pod.publish(&[("size", "64Mi")], "");
    block.volume_capability = Some(block_cap(Access::SingleNodeWriter));
    cases.push(("block access".into(), block));
    let mut no_cap = pod.publish(&[], "");
    no_cap.volume_capability = None;
    cases.push(("no capability".into(), no_cap));
    let mut ours = pod.publish(&[], "");
    ours.volume_id = format!("vol-{}", "a".repeat(32));
    cases.push(("a persistent volume's ID".into(), ours));
    let mut unsafe_id = pod.publish(&[], "");
    unsafe_id.volume_id = "../../etc".into();
    cases.push(("an unsafe ID".into(), unsafe_id));
    let mut outside = pod.publish(&[], "");
    outside.target_path = s(&env.path().join("outside/mount"));
    cases.push(("a target outside the kubelet dir".into(), outside));

    for (what, r) in cases {
        assert_eq!(
            code(c.node.node_publish_volume(r).await),
            Code::InvalidArgument,
            "{what}"
        );
        assert_eq!(ephemeral_dirs(&env), Vec::<String>::new(), "{what}: dirs");
        assert_eq!(env.loops(), Vec::<PathBuf>::new(), "{what}: loop devices");
        assert_eq!(env.mounts(), Vec::<PathBuf>::new(), "{what}: mounts");
        assert!(!pod.target.exists(), "{what}: target made");
    }

    // Unknown volumes: kubelet's inline IDs unpublish as done; other unknown IDs stay
    // NOT_FOUND, as for persistent volumes.
    let never = Pod::new(&env, "pod-never");
    c.node
        .node_unpublish_volume(never.unpublish())
        .await
        .unwrap();
    let mut fake = never.unpublish();
    fake.volume_id = "fake-vol-id-0001".into();
    assert_eq!(
        code(c.node.node_unpublish_volume(fake).await),
        Code::NotFound
    );
    assert_eq!(
        code(c.node.node_get_volume_stats(never.stats()).await),
        Code::NotFound
    );
    plugin.stop().await;
    env.assert_clean();
}

/// With `podInfoOnMount: true` every NodePublishVolume carries pod info and
/// `csi.storage.k8s.io/ephemeral: "false"` for persistent volumes: nothing changes for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_volumes_ignore_pod_info() {
    require_root!();
    let env = Env::new();
    let (plugin, mut c) = InProcess::start(env.config(Mode::All, Some(NODE), "all")).await;
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let id = c
        .controller
        .create_volume(create_request("pvc-pod-info", (32 * MIB) as i64, &cap))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let ctx = c
        .controller
        .controller_publish_volume(publish_request(&id, NODE, &cap))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    let staging = env.staging_path(NODE, &id);
    let target = env.target_path(NODE, "pod-p", "pv");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    c.node
        .node_stage_volume(stage_request(&id, &staging, &cap, &ctx))
        .await
        .unwrap();
    let pod_info: HashMap<String, String> = [
        (CTX_EPHEMERAL, "false"),
        ("csi.storage.k8s.io/pod.name", "p"),
        ("csi.storage.k8s.io/pod.namespace", "default"),
        ("csi.storage.k8s.io/pod.uid", "pod-p"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    c.node
        .node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: id.clone(),
            publish_context: ctx,
            staging_target_path: s(&staging),
            target_path: s(&target),
            volume_capability: Some(cap),
            volume_context: pod_info,
            ..Default::default()
        })
        .await
        .unwrap();
    std::fs::write(target.join("f"), b"persistent").unwrap();
    assert_eq!(ephemeral_dirs(&env), Vec::<String>::new());
    c.node
        .node_unpublish_volume(unpublish_request(&id, &target))
        .await
        .unwrap();
    c.node
        .node_unstage_volume(unstage_request(&id, &staging))
        .await
        .unwrap();
    c.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: NODE.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    c.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: id,
            ..Default::default()
        })
        .await
        .unwrap();
    plugin.stop().await;
    env.assert_clean();
}

// ------------------------------------------------------------------ crashes

/// The node plugin in its own process, with failpoints armed.
async fn node_process(env: &Env, failpoints: &str) -> (Process, CsiClient) {
    let cfg = env.config(Mode::Node, Some(NODE), "node");
    let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
    let p = Process::spawn_with_env(&cfg, &[(failpoint::ENV, failpoints), ("RUST_LOG", &log)]);
    let c = wait_for_socket(&p.socket).await;
    (p, c)
}

fn assert_aborted(mut p: Process, fp: &str) {
    let status = p.child.wait().unwrap();
    assert_eq!(
        status.signal(),
        Some(libc::SIGABRT),
        "{fp}: the plugin must have crashed at the failpoint ({status})"
    );
}

const SIZE: &str = "32Mi";

/// A plugin killed at `fp` while publishing (or unpublishing) one volume, with another,
/// completed volume in use beside it; then restarted. The half-made one leaves nothing
/// (no loop device, no image, no dir); the completed one stays mounted with its data;
/// the CO's retry then completes.
async fn crash_once(fp: &str) {
    fresh_driver_binary();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let unpublishing = fp.starts_with("ephemeral-unpublish:");
    // A volume published and written by a plugin that is then killed: it stays in use.
    let keep = Pod::new(&env, "pod-keep");
    let (mut first, mut c) = node_process(&env, "").await;
    c.node
        .node_publish_volume(keep.publish(&[("size", SIZE)], "ext4"))
        .await
        .unwrap();
    let kept = write_data(&keep, "kept", 1 << 20);
    let doomed = Pod::new(&env, "pod-doomed");
    if unpublishing {
        c.node
            .node_publish_volume(doomed.publish(&[("size", SIZE)], "ext4"))
            .await
            .unwrap();
        write_data(&doomed, "doomed", 4096);
    }
    first.kill9();

    let (crashing, mut c) = node_process(&env, fp).await;
    let call = if unpublishing {
        c.node
            .node_unpublish_volume(doomed.unpublish())
            .await
            .map(|_| ())
    } else {
        c.node
            .node_publish_volume(doomed.publish(&[("size", SIZE)], "ext4"))
            .await
            .map(|_| ())
    };
    call.expect_err("the call must die with the plugin");
    assert_aborted(crashing, fp);

    // What the crash left: proof that the restart has something to clean.
    let image = doomed.image(&env);
    let left_device = matches!(
        fp,
        "ephemeral:after-attach" | "ephemeral:after-mkfs" | "ephemeral:after-mount"
    ) || fp == "ephemeral-unpublish:after-unmount";
    assert!(
        image.exists() || fp == "ephemeral-unpublish:after-detach",
        "{fp}: the crash left the image"
    );
    assert!(doomed.dir(&env).exists(), "{fp}: the crash left the dir");
    assert_eq!(
        loops_on(&image).len(),
        left_device as usize,
        "{fp}: loop devices the crash left"
    );
    let completed = fp == "ephemeral:after-mount";

    // Restart: start-up cleans up before serving.
    let (plugin, mut c) = node_process(&env, "").await;
    if completed {
        // Mounted: in use, left alone; the retried publish finds it done.
        assert_published(&env, &doomed, "ext4", 32 * MIB, false, fp);
        c.node
            .node_publish_volume(doomed.publish(&[("size", SIZE)], "ext4"))
            .await
            .unwrap();
        assert_published(&env, &doomed, "ext4", 32 * MIB, false, fp);
    } else {
        assert_eq!(
            loops_on(&image),
            Vec::<PathBuf>::new(),
            "{fp}: loop device left"
        );
        assert!(!image.exists(), "{fp}: image left");
        assert!(!doomed.dir(&env).exists(), "{fp}: dir left");
        assert_eq!(mountinfo_at(&doomed.target), vec![], "{fp}: mounted");
        let tags: Vec<String> = fencecsi_driver::kernel::loop_device::list()
            .unwrap()
            .into_iter()
            .map(|l| l.tag)
            .filter(|t| {
                // This plugin's (other tests run the same pods under other owners).
                t.contains(&ephemeral::key_of(&doomed.volume_id))
                    && t.ends_with(&ephemeral::owner_tag(NODE, &node_state_dir(&env)))
            })
            .collect();
        assert_eq!(tags, Vec::<String>::new(), "{fp}: tagged devices left");
    }
    assert_published(
        &env,
        &keep,
        "ext4",
        32 * MIB,
        false,
        &format!("{fp}: kept volume"),
    );
    assert_eq!(
        sha256_file(&keep.target.join("kept")),
        kept,
        "{fp}: kept data"
    );
    assert_eq!(
        ephemeral_dirs(&env).len(),
        1 + completed as usize,
        "{fp}: {:?}",
        ephemeral_dirs(&env)
    );

    // The CO retries what died, then the pods end.
    if unpublishing {
        c.node
            .node_unpublish_volume(doomed.unpublish())
            .await
            .unwrap();
    } else {
        c.node
            .node_publish_volume(doomed.publish(&[("size", SIZE)], "ext4"))
            .await
            .unwrap();
        assert_published(&env, &doomed, "ext4", 32 * MIB, false, fp);
        write_data(&doomed, "after-crash", 4096);
        c.node
            .node_unpublish_volume(doomed.unpublish())
            .await
            .unwrap();
    }
    assert_gone(&env, &doomed, fp);
    c.node
        .node_unpublish_volume(keep.unpublish())
        .await
        .unwrap();
    assert_gone(&env, &keep, fp);
    assert_eq!(ephemeral_dirs(&env), Vec::<String>::new());
    drop(plugin);
    env.assert_clean();
}

macro_rules! crash_tests {
    ($($name:ident: $fp:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            require_root!();
            crash_once($fp).await;
        }
    )*};
}

crash_tests! {
    publish_crash_after_image: "ephemeral:after-image";
    publish_crash_after_attach: "ephemeral:after-attach";
    publish_crash_after_mkfs: "ephemeral:after-mkfs";
    publish_crash_after_mount: "ephemeral:after-mount";
    unpublish_crash_after_unmount: "ephemeral-unpublish:after-unmount";
    unpublish_crash_after_detach: "ephemeral-unpublish:after-detach";
}
