//! NodeGetVolumeStats and NodeExpandVolume.

use std::path::Path;

use fencecsi_proto::v1::volume_usage::Unit;
use fencecsi_proto::v1::*;

use super::Node;
use crate::error::{CsiError, CsiResult};
use crate::fsutil;
use crate::loopdev;
use crate::mounts::{self, PathState};

impl Node {
    pub(super) fn stats(
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
        let loops = self.loops_of(&id)?;
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
            if !self.generation_path(&id, *gen).exists() {
                problems.push(format!("the image of generation {gen} is gone"));
            }
        }
        let volume_condition = condition(
            !problems.is_empty(),
            if problems.is_empty() {
                "healthy".into()
            } else {
                problems.join("; ")
            },
        );

        let is_dir = std::fs::metadata(&path)
            .map(|m| m.is_dir())
            .unwrap_or(false);
        let usage = if is_dir {
            fs_usage(&path)?
        } else {
            let total = fsutil::block_device_size(&path)
                .map_err(|e| CsiError::internal("reading the block device size", e))?;
            vec![VolumeUsage {
                available: 0,
                total: total as i64,
                used: 0,
                unit: Unit::Bytes as i32,
            }]
        };
        Ok(NodeGetVolumeStatsResponse {
            usage,
            volume_condition,
        })
    }

    pub(super) fn expand(
        &self,
        req: NodeExpandVolumeRequest,
    ) -> CsiResult<NodeExpandVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if req.volume_path.is_empty() {
            return Err(CsiError::InvalidArgument("volume_path is required".into()));
        }
        let id = self.our_volume(&req.volume_id)?;
        let path = self.roots.check("volume_path", &req.volume_path)?;
        if let Some(cap) = &req.volume_capability {
            crate::capability::parse(cap)?;
        }
        let _lock = self.inflight.try_lock(id.as_str())?;
        let meta = self
            .read_meta(&id)?
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        if matches!(mounts::path_state(&path), PathState::Missing) {
            return Err(CsiError::NotFound(format!(
                "{} does not exist",
                path.display()
            )));
        }
        let current = self
            .loops_of(&id)?
            .into_iter()
            .filter(|(_, g)| {
                meta.generations
                    .get(g)
                    .is_some_and(|m| m.fenced_at.is_none())
            })
            .max_by_key(|(_, g)| *g);
        let (lo, gen) = current.ok_or_else(|| {
            CsiError::FailedPrecondition(format!("volume {id} is not staged on this node"))
        })?;
        if meta.fenced_from.contains_key(&self.node_id) {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} was fenced away from this node: it is not expanded here"
            )));
        }
        // The controller widened the device when it grew the volume
        // (ControllerExpandVolume): nodes never remap a device, so a node that
        // hangs here cannot undo a fence. A fenced device (a window, or a
        // generation fenced whole) is never grown into.
        let image = self.generation_path(&id, gen);
        let lo = loopdev::status(&lo.device)
            .map_err(|e| CsiError::internal("reading the loop device", e))?;
        if lo.offset != 0
            || crate::fence::marker_path(&image).exists()
            || crate::fence::is_fenced_device(&lo, meta.data_bytes(gen))
        {
            return Err(CsiError::FailedPrecondition(format!(
                "this node's device for volume {id} is fenced: it is not expanded"
            )));
        }
        if lo.size_bytes != meta.data_bytes(gen) {
            // Never grow a filesystem into the fence trailer either (a device
            // attached before windows existed shows it).
            return Err(CsiError::FailedPrecondition(format!(
                "this node's device for volume {id} shows {} bytes, not its {}: ControllerExpandVolume makes it whole (retry it)",
                lo.size_bytes,
                meta.data_bytes(gen)
            )));
        }
        let size = lo.size_bytes;
        if std::fs::metadata(&path)
            .map(|m| m.is_dir())
            .unwrap_or(false)
        {
            fsutil::grow(&lo.device, &path, &meta.fs_type).map_err(|e| match e {
                fsutil::FsError::MissingCapability { .. } => CsiError::FailedPrecondition(format!(
                    "{e}: online ext4 resize is not possible in this process; the filesystem grows to the new size at the next NodeStageVolume"
                )),
                e => CsiError::internal("growing the filesystem", e),
            })?;
        }
        tracing::info!(volume = %id, size, "volume expanded on node");
        Ok(NodeExpandVolumeResponse {
            capacity_bytes: size as i64,
        })
    }
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
    let u = fsutil::usage(path).map_err(|e| CsiError::internal("statfs", e))?;
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
