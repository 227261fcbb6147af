//! Force-deleting pods: the UID-bound protocol ([`disrupt_and_delete`], public: the tests
//! call it directly), and the deletion of a down node's selected pods.

use std::collections::HashSet;

use fencecsi_cluster::k8s_openapi::api::core::v1::{Pod, PodCondition};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::well_known::{DELETION_BY_PODGC_REASON, DISRUPTION_TARGET_CONDITION};
use fencecsi_cluster::{Cluster, DeleteOptions, DeleteOutcome, EventType};

use super::{now, PassSummary, Runner};
use crate::volumes::DeleteReason;

/// Result of [`disrupt_and_delete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteResult {
    /// Force-deleted (it may linger while other finalizers are pending).
    Deleted,
    /// Already gone.
    Gone,
    /// The name now belongs to another pod (new UID): left alone.
    Recreated,
}

/// Marks `pod` `Failed` with a `DisruptionTarget` condition (reason `DeletionByPodGC`,
/// `message`; one already there is kept) through the status subresource, then
/// force-deletes it (grace 0) with a UID
/// precondition. Both steps are bound to the pod's UID: a pod re-created under the same
/// name is never touched.
pub async fn disrupt_and_delete(
    cluster: &Cluster,
    pod: &Pod,
    message: &str,
) -> fencecsi_cluster::Result<DeleteResult> {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let name = pod.metadata.name.clone().unwrap_or_default();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let pods = cluster.api::<Pod>(Some(&ns));
    let mut current = pod.clone();
    for attempt in 0..5 {
        if attempt > 0 {
            match pods.get_opt(&name).await? {
                None => return Ok(DeleteResult::Gone),
                Some(p) if p.metadata.uid.as_deref() != Some(uid.as_str()) => {
                    return Ok(DeleteResult::Recreated)
                }
                Some(p) => current = p,
            }
        }
        let mut p = current.clone();
        let status = p.status.get_or_insert_with(Default::default);
        // As upstream PodGC: a pod it deletes ends `Failed`, unless it already finished.
        let set_phase = !matches!(status.phase.as_deref(), Some("Failed" | "Succeeded"));
        if set_phase {
            status.phase = Some("Failed".into());
        }
        let conds = status.conditions.get_or_insert_with(Vec::new);
        // A DisruptionTarget already there (the taint manager's eviction, say) says who
        // started the disruption; it is kept.
        let has_condition = conds
            .iter()
            .any(|c| c.type_ == DISRUPTION_TARGET_CONDITION && c.status == "True");
        if has_condition && !set_phase {
            break;
        }
        if !has_condition {
            conds.retain(|c| c.type_ != DISRUPTION_TARGET_CONDITION);
            conds.push(PodCondition {
                type_: DISRUPTION_TARGET_CONDITION.into(),
                status: "True".into(),
                reason: Some(DELETION_BY_PODGC_REASON.into()),
                message: Some(message.to_string()),
                last_transition_time: Some(Time(
                    Timestamp::from_second(now().as_second()).unwrap_or_else(|_| now()),
                )),
                ..Default::default()
            });
        }
        // The uid in the object makes the write conditional on it, like the resourceVersion.
        p.metadata.uid = Some(uid.clone());
        match pods.replace_status(&p).await {
            Ok(_) => break,
            Err(e) if e.is_not_found() => return Ok(DeleteResult::Gone),
            Err(e) if e.is_conflict() => continue,
            Err(e) => return Err(e),
        }
    }
    match pods
        .delete(&name, &DeleteOptions::force().with_uid(&uid))
        .await
    {
        Ok(DeleteOutcome::Deleted) | Ok(DeleteOutcome::Terminating(_)) => Ok(DeleteResult::Deleted),
        Err(e) if e.is_not_found() => Ok(DeleteResult::Gone),
        Err(e) if e.is_conflict() => Ok(DeleteResult::Recreated),
        Err(e) => Err(e),
    }
}

impl Runner {
    /// Force-deletes the `selected` pods of `node` and records one Event for them. The
    /// PersistentVolumes of a pod whose deletion failed join `keep_pvs`: their
    /// VolumeAttachments stay until a later pass deletes the pod.
    pub(super) async fn force_delete(
        &self,
        node: &str,
        why: &str,
        selected: Vec<(Pod, DeleteReason, Vec<String>)>,
        keep_pvs: &mut HashSet<String>,
        s: &mut PassSummary,
    ) {
        let msg = format!(
            "{why}; podgc force-deletes this pod and detaches its volumes with a write fence"
        );
        let mut names = Vec::new();
        for (pod, reason, pvs) in selected {
            let full = format!(
                "{}/{}",
                pod.metadata.namespace.as_deref().unwrap_or(""),
                pod.metadata.name.as_deref().unwrap_or("")
            );
            match disrupt_and_delete(&self.cluster, &pod, &msg).await {
                Ok(DeleteResult::Deleted) => {
                    self.metrics.force_deleted(reason.as_str());
                    tracing::info!(pod = %full, node, reason = reason.as_str(), "pod force-deleted");
                    names.push(full.clone());
                    s.force_deleted.push(full);
                }
                Ok(DeleteResult::Gone) => {}
                Ok(DeleteResult::Recreated) => {
                    tracing::info!(pod = %full, node, "pod was re-created under the same name; left alone");
                }
                Err(e) => {
                    tracing::warn!(pod = %full, node, error = %e, "force delete failed; retried next pass");
                    keep_pvs.extend(pvs);
                }
            }
        }
        if !names.is_empty() {
            let mut list = names.join(", ");
            if list.len() > 600 {
                list.truncate(600);
                list.push_str(", ...");
            }
            self.event(
                Self::node_ref(node),
                EventType::Warning,
                "TerminatingPodsForceDeleted",
                &format!("{why}: force-deleted {} pod(s): {list}", names.len()),
            )
            .await;
        }
    }
}
