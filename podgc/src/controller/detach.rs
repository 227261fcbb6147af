//! Deleting the VolumeAttachments of safe-detach drivers on a quarantined node that no
//! pod left on it uses: the attacher then detaches them with `fence = true`.

use std::collections::HashSet;

use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::{DeleteOptions, MetadataPatch};

use super::{PassSummary, Runner};
use crate::annotations::FENCES_DONE;

impl Runner {
    /// Also retries the deletions of earlier passes. A deletion makes the fences pending
    /// again, so `fences-done` goes.
    pub(super) async fn detach_unused(
        &mut self,
        node: &str,
        keep_pvs: &HashSet<String>,
        s: &mut PassSummary,
    ) -> anyhow::Result<()> {
        if self.caches.nodes.get(node).is_some_and(|i| i.quarantined) {
            let names: Vec<String> = self
                .caches
                .vas_by_node
                .get(node)
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default();
            let mut deleted_any = false;
            for va_name in names {
                let Some(va) = self.caches.vas.get(&va_name).cloned() else {
                    continue;
                };
                if va.deleting
                    || !self
                        .caches
                        .drivers
                        .get(&va.attacher)
                        .copied()
                        .unwrap_or(false)
                {
                    continue;
                }
                let Some(pv) = va.pv.as_ref() else { continue };
                if keep_pvs.contains(pv) {
                    continue;
                }
                match self
                    .cluster
                    .api::<VolumeAttachment>(None)
                    .delete(&va_name, &DeleteOptions::default())
                    .await
                {
                    Ok(_) | Err(fencecsi_cluster::Error::NotFound(_)) => {
                        tracing::info!(node, volume_attachment = %va_name, pv = %pv, "VolumeAttachment deleted: the attacher detaches with a fence");
                        self.metrics.volume_attachments_deleted.inc();
                        if let Some(v) = self.caches.vas.get_mut(&va_name) {
                            v.deleting = true;
                        }
                        s.volume_attachments_deleted.push(va_name);
                        deleted_any = true;
                    }
                    Err(e) => {
                        tracing::warn!(node, volume_attachment = %va_name, error = %e, "deleting VolumeAttachment failed; retried next pass")
                    }
                }
            }
            if deleted_any && self.caches.nodes.get(node).is_some_and(|i| i.fences_done) {
                self.patch_node(node, MetadataPatch::new().remove_annotation(FENCES_DONE))
                    .await?;
            }
        }
        Ok(())
    }
}
