//! Cluster objects shared by podgc's tests on the embedded cluster (`podgc.rs`) and on a
//! real API server (`real_cluster.rs`): a stateful pod's PV, claim, VolumeAttachment and
//! pod as the PV controller, the attach-detach controller and a workload controller would
//! make them, and what the tests read off a node. (`scale.rs` here is the scale benchmark's
//! own code, included by `tests/scale.rs` and `benches/scale.rs`.)
#![allow(dead_code)]

pub mod kubelet_tls;
pub mod world;

use fencecsi_cluster::k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Node, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, Pod,
    PodSpec, Volume,
};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{
    VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec,
};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// A CSI PV of `driver` for the volume `handle`, with the access mode `mode`.
pub fn csi_pv(metadata: ObjectMeta, driver: &str, handle: &str, mode: &str) -> PersistentVolume {
    PersistentVolume {
        metadata,
        spec: Some(PersistentVolumeSpec {
            access_modes: Some(vec![mode.into()]),
            csi: Some(CSIPersistentVolumeSource {
                driver: driver.into(),
                volume_handle: handle.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// A claim bound to the PV `pv`, with the access mode `mode`.
pub fn bound_claim(metadata: ObjectMeta, pv: &str, mode: &str) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata,
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![mode.into()]),
            volume_name: Some(pv.into()),
            ..Default::default()
        }),
        status: None,
    }
}

/// The attachment of the PV `pv` to `node` by `driver`.
pub fn volume_attachment(
    metadata: ObjectMeta,
    driver: &str,
    node: &str,
    pv: &str,
) -> VolumeAttachment {
    VolumeAttachment {
        metadata,
        spec: VolumeAttachmentSpec {
            attacher: driver.into(),
            node_name: node.into(),
            source: VolumeAttachmentSource {
                persistent_volume_name: Some(pv.into()),
                ..Default::default()
            },
        },
        status: None,
    }
}

/// The pod volume "data" of the claim `claim`.
pub fn claim_volume(claim: &str) -> Volume {
    Volume {
        name: "data".into(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: claim.into(),
            read_only: None,
        }),
        ..Default::default()
    }
}

/// A pod scheduled to `node` with `volumes`.
pub fn pod_on(metadata: ObjectMeta, node: &str, volumes: Vec<Volume>) -> Pod {
    Pod {
        metadata,
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            volumes: Some(volumes),
            ..Default::default()
        }),
        status: None,
    }
}

pub fn has_taint(n: &Node, key: &str) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == key))
}

pub fn annotation<'a>(n: &'a Node, key: &str) -> Option<&'a String> {
    n.metadata.annotations.as_ref().and_then(|a| a.get(key))
}
