//! What a real cluster has and the embedded one does not, reduced to what the drill needs:
//! a provisioner (external-provisioner) and a StatefulSet controller. The attach-detach
//! controller is `fencecsi_embedded_cluster::sim::attach_detach`, shared with the tests. Each is a small polling loop over the cluster
//! seam.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Context};
use fencecsi_cluster::k8s_openapi::api::core::v1::Node;
use fencecsi_cluster::k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Container, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, Pod, PodSpec, Toleration, Volume,
};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use fencecsi_cluster::{Cluster, ListParams};
use fencecsi_embedded_cluster::sim::{ready_condition, NOT_READY_TAINT_KEY, UNREACHABLE_TAINT_KEY};
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::rig::retry_aborted;
use fencecsi_tests::{csi, mount_cap, Access};

use crate::Progress;

/// A background loop, aborted on drop.
pub struct Task(pub tokio::task::JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn every<F, Fut>(interval: Duration, mut f: F) -> Task
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    Task(tokio::spawn(async move {
        loop {
            if let Err(e) = f().await {
                tracing::debug!(error = %format!("{e:#}"), "stand-in tick");
            }
            tokio::time::sleep(interval).await;
        }
    }))
}

/// The StorageClass parameter that names the filesystem (as in deploy/base).
pub const FSTYPE_PARAM: &str = "csi.storage.k8s.io/fstype";
/// external-provisioner keeps parameters with this prefix for itself.
const RESERVED_PARAM_PREFIX: &str = "csi.storage.k8s.io/";

/// The drill's StorageClass (the embedded cluster has no StorageClass kind, so the
/// provisioner holds it).
#[derive(Debug, Clone)]
pub struct StorageClass {
    pub name: String,
    pub provisioner: String,
    pub parameters: BTreeMap<String, String>,
}

// ---------------------------------------------------------------------------------------

/// PVC of the drill's StorageClass without a volume → CreateVolume → bound CSI PV (RWO).
pub fn provisioner(
    cluster: &Cluster,
    controller: CsiClient,
    sc: StorageClass,
    size: i64,
    progress: Progress,
) -> Task {
    let cluster = cluster.clone();
    every(Duration::from_millis(100), move || {
        let (cluster, controller, sc, progress) = (
            cluster.clone(),
            controller.clone(),
            sc.clone(),
            progress.clone(),
        );
        async move {
            let pvcs = cluster
                .api::<PersistentVolumeClaim>(None)
                .list_filtered(&ListParams::default(), |c| {
                    c.spec.as_ref().is_some_and(|s| {
                        s.volume_name.is_none()
                            && s.storage_class_name.as_deref() == Some(sc.name.as_str())
                    })
                })
                .await?;
            for pvc in pvcs {
                provision(&cluster, &controller, &sc, size, &pvc, &progress)
                    .await
                    .with_context(|| {
                        format!(
                            "provisioning {}",
                            pvc.metadata.name.clone().unwrap_or_default()
                        )
                    })?;
            }
            Ok(())
        }
    })
}

async fn provision(
    cluster: &Cluster,
    controller: &CsiClient,
    sc: &StorageClass,
    size: i64,
    pvc: &PersistentVolumeClaim,
    progress: &Progress,
) -> anyhow::Result<()> {
    let ns = pvc.metadata.namespace.clone().unwrap_or_default();
    let claim = pvc.metadata.name.clone().unwrap_or_default();
    let uid = pvc.metadata.uid.clone().unwrap_or_default();
    let pv_name = format!("pvc-{uid}");
    let fs = class_fs_type(sc);
    let vol = create_volume(controller, sc, &pv_name, &fs, size).await?;
    let pv = persistent_volume(sc, &pv_name, &fs, &vol, pvc);
    match cluster.api::<PersistentVolume>(None).create(&pv).await {
        Ok(_) => {}
        Err(e) if e.is_already_exists() => {}
        Err(e) => return Err(e.into()),
    }
    bind_claim(cluster, &ns, &claim, &pv_name).await?;
    progress.say(format!(
        "provisioner: {ns}/{claim} bound to {pv_name} (CreateVolume → {}, {fs}, {} MiB)",
        vol.volume_id,
        vol.capacity_bytes >> 20
    ));
    Ok(())
}

/// As external-provisioner does: the filesystem named by the class goes into the
/// capability (and the PV), and its reserved `csi.storage.k8s.io/` keys never reach
/// CreateVolume, so the driver learns the filesystem from the capability alone.
fn class_fs_type(sc: &StorageClass) -> String {
    sc.parameters
        .iter()
        .find(|(k, _)| k.as_str() == FSTYPE_PARAM || k.eq_ignore_ascii_case("fstype"))
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| "ext4".into())
}

async fn create_volume(
    controller: &CsiClient,
    sc: &StorageClass,
    name: &str,
    fs: &str,
    size: i64,
) -> anyhow::Result<csi::Volume> {
    let parameters: std::collections::HashMap<String, String> = sc
        .parameters
        .iter()
        .filter(|(k, _)| !k.starts_with(RESERVED_PARAM_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let cap = mount_cap(Access::SingleNodeWriter, fs);
    retry_aborted(|| {
        let mut c = controller.clone();
        let req = csi::CreateVolumeRequest {
            name: name.to_string(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: size,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            parameters: parameters.clone(),
            ..Default::default()
        };
        async move { c.controller.create_volume(req).await }
    })
    .await
    .context("CreateVolume")?
    .into_inner()
    .volume
    .ok_or_else(|| anyhow!("CreateVolume returned no volume"))
}

/// The PV of `vol`, bound ahead to its claim, as external-provisioner writes it.
fn persistent_volume(
    sc: &StorageClass,
    name: &str,
    fs: &str,
    vol: &csi::Volume,
    pvc: &PersistentVolumeClaim,
) -> PersistentVolume {
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            annotations: Some(
                [(
                    "pv.kubernetes.io/provisioned-by".to_string(),
                    sc.provisioner.clone(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            capacity: Some(
                [(
                    "storage".to_string(),
                    Quantity(vol.capacity_bytes.to_string()),
                )]
                .into(),
            ),
            storage_class_name: Some(sc.name.clone()),
            persistent_volume_reclaim_policy: Some("Delete".into()),
            claim_ref: Some(ObjectReference {
                kind: Some("PersistentVolumeClaim".into()),
                namespace: Some(pvc.metadata.namespace.clone().unwrap_or_default()),
                name: Some(pvc.metadata.name.clone().unwrap_or_default()),
                uid: Some(pvc.metadata.uid.clone().unwrap_or_default()),
                ..Default::default()
            }),
            csi: Some(CSIPersistentVolumeSource {
                driver: sc.provisioner.clone(),
                volume_handle: vol.volume_id.clone(),
                fs_type: Some(fs.to_string()),
                volume_attributes: Some(vol.volume_context.clone().into_iter().collect()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

/// Names the PV in the claim and marks the claim Bound.
async fn bind_claim(cluster: &Cluster, ns: &str, claim: &str, pv_name: &str) -> anyhow::Result<()> {
    let pvcs = cluster.api::<PersistentVolumeClaim>(Some(ns));
    let mut cur = pvcs.get(claim).await?;
    cur.spec.get_or_insert_with(Default::default).volume_name = Some(pv_name.to_string());
    let cur = pvcs.replace(&cur).await?;
    let mut st = cur.clone();
    let status = st.status.get_or_insert_with(Default::default);
    status.phase = Some("Bound".into());
    status.access_modes = Some(vec!["ReadWriteOnce".into()]);
    let _ = pvcs.replace_status(&st).await;
    Ok(())
}

// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------

/// Whether a node can take new pods: Ready and without NoSchedule/NoExecute taints.
pub fn schedulable(n: &Node) -> bool {
    ready_condition(n).is_some_and(|c| c.status == "True")
        && n.spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_none_or(|ts| ts.iter().all(|t| t.effect == "PreferNoSchedule"))
}

/// A writer pod `name` on `node` with claim `claim`.
pub fn writer_pod(ns: &str, name: &str, node: &str, claim: &str, toleration_secs: i64) -> Pod {
    let tol = |key: &str| Toleration {
        key: Some(key.into()),
        operator: Some("Exists".into()),
        effect: Some("NoExecute".into()),
        toleration_seconds: Some(toleration_secs),
        ..Default::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: Some([("app".to_string(), "writer".to_string())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "writer".into(),
                image: Some("fencecsi-drill/writer".into()),
                ..Default::default()
            }],
            volumes: Some(vec![Volume {
                name: "data".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.into(),
                    read_only: None,
                }),
                ..Default::default()
            }]),
            tolerations: Some(vec![tol(NOT_READY_TAINT_KEY), tol(UNREACHABLE_TAINT_KEY)]),
            termination_grace_period_seconds: Some(30),
            ..Default::default()
        }),
        status: None,
    }
}

/// The StatefulSet controller: keeps pods `writer-<i>` (claim `data-writer-<i>`) in
/// existence. The first ones go to `first_node`; a pod that is gone is re-created (new
/// UID) on the first Ready, untainted node.
pub fn statefulset(
    cluster: &Cluster,
    ns: &str,
    replicas: usize,
    first_node: &str,
    toleration_secs: i64,
    progress: Progress,
) -> Task {
    let cluster = cluster.clone();
    let ns = ns.to_string();
    let first_node = first_node.to_string();
    let created: Arc<Mutex<HashSet<String>>> = Arc::default();
    every(Duration::from_millis(50), move || {
        let (cluster, ns, first_node, progress, created) = (
            cluster.clone(),
            ns.clone(),
            first_node.clone(),
            progress.clone(),
            created.clone(),
        );
        async move {
            let pods = cluster.api::<Pod>(Some(&ns));
            for i in 0..replicas {
                let name = format!("writer-{i}");
                if pods.get_opt(&name).await?.is_some() {
                    continue;
                }
                let first = !created.lock().unwrap().contains(&name);
                let node = if first {
                    first_node.clone()
                } else {
                    let mut nodes = cluster
                        .api::<Node>(None)
                        .list(&ListParams::default())
                        .await?
                        .items;
                    nodes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
                    match nodes.iter().find(|n| schedulable(n)) {
                        Some(n) => n.metadata.name.clone().unwrap_or_default(),
                        None => continue,
                    }
                };
                let p = writer_pod(&ns, &name, &node, &format!("data-{name}"), toleration_secs);
                match pods.create(&p).await {
                    Ok(p) => {
                        created.lock().unwrap().insert(name.clone());
                        progress.say(format!(
                            "statefulset: pod {name} {} on {node} (uid {})",
                            if first { "created" } else { "re-created" },
                            &p.metadata.uid.unwrap_or_default()[..8]
                        ));
                    }
                    Err(e) if e.is_already_exists() => {}
                    Err(e) => return Err(e.into()),
                }
            }
            Ok(())
        }
    })
}
