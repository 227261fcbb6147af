//! Sorting the pods of a down node by the verdicts of [`Resolver`]: the terminating pods
//! podgc may force-delete, those it leaves alone, and the volumes that must stay attached
//! because a pod left on the node still uses them.

use std::collections::{HashMap, HashSet};

use fencecsi_cluster::k8s_openapi::api::core::v1::Pod;
use fencecsi_cluster::well_known::OUT_OF_SERVICE_TAINT_KEY;
use fencecsi_cluster::Cluster;

use crate::volumes::{DeleteReason, Resolver, SkipReason};
use crate::Result;

/// The pods of one node, sorted.
pub(super) struct NodePods {
    /// Terminating pods podgc may force-delete, why, and their PersistentVolumes.
    pub(super) selected: Vec<(Pod, DeleteReason, Vec<String>)>,
    /// Terminating pods left alone, why, and the detail for the Warning.
    pub(super) skipped: Vec<(Pod, SkipReason, String)>,
    /// PersistentVolumes of the pods that stay (running, except `safe_running`, or
    /// skipped): their VolumeAttachments are not deleted.
    pub(super) keep_pvs: HashSet<String>,
    /// Running pods with volumes, every one of which can be detached safely (fenced), that
    /// the out-of-service taint would evict; why, and their PersistentVolumes.
    pub(super) safe_running: Vec<(Pod, DeleteReason, Vec<String>)>,
    /// Pods (running or terminating) the out-of-service taint would put at risk: upstream
    /// PodGC force-deletes them and the attach-detach controller force-detaches their
    /// volumes, none of which is fenced. `namespace/name: why`.
    pub(super) at_risk: Vec<String>,
}

/// Does the pod tolerate the out-of-service taint (so that it would not be evicted)?
fn tolerates_out_of_service(pod: &Pod) -> bool {
    pod.spec
        .iter()
        .flat_map(|s| s.tolerations.iter().flatten())
        .any(|t| {
            let effect_ok = t
                .effect
                .as_deref()
                .is_none_or(|e| e.is_empty() || e == "NoExecute");
            let exists = t.operator.as_deref() == Some("Exists");
            let key_ok = match t.key.as_deref() {
                None | Some("") => exists,
                Some(k) => {
                    k == OUT_OF_SERVICE_TAINT_KEY
                        && (exists
                            || t.value.as_deref()
                                == Some(fencecsi_cluster::well_known::OUT_OF_SERVICE_TAINT_VALUE))
                }
            };
            effect_ok && key_ok
        })
}

/// Classifies `pods` (all on one node). `drivers` is the CSIDriver cache: name -> carries
/// safe-detach.
pub(super) async fn classify_pods(
    cluster: &Cluster,
    drivers: &HashMap<String, bool>,
    pods: &[Pod],
) -> Result<NodePods> {
    let mut selected = Vec::new();
    let mut keep_pvs: HashSet<String> = HashSet::new();
    let mut skipped = Vec::new();
    let mut safe_running = Vec::new();
    let mut at_risk = Vec::new();
    let mut resolver = Resolver::new(cluster, drivers);
    for pod in pods {
        let c = resolver.classify(pod).await?;
        if let Err((_, detail)) = &c.verdict {
            at_risk.push(format!(
                "{}/{}: {detail}",
                pod.metadata.namespace.as_deref().unwrap_or(""),
                pod.metadata.name.as_deref().unwrap_or("")
            ));
        }
        if pod.metadata.deletion_timestamp.is_none() {
            // The volumes of `safe_running` pods are kept or not by the caller, which
            // decides whether those pods go.
            match c.verdict {
                Ok(reason) if !c.pvs.is_empty() && !tolerates_out_of_service(pod) => {
                    safe_running.push((pod.clone(), reason, c.pvs))
                }
                _ => keep_pvs.extend(c.pvs),
            }
            continue;
        }
        match c.verdict {
            Ok(reason) => selected.push((pod.clone(), reason, c.pvs)),
            Err((reason, detail)) => {
                keep_pvs.extend(c.pvs);
                skipped.push((pod.clone(), reason, detail));
            }
        }
    }
    Ok(NodePods {
        selected,
        skipped,
        keep_pvs,
        safe_running,
        at_risk,
    })
}
