//! Garbage collection of fenced, superseded generations once nothing holds them,
//! and the fenced-from marks it lifts. A generation that may hold the only copy of
//! some data is never deleted.

use super::Controller;
use crate::backend::meta::VolumeMeta;
use crate::ids::VolumeId;
use crate::kernel::loop_device::LoopInfo;

impl Controller {
    /// Deletes fenced, superseded generations nobody holds and lifts the
    /// matching fenced-from marks. Safe to run at any time; skips busy volumes.
    /// Fences again first what [`Controller::complete_fence`] finds.
    pub fn collect_garbage(&self) -> usize {
        self.thaw_leftover_freezes();
        // One scan of the loop devices per pass, shared by the stray check and
        // the collection, and none when nothing is published or fenced. A
        // generation that looks released is checked again fresh before anything
        // is lifted or deleted (remove_generation re-checks too). In memory
        // only: a fence marker without its record is left by a crash, and the
        // start-up pass (`complete_fences`) handles those.
        let pending = |v: &VolumeMeta| {
            !v.fenced_from.is_empty() || v.generations.values().any(|g| g.fenced_at.is_some())
        };
        let records = self.store.volumes();
        let published: Vec<VolumeId> = records
            .iter()
            .filter(|v| !v.attachments.is_empty() && !v.current_is_fenced())
            .map(VolumeMeta::volume_id)
            .collect();
        let volumes: Vec<VolumeId> = records
            .iter()
            .filter(|v| pending(v))
            .map(VolumeMeta::volume_id)
            .collect();
        if published.is_empty() && volumes.is_empty() {
            return 0;
        }
        let snapshot = match self.backend.holder_snapshot() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list holders; this garbage collection pass skipped");
                return 0;
            }
        };
        self.fence_late_strays(&published, &snapshot);
        let mut removed = 0;
        for id in volumes {
            let Ok(_lock) = self.inflight.try_lock(id.as_str()) else {
                continue;
            };
            let Some(mut v) = self.store.volume(&id) else {
                continue;
            };
            self.complete_fences_of(&id, &mut v, &snapshot, false);
            let gone = self.remove_released_generations(&id, &mut v, &snapshot);
            let lifted = self.lift_released_marks(&id, &mut v, &snapshot);
            removed += gone;
            if gone + lifted > 0 {
                if let Err(e) = self.persist(&v) {
                    tracing::error!(volume = %id, error = %e, "cannot record garbage collection");
                }
            }
        }
        removed
    }

    /// Whether nothing holds generation `gen`: not in the pass's scan, nor in a fresh one.
    fn released(&self, snapshot: &[LoopInfo], id: &VolumeId, gen: u64) -> bool {
        self.backend.holders_in(snapshot, id, gen).is_empty()
            && self.backend.holders(id, gen).is_ok_and(|h| h.is_empty())
    }

    /// Removes the volume's fenced, superseded generations that nothing holds and that hold
    /// no data the current one lacks (the record updated, not written). How many.
    fn remove_released_generations(
        &self,
        id: &VolumeId,
        v: &mut VolumeMeta,
        snapshot: &[LoopInfo],
    ) -> usize {
        let candidates: Vec<u64> = v
            .generations
            .iter()
            .filter(|(g, m)| **g != v.current_generation && m.fenced_at.is_some())
            .map(|(g, _)| *g)
            .collect();
        let mut removed = 0;
        for gen in candidates {
            if !self.released(snapshot, id, gen) {
                continue;
            }
            if let Some(why) = self.only_copy(id, v, gen) {
                tracing::error!(volume = %id, generation = gen, "fenced generation kept: {why}");
                continue;
            }
            let late = self.late_write_in(id, v, gen);
            if let Err(e) = self.backend.remove_generation(id, gen) {
                tracing::warn!(volume = %id, generation = gen, error = %e, "cannot remove fenced generation");
                continue;
            }
            crate::failpoint::hit("gc:after-remove");
            v.generations.remove(&gen);
            v.fenced_from.retain(|_, g| *g != gen);
            removed += 1;
            tracing::info!(volume = %id, generation = gen, "released fenced generation removed");
            if let Some(at) = late {
                // Counted once: the generation is gone now.
                self.fence_metrics.late_write_found();
                tracing::error!(volume = %id, generation = gen, offset = at, "the fenced generation had been written past its data after the fence: a write reported done to the fenced node is not in the volume (raise --fence-settle)");
            }
        }
        removed
    }

    /// Lifts the fenced-from marks on generations nothing holds any more: quarantines on a
    /// generation that is still current (not yet republished) lift as soon as nothing
    /// holds it (the record updated, not written). How many.
    fn lift_released_marks(
        &self,
        id: &VolumeId,
        v: &mut VolumeMeta,
        snapshot: &[LoopInfo],
    ) -> usize {
        let released: Vec<String> = v
            .fenced_from
            .iter()
            .filter(|(_, g)| self.released(snapshot, id, **g))
            .map(|(n, _)| n.clone())
            .collect();
        for node in &released {
            v.fenced_from.remove(node);
            tracing::info!(volume = %id, node, "fenced-from mark lifted: the node released the fenced generation");
        }
        released.len()
    }

    /// Where the fenced generation about to go was written past its data
    /// (`fence::late_write_at`), if it was: a write node A was told was done
    /// that is in neither this generation's data nor the new one's.
    fn late_write_in(&self, id: &VolumeId, v: &VolumeMeta, gen: u64) -> Option<u64> {
        let path = self.backend.generation_path(id, gen);
        match crate::fence::late_write_at(&path, v.data_bytes(gen)) {
            Ok(at) => at,
            Err(e) => {
                tracing::warn!(volume = %id, generation = gen, path = %path.display(), error = %e, "could not check the fenced generation for late writes");
                None
            }
        }
    }

    /// Why superseded generation `gen` may hold data the current one lacks
    /// (then it is never deleted), or None. The record alone does not decide:
    /// a stale record (another controller's, an older version) may understate
    /// what the images hold, so the image sizes are compared too.
    fn only_copy(&self, id: &VolumeId, v: &VolumeMeta, gen: u64) -> Option<String> {
        let cur = v.current_generation;
        let Some(cur_len) = self.backend.image_bytes(id, cur) else {
            return Some(format!("the current generation {cur} has no image"));
        };
        if v.current().is_some_and(|g| g.origin.is_none()) && cur > gen {
            return Some(format!(
                "the current generation {cur} was not copied from an older one"
            ));
        }
        let old_len = self.backend.image_bytes(id, gen).unwrap_or(0);
        // One trailer of slack: a fence may have grown an old image by a
        // trailer for a device that showed more than its data.
        let larger_image = cur_len + crate::fence::TRAILER_BYTES < old_len;
        if v.data_bytes(cur) < v.data_bytes(gen) || larger_image {
            return Some(format!(
                "it holds more data than the current generation {cur} ({} bytes of image, the current {cur_len}; {} bytes of data recorded, the current {})",
                old_len,
                v.data_bytes(gen),
                v.data_bytes(cur)
            ));
        }
        None
    }
}
