//! The CSI Node service: loop devices and mounts on this node.
//!
//! What is staged and published is not kept here: it is read back from the
//! kernel (loop devices by backing inode and tag, the mount table), so a plugin
//! killed between any two steps finds its work on restart and a retried call
//! completes it without doubling anything. The one thing the node keeps is the
//! identity of the state dir it uses (`state_guard`), and the images of CSI ephemeral
//! inline volumes, which are node-local (`ephemeral`).
//!
//! Each RPC's body is a `Node` method named after it, in the file of its step:
//! - `stage.rs`: NodeStageVolume, NodeUnstageVolume;
//! - `publish.rs`: NodePublishVolume, NodeUnpublishVolume;
//! - `volume_stats.rs`: NodeGetVolumeStats;
//! - `expand.rs`: NodeExpandVolume;
//! - `ephemeral/`: the same publish, unpublish and stats for ephemeral inline volumes;
//! - this file: NodeGetInfo, NodeGetCapabilities and the gRPC service (`NodeService`).
//!
//! Beside the RPCs: `recover.rs` (releasing what a fence took while the node was away),
//! `state_guard.rs` (its state dir check) and `report.rs` (its clean report).

pub mod ephemeral;
mod expand;
pub mod heartbeat;
mod publish;
pub mod recover;
pub mod report;
mod stage;
pub mod state_guard;
mod volume_stats;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fencecsi_proto::v1::node_server::Node as CsiNode;
use fencecsi_proto::v1::node_service_capability::{rpc::Type as RpcType, Rpc, Type as CapType};
use fencecsi_proto::v1::*;
use tonic::{Request, Response, Status};

use crate::backend::image::ImageBackend;
use crate::backend::meta::{now_nanos, MetaStore, NodeRecord, VolumeMeta};
use crate::backend::Backend;
use crate::config::Config;
use crate::error::{CsiError, CsiResult};
use crate::ids::{Parsed, VolumeId};
use crate::kernel::loop_device::{self, LoopInfo};
use crate::locks::InFlight;
use crate::paths::AllowedRoots;
use crate::rpc::blocking;
use crate::terms::{node_tag, parse_tag_full};

pub struct Node {
    pub(crate) cfg: Config,
    pub(crate) node_id: String,
    pub(crate) roots: AllowedRoots,
    pub(crate) backend: ImageBackend,
    pub(crate) inflight: InFlight,
    /// Whether the state dir is the one this node's volumes live in (recovery and Probe).
    pub(crate) guard: Arc<state_guard::StateGuard>,
    /// The owner part of this plugin's ephemeral loop tags (`ephemeral::owner_tag`).
    pub(crate) ephemeral_owner: String,
}

impl Node {
    pub fn open(cfg: Config) -> std::io::Result<Arc<Self>> {
        let node_id = cfg
            .node_id
            .clone()
            .ok_or_else(|| std::io::Error::other("node mode needs --node-id"))?;
        std::fs::create_dir_all(&cfg.kubelet_dir)?;
        let roots = AllowedRoots::new([cfg.kubelet_dir.clone()]);
        let guard = Arc::new(state_guard::StateGuard::new(&cfg));
        // Once at start, before anything below creates the state dir, so that a missing one
        // is reported as such, and so that Probe tells the truth also when recovery is off.
        let _ = recover::check_state_dir(&guard, &node_id, &roots);
        let backend = ImageBackend::new(&cfg.state_dir).map_err(std::io::Error::other)?;
        if let Err(e) = crate::kernel::filesystem::check_tools() {
            tracing::warn!(error = %e, "filesystem tools missing: staging filesystem volumes will fail");
        }
        MetaStore::register_node(
            &cfg.state_dir,
            &NodeRecord {
                node_id: node_id.clone(),
                max_volumes: cfg.max_volumes_per_node,
                registered_at: now_nanos(),
            },
        )?;
        tracing::info!(node = %node_id, kubelet_dir = %cfg.kubelet_dir.display(), "node plugin registered");
        let ephemeral_owner = ephemeral::owner_tag(&node_id, &cfg.node_state_dir());
        let node = Arc::new(Node {
            cfg,
            node_id,
            roots,
            backend,
            inflight: InFlight::new(),
            guard,
            ephemeral_owner,
        });
        // Before the plugin serves: what a crashed plugin left of ephemeral volumes whose
        // publish never completed goes now, before kubelet retries anything.
        let swept = node.sweep_ephemeral();
        if !swept.removed.is_empty() || !swept.kept.is_empty() {
            tracing::info!(
                removed = swept.removed.len(),
                kept = swept.kept.len(),
                "ephemeral volumes checked at start"
            );
        }
        Ok(node)
    }

    /// A client's volume ID that must be ours; foreign IDs are NOT_FOUND.
    pub(crate) fn our_volume(&self, raw: &str) -> CsiResult<VolumeId> {
        match VolumeId::parse(raw)? {
            Parsed::Ours(id) => Ok(id),
            Parsed::Foreign => Err(CsiError::NotFound(format!("volume {raw} does not exist"))),
        }
    }

    pub(crate) fn read_meta(&self, id: &VolumeId) -> CsiResult<Option<VolumeMeta>> {
        MetaStore::read_volume(&self.cfg.state_dir, id)
            .map_err(|e| CsiError::internal("reading volume metadata", e))
    }

    /// Our loop devices for a volume (any generation).
    pub(crate) fn loops_of(&self, id: &VolumeId) -> CsiResult<Vec<(LoopInfo, u64)>> {
        let all = loop_device::list().map_err(|e| CsiError::internal("listing loop devices", e))?;
        let me = node_tag(&self.node_id);
        Ok(all
            .into_iter()
            .filter_map(|l| {
                parse_tag_full(&l.tag)
                    .filter(|(v, _, n)| v == id && *n == me)
                    .map(|(_, g, _)| g)
                    .map(|g| (l, g))
            })
            .collect())
    }

    fn capabilities(extensions: bool) -> Vec<NodeServiceCapability> {
        [
            RpcType::StageUnstageVolume,
            RpcType::GetVolumeStats,
            RpcType::ExpandVolume,
            RpcType::VolumeCondition,
            RpcType::SingleNodeMultiWriter,
            RpcType::ForceUnpublish,
        ]
        .into_iter()
        .filter(|t| extensions || *t != RpcType::ForceUnpublish)
        .map(|t| NodeServiceCapability {
            r#type: Some(CapType::Rpc(Rpc { r#type: t as i32 })),
        })
        .collect()
    }

    pub(crate) fn generation_path(&self, id: &VolumeId, gen: u64) -> PathBuf {
        self.backend.generation_path(id, gen)
    }
}

/// The mount on top at `path` (the one a lookup there sees), if any.
pub(crate) fn top_mount(path: &Path) -> CsiResult<Option<crate::kernel::mounts::MountEntry>> {
    Ok(crate::kernel::mounts::mounts_at(path)
        .map_err(|e| CsiError::internal("reading the mount table", e))?
        .pop())
}

/// Removes a directory we may have created, only if empty; a file only if
/// it is a plain file or device node (block targets). Never recursive.
pub(crate) fn remove_target(path: &Path) -> CsiResult<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(CsiError::internal(
                &format!("inspecting {}", path.display()),
                e,
            ))
        }
    };
    let result = if meta.is_dir() {
        std::fs::remove_dir(path)
    } else {
        std::fs::remove_file(path)
    };
    match result {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => Err(CsiError::FailedPrecondition(format!(
            "{} is not empty after unmounting: it holds data that is not the volume's; left in place",
            path.display()
        ))),
        Err(e) => Err(CsiError::internal(&format!("removing {}", path.display()), e)),
    }
}

#[derive(Clone)]
pub struct NodeService(pub Arc<Node>);

/// The gRPC face of [`Node`]: each call runs the `Node` method of the same name on the
/// blocking pool (the bodies touch the kernel and the state dir).
#[tonic::async_trait]
impl CsiNode for NodeService {
    async fn node_stage_volume(
        &self,
        r: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let n = self.0.clone();
        blocking("NodeStageVolume", move || {
            n.node_stage_volume(r.into_inner())
        })
        .await
    }
    async fn node_unstage_volume(
        &self,
        r: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let n = self.0.clone();
        blocking("NodeUnstageVolume", move || {
            n.node_unstage_volume(r.into_inner())
        })
        .await
    }
    async fn node_publish_volume(
        &self,
        r: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let n = self.0.clone();
        blocking("NodePublishVolume", move || {
            n.node_publish_volume(r.into_inner())
        })
        .await
    }
    async fn node_unpublish_volume(
        &self,
        r: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let n = self.0.clone();
        blocking("NodeUnpublishVolume", move || {
            n.node_unpublish_volume(r.into_inner())
        })
        .await
    }
    async fn node_get_volume_stats(
        &self,
        r: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let n = self.0.clone();
        blocking("NodeGetVolumeStats", move || {
            n.node_get_volume_stats(r.into_inner())
        })
        .await
    }
    async fn node_expand_volume(
        &self,
        r: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let n = self.0.clone();
        blocking("NodeExpandVolume", move || {
            n.node_expand_volume(r.into_inner())
        })
        .await
    }
    /// NodeGetCapabilities: the RPCs above; FORCE_UNPUBLISH only to callers that see the
    /// fence extensions (`Extensions::shown`).
    async fn node_get_capabilities(
        &self,
        r: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        let ext = self.0.cfg.advertise_extensions.shown(r.metadata());
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: Node::capabilities(ext),
        }))
    }
    /// NodeGetInfo: this node's ID, its volume limit and its topology
    /// (`StateGuard::topology`: the state dir's identity).
    async fn node_get_info(
        &self,
        _r: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.0.node_id.clone(),
            max_volumes_per_node: self.0.cfg.max_volumes_per_node.max(0),
            accessible_topology: Some(crate::terms::topology_of(&self.0.guard.topology())),
        }))
    }
}
