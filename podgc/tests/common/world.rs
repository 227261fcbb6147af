//! The embedded-cluster world podgc's tests run in: the cluster with the two CSIDrivers
//! (one that fences, one that does not) and ready nodes, stateful pods on it, and podgc's
//! test configuration.

use std::time::Duration;

use fencecsi_cluster::k8s_openapi::api::core::v1::{
    Node, PersistentVolume, PersistentVolumeClaim, Pod, Volume,
};
use fencecsi_cluster::k8s_openapi::api::events::v1::Event;
use fencecsi_cluster::k8s_openapi::api::storage::v1::{CSIDriver, CSIDriverSpec, VolumeAttachment};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use fencecsi_cluster::well_known::*;
use fencecsi_cluster::{Cluster, DeleteOptions, ListParams};
use fencecsi_embedded_cluster::sim::ready_node;
use fencecsi_embedded_cluster::EmbeddedCluster;
use fencecsi_podgc::PodGcConfig;

use super::*;

pub const SAFE: &str = DRIVER_NAME;
pub const UNSAFE: &str = "other.example.com";
pub const NS: &str = "apps";

pub fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(Into::into),
        ..Default::default()
    }
}

pub async fn cluster(nodes: &[&str]) -> Cluster {
    embedded(nodes).await.cluster()
}

/// [`cluster`], with the embedded cluster's controls.
pub async fn embedded(nodes: &[&str]) -> EmbeddedCluster {
    let c = EmbeddedCluster::new();
    for (name, safe) in [(SAFE, true), (UNSAFE, false)] {
        let mut d = CSIDriver {
            metadata: meta(name, None),
            spec: CSIDriverSpec::default(),
        };
        if safe {
            d.metadata.annotations = Some([(SAFE_DETACH_ANNOTATION.into(), "true".into())].into());
        }
        c.api::<CSIDriver>(None).create(&d).await.unwrap();
    }
    for n in nodes {
        c.api::<Node>(None).create(&ready_node(n)).await.unwrap();
    }
    c
}

/// A pod on `node`; with `volume = Some((driver, access mode))` it has a PVC bound to a CSI
/// PV of that driver and a VolumeAttachment on the node. Returns (pod, VA name).
pub async fn pod(
    c: &Cluster,
    name: &str,
    node: &str,
    volume: Option<(&str, &str)>,
) -> (Pod, Option<String>) {
    let mut volumes = vec![Volume {
        name: "scratch".into(),
        empty_dir: Some(Default::default()),
        ..Default::default()
    }];
    let mut va_name = None;
    if let Some((driver, mode)) = volume {
        let pv = format!("pv-{name}");
        let claim = format!("data-{name}");
        let handle = format!("handle-{name}");
        c.api::<PersistentVolume>(None)
            .create(&csi_pv(meta(&pv, None), driver, &handle, mode))
            .await
            .unwrap();
        c.api::<PersistentVolumeClaim>(Some(NS))
            .create(&bound_claim(meta(&claim, Some(NS)), &pv, mode))
            .await
            .unwrap();
        let va = volume_attachment_name(&handle, driver, node);
        c.api::<VolumeAttachment>(None)
            .create(&volume_attachment(meta(&va, None), driver, node, &pv))
            .await
            .unwrap();
        volumes.push(claim_volume(&claim));
        va_name = Some(va);
    }
    let p = c
        .api::<Pod>(Some(NS))
        .create(&pod_on(meta(name, Some(NS)), node, volumes))
        .await
        .unwrap();
    (p, va_name)
}

/// Graceful delete: the pod turns Terminating (no kubelet finishes it).
pub async fn terminate(c: &Cluster, name: &str) {
    let out = c
        .api::<Pod>(Some(NS))
        .delete(name, &DeleteOptions::default())
        .await
        .unwrap();
    assert!(!out.is_deleted());
}

pub fn cfg() -> PodGcConfig {
    PodGcConfig {
        shutdown_grace: Duration::from_secs(2),
        node_lease_grace: None,
        resync_interval: Duration::from_millis(200),
        debounce: Duration::from_millis(10),
        identity: "podgc-test".into(),
        ..Default::default()
    }
}

pub async fn wait_for<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    // A bound on liveness only: what is waited for comes within a grace or two.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !f().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn events(c: &Cluster, reason: &str) -> Vec<Event> {
    c.api::<Event>(None)
        .list_filtered(&ListParams::default(), |e| {
            e.reason.as_deref() == Some(reason)
        })
        .await
        .unwrap()
}
