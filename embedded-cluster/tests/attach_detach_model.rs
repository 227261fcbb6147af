//! The attach-detach controller model (`sim::attach_detach`) behaves as the real one does
//! where podgc and the drill depend on it: its own view, the Multi-Attach refusal, detach
//! gated on the node's volumesInUse, and the verification that drops attachments deleted
//! behind its back.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencecsi_cluster::k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Node, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, Pod,
    PodSpec, Volume,
};
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use fencecsi_cluster::well_known::volume_attachment_name;
use fencecsi_cluster::{Cluster, DeleteOptions};
use fencecsi_embedded_cluster::sim::attach_detach::{
    csi_unique_name, AttachDetach, AttachDetachConfig,
};
use fencecsi_embedded_cluster::sim::ready_node;
use fencecsi_embedded_cluster::EmbeddedCluster;

const DRIVER: &str = "loop.example.com";
const NS: &str = "apps";

fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(Into::into),
        ..Default::default()
    }
}

async fn pod(c: &Cluster, name: &str, node: &str) {
    c.api::<Pod>(Some(NS))
        .create(&Pod {
            metadata: meta(name, Some(NS)),
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                volumes: Some(vec![Volume {
                    name: "data".into(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: "data".into(),
                        read_only: None,
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            status: None,
        })
        .await
        .unwrap();
}

async fn set_in_use(c: &Cluster, node: &str, list: Vec<String>) {
    let api = c.api::<Node>(None);
    let mut n = api.get(node).await.unwrap();
    n.status.get_or_insert_with(Default::default).volumes_in_use = Some(list);
    api.replace_status(&n).await.unwrap();
}

async fn exists(c: &Cluster, va: &str) -> bool {
    c.api::<VolumeAttachment>(None)
        .get_opt(va)
        .await
        .unwrap()
        .is_some()
}

async fn gone(c: &Cluster, name: &str) {
    c.api::<Pod>(Some(NS))
        .delete(name, &DeleteOptions::force())
        .await
        .unwrap();
}

#[tokio::test]
async fn the_model_keeps_its_own_view() {
    let c = EmbeddedCluster::new();
    for n in ["a", "b"] {
        c.api::<Node>(None).create(&ready_node(n)).await.unwrap();
    }
    c.api::<PersistentVolume>(None)
        .create(&PersistentVolume {
            metadata: meta("pv", None),
            spec: Some(PersistentVolumeSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                csi: Some(CSIPersistentVolumeSource {
                    driver: DRIVER.into(),
                    volume_handle: "h".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        })
        .await
        .unwrap();
    c.api::<PersistentVolumeClaim>(Some(NS))
        .create(&PersistentVolumeClaim {
            metadata: meta("data", Some(NS)),
            spec: Some(PersistentVolumeClaimSpec {
                volume_name: Some("pv".into()),
                ..Default::default()
            }),
            status: None,
        })
        .await
        .unwrap();
    // The first round verifies, the next only a sync period later: long enough that the
    // rounds below, up to the deletion behind the controller's back, all come before it
    // however busy the machine.
    let sync = Duration::from_secs(3);
    // What the controller says it did, in order.
    let said = Arc::new(Mutex::new(Vec::<String>::new()));
    let adc = AttachDetach::new(
        &c,
        AttachDetachConfig {
            sync_period: sync,
            drivers: vec![DRIVER.into()],
            ..Default::default()
        },
    )
    .with_say({
        let said = said.clone();
        Arc::new(move |m| said.lock().unwrap().push(m))
    });
    let unique = csi_unique_name(DRIVER, "h");
    let va_a = volume_attachment_name("h", DRIVER, "a");
    let va_b = volume_attachment_name("h", DRIVER, "b");

    // Attach to a; the kubelet on a reports it mounted.
    pod(&c, "p1", "a").await;
    adc.reconcile().await.unwrap();
    assert!(exists(&c, &va_a).await);
    set_in_use(&c, "a", vec![unique.clone()]).await;

    // The pod moves to b: still mounted on a, so no detach, and b waits (Multi-Attach).
    gone(&c, "p1").await;
    pod(&c, "p2", "b").await;
    adc.reconcile().await.unwrap();
    assert!(
        exists(&c, &va_a).await,
        "detached while still in volumesInUse"
    );
    assert!(!exists(&c, &va_b).await);
    assert_eq!(adc.multi_attach_errors(), 1);

    // Out of volumesInUse: detached at once, then attached to b.
    set_in_use(&c, "a", vec![]).await;
    for _ in 0..3 {
        adc.reconcile().await.unwrap();
    }
    assert!(!exists(&c, &va_a).await);
    assert!(exists(&c, &va_b).await);
    assert_eq!(adc.attached_nodes("pv"), vec!["b"]);

    // b's attachment deleted behind the controller's back while b still lists the volume
    // in use: the view keeps it until the verification, and a pod on a waits until then.
    set_in_use(&c, "b", vec![unique.clone()]).await;
    gone(&c, "p2").await;
    c.api::<VolumeAttachment>(None)
        .delete(&va_b, &DeleteOptions::default())
        .await
        .unwrap();
    pod(&c, "p3", "a").await;
    let from = said.lock().unwrap().len();
    adc.reconcile().await.unwrap();
    assert_eq!(adc.attached_nodes("pv"), vec!["b"]);
    assert!(!exists(&c, &va_a).await);
    assert_eq!(adc.multi_attach_errors(), 2);
    let deadline = Instant::now() + sync + Duration::from_secs(60);
    while !exists(&c, &va_a).await {
        assert!(Instant::now() < deadline, "never attached to a");
        adc.reconcile().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(adc.attached_nodes("pv"), vec!["a"]);
    // In the controller's own words: the verification dropped b's attachment, and only
    // after it did the volume go to a.
    let said = said.lock().unwrap()[from..].to_vec();
    let at = |what: &str| {
        said.iter()
            .position(|m| m.starts_with(what))
            .unwrap_or_else(|| panic!("the controller never said {what:?}: {said:#?}"))
    };
    assert!(
        at("verification: VolumeAttachment of pv on b is gone")
            < at("attaching pv to a: VolumeAttachment created"),
        "attached before the verification: {said:#?}"
    );
}
