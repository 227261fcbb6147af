//! Sorting the pods of a down node by the verdicts of [`Resolver`]: the terminating pods
//! podgc may force-delete, those it leaves alone, and the volumes that must stay attached
//! because a pod left on the node still uses them.

use std::collections::{HashMap, HashSet};

use fencecsi_cluster::k8s_openapi::api::core::v1::Pod;
use fencecsi_cluster::Cluster;

use crate::volumes::{DeleteReason, Resolver, SkipReason};

/// The pods of one node, sorted.
pub(super) struct NodePods {
    /// Terminating pods podgc may force-delete, why, and their PersistentVolumes.
    pub(super) selected: Vec<(Pod, DeleteReason, Vec<String>)>,
    /// Terminating pods left alone, why, and the detail for the Warning.
    pub(super) skipped: Vec<(Pod, SkipReason, String)>,
    /// PersistentVolumes of the pods that stay (running or skipped): their
    /// VolumeAttachments are not deleted.
    pub(super) keep_pvs: HashSet<String>,
    /// Running pods whose every volume can be detached safely (fenced).
    pub(super) safe_running: usize,
}

/// Classifies `pods` (all on one node). `drivers` is the CSIDriver cache: name -> carries
/// safe-detach.
pub(super) async fn classify_pods(
    cluster: &Cluster,
    drivers: &HashMap<String, bool>,
    pods: &[Pod],
) -> anyhow::Result<NodePods> {
    let mut selected = Vec::new();
    let mut keep_pvs: HashSet<String> = HashSet::new();
    let mut skipped = Vec::new();
    let mut safe_running = 0usize;
    let mut resolver = Resolver::new(cluster, drivers);
    for pod in pods {
        let c = resolver.classify(pod).await?;
        if pod.metadata.deletion_timestamp.is_none() {
            if c.verdict.is_ok() && !c.pvs.is_empty() {
                safe_running += 1;
            }
            keep_pvs.extend(c.pvs);
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
    })
}
