//! Checking attachments against the plugin: a VolumeAttachment that says attached while
//! the plugin no longer lists its volume as published to that node (its controller state
//! was restored from a backup, say, or someone unpublished it out of band) is marked not
//! attached, so the attach path publishes it again or reports why it cannot. The kubelet
//! waits on `attached`, so a node is never told a volume is there when the plugin says
//! otherwise.

use std::collections::HashSet;

use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeError;
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
            let name = va.metadata.name.clone().unwrap_or_default();
            let Some(node_id) = va
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(VA_NODE_ID_ANNOTATION))
            else {
                continue;
            };
            let handle = match self.volume_of(&va).await {
                Ok((_, v)) => v.handle,
                Err(e) => {
                    tracing::debug!(volume_attachment = %name, error = %e, "not checked");
                    continue;
                }
            };
            let empty = HashSet::new();
            let nodes = listed.get(&handle).unwrap_or(&empty);
            if nodes.contains(node_id) {
                continue;
            }
            // Re-read: a detach may have started, or a re-attach finished, meanwhile.
            let cur = match self.vas.get_opt(&name).await {
                Ok(Some(v)) => v,
                _ => continue,
            };
            if cur.metadata.deletion_timestamp.is_some()
                || cur.status.as_ref().is_none_or(|s| !s.attached)
                || cur.metadata.resource_version != va.metadata.resource_version
            {
                continue;
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
                continue;
            }
            self.event(&cur, EventType::Warning, REASON_ATTACHMENT_LOST, msg);
            lost.push(name);
        }
        lost
    }
}
