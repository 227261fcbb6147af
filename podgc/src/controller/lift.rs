//! Lifting a quarantine, and the re-stamp of `fencecsi.io/quarantined-at` when the node's
//! last VolumeAttachment of a safe-detach driver goes (see the module root for why). The
//! lift needs the node Ready, no such VolumeAttachment, and a clean report newer than the
//! re-stamp.
//!
//! The caches only say when to look: they are fed by watches, and a watch can be behind
//! (it backs off after an API server restart) or dead without a sign (a network cut). A
//! lift is decided on the Node and the VolumeAttachments read from the API server right
//! before it, as a stale-looking Lease is read again before podgc acts on a node
//! (`Runner::still_stale`). When those reads disagree with the cache, nothing is
//! lifted this pass, and the cache takes what was read.

use std::collections::HashSet;

use fencecsi_cluster::k8s_openapi::api::core::v1::Node;
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::well_known::{
    OUT_OF_SERVICE_TAINT_KEY, QUARANTINED_AT_ANNOTATION, QUARANTINE_TAINT_KEY,
};
use fencecsi_cluster::{EventType, ListParams, MetadataPatch};

use super::caches::NodeInfo;
use super::quarantine::node_patch;
use super::{now, Runner};
use crate::annotations::{FENCES_DONE, OUT_OF_SERVICE_ADDED};
use crate::Result;

impl Runner {
    /// Re-stamps after the fences, lifts the quarantine when everything says so.
    pub(super) async fn maybe_lift(&mut self, node: &str, unhealthy: bool) -> Result<bool> {
        let Some(info) = self.caches.nodes.get(node).cloned() else {
            return Ok(false);
        };
        let vas = self.caches.safe_vas_on(node);
        if self.sync_fences_done(node, &info, vas).await? {
            return Ok(false);
        }
        if unhealthy || vas > 0 || info.liftable().is_err() {
            return Ok(false);
        }
        // The cache says lift; the API server decides. The Node is read again on every
        // attempt, and the write below is conditional on the resourceVersion read, so the
        // lift is decided on the very Node it changes.
        let nodes = self.cluster.api::<Node>(None);
        let mut attachments_checked = false;
        for _ in 0..5 {
            let mut n = nodes.get(node).await?;
            let fresh = NodeInfo::of(&n, self.caches.nodes.get(node));
            let (qa, clean) = match fresh.liftable() {
                Ok(t) => t,
                Err(why) => {
                    tracing::warn!(
                        node,
                        api_server = %why,
                        cached = ?info,
                        "podgc's Node watch said the quarantine could be lifted, but the Node read just now disagrees (the watch is behind, or the Node just changed): not lifting it this pass"
                    );
                    self.caches.nodes.insert(node.to_string(), fresh);
                    return Ok(false);
                }
            };
            if !attachments_checked {
                if self.attachments_the_watch_missed(node).await? {
                    return Ok(false);
                }
                attachments_checked = true;
            }
            let ours = strip_quarantine(&mut n);
            match nodes.patch_merge(node, &node_patch(&n, &ours)).await {
                Ok(written) => {
                    self.report_lift(node, &written, &qa, &clean).await;
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

    /// Keeps `fencecsi.io/fences-done` true exactly while no VolumeAttachment of a
    /// safe-detach driver names the node: re-stamps quarantined-at when it becomes true
    /// (only a clean report from after that counts), clears it when one appears again.
    /// Whether it wrote (nothing more this pass then).
    async fn sync_fences_done(&mut self, node: &str, info: &NodeInfo, vas: usize) -> Result<bool> {
        if vas == 0 && !info.fences_done {
            self.patch_node(
                node,
                MetadataPatch::new()
                    .set_annotation(QUARANTINED_AT_ANNOTATION, &now().to_string())
                    .set_annotation(FENCES_DONE, "true"),
            )
            .await?;
            tracing::info!(node, "no VolumeAttachment of a safe-detach driver left on the node: fences done; waiting for a clean report");
            return Ok(true);
        }
        if vas > 0 && info.fences_done {
            self.patch_node(node, MetadataPatch::new().remove_annotation(FENCES_DONE))
                .await?;
            return Ok(true);
        }
        Ok(false)
    }

    /// The VolumeAttachments are read again too. Their cache is no more authoritative
    /// than the Node's: the same API server restart or network cut holds up every watch.
    /// It errs one way only: a VolumeAttachment it still holds keeps the quarantine until
    /// the watch delivers its deletion, so a VolumeAttachment that was there when the
    /// fences were marked done cannot be missed. But one created while the watch was
    /// behind (for a pod that tolerates the quarantine taint, say) would be, and it calls
    /// for new fences and a new clean report (fences-done cleared, as when the watch
    /// delivers it). One list, paged, of all VolumeAttachments (the API server has no
    /// field selector on spec.nodeName), made only for a lift about to happen: about once
    /// per node that comes back. Which drivers declare safe detach stays the cache's: a
    /// CSIDriver's annotation changes only when the driver is installed or reconfigured.
    /// Whether there were such attachments (the cache takes them).
    async fn attachments_the_watch_missed(&mut self, node: &str) -> Result<bool> {
        let missed = self.safe_attachments_listed_on(node).await?;
        if missed.is_empty() {
            return Ok(false);
        }
        let names: Vec<&str> = missed
            .iter()
            .filter_map(|va| va.metadata.name.as_deref())
            .collect();
        tracing::warn!(
            node,
            volume_attachments = ?names,
            "VolumeAttachments of a safe-detach driver name the node that podgc's watch has not delivered (yet): not lifting its quarantine this pass"
        );
        for va in &missed {
            self.caches.note_va(va);
        }
        Ok(true)
    }

    async fn report_lift(
        &mut self,
        node: &str,
        written: &Node,
        qa: &impl std::fmt::Display,
        clean: &impl std::fmt::Display,
    ) {
        let info = NodeInfo::of(written, self.caches.nodes.get(node));
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
    }

    /// The VolumeAttachments of safe-detach drivers naming `node`, as the API server has
    /// them now.
    async fn safe_attachments_listed_on(&self, node: &str) -> Result<Vec<VolumeAttachment>> {
        let safe: HashSet<String> = self
            .caches
            .drivers
            .iter()
            .filter(|(_, safe)| **safe)
            .map(|(d, _)| d.clone())
            .collect();
        let node = node.to_string();
        Ok(self
            .cluster
            .api::<VolumeAttachment>(None)
            .list_filtered(&ListParams::default(), move |va| {
                va.spec.node_name == node && safe.contains(&va.spec.attacher)
            })
            .await?)
    }
}

/// Takes podgc's quarantine off `n`: its taint, the out-of-service taint when podgc
/// added it, and podgc's annotations. Returns those annotation keys (the patch removes
/// them).
fn strip_quarantine(n: &mut Node) -> [&'static str; 3] {
    let owned_oos = n
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(OUT_OF_SERVICE_ADDED));
    if let Some(spec) = n.spec.as_mut() {
        if let Some(list) = spec.taints.as_mut() {
            list.retain(|t| {
                t.key != QUARANTINE_TAINT_KEY && !(owned_oos && t.key == OUT_OF_SERVICE_TAINT_KEY)
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
    ours
}
