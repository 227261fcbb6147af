//! Set-up: the embedded cluster's objects and simulations, the real driver, the attacher
//! and podgc, the stand-ins, the PVCs and the StatefulSet whose pods start on node A.
//! Everything started here is held in a [`Rig`] until the teardown.

use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use fencecsi_attacher::AttacherHandle;
use fencecsi_cluster::k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Node, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeSpec, Pod, VolumeResourceRequirements,
};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{
    CSIDriver, CSIDriverSpec, CSINode, CSINodeDriver, CSINodeSpec,
};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use fencecsi_cluster::well_known::*;
use fencecsi_cluster::{Cluster, ListParams};
use fencecsi_driver::config::Mode;
use fencecsi_embedded_cluster::sim::attach_detach::{AttachDetach, AttachDetachConfig};
use fencecsi_embedded_cluster::sim::{self, HeartbeatHandle, SimHandle};
use fencecsi_podgc::{PodGc, PodGcConfig, PodGcHandle};
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::{Env, InProcess};

use super::node_plugin::NodePlugin;
use super::wait_until;
use crate::kubelet::{Board, Kubelet};
use crate::procs::Procs;
use crate::standins::{self, StorageClass, Task, FSTYPE_PARAM};
use crate::{Options, NAMESPACE, STORAGE_CLASS, UNSAFE_DRIVER};

/// What the set-up started. The fields are in the reverse order of starting because they
/// drop in declaration order: if the scenario fails before its teardown, the newest go
/// first (the StatefulSet stand-in) and the heartbeats last, as locals would.
pub(super) struct Rig {
    pub(super) sts: Task,
    pub(super) kubelets: Vec<Kubelet>,
    pub(super) adc: SimHandle,
    /// The attach-detach model itself (its Multi-Attach count goes into the figures).
    pub(super) adc_model: AttachDetach,
    pub(super) provisioner: Task,
    pub(super) podgc: PodGcHandle,
    pub(super) attacher: AttacherHandle,
    pub(super) plugins: Vec<NodePlugin>,
    /// The controller plugin's client; the provisioner stand-in works on a clone.
    pub(super) controller_client: CsiClient,
    pub(super) controller: InProcess,
    pub(super) eviction: SimHandle,
    pub(super) lifecycle: SimHandle,
    /// One per node, in `names` order: index 0 is node A.
    pub(super) hbs: Vec<HeartbeatHandle>,
}

fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(Into::into),
        ..Default::default()
    }
}

/// Sets everything up, up to the writer pods created on node A (not yet running).
pub(super) async fn start(
    env: &Env,
    opts: &Options,
    procs: &Procs,
    board: &Board,
    cluster: &Cluster,
    names: &[String],
) -> anyhow::Result<Rig> {
    let p = &opts.progress;
    let node_a = &names[0];
    let sc = create_driver_objects(cluster, opts).await?;
    let hbs = register_nodes(cluster, opts, names).await?;
    let (lifecycle, eviction) = start_node_controllers(cluster, opts);
    let (controller, controller_client) =
        InProcess::start(env.config(Mode::Controller, None, "controller")).await;
    let mut plugins = Vec::new();
    for n in names {
        plugins.push(NodePlugin::start(env, cluster, n).await?);
    }
    p.say(format!(
        "driver: controller plugin + {} node plugins (recovery every 1 s, clean reports to the Node)",
        names.len()
    ));
    let attacher = start_attacher(env, cluster).await?;
    let podgc = start_podgc(cluster, opts);
    p.say("attacher (fence auto) and podgc (out-of-service taint on) running");
    let size = volume_size(opts);
    let provisioner = standins::provisioner(
        cluster,
        controller_client.clone(),
        sc.clone(),
        size,
        p.clone(),
    );
    let adc_model = attach_detach_model(cluster, opts);
    let adc = adc_model.clone().spawn();
    let kubelets = spawn_kubelets(env, opts, procs, board, cluster, names, &plugins);
    create_claims(cluster, opts.volumes, size).await?;
    let sts = standins::statefulset(
        cluster,
        NAMESPACE,
        opts.volumes,
        node_a,
        opts.toleration_seconds,
        p.clone(),
    );
    if opts.unsafe_pod {
        create_unsafe_pod(cluster, node_a, opts.toleration_seconds).await?;
        p.say(format!(
            "pod other-0 on {node_a} with a PV of {UNSAFE_DRIVER} (no safe-detach annotation)"
        ));
    }
    Ok(Rig {
        sts,
        kubelets,
        adc,
        adc_model,
        provisioner,
        podgc,
        attacher,
        plugins,
        controller_client,
        controller,
        eviction,
        lifecycle,
        hbs,
    })
}

/// One mini kubelet per node, talking to that node's plugin.
fn spawn_kubelets(
    env: &Env,
    opts: &Options,
    procs: &Procs,
    board: &Board,
    cluster: &Cluster,
    names: &[String],
    plugins: &[NodePlugin],
) -> Vec<Kubelet> {
    names
        .iter()
        .zip(plugins)
        .map(|(n, plugin)| {
            Kubelet::spawn(
                cluster,
                n,
                env.kubelet_dir(n),
                plugin.client.clone(),
                board.clone(),
                procs.clone(),
                opts.writer_exe.clone(),
                opts.write_interval_ms,
                opts.progress.clone(),
            )
        })
        .collect()
}

/// The CSIDriver (with safe detach; and the unsafe driver when asked for) and the
/// StorageClass the provisioner stand-in serves.
async fn create_driver_objects(cluster: &Cluster, opts: &Options) -> anyhow::Result<StorageClass> {
    let mut drv = CSIDriver {
        metadata: meta(DRIVER_NAME, None),
        spec: CSIDriverSpec {
            attach_required: Some(true),
            ..Default::default()
        },
    };
    drv.metadata.annotations = Some([(SAFE_DETACH_ANNOTATION.into(), "true".into())].into());
    cluster.api::<CSIDriver>(None).create(&drv).await?;
    if opts.unsafe_pod {
        cluster
            .api::<CSIDriver>(None)
            .create(&CSIDriver {
                metadata: meta(UNSAFE_DRIVER, None),
                spec: CSIDriverSpec::default(),
            })
            .await?;
    }
    let sc = StorageClass {
        name: STORAGE_CLASS.into(),
        provisioner: DRIVER_NAME.into(),
        parameters: [(FSTYPE_PARAM.to_string(), opts.fs.clone())].into(),
    };
    opts.progress.say(format!(
        "CSIDriver {DRIVER_NAME} ({SAFE_DETACH_ANNOTATION}=true), StorageClass {} ({FSTYPE_PARAM}={})",
        sc.name, opts.fs
    ));
    Ok(sc)
}

/// Each node's heartbeat (its Node and Lease) and its CSINode; returns the heartbeats,
/// in `names` order, once every Node is there.
async fn register_nodes(
    cluster: &Cluster,
    opts: &Options,
    names: &[String],
) -> anyhow::Result<Vec<HeartbeatHandle>> {
    let hb_cfg = sim::HeartbeatConfig {
        interval: opts.lease_renew_interval,
        lease_duration_seconds: (opts.lease_renew_interval.as_secs() as i32 * 4).max(1),
        finish_terminating_pods: false, // the mini kubelets finish their pods
    };
    let hbs: Vec<_> = names
        .iter()
        .map(|n| sim::KubeletHeartbeat::new(cluster, n, hb_cfg.clone()).spawn())
        .collect();
    let nodes_api = cluster.api::<Node>(None);
    wait_until("nodes registered", Duration::from_secs(10), || async {
        Ok(nodes_api.list(&ListParams::default()).await?.items.len() == names.len())
    })
    .await?;
    for n in names {
        cluster
            .api::<CSINode>(None)
            .create(&CSINode {
                metadata: meta(n, None),
                spec: CSINodeSpec {
                    drivers: vec![CSINodeDriver {
                        name: DRIVER_NAME.into(),
                        node_id: n.clone(),
                        ..Default::default()
                    }],
                },
                ..Default::default()
            })
            .await?;
    }
    opts.progress.say(format!(
        "nodes {} registered (Ready), CSINodes created",
        names.join(", ")
    ));
    Ok(hbs)
}

/// The node lifecycle and taint-eviction models: (lifecycle, eviction).
fn start_node_controllers(cluster: &Cluster, opts: &Options) -> (SimHandle, SimHandle) {
    let lifecycle = sim::NodeLifecycle::new(
        cluster,
        sim::NodeLifecycleConfig {
            grace: opts.node_monitor_grace,
            interval: Duration::from_millis(100),
        },
    )
    .spawn();
    let eviction = sim::TaintEviction::new(
        cluster,
        sim::TaintEvictionConfig {
            interval: Duration::from_millis(100),
            default_toleration_seconds: 300,
        },
    )
    .spawn();
    (lifecycle, eviction)
}

/// The attacher on the controller plugin's socket, fencing when the plugin can; returns
/// once it is active.
async fn start_attacher(env: &Env, cluster: &Cluster) -> anyhow::Result<AttacherHandle> {
    let mut acfg = fencecsi_attacher::Config::new(env.socket("controller"));
    acfg.resync = Duration::from_secs(2);
    acfg.timeout = Duration::from_secs(30);
    acfg.backoff = fencecsi_attacher::Backoff {
        initial: Duration::from_millis(100),
        max: Duration::from_secs(1),
    };
    acfg.fence = fencecsi_attacher::FencePolicy::Auto;
    acfg.identity = "drill-attacher".into();
    let mut attacher = fencecsi_attacher::Attacher::new(cluster.clone(), acfg).spawn();
    if !attacher.wait_active(Duration::from_secs(20)).await {
        bail!("the attacher did not become active");
    }
    Ok(attacher)
}

fn start_podgc(cluster: &Cluster, opts: &Options) -> PodGcHandle {
    PodGc::new(
        cluster.clone(),
        PodGcConfig {
            shutdown_grace: opts.podgc_shutdown_grace,
            node_lease_grace: Some(opts.podgc_lease_grace),
            out_of_service_taint: true,
            resync_interval: Duration::from_millis(250),
            debounce: Duration::from_millis(20),
            identity: "drill-podgc".into(),
            leader_election: None,
            ..Default::default()
        },
    )
    .spawn()
}

/// Each claim's size: xfs needs more room than ext4 for its own metadata.
fn volume_size(opts: &Options) -> i64 {
    if opts.fs == "xfs" {
        320 << 20
    } else {
        64 << 20
    }
}

/// The attach-detach controller keeps its own view of what is attached; the unsafe
/// driver's volume is attached too (by nobody), so its VolumeAttachment is there to stay.
fn attach_detach_model(cluster: &Cluster, opts: &Options) -> AttachDetach {
    let p = opts.progress.clone();
    AttachDetach::new(
        cluster,
        AttachDetachConfig {
            drivers: vec![DRIVER_NAME.to_string(), UNSAFE_DRIVER.to_string()],
            sync_period: opts.adc_sync_period,
            ..Default::default()
        },
    )
    .with_say(Arc::new(move |m| p.say(format!("attach-detach: {m}"))))
}

/// The StatefulSet's claims, `data-writer-<i>`, of `size` bytes each.
async fn create_claims(cluster: &Cluster, volumes: usize, size: i64) -> anyhow::Result<()> {
    let pvcs = cluster.api::<PersistentVolumeClaim>(Some(NAMESPACE));
    for i in 0..volumes {
        pvcs.create(&PersistentVolumeClaim {
            metadata: meta(&format!("data-writer-{i}"), Some(NAMESPACE)),
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                storage_class_name: Some(STORAGE_CLASS.into()),
                resources: Some(VolumeResourceRequirements {
                    requests: Some(
                        [("storage".to_string(), Quantity(format!("{}Mi", size >> 20)))].into(),
                    ),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        })
        .await?;
    }
    Ok(())
}

/// A pod on node A whose PV belongs to a driver without safe detach: podgc must leave it.
async fn create_unsafe_pod(cluster: &Cluster, node: &str, tol: i64) -> anyhow::Result<()> {
    cluster
        .api::<PersistentVolume>(None)
        .create(&PersistentVolume {
            metadata: meta("pv-other", None),
            spec: Some(PersistentVolumeSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                csi: Some(CSIPersistentVolumeSource {
                    driver: UNSAFE_DRIVER.into(),
                    volume_handle: "other-1".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            status: None,
        })
        .await?;
    cluster
        .api::<PersistentVolumeClaim>(Some(NAMESPACE))
        .create(&PersistentVolumeClaim {
            metadata: meta("data-other-0", Some(NAMESPACE)),
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                volume_name: Some("pv-other".into()),
                ..Default::default()
            }),
            status: None,
        })
        .await?;
    cluster
        .api::<Pod>(Some(NAMESPACE))
        .create(&standins::writer_pod(
            NAMESPACE,
            "other-0",
            node,
            "data-other-0",
            tol,
        ))
        .await?;
    Ok(())
}
