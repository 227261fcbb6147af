//! Writes to Nodes: the quarantine (taints and `fencecsi.io/quarantined-at` in one write),
//! and the annotation patches of the fence bookkeeping. Each write refreshes the node's
//! cache entry from the object the API server returned, so the rest of the pass sees it.

use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, Taint};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::well_known::{
    OUT_OF_SERVICE_TAINT_KEY, OUT_OF_SERVICE_TAINT_VALUE, QUARANTINED_AT_ANNOTATION,
    QUARANTINE_TAINT_KEY, QUARANTINE_TAINT_VALUE,
};
use fencecsi_cluster::{EventType, MetadataPatch};
use serde_json::{json, Map, Value};

use super::caches::{taints, NodeInfo};
use super::{now, Runner};
use crate::annotations::{FENCES_DONE, OUT_OF_SERVICE_ADDED};
use crate::{Error, Result};

/// A merge patch that writes `n`'s taints and annotations (those in `removed` become
/// `null`), conditional on the resourceVersion `n` was read at. Nodes are patched, never
/// replaced: the kubelet and other controllers write other fields of the same object.
pub(super) fn node_patch(n: &Node, removed: &[&str]) -> Value {
    let mut ann: Map<String, Value> = n
        .metadata
        .annotations
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), json!(v)))
        .collect();
    for k in removed {
        ann.entry(k.to_string()).or_insert(Value::Null);
    }
    let taints = n.spec.as_ref().and_then(|s| s.taints.as_ref());
    json!({
        "metadata": {
            "resourceVersion": n.metadata.resource_version,
            "annotations": ann,
        },
        "spec": { "taints": taints },
    })
}

impl Runner {
    pub(super) async fn patch_node(&mut self, node: &str, patch: MetadataPatch) -> Result<()> {
        let n = self
            .cluster
            .api::<Node>(None)
            .patch_metadata(node, &patch)
            .await?;
        let info = NodeInfo::of(&n, self.caches.nodes.get(node));
        self.caches.nodes.insert(node.to_string(), info);
        Ok(())
    }

    /// Taints and annotates the node (one write), with the out-of-service taint too when
    /// `oos`. Returns whether it was not quarantined yet.
    pub(super) async fn ensure_quarantine(
        &mut self,
        node: &str,
        why: &str,
        oos: bool,
    ) -> Result<bool> {
        let nodes = self.cluster.api::<Node>(None);
        for _ in 0..5 {
            let mut n = nodes.get(node).await?;
            let has = |n: &Node, k: &str| taints(n).iter().any(|t| t.key == k);
            let annotated = n
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(QUARANTINED_AT_ANNOTATION));
            let want_oos = oos && !has(&n, OUT_OF_SERVICE_TAINT_KEY);
            if has(&n, QUARANTINE_TAINT_KEY) && annotated && !want_oos {
                let info = NodeInfo::of(&n, self.caches.nodes.get(node));
                self.caches.nodes.insert(node.to_string(), info);
                return Ok(false);
            }
            let stamp = Some(Time(
                Timestamp::from_second(now().as_second()).unwrap_or_else(|_| now()),
            ));
            let spec = n.spec.get_or_insert_with(Default::default);
            let list = spec.taints.get_or_insert_with(Vec::new);
            if !list.iter().any(|t| t.key == QUARANTINE_TAINT_KEY) {
                list.push(Taint {
                    key: QUARANTINE_TAINT_KEY.into(),
                    value: Some(QUARANTINE_TAINT_VALUE.into()),
                    effect: "NoSchedule".into(),
                    time_added: stamp.clone(),
                });
            }
            let ann = n.metadata.annotations.get_or_insert_with(Default::default);
            if want_oos {
                list.push(Taint {
                    key: OUT_OF_SERVICE_TAINT_KEY.into(),
                    value: Some(OUT_OF_SERVICE_TAINT_VALUE.into()),
                    effect: "NoExecute".into(),
                    time_added: stamp,
                });
                ann.insert(OUT_OF_SERVICE_ADDED.into(), "true".into());
            }
            ann.entry(QUARANTINED_AT_ANNOTATION.into())
                .or_insert_with(|| now().to_string());
            ann.remove(FENCES_DONE);
            match nodes
                .patch_merge(node, &node_patch(&n, &[FENCES_DONE]))
                .await
            {
                Ok(written) => {
                    let info = NodeInfo::of(&written, self.caches.nodes.get(node));
                    self.caches.nodes.insert(node.to_string(), info);
                    self.metrics.quarantines.inc();
                    let msg = format!("{why}: podgc quarantined the node ({QUARANTINE_TAINT_KEY}:NoSchedule{}) before force-deleting its terminating pods; the quarantine is lifted once the node is Ready again and its node plugin reports it released every fenced volume",
                        if want_oos { format!(", {OUT_OF_SERVICE_TAINT_KEY}:NoExecute") } else { String::new() });
                    tracing::warn!(node, "{msg}");
                    self.event(
                        Self::node_ref(node),
                        EventType::Warning,
                        "NodeQuarantined",
                        &msg,
                    )
                    .await;
                    return Ok(true);
                }
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(Error::NodeKeptChanging {
            node: node.to_string(),
        })
    }
}
