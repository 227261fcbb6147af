//! Upstream PodGC on a node that carries the out-of-service taint (`gcTerminating`):
//! every terminating pod on a NotReady node with the taint is marked `Failed` and
//! force-deleted, whatever its volumes are. The taint manager's eviction is
//! [`super::TaintEviction`], the attach-detach controller's forced detach
//! [`super::attach_detach`]; with a CSI driver that cannot fence, the three together make
//! two writers. A plain `reconcile()` round, so tests can step it deterministically.

use k8s_openapi::api::core::v1::{Node, Pod, PodCondition};

use super::{ready_condition, time_now};
use fencecsi_cluster::well_known::{DISRUPTION_TARGET_CONDITION, OUT_OF_SERVICE_TAINT_KEY};
use fencecsi_cluster::Cluster;
use fencecsi_cluster::Result;
use fencecsi_cluster::{DeleteOptions, ListParams};

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
