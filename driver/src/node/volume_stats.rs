//! NodeGetVolumeStats: usage and condition of a published volume. The helpers below
//! serve ephemeral inline volumes' stats too (`Node::stats_ephemeral` in `ephemeral/`).

use std::path::Path;

use fencecsi_proto::v1::volume_usage::Unit;
use fencecsi_proto::v1::*;

use super::Node;
use crate::backend::meta::VolumeMeta;
use crate::error::{CsiError, CsiResult};
use crate::ids::VolumeId;
use crate::kernel::filesystem;
use crate::kernel::mounts::{self, PathState};

impl Node {
    /// NodeGetVolumeStats: bytes and inodes of the filesystem at the path (the size of a
    /// block volume), and whether this node's devices for it are fenced or gone.
    pub(super) fn node_get_volume_stats(
        &self,
        req: NodeGetVolumeStatsRequest,
    ) -> CsiResult<NodeGetVolumeStatsResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if req.volume_path.is_empty() {
            return Err(CsiError::InvalidArgument("volume_path is required".into()));
        }
        let id = match crate::ids::VolumeId::parse(&req.volume_id)? {
            crate::ids::Parsed::Ours(id) => id,
            crate::ids::Parsed::Foreign => {
                // Only an ephemeral inline volume can have such an ID.
                let path = self
                    .roots
                    .check("volume_path", &req.volume_path)
                    .map_err(|e| {
                        CsiError::NotFound(format!(
                            "volume {} is not at that path: {e}",
                            req.volume_id
                        ))
                    })?;
                return self.stats_ephemeral(&req.volume_id, &path);
            }
        };
        // Only ever inspected, never created: a path that cannot be below the
        // kubelet dir cannot hold the volume, which the spec (and csi-sanity,
        // with a relative "some/path") calls NOT_FOUND.
        let path = self
            .roots
            .check("volume_path", &req.volume_path)
            .map_err(|e| CsiError::NotFound(format!("volume {id} is not at that path: {e}")))?;
        let meta = self.read_meta(&id)?;
        if let Some(stale) = stale_or_missing(&path, ": the filesystem was aborted or fenced")? {
            return Ok(stale);
        }
        let Some(meta) = meta else {
            return Err(CsiError::NotFound(format!("volume {id} does not exist")));
        };
        let volume_condition = self.device_condition(&id, &meta)?;
        Ok(NodeGetVolumeStatsResponse {
            usage: path_usage(&path)?,
            volume_condition,
        })
    }

    /// Whether this node's devices for the volume are healthy: there is one, none is on a
    /// fenced generation, and each generation's image is still there.
    fn device_condition(
        &self,
        id: &VolumeId,
        meta: &VolumeMeta,
    ) -> CsiResult<Option<VolumeCondition>> {
        let loops = self.loops_of(id)?;
        let mut problems = Vec::new();
        if loops.is_empty() {
            problems.push("no loop device is attached for this volume on this node".to_string());
        }
        for (lo, gen) in &loops {
            if meta
                .generations
                .get(gen)
                .is_some_and(|g| g.fenced_at.is_some())
            {
                problems.push(format!(
                    "generation {gen} on {} was fenced: writes fail; unstage and republish",
                    lo.device.display()
                ));
            }
            if !self.generation_path(id, *gen).exists() {
                problems.push(format!("the image of generation {gen} is gone"));
            }
        }
        Ok(condition(
            !problems.is_empty(),
            if problems.is_empty() {
                "healthy".into()
            } else {
                problems.join("; ")
            },
        ))
    }
}

/// The usage at a published path: bytes and inodes of a filesystem, the size of a block
/// device.
fn path_usage(path: &Path) -> CsiResult<Vec<VolumeUsage>> {
    let is_dir = std::fs::metadata(path).map(|m| m.is_dir()).unwrap_or(false);
    if is_dir {
        return fs_usage(path);
    }
    let total = filesystem::block_device_size(path)
        .map_err(|e| CsiError::internal("reading the block device size", e))?;
    Ok(vec![VolumeUsage {
        available: 0,
        total: total as i64,
        used: 0,
        unit: Unit::Bytes as i32,
    }])
}

/// A volume condition, as the stats answer carries it.
pub(super) fn condition(abnormal: bool, message: String) -> Option<VolumeCondition> {
    Some(VolumeCondition { abnormal, message })
}

/// The stats of a path that cannot be read: NOT_FOUND when it is missing, an
/// abnormal condition with no usage when it is stale (`why` follows the errno),
/// None when it can be read.
pub(super) fn stale_or_missing(
    path: &Path,
    why: &str,
) -> CsiResult<Option<NodeGetVolumeStatsResponse>> {
    match mounts::path_state(path) {
        PathState::Missing => Err(CsiError::NotFound(format!(
            "{} does not exist",
            path.display()
        ))),
        PathState::Stale(errno) => Ok(Some(NodeGetVolumeStatsResponse {
            usage: Vec::new(),
            volume_condition: condition(
                true,
                format!("{} is stale ({errno}){why}", path.display()),
            ),
        })),
        PathState::Ok => Ok(None),
    }
}

/// Bytes and inodes of the filesystem mounted at `path`.
pub(super) fn fs_usage(path: &Path) -> CsiResult<Vec<VolumeUsage>> {
    let u = filesystem::usage(path).map_err(|e| CsiError::internal("statfs", e))?;
    Ok(vec![
        VolumeUsage {
            available: u.bytes_available as i64,
            total: u.bytes_total as i64,
            used: u.bytes_used as i64,
            unit: Unit::Bytes as i32,
        },
        VolumeUsage {
            available: u.inodes_free as i64,
            total: u.inodes_total as i64,
            used: u.inodes_used as i64,
            unit: Unit::Inodes as i32,
        },
    ])
}
