//! The detach half (deletionTimestamp set): `ControllerUnpublishVolume`, with or
//! without a fence, then the VolumeAttachment's finalizer and, once nothing references
//! it, the PV's.

use std::time::Instant;

use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::{EventType, MetadataPatch};
use fencecsi_proto::v1::ControllerUnpublishVolumeRequest;
use tonic::Code;

use super::failure::Op;
use super::{
    has_finalizer, Ctx, ReconcileError, REASON_DETACHED, REASON_FENCED, VA_NODE_ID_ANNOTATION,
};
use crate::metrics::DETACH;

impl Ctx {
    pub(super) async fn detach(&self, va: VolumeAttachment) -> Result<(), ReconcileError> {
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
                Err(e) => return self.failed(&va, Op::Detach, e).await,
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
                    Err(e) => return self.failed(&va, Op::Detach, e).await,
                },
            };
            let (fence, why) = match self.fence_decision(&node, &vol.handle, caps).await {
                Ok(d) => d,
                Err(e) => return self.failed(&va, Op::Detach, e).await,
            };
            if !(self.may_act)() {
                return Err(ReconcileError::NotActive);
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
                    let e = ReconcileError::Unpublish {
                        handle: vol.handle,
                        node_id,
                        fence,
                        status: s,
                    };
                    return self.failed(&va, Op::Detach, e).await;
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
                return Err(ReconcileError::kube(
                    format!("removing the finalizer of VolumeAttachment {name}"),
                    e,
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
}
