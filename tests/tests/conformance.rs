//! Conformance with the CSI spec v1.12: every RPC the driver serves, driven
//! over its real unix socket, with the error codes the spec documents, and
//! checked against the kernel (mount table, loop devices, image files, data
//! checksums). Every test tears down through the RPCs and ends clean.

use std::collections::{BTreeSet, HashMap};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Bytes every image carries behind the volume data (the fence window).
const TRAILER: i64 = fencecsi_driver::fence::TRAILER_BYTES as i64;

use fencecsi_driver::config::{Mode, DEFAULT_DRIVER_NAME};
use fencecsi_driver::kernel::mounts;
use fencecsi_driver::terms::{CTX_FS_TYPE, CTX_GENERATION, CTX_READONLY, TOPOLOGY_KEY};
use fencecsi_proto::client::with_extensions;
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::csi::controller_service_capability::rpc::Type as CtlRpc;
use fencecsi_tests::csi::node_service_capability::rpc::Type as NodeRpc;
use fencecsi_tests::csi::plugin_capability::service::Type as Svc;
use fencecsi_tests::csi::plugin_capability::volume_expansion::Type as Expansion;
use fencecsi_tests::csi::volume_content_source::{SnapshotSource, Type as SrcType, VolumeSource};
use fencecsi_tests::csi::volume_usage::Unit;
use fencecsi_tests::rig::stage_request;
use fencecsi_tests::{
    block_cap, csi, mount_cap, require_root, sha256_file, unpublish_and_delete, Access, AllInOne,
    Env, InProcess,
};
use tonic::Code;

const MIB: i64 = 1 << 20;

// ---------------------------------------------------------------- helpers

/// Asserts the gRPC outcome of a call: `Code::Ok` or the expected error.
macro_rules! assert_code {
    ($call:expr, $code:expr) => {{
        let r = $call.await;
        let got = match &r {
            ::core::result::Result::Ok(_) => Code::Ok,
            ::core::result::Result::Err(s) => s.code(),
        };
        assert_eq!(
            got,
            $code,
            "{} -> {:?}",
            stringify!($call),
            r.as_ref().err().map(|s| s.message().to_string())
        );
    }};
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn image_path(env: &Env, vol: &str, gen: u64) -> PathBuf {
    env.state_dir()
        .join("volumes")
        .join(vol)
        .join(format!("gen-{gen:06}.img"))
}

fn volume_dirs(env: &Env) -> usize {
    std::fs::read_dir(env.state_dir().join("volumes"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn params(p: &[(&str, &str)]) -> HashMap<String, String> {
    p.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn range(required: i64, limit: i64) -> Option<csi::CapacityRange> {
    Some(csi::CapacityRange {
        required_bytes: required,
        limit_bytes: limit,
    })
}

fn create_req(
    name: &str,
    required: i64,
    cap: &csi::VolumeCapability,
    p: &[(&str, &str)],
) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: range(required, 0),
        volume_capabilities: vec![cap.clone()],
        parameters: params(p),
        ..Default::default()
    }
}

async fn create(
    c: &mut CsiClient,
    name: &str,
    required: i64,
    cap: &csi::VolumeCapability,
    p: &[(&str, &str)],
) -> csi::Volume {
    c.controller
        .create_volume(create_req(name, required, cap, p))
        .await
        .unwrap_or_else(|e| panic!("CreateVolume {name}: {e}"))
        .into_inner()
        .volume
        .unwrap()
}

async fn cpublish(
    c: &mut CsiClient,
    vol: &str,
    node: &str,
    cap: &csi::VolumeCapability,
    readonly: bool,
) -> HashMap<String, String> {
    c.controller
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: vol.into(),
            node_id: node.into(),
            volume_capability: Some(cap.clone()),
            readonly,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("ControllerPublish {vol} to {node}: {e}"))
        .into_inner()
        .publish_context
}

/// Where a volume is attached to node-a and staged there.
struct Staged {
    ctx: HashMap<String, String>,
    staging: PathBuf,
}

/// ControllerPublish of `id` to node-a (read-write), then NodeStage at its staging path.
async fn attach_and_stage(
    env: &Env,
    c: &mut CsiClient,
    id: &str,
    cap: &csi::VolumeCapability,
) -> Staged {
    let ctx = cpublish(c, id, "node-a", cap, false).await;
    let staging = env.staging_path("node-a", id);
    c.node
        .node_stage_volume(stage_request(id, &staging, cap, &ctx))
        .await
        .unwrap_or_else(|e| panic!("NodeStage {id}: {e}"));
    Staged { ctx, staging }
}

fn publish_req(
    staging: &Path,
    target: &Path,
    vol: &str,
    cap: &csi::VolumeCapability,
    ctx: &HashMap<String, String>,
    readonly: bool,
) -> csi::NodePublishVolumeRequest {
    csi::NodePublishVolumeRequest {
        volume_id: vol.into(),
        publish_context: ctx.clone(),
        staging_target_path: s(staging),
        target_path: s(target),
        volume_capability: Some(cap.clone()),
        readonly,
        ..Default::default()
    }
}

/// A pod's target path; kubelet creates its parent.
fn pod_target(env: &Env, node: &str, pod: &str, pv: &str) -> PathBuf {
    let t = env.target_path(node, pod, pv);
    std::fs::create_dir_all(t.parent().unwrap()).unwrap();
    t
}

/// A raw block target as kubelet lays it out; kubelet creates its parent.
fn block_target(env: &Env, node: &str, pv: &str, pod: &str) -> PathBuf {
    let dir = env
        .kubelet_dir(node)
        .join("plugins/kubernetes.io/csi/volumeDevices/publish")
        .join(pv);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(pod)
}

async fn node_unpublish(c: &mut CsiClient, vol: &str, target: &Path) {
    c.node
        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: vol.into(),
            target_path: s(target),
            force: false,
        })
        .await
        .unwrap_or_else(|e| panic!("NodeUnpublish {}: {e}", target.display()));
}

async fn node_unstage(c: &mut CsiClient, vol: &str, staging: &Path) {
    c.node
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: vol.into(),
            staging_target_path: s(staging),
            force: false,
        })
        .await
        .unwrap_or_else(|e| panic!("NodeUnstage {}: {e}", staging.display()));
}

/// (major, minor) of a device node.
fn rdev(p: &Path) -> (u32, u32) {
    let r = std::fs::metadata(p).unwrap().rdev();
    (libc::major(r), libc::minor(r))
}

/// The single loop device of this env, and its backing file.
fn only_loop(env: &Env) -> (PathBuf, PathBuf) {
    let loops = env.loops();
    assert_eq!(loops.len(), 1, "exactly one loop device: {loops:?}");
    (loops[0].clone(), fencecsi_tests::backing_file_of(&loops[0]))
}

fn write_payload(path: &Path, seed: u32, len: usize) -> String {
    let data: Vec<u8> = (0..len as u32)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed) % 251) as u8)
        .collect();
    let f = std::fs::File::create(path).unwrap();
    f.write_all_at(&data, 0).unwrap();
    f.sync_all().unwrap();
    sha256_file(path)
}

fn statvfs_total(p: &Path) -> u64 {
    let st = nix::sys::statvfs::statvfs(p).unwrap();
    st.blocks() as u64 * st.fragment_size() as u64
}

/// ext4's online resize needs CAP_SYS_RESOURCE, which some sandboxes drop.
fn has_cap_sys_resource() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_string();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << 24) != 0)
}

fn errno_of(e: &std::io::Error) -> Option<i32> {
    e.raw_os_error()
}

// ---------------------------------------------------------------- identity

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_info_capabilities_probe() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());

    let info = c
        .identity
        .get_plugin_info(csi::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, DEFAULT_DRIVER_NAME);
    assert!(info.name.len() <= 63 && info.name.contains('.'));
    assert!(!info.vendor_version.is_empty());

    let caps = c
        .identity
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let services: BTreeSet<i32> = caps
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(csi::plugin_capability::Type::Service(s)) => Some(s.r#type),
            _ => None,
        })
        .collect();
    assert!(services.contains(&(Svc::ControllerService as i32)));
    assert!(services.contains(&(Svc::VolumeAccessibilityConstraints as i32)));
    assert!(caps.iter().any(|c| matches!(&c.r#type,
        Some(csi::plugin_capability::Type::VolumeExpansion(e)) if e.r#type == Expansion::Online as i32)));

    let probe = c
        .identity
        .probe(csi::ProbeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_ne!(probe.ready, Some(false));

    // A node-only plugin must not claim the controller service, and answers
    // controller RPCs with UNIMPLEMENTED; a controller-only plugin the same
    // for node RPCs.
    let (node_plugin, mut n) =
        InProcess::start(env.config(Mode::Node, Some("node-b"), "node-b")).await;
    let caps = n
        .identity
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert!(!caps.iter().any(|c| matches!(&c.r#type,
        Some(csi::plugin_capability::Type::Service(s)) if s.r#type == Svc::ControllerService as i32)));
    assert_code!(
        n.controller
            .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {}),
        Code::Unimplemented
    );
    assert_code!(
        n.controller.create_volume(create_req(
            "x",
            MIB,
            &mount_cap(Access::SingleNodeWriter, "ext4"),
            &[]
        )),
        Code::Unimplemented
    );
    // Its own state dir: one controller owns a state dir at a time.
    let ctl_env = Env::new();
    let (ctl_plugin, mut k) = InProcess::start(ctl_env.config(Mode::Controller, None, "ctl")).await;
    assert_code!(
        k.node.node_get_info(csi::NodeGetInfoRequest {}),
        Code::Unimplemented
    );
    assert_code!(k.identity.probe(csi::ProbeRequest {}), Code::Ok);

    ctl_plugin.stop().await;
    node_plugin.stop().await;
    w.finish().await;
}

/// The RPC types a controller advertises (every capability must be an RPC one).
fn ctl_types(caps: &[csi::ControllerServiceCapability]) -> BTreeSet<i32> {
    caps.iter()
        .map(|c| match &c.r#type {
            Some(csi::controller_service_capability::Type::Rpc(r)) => r.r#type,
            other => panic!("unexpected capability {other:?}"),
        })
        .collect()
}

/// The RPC types a node advertises.
fn node_types(caps: &[csi::NodeServiceCapability]) -> BTreeSet<i32> {
    caps.iter()
        .map(|c| match &c.r#type {
            Some(csi::node_service_capability::Type::Rpc(r)) => r.r#type,
            other => panic!("unexpected capability {other:?}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_and_node_capabilities_and_node_info() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());

    assert_eq!(CtlRpc::UnpublishFence as i32, 1000);
    assert_eq!(NodeRpc::ForceUnpublish as i32, 1000);
    // A standard caller sees only standard capabilities (conformance suites
    // reject unknown values); a caller that asks for the extensions sees them.
    let plain = ctl_types(
        &c.controller
            .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner()
            .capabilities,
    );
    assert!(
        plain.iter().all(|t| *t < 1000),
        "standard caller saw an extension: {plain:?}"
    );
    let plain_node = node_types(
        &c.node
            .node_get_capabilities(csi::NodeGetCapabilitiesRequest {})
            .await
            .unwrap()
            .into_inner()
            .capabilities,
    );
    assert!(
        plain_node.iter().all(|t| *t < 1000),
        "standard caller saw an extension: {plain_node:?}"
    );

    let ctl = ctl_types(
        &c.controller
            .controller_get_capabilities(with_extensions(csi::ControllerGetCapabilitiesRequest {}))
            .await
            .unwrap()
            .into_inner()
            .capabilities,
    );
    for want in [
        CtlRpc::CreateDeleteVolume,
        CtlRpc::PublishUnpublishVolume,
        CtlRpc::ListVolumes,
        CtlRpc::GetCapacity,
        CtlRpc::CreateDeleteSnapshot,
        CtlRpc::ListSnapshots,
        CtlRpc::CloneVolume,
        CtlRpc::PublishReadonly,
        CtlRpc::ExpandVolume,
        CtlRpc::ListVolumesPublishedNodes,
        CtlRpc::VolumeCondition,
        CtlRpc::GetVolume,
        CtlRpc::SingleNodeMultiWriter,
        CtlRpc::ModifyVolume,
        CtlRpc::UnpublishFence,
    ] {
        assert!(
            ctl.contains(&(want as i32)),
            "controller capability {want:?}"
        );
    }
    // Advertised, so served: a request without a volume is the caller's error.
    assert_code!(
        c.controller
            .controller_modify_volume(csi::ControllerModifyVolumeRequest::default()),
        Code::InvalidArgument
    );

    let node = node_types(
        &c.node
            .node_get_capabilities(with_extensions(csi::NodeGetCapabilitiesRequest {}))
            .await
            .unwrap()
            .into_inner()
            .capabilities,
    );
    for want in [
        NodeRpc::StageUnstageVolume,
        NodeRpc::GetVolumeStats,
        NodeRpc::ExpandVolume,
        NodeRpc::VolumeCondition,
        NodeRpc::SingleNodeMultiWriter,
        NodeRpc::ForceUnpublish,
    ] {
        assert!(node.contains(&(want as i32)), "node capability {want:?}");
    }

    let info = c
        .node
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "node-a");
    assert_eq!(info.max_volumes_per_node, 64);
    let topo = info.accessible_topology.expect("topology");
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    assert_eq!(
        topo.segments.get(TOPOLOGY_KEY).map(String::as_str),
        Some(boot_id.trim())
    );

    // A volume is accessible exactly where the node says it is.
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = c
        .controller
        .create_volume(csi::CreateVolumeRequest {
            accessibility_requirements: Some(csi::TopologyRequirement {
                requisite: vec![topo.clone()],
                preferred: vec![topo.clone()],
            }),
            ..create_req("pvc-topo", 16 * MIB, &cap, &[])
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(vol.accessible_topology, vec![topo.clone()]);
    // Requisite topology the plugin cannot serve: RESOURCE_EXHAUSTED (spec: "Unable to provision in accessible_topology").
    let elsewhere = csi::Topology {
        segments: [(TOPOLOGY_KEY.to_string(), "another-kernel".to_string())].into(),
    };
    assert_code!(
        c.controller.create_volume(csi::CreateVolumeRequest {
            accessibility_requirements: Some(csi::TopologyRequirement {
                requisite: vec![elsewhere],
                preferred: vec![],
            }),
            ..create_req("pvc-topo-elsewhere", 16 * MIB, &cap, &[])
        }),
        Code::ResourceExhausted
    );
    assert_eq!(volume_dirs(env), 1);
    unpublish_and_delete(&mut c, &vol.volume_id).await;
    w.finish().await;
}

// ---------------------------------------------------------------- CreateVolume / DeleteVolume

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_volume_capacity_ranges() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let ext4 = mount_cap(Access::SingleNodeWriter, "ext4");
    let any = mount_cap(Access::SingleNodeWriter, "");
    let block = block_cap(Access::SingleNodeWriter);

    // (name, cap, params, required, limit, expected capacity or None = only "in range")
    type Case<'a> = (
        &'a str,
        &'a csi::VolumeCapability,
        Vec<(&'a str, &'a str)>,
        i64,
        i64,
        Option<i64>,
    );
    let cases: Vec<Case> = vec![
        ("tiny-ext4", &ext4, vec![], 1, 0, Some(16 * MIB)), // raised to the ext4 minimum
        (
            "rounded",
            &ext4,
            vec![],
            33 * MIB + 1,
            0,
            Some(33 * MIB + 4096),
        ), // rounded up to 4 KiB
        (
            "aligned",
            &ext4,
            vec![],
            33 * MIB + 8192,
            0,
            Some(33 * MIB + 8192),
        ), // as asked
        ("exact", &ext4, vec![], 20 * MIB, 20 * MIB, Some(20 * MIB)),
        (
            "limit-wins",
            &ext4,
            vec![],
            20 * MIB + 1,
            20 * MIB + 100,
            Some(20 * MIB + 100),
        ),
        ("only-limit", &ext4, vec![], 0, 24 * MIB, Some(24 * MIB)),
        ("default", &ext4, vec![], 0, 0, Some(1 << 30)),
        (
            "xfs-min",
            &any,
            vec![("fsType", "xfs")],
            1,
            0,
            Some(300 * MIB),
        ),
        ("block-min", &block, vec![], 1, 0, Some(MIB)),
        (
            "k8s-params",
            &ext4,
            vec![
                ("csi.storage.k8s.io/pvc/name", "data"),
                ("csi.storage.k8s.io/pvc/namespace", "ns"),
            ],
            16 * MIB,
            0,
            Some(16 * MIB),
        ),
    ];
    let mut ids = Vec::new();
    for (name, cap, p, req, lim, want) in &cases {
        let vol = c
            .controller
            .create_volume(csi::CreateVolumeRequest {
                capacity_range: range(*req, *lim),
                ..create_req(name, 0, cap, p)
            })
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .into_inner()
            .volume
            .unwrap();
        let got = vol.capacity_bytes;
        assert!(
            got >= *req && (*lim == 0 || got <= *lim),
            "{name}: {got} not in [{req}, {lim}]"
        );
        if let Some(w) = want {
            assert_eq!(got, *w, "{name}");
        }
        // The image is exactly that big, and sparse.
        let img = std::fs::metadata(image_path(env, &vol.volume_id, 1)).unwrap();
        assert_eq!(
            img.len() as i64,
            got + TRAILER,
            "{name}: image size (data + fence trailer)"
        );
        assert!(
            img.blocks() * 512 < MIB as u64,
            "{name}: image must be sparse"
        );
        ids.push(vol.volume_id);
    }
    assert_eq!(volume_dirs(env), cases.len());

    // Ranges that cannot be met: OUT_OF_RANGE; malformed ones: INVALID_ARGUMENT. Nothing is created.
    for (req, lim, code) in [
        (0, MIB, Code::OutOfRange),     // limit below the ext4 minimum
        (1 << 50, 0, Code::OutOfRange), // more than the backend holds
        (-1, 0, Code::InvalidArgument),
        (0, -1, Code::InvalidArgument),
        (20 * MIB, 19 * MIB, Code::InvalidArgument),
    ] {
        assert_code!(
            c.controller.create_volume(csi::CreateVolumeRequest {
                capacity_range: range(req, lim),
                ..create_req(&format!("bad-{req}-{lim}"), 0, &ext4, &[])
            }),
            code
        );
    }
    assert_eq!(volume_dirs(env), cases.len());

    for id in &ids {
        unpublish_and_delete(&mut c, id).await;
    }
    assert_eq!(volume_dirs(env), 0);
    let left = c
        .controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(left.entries.is_empty());
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_volume_is_idempotent_by_name_and_refuses_conflicts() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");

    let v1 = create(&mut c, "pvc-idem", 32 * MIB, &cap, &[]).await;
    assert_eq!(
        v1.volume_context.get("fsType").map(String::as_str),
        Some("ext4")
    );
    let v2 = create(&mut c, "pvc-idem", 32 * MIB, &cap, &[]).await;
    assert_eq!(v1, v2, "same name and arguments: the same volume");
    // A smaller request that the existing volume satisfies is compatible too.
    let v3 = create(&mut c, "pvc-idem", 20 * MIB, &cap, &[]).await;
    assert_eq!(v3.volume_id, v1.volume_id);
    assert_eq!(v3.capacity_bytes, 32 * MIB);

    let snap_src = Some(csi::VolumeContentSource {
        r#type: Some(SrcType::Snapshot(SnapshotSource {
            snapshot_id: format!("snap-{}", "0".repeat(32)),
        })),
    });
    for (what, req) in [
        ("bigger", create_req("pvc-idem", 64 * MIB, &cap, &[])),
        (
            "limit below",
            csi::CreateVolumeRequest {
                capacity_range: range(16 * MIB, 16 * MIB),
                ..create_req("pvc-idem", 0, &cap, &[])
            },
        ),
        (
            "other fs",
            create_req(
                "pvc-idem",
                32 * MIB,
                &mount_cap(Access::SingleNodeWriter, "xfs"),
                &[],
            ),
        ),
        (
            "other fs parameter",
            create_req(
                "pvc-idem",
                32 * MIB,
                &mount_cap(Access::SingleNodeWriter, ""),
                &[("fsType", "xfs")],
            ),
        ),
        (
            "other source",
            csi::CreateVolumeRequest {
                volume_content_source: snap_src.clone(),
                ..create_req("pvc-idem", 32 * MIB, &cap, &[])
            },
        ),
    ] {
        let err = c.controller.create_volume(req).await.expect_err(what);
        assert_eq!(err.code(), Code::AlreadyExists, "{what}: {}", err.message());
    }
    // Missing fields.
    assert_code!(
        c.controller
            .create_volume(create_req("", 16 * MIB, &cap, &[])),
        Code::InvalidArgument
    );
    assert_code!(
        c.controller.create_volume(csi::CreateVolumeRequest {
            name: "pvc-nocaps".into(),
            ..Default::default()
        }),
        Code::InvalidArgument
    );
    // The maximum-length name csi-sanity uses (128) is fine.
    let long = create(&mut c, &"n".repeat(128), 16 * MIB, &cap, &[]).await;
    assert_eq!(volume_dirs(env), 2);
    unpublish_and_delete(&mut c, &long.volume_id).await;
    unpublish_and_delete(&mut c, &v1.volume_id).await;
    // After deletion the name is free again, for a new volume.
    let v4 = create(&mut c, "pvc-idem", 64 * MIB, &cap, &[]).await;
    assert_ne!(v4.volume_id, v1.volume_id);
    unpublish_and_delete(&mut c, &v4.volume_id).await;
    assert_eq!(volume_dirs(env), 0);

    // xfs needs 300 MiB: a smaller request is rounded up. The same name with a range
    // the existing volume does not fit is ALREADY_EXISTS (the name answers first); a new
    // name with that range is OUT_OF_RANGE.
    let xfs = mount_cap(Access::SingleNodeWriter, "xfs");
    let small = create(&mut c, "pvc-xfs", 64 * MIB, &xfs, &[]).await;
    assert_eq!(small.capacity_bytes, 300 * MIB);
    let tight = |name: &str| csi::CreateVolumeRequest {
        capacity_range: range(128 * MIB, 128 * MIB),
        ..create_req(name, 0, &xfs, &[])
    };
    assert_code!(
        c.controller.create_volume(tight("pvc-xfs")),
        Code::AlreadyExists
    );
    assert_code!(
        c.controller.create_volume(tight("pvc-xfs-2")),
        Code::OutOfRange
    );
    unpublish_and_delete(&mut c, &small.volume_id).await;
    assert_eq!(volume_dirs(env), 0);
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_volume_is_idempotent_and_refused_while_published() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = create(&mut c, "pvc-del", 16 * MIB, &cap, &[]).await;
    let id = vol.volume_id.clone();
    cpublish(&mut c, &id, "node-a", &cap, false).await;
    let del = || csi::DeleteVolumeRequest {
        volume_id: id.clone(),
        ..Default::default()
    };
    assert_code!(c.controller.delete_volume(del()), Code::FailedPrecondition);
    assert!(image_path(env, &id, 1).exists(), "nothing deleted");
    c.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: "node-a".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_code!(c.controller.delete_volume(del()), Code::Ok);
    assert!(!env.state_dir().join("volumes").join(&id).exists());
    assert_code!(c.controller.delete_volume(del()), Code::Ok);
    for unknown in ["pvc-never-existed", &format!("vol-{}", "ab".repeat(16))] {
        assert_code!(
            c.controller.delete_volume(csi::DeleteVolumeRequest {
                volume_id: unknown.to_string(),
                ..Default::default()
            }),
            Code::Ok
        );
    }
    assert_code!(
        c.controller
            .delete_volume(csi::DeleteVolumeRequest::default()),
        Code::InvalidArgument
    );
    assert_code!(
        c.controller
            .controller_get_volume(csi::ControllerGetVolumeRequest {
                volume_id: id.clone()
            }),
        Code::NotFound
    );
    w.finish().await;
}

// ---------------------------------------------------------------- snapshots and clones

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_clones_carry_the_data() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let src = create(&mut c, "pvc-src", 64 * MIB, &cap, &[]).await;
    let sid = src.volume_id.clone();
    let ctx = cpublish(&mut c, &sid, "node-a", &cap, false).await;
    let staging = env.staging_path("node-a", &sid);
    let target = pod_target(env, "node-a", "pod-src", "pv-src");

    // Write v1 of the data, unmount everything so the image is consistent.
    c.node
        .node_stage_volume(stage_request(&sid, &staging, &cap, &ctx))
        .await
        .unwrap();
    c.node
        .node_publish_volume(publish_req(&staging, &target, &sid, &cap, &ctx, false))
        .await
        .unwrap();
    let v1 = write_payload(&target.join("data.bin"), 1, 3 << 20);
    node_unpublish(&mut c, &sid, &target).await;
    node_unstage(&mut c, &sid, &staging).await;

    let snap_req = |name: &str, source: &str| csi::CreateSnapshotRequest {
        name: name.into(),
        source_volume_id: source.into(),
        ..Default::default()
    };
    let snap = c
        .controller
        .create_snapshot(snap_req("snap-1", &sid))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(snap.ready_to_use);
    assert_eq!(snap.source_volume_id, sid);
    assert_eq!(snap.size_bytes, 64 * MIB);
    assert!(snap.creation_time.as_ref().is_some_and(|t| t.seconds > 0));
    let again = c
        .controller
        .create_snapshot(snap_req("snap-1", &sid))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(
        again.snapshot_id, snap.snapshot_id,
        "CreateSnapshot is idempotent by name"
    );
    let other = create(&mut c, "pvc-other", 16 * MIB, &cap, &[]).await;
    assert_code!(
        c.controller
            .create_snapshot(snap_req("snap-1", &other.volume_id)),
        Code::AlreadyExists
    );
    assert_code!(
        c.controller.create_snapshot(snap_req("", &sid)),
        Code::InvalidArgument
    );
    assert_code!(
        c.controller.create_snapshot(snap_req("snap-x", "")),
        Code::InvalidArgument
    );
    assert_code!(
        c.controller
            .create_snapshot(snap_req("snap-x", &format!("vol-{}", "0".repeat(32)))),
        Code::NotFound
    );
    assert_code!(
        c.controller.create_snapshot(csi::CreateSnapshotRequest {
            parameters: params(&[("speed", "fast")]),
            ..snap_req("snap-x", &sid)
        }),
        Code::InvalidArgument
    );

    // Change the source after the snapshot: v2.
    c.node
        .node_stage_volume(stage_request(&sid, &staging, &cap, &ctx))
        .await
        .unwrap();
    c.node
        .node_publish_volume(publish_req(&staging, &target, &sid, &cap, &ctx, false))
        .await
        .unwrap();
    let v2 = write_payload(&target.join("data.bin"), 2, 3 << 20);
    assert_ne!(v1, v2);
    node_unpublish(&mut c, &sid, &target).await;
    node_unstage(&mut c, &sid, &staging).await;

    let from = |src: SrcType| Some(csi::VolumeContentSource { r#type: Some(src) });
    let snap_source = SrcType::Snapshot(SnapshotSource {
        snapshot_id: snap.snapshot_id.clone(),
    });
    let vol_source = SrcType::Volume(VolumeSource {
        volume_id: sid.clone(),
    });
    // Smaller than the source: OUT_OF_RANGE. Missing sources: NOT_FOUND.
    assert_code!(
        c.controller.create_volume(csi::CreateVolumeRequest {
            volume_content_source: from(snap_source.clone()),
            ..create_req("clone-small", 32 * MIB, &cap, &[])
        }),
        Code::OutOfRange
    );
    for missing in [
        SrcType::Snapshot(SnapshotSource {
            snapshot_id: format!("snap-{}", "1".repeat(32)),
        }),
        SrcType::Snapshot(SnapshotSource {
            snapshot_id: "not-a-snapshot".into(),
        }),
        SrcType::Volume(VolumeSource {
            volume_id: format!("vol-{}", "1".repeat(32)),
        }),
    ] {
        assert_code!(
            c.controller.create_volume(csi::CreateVolumeRequest {
                volume_content_source: from(missing),
                ..create_req("clone-missing", 64 * MIB, &cap, &[])
            }),
            Code::NotFound
        );
    }

    let mut clones = Vec::new();
    for (name, source, size, want) in [
        ("clone-of-snap", snap_source.clone(), 80 * MIB, &v1),
        ("clone-of-vol", vol_source.clone(), 64 * MIB, &v2),
    ] {
        let vol = c
            .controller
            .create_volume(csi::CreateVolumeRequest {
                volume_content_source: from(source.clone()),
                ..create_req(name, size, &cap, &[])
            })
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        assert_eq!(vol.capacity_bytes, size);
        assert_eq!(
            vol.content_source,
            from(source),
            "{name}: content_source echoed"
        );
        let img = image_path(env, &vol.volume_id, 1);
        assert_eq!(
            std::fs::metadata(&img).unwrap().len() as i64,
            size + TRAILER
        );
        assert_ne!(
            std::fs::metadata(&img).unwrap().ino(),
            std::fs::metadata(image_path(env, &sid, 1)).unwrap().ino()
        );
        let id = vol.volume_id.clone();
        let Staged { ctx, staging } = attach_and_stage(env, &mut c, &id, &cap).await;
        let target = pod_target(env, "node-a", name, name);
        c.node
            .node_publish_volume(publish_req(&staging, &target, &id, &cap, &ctx, false))
            .await
            .unwrap();
        assert_eq!(&sha256_file(&target.join("data.bin")), want, "{name}: data");
        clones.push((id, staging, target));
    }
    assert_eq!(env.loops().len(), 2);
    for (id, staging, target) in &clones {
        node_unpublish(&mut c, id, target).await;
        node_unstage(&mut c, id, staging).await;
    }

    // Deleting the snapshot leaves its clone alone; deleting twice is fine.
    for _ in 0..2 {
        c.controller
            .delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: snap.snapshot_id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert!(!env
        .state_dir()
        .join("snapshots")
        .join(&snap.snapshot_id)
        .exists());
    assert!(image_path(env, &clones[0].0, 1).exists());
    assert_code!(
        c.controller
            .delete_snapshot(csi::DeleteSnapshotRequest::default()),
        Code::InvalidArgument
    );
    for (id, _, _) in &clones {
        unpublish_and_delete(&mut c, id).await;
    }
    unpublish_and_delete(&mut c, &other.volume_id).await;
    unpublish_and_delete(&mut c, &sid).await;
    assert_eq!(volume_dirs(env), 0);
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_snapshots_pages_and_filters() {
    require_root!();
    let w = AllInOne::start().await;
    let mut c = w.client.clone();
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let a = create(&mut c, "pvc-a", 16 * MIB, &cap, &[]).await.volume_id;
    let b = create(&mut c, "pvc-b", 16 * MIB, &cap, &[]).await.volume_id;
    let mut all = BTreeSet::new();
    for (name, vol) in [("a-1", &a), ("a-2", &a), ("a-3", &a), ("b-1", &b)] {
        let sn = c
            .controller
            .create_snapshot(csi::CreateSnapshotRequest {
                name: name.into(),
                source_volume_id: vol.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .snapshot
            .unwrap();
        all.insert(sn.snapshot_id);
    }
    let lc = c.clone();
    let list = move |req: csi::ListSnapshotsRequest| {
        let mut c = lc.clone();
        async move {
            c.controller
                .list_snapshots(req)
                .await
                .map(|r| r.into_inner())
        }
    };
    let ids = |r: &csi::ListSnapshotsResponse| -> Vec<String> {
        r.entries
            .iter()
            .map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone())
            .collect()
    };
    let everything = list(Default::default()).await.unwrap();
    assert_eq!(ids(&everything).into_iter().collect::<BTreeSet<_>>(), all);
    assert!(everything.next_token.is_empty());

    // Pages of 3: all snapshots exactly once.
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = list(csi::ListSnapshotsRequest {
            max_entries: 3,
            starting_token: token.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        assert!(page.entries.len() <= 3);
        seen.extend(ids(&page));
        pages += 1;
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(pages, 2);
    assert_eq!(seen.len(), 4);
    assert_eq!(seen.into_iter().collect::<BTreeSet<_>>(), all);

    let of_a = list(csi::ListSnapshotsRequest {
        source_volume_id: a.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(of_a.entries.len(), 3);
    assert!(of_a
        .entries
        .iter()
        .all(|e| e.snapshot.as_ref().unwrap().source_volume_id == a));
    let one = all.iter().next().unwrap().clone();
    let by_id = list(csi::ListSnapshotsRequest {
        snapshot_id: one.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(ids(&by_id), vec![one]);
    for empty in [
        csi::ListSnapshotsRequest {
            snapshot_id: format!("snap-{}", "9".repeat(32)),
            ..Default::default()
        },
        csi::ListSnapshotsRequest {
            snapshot_id: "no-such-snapshot".into(),
            ..Default::default()
        },
        csi::ListSnapshotsRequest {
            source_volume_id: format!("vol-{}", "9".repeat(32)),
            ..Default::default()
        },
    ] {
        assert!(list(empty).await.unwrap().entries.is_empty());
    }
    assert_eq!(
        list(csi::ListSnapshotsRequest {
            starting_token: "bogus-token".into(),
            ..Default::default()
        })
        .await
        .unwrap_err()
        .code(),
        Code::Aborted
    );
    assert_eq!(
        list(csi::ListSnapshotsRequest {
            max_entries: -1,
            ..Default::default()
        })
        .await
        .unwrap_err()
        .code(),
        Code::InvalidArgument
    );

    for id in &all {
        c.controller
            .delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id: id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert!(list(Default::default()).await.unwrap().entries.is_empty());
    unpublish_and_delete(&mut c, &a).await;
    unpublish_and_delete(&mut c, &b).await;
    w.finish().await;
}

// ---------------------------------------------------------------- ControllerPublish / Unpublish

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_publish_unpublish() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let (node_b, _b) = InProcess::start(env.config(Mode::Node, Some("node-b"), "node-b")).await;
    let snw = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = create(&mut c, "pvc-pub", 16 * MIB, &snw, &[]).await;
    let id = vol.volume_id.clone();
    let req = |vol: &str, node: &str, cap: Option<&csi::VolumeCapability>, readonly: bool| {
        csi::ControllerPublishVolumeRequest {
            volume_id: vol.into(),
            node_id: node.into(),
            volume_capability: cap.cloned(),
            readonly,
            ..Default::default()
        }
    };

    // Missing or bad arguments, unknown volume and node.
    for (r, code) in [
        (req("", "node-a", Some(&snw), false), Code::InvalidArgument),
        (req(&id, "", Some(&snw), false), Code::InvalidArgument),
        (req(&id, "node-a", None, false), Code::InvalidArgument),
        (
            req(
                &id,
                "node-a",
                Some(&mount_cap(Access::MultiNodeMultiWriter, "ext4")),
                false,
            ),
            Code::InvalidArgument,
        ),
        (
            req("fake-vol-id", "node-a", Some(&snw), false),
            Code::NotFound,
        ),
        (
            req(
                &format!("vol-{}", "7".repeat(32)),
                "node-a",
                Some(&snw),
                false,
            ),
            Code::NotFound,
        ),
        (req(&id, "node-z", Some(&snw), false), Code::NotFound),
    ] {
        assert_code!(c.controller.controller_publish_volume(r.clone()), code);
    }

    let ctx = cpublish(&mut c, &id, "node-a", &snw, false).await;
    assert_eq!(ctx.get(CTX_GENERATION).map(String::as_str), Some("1"));
    assert_eq!(ctx.get(CTX_FS_TYPE).map(String::as_str), Some("ext4"));
    assert_eq!(ctx.get(CTX_READONLY).map(String::as_str), Some("false"));
    assert_eq!(
        cpublish(&mut c, &id, "node-a", &snw, false).await,
        ctx,
        "idempotent"
    );
    // Same node, incompatible (read-only now): ALREADY_EXISTS.
    assert_code!(
        c.controller
            .controller_publish_volume(req(&id, "node-a", Some(&snw), true)),
        Code::AlreadyExists
    );
    // Single-node mode, another node: FAILED_PRECONDITION.
    assert_code!(
        c.controller
            .controller_publish_volume(req(&id, "node-b", Some(&snw), false)),
        Code::FailedPrecondition
    );
    let published = |c: &CsiClient, id: String| {
        let mut c = c.clone();
        async move {
            c.controller
                .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: id })
                .await
                .unwrap()
                .into_inner()
                .status
                .unwrap()
                .published_node_ids
                .into_iter()
                .collect::<BTreeSet<_>>()
        }
    };
    assert_eq!(
        published(&c, id.clone()).await,
        BTreeSet::from(["node-a".to_string()])
    );

    let unpub = |node: &str| csi::ControllerUnpublishVolumeRequest {
        volume_id: id.clone(),
        node_id: node.into(),
        ..Default::default()
    };
    assert_code!(
        c.controller.controller_unpublish_volume(unpub("node-a")),
        Code::Ok
    );
    assert_code!(
        c.controller.controller_unpublish_volume(unpub("node-a")),
        Code::Ok
    );
    assert_code!(
        c.controller.controller_unpublish_volume(unpub("node-b")),
        Code::Ok
    );
    assert_code!(
        c.controller
            .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest::default()),
        Code::InvalidArgument
    );
    // A volume that does not exist is published nowhere: OK, as the spec recommends.
    for missing in ["vol-00000000000000000000000000000000", "some-foreign-id"] {
        assert_code!(
            c.controller
                .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                    volume_id: missing.into(),
                    node_id: "node-a".into(),
                    fence: true,
                    ..Default::default()
                }),
            Code::Ok
        );
    }
    assert!(published(&c, id.clone()).await.is_empty());

    // Read-only publish.
    let ro = cpublish(&mut c, &id, "node-a", &snw, true).await;
    assert_eq!(ro.get(CTX_READONLY).map(String::as_str), Some("true"));
    assert_code!(
        c.controller.controller_unpublish_volume(unpub("node-a")),
        Code::Ok
    );

    // MULTI_NODE_READER_ONLY: two nodes at once, both read-only.
    let mnro = mount_cap(Access::MultiNodeReaderOnly, "ext4");
    let a = cpublish(&mut c, &id, "node-a", &mnro, false).await;
    let b = cpublish(&mut c, &id, "node-b", &mnro, false).await;
    assert_eq!(a.get(CTX_READONLY).map(String::as_str), Some("true"));
    assert_eq!(b.get(CTX_READONLY).map(String::as_str), Some("true"));
    assert_eq!(
        published(&c, id.clone()).await,
        BTreeSet::from(["node-a".to_string(), "node-b".to_string()])
    );
    // ListVolumes reports the same nodes.
    let listed = c
        .controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let entry = listed
        .entries
        .iter()
        .find(|e| e.volume.as_ref().unwrap().volume_id == id)
        .unwrap();
    let nodes: BTreeSet<String> = entry
        .status
        .as_ref()
        .unwrap()
        .published_node_ids
        .iter()
        .cloned()
        .collect();
    assert_eq!(
        nodes,
        BTreeSet::from(["node-a".to_string(), "node-b".to_string()])
    );
    // Unpublish without a node: from every node.
    c.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(published(&c, id.clone()).await.is_empty());

    unpublish_and_delete(&mut c, &id).await;
    node_b.stop().await;
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_publish_respects_max_volumes_per_node() {
    require_root!();
    let env = Env::new();
    let mut cfg = env.config(Mode::All, Some("node-a"), "all");
    cfg.max_volumes_per_node = 2;
    let (plugin, mut c) = InProcess::start(cfg).await;
    assert_eq!(
        c.node
            .node_get_info(csi::NodeGetInfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .max_volumes_per_node,
        2
    );
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(
            create(&mut c, &format!("pvc-max-{i}"), 16 * MIB, &cap, &[])
                .await
                .volume_id,
        );
    }
    cpublish(&mut c, &ids[0], "node-a", &cap, false).await;
    cpublish(&mut c, &ids[1], "node-a", &cap, false).await;
    let third = || csi::ControllerPublishVolumeRequest {
        volume_id: ids[2].clone(),
        node_id: "node-a".into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    assert_code!(
        c.controller.controller_publish_volume(third()),
        Code::ResourceExhausted
    );
    // Re-publishing an attached volume is idempotent, not a new attachment.
    cpublish(&mut c, &ids[1], "node-a", &cap, false).await;
    c.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: ids[0].clone(),
            node_id: "node-a".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_code!(c.controller.controller_publish_volume(third()), Code::Ok);
    for id in &ids {
        unpublish_and_delete(&mut c, id).await;
    }
    plugin.stop().await;
    env.assert_clean();
}

// ---------------------------------------------------------------- Validate / List / GetCapacity / GetVolume

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_volume_capabilities() {
    require_root!();
    let w = AllInOne::start().await;
    let mut c = w.client.clone();
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let id = create(&mut c, "pvc-val", 16 * MIB, &cap, &[])
        .await
        .volume_id;
    let validate = |caps: Vec<csi::VolumeCapability>, p: &[(&str, &str)]| {
        csi::ValidateVolumeCapabilitiesRequest {
            volume_id: id.clone(),
            volume_capabilities: caps,
            parameters: params(p),
            ..Default::default()
        }
    };

    for ok in [
        vec![cap.clone()],
        vec![mount_cap(Access::SingleNodeWriter, "")],
        vec![
            mount_cap(Access::SingleNodeMultiWriter, "ext4"),
            mount_cap(Access::MultiNodeReaderOnly, "ext4"),
        ],
        vec![block_cap(Access::SingleNodeWriter)],
    ] {
        let r = c
            .controller
            .validate_volume_capabilities(validate(ok.clone(), &[("fsType", "ext4")]))
            .await
            .unwrap()
            .into_inner();
        let confirmed = r
            .confirmed
            .unwrap_or_else(|| panic!("{ok:?}: {}", r.message));
        assert_eq!(
            confirmed.volume_capabilities, ok,
            "confirmed echoes the capabilities"
        );
        assert_eq!(confirmed.parameters, params(&[("fsType", "ext4")]));
    }
    for (bad, p) in [
        (
            vec![mount_cap(Access::MultiNodeMultiWriter, "ext4")],
            vec![],
        ),
        (
            vec![mount_cap(Access::MultiNodeSingleWriter, "ext4")],
            vec![],
        ),
        (
            vec![cap.clone(), mount_cap(Access::MultiNodeMultiWriter, "ext4")],
            vec![],
        ),
        (vec![mount_cap(Access::SingleNodeWriter, "xfs")], vec![]),
        (vec![cap.clone()], vec![("color", "blue")]),
    ] {
        let r = c
            .controller
            .validate_volume_capabilities(validate(bad.clone(), &p))
            .await
            .unwrap()
            .into_inner();
        assert!(r.confirmed.is_none(), "{bad:?} must not be confirmed");
        assert!(!r.message.is_empty(), "{bad:?}: a message says why");
    }
    assert_code!(
        c.controller
            .validate_volume_capabilities(validate(vec![], &[])),
        Code::InvalidArgument
    );
    assert_code!(
        c.controller
            .validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            }),
        Code::InvalidArgument
    );
    for unknown in ["fake-vol-id", &format!("vol-{}", "5".repeat(32))] {
        assert_code!(
            c.controller
                .validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
                    volume_id: unknown.to_string(),
                    volume_capabilities: vec![cap.clone()],
                    ..Default::default()
                }),
            Code::NotFound
        );
    }
    unpublish_and_delete(&mut c, &id).await;
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_volumes_pages_and_reports_nodes() {
    require_root!();
    let w = AllInOne::start().await;
    let mut c = w.client.clone();
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let mut ids = BTreeSet::new();
    for i in 0..5 {
        ids.insert(
            create(&mut c, &format!("pvc-list-{i}"), 16 * MIB, &cap, &[])
                .await
                .volume_id,
        );
    }
    let published = ids.iter().next().unwrap().clone();
    cpublish(&mut c, &published, "node-a", &cap, false).await;

    let page = |c: &CsiClient, max: i32, token: String| {
        let mut c = c.clone();
        async move {
            c.controller
                .list_volumes(csi::ListVolumesRequest {
                    max_entries: max,
                    starting_token: token,
                })
                .await
                .map(|r| r.into_inner())
        }
    };
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut sizes = Vec::new();
    loop {
        let p = page(&c, 2, token.clone()).await.unwrap();
        sizes.push(p.entries.len());
        for e in &p.entries {
            let v = e.volume.as_ref().unwrap();
            let st = e
                .status
                .as_ref()
                .expect("status (LIST_VOLUMES_PUBLISHED_NODES)");
            if v.volume_id == published {
                assert_eq!(st.published_node_ids, vec!["node-a".to_string()]);
            } else {
                assert!(st.published_node_ids.is_empty());
            }
            let cond = st.volume_condition.as_ref().expect("volume_condition");
            assert!(!cond.abnormal, "{}", cond.message);
            seen.push(v.volume_id.clone());
        }
        if p.next_token.is_empty() {
            break;
        }
        token = p.next_token;
    }
    assert_eq!(sizes, vec![2, 2, 1]);
    assert_eq!(seen.len(), 5);
    assert_eq!(seen.iter().cloned().collect::<BTreeSet<_>>(), ids);

    // A token stays valid when the volume it names is deleted meanwhile.
    let first = page(&c, 2, String::new()).await.unwrap();
    let last_of_page = first.entries[1].volume.as_ref().unwrap().volume_id.clone();
    assert_eq!(first.next_token, last_of_page);
    unpublish_and_delete(&mut c, &last_of_page).await;
    ids.remove(&last_of_page);
    let rest = page(&c, 0, first.next_token.clone()).await.unwrap();
    assert_eq!(
        rest.entries.len(),
        3,
        "the remaining volumes after the token"
    );
    assert!(rest.next_token.is_empty());

    assert_eq!(
        page(&c, 0, "bogus".into()).await.unwrap_err().code(),
        Code::Aborted
    );
    assert_eq!(
        page(&c, -1, String::new()).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    assert_eq!(page(&c, 0, String::new()).await.unwrap().entries.len(), 4);

    for id in &ids {
        unpublish_and_delete(&mut c, id).await;
    }
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_capacity() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let get = |caps: Vec<csi::VolumeCapability>, p: &[(&str, &str)]| csi::GetCapacityRequest {
        volume_capabilities: caps,
        parameters: params(p),
        ..Default::default()
    };
    let st = nix::sys::statvfs::statvfs(&env.state_dir()).unwrap();
    // Never more than the free space (less the fence trailer of the image): the capacity
    // counts what the volumes made have promised (see tests/tests/capacity.rs).
    let free = st.blocks_available() as i64 * st.fragment_size() as i64;
    for (caps, p, min) in [
        (vec![], vec![], 16 * MIB),
        (
            vec![mount_cap(Access::SingleNodeWriter, "ext4")],
            vec![],
            16 * MIB,
        ),
        (
            vec![mount_cap(Access::SingleNodeWriter, "")],
            vec![("fsType", "xfs")],
            300 * MIB,
        ),
        (vec![block_cap(Access::SingleNodeWriter)], vec![], MIB),
    ] {
        let r = c
            .controller
            .get_capacity(get(caps, &p))
            .await
            .unwrap()
            .into_inner();
        assert!(r.available_capacity > 0 && r.available_capacity <= free - TRAILER);
        // The largest volume CreateVolume takes now (the scheduler prefers it to the capacity).
        assert_eq!(r.maximum_volume_size, Some(r.available_capacity));
        assert_eq!(r.minimum_volume_size, Some(min));
    }
    // Nothing can be provisioned with an unsupported capability.
    let r = c
        .controller
        .get_capacity(get(
            vec![mount_cap(Access::MultiNodeMultiWriter, "ext4")],
            &[],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.available_capacity, 0);
    assert_code!(
        c.controller
            .get_capacity(get(vec![], &[("fsType", "ntfs")])),
        Code::InvalidArgument
    );
    assert_code!(
        c.controller.get_capacity(get(vec![], &[("tier", "gold")])),
        Code::InvalidArgument
    );
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_get_volume_reports_status_and_condition() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let vol = create(&mut c, "pvc-get", 16 * MIB, &cap, &[]).await;
    let id = vol.volume_id.clone();
    let get = |c: &CsiClient, id: &str| {
        let mut c = c.clone();
        let id = id.to_string();
        async move {
            c.controller
                .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: id })
                .await
                .map(|r| r.into_inner())
        }
    };
    let r = get(&c, &id).await.unwrap();
    assert_eq!(r.volume.as_ref(), Some(&vol));
    let st = r.status.unwrap();
    assert!(st.published_node_ids.is_empty());
    let cond = st.volume_condition.unwrap();
    assert!(!cond.abnormal);

    let Staged { staging, .. } = attach_and_stage(env, &mut c, &id, &cap).await;
    let (dev, _) = only_loop(env);
    let st = get(&c, &id).await.unwrap().status.unwrap();
    assert_eq!(st.published_node_ids, vec!["node-a".to_string()]);
    let cond = st.volume_condition.unwrap();
    assert!(!cond.abnormal, "{}", cond.message);
    assert!(
        cond.message.contains(&*dev.to_string_lossy()),
        "condition names the holder: {}",
        cond.message
    );

    // The data going missing is abnormal.
    node_unstage(&mut c, &id, &staging).await;
    let img = image_path(env, &id, 1);
    let aside = img.with_extension("aside");
    std::fs::rename(&img, &aside).unwrap();
    let cond = get(&c, &id)
        .await
        .unwrap()
        .status
        .unwrap()
        .volume_condition
        .unwrap();
    assert!(cond.abnormal, "missing data must be abnormal");
    std::fs::rename(&aside, &img).unwrap();

    assert_eq!(get(&c, "").await.unwrap_err().code(), Code::InvalidArgument);
    assert_eq!(
        get(&c, "fake-vol-id").await.unwrap_err().code(),
        Code::NotFound
    );
    assert_eq!(
        get(&c, &format!("vol-{}", "3".repeat(32)))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    unpublish_and_delete(&mut c, &id).await;
    w.finish().await;
}

// ---------------------------------------------------------------- expansion

/// A volume of the expansion tests, published on node-a with 1 MiB of data in it.
struct Grown {
    id: String,
    cap: csi::VolumeCapability,
    ctx: HashMap<String, String>,
    staging: PathBuf,
    target: PathBuf,
    /// The data's checksum.
    sum: String,
}

/// Creates `pvc-<name>-<fs>` of `from` bytes, attaches, stages and publishes it on
/// node-a (target `pod-<name>`/`pv-<name>`), and writes 1 MiB of `seed`'s data.
async fn published_with_payload(
    env: &Env,
    c: &mut CsiClient,
    fs: &str,
    name: &str,
    from: i64,
    seed: u32,
) -> Grown {
    let cap = mount_cap(Access::SingleNodeWriter, fs);
    let id = create(c, &format!("pvc-{name}-{fs}"), from, &cap, &[])
        .await
        .volume_id;
    let Staged { ctx, staging } = attach_and_stage(env, c, &id, &cap).await;
    let target = pod_target(env, "node-a", &format!("pod-{name}"), &format!("pv-{name}"));
    c.node
        .node_publish_volume(publish_req(&staging, &target, &id, &cap, &ctx, false))
        .await
        .unwrap();
    let sum = write_payload(&target.join("keep.bin"), seed, 1 << 20);
    Grown {
        id,
        cap,
        ctx,
        staging,
        target,
        sum,
    }
}

async fn expand_online(fs: &str, from: i64, to: i64) {
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let Grown {
        id,
        cap,
        ctx,
        staging,
        target,
        sum,
    } = published_with_payload(env, &mut c, fs, "grow", from, 9).await;
    let before = statvfs_total(&target);

    let cexp = |id: &str, r: Option<csi::CapacityRange>| csi::ControllerExpandVolumeRequest {
        volume_id: id.into(),
        capacity_range: r,
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    let r = c
        .controller
        .controller_expand_volume(cexp(&id, range(to, 0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, to);
    assert!(r.node_expansion_required);
    assert_eq!(
        std::fs::metadata(image_path(env, &id, 1)).unwrap().len() as i64,
        to + TRAILER
    );
    // Idempotent, and never shrinks.
    let again = c
        .controller
        .controller_expand_volume(cexp(&id, range(to, 0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.capacity_bytes, to);
    let smaller = c
        .controller
        .controller_expand_volume(cexp(&id, range(from, 0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(smaller.capacity_bytes, to);
    assert_code!(
        c.controller
            .controller_expand_volume(cexp(&id, range(0, from))),
        Code::OutOfRange
    );
    assert_code!(
        c.controller.controller_expand_volume(cexp(&id, None)),
        Code::InvalidArgument
    );
    assert_code!(
        c.controller
            .controller_expand_volume(cexp("", range(to, 0))),
        Code::InvalidArgument
    );
    assert_code!(
        c.controller
            .controller_expand_volume(cexp("fake-vol-id", range(to, 0))),
        Code::NotFound
    );

    let nexp = |id: &str, path: &Path| csi::NodeExpandVolumeRequest {
        volume_id: id.into(),
        volume_path: s(path),
        staging_target_path: s(&staging),
        capacity_range: range(to, 0),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    if fs == "xfs" || has_cap_sys_resource() {
        let r = c
            .node
            .node_expand_volume(nexp(&id, &target))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.capacity_bytes, to);
    } else {
        // ext4 online resize needs CAP_SYS_RESOURCE: without it the answer
        // is FAILED_PRECONDITION with nothing changed, and the filesystem
        // grows offline at the next stage.
        assert_code!(
            c.node.node_expand_volume(nexp(&id, &target)),
            Code::FailedPrecondition
        );
        assert_eq!(statvfs_total(&target), before);
        node_unpublish(&mut c, &id, &target).await;
        node_unstage(&mut c, &id, &staging).await;
        c.node
            .node_stage_volume(stage_request(&id, &staging, &cap, &ctx))
            .await
            .unwrap();
        c.node
            .node_publish_volume(publish_req(&staging, &target, &id, &cap, &ctx, false))
            .await
            .unwrap();
    }
    let after = statvfs_total(&target);
    assert!(after > before, "{fs}: filesystem grew: {before} -> {after}");
    assert!(after as i64 > from, "{fs}: now bigger than the old device");
    let stats = c
        .node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: s(&target),
            staging_target_path: s(&staging),
        })
        .await
        .unwrap()
        .into_inner();
    let bytes = stats
        .usage
        .iter()
        .find(|u| u.unit == Unit::Bytes as i32)
        .unwrap();
    assert_eq!(bytes.total as u64, after);
    assert_eq!(sha256_file(&target.join("keep.bin")), sum, "data kept");
    // Idempotent on the node too.
    c.node.node_expand_volume(nexp(&id, &target)).await.unwrap();
    assert_eq!(statvfs_total(&target), after);

    assert_code!(
        c.node
            .node_expand_volume(nexp(&id, &target.with_file_name("missing"))),
        Code::NotFound
    );
    assert_code!(
        c.node.node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        }),
        Code::InvalidArgument
    );
    assert_code!(
        c.node.node_expand_volume(nexp("fake-vol-id", &target)),
        Code::NotFound
    );

    node_unpublish(&mut c, &id, &target).await;
    node_unstage(&mut c, &id, &staging).await;
    unpublish_and_delete(&mut c, &id).await;
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expand_ext4_online() {
    require_root!();
    // Not a whole MiB: the answer is exactly what was asked (csi-sanity compares).
    expand_online("ext4", 32 * MIB, 64 * MIB + 12288).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expand_xfs_online() {
    require_root!();
    expand_online("xfs", 300 * MIB, 400 * MIB).await;
}

/// A volume grown while unstaged (as one restored from a snapshot into a larger claim)
/// has its filesystem grown at the next stage, on both filesystems.
async fn expand_unstaged(fs: &str, from: i64, to: i64) {
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let Grown {
        id,
        cap,
        ctx,
        staging,
        target,
        sum,
    } = published_with_payload(env, &mut c, fs, "grow-off", from, 7).await;
    let before = statvfs_total(&target);
    node_unpublish(&mut c, &id, &target).await;
    node_unstage(&mut c, &id, &staging).await;
    let r = c
        .controller
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: range(to, 0),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.capacity_bytes, to);
    c.node
        .node_stage_volume(stage_request(&id, &staging, &cap, &ctx))
        .await
        .unwrap();
    c.node
        .node_publish_volume(publish_req(&staging, &target, &id, &cap, &ctx, false))
        .await
        .unwrap();
    let after = statvfs_total(&target);
    assert!(
        after > before,
        "{fs}: filesystem grew at stage: {before} -> {after}"
    );
    assert!(after as i64 > from, "{fs}: now bigger than the old device");
    assert_eq!(sha256_file(&target.join("keep.bin")), sum, "data kept");
    node_unpublish(&mut c, &id, &target).await;
    node_unstage(&mut c, &id, &staging).await;
    unpublish_and_delete(&mut c, &id).await;
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expand_xfs_unstaged_grows_at_stage() {
    require_root!();
    expand_unstaged("xfs", 300 * MIB, 400 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expand_ext4_unstaged_grows_at_stage() {
    require_root!();
    expand_unstaged("ext4", 32 * MIB, 64 * MIB).await;
}

// ---------------------------------------------------------------- node: filesystem volumes

async fn stage_publish_filesystem(fs: &str, size: i64) {
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    // The StorageClass parameter chooses the filesystem; the capability leaves it open.
    let cap = mount_cap(Access::SingleNodeWriter, "");
    let vol = create(
        &mut c,
        &format!("pvc-fs-{fs}"),
        size,
        &cap,
        &[("fsType", fs)],
    )
    .await;
    assert_eq!(
        vol.volume_context.get("fsType").map(String::as_str),
        Some(fs)
    );
    let id = vol.volume_id.clone();
    let ctx = cpublish(&mut c, &id, "node-a", &cap, false).await;
    assert_eq!(ctx.get(CTX_FS_TYPE).map(String::as_str), Some(fs));
    let staging = env.staging_path("node-a", &id);

    // Publishing before staging: FAILED_PRECONDITION, nothing mounted.
    let t1 = pod_target(env, "node-a", "pod-1", "pv");
    assert_code!(
        c.node
            .node_publish_volume(publish_req(&staging, &t1, &id, &cap, &ctx, false)),
        Code::FailedPrecondition
    );
    assert!(env.mounts().is_empty());

    for _ in 0..2 {
        c.node
            .node_stage_volume(stage_request(&id, &staging, &cap, &ctx))
            .await
            .unwrap();
        let (dev, backing) = only_loop(env);
        assert_eq!(backing, image_path(env, &id, 1));
        let m = mounts::mounts_at(&staging).unwrap();
        assert_eq!(m.len(), 1, "one staging mount");
        assert_eq!(m[0].fs_type, fs);
        assert!(!m[0].read_only);
        assert_eq!((m[0].major, m[0].minor), rdev(&dev));
    }

    let t2 = pod_target(env, "node-a", "pod-2", "pv");
    for t in [&t1, &t2] {
        for _ in 0..2 {
            c.node
                .node_publish_volume(publish_req(&staging, t, &id, &cap, &ctx, false))
                .await
                .unwrap();
        }
        let m = mounts::mounts_at(t).unwrap();
        assert_eq!(m.len(), 1, "one mount at {}", t.display());
        assert_eq!((m[0].major, m[0].minor), rdev(&only_loop(env).0));
    }
    assert_eq!(env.mounts().len(), 3);
    // One filesystem behind both targets.
    let sum = write_payload(&t1.join("shared.bin"), 5, 512 << 10);
    assert_eq!(sha256_file(&t2.join("shared.bin")), sum);

    // Stats: bytes and inodes, matching statvfs.
    for path in [&t1, &staging] {
        let r = c
            .node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: s(path),
                staging_target_path: s(&staging),
            })
            .await
            .unwrap()
            .into_inner();
        let st = nix::sys::statvfs::statvfs(path.as_path()).unwrap();
        let bytes = r
            .usage
            .iter()
            .find(|u| u.unit == Unit::Bytes as i32)
            .expect("bytes");
        let inodes = r
            .usage
            .iter()
            .find(|u| u.unit == Unit::Inodes as i32)
            .expect("inodes");
        assert_eq!(
            bytes.total as u64,
            st.blocks() as u64 * st.fragment_size() as u64
        );
        assert!(bytes.used > 0 && bytes.available > 0 && bytes.used <= bytes.total);
        assert_eq!(inodes.total as u64, st.files() as u64);
        assert!(inodes.used >= 1 && inodes.used <= inodes.total);
        let cond = r.volume_condition.expect("VOLUME_CONDITION");
        assert!(!cond.abnormal, "{}", cond.message);
    }
    let stats = |id: &str, path: &str| csi::NodeGetVolumeStatsRequest {
        volume_id: id.into(),
        volume_path: path.into(),
        staging_target_path: String::new(),
    };
    let missing = env.kubelet_dir("node-a").join("pods/nope/volumes/x/mount");
    assert_code!(
        c.node.node_get_volume_stats(stats(&id, &s(&missing))),
        Code::NotFound
    );
    assert_code!(
        c.node.node_get_volume_stats(stats(&id, "some/path")),
        Code::NotFound
    );
    assert_code!(
        c.node.node_get_volume_stats(stats("fake-vol-id", &s(&t1))),
        Code::NotFound
    );
    assert_code!(
        c.node.node_get_volume_stats(stats(&id, "")),
        Code::InvalidArgument
    );
    assert_code!(
        c.node.node_get_volume_stats(stats("", &s(&t1))),
        Code::InvalidArgument
    );

    // Unpublish removes the target; idempotent; staging stays.
    for t in [&t1, &t2] {
        node_unpublish(&mut c, &id, t).await;
        node_unpublish(&mut c, &id, t).await;
        assert!(!t.exists(), "target removed");
        assert!(mounts::mounts_at(t).unwrap().is_empty());
    }
    assert_eq!(env.mounts().len(), 1);
    node_unstage(&mut c, &id, &staging).await;
    node_unstage(&mut c, &id, &staging).await;
    env.assert_clean();
    assert!(!staging.exists(), "staging dir removed");
    unpublish_and_delete(&mut c, &id).await;
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_stage_publish_ext4() {
    require_root!();
    stage_publish_filesystem("ext4", 32 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_stage_publish_xfs() {
    require_root!();
    stage_publish_filesystem("xfs", 300 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_publish_refuses_writes() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let id = create(&mut c, "pvc-ro", 32 * MIB, &cap, &[])
        .await
        .volume_id;
    let Staged { ctx, staging } = attach_and_stage(env, &mut c, &id, &cap).await;
    let rw = pod_target(env, "node-a", "pod-rw", "pv");
    let ro = pod_target(env, "node-a", "pod-ro", "pv");
    c.node
        .node_publish_volume(publish_req(&staging, &rw, &id, &cap, &ctx, false))
        .await
        .unwrap();
    let sum = write_payload(&rw.join("file"), 3, 256 << 10);

    // NodePublish readonly=true on a writable staging: this target only is read-only.
    for _ in 0..2 {
        c.node
            .node_publish_volume(publish_req(&staging, &ro, &id, &cap, &ctx, true))
            .await
            .unwrap();
    }
    assert!(mounts::mounts_at(&ro).unwrap()[0].read_only);
    let err = std::fs::write(ro.join("new"), b"x").unwrap_err();
    assert_eq!(errno_of(&err), Some(libc::EROFS), "{err}");
    let err = std::fs::OpenOptions::new()
        .write(true)
        .open(ro.join("file"))
        .unwrap_err();
    assert_eq!(errno_of(&err), Some(libc::EROFS));
    assert_eq!(sha256_file(&ro.join("file")), sum, "reads work");
    // The same target read-write now is incompatible.
    assert_code!(
        c.node
            .node_publish_volume(publish_req(&staging, &ro, &id, &cap, &ctx, false)),
        Code::AlreadyExists
    );
    std::fs::write(rw.join("still-writable"), b"y").unwrap();
    node_unpublish(&mut c, &id, &ro).await;
    node_unpublish(&mut c, &id, &rw).await;
    node_unstage(&mut c, &id, &staging).await;

    // A read-only attachment (ControllerPublish readonly): the loop device and
    // the staging mount are read-only too.
    c.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: "node-a".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let ctx = cpublish(&mut c, &id, "node-a", &cap, true).await;
    c.node
        .node_stage_volume(stage_request(&id, &staging, &cap, &ctx))
        .await
        .unwrap();
    let (dev, _) = only_loop(env);
    assert!(
        fencecsi_driver::kernel::loop_device::status(&dev)
            .unwrap()
            .read_only
    );
    assert!(mounts::mounts_at(&staging).unwrap()[0].read_only);
    c.node
        .node_publish_volume(publish_req(&staging, &ro, &id, &cap, &ctx, false))
        .await
        .unwrap();
    assert!(
        mounts::mounts_at(&ro).unwrap()[0].read_only,
        "publish_context readonly wins"
    );
    let err = std::fs::write(ro.join("new"), b"x").unwrap_err();
    assert_eq!(errno_of(&err), Some(libc::EROFS));
    assert_eq!(sha256_file(&ro.join("file")), sum);
    node_unpublish(&mut c, &id, &ro).await;
    node_unstage(&mut c, &id, &staging).await;
    unpublish_and_delete(&mut c, &id).await;
    w.finish().await;
}

// ---------------------------------------------------------------- node: raw block volumes

const PATTERN_OFF: u64 = 4 << 20;

fn pattern() -> Vec<u8> {
    (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(13) ^ (i >> 9)) as u8)
        .collect()
}

/// Reads `len` bytes at `off` with O_DIRECT (bypassing the page cache).
fn read_direct(path: &Path, off: u64, len: usize) -> Vec<u8> {
    let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
    // SAFETY: non-zero size; freed below with the same layout.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    // SAFETY: ptr is valid for len bytes.
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap();
    f.read_exact_at(buf, off).unwrap();
    let out = buf.to_vec();
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(ptr, layout) };
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_block_volume_round_trip() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let cap = block_cap(Access::SingleNodeWriter);
    let id = create(&mut c, "pvc-block", 32 * MIB, &cap, &[])
        .await
        .volume_id;
    let ctx = cpublish(&mut c, &id, "node-a", &cap, false).await;
    let staging = env.staging_path("node-a", &id);
    let target = block_target(env, "node-a", "pv-block", "pod-1");
    let data = pattern();

    for round in 0..2 {
        for _ in 0..2 {
            c.node
                .node_stage_volume(stage_request(&id, &staging, &cap, &ctx))
                .await
                .unwrap();
        }
        let (dev, backing) = only_loop(env);
        assert_eq!(backing, image_path(env, &id, 1));
        for _ in 0..2 {
            c.node
                .node_publish_volume(publish_req(&staging, &target, &id, &cap, &ctx, false))
                .await
                .unwrap_or_else(|e| panic!("round {round}: NodePublish (block): {e}"));
        }
        let meta = std::fs::metadata(&target).unwrap();
        assert!(
            meta.file_type().is_block_device(),
            "the target is a block device node"
        );
        assert_eq!(rdev(&target), rdev(&dev));
        assert_eq!(mounts::mounts_at(&target).unwrap().len(), 1);
        assert_eq!(
            fencecsi_driver::kernel::filesystem::block_device_size(&target).unwrap() as i64,
            32 * MIB
        );
        let r = c
            .node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: s(&target),
                staging_target_path: s(&staging),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.usage.len(), 1);
        assert_eq!(r.usage[0].total, 32 * MIB);

        if round == 0 {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&target)
                .unwrap();
            f.write_all_at(&data, PATTERN_OFF).unwrap();
            f.sync_all().unwrap();
        }
        assert!(
            read_direct(&target, PATTERN_OFF, data.len()) == data,
            "round {round}: pattern reads back"
        );
        if round == 1 {
            // Unstaging while a pod still has the device: refused, and the
            // loop device stays bound under the pod's target.
            assert_code!(
                c.node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
                    volume_id: id.clone(),
                    staging_target_path: s(&staging),
                    force: false,
                }),
                Code::FailedPrecondition
            );
            assert_eq!(only_loop(env).0, dev);
            assert!(read_direct(&target, PATTERN_OFF, data.len()) == data);
        }
        node_unpublish(&mut c, &id, &target).await;
        assert!(!target.exists(), "block target file removed");
        node_unstage(&mut c, &id, &staging).await;
        env.assert_clean();
        // The pattern is in the image file itself.
        let img = std::fs::File::open(image_path(env, &id, 1)).unwrap();
        let mut buf = vec![0u8; data.len()];
        img.read_exact_at(&mut buf, PATTERN_OFF).unwrap();
        assert!(buf == data, "round {round}: pattern is in the image");
    }
    unpublish_and_delete(&mut c, &id).await;
    w.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_block_read_only_publish_refuses_writes() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let cap = block_cap(Access::SingleNodeWriter);
    let id = create(&mut c, "pvc-block-ro", 16 * MIB, &cap, &[])
        .await
        .volume_id;
    let Staged { ctx, staging } = attach_and_stage(env, &mut c, &id, &cap).await;
    let rw = block_target(env, "node-a", "pv", "pod-rw");
    let ro = block_target(env, "node-a", "pv", "pod-ro");
    c.node
        .node_publish_volume(publish_req(&staging, &rw, &id, &cap, &ctx, false))
        .await
        .unwrap();
    let data = pattern();
    let f = std::fs::OpenOptions::new().write(true).open(&rw).unwrap();
    f.write_all_at(&data, PATTERN_OFF).unwrap();
    f.sync_all().unwrap();
    drop(f);
    for _ in 0..2 {
        c.node
            .node_publish_volume(publish_req(&staging, &ro, &id, &cap, &ctx, true))
            .await
            .unwrap();
    }
    assert!(std::fs::metadata(&ro)
        .unwrap()
        .file_type()
        .is_block_device());
    // No write may get through the read-only target: refused at open or at write.
    let refused = match std::fs::OpenOptions::new().write(true).open(&ro) {
        Err(e) => Some(e),
        Ok(f) => f
            .write_all_at(&[0xAA; 4096], 0)
            .and_then(|_| f.sync_all())
            .err(),
    };
    let err = refused.expect("a write through a read-only block target must fail");
    assert!(
        matches!(
            errno_of(&err),
            Some(libc::EROFS | libc::EPERM | libc::EACCES)
        ),
        "{err}"
    );
    assert!(
        read_direct(&ro, PATTERN_OFF, data.len()) == data,
        "reads work"
    );
    assert!(
        read_direct(&rw, 0, 4096).iter().all(|&b| b == 0),
        "nothing was written"
    );
    node_unpublish(&mut c, &id, &ro).await;
    node_unpublish(&mut c, &id, &rw).await;
    node_unstage(&mut c, &id, &staging).await;
    unpublish_and_delete(&mut c, &id).await;
    w.finish().await;
}

// ---------------------------------------------------------------- node: error codes

/// The node RPCs check their arguments before the volume's existence, so a
/// missing field is INVALID_ARGUMENT even with an unknown volume ID (as
/// csi-sanity sends); a well-formed unknown ID is NOT_FOUND.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_error_codes() {
    require_root!();
    let w = AllInOne::start().await;
    let (env, mut c) = (&w.env, w.client.clone());
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let id = create(&mut c, "pvc-errors", 16 * MIB, &cap, &[])
        .await
        .volume_id;
    let fake = "fake-vol-id-0001".to_string();
    let ours_unknown = format!("vol-{}", "e".repeat(32));
    let staging = env.staging_path("node-a", &id);
    let target = pod_target(env, "node-a", "pod-e", "pv-e");

    use Code::*;
    // NodeStage
    let stage = |vol: &str, staging: &str, cap: Option<&csi::VolumeCapability>| {
        csi::NodeStageVolumeRequest {
            volume_id: vol.into(),
            staging_target_path: staging.into(),
            volume_capability: cap.cloned(),
            ..Default::default()
        }
    };
    for (r, code) in [
        (stage("", &s(&staging), Some(&cap)), InvalidArgument),
        (stage(&fake, "", Some(&cap)), InvalidArgument),
        (stage(&fake, &s(&staging), None), InvalidArgument),
        (stage(&id, &s(&staging), None), InvalidArgument),
        (stage(&fake, &s(&staging), Some(&cap)), NotFound),
        (stage(&ours_unknown, &s(&staging), Some(&cap)), NotFound),
        // Not ControllerPublished to this node, and no publish_context.
        (stage(&id, &s(&staging), Some(&cap)), FailedPrecondition),
    ] {
        assert_code!(c.node.node_stage_volume(r.clone()), code);
    }
    // NodePublish
    let publish = |vol: &str, target: &str, cap: Option<&csi::VolumeCapability>| {
        csi::NodePublishVolumeRequest {
            volume_id: vol.into(),
            target_path: target.into(),
            staging_target_path: s(&staging),
            volume_capability: cap.cloned(),
            ..Default::default()
        }
    };
    for (r, code) in [
        (publish("", &s(&target), Some(&cap)), InvalidArgument),
        (publish(&fake, "", Some(&cap)), InvalidArgument),
        (publish(&fake, &s(&target), None), InvalidArgument),
        (publish(&fake, &s(&target), Some(&cap)), NotFound),
        (publish(&ours_unknown, &s(&target), Some(&cap)), NotFound),
        (publish(&id, &s(&target), Some(&cap)), FailedPrecondition), // not staged
    ] {
        assert_code!(c.node.node_publish_volume(r.clone()), code);
    }
    // NodeUnpublish / NodeUnstage
    let unpublish = |vol: &str, t: &str| csi::NodeUnpublishVolumeRequest {
        volume_id: vol.into(),
        target_path: t.into(),
        force: false,
    };
    for (r, code) in [
        (unpublish("", &s(&target)), InvalidArgument),
        (unpublish(&fake, ""), InvalidArgument),
        (unpublish(&fake, &s(&target)), NotFound),
        (unpublish(&id, &s(&target)), Ok), // not published there: done
    ] {
        assert_code!(c.node.node_unpublish_volume(r.clone()), code);
    }
    let unstage = |vol: &str, st: &str| csi::NodeUnstageVolumeRequest {
        volume_id: vol.into(),
        staging_target_path: st.into(),
        force: false,
    };
    for (r, code) in [
        (unstage("", &s(&staging)), InvalidArgument),
        (unstage(&fake, ""), InvalidArgument),
        (unstage(&fake, &s(&staging)), NotFound),
        (unstage(&id, &s(&staging)), Ok), // not staged: done
    ] {
        assert_code!(c.node.node_unstage_volume(r.clone()), code);
    }
    // NodeGetVolumeStats / NodeExpandVolume
    let stats = |vol: &str, p: &str| csi::NodeGetVolumeStatsRequest {
        volume_id: vol.into(),
        volume_path: p.into(),
        staging_target_path: String::new(),
    };
    for (r, code) in [
        (stats("", "some/path"), InvalidArgument),
        (stats(&fake, ""), InvalidArgument),
        (stats(&fake, "some/path"), NotFound),
        (stats(&id, "some/path"), NotFound),
        (stats(&id, &s(&target)), NotFound),
    ] {
        assert_code!(c.node.node_get_volume_stats(r.clone()), code);
    }
    let expand = |vol: &str, p: &str| csi::NodeExpandVolumeRequest {
        volume_id: vol.into(),
        volume_path: p.into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    for (r, code) in [
        (expand("", &s(&target)), InvalidArgument),
        (expand(&id, ""), InvalidArgument),
        (expand(&fake, ""), InvalidArgument),
        (expand(&fake, "some/path"), NotFound),
        (expand(&id, &s(&target)), NotFound),
    ] {
        assert_code!(c.node.node_expand_volume(r.clone()), code);
    }
    // Nothing of that left a trace.
    assert!(!staging.exists() && !target.exists());
    unpublish_and_delete(&mut c, &id).await;
    w.finish().await;
}
