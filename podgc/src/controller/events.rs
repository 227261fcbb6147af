//! Events: recording them (a failed record is logged, never fatal to a pass), and the one
//! Warning per terminating pod podgc leaves alone.

use std::collections::HashSet;

use fencecsi_cluster::k8s_openapi::api::core::v1::{ObjectReference, Pod};
use fencecsi_cluster::{object_ref, EventType};

use super::{PassSummary, Runner};
use crate::volumes::SkipReason;

impl Runner {
    pub(super) async fn event(
        &self,
        obj_ref: ObjectReference,
        t: EventType,
        reason: &str,
        msg: &str,
    ) {
        if let Err(e) = self.recorder.record(&obj_ref, t, reason, msg).await {
            tracing::debug!(error = %e, reason, "recording an event failed");
        }
    }

    pub(super) fn node_ref(name: &str) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(name.to_string()),
            ..Default::default()
        }
    }

    /// Lists every skipped pod in the summary; records a Warning Event only for those not
    /// warned about yet (`warned` forgets the pods gone from the node).
    pub(super) async fn warn_skipped(
        &mut self,
        node: &str,
        why: &str,
        pods: &[Pod],
        skipped: Vec<(Pod, SkipReason, String)>,
        s: &mut PassSummary,
    ) {
        let seen: HashSet<String> = pods.iter().filter_map(|p| p.metadata.uid.clone()).collect();
        let warned = self.warned.entry(node.to_string()).or_default();
        warned.retain(|u| seen.contains(u));
        let mut to_warn = Vec::new();
        for (pod, reason, detail) in skipped {
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            s.skipped.push(format!(
                "{}/{}",
                pod.metadata.namespace.as_deref().unwrap_or(""),
                pod.metadata.name.as_deref().unwrap_or("")
            ));
            if warned.insert(uid) {
                to_warn.push((pod, reason, detail));
            }
        }
        for (pod, reason, detail) in to_warn {
            self.metrics.skipped(reason.as_str());
            let msg = format!("{why}, but podgc leaves this terminating pod alone: {detail}. Delete it by hand once the node is known to be off.");
            tracing::warn!(pod = %format!("{}/{}", pod.metadata.namespace.as_deref().unwrap_or(""), pod.metadata.name.as_deref().unwrap_or("")), node, reason = reason.as_str(), "{msg}");
            self.event(
                object_ref(&pod),
                EventType::Warning,
                "ForceDeleteSkipped",
                &msg,
            )
            .await;
        }
    }

    /// Says once per episode why the out-of-service taint stays off `node`.
    pub(super) async fn warn_oos_withheld(
        &mut self,
        node: &str,
        why: &str,
        at_risk: &[String],
        foreign: &[String],
    ) {
        if !self.oos_withheld.insert(node.to_string()) {
            return;
        }
        let mut what: Vec<String> = at_risk.to_vec();
        what.extend(
            foreign
                .iter()
                .map(|va| format!("VolumeAttachment {va} of a driver without safe detach")),
        );
        let mut list = what.join("; ");
        if list.len() > 800 {
            list.truncate(800);
            list.push_str("; ...");
        }
        let msg = format!("{why}, but podgc does not set the out-of-service taint: it would make Kubernetes force-delete pods and force-detach volumes that nothing fences ({list}). podgc evicts only the pods whose every volume is fenced; the rest wait for someone to confirm the node is off and set the taint by hand.");
        tracing::warn!(node, "{msg}");
        self.event(
            Self::node_ref(node),
            EventType::Warning,
            "OutOfServiceTaintWithheld",
            &msg,
        )
        .await;
    }
}
