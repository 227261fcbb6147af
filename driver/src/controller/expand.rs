//! ControllerExpandVolume: a bigger image, and the devices that show it widened.

use fencecsi_proto::v1::*;

use super::capacity::size_for;
use super::Controller;
use crate::backend::capacity;
use crate::backend::meta::VolumeMeta;
use crate::capability;
use crate::error::{CsiError, CsiResult};
use crate::ids::VolumeId;
use crate::locks::PublishLock;

impl Controller {
    /// ControllerExpandVolume: grows the image and widens the devices that show it.
    pub(super) fn controller_expand_volume(
        &self,
        req: ControllerExpandVolumeRequest,
    ) -> CsiResult<ControllerExpandVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        let range = req
            .capacity_range
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("capacity_range is required".into()))?;
        let (id, _) = self.existing_volume(&req.volume_id)?;
        let _lock = self.inflight.try_lock(id.as_str())?;
        let mut v = self
            .store
            .volume(&id)
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        if let Some(cap) = &req.volume_capability {
            capability::parse(cap)?;
        }
        // From the record's growth until the devices are widened: a stage either
        // attached before (and is widened below) or reads the grown record (and
        // attaches it whole).
        let mut stage_lock = None;
        let size = size_for(Some(range), v.capacity_bytes, self.largest_volume()?)?;
        if size > v.capacity_bytes {
            let (grown, lock) = self.grow_volume(&id, &v, size)?;
            v = grown;
            stage_lock = Some(lock);
        }
        // Also on a retry: a widen that failed after the record was written
        // is made again. Nodes never remap devices (a node that hangs must
        // not undo a fence with a stale widen): NodeExpandVolume only grows
        // the filesystem on the device made whole here.
        let gen = v.current_generation;
        if !v.current_is_fenced()
            && !self.backend.fence_marked(&id, gen)
            && self.backend.generation_exists(&id, gen)
        {
            if stage_lock.is_none() {
                stage_lock = Some(self.expand_lock(&id)?);
            }
            self.widen_devices(&id, &v)?;
        }
        drop(stage_lock);
        Ok(ControllerExpandVolumeResponse {
            capacity_bytes: v.capacity_bytes as i64,
            node_expansion_required: true,
        })
    }

    /// The volume's [`PublishLock`], exclusive, for growing its attached devices.
    fn expand_lock(&self, id: &VolumeId) -> CsiResult<PublishLock> {
        PublishLock::take_for_rpc(
            &self.cfg.state_dir,
            id,
            true,
            "growing the volume's attached devices",
        )
    }

    /// Grows the record to `size` and, when the current generation is writable, its image;
    /// the grown record, written, and the publish lock, taken after the capacity guard (as
    /// snapshots do) and held until the devices are widened.
    fn grow_volume(
        &self,
        id: &VolumeId,
        v: &VolumeMeta,
        size: u64,
    ) -> CsiResult<(VolumeMeta, PublishLock)> {
        // A fenced current generation is immutable; the clone made at the
        // next publish is created at the recorded size instead.
        // Generations keep the data size they have now; only the
        // current one, if writable, grows.
        let old = v.capacity_bytes;
        let before = capacity::volume_commitment(v);
        let mut grown = v.clone();
        for g in grown.generations.values_mut() {
            g.data_bytes.get_or_insert(old);
        }
        let gen = grown.current_generation;
        let from = grown.data_bytes(gen);
        let writable = !grown.current_is_fenced();
        if writable {
            self.check_no_fenced_device(id, gen, from)?;
            if let Some(g) = grown.generations.get_mut(&gen) {
                g.data_bytes = Some(size);
            }
        }
        grown.capacity_bytes = size;
        // The growth is taken like a new volume's space (under the same guard until
        // the record says so); a fenced current generation's is the larger copy the
        // next publish makes.
        let _reserve = self.store.capacity_guard();
        let growth = capacity::volume_commitment(&grown).saturating_sub(before);
        self.ensure_capacity(
            growth,
            &format!("growing volume {id} from {old} to {size} bytes"),
        )?;
        let stage_lock = self.expand_lock(id)?;
        if writable {
            self.backend.grow(id, gen, from, size)?;
            crate::failpoint::hit("expand:after-grow");
        }
        self.persist(&grown)?;
        crate::failpoint::hit("expand:after-record");
        tracing::info!(volume = %id, size, "volume expanded");
        Ok((grown, stage_lock))
    }

    /// A device fenced away from this generation (a partial fence: other nodes stay
    /// entitled) shows a window just past the data; growing the data would put that
    /// window onto volume bytes. FAILED_PRECONDITION until its node released it.
    fn check_no_fenced_device(&self, id: &VolumeId, gen: u64, data_bytes: u64) -> CsiResult<()> {
        let held = self
            .backend
            .holders(id, gen)
            .map_err(|e| CsiError::internal("listing the volume's loop devices", e))?;
        if let Some(lo) = held
            .iter()
            .find(|l| l.offset != 0 || crate::fence::is_fenced_device(l, data_bytes))
        {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} still has a fenced loop device ({}) on generation {gen}: it can grow once that node released it",
                lo.device.display()
            )));
        }
        Ok(())
    }

    /// Widens every device of the current generation to the volume's data size.
    fn widen_devices(&self, id: &VolumeId, v: &VolumeMeta) -> CsiResult<()> {
        let gen = v.current_generation;
        let widened = self
            .backend
            .widen(id, gen, v.data_bytes(gen))
            .map_err(|e| match e {
                crate::backend::BackendError::Fence(crate::fence::FenceError::Io {
                    ref source,
                    ..
                }) if source.kind() == std::io::ErrorKind::TimedOut => CsiError::Aborted(format!(
                    "volume {id}: a node process holds its image lock; retry later"
                )),
                e => e.into(),
            })?;
        for lo in &widened {
            tracing::info!(volume = %id, generation = gen, device = %lo.device.display(), bytes = lo.size_bytes, "attached device widened to the volume's size");
        }
        Ok(())
    }
}
