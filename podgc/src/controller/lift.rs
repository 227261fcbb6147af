//! Lifting a quarantine, and the re-stamp of `fencecsi.io/quarantined-at` when the node's
//! last VolumeAttachment of a safe-detach driver goes (see the module root for why). The
//! lift needs the node Ready, no such VolumeAttachment, and a clean report newer than the
//! re-stamp.

use fencecsi_cluster::k8s_openapi::api::core::v1::Node;
use fencecsi_cluster::well_known::{
    OUT_OF_SERVICE_TAINT_KEY, QUARANTINED_AT_ANNOTATION, QUARANTINE_TAINT_KEY,
};
use fencecsi_cluster::{EventType, MetadataPatch};

use super::caches::{NodeInfo, Readiness};
use super::quarantine::node_patch;
use super::{now, Runner};
use crate::annotations::{FENCES_DONE, OUT_OF_SERVICE_ADDED};

impl Runner {
    /// Re-stamps after the fences, lifts the quarantine when everything says so.
    pub(super) async fn maybe_lift(&mut self, node: &str, unhealthy: bool) -> anyhow::Result<bool> {
        let Some(info) = self.caches.nodes.get(node).cloned() else {
            return Ok(false);
        };
        let vas = self.caches.safe_vas_on(node);
        if vas == 0 && !info.fences_done {
            // The fences are done now: only a clean report from after this moment counts.
            self.patch_node(
                node,
                MetadataPatch::new()
                    .set_annotation(QUARANTINED_AT_ANNOTATION, &now().to_string())
                    .set_annotation(FENCES_DONE, "true"),
            )
            .await?;
            tracing::info!(node, "no VolumeAttachment of a safe-detach driver left on the node: fences done; waiting for a clean report");
            return Ok(false);
        }
        if vas > 0 && info.fences_done {
            self.patch_node(node, MetadataPatch::new().remove_annotation(FENCES_DONE))
                .await?;
            return Ok(false);
        }
        if unhealthy || info.ready != Readiness::True || vas > 0 {
            return Ok(false);
        }
        let (Some(qa), Some(clean)) = (info.quarantined_at, info.clean_at) else {
            return Ok(false);
        };
        if clean <= qa {
            return Ok(false);
        }
        let nodes = self.cluster.api::<Node>(None);
        for _ in 0..5 {
            let mut n = nodes.get(node).await?;
            let owned_oos = n
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(OUT_OF_SERVICE_ADDED));
            if let Some(spec) = n.spec.as_mut() {
                if let Some(list) = spec.taints.as_mut() {
                    list.retain(|t| {
                        t.key != QUARANTINE_TAINT_KEY
                            && !(owned_oos && t.key == OUT_OF_SERVICE_TAINT_KEY)
                    });
                    if list.is_empty() {
                        spec.taints = None;
                    }
                }
            }
            let ours = [QUARANTINED_AT_ANNOTATION, OUT_OF_SERVICE_ADDED, FENCES_DONE];
            if let Some(a) = n.metadata.annotations.as_mut() {
                for k in ours {
                    a.remove(k);
                }
            }
            match nodes.patch_merge(node, &node_patch(&n, &ours)).await {
                Ok(written) => {
                    let info = NodeInfo::of(&written, self.caches.nodes.get(node));
                    self.caches.nodes.insert(node.to_string(), info);
                    self.metrics.quarantines_lifted.inc();
                    let msg = format!("node {node} is Ready, no VolumeAttachment of a safe-detach driver names it, and its node plugin reported it clean at {clean} (after {qa}): quarantine lifted");
                    tracing::info!(node, "{msg}");
                    self.event(
                        Self::node_ref(node),
                        EventType::Normal,
                        "QuarantineLifted",
                        &msg,
                    )
                    .await;
                    return Ok(true);
                }
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        tracing::warn!(
            node,
            "the node changed under every attempt to lift its quarantine; retried next pass"
        );
        Ok(false)
    }
}
