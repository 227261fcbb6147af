//! ControllerPublish/Unpublish: attachment records, the fence, new
//! generations after a fence, fenced-from marks (a fenced node may not have
//! the volume back before it let go), and garbage collection of fenced
//! generations once nothing holds them.

use std::collections::BTreeMap;

use fencecsi_proto::v1::*;

use super::{Controller, CTX_FS_TYPE, CTX_GENERATION, CTX_READONLY};
use crate::backend::meta::{now_nanos, Attachment, Generation, PublishLock, VolumeMeta};
use crate::backend::Backend;
use crate::backend::DataRef;
use crate::capability;
use crate::error::{CsiError, CsiResult};
use crate::fence::is_fenced_device;
use crate::ids::{check_token, VolumeId};
use crate::loopdev::LoopInfo;
use crate::node::node_tag;

use super::fence_policy::{plan_unpublish, tag_node, writable, Scope, UnpublishFacts};

impl Controller {
    pub(super) fn publish(
        &self,
        req: ControllerPublishVolumeRequest,
    ) -> CsiResult<ControllerPublishVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if req.node_id.is_empty() {
            return Err(CsiError::InvalidArgument("node_id is required".into()));
        }
        check_token("node ID", &req.node_id)?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("volume_capability is required".into()))?;
        let access = capability::parse(cap)?;
        let (id, _) = self.existing_volume(&req.volume_id)?;
        let node = self
            .store
            .node(&req.node_id)
            .map_err(|e| CsiError::internal("reading node registration", e))?;
        let Some(node) = node else {
            return Err(CsiError::NotFound(format!(
                "node {} is not known: no node plugin has registered it",
                req.node_id
            )));
        };
        let _lock = self.inflight.try_lock(id.as_str())?;
        let mut v = self
            .store
            .volume(&id)
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        if v.state == crate::backend::meta::VolumeState::Creating {
            return Err(CsiError::Aborted(format!(
                "volume {id} is still being created; retry after CreateVolume completes"
            )));
        }
        if let Some(fs) = &access.fs_type {
            if *fs != v.fs_type {
                return Err(CsiError::InvalidArgument(format!(
                    "volume {id} has a {} filesystem, not {fs}",
                    v.fs_type
                )));
            }
        }
        let readonly = req.readonly || access.read_only_mode();

        if let Some(a) = v.attachments.get(&req.node_id) {
            if a.readonly == readonly && a.block == access.block {
                return Ok(self.publish_context(&v, a));
            }
            return Err(CsiError::AlreadyExists(format!(
                "volume {id} is already published to node {} with readonly={} block={}",
                req.node_id, a.readonly, a.block
            )));
        }
        // From the holder scans below until the attachment is recorded: a
        // node's stage checks its record and attaches under the same lock.
        // Without it (a node stuck holding it), only a publish that makes a
        // new generation is safe: a stuck stage can only attach a
        // generation it read before, never the new one.
        let publish_lock = self.publish_lock_within(&id)?;
        if publish_lock.is_none() && !self.needs_new_generation(&id, &v) {
            return Err(CsiError::Aborted(format!(
                "volume {id}: a node process has held its attachments lock for {:?} (a stage stuck mid-attach?); it is published elsewhere once its node is unpublished with a fence",
                crate::locks::NODE_LOCK_WAIT
            )));
        }
        self.lift_fenced_from(&id, &mut v, &req.node_id)?;
        let others: Vec<(&String, &Attachment)> = v.attachments.iter().collect();
        let shared_read_only =
            access.multi_node() && readonly && others.iter().all(|(_, a)| a.readonly);
        if !others.is_empty() && !shared_read_only {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} is published to node {} and its access mode allows one node only",
                others
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let max = if node.max_volumes > 0 {
            node.max_volumes
        } else {
            self.cfg.max_volumes_per_node
        };
        if max > 0 && self.store.attachments_on(&req.node_id) as i64 >= max {
            return Err(CsiError::ResourceExhausted(format!(
                "node {} already has its maximum of {max} volumes attached",
                req.node_id
            )));
        }
        // The kernel, not the records, says who holds the generation: a
        // writable holder that no attachment entitles is fenced first.
        if !v.current_is_fenced()
            && !self.backend.fence_marked(&id, v.current_generation)
            && self.backend.generation_exists(&id, v.current_generation)
        {
            self.fence_strays(&id, &mut v, &req.node_id)?;
        }
        if self.needs_new_generation(&id, &v) {
            // The copy must not race a writer: a generation fenced by an
            // older driver (flag only) or by a fence a crash interrupted may
            // still have holders over its data.
            let gen = v.current_generation;
            if self.backend.generation_exists(&id, gen) {
                let scan = self.backend.holders(&id, gen)?;
                self.complete_fence(&id, &mut v, gen, &scan)?;
            }
            self.new_generation(&id, &mut v)?;
            crate::failpoint::hit("cpublish:after-new-generation");
        }
        let gen = v.current_generation;
        self.backend.ensure_trailer(&id, gen, v.data_bytes(gen))?;
        let a = Attachment {
            generation: v.current_generation,
            readonly,
            block: access.block,
            published_at: now_nanos(),
        };
        v.attachments.insert(req.node_id.clone(), a.clone());
        self.persist(&v)?;
        tracing::info!(volume = %id, node = %req.node_id, generation = a.generation, readonly, "volume published");
        Ok(self.publish_context(&v, &a))
    }

    /// The volume's [`PublishLock`], exclusive, or None when a node process
    /// still holds it after [`crate::locks::NODE_LOCK_WAIT`].
    fn publish_lock_within(&self, id: &VolumeId) -> CsiResult<Option<PublishLock>> {
        PublishLock::within_for_rpc(
            &self.cfg.state_dir,
            id,
            true,
            "locking the volume's attachments against a concurrent stage",
        )
    }

    /// Whether the next writer gets a new generation: the current one is
    /// fenced (or its fence was begun) or has no image.
    fn needs_new_generation(&self, id: &VolumeId, v: &VolumeMeta) -> bool {
        let gen = v.current_generation;
        v.current_is_fenced()
            || self.backend.fence_marked(id, gen)
            || !self.backend.generation_exists(id, gen)
    }

    fn publish_context(&self, v: &VolumeMeta, a: &Attachment) -> ControllerPublishVolumeResponse {
        let mut ctx: std::collections::HashMap<String, String> = [
            (CTX_GENERATION.to_string(), a.generation.to_string()),
            (CTX_READONLY.to_string(), a.readonly.to_string()),
        ]
        .into();
        // A raw block attachment has no filesystem to name.
        if !a.block {
            ctx.insert(CTX_FS_TYPE.to_string(), v.fs_type.clone());
        }
        ControllerPublishVolumeResponse {
            publish_context: ctx,
        }
    }

    /// The current generation was fenced: the next writer gets a clone of it
    /// (reflink where the backend can), while the frozen one stays frozen for
    /// as long as the old node may hold it.
    fn new_generation(&self, id: &VolumeId, v: &mut VolumeMeta) -> CsiResult<()> {
        let from = v.current_generation;
        let next = v.generations.keys().max().copied().unwrap_or(0) + 1;
        let start = std::time::Instant::now();
        let kind = self.backend.clone_data(
            &DataRef::Generation(id.clone(), from),
            v.data_bytes(from),
            id,
            next,
            v.capacity_bytes,
        )?;
        v.generations.insert(
            next,
            Generation {
                created_at: now_nanos(),
                origin: Some(kind),
                fenced_at: None,
                fenced_node: None,
                data_bytes: Some(v.capacity_bytes),
                fence_reason: None,
            },
        );
        v.current_generation = next;
        self.persist(v)?;
        tracing::info!(volume = %id, from, to = next, ?kind, ms = start.elapsed().as_secs_f64() * 1e3, "new generation after fence");
        Ok(())
    }

    /// A node fenced from a generation may be published to again only once it
    /// has let go of that generation (force-unpublished and force-unstaged).
    fn lift_fenced_from(&self, id: &VolumeId, v: &mut VolumeMeta, node: &str) -> CsiResult<()> {
        let Some(&gen) = v.fenced_from.get(node) else {
            return Ok(());
        };
        let holders = self.backend.holders(id, gen)?;
        if !holders.is_empty() {
            return Err(CsiError::FailedPrecondition(format!(
                "node {node} was fenced from volume {id} and still holds generation {gen} ({}); it must force-unpublish and force-unstage it first",
                holders.iter().map(|l| l.device.display().to_string()).collect::<Vec<_>>().join(", ")
            )));
        }
        v.fenced_from.remove(node);
        self.persist(v)?;
        tracing::info!(volume = %id, node, generation = gen, "fenced-from mark lifted: the node released the fenced generation");
        Ok(())
    }

    pub(super) fn unpublish(
        &self,
        req: ControllerUnpublishVolumeRequest,
    ) -> CsiResult<ControllerUnpublishVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if !req.node_id.is_empty() {
            check_token("node ID", &req.node_id)?;
        }
        // A volume that does not exist is published nowhere: as the spec
        // recommends, that unpublish is done (and nothing can write to it).
        let id = match crate::ids::VolumeId::parse(&req.volume_id)? {
            crate::ids::Parsed::Ours(id) => id,
            crate::ids::Parsed::Foreign => return Ok(ControllerUnpublishVolumeResponse {}),
        };
        let _lock = self.inflight.try_lock(id.as_str())?;
        let Some(mut v) = self.store.volume(&id) else {
            tracing::info!(volume = %id, "unpublish of a volume that does not exist: nothing to do");
            return Ok(ControllerUnpublishVolumeResponse {});
        };
        // Held from the holder scan until the record is written: a stage of
        // a target node either attached before (seen and fenced below) or
        // re-reads the record after and attaches nothing. Without it, such a
        // stage could attach after a scan that found no holder, while a
        // publish to another node hands out the same generation.
        // A node that hangs holding it must not hold up the unpublish: past
        // the bound, a target's writable generation is fenced whole whatever
        // the request asked (the stage may attach it at any time; the
        // fence's marker makes that attach refuse itself).
        let publish_lock = self.publish_lock_within(&id)?;
        let stuck_stage = publish_lock.is_none();
        if stuck_stage {
            tracing::warn!(volume = %id, wait = ?crate::locks::NODE_LOCK_WAIT, "a node process holds the volume's attachments lock (a stage stuck mid-attach?): unpublishing without it");
        }
        let nodes: Vec<String> = if req.node_id.is_empty() {
            v.attachments.keys().cloned().collect()
        } else {
            vec![req.node_id.clone()]
        };
        let scan = self.backend.holder_snapshot()?;
        let holders: BTreeMap<u64, Vec<LoopInfo>> = v
            .generations
            .keys()
            .map(|&gen| (gen, self.backend.holders_in(&scan, &id, gen)))
            .collect();
        let plan = plan_unpublish(&UnpublishFacts {
            id: &id,
            record: &v,
            targets: &nodes,
            fence_requested: req.fence,
            stuck_stage,
            holders: &holders,
        });
        if !plan.fences.is_empty() && !self.fence_available() {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id}: {}; the fence is not available on this driver ({})",
                if req.fence {
                    "a fence was asked for".to_string()
                } else {
                    format!(
                        "node {} still holds it and must unstage it first",
                        nodes.join(", ")
                    )
                },
                self.fence_unavailable_reason()
            )));
        }
        // Nothing is recorded until every fence succeeded: a failed fence
        // leaves the records as they were (the devices already remapped stay
        // fenced, the safe side; a retry completes the rest).
        for step in &plan.fences {
            let gen = step.generation;
            let bytes = v.data_bytes(gen);
            let report = match &step.scope {
                Scope::Whole => self
                    .fence_metrics
                    .time(|| self.backend.freeze(&id, gen, bytes))?,
                Scope::DevicesExcept(others) => {
                    let pick = |l: &LoopInfo| {
                        let tag = tag_node(&l.tag, &id, gen);
                        !l.read_only && !others.iter().any(|o| Some(o.as_str()) == tag)
                    };
                    self.fence_metrics
                        .time(|| self.backend.fence_devices(&id, gen, bytes, &pick))?
                }
            };
            let whole = step.scope == Scope::Whole;
            match step.reason.unrequested_why(&nodes) {
                Some(why) => {
                    tracing::warn!(volume = %id, generation = gen, nodes = ?nodes, holders = report.fenced.len(), us = report.elapsed.as_micros() as u64, whole, "write fence made: {why}")
                }
                None => {
                    tracing::warn!(volume = %id, generation = gen, nodes = ?nodes, holders = report.fenced.len(), us = report.elapsed.as_micros() as u64, whole, "write fence made")
                }
            }
        }
        if !plan.fences.is_empty() {
            crate::failpoint::hit("unpublish:after-fence");
        }
        let now = now_nanos();
        for step in plan.fences.iter().filter(|s| s.scope == Scope::Whole) {
            if let Some(g) = v.generations.get_mut(&step.generation) {
                if g.fenced_at.is_none() {
                    g.fenced_at = Some(now);
                    g.fenced_node = Some(nodes.join(","));
                    g.fence_reason = step.reason.unrequested_why(&nodes);
                }
            }
        }
        for (node, gen) in &plan.fenced_from {
            v.fenced_from.insert(node.clone(), *gen);
        }
        for node in &nodes {
            if v.attachments.remove(node).is_some() {
                tracing::info!(volume = %id, node, fenced = !plan.fences.is_empty(), "volume unpublished");
            }
        }
        if req.fence && plan.fences.is_empty() {
            tracing::info!(volume = %id, nodes = ?nodes, "fence requested but nothing holds or is published: nothing can write");
        }
        self.persist(&v)?;
        Ok(ControllerUnpublishVolumeResponse {})
    }

    /// Before a publish: fences writable holders of the current generation
    /// that no attachment entitles (a node whose record is gone, a forged
    /// stage, an admin's losetup). With no entitled writer left the whole
    /// generation is fenced, so the publish that follows makes a new one.
    fn fence_strays(&self, id: &VolumeId, v: &mut VolumeMeta, publishing: &str) -> CsiResult<()> {
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
    fn complete_fence(
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
    fn complete_fences_of(
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

    /// Deletes fenced, superseded generations nobody holds and lifts the
    /// matching fenced-from marks. Safe to run at any time; skips busy volumes.
    /// Fences again first what [`Controller::complete_fence`] finds.
    pub fn collect_garbage(&self) -> usize {
        self.thaw_leftover_freezes();
        let mut removed = 0;
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
        let released = |id: &VolumeId, gen: u64| {
            self.backend.holders_in(&snapshot, id, gen).is_empty()
                && self.backend.holders(id, gen).is_ok_and(|h| h.is_empty())
        };
        for id in volumes {
            let Ok(_lock) = self.inflight.try_lock(id.as_str()) else {
                continue;
            };
            let Some(mut v) = self.store.volume(&id) else {
                continue;
            };
            self.complete_fences_of(&id, &mut v, &snapshot, false);
            let candidates: Vec<u64> = v
                .generations
                .iter()
                .filter(|(g, m)| **g != v.current_generation && m.fenced_at.is_some())
                .map(|(g, _)| *g)
                .collect();
            let mut changed = false;
            for gen in candidates {
                if !released(&id, gen) {
                    continue;
                }
                if let Some(why) = self.only_copy(&id, &v, gen) {
                    tracing::error!(volume = %id, generation = gen, "fenced generation kept: {why}");
                    continue;
                }
                if let Err(e) = self.backend.remove_generation(&id, gen) {
                    tracing::warn!(volume = %id, generation = gen, error = %e, "cannot remove fenced generation");
                    continue;
                }
                crate::failpoint::hit("gc:after-remove");
                v.generations.remove(&gen);
                v.fenced_from.retain(|_, g| *g != gen);
                changed = true;
                removed += 1;
                tracing::info!(volume = %id, generation = gen, "released fenced generation removed");
            }
            // Quarantines on a generation that is still current (not yet
            // republished) lift as soon as nothing holds it.
            let released: Vec<String> = v
                .fenced_from
                .iter()
                .filter(|(_, g)| released(&id, **g))
                .map(|(n, _)| n.clone())
                .collect();
            for node in released {
                v.fenced_from.remove(&node);
                changed = true;
                tracing::info!(volume = %id, node, "fenced-from mark lifted: the node released the fenced generation");
            }
            if changed {
                if let Err(e) = self.persist(&v) {
                    tracing::error!(volume = %id, error = %e, "cannot record garbage collection");
                }
            }
        }
        removed
    }
}

impl Controller {
    /// A writable holder of a published volume's current generation that no
    /// writable attachment entitles (an admin's `losetup` made after the
    /// publish, a forged stage) is fenced at the next pass, not only at the
    /// volume's next publish. Only those devices: the entitled node, and any
    /// readers, keep theirs. `snapshot`: the pass's scan of the loop devices.
    fn fence_late_strays(&self, published: &[VolumeId], snapshot: &[LoopInfo]) {
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

/// Parses a generation number from a publish context.
pub fn generation_from_context(
    ctx: &std::collections::HashMap<String, String>,
) -> Option<Result<u64, CsiError>> {
    ctx.get(CTX_GENERATION).map(|g| {
        g.parse::<u64>().map_err(|_| {
            CsiError::InvalidArgument(format!("publish_context generation {g:?} is not a number"))
        })
    })
}

/// Loop devices as a log and error text: "/dev/loopN (tag), ...".
fn describe(devices: &[LoopInfo]) -> String {
    devices
        .iter()
        .map(|l| format!("{} ({})", l.device.display(), l.tag))
        .collect::<Vec<_>>()
        .join(", ")
}
