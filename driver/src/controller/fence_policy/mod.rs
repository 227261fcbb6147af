//! The controller's fence policy: what an unpublish fences ([`plan`], pure), the
//! strays a publish or a GC pass finds (writable holders no attachment entitles),
//! and fences a crash left incomplete, completed at start-up and by GC. The
//! mechanism (remapping devices, the immutable flag) is `crate::fence`.

pub(super) mod plan;

use super::Controller;
use crate::backend::meta::{now_nanos, VolumeMeta};
use crate::backend::Backend;
use crate::error::{CsiError, CsiResult};
use crate::fence::is_fenced_device;
use crate::ids::VolumeId;
use crate::kernel::loop_device::LoopInfo;
use crate::terms::node_tag;

use plan::{tag_node, writable};

impl Controller {
    /// Before a publish: fences writable holders of the current generation
    /// that no attachment entitles (a node whose record is gone, a forged
    /// stage, an admin's losetup). With no entitled writer left the whole
    /// generation is fenced, so the publish that follows makes a new one.
    pub(super) fn fence_strays(
        &self,
        id: &VolumeId,
        v: &mut VolumeMeta,
        publishing: &str,
    ) -> CsiResult<()> {
        let gen = v.current_generation;
        let holders = self.backend.holder_snapshot()?;
        let entitled: Vec<String> = v
            .attachments
            .iter()
            .filter(|(_, a)| a.generation == gen && !a.readonly)
            .map(|(n, _)| node_tag(n))
            .collect();
        let strays = writable_holders(&*self.backend, &holders, id, gen, &|tag| {
            !entitled.iter().any(|e| Some(e.as_str()) == tag)
        });
        let bytes = v.data_bytes(gen);
        if strays.iter().all(|l| is_fenced_device(l, bytes)) {
            return Ok(());
        }
        let devices = describe(&strays);
        if !self.fence_available() {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id}: generation {gen} is held writable by {devices}, which no attachment entitles, and the fence is not available ({})",
                self.fence_unavailable_reason()
            )));
        }
        let why = format!(
            "fenced before publishing to {publishing}: held by {devices} with no attachment"
        );
        if entitled.is_empty() {
            self.fence_metrics
                .time(|| self.backend.freeze(id, gen, bytes))?;
            if let Some(g) = v.generations.get_mut(&gen) {
                g.fenced_at = Some(now_nanos());
                g.fenced_node = Some("unknown".into());
                g.fence_reason = Some(why.clone());
            }
            self.persist(v)?;
        } else {
            let pick = |l: &LoopInfo| {
                let tag = tag_node(&l.tag, id, gen);
                !l.read_only && !entitled.iter().any(|e| Some(e.as_str()) == tag)
            };
            self.fence_metrics
                .time(|| self.backend.fence_devices(id, gen, bytes, &pick))?;
        }
        tracing::warn!(volume = %id, generation = gen, "write fence made: {why}");
        Ok(())
    }

    /// A generation recorded as fenced (or whose whole-generation fence was
    /// started, see [`Backend::fence_marked`]) must have no writable holder
    /// over its data. One fenced by an older driver has: that fence only set
    /// the immutable flag, which xfs and btrfs do not check on an open file
    /// and which no filesystem checks for discards. So does one whose fence a
    /// crash interrupted. Such holders (found in `scan`, confirmed fresh) get
    /// the current fence; Ok(true) when there were any.
    pub(super) fn complete_fence(
        &self,
        id: &VolumeId,
        v: &mut VolumeMeta,
        gen: u64,
        scan: &[LoopInfo],
    ) -> CsiResult<bool> {
        let bytes = v.data_bytes(gen);
        let open = |scan: &[LoopInfo]| {
            writable_holders(&*self.backend, scan, id, gen, &|_| true)
                .into_iter()
                .filter(|l| !is_fenced_device(l, bytes))
                .collect::<Vec<_>>()
        };
        // `scan` may predate a fence made meanwhile: only what the kernel
        // shows now counts.
        let open = if open(scan).is_empty() {
            Vec::new()
        } else {
            open(&self.backend.holders(id, gen)?)
        };
        if open.is_empty() {
            // A fence a crash interrupted after it had moved every holder:
            // recorded now, so the generation is superseded and collected
            // like any fenced one instead of kept (and counted) forever.
            let interrupted = v
                .generations
                .get(&gen)
                .is_some_and(|g| g.fenced_at.is_none())
                && self.backend.fence_marked(id, gen);
            if interrupted {
                self.record_interrupted_fence(id, v, gen, "no holder left")?;
            }
            return Ok(false);
        }
        let devices = describe(&open);
        if !self.fence_available() {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id}: generation {gen} is recorded fenced but {devices} can still write its data, and the fence is not available ({})",
                self.fence_unavailable_reason()
            )));
        }
        let report = self
            .fence_metrics
            .time(|| self.backend.freeze(id, gen, bytes))?;
        if v.generations
            .get(&gen)
            .is_some_and(|g| g.fenced_at.is_none())
        {
            self.record_interrupted_fence(id, v, gen, &format!("held by {devices}"))?;
        }
        tracing::warn!(volume = %id, generation = gen, devices = %devices, holders = report.fenced.len(), us = report.elapsed.as_micros() as u64, "write fence completed: the generation was fenced without remapping these holders (an older driver's flag-only fence, or an interrupted one); they are remapped into the trailer now");
        Ok(true)
    }

    /// Whether a generation of `v` is fenced, or marked by a fence a crash
    /// interrupted (one stat per generation).
    fn has_fence_to_complete(&self, v: &VolumeMeta) -> bool {
        let id = v.volume_id();
        v.generations
            .iter()
            .any(|(g, m)| m.fenced_at.is_some() || self.backend.fence_marked(&id, *g))
    }

    /// Records the fence of `gen` that a crash interrupted (its marker exists,
    /// its record does not), now that it is complete.
    fn record_interrupted_fence(
        &self,
        id: &VolumeId,
        v: &mut VolumeMeta,
        gen: u64,
        what: &str,
    ) -> CsiResult<()> {
        if let Some(g) = v.generations.get_mut(&gen) {
            g.fenced_at = Some(now_nanos());
            g.fenced_node = Some("unknown".into());
            g.fence_reason = Some(format!("an interrupted fence completed: {what}"));
            self.persist(v)?;
            tracing::warn!(volume = %id, generation = gen, "an interrupted fence is recorded: {what}");
        }
        Ok(())
    }

    /// The start-up pass: completes the fence of every generation recorded
    /// fenced whose holders can still write its data (see
    /// [`Controller::complete_fence`]), before the controller serves.
    /// Returns how many generations it fenced again.
    pub(super) fn complete_fences(&self) -> usize {
        let volumes: Vec<VolumeMeta> = self
            .store
            .volumes()
            .into_iter()
            .filter(|v| self.has_fence_to_complete(v))
            .collect();
        if volumes.is_empty() {
            return 0;
        }
        let snapshot = match self.backend.holder_snapshot() {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot list loop devices: fenced generations not checked for holders an older fence left writable");
                return 0;
            }
        };
        let mut done = 0;
        for meta in volumes {
            let id = meta.volume_id();
            let Ok(_lock) = self.inflight.try_lock(id.as_str()) else {
                continue;
            };
            let Some(mut v) = self.store.volume(&id) else {
                continue;
            };
            done += self.complete_fences_of(&id, &mut v, &snapshot, true);
        }
        done
    }

    /// [`Controller::complete_fence`] on each fenced generation of one
    /// volume (its in-flight lock held); failures are logged.
    pub(super) fn complete_fences_of(
        &self,
        id: &VolumeId,
        v: &mut VolumeMeta,
        snapshot: &[LoopInfo],
        markers: bool,
    ) -> usize {
        // `markers`: also generations a crash left marked but unrecorded
        // (one stat each; the start-up pass only).
        let fenced: Vec<u64> = v
            .generations
            .iter()
            .filter(|(g, m)| {
                m.fenced_at.is_some() || (markers && self.backend.fence_marked(id, **g))
            })
            .map(|(g, _)| *g)
            .collect();
        let mut done = 0;
        for gen in fenced {
            match self.complete_fence(id, v, gen, snapshot) {
                Ok(fenced) => done += usize::from(fenced),
                // Once at error level per generation: GC passes repeat it
                // every interval while the fence stays unavailable.
                Err(e) if self.first_report_of_unfenceable(id, gen) => {
                    tracing::error!(volume = %id, generation = gen, error = %e, "a fenced generation still has writable holders over its data and could not be fenced again (repeated at debug level)")
                }
                Err(e) => {
                    tracing::debug!(volume = %id, generation = gen, error = %e, "a fenced generation still has writable holders over its data and could not be fenced again")
                }
            }
        }
        done
    }

    /// A writable holder of a published volume's current generation that no
    /// writable attachment entitles (an admin's `losetup` made after the
    /// publish, a forged stage) is fenced at the next pass, not only at the
    /// volume's next publish. Only those devices: the entitled node, and any
    /// readers, keep theirs. `snapshot`: the pass's scan of the loop devices.
    pub(super) fn fence_late_strays(&self, published: &[VolumeId], snapshot: &[LoopInfo]) {
        for id in published {
            let Ok(_lock) = self.inflight.try_lock(id.as_str()) else {
                continue;
            };
            let Some(meta) = self.store.volume(id) else {
                continue;
            };
            let gen = meta.current_generation;
            let bytes = meta.data_bytes(gen);
            let entitled: Vec<String> = meta
                .attachments
                .iter()
                .filter(|(_, a)| a.generation == gen && !a.readonly)
                .map(|(n, _)| node_tag(n))
                .collect();
            let is_stray = |tag: Option<&str>| !entitled.iter().any(|e| Some(e.as_str()) == tag);
            let open: Vec<LoopInfo> =
                writable_holders(&*self.backend, snapshot, id, gen, &is_stray)
                    .into_iter()
                    .filter(|l| !is_fenced_device(l, bytes))
                    .collect();
            if open.is_empty() || meta.current_is_fenced() {
                continue;
            }
            crate::failpoint::pause("gc:before-stray-fence", id.as_str());
            let devices = describe(&open);
            if !self.fence_available() {
                if self.first_report_of_unfenceable(id, gen) {
                    tracing::error!(volume = %id, generation = gen, devices = %devices, "held writable with no attachment, and the fence is not available");
                }
                continue;
            }
            let pick = |l: &LoopInfo| !l.read_only && is_stray(tag_node(&l.tag, id, gen));
            match self
                .fence_metrics
                .time(|| self.backend.fence_devices(id, gen, bytes, &pick))
            {
                Ok(report) => {
                    tracing::warn!(volume = %id, generation = gen, devices = %devices, holders = report.fenced.len(), "write fence made: held writable by devices no attachment entitles")
                }
                Err(e) => {
                    tracing::error!(volume = %id, generation = gen, devices = %devices, error = %e, "could not fence devices no attachment entitles")
                }
            }
        }
    }

    /// True the first time `gen` of `id` could not be fenced again.
    fn first_report_of_unfenceable(&self, id: &VolumeId, gen: u64) -> bool {
        self.unfenceable_reported
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((id.to_string(), gen))
    }
}

/// Writable loop devices on `gen` (from one scan) whose node part of the
/// tag `pick` accepts (None: not one of our tags at all).
fn writable_holders(
    backend: &dyn Backend,
    scan: &[LoopInfo],
    id: &VolumeId,
    gen: u64,
    pick: &dyn Fn(Option<&str>) -> bool,
) -> Vec<LoopInfo> {
    writable(&backend.holders_in(scan, id, gen), id, gen, pick)
}
/// Loop devices as a log and error text: "/dev/loopN (tag), ...".
fn describe(devices: &[LoopInfo]) -> String {
    devices
        .iter()
        .map(|l| format!("{} ({})", l.device.display(), l.tag))
        .collect::<Vec<_>>()
        .join(", ")
}
