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
use crate::csi::Capabilities;
use crate::metrics::DETACH;

/// A volume unpublished from a node: with a fence or not, and why.
struct Detached {
    handle: String,
    fence: bool,
    why: String,
}

/// Why an unpublish did not happen: a failure recorded on the VolumeAttachment (and
/// retried), or this instance may not act any more.
enum Unpublish {
    Failed(ReconcileError),
    Stopped(ReconcileError),
}

impl Ctx {
    pub(super) async fn detach(&self, va: VolumeAttachment) -> Result<(), ReconcileError> {
        if !has_finalizer(&va.metadata, &self.finalizer) {
            return Ok(());
        }
        let name = va.metadata.name.clone().unwrap_or_default();
        let node = va.spec.node_name.clone();
        let pv_name = va.spec.source.persistent_volume_name.clone();
        let caps = self.caps();
        let detached = if caps.publish_unpublish {
            match self.unpublish(&va, &name, &node, caps).await {
                Ok(d) => Some(d),
                Err(Unpublish::Failed(e)) => return self.failed(&va, Op::Detach, e).await,
                Err(Unpublish::Stopped(e)) => return Err(e),
            }
        } else {
            None
        };
        self.let_go(&va, &name).await?;
        let msg = match &detached {
            Some(d) if d.fence => {
                format!("volume {} detached from node {node} with a fence", d.handle)
            }
            Some(d) => format!(
                "volume {} detached from node {node} without a fence ({})",
                d.handle, d.why
            ),
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

    /// `ControllerUnpublishVolume` for the attachment, fenced when the policy says so,
    /// to the node ID recorded at attach (else the node's CSINode's).
    async fn unpublish(
        &self,
        va: &VolumeAttachment,
        name: &str,
        node: &str,
        caps: Capabilities,
    ) -> Result<Detached, Unpublish> {
        let (_, vol) = self.volume_of(va).await.map_err(Unpublish::Failed)?;
        let recorded = va
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(VA_NODE_ID_ANNOTATION))
            .filter(|s| !s.is_empty())
            .cloned();
        let node_id = match recorded {
            Some(id) => id,
            None => self.node_id(node).await.map_err(Unpublish::Failed)?,
        };
        let (fence, why) = self
            .fence_decision(node, &vol.handle, caps)
            .await
            .map_err(Unpublish::Failed)?;
        if !(self.may_act)() {
            return Err(Unpublish::Stopped(ReconcileError::NotActive));
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
                return Err(Unpublish::Failed(ReconcileError::Unpublish {
                    handle: vol.handle,
                    node_id,
                    fence,
                    status: s,
                }));
            }
        }
        let took = start.elapsed();
        self.metrics.operation(DETACH, true, took);
        if fence {
            self.metrics.fence(true);
            tracing::warn!(va = %name, volume = %vol.handle, node = %node, reason = %why, "node fenced from the volume");
            self.event(
                va,
                EventType::Warning,
                REASON_FENCED,
                format!("node {node} fenced from volume {}: {why}", vol.handle),
            );
        }
        tracing::info!(va = %name, volume = %vol.handle, node = %node, fence, reason = %why, ms = took.as_secs_f64() * 1e3, "detached");
        Ok(Detached {
            handle: vol.handle,
            fence,
            why,
        })
    }

    /// Lets the object go: the finalizer off. With other finalizers it stays, so its
    /// status says it is detached.
    async fn let_go(&self, va: &VolumeAttachment, name: &str) -> Result<(), ReconcileError> {
        let others = va
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|fs| fs.iter().any(|f| *f != self.finalizer));
        if others {
            self.set_status(va, |s| {
                s.attached = false;
                s.attachment_metadata = None;
                s.detach_error = None;
            })
            .await?;
        }
        match self
            .vas
            .patch_metadata(
                name,
                &MetadataPatch::new().remove_finalizer(&self.finalizer),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(ReconcileError::kube(
                format!("removing the finalizer of VolumeAttachment {name}"),
                e,
            )),
        }
    }
}
