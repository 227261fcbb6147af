//! What kube-controller-manager does on a node that carries the out-of-service taint,
//! reduced to the two effects podgc must reason about (the taint manager's eviction is in
//! [`super::TaintEviction`]):
//!
//! - [`OutOfServicePodGc`], upstream PodGC's `gcTerminating`: every terminating pod on a
//!   NotReady node with the taint is marked `Failed` and force-deleted, whatever its
//!   volumes are.
//! - [`OutOfServiceDetach`], the attach-detach controller's force detach: a
//!   VolumeAttachment on such a node whose volume no pod on the node uses any more is
//!   deleted at once, without waiting for the node to report it unmounted and whatever
//!   the driver. With a CSI driver that cannot fence, that is two writers.
//!
//! Both are plain `reconcile()` rounds, so tests can step them deterministically.

use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod, PodCondition};
use k8s_openapi::api::storage::v1::VolumeAttachment;

use super::{ready_condition, time_now};
use crate::error::Result;
use crate::params::{DeleteOptions, ListParams};
use crate::well_known::{DISRUPTION_TARGET_CONDITION, OUT_OF_SERVICE_TAINT_KEY};
use crate::Cluster;

/// Reason upstream PodGC gives its DisruptionTarget condition.
const DELETION_BY_POD_GC: &str = "DeletionByPodGC";

/// Names of NotReady nodes carrying the out-of-service taint.
async fn out_of_service_nodes(cluster: &Cluster) -> Result<Vec<String>> {
    Ok(cluster
        .api::<Node>(None)
        .list_filtered(&ListParams::default(), |n| {
            let tainted = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|ts| ts.iter().any(|t| t.key == OUT_OF_SERVICE_TAINT_KEY));
            let ready = ready_condition(n).is_some_and(|c| c.status == "True");
            tainted && !ready
        })
        .await?
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect())
}

/// Upstream PodGC's handling of terminating pods on out-of-service nodes.
#[derive(Debug, Clone)]
pub struct OutOfServicePodGc {
    cluster: Cluster,
}

impl OutOfServicePodGc {
    pub fn new(cluster: &Cluster) -> Self {
        OutOfServicePodGc {
            cluster: cluster.clone(),
        }
    }

    /// One round; returns the pods it force-deleted (`namespace/name`).
    pub async fn reconcile(&self) -> Result<Vec<String>> {
        let mut deleted = Vec::new();
        for node in out_of_service_nodes(&self.cluster).await? {
            let pods = self
                .cluster
                .api::<Pod>(None)
                .list_filtered(
                    &ListParams::default().fields(&format!("spec.nodeName={node}")),
                    |p| p.metadata.deletion_timestamp.is_some(),
                )
                .await?;
            for pod in pods {
                let ns = pod.metadata.namespace.clone().unwrap_or_default();
                let name = pod.metadata.name.clone().unwrap_or_default();
                let uid = pod.metadata.uid.clone().unwrap_or_default();
                let api = self.cluster.api::<Pod>(Some(&ns));
                let mut p = pod.clone();
                let st = p.status.get_or_insert_with(Default::default);
                if !matches!(st.phase.as_deref(), Some("Failed" | "Succeeded")) {
                    st.phase = Some("Failed".into());
                }
                let conds = st.conditions.get_or_insert_with(Vec::new);
                if !conds.iter().any(|c| c.type_ == DISRUPTION_TARGET_CONDITION) {
                    conds.push(PodCondition {
                        type_: DISRUPTION_TARGET_CONDITION.into(),
                        status: "True".into(),
                        reason: Some(DELETION_BY_POD_GC.into()),
                        message: Some("PodGC: node is out of service".into()),
                        last_transition_time: Some(time_now()),
                        ..Default::default()
                    });
                }
                match api.replace_status(&p).await {
                    Ok(_) => {}
                    Err(e) if e.is_conflict() || e.is_not_found() => continue,
                    Err(e) => return Err(e),
                }
                match api
                    .delete(&name, &DeleteOptions::force().with_uid(&uid))
                    .await
                {
                    Ok(_) => deleted.push(format!("{ns}/{name}")),
                    Err(e) if e.is_conflict() || e.is_not_found() => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(deleted)
    }
}

/// The attach-detach controller's force detach on out-of-service nodes.
#[derive(Debug, Clone)]
pub struct OutOfServiceDetach {
    cluster: Cluster,
}

impl OutOfServiceDetach {
    pub fn new(cluster: &Cluster) -> Self {
        OutOfServiceDetach {
            cluster: cluster.clone(),
        }
    }

    /// One round; returns the VolumeAttachments it deleted.
    pub async fn reconcile(&self) -> Result<Vec<String>> {
        let mut detached = Vec::new();
        for node in out_of_service_nodes(&self.cluster).await? {
            let pods = self
                .cluster
                .api::<Pod>(None)
                .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
                .await?
                .items;
            let mut in_use = std::collections::HashSet::new();
            for p in &pods {
                let ns = p.metadata.namespace.clone().unwrap_or_default();
                let claims = p
                    .spec
                    .iter()
                    .flat_map(|s| s.volumes.iter().flatten())
                    .filter_map(|v| v.persistent_volume_claim.as_ref());
                for c in claims {
                    let pvc = self
                        .cluster
                        .api::<PersistentVolumeClaim>(Some(&ns))
                        .get_opt(&c.claim_name)
                        .await?;
                    if let Some(pv) = pvc.and_then(|c| c.spec).and_then(|s| s.volume_name) {
                        in_use.insert(pv);
                    }
                }
            }
            let vas = self
                .cluster
                .api::<VolumeAttachment>(None)
                .list_filtered(&ListParams::default(), |va| {
                    va.spec.node_name == node && va.metadata.deletion_timestamp.is_none()
                })
                .await?;
            for va in vas {
                let pv = va.spec.source.persistent_volume_name.clone();
                if pv.as_ref().is_some_and(|pv| in_use.contains(pv)) {
                    continue;
                }
                let name = va.metadata.name.clone().unwrap_or_default();
                match self
                    .cluster
                    .api::<VolumeAttachment>(None)
                    .delete(&name, &DeleteOptions::default())
                    .await
                {
                    Ok(_) => detached.push(name),
                    Err(e) if e.is_not_found() => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(detached)
    }
}
