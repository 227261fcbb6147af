//! Hostile and malformed input: path-traversal IDs, paths outside the
//! kubelet dir (directly, relatively, through `..` or a planted symlink),
//! unsupported capabilities, impossible sizes, unknown parameters. Each is
//! refused with the spec's code, and the test proves that nothing changed:
//! the file tree under the test dir, the mount table and the loop devices are
//! exactly as before. Also concurrent calls on one volume: ABORTED or OK,
//! never a doubled loop device or mount.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use fencecsi_driver::kernel::mounts;
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::csi::volume_capability::{AccessMode, AccessType, MountVolume};
use fencecsi_tests::csi::volume_content_source::{SnapshotSource, Type as SrcType, VolumeSource};
use fencecsi_tests::rig::stage_request;
use fencecsi_tests::{
    block_cap, csi, mount_cap, require_root, unpublish_and_delete, Access, AllInOne, Env,
};
use tonic::Code;

const MIB: i64 = 1 << 20;

macro_rules! assert_code {
    ($call:expr, $code:expr, $what:expr) => {{
        let r = $call.await;
        let got = match &r {
            ::core::result::Result::Ok(_) => Code::Ok,
            ::core::result::Result::Err(s) => s.code(),
        };
        assert_eq!(
            got,
            $code,
            "{} [{}] -> {:?}",
            stringify!($call),
            $what,
            r.as_ref()
                .err()
                .map(|s| s.message().chars().take(300).collect::<String>())
        );
    }};
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Every entry below `root` (symlinks not followed) with its type, size and
/// mode: two equal listings mean no file or dir was made, removed or resized.
fn tree(root: &Path) -> BTreeMap<PathBuf, (u32, u64)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            let size = if m.is_file() { m.len() } else { 0 };
            out.insert(p.clone(), (m.mode(), size));
            if m.is_dir() {
                stack.push(p);
            }
        }
    }
    out
}

/// Mounts, loop devices and file tree of the env, plus the places outside
/// it that a traversal would reach.
#[derive(Debug, PartialEq)]
struct World {
    tree: BTreeMap<PathBuf, (u32, u64)>,
    mounts: Vec<PathBuf>,
    loops: Vec<PathBuf>,
    escapes: Vec<(PathBuf, bool)>,
}

fn world(env: &Env, escapes: &[PathBuf]) -> World {
    World {
        tree: tree(env.path()),
        mounts: env.mounts(),
        loops: env.loops(),
        escapes: escapes.iter().map(|p| (p.clone(), p.exists())).collect(),
    }
}

fn assert_same(before: &World, after: &World, what: &str) {
    if before == after {
        return;
    }
    let added: Vec<_> = after
        .tree
        .keys()
        .filter(|k| !before.tree.contains_key(*k))
        .collect();
    let removed: Vec<_> = before
        .tree
        .keys()
        .filter(|k| !after.tree.contains_key(*k))
        .collect();
    let changed: Vec<_> = after
        .tree
        .iter()
        .filter(|(k, v)| before.tree.get(*k).is_some_and(|b| b != *v))
        .map(|(k, _)| k)
        .collect();
    panic!(
        "{what} changed the world: added {added:?}, removed {removed:?}, changed {changed:?}, mounts {:?} -> {:?}, loops {:?} -> {:?}, escapes {:?} -> {:?}",
        before.mounts, after.mounts, before.loops, after.loops, before.escapes, after.escapes
    );
}

async fn create(c: &mut CsiClient, name: &str, size: i64, cap: &csi::VolumeCapability) -> String {
    c.controller
        .create_volume(fencecsi_tests::rig::create_request(name, size, cap))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id
}

async fn cpublish(
    c: &mut CsiClient,
    id: &str,
    cap: &csi::VolumeCapability,
) -> HashMap<String, String> {
    c.controller
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: id.into(),
            node_id: "node-a".into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .publish_context
}

async fn teardown(c: &mut CsiClient, id: &str, staging: &Path, targets: &[&Path]) {
    for t in targets {
        c.node
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: id.into(),
                target_path: s(t),
                force: false,
            })
            .await
            .unwrap();
    }
    c.node
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: s(staging),
            force: false,
        })
        .await
        .unwrap();
    unpublish_and_delete(c, id).await;
}

fn bad_ids() -> Vec<String> {
    vec![
        "../../etc".into(),
        "..".into(),
        ".".into(),
        "a/b".into(),
        "/etc/passwd".into(),
        "vol-../../../etc".into(),
        format!("vol-{}/..", "a".repeat(32)),
        "vol-\0".into(),
        format!("vol-{}\0", "a".repeat(32)),
        "x y".into(),
        "%2e%2e%2fetc".into(),
        "a".repeat(129),
        "v".repeat(8192),
    ]
}

// ---------------------------------------------------------------- IDs

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traversal_and_junk_ids_are_invalid_argument_everywhere() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    // A real, staged volume: every call below would do something with good IDs.
    let id = create(&mut c, "pvc-real", 16 * MIB, &cap).await;
    let ctx = cpublish(&mut c, &id, &cap).await;
    let staging = env.staging_path("node-a", &id);
    let target = env.target_path("node-a", "pod-1", "pv");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    c.node
        .node_stage_volume(stage_request(&id, &staging, &cap, &ctx))
        .await
        .unwrap();
    let escapes = vec![
        PathBuf::from("/etc/passwd.fencecsi"),
        env.path().join("etc"),
    ];
    let before = world(env, &escapes);
    let range = Some(csi::CapacityRange {
        required_bytes: 32 * MIB,
        limit_bytes: 0,
    });

    for bad in bad_ids() {
        let what = format!("{:?}", bad.chars().take(40).collect::<String>());
        let ia = Code::InvalidArgument;
        // Node service.
        assert_code!(
            c.node.node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: bad.clone(),
                publish_context: ctx.clone(),
                staging_target_path: s(&staging),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            }),
            ia,
            what
        );
        assert_code!(
            c.node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: bad.clone(),
                staging_target_path: s(&staging),
                force: true,
            }),
            ia,
            what
        );
        assert_code!(
            c.node.node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: bad.clone(),
                publish_context: ctx.clone(),
                staging_target_path: s(&staging),
                target_path: s(&target),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            }),
            ia,
            what
        );
        assert_code!(
            c.node
                .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                    volume_id: bad.clone(),
                    target_path: s(&staging),
                    force: true,
                }),
            ia,
            what
        );
        assert_code!(
            c.node
                .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                    volume_id: bad.clone(),
                    volume_path: s(&staging),
                    staging_target_path: s(&staging),
                }),
            ia,
            what
        );
        assert_code!(
            c.node.node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: bad.clone(),
                volume_path: s(&staging),
                capacity_range: range,
                ..Default::default()
            }),
            ia,
            what
        );
        // Controller service.
        assert_code!(
            c.controller.delete_volume(csi::DeleteVolumeRequest {
                volume_id: bad.clone(),
                ..Default::default()
            }),
            ia,
            what
        );
        for (vol, node) in [(bad.as_str(), "node-a"), (id.as_str(), bad.as_str())] {
            assert_code!(
                c.controller
                    .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                        volume_id: vol.into(),
                        node_id: node.into(),
                        volume_capability: Some(cap.clone()),
                        ..Default::default()
                    }),
                ia,
                what
            );
            assert_code!(
                c.controller
                    .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                        volume_id: vol.into(),
                        node_id: node.into(),
                        fence: true,
                        ..Default::default()
                    }),
                ia,
                what
            );
        }
        assert_code!(
            c.controller
                .validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                    volume_id: bad.clone(),
                    volume_capabilities: vec![cap.clone()],
                    ..Default::default()
                }),
            ia,
            what
        );
        assert_code!(
            c.controller
                .controller_get_volume(csi::ControllerGetVolumeRequest {
                    volume_id: bad.clone()
                }),
            ia,
            what
        );
        assert_code!(
            c.controller
                .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                    volume_id: bad.clone(),
                    capacity_range: range,
                    ..Default::default()
                }),
            ia,
            what
        );
        assert_code!(
            c.controller.create_snapshot(csi::CreateSnapshotRequest {
                name: "snap".into(),
                source_volume_id: bad.clone(),
                ..Default::default()
            }),
            ia,
            what
        );
        assert_code!(
            c.controller.delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: bad.clone(),
                ..Default::default()
            }),
            ia,
            what
        );
        for src in [
            SrcType::Snapshot(SnapshotSource {
                snapshot_id: bad.clone(),
            }),
            SrcType::Volume(VolumeSource {
                volume_id: bad.clone(),
            }),
        ] {
            assert_code!(
                c.controller.create_volume(csi::CreateVolumeRequest {
                    name: "pvc-from-bad".into(),
                    capacity_range: range,
                    volume_capabilities: vec![cap.clone()],
                    volume_content_source: Some(csi::VolumeContentSource { r#type: Some(src) }),
                    ..Default::default()
                }),
                ia,
                what
            );
        }
        // Tokens are opaque: a bad one is ABORTED (spec), a filter is just a filter.
        assert_code!(
            c.controller.list_volumes(csi::ListVolumesRequest {
                max_entries: 0,
                starting_token: bad.clone(),
            }),
            Code::Aborted,
            what
        );
        let listed = c
            .controller
            .list_snapshots(csi::ListSnapshotsRequest {
                snapshot_id: bad.clone(),
                source_volume_id: bad.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(listed.entries.is_empty());
    }
    assert_same(&before, &world(env, &escapes), "bad IDs");
    assert!(
        mounts::is_mountpoint(&staging).unwrap(),
        "the real volume stayed staged"
    );

    // A volume *name* is not a path: a traversal-looking name makes an
    // ordinary volume with a generated ID, inside the state dir.
    let odd = create(&mut c, "../../etc/passwd", 16 * MIB, &cap).await;
    assert!(odd.starts_with("vol-") && !odd.contains('/'));
    assert!(env.state_dir().join("volumes").join(&odd).is_dir());
    for (name, code) in [
        ("pvc\0nul", Code::InvalidArgument),
        (&*"n".repeat(1025), Code::InvalidArgument),
    ] {
        assert_code!(
            c.controller.create_volume(csi::CreateVolumeRequest {
                name: name.into(),
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            }),
            code,
            "name"
        );
    }
    c.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: odd,
            ..Default::default()
        })
        .await
        .unwrap();
    teardown(&mut c, &id, &staging, &[]).await;
    w.finish().await;
    assert!(!Path::new("/etc/passwd.fencecsi").exists());
}

// ---------------------------------------------------------------- paths

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_outside_the_kubelet_dir_are_refused_and_nothing_changes() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let kubelet = env.kubelet_dir("node-a");
    let outside = env.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("precious"), b"do not touch").unwrap();
    // Symlinks planted inside the kubelet dir, leading out of it.
    let pods = kubelet.join("pods");
    std::fs::create_dir_all(&pods).unwrap();
    std::os::unix::fs::symlink(&outside, pods.join("evil")).unwrap();
    std::os::unix::fs::symlink("/", pods.join("root")).unwrap();
    std::os::unix::fs::symlink("../../../../outside", pods.join("relative-evil")).unwrap();
    let unique = format!("fencecsi-escape-{}", std::process::id());
    let system = std::env::temp_dir().join(&unique);

    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let id = create(&mut c, "pvc-paths", 16 * MIB, &cap).await;
    let ctx = cpublish(&mut c, &id, &cap).await;
    let staging = env.staging_path("node-a", &id);
    let good_target = env.target_path("node-a", "pod-ok", "pv");
    std::fs::create_dir_all(good_target.parent().unwrap()).unwrap();
    // Staged and published for real, so that the refusals below are about
    // the paths alone and there is live state to disturb.
    c.node
        .node_stage_volume(stage_request(&id, &staging, &cap, &ctx))
        .await
        .unwrap();
    let publish = |target: &str, staging_path: &str| csi::NodePublishVolumeRequest {
        volume_id: id.clone(),
        publish_context: ctx.clone(),
        staging_target_path: staging_path.into(),
        target_path: target.into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    c.node
        .node_publish_volume(publish(&s(&good_target), &s(&staging)))
        .await
        .unwrap();

    let bad_paths: Vec<String> = vec![
        s(&outside.join("mount")),
        s(&outside),
        s(&system),
        "/etc/fencecsi-escape".into(),
        "/".into(),
        s(&kubelet), // the root itself is never ours
        "relative/path".into(),
        "pods/x/mount".into(),
        format!("{}/pods/../../../outside/mount", kubelet.display()),
        format!("{}/pods/x/../../../../outside", kubelet.display()),
        format!("{}/./pods/../..", kubelet.display()),
        s(&pods.join("evil/mount")),
        s(&pods.join("evil")),
        s(&pods.join("relative-evil/mount")),
        format!("{}/root{}", pods.display(), system.display()),
        format!("{}/root/etc/fencecsi-escape", pods.display()),
        format!("{}/pods/a\0b", kubelet.display()),
        format!("{}/pods/{}", kubelet.display(), "a".repeat(256)),
        format!("{}/{}", kubelet.display(), "abcdefg/".repeat(600)),
    ];
    let escapes = vec![
        system.clone(),
        PathBuf::from("/etc/fencecsi-escape"),
        outside.join("mount"),
    ];
    let before = world(env, &escapes);
    assert_eq!(before.mounts.len(), 2);
    assert_eq!(before.loops.len(), 1);
    let ia = Code::InvalidArgument;
    for bad in &bad_paths {
        let what = format!("{:?}", bad.chars().take(120).collect::<String>());
        assert_code!(
            c.node.node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: id.clone(),
                publish_context: ctx.clone(),
                staging_target_path: bad.clone(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            }),
            ia,
            what
        );
        assert_code!(
            c.node.node_publish_volume(publish(bad, &s(&staging))),
            ia,
            what
        );
        assert_code!(
            c.node.node_publish_volume(publish(&s(&good_target), bad)),
            ia,
            what
        );
        assert_code!(
            c.node
                .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                    volume_id: id.clone(),
                    target_path: bad.clone(),
                    force: true,
                }),
            ia,
            what
        );
        assert_code!(
            c.node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: bad.clone(),
                force: true,
            }),
            ia,
            what
        );
        assert_code!(
            c.node.node_expand_volume(csi::NodeExpandVolumeRequest {
                volume_id: id.clone(),
                volume_path: bad.clone(),
                ..Default::default()
            }),
            ia,
            what
        );
        // Stats only ever look: a path that cannot hold the volume is NOT_FOUND
        // (what csi-sanity expects for "some/path"), and is not looked at.
        assert_code!(
            c.node
                .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                    volume_id: id.clone(),
                    volume_path: bad.clone(),
                    staging_target_path: String::new(),
                }),
            Code::NotFound,
            what
        );
    }
    assert_same(&before, &world(env, &escapes), "bad paths");
    assert_eq!(
        std::fs::read(outside.join("precious")).unwrap(),
        b"do not touch"
    );

    teardown(&mut c, &id, &staging, &[&good_target]).await;
    w.finish().await;
    assert!(!system.exists());
}

// ---------------------------------------------------------------- capabilities, sizes, parameters

fn cap_with(mode: Option<Access>, access_type: Option<AccessType>) -> csi::VolumeCapability {
    csi::VolumeCapability {
        access_mode: mode.map(|m| AccessMode { mode: m as i32 }),
        access_type,
    }
}

fn mount_type(fs: &str, flags: Vec<String>, group: &str) -> Option<AccessType> {
    Some(AccessType::Mount(MountVolume {
        fs_type: fs.into(),
        mount_flags: flags,
        volume_mount_group: group.into(),
    }))
}

fn unsupported_caps() -> Vec<(&'static str, csi::VolumeCapability)> {
    vec![
        (
            "multi-node multi-writer",
            mount_cap(Access::MultiNodeMultiWriter, "ext4"),
        ),
        (
            "multi-node single-writer",
            mount_cap(Access::MultiNodeSingleWriter, "ext4"),
        ),
        (
            "block multi-writer",
            block_cap(Access::MultiNodeMultiWriter),
        ),
        ("unknown fs", mount_cap(Access::SingleNodeWriter, "ntfs")),
        (
            "fs with a slash",
            mount_cap(Access::SingleNodeWriter, "../ext4"),
        ),
        (
            "no access mode",
            cap_with(None, mount_type("ext4", vec![], "")),
        ),
        (
            "UNKNOWN mode",
            cap_with(Some(Access::Unknown), mount_type("ext4", vec![], "")),
        ),
        (
            "no access type",
            cap_with(Some(Access::SingleNodeWriter), None),
        ),
        (
            "mount group",
            cap_with(
                Some(Access::SingleNodeWriter),
                mount_type("ext4", vec![], "1000"),
            ),
        ),
        (
            "huge mount flags",
            cap_with(
                Some(Access::SingleNodeWriter),
                mount_type("ext4", vec!["noatime".repeat(1000)], ""),
            ),
        ),
        (
            "mode out of range",
            csi::VolumeCapability {
                access_mode: Some(AccessMode { mode: 4242 }),
                access_type: mount_type("ext4", vec![], ""),
            },
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_capabilities_sizes_and_parameters_create_nothing() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let good = mount_cap(Access::SingleNodeWriter, "ext4");
    let req = |cap: &csi::VolumeCapability, required: i64, limit: i64, params: &[(&str, &str)]| {
        csi::CreateVolumeRequest {
            name: "pvc-bad".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            }),
            volume_capabilities: vec![cap.clone()],
            parameters: params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    };
    let before = world(env, &[]);

    for (what, cap) in unsupported_caps() {
        assert_code!(
            c.controller.create_volume(req(&cap, 16 * MIB, 0, &[])),
            Code::InvalidArgument,
            what
        );
        // One bad capability among good ones spoils the request.
        assert_code!(
            c.controller.create_volume(csi::CreateVolumeRequest {
                volume_capabilities: vec![good.clone(), cap.clone()],
                ..req(&good, 16 * MIB, 0, &[])
            }),
            Code::InvalidArgument,
            what
        );
    }
    let st = nix::sys::statvfs::statvfs(&env.state_dir()).unwrap();
    let backend = st.blocks() as i64 * st.fragment_size() as i64;
    for (what, required, limit, code) in [
        ("negative required", -1, 0, Code::InvalidArgument),
        ("negative limit", 16 * MIB, -5, Code::InvalidArgument),
        (
            "required above limit",
            32 * MIB,
            16 * MIB,
            Code::InvalidArgument,
        ),
        ("i64::MIN", i64::MIN, 0, Code::InvalidArgument),
        (
            "larger than the backing filesystem",
            backend + MIB,
            0,
            Code::OutOfRange,
        ),
        ("1 PiB", 1 << 50, 0, Code::OutOfRange),
        ("i64::MAX", i64::MAX, 0, Code::OutOfRange),
        ("limit below the ext4 minimum", 0, MIB, Code::OutOfRange),
        (
            "limit below the ext4 minimum, required 1",
            1,
            MIB,
            Code::OutOfRange,
        ),
    ] {
        assert_code!(
            c.controller.create_volume(req(&good, required, limit, &[])),
            code,
            what
        );
    }
    assert_code!(
        c.controller.create_volume(req(
            &mount_cap(Access::SingleNodeWriter, ""),
            0,
            100 * MIB,
            &[("fsType", "xfs")]
        )),
        Code::OutOfRange,
        "limit below the xfs minimum"
    );
    for params in [
        vec![("color", "blue")],
        vec![("fsType", "btrfs")],
        vec![("fsType", "")],
        vec![("fsType", "../../ext4")],
        vec![("fstype", "ext4")],
        vec![("fsType", "ext4"), ("replicas", "3")],
    ] {
        assert_code!(
            c.controller.create_volume(req(&good, 16 * MIB, 0, &params)),
            Code::InvalidArgument,
            format!("{params:?}")
        );
    }
    assert_code!(
        c.controller.create_volume(req(
            &mount_cap(Access::SingleNodeWriter, "xfs"),
            300 * MIB,
            0,
            &[("fsType", "ext4")]
        )),
        Code::InvalidArgument,
        "capability and parameter disagree"
    );
    assert_same(&before, &world(env, &[]), "refused CreateVolume");
    assert_eq!(
        std::fs::read_dir(env.state_dir().join("volumes"))
            .unwrap()
            .count(),
        0,
        "no image, no record"
    );

    // The same capabilities on the other RPCs of a real volume.
    let id = create(&mut c, "pvc-caps", 16 * MIB, &good).await;
    let ctx = cpublish(&mut c, &id, &good).await;
    let staging = env.staging_path("node-a", &id);
    let target = env.target_path("node-a", "pod", "pv");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let before = world(env, &[]);
    for (what, cap) in unsupported_caps() {
        assert_code!(
            c.node
                .node_stage_volume(stage_request(&id, &staging, &cap, &ctx)),
            Code::InvalidArgument,
            what
        );
        assert_code!(
            c.node.node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: id.clone(),
                publish_context: ctx.clone(),
                staging_target_path: s(&staging),
                target_path: s(&target),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            }),
            Code::InvalidArgument,
            what
        );
        assert_code!(
            c.controller
                .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                    volume_id: id.clone(),
                    node_id: "node-a".into(),
                    volume_capability: Some(cap.clone()),
                    ..Default::default()
                }),
            Code::InvalidArgument,
            what
        );
    }
    // Expanding past the backend: OUT_OF_RANGE, the image keeps its size.
    let img = env
        .state_dir()
        .join("volumes")
        .join(&id)
        .join("gen-000001.img");
    for (required, code) in [(1 << 50, Code::OutOfRange), (-1, Code::InvalidArgument)] {
        assert_code!(
            c.controller
                .controller_expand_volume(csi::ControllerExpandVolumeRequest {
                    volume_id: id.clone(),
                    capacity_range: Some(csi::CapacityRange {
                        required_bytes: required,
                        limit_bytes: 0,
                    }),
                    ..Default::default()
                }),
            code,
            required
        );
    }
    assert_code!(
        c.controller.create_snapshot(csi::CreateSnapshotRequest {
            name: "snap".into(),
            source_volume_id: id.clone(),
            parameters: [("retention".to_string(), "7d".to_string())].into(),
            ..Default::default()
        }),
        Code::InvalidArgument,
        "snapshot parameter"
    );
    assert_eq!(
        std::fs::metadata(&img).unwrap().len() as i64,
        16 * MIB + fencecsi_driver::fence::TRAILER_BYTES as i64
    );
    assert_same(&before, &world(env, &[]), "refused capabilities and sizes");
    assert!(env.loops().is_empty() && env.mounts().is_empty());

    c.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    c.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    w.finish().await;
}

// ---------------------------------------------------------------- concurrency

/// Fires `n` copies of a call at once; each must be OK or ABORTED. Returns
/// how many were OK.
macro_rules! all_at_once {
    ($n:expr, $client:expr, $req:expr, |$c:ident, $r:ident| $call:expr) => {{
        let mut tasks = Vec::new();
        for _ in 0..$n {
            let mut $c = $client.clone();
            let $r = $req.clone();
            tasks.push(tokio::spawn(async move { $call.await.map(|_| ()) }));
        }
        let mut ok = 0;
        let mut aborted = 0;
        for t in tasks {
            match t.await.unwrap() {
                ::core::result::Result::Ok(()) => ok += 1,
                ::core::result::Result::Err(s) if s.code() == Code::Aborted => aborted += 1,
                ::core::result::Result::Err(s) => panic!("{}: {s}", stringify!($call)),
            }
        }
        assert_eq!(ok + aborted, $n);
        ok
    }};
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_on_one_volume_never_double_anything() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");

    // 8 CreateVolume with one name: one volume.
    let create_req = csi::CreateVolumeRequest {
        name: "pvc-race".into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: 32 * MIB,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap.clone()],
        ..Default::default()
    };
    let r = create_req.clone();
    all_at_once!(8, c, r, |k, r| k.controller.create_volume(r));
    let id = c
        .controller
        .create_volume(create_req.clone())
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    assert_eq!(
        std::fs::read_dir(env.state_dir().join("volumes"))
            .unwrap()
            .count(),
        1
    );

    // 8 ControllerPublish: one attachment.
    let pr = csi::ControllerPublishVolumeRequest {
        volume_id: id.clone(),
        node_id: "node-a".into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    all_at_once!(8, c, pr, |k, r| k.controller.controller_publish_volume(r));
    let ctx = c
        .controller
        .controller_publish_volume(pr.clone())
        .await
        .unwrap()
        .into_inner()
        .publish_context;

    // 8 NodeStage: in the end exactly one loop device and one mount.
    let staging = env.staging_path("node-a", &id);
    let sr = csi::NodeStageVolumeRequest {
        volume_id: id.clone(),
        publish_context: ctx.clone(),
        staging_target_path: s(&staging),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    let ok = all_at_once!(8, c, sr, |k, r| k.node.node_stage_volume(r));
    eprintln!("NodeStage x8: {ok} OK, {} ABORTED", 8 - ok);
    c.node.node_stage_volume(sr.clone()).await.unwrap();
    assert_eq!(env.loops().len(), 1, "one loop device");
    assert_eq!(
        mounts::mounts_at(&staging).unwrap().len(),
        1,
        "one staging mount"
    );

    // 8 NodePublish on one target: one mount.
    let target = env.target_path("node-a", "pod", "pv");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let pubr = csi::NodePublishVolumeRequest {
        volume_id: id.clone(),
        publish_context: ctx.clone(),
        staging_target_path: s(&staging),
        target_path: s(&target),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    all_at_once!(8, c, pubr, |k, r| k.node.node_publish_volume(r));
    c.node.node_publish_volume(pubr.clone()).await.unwrap();
    assert_eq!(
        mounts::mounts_at(&target).unwrap().len(),
        1,
        "one target mount"
    );
    assert_eq!(env.mounts().len(), 2);
    std::fs::write(target.join("ok"), b"fine").unwrap();

    // Mixed calls on the volume at once: each OK or ABORTED, and the
    // volume still works afterwards.
    let statr = csi::NodeGetVolumeStatsRequest {
        volume_id: id.clone(),
        volume_path: s(&target),
        staging_target_path: s(&staging),
    };
    let mut tasks = Vec::new();
    for i in 0..8 {
        let mut k = c.clone();
        let (sr, pubr, statr) = (sr.clone(), pubr.clone(), statr.clone());
        tasks.push(tokio::spawn(async move {
            match i % 3 {
                0 => k.node.node_stage_volume(sr).await.map(|_| ()),
                1 => k.node.node_publish_volume(pubr).await.map(|_| ()),
                _ => k.node.node_get_volume_stats(statr).await.map(|_| ()),
            }
        }));
    }
    for t in tasks {
        if let Err(s) = t.await.unwrap() {
            assert_eq!(s.code(), Code::Aborted, "{s}");
        }
    }
    assert_eq!(env.loops().len(), 1);
    assert_eq!(env.mounts().len(), 2);
    assert_eq!(std::fs::read(target.join("ok")).unwrap(), b"fine");

    // 8 NodeUnpublish, 8 NodeUnstage: gone, once.
    let ur = csi::NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: s(&target),
        force: false,
    };
    all_at_once!(8, c, ur, |k, r| k.node.node_unpublish_volume(r));
    c.node.node_unpublish_volume(ur.clone()).await.unwrap();
    let usr = csi::NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: s(&staging),
        force: false,
    };
    all_at_once!(8, c, usr, |k, r| k.node.node_unstage_volume(r));
    c.node.node_unstage_volume(usr.clone()).await.unwrap();
    env.assert_clean();

    // Several volumes staged at once each get their own loop device (the
    // free-device race inside the kernel is retried, not shared).
    let mut vols = Vec::new();
    for i in 0..4 {
        let v = create(&mut c, &format!("pvc-par-{i}"), 16 * MIB, &cap).await;
        let ctx = cpublish(&mut c, &v, &cap).await;
        vols.push((v, ctx));
    }
    let mut tasks = Vec::new();
    for (v, ctx) in &vols {
        let mut k = c.clone();
        let req = csi::NodeStageVolumeRequest {
            volume_id: v.clone(),
            publish_context: ctx.clone(),
            staging_target_path: s(&env.staging_path("node-a", v)),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        };
        tasks.push(tokio::spawn(
            async move { k.node.node_stage_volume(req).await },
        ));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let loops = env.loops();
    assert_eq!(loops.len(), 4, "{loops:?}");
    let mut devs: Vec<_> = vols
        .iter()
        .map(|(v, _)| {
            let m = mounts::mounts_at(&env.staging_path("node-a", v)).unwrap();
            assert_eq!(m.len(), 1);
            (m[0].major, m[0].minor)
        })
        .collect();
    devs.sort();
    devs.dedup();
    assert_eq!(devs.len(), 4, "each volume on its own device");
    for (v, _) in &vols {
        let staging = env.staging_path("node-a", v);
        teardown(&mut c, v, &staging, &[]).await;
    }
    teardown(&mut c, &id, &staging, &[]).await;
    w.finish().await;
}

/// A volume already staged is refused at a second staging path (FAILED_PRECONDITION,
/// nothing changed, and the first staging still unstages). Mount options the kernel can
/// never take are INVALID_ARGUMENT before anything is attached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_staging_path_and_impossible_mount_options_change_nothing() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    for (cap, what) in [
        (mount_cap(Access::SingleNodeWriter, "ext4"), "ext4"),
        (block_cap(Access::SingleNodeWriter), "block"),
    ] {
        let id = create(&mut c, &format!("twice-{what}"), 32 << 20, &cap).await;
        let ctx = cpublish(&mut c, &id, &cap).await;
        let first = env.staging_path("node-a", &id);
        let stage = |path: &Path| csi::NodeStageVolumeRequest {
            volume_id: id.clone(),
            publish_context: ctx.clone(),
            staging_target_path: s(path),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        };
        // Positive control: the first staging works, and is idempotent.
        c.node.node_stage_volume(stage(&first)).await.unwrap();
        c.node.node_stage_volume(stage(&first)).await.unwrap();
        let second = first.parent().unwrap().join("second-globalmount");
        let before = world(env, &[]);
        let err = c.node.node_stage_volume(stage(&second)).await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{what}: {err:?}");
        assert!(
            err.message().contains(&s(&first)) || err.message().contains("already staged"),
            "{what}: names the staging: {}",
            err.message()
        );
        assert_same(
            &before,
            &world(env, &[]),
            &format!("{what}: second staging path"),
        );
        teardown(&mut c, &id, &first, &[]).await;
    }

    let id = create(
        &mut c,
        "bad-options",
        32 << 20,
        &mount_cap(Access::SingleNodeWriter, "ext4"),
    )
    .await;
    let good = mount_cap(Access::SingleNodeWriter, "ext4");
    let ctx = cpublish(&mut c, &id, &good).await;
    let staging = env.staging_path("node-a", &id);
    for flags in [
        vec!["X-mount.mkdir".to_string()],
        vec!["x-systemd.automount".to_string()],
        vec!["nofail".to_string()],
        vec!["context=system_u:object_r:container_file_t:s0".to_string()],
        vec!["noatime,X-mount.mode=0755".to_string()],
        vec!["".to_string()],
    ] {
        if flags[0].starts_with("context=") && Path::new("/sys/fs/selinux/enforce").exists() {
            continue; // with SELinux the kernel may take it
        }
        let cap = cap_with(
            Some(Access::SingleNodeWriter),
            mount_type("ext4", flags.clone(), ""),
        );
        let before = world(env, &[]);
        let err = c
            .node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: id.clone(),
                publish_context: ctx.clone(),
                staging_target_path: s(&staging),
                volume_capability: Some(cap),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{flags:?}: {err:?}");
        assert_same(
            &before,
            &world(env, &[]),
            &format!("mount options {flags:?}"),
        );
    }
    // Positive control: kernel options that exist are taken.
    let ok = cap_with(
        Some(Access::SingleNodeWriter),
        mount_type("ext4", vec!["noatime".into()], ""),
    );
    c.node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: id.clone(),
            publish_context: ctx.clone(),
            staging_target_path: s(&staging),
            volume_capability: Some(ok),
            ..Default::default()
        })
        .await
        .expect("noatime is a real option");
    teardown(&mut c, &id, &staging, &[]).await;
    assert!(env.loops().is_empty() && env.mounts().is_empty());
}
