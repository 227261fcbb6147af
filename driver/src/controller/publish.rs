//! ControllerPublishVolume and ControllerUnpublishVolume: attachment records, new
//! generations after a fence, fenced-from marks (a fenced node may not have the
//! volume back before it let go). What an unpublish fences is decided in
//! `fence_policy`; this file carries it out and records it.

use std::collections::BTreeMap;

use fencecsi_proto::v1::*;

use super::Controller;
use crate::backend::meta::{now_nanos, Attachment, Generation, NodeRecord, VolumeMeta};
use crate::backend::DataRef;
use crate::capability::{self, Access};
use crate::error::{CsiError, CsiResult};
use crate::ids::{check_token, VolumeId};
use crate::kernel::loop_device::LoopInfo;
use crate::locks::PublishLock;
use crate::terms::{CTX_FS_TYPE, CTX_GENERATION, CTX_READONLY};

use super::fence_policy::plan::{plan_unpublish, tag_node, Scope, UnpublishFacts, UnpublishPlan};

impl Controller {
    /// ControllerPublishVolume: records the attachment and hands the node its generation (a new one after a fence).
    pub(super) fn controller_publish_volume(
        &self,
        req: ControllerPublishVolumeRequest,
    ) -> CsiResult<ControllerPublishVolumeResponse> {
        let access = check_publish_request(&req)?;
        let (id, _) = self.existing_volume(&req.volume_id)?;
        let node = self.registered_node(&req.node_id)?;
        let _lock = self.inflight.try_lock(id.as_str())?;
        let mut v = self
            .store
            .volume(&id)
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        check_publishable(&id, &v, &access)?;
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
        check_single_writer(&id, &v, &access, readonly)?;
        self.check_node_room(&node, &req.node_id)?;
        self.generation_for_publish(&id, &mut v, &req.node_id)?;
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

    /// The node's registration, written by its node plugin; NOT_FOUND without one.
    fn registered_node(&self, node_id: &str) -> CsiResult<NodeRecord> {
        let node = self
            .store
            .node(node_id)
            .map_err(|e| CsiError::internal("reading node registration", e))?;
        node.ok_or_else(|| {
            CsiError::NotFound(format!(
                "node {node_id} is not known: no node plugin has registered it"
            ))
        })
    }

    /// RESOURCE_EXHAUSTED when the node already has its maximum of volumes (its own, or
    /// the driver's default).
    fn check_node_room(&self, node: &NodeRecord, node_id: &str) -> CsiResult<()> {
        let max = if node.max_volumes > 0 {
            node.max_volumes
        } else {
            self.cfg.max_volumes_per_node
        };
        if max > 0 && self.store.attachments_on(node_id) as i64 >= max {
            return Err(CsiError::ResourceExhausted(format!(
                "node {node_id} already has its maximum of {max} volumes attached"
            )));
        }
        Ok(())
    }

    /// Makes the current generation one the node may be handed: strays fenced, and a new
    /// generation when the current one is fenced (or its fence begun) or has no image.
    fn generation_for_publish(
        &self,
        id: &VolumeId,
        v: &mut VolumeMeta,
        node_id: &str,
    ) -> CsiResult<()> {
        // The kernel, not the records, says who holds the generation: a
        // writable holder that no attachment entitles is fenced first.
        if !v.current_is_fenced()
            && !self.backend.fence_marked(id, v.current_generation)
            && self.backend.generation_exists(id, v.current_generation)
        {
            self.fence_strays(id, v, node_id)?;
        }
        if self.needs_new_generation(id, v) {
            // The copy must not race a writer: a generation fenced by an
            // older driver (flag only) or by a fence a crash interrupted may
            // still have holders over its data.
            let gen = v.current_generation;
            if self.backend.generation_exists(id, gen) {
                let scan = self.backend.holders(id, gen)?;
                self.complete_fence(id, v, gen, &scan)?;
            }
            self.new_generation(id, v)?;
            crate::failpoint::hit("cpublish:after-new-generation");
        }
        Ok(())
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

    /// ControllerUnpublishVolume: removes the attachment, fencing first what `fence_policy::plan` says.
    pub(super) fn controller_unpublish_volume(
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
        let holders = self.holders_by_generation(&id, &v)?;
        let plan = plan_unpublish(&UnpublishFacts {
            id: &id,
            record: &v,
            targets: &nodes,
            fence_requested: req.fence,
            stuck_stage,
            holders: &holders,
        });
        if !plan.fences.is_empty() && !self.fence_available() {
            return Err(self.fence_refused(&id, req.fence, &nodes));
        }
        // Nothing is recorded until every fence succeeded: a failed fence
        // leaves the records as they were (the devices already remapped stay
        // fenced, the safe side; a retry completes the rest).
        self.make_fences(&id, &v, &plan, &nodes)?;
        record_unpublish(&id, &mut v, &plan, &nodes);
        if req.fence && plan.fences.is_empty() {
            tracing::info!(volume = %id, nodes = ?nodes, "fence requested but nothing holds or is published: nothing can write");
        }
        self.persist(&v)?;
        Ok(ControllerUnpublishVolumeResponse {})
    }

    /// Who holds each generation of the volume, from one scan of the loop devices.
    fn holders_by_generation(
        &self,
        id: &VolumeId,
        v: &VolumeMeta,
    ) -> CsiResult<BTreeMap<u64, Vec<LoopInfo>>> {
        let scan = self.backend.holder_snapshot()?;
        Ok(v.generations
            .keys()
            .map(|&gen| (gen, self.backend.holders_in(&scan, id, gen)))
            .collect())
    }

    /// FAILED_PRECONDITION for an unpublish that needs a fence this driver cannot make.
    fn fence_refused(&self, id: &VolumeId, requested: bool, nodes: &[String]) -> CsiError {
        CsiError::FailedPrecondition(format!(
            "volume {id}: {}; the fence is not available on this driver ({})",
            if requested {
                "a fence was asked for".to_string()
            } else {
                format!(
                    "node {} still holds it and must unstage it first",
                    nodes.join(", ")
                )
            },
            self.fence_unavailable_reason()
        ))
    }

    /// Makes every fence of the plan, each logged with why; the first failure ends it.
    fn make_fences(
        &self,
        id: &VolumeId,
        v: &VolumeMeta,
        plan: &UnpublishPlan,
        nodes: &[String],
    ) -> CsiResult<()> {
        for step in &plan.fences {
            let gen = step.generation;
            let bytes = v.data_bytes(gen);
            let report = match &step.scope {
                Scope::Whole => self
                    .fence_metrics
                    .time(|| self.backend.freeze(id, gen, bytes))?,
                Scope::DevicesExcept(others) => {
                    let pick = |l: &LoopInfo| {
                        let tag = tag_node(&l.tag, id, gen);
                        !l.read_only && !others.iter().any(|o| Some(o.as_str()) == tag)
                    };
                    self.fence_metrics
                        .time(|| self.backend.fence_devices(id, gen, bytes, &pick))?
                }
            };
            let whole = step.scope == Scope::Whole;
            match step.reason.unrequested_why(nodes) {
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
        Ok(())
    }
}

/// The request's own checks: ids present and well formed, a capability this driver serves.
fn check_publish_request(req: &ControllerPublishVolumeRequest) -> CsiResult<Access> {
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
    capability::parse(cap)
}

/// ABORTED while the volume is still being created; INVALID_ARGUMENT for a filesystem it
/// does not have.
fn check_publishable(id: &VolumeId, v: &VolumeMeta, access: &Access) -> CsiResult<()> {
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
    Ok(())
}

/// FAILED_PRECONDITION when the volume is published elsewhere, unless every attachment,
/// this one too, is read-only under a multi-node access mode.
fn check_single_writer(
    id: &VolumeId,
    v: &VolumeMeta,
    access: &Access,
    readonly: bool,
) -> CsiResult<()> {
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
    Ok(())
}

/// Writes the unpublish into the record: the whole fences' time, node and reason (a
/// generation fenced before keeps its first), the fenced-from marks, the attachments gone.
fn record_unpublish(id: &VolumeId, v: &mut VolumeMeta, plan: &UnpublishPlan, nodes: &[String]) {
    let now = now_nanos();
    for step in plan.fences.iter().filter(|s| s.scope == Scope::Whole) {
        if let Some(g) = v.generations.get_mut(&step.generation) {
            if g.fenced_at.is_none() {
                g.fenced_at = Some(now);
                g.fenced_node = Some(nodes.join(","));
                g.fence_reason = step.reason.unrequested_why(nodes);
            }
        }
    }
    for (node, gen) in &plan.fenced_from {
        v.fenced_from.insert(node.clone(), *gen);
    }
    for node in nodes {
        if v.attachments.remove(node).is_some() {
            tracing::info!(volume = %id, node, fenced = !plan.fences.is_empty(), "volume unpublished");
        }
    }
}
