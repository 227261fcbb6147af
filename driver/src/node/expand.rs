//! NodeExpandVolume: growing a staged filesystem online to its device's size.

use fencecsi_proto::v1::*;

use super::Node;
use crate::backend::meta::VolumeMeta;
use crate::error::{CsiError, CsiResult};
use crate::ids::VolumeId;
use crate::kernel::filesystem;
use crate::kernel::loop_device::{self, LoopInfo};
use crate::kernel::mounts::{self, PathState};

impl Node {
    /// NodeExpandVolume: grows the filesystem to the device the controller already
    /// widened; never remaps or grows a fenced device.
    pub(super) fn node_expand_volume(
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
        let lo = self.growable_device(&id, &meta)?;
        let size = lo.size_bytes;
        if std::fs::metadata(&path)
            .map(|m| m.is_dir())
            .unwrap_or(false)
        {
            filesystem::grow(&lo.device, &path, &meta.fs_type).map_err(|e| match e {
                filesystem::FsError::MissingCapability { .. } => CsiError::FailedPrecondition(format!(
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

    /// This node's device for the current, unfenced generation, checked to show the whole
    /// data and no fence. The controller widened it when it grew the volume
    /// (ControllerExpandVolume): nodes never remap a device, so a node that hangs here
    /// cannot undo a fence. A fenced device (a window, or a generation fenced whole) is
    /// never grown into.
    fn growable_device(&self, id: &VolumeId, meta: &VolumeMeta) -> CsiResult<LoopInfo> {
        let current = self
            .loops_of(id)?
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
        let image = self.generation_path(id, gen);
        let lo = loop_device::status(&lo.device)
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
        Ok(lo)
    }
}
