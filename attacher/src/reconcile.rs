//! Attach and detach of one VolumeAttachment. Everything here is idempotent: a pass can
//! be cut short anywhere (timeout, crash, lost leadership) and the next pass, by this or
//! another instance, finishes the job.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, PersistentVolume};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{
    CSINode, VolumeAttachment, VolumeAttachmentStatus, VolumeError,
};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::{object_ref, Api, EventRecorder, EventType, ListParams, MetadataPatch};
use fencecsi_proto::v1::{ControllerPublishVolumeRequest, ControllerUnpublishVolumeRequest};
use tonic::Code;

use crate::config::{Config, FencePolicy};
use crate::csi::{Capabilities, Csi};
use crate::metrics::{Metrics, ATTACH, DETACH};
use crate::volume::{self, CsiVolume};

/// On a VolumeAttachment: the CSI node ID it was published to, so a detach still knows
/// it after the Node and its CSINode are gone. Upstream external-attacher's name.
pub const VA_NODE_ID_ANNOTATION: &str = "csi.alpha.kubernetes.io/node-id";

/// Event reasons on VolumeAttachments.
pub const REASON_ATTACHED: &str = "Attached";
pub const REASON_ATTACH_FAILED: &str = "AttachFailed";
pub const REASON_DETACHED: &str = "Detached";
pub const REASON_DETACH_FAILED: &str = "DetachFailed";
pub const REASON_FENCED: &str = "Fenced";

/// What one pass needs; shared by the workers of an instance.
pub(crate) struct Ctx {
    pub cfg: Config,
    pub driver: String,
    pub finalizer: String,
    pub csi: Csi,
    pub caps: RwLock<Capabilities>,
    pub metrics: Arc<Metrics>,
    pub events: Arc<EventRecorder>,
    pub vas: Api<VolumeAttachment>,
    pub pvs: Api<PersistentVolume>,
    pub nodes: Api<Node>,
    pub csinodes: Api<CSINode>,
    /// VolumeAttachments of this driver, as last seen on the watch.
    pub cache: RwLock<HashMap<String, Arc<VolumeAttachment>>>,
    /// Whether this instance may act (leads, or runs without election). Checked before
    /// every CSI call.
    pub may_act: Arc<dyn Fn() -> bool + Send + Sync>,
}

fn has_finalizer(meta: &ObjectMeta, f: &str) -> bool {
    meta.finalizers
        .as_ref()
        .is_some_and(|fs| fs.iter().any(|x| x == f))
}

fn now() -> Time {
    Time(Timestamp::now())
}

/// Which half of the VolumeAttachment's life an error belongs to.
#[derive(Debug, Clone, Copy)]
enum Op {
    Attach,
    Detach,
}

impl Ctx {
    pub(crate) fn caps(&self) -> Capabilities {
        *self.caps.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn is_ours(&self, va: &VolumeAttachment) -> bool {
        va.spec.attacher == self.driver
    }

    /// One pass over the VolumeAttachment `name`. `Err` means: retry with backoff.
    pub(crate) async fn reconcile(&self, name: &str) -> Result<(), String> {
        let va = match self.vas.get_opt(name).await {
            Ok(Some(va)) => va,
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("reading VolumeAttachment {name}: {e}")),
        };
        if !self.is_ours(&va) {
            return Ok(());
        }
        if va.metadata.deletion_timestamp.is_some() {
            self.detach(va).await
        } else {
            self.attach(va).await
        }
    }

    fn event(&self, va: &VolumeAttachment, t: EventType, reason: &'static str, msg: String) {
        let regarding = object_ref(va);
        let rec = self.events.clone();
        tokio::spawn(async move {
            if let Err(e) = rec.record(&regarding, t, reason, &msg).await {
                tracing::debug!(error = %e, reason, "recording an event failed");
            }
        });
    }

    /// The PV name (if any) and the CSI volume of `va`.
    async fn volume_of(
        &self,
        va: &VolumeAttachment,
    ) -> Result<(Option<String>, CsiVolume), String> {
        let src = &va.spec.source;
        if let Some(pv_name) = &src.persistent_volume_name {
            let pv = match self.pvs.get_opt(pv_name).await {
                Ok(Some(pv)) => pv,
                Ok(None) => return Err(format!("PersistentVolume {pv_name} not found")),
                Err(e) => return Err(format!("reading PersistentVolume {pv_name}: {e}")),
            };
            let spec = pv.spec.unwrap_or_default();
            let v = volume::csi_volume(&spec, &self.driver)
                .map_err(|e| format!("PersistentVolume {pv_name}: {e}"))?;
            Ok((Some(pv_name.clone()), v))
        } else if let Some(spec) = &src.inline_volume_spec {
            let v = volume::csi_volume(spec, &self.driver)
                .map_err(|e| format!("inline volume: {e}"))?;
            Ok((None, v))
        } else {
            Err("spec.source names neither a PersistentVolume nor an inline volume".into())
        }
    }

    /// The CSI node ID of `node`: CSINode first, then the Node annotation.
    async fn node_id(&self, node: &str) -> Result<String, String> {
        if let Some(cn) = self
            .csinodes
            .get_opt(node)
            .await
            .map_err(|e| format!("reading CSINode {node}: {e}"))?
        {
            if let Some(id) = volume::node_id_from_csinode(&cn, &self.driver) {
                return Ok(id);
            }
        }
        if let Some(n) = self
            .nodes
            .get_opt(node)
            .await
            .map_err(|e| format!("reading Node {node}: {e}"))?
        {
            if let Some(id) = volume::node_id_from_annotation(&n, &self.driver) {
                return Ok(id);
            }
        }
        Err(format!(
            "node {node} has no CSI node ID for driver {}: neither its CSINode nor its Node annotation names it (is the node plugin registered?)",
            self.driver
        ))
    }

    /// Writes `va`'s status through `f`, re-reading on conflict. A vanished object is fine.
    async fn set_status(
        &self,
        va: &VolumeAttachment,
        f: impl Fn(&mut VolumeAttachmentStatus),
    ) -> Result<(), String> {
        let name = va.metadata.name.clone().unwrap_or_default();
        let mut cur = va.clone();
        for _ in 0..8 {
            let mut st = cur.status.clone().unwrap_or_default();
            f(&mut st);
            if cur.status.as_ref() == Some(&st) {
                return Ok(());
            }
            cur.status = Some(st);
            match self.vas.replace_status(&cur).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_not_found() => return Ok(()),
                Err(e) if e.is_conflict() => match self.vas.get_opt(&name).await {
                    Ok(Some(v)) => cur = v,
                    Ok(None) => return Ok(()),
                    Err(e) => return Err(format!("re-reading VolumeAttachment {name}: {e}")),
                },
                Err(e) => {
                    return Err(format!(
                        "writing the status of VolumeAttachment {name}: {e}"
                    ))
                }
            }
        }
        Err(format!(
            "writing the status of VolumeAttachment {name}: too many conflicts"
        ))
    }

    fn volume_error(msg: &str, code: Option<Code>) -> VolumeError {
        VolumeError {
            message: Some(msg.to_string()),
            time: Some(now()),
            error_code: code.map(|c| c as i32),
        }
    }

    async fn attach(&self, va: VolumeAttachment) -> Result<(), String> {
        let name = va.metadata.name.clone().unwrap_or_default();
        let node = va.spec.node_name.clone();
        let attached = va.status.as_ref().is_some_and(|s| s.attached);
        if attached && has_finalizer(&va.metadata, &self.finalizer) {
            // Attached: only keep the PV's finalizer in place (a no-op patch when present).
            if let Some(pv) = &va.spec.source.persistent_volume_name {
                self.add_pv_finalizer(pv).await?;
            }
            return Ok(());
        }

        let (pv_name, vol) = match self.volume_of(&va).await {
            Ok(v) => v,
            Err(e) => return self.failed(&va, Op::Attach, e, None).await,
        };
        if let Some(pv) = &pv_name {
            if let Err(e) = self.add_pv_finalizer(pv).await {
                return self.failed(&va, Op::Attach, e, None).await;
            }
        }
        let node_id = match self.node_id(&node).await {
            Ok(id) => id,
            Err(e) => return self.failed(&va, Op::Attach, e, None).await,
        };
        let annotated = va
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(VA_NODE_ID_ANNOTATION))
            == Some(&node_id);
        let va = if has_finalizer(&va.metadata, &self.finalizer) && annotated {
            va
        } else {
            let patch = MetadataPatch::new()
                .add_finalizer(&self.finalizer)
                .set_annotation(VA_NODE_ID_ANNOTATION, &node_id);
            match self.vas.patch_metadata(&name, &patch).await {
                Ok(v) => v,
                Err(e) if e.is_not_found() => return Ok(()),
                // Deletion started meanwhile: its watch event queues the detach.
                Err(e) if e.is_invalid() => return Ok(()),
                Err(e) => {
                    return Err(format!(
                        "adding the finalizer to VolumeAttachment {name}: {e}"
                    ))
                }
            }
        };

        let caps = self.caps();
        if !caps.publish_unpublish {
            self.set_status(&va, |s| {
                s.attached = true;
                s.attach_error = None;
            })
            .await?;
            self.event(
                &va,
                EventType::Normal,
                REASON_ATTACHED,
                format!(
                    "marked attached to node {node}: the plugin has no ControllerPublishVolume"
                ),
            );
            return Ok(());
        }
        if !(self.may_act)() {
            return Err("not the active attacher any more".into());
        }
        if vol.wants_secrets {
            tracing::warn!(va = %name, "controllerPublishSecretRef is set but secrets are not supported; publishing without them");
        }
        let req = ControllerPublishVolumeRequest {
            volume_id: vol.handle.clone(),
            node_id: node_id.clone(),
            volume_capability: Some(vol.capability.clone()),
            readonly: vol.readonly,
            volume_context: vol.context.clone(),
            ..Default::default()
        };
        let start = Instant::now();
        match self.csi.publish(req).await {
            Ok(ctx) => {
                let took = start.elapsed();
                self.metrics.operation(ATTACH, true, took);
                let meta: BTreeMap<String, String> = ctx.into_iter().collect();
                self.set_status(&va, |s| {
                    s.attached = true;
                    s.attachment_metadata = (!meta.is_empty()).then(|| meta.clone());
                    s.attach_error = None;
                })
                .await?;
                tracing::info!(va = %name, volume = %vol.handle, node = %node, node_id = %node_id, ms = took.as_secs_f64() * 1e3, "attached");
                self.event(
                    &va,
                    EventType::Normal,
                    REASON_ATTACHED,
                    format!(
                        "volume {} attached to node {node} (CSI node ID {node_id})",
                        vol.handle
                    ),
                );
                Ok(())
            }
            Err(s) => {
                self.metrics.operation(ATTACH, false, start.elapsed());
                let msg = format!(
                    "ControllerPublishVolume of {} to node {node_id} failed: {}: {}",
                    vol.handle,
                    code_name(s.code()),
                    s.message()
                );
                self.failed(&va, Op::Attach, msg, Some(s.code())).await
            }
        }
    }

    /// Records a failed attach or detach in the VolumeAttachment's status
    /// (attachError / detachError) and, unless it repeats the last error, as
    /// a Warning event; returns the error so the queue backs off.
    async fn failed(
        &self,
        va: &VolumeAttachment,
        op: Op,
        msg: String,
        code: Option<Code>,
    ) -> Result<(), String> {
        let last = va.status.as_ref().and_then(|s| match op {
            Op::Attach => s.attach_error.as_ref(),
            Op::Detach => s.detach_error.as_ref(),
        });
        let repeated = last.and_then(|e| e.message.as_deref()) == Some(msg.as_str());
        let err = Self::volume_error(&msg, code);
        if let Err(e) = self
            .set_status(va, |s| match op {
                Op::Attach => s.attach_error = Some(err.clone()),
                Op::Detach => s.detach_error = Some(err.clone()),
            })
            .await
        {
            tracing::warn!(error = %e, ?op, "recording the error in the VolumeAttachment status failed");
        }
        if !repeated {
            let reason = match op {
                Op::Attach => REASON_ATTACH_FAILED,
                Op::Detach => REASON_DETACH_FAILED,
            };
            self.event(va, EventType::Warning, reason, msg.clone());
        }
        Err(msg)
    }

    async fn detach(&self, va: VolumeAttachment) -> Result<(), String> {
        if !has_finalizer(&va.metadata, &self.finalizer) {
            return Ok(());
        }
        let name = va.metadata.name.clone().unwrap_or_default();
        let node = va.spec.node_name.clone();
        let pv_name = va.spec.source.persistent_volume_name.clone();
        let caps = self.caps();
        let mut fenced = None;
        if caps.publish_unpublish {
            let (_, vol) = match self.volume_of(&va).await {
                Ok(v) => v,
                Err(e) => return self.failed(&va, Op::Detach, e, None).await,
            };
            let recorded = va
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(VA_NODE_ID_ANNOTATION))
                .filter(|s| !s.is_empty())
                .cloned();
            let node_id = match recorded {
                Some(id) => id,
                None => match self.node_id(&node).await {
                    Ok(id) => id,
                    Err(e) => return self.failed(&va, Op::Detach, e, None).await,
                },
            };
            let (fence, why) = match self.fence_decision(&node, &vol.handle, caps).await {
                Ok(d) => d,
                Err(e) => return self.failed(&va, Op::Detach, e, None).await,
            };
            if !(self.may_act)() {
                return Err("not the active attacher any more".into());
            }
            let req = ControllerUnpublishVolumeRequest {
                volume_id: vol.handle.clone(),
                node_id: node_id.clone(),
                fence,
                ..Default::default()
            };
            let start = Instant::now();
            match self.csi.unpublish(req).await {
                Ok(()) => {}
                Err(s) if s.code() == Code::NotFound => {
                    tracing::info!(va = %name, volume = %vol.handle, "the plugin does not know the volume: counts as detached");
                }
                Err(s) => {
                    self.metrics.operation(DETACH, false, start.elapsed());
                    if fence {
                        self.metrics.fence(false);
                    }
                    let msg = format!(
                        "ControllerUnpublishVolume{} of {} from node {node_id} failed: {}: {}",
                        if fence { " with fence" } else { "" },
                        vol.handle,
                        code_name(s.code()),
                        s.message()
                    );
                    return self.failed(&va, Op::Detach, msg, Some(s.code())).await;
                }
            }
            let took = start.elapsed();
            self.metrics.operation(DETACH, true, took);
            if fence {
                self.metrics.fence(true);
                tracing::warn!(va = %name, volume = %vol.handle, node = %node, reason = %why, "node fenced from the volume");
                self.event(
                    &va,
                    EventType::Warning,
                    REASON_FENCED,
                    format!("node {node} fenced from volume {}: {why}", vol.handle),
                );
            }
            tracing::info!(va = %name, volume = %vol.handle, node = %node, fence, reason = %why, ms = took.as_secs_f64() * 1e3, "detached");
            fenced = Some((vol.handle, fence, why));
        }

        // Let the object go. With other finalizers it stays: say it is detached.
        let others = va
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|fs| fs.iter().any(|f| *f != self.finalizer));
        if others {
            self.set_status(&va, |s| {
                s.attached = false;
                s.attachment_metadata = None;
                s.detach_error = None;
            })
            .await?;
        }
        match self
            .vas
            .patch_metadata(
                &name,
                &MetadataPatch::new().remove_finalizer(&self.finalizer),
            )
            .await
        {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {}
            Err(e) => {
                return Err(format!(
                    "removing the finalizer of VolumeAttachment {name}: {e}"
                ))
            }
        }
        let msg = match &fenced {
            Some((h, true, _)) => format!("volume {h} detached from node {node} with a fence"),
            Some((h, false, why)) => {
                format!("volume {h} detached from node {node} without a fence ({why})")
            }
            None => format!(
                "marked detached from node {node}: the plugin has no ControllerUnpublishVolume"
            ),
        };
        self.event(&va, EventType::Normal, REASON_DETACHED, msg);
        if let Some(pv) = pv_name {
            if !self.pv_referenced(&pv, Some(&name)) {
                self.remove_pv_finalizer(&pv).await?;
            }
        }
        Ok(())
    }

    /// Whether to send `fence = true`, and why.
    async fn fence_decision(
        &self,
        node: &str,
        handle: &str,
        caps: Capabilities,
    ) -> Result<(bool, String), String> {
        match self.cfg.fence {
            FencePolicy::Never => Ok((false, "the fence policy is never".into())),
            FencePolicy::Always if caps.unpublish_fence => {
                Ok((true, "the fence policy is always".into()))
            }
            FencePolicy::Always => {
                tracing::warn!(node, volume = handle, "fence policy is always but the plugin does not advertise UNPUBLISH_FENCE: detaching without a fence");
                Ok((false, "the plugin cannot fence".into()))
            }
            FencePolicy::Auto if !caps.unpublish_fence => {
                Ok((false, "the plugin cannot fence".into()))
            }
            FencePolicy::Auto => {
                let n = self
                    .nodes
                    .get_opt(node)
                    .await
                    .map_err(|e| format!("reading Node {node} to decide on a fence: {e}"))?;
                Ok(
                    match volume::node_may_be_writing(n.as_ref(), &self.driver, handle) {
                        Some(why) => (true, why),
                        None => (
                            false,
                            "the node is Ready and does not use the volume".into(),
                        ),
                    },
                )
            }
        }
    }

    /// Whether a VolumeAttachment of this driver (other than `except`) references `pv`.
    fn pv_referenced(&self, pv: &str, except: Option<&str>) -> bool {
        let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
        cache.iter().any(|(n, va)| {
            Some(n.as_str()) != except
                && va.spec.source.persistent_volume_name.as_deref() == Some(pv)
        })
    }

    async fn add_pv_finalizer(&self, pv: &str) -> Result<(), String> {
        match self
            .pvs
            .patch_metadata(pv, &MetadataPatch::new().add_finalizer(&self.finalizer))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Err(format!("PersistentVolume {pv} not found")),
            // Deleting already: it keeps the finalizer it has.
            Err(e) if e.is_invalid() => Ok(()),
            Err(e) => Err(format!(
                "adding the finalizer to PersistentVolume {pv}: {e}"
            )),
        }
    }

    async fn remove_pv_finalizer(&self, pv: &str) -> Result<(), String> {
        match self
            .pvs
            .patch_metadata(pv, &MetadataPatch::new().remove_finalizer(&self.finalizer))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(format!(
                "removing the finalizer of PersistentVolume {pv}: {e}"
            )),
        }
    }

    /// Removes this driver's finalizer from PVs no VolumeAttachment of the driver
    /// references any more (e.g. after two detaches raced). Part of the resync.
    pub(crate) async fn sweep_pv_finalizers(&self) {
        let fin = self.finalizer.clone();
        let pvs = match self
            .pvs
            .list_filtered(&ListParams::default(), move |pv| {
                has_finalizer(&pv.metadata, &fin)
            })
            .await
        {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "listing PersistentVolumes for the finalizer sweep failed");
                return;
            }
        };
        for pv in pvs {
            let name = pv.metadata.name.clone().unwrap_or_default();
            if !self.pv_referenced(&name, None) {
                if let Err(e) = self.remove_pv_finalizer(&name).await {
                    tracing::warn!(pv = %name, error = %e, "finalizer sweep");
                } else {
                    tracing::info!(pv = %name, "finalizer removed: no VolumeAttachment references the PersistentVolume");
                }
            }
        }
    }
}

fn code_name(c: Code) -> String {
    format!("{c:?}")
}

/// Whether a watch update should queue the object. External-attacher's rule — not when
/// only the attach/detach error changed — widened to every change this attacher makes
/// itself: the status (only the attacher writes it), its own finalizer and node-ID
/// annotation being added. Those are followed by the backoff (on failure) or need
/// nothing (on success); queuing them at once would bypass the backoff and double every
/// attach. Anything else queues: spec, deletion, finalizers or annotations changed by
/// someone else, and resyncs (same resourceVersion). A status changed by someone else
/// is repaired at the next resync.
pub(crate) fn should_enqueue(
    old: Option<&VolumeAttachment>,
    new: &VolumeAttachment,
    finalizer: &str,
) -> bool {
    let Some(old) = old else { return true };
    if old.metadata.resource_version == new.metadata.resource_version {
        return true;
    }
    let mut sanitized = new.clone();
    let m = &mut sanitized.metadata;
    m.resource_version = old.metadata.resource_version.clone();
    m.managed_fields = old.metadata.managed_fields.clone();
    sanitized.status = old.status.clone();
    // Our finalizer added (nothing else changed in the list).
    let mut with_ours = old.metadata.finalizers.clone().unwrap_or_default();
    if !with_ours.iter().any(|f| f == finalizer) {
        with_ours.push(finalizer.to_string());
    }
    if m.finalizers.as_deref().unwrap_or_default() == with_ours.as_slice() {
        m.finalizers = old.metadata.finalizers.clone();
    }
    // Our node-ID annotation set (nothing else changed in the map).
    if let Some(a) = m.annotations.as_mut() {
        let mut a2 = a.clone();
        a2.remove(VA_NODE_ID_ANNOTATION);
        let mut o = old.metadata.annotations.clone().unwrap_or_default();
        o.remove(VA_NODE_ID_ANNOTATION);
        if a2 == o {
            m.annotations = old.metadata.annotations.clone();
        }
    }
    sanitized != *old
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachmentSpec;

    fn va(rv: &str) -> VolumeAttachment {
        VolumeAttachment {
            metadata: ObjectMeta {
                name: Some("va".into()),
                resource_version: Some(rv.into()),
                ..Default::default()
            },
            spec: VolumeAttachmentSpec {
                attacher: "d".into(),
                node_name: "n".into(),
                ..Default::default()
            },
            status: None,
        }
    }

    const FIN: &str = "external-attacher/d";

    #[test]
    fn own_writes_do_not_requeue() {
        let should_enqueue =
            |a: Option<&VolumeAttachment>, b: &VolumeAttachment| super::should_enqueue(a, b, FIN);
        let old = va("1");
        assert!(should_enqueue(None, &old));
        assert!(should_enqueue(Some(&old), &old), "resync (same rv) queues");
        let mut err = va("2");
        err.status = Some(VolumeAttachmentStatus {
            attach_error: Some(VolumeError {
                message: Some("boom".into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        assert!(!should_enqueue(Some(&old), &err));
        let mut err2 = err.clone();
        err2.metadata.resource_version = Some("3".into());
        err2.status
            .as_mut()
            .unwrap()
            .attach_error
            .as_mut()
            .unwrap()
            .message = Some("again".into());
        assert!(!should_enqueue(Some(&err), &err2));
        let mut attached = err2.clone();
        attached.metadata.resource_version = Some("4".into());
        attached.status.as_mut().unwrap().attached = true;
        assert!(!should_enqueue(Some(&err2), &attached), "our status write");
        let mut deleting = va("5");
        deleting.metadata.deletion_timestamp = Some(now());
        assert!(should_enqueue(Some(&old), &deleting));

        let mut ours = va("6");
        ours.metadata.finalizers = Some(vec![FIN.into()]);
        ours.metadata.annotations =
            Some([(VA_NODE_ID_ANNOTATION.to_string(), "n1".to_string())].into());
        assert!(
            !should_enqueue(Some(&old), &ours),
            "our finalizer and annotation"
        );
        let mut gone = ours.clone();
        gone.metadata.resource_version = Some("7".into());
        gone.metadata.finalizers = None;
        assert!(
            should_enqueue(Some(&ours), &gone),
            "our finalizer removed by someone else"
        );
        let mut other = ours.clone();
        other.metadata.resource_version = Some("8".into());
        other.metadata.finalizers = Some(vec![FIN.into(), "someone/else".into()]);
        assert!(should_enqueue(Some(&ours), &other));
        let mut label = ours.clone();
        label.metadata.resource_version = Some("9".into());
        label
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert("x".into(), "y".into());
        assert!(should_enqueue(Some(&ours), &label));
    }
}
