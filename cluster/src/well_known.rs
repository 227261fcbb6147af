//! Names the fencecsi components agree on: taints, annotations, finalizers.
//! One place, so the attacher, podgc and the node plugin cannot drift apart.

/// Default CSI driver name of the loop-image plugin.
pub const DRIVER_NAME: &str = "loop.fencecsi.io";

/// podgc's quarantine taint (NoSchedule) on a node that shut down. Lifted only
/// after the node came back and its node plugin reported it clean.
pub const QUARANTINE_TAINT_KEY: &str = "fencecsi.io/quarantine";
pub const QUARANTINE_TAINT_VALUE: &str = "node-shutdown";

/// The taint Kubernetes ≥ 1.28 shipped for non-graceful node shutdown: with
/// it, kube-controller-manager force-deletes the node's terminating pods and
/// force-detaches its volumes.
pub const OUT_OF_SERVICE_TAINT_KEY: &str = "node.kubernetes.io/out-of-service";
pub const OUT_OF_SERVICE_TAINT_VALUE: &str = "nodeshutdown";

/// On a CSIDriver object: the driver can detach safely from a node that may
/// still be running (it fences). `CSIDriverSpec` has no field for this.
pub const SAFE_DETACH_ANNOTATION: &str = "fencecsi.io/safe-detach";

/// On a Node: set by the node plugin (RFC 3339 time) once, after the node
/// returned, it has released every volume that was fenced away from it.
pub const NODE_CLEAN_ANNOTATION: &str = "fencecsi.io/node-clean";

/// On a Node: set by podgc (RFC 3339 time) when it quarantined the node; the
/// node-clean report must be newer than this to count.
pub const QUARANTINED_AT_ANNOTATION: &str = "fencecsi.io/quarantined-at";

/// Where the kubelet publishes a node's CSI node IDs (JSON map driver → ID),
/// the fallback when no CSINode object names the driver.
pub const NODE_ID_ANNOTATION: &str = "csi.volume.kubernetes.io/nodeid";

/// Pod condition type and reason used when podgc force-deletes a pod, as
/// kube-controller-manager's PodGC does.
pub const DISRUPTION_TARGET_CONDITION: &str = "DisruptionTarget";
pub const DELETION_BY_PODGC_REASON: &str = "DeletionByPodGC";

/// Namespace of the kubelets' node Leases.
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";

/// The node plugin's heartbeat: a Lease named this prefix plus the node's name, in the
/// node plugin's namespace, whose holderIdentity is the node's name and which the node
/// plugin renews every `--heartbeat-interval`. podgc watches these Leases (by the label
/// below) to see a node stop faster than the kubelet's Lease shows it.
pub const HEARTBEAT_LEASE_PREFIX: &str = "fencecsi-node-";
/// The label (key, value) every heartbeat Lease carries.
pub const HEARTBEAT_LABEL: (&str, &str) = ("fencecsi.io/heartbeat", "node");

/// The name of `node`'s heartbeat Lease.
pub fn heartbeat_lease_name(node: &str) -> String {
    format!("{HEARTBEAT_LEASE_PREFIX}{node}")
}

/// The attacher's finalizer on VolumeAttachments and PersistentVolumes:
/// `external-attacher/<driver name with '/' replaced by '-'>`, as upstream.
pub fn attacher_finalizer(driver: &str) -> String {
    format!("external-attacher/{}", driver.replace('/', "-"))
}

/// The VolumeAttachment name kubelet and the attach-detach controller use:
/// `csi-<sha256(volumeHandle + driver + node)>`.
pub fn volume_attachment_name(volume_handle: &str, driver: &str, node: &str) -> String {
    use std::fmt::Write;
    let digest = sha2_256(format!("{volume_handle}{driver}{node}").as_bytes());
    let mut hex = String::with_capacity(64);
    for b in digest {
        let _ = write!(hex, "{b:02x}");
    }
    format!("csi-{hex}")
}

fn sha2_256(data: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(data).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finalizer_and_attachment_names_match_upstream_forms() {
        assert_eq!(
            attacher_finalizer("loop.fencecsi.io"),
            "external-attacher/loop.fencecsi.io"
        );
        assert_eq!(attacher_finalizer("a/b"), "external-attacher/a-b");
        let n = volume_attachment_name("vol-1", DRIVER_NAME, "node-a");
        assert!(n.starts_with("csi-") && n.len() == 68, "{n}");
        assert_ne!(n, volume_attachment_name("vol-1", DRIVER_NAME, "node-b"));
    }
}
