//! Deleting the VolumeAttachments of safe-detach drivers on a quarantined node that no
//! pod left on it uses: the attacher then detaches them with `fence = true`. And telling
//! the attach-detach controller so (see [`Runner::release_volumes_in_use`]).

use std::collections::HashSet;

use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, PersistentVolume};
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::{DeleteOptions, MetadataPatch};
use serde_json::json;

use super::{PassSummary, Runner};
use crate::annotations::FENCES_DONE;
use crate::Result;

/// How the kubelet names a CSI volume in `status.volumesInUse`:
/// `kubernetes.io/csi/<driver>^<volume handle>`.
const CSI_VOLUME_PREFIX: &str = "kubernetes.io/csi/";

impl Runner {
    /// Also retries the deletions of earlier passes. A deletion makes the fences pending
    /// again, so `fences-done` goes.
    pub(super) async fn detach_unused(
        &mut self,
        node: &str,
        keep_pvs: &HashSet<String>,
        s: &mut PassSummary,
    ) -> Result<()> {
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
            self.release_volumes_in_use(node, keep_pvs).await?;
        }
        Ok(())
    }

    /// The attach-detach controller keeps its own view of what is attached. It detaches a
    /// volume whose pod is gone only once the node stops listing it in
    /// `status.volumesInUse` (or after 6 minutes, or under the out-of-service taint), and a
    /// VolumeAttachment deleted behind its back leaves it believing the volume attached
    /// until its next verification (a minute): the replacement pod meanwhile gets
    /// "Multi-Attach error". A dead node's kubelet never updates that list, so podgc takes
    /// out the entries of safe-detach volumes that no pod left on the quarantined node
    /// uses. The controller then detaches them itself, through the VolumeAttachment, which
    /// the attacher fences. Other drivers' entries are never touched. A kubelet that comes
    /// back writes its own list again.
    async fn release_volumes_in_use(
        &mut self,
        node: &str,
        keep_pvs: &HashSet<String>,
    ) -> Result<()> {
        let nodes = self.cluster.api::<Node>(None);
        let n = nodes.get(node).await?;
        let in_use = n
            .status
            .as_ref()
            .and_then(|s| s.volumes_in_use.clone())
            .unwrap_or_default();
        if !in_use.iter().any(|v| self.safe_detach_volume(v)) {
            return Ok(());
        }
        let mut kept = HashSet::new();
        for pv in keep_pvs {
            let csi = self
                .cluster
                .api::<PersistentVolume>(None)
                .get_opt(pv)
                .await?
                .and_then(|p| p.spec)
                .and_then(|s| s.csi);
            if let Some(csi) = csi {
                kept.insert(format!(
                    "{CSI_VOLUME_PREFIX}{}^{}",
                    csi.driver, csi.volume_handle
                ));
            }
        }
        let (release, keep): (Vec<String>, Vec<String>) = in_use
            .into_iter()
            .partition(|v| self.safe_detach_volume(v) && !kept.contains(v));
        if release.is_empty() {
            return Ok(());
        }
        let patch = json!({
            "metadata": { "resourceVersion": n.metadata.resource_version },
            "status": { "volumesInUse": if keep.is_empty() { None } else { Some(keep) } },
        });
        match nodes.patch_status_merge(node, &patch).await {
            Ok(_) => {
                tracing::info!(node, volumes = ?release, "taken out of the node's volumesInUse: the attach-detach controller detaches them now (fenced by the attacher)");
                Ok(())
            }
            Err(e) if e.is_conflict() => {
                tracing::debug!(node, "node changed; volumesInUse released next pass");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Is `unique_name` (a `volumesInUse` entry) a CSI volume of a safe-detach driver?
    fn safe_detach_volume(&self, unique_name: &str) -> bool {
        unique_name
            .strip_prefix(CSI_VOLUME_PREFIX)
            .and_then(|r| r.split_once('^'))
            .is_some_and(|(driver, _)| self.caches.drivers.get(driver).copied().unwrap_or(false))
    }
}
