//! The attach half: finalizers on the PV and the VolumeAttachment, the node-ID
//! annotation, then `ControllerPublishVolume` (or only the status when the plugin has
//! no publish).

use std::collections::BTreeMap;
use std::time::Instant;

use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::{EventType, MetadataPatch};
use fencecsi_proto::v1::ControllerPublishVolumeRequest;

use super::failure::Op;
use super::{has_finalizer, Ctx, ReconcileError, REASON_ATTACHED, VA_NODE_ID_ANNOTATION};
use crate::metrics::ATTACH;
use crate::volume::CsiVolume;

impl Ctx {
    pub(super) async fn attach(&self, va: VolumeAttachment) -> Result<(), ReconcileError> {
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
            Err(e) => return self.failed(&va, Op::Attach, e).await,
        };
        if let Some(pv) = &pv_name {
            if let Err(e) = self.add_pv_finalizer(pv).await {
                return self.failed(&va, Op::Attach, e).await;
            }
        }
        let node_id = match self.node_id(&node).await {
            Ok(id) => id,
            Err(e) => return self.failed(&va, Op::Attach, e).await,
        };
        let Some(va) = self.claim(va, &name, &node_id).await? else {
            return Ok(());
        };
        let caps = self.caps();
        if !caps.publish_unpublish {
            return self.mark_attached_without_publish(&va, &node).await;
        }
        if !(self.may_act)() {
            return Err(ReconcileError::NotActive);
        }
        if vol.wants_secrets {
            tracing::warn!(va = %name, "controllerPublishSecretRef is set but secrets are not supported; publishing without them");
        }
        self.publish(&va, &node, node_id, vol).await
    }

    /// Our finalizer and the node ID annotation on the VolumeAttachment, unless both
    /// are there. None when the object is gone or its deletion started meanwhile (its
    /// watch event queues the detach).
    async fn claim(
        &self,
        va: VolumeAttachment,
        name: &str,
        node_id: &str,
    ) -> Result<Option<VolumeAttachment>, ReconcileError> {
        let annotated = va
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(VA_NODE_ID_ANNOTATION))
            .is_some_and(|id| id == node_id);
        if has_finalizer(&va.metadata, &self.finalizer) && annotated {
            return Ok(Some(va));
        }
        let patch = MetadataPatch::new()
            .add_finalizer(&self.finalizer)
            .set_annotation(VA_NODE_ID_ANNOTATION, node_id);
        match self.vas.patch_metadata(name, &patch).await {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) if e.is_invalid() => Ok(None),
            Err(e) => Err(ReconcileError::kube(
                format!("adding the finalizer to VolumeAttachment {name}"),
                e,
            )),
        }
    }

    async fn mark_attached_without_publish(
        &self,
        va: &VolumeAttachment,
        node: &str,
    ) -> Result<(), ReconcileError> {
        self.set_status(va, |s| {
            s.attached = true;
            s.attach_error = None;
        })
        .await?;
        self.event(
            va,
            EventType::Normal,
            REASON_ATTACHED,
            format!("marked attached to node {node}: the plugin has no ControllerPublishVolume"),
        );
        Ok(())
    }

    /// `ControllerPublishVolume`, then the status with the publish context; a failure
    /// is recorded on the object and retried.
    async fn publish(
        &self,
        va: &VolumeAttachment,
        node: &str,
        node_id: String,
        vol: CsiVolume,
    ) -> Result<(), ReconcileError> {
        let name = va.metadata.name.as_deref().unwrap_or_default();
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
                self.set_status(va, |s| {
                    s.attached = true;
                    s.attachment_metadata = (!meta.is_empty()).then(|| meta.clone());
                    s.attach_error = None;
                })
                .await?;
                tracing::info!(va = %name, volume = %vol.handle, node = %node, node_id = %node_id, ms = took.as_secs_f64() * 1e3, "attached");
                self.event(
                    va,
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
                let e = ReconcileError::Publish {
                    handle: vol.handle,
                    node_id,
                    status: s,
                };
                self.failed(va, Op::Attach, e).await
            }
        }
    }
}
