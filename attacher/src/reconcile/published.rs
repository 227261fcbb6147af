//! Checking attachments against the plugin: a VolumeAttachment that says attached while
//! the plugin no longer lists its volume as published to that node (its controller state
//! was restored from a backup, say, or someone unpublished it out of band) is marked not
//! attached, so the attach path publishes it again or reports why it cannot. The kubelet
//! waits on `attached`, so a node is never told a volume is there when the plugin says
//! otherwise.

use std::collections::{HashMap, HashSet};

use fencecsi_cluster::k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeError};
use fencecsi_cluster::EventType;

use super::{has_finalizer, now, Ctx, REASON_ATTACHMENT_LOST, VA_NODE_ID_ANNOTATION};

impl Ctx {
    /// One check; returns the VolumeAttachments it marked not attached (the caller queues
    /// them). Only attachments that were already attached before the listing began are
    /// judged, so a publish that finishes during the listing is not mistaken for a loss.
    pub(crate) async fn check_published(&self) -> Vec<String> {
        if !self.caps().list_published
            || !(self.may_act)()
            || !self.listed.load(std::sync::atomic::Ordering::Acquire)
        {
            return Vec::new();
        }
        let attached: Vec<_> = self
            .cache
            .state()
            .into_iter()
            .filter(|va| {
                self.is_ours(va)
                    && va.metadata.deletion_timestamp.is_none()
                    && va.status.as_ref().is_some_and(|s| s.attached)
                    && has_finalizer(&va.metadata, &self.finalizer)
            })
            .collect();
        if attached.is_empty() {
            return Vec::new();
        }
        let listed = match self.csi.published_nodes().await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "ListVolumes failed: attachments not checked against the plugin this time");
                return Vec::new();
            }
        };
        let mut lost = Vec::new();
        for va in attached {
            if let Some(name) = self.mark_if_lost(&va, &listed).await {
                lost.push(name);
            }
        }
        lost
    }

    /// Marks `va` not attached when the plugin's listing does not have its volume published
    /// to its node and the object is still as it was listed; its name when marked.
    async fn mark_if_lost(
        &self,
        va: &VolumeAttachment,
        listed: &HashMap<String, HashSet<String>>,
    ) -> Option<String> {
        let name = va.metadata.name.clone().unwrap_or_default();
        let node_id = va
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(VA_NODE_ID_ANNOTATION))?;
        let handle = match self.volume_of(va).await {
            Ok((_, v)) => v.handle,
            Err(e) => {
                tracing::debug!(volume_attachment = %name, error = %e, "not checked");
                return None;
            }
        };
        if listed
            .get(&handle)
            .is_some_and(|nodes| nodes.contains(node_id))
        {
            return None;
        }
        // Re-read: a detach may have started, or a re-attach finished, meanwhile.
        let cur = match self.vas.get_opt(&name).await {
            Ok(Some(v)) => v,
            _ => return None,
        };
        if cur.metadata.deletion_timestamp.is_some()
            || cur.status.as_ref().is_none_or(|s| !s.attached)
            || cur.metadata.resource_version != va.metadata.resource_version
        {
            return None;
        }
        let msg = format!(
            "the plugin does not list volume {handle} as published to node {} (CSI node ID {node_id}): marked not attached, to publish it again",
            cur.spec.node_name
        );
        tracing::warn!(volume_attachment = %name, "{msg}");
        let written = self
            .set_status(&cur, |s| {
                s.attached = false;
                s.attachment_metadata = None;
                s.attach_error = Some(VolumeError {
                    message: Some(msg.clone()),
                    time: Some(now()),
                    ..Default::default()
                });
            })
            .await;
        if let Err(e) = written {
            tracing::warn!(volume_attachment = %name, error = %e, "marking the attachment lost failed; checked again at the next resync");
            return None;
        }
        self.event(&cur, EventType::Warning, REASON_ATTACHMENT_LOST, msg);
        Some(name)
    }
}
