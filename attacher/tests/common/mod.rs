//! Helpers shared by the attacher's tests and benchmark: cluster objects as kubelet,
//! the PV controller and the attach-detach controller would make them, volumes made
//! through the real driver, polling, and a gated unix-socket proxy.
#![allow(dead_code)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencecsi_attacher::{Backoff, Config};
use fencecsi_cluster::k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, Node, NodeCondition, NodeStatus, PersistentVolume,
    PersistentVolumeSpec,
};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{
    CSINode, CSINodeDriver, CSINodeSpec, VolumeAttachment, VolumeAttachmentSource,
    VolumeAttachmentSpec,
};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use fencecsi_cluster::{well_known, Cluster};
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::real_cluster::events_about;
use fencecsi_tests::{block_cap, csi, mount_cap, Access};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

pub const DRIVER: &str = well_known::DRIVER_NAME;

pub fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        ..Default::default()
    }
}

/// A CSI PersistentVolume of `DRIVER` for `handle`.
pub fn pv(name: &str, handle: &str, block: bool, access: &str) -> PersistentVolume {
    pv_of(name, handle, block, access, DRIVER)
}

pub fn pv_of(
    name: &str,
    handle: &str,
    block: bool,
    access: &str,
    driver: &str,
) -> PersistentVolume {
    PersistentVolume {
        metadata: meta(name),
        spec: Some(PersistentVolumeSpec {
            access_modes: Some(vec![access.into()]),
            volume_mode: Some(if block { "Block" } else { "Filesystem" }.into()),
            csi: Some(CSIPersistentVolumeSource {
                driver: driver.into(),
                volume_handle: handle.into(),
                fs_type: (!block).then(|| "ext4".to_string()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    }
}

pub fn ready_condition(ready: bool) -> NodeCondition {
    NodeCondition {
        type_: "Ready".into(),
        status: if ready { "True" } else { "Unknown" }.into(),
        reason: Some(
            if ready {
                "KubeletReady"
            } else {
                "NodeStatusUnknown"
            }
            .into(),
        ),
        ..Default::default()
    }
}

pub fn node(name: &str, ready: bool) -> Node {
    Node {
        metadata: meta(name),
        spec: None,
        status: Some(NodeStatus {
            conditions: Some(vec![ready_condition(ready)]),
            ..Default::default()
        }),
    }
}

pub fn csinode(name: &str, node_id: &str) -> CSINode {
    CSINode {
        metadata: meta(name),
        spec: CSINodeSpec {
            drivers: vec![CSINodeDriver {
                name: DRIVER.into(),
                node_id: node_id.into(),
                ..Default::default()
            }],
        },
        ..Default::default()
    }
}

/// A VolumeAttachment as the attach-detach controller makes it.
pub fn va(pv: &str, handle: &str, node: &str) -> VolumeAttachment {
    va_of(pv, handle, node, DRIVER)
}

pub fn va_of(pv: &str, handle: &str, node: &str, attacher: &str) -> VolumeAttachment {
    VolumeAttachment {
        metadata: meta(&well_known::volume_attachment_name(handle, attacher, node)),
        spec: VolumeAttachmentSpec {
            attacher: attacher.into(),
            node_name: node.into(),
            source: VolumeAttachmentSource {
                persistent_volume_name: Some(pv.into()),
                inline_volume_spec: None,
            },
        },
        status: None,
    }
}

/// A configuration for tests: fast retries and resync, 5 s calls, metrics on port 0.
pub fn test_config(socket: &Path) -> Config {
    let mut cfg = Config::new(socket);
    cfg.workers = 4;
    cfg.timeout = Duration::from_secs(5);
    cfg.resync = Duration::from_secs(2);
    cfg.backoff = Backoff {
        initial: Duration::from_millis(50),
        max: Duration::from_secs(1),
    };
    cfg.http_endpoint = Some("127.0.0.1:0".parse().unwrap());
    cfg.shutdown_grace = Duration::from_secs(5);
    cfg
}

/// A node, its CSINode, all in the cluster.
pub async fn register_node(cluster: &Cluster, name: &str, ready: bool) {
    cluster
        .api::<Node>(None)
        .create(&node(name, ready))
        .await
        .unwrap();
    cluster
        .api::<CSINode>(None)
        .create(&csinode(name, name))
        .await
        .unwrap();
}

/// Sets the node's Ready condition.
pub async fn set_ready(cluster: &Cluster, name: &str, ready: bool) {
    let nodes = cluster.api::<Node>(None);
    let mut n = nodes.get(name).await.unwrap();
    n.status.get_or_insert_with(Default::default).conditions = Some(vec![ready_condition(ready)]);
    nodes.replace_status(&n).await.unwrap();
}

/// Creates a small volume through the driver.
pub async fn create_volume(c: &CsiClient, name: &str, block: bool) -> String {
    let cap = if block {
        block_cap(Access::SingleNodeWriter)
    } else {
        mount_cap(Access::SingleNodeWriter, "ext4")
    };
    c.clone()
        .controller
        .create_volume(csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: if block { 1 << 20 } else { 16 << 20 },
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap],
            ..Default::default()
        })
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .expect("volume")
        .volume_id
}

/// The nodes the driver has `volume` published to.
pub async fn published_nodes(c: &CsiClient, volume: &str) -> Vec<String> {
    let mut v = c
        .clone()
        .controller
        .controller_get_volume(csi::ControllerGetVolumeRequest {
            volume_id: volume.into(),
        })
        .await
        .expect("ControllerGetVolume")
        .into_inner()
        .status
        .map(|s| s.published_node_ids)
        .unwrap_or_default();
    v.sort();
    v
}

/// Polls `f` every 20 ms until it yields `Some`, panicking with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the VolumeAttachment `name` reports attached; returns it.
pub async fn wait_attached(cluster: &Cluster, name: &str, timeout: Duration) -> VolumeAttachment {
    let vas = cluster.api::<VolumeAttachment>(None);
    eventually(
        timeout,
        &format!("VolumeAttachment {name} attached"),
        || {
            let vas = vas.clone();
            async move {
                vas.get_opt(name)
                    .await
                    .unwrap()
                    .filter(|v| v.status.as_ref().is_some_and(|s| s.attached))
            }
        },
    )
    .await
}

/// Waits until the VolumeAttachment `name` is gone.
pub async fn wait_gone(cluster: &Cluster, name: &str, timeout: Duration) {
    let vas = cluster.api::<VolumeAttachment>(None);
    eventually(timeout, &format!("VolumeAttachment {name} deleted"), || {
        let vas = vas.clone();
        async move { vas.get_opt(name).await.unwrap().is_none().then_some(()) }
    })
    .await
}

/// Reasons of the Events about the VolumeAttachment `va`, oldest first; with `controller`,
/// only those it reported.
pub async fn va_event_reasons(
    cluster: &Cluster,
    va: &str,
    controller: Option<&str>,
) -> Vec<String> {
    let mut evs = events_about(cluster, va, controller).await;
    evs.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
    evs.into_iter().filter_map(|e| e.reason).collect()
}

/// Waits until there is an Event `reason` about `va` (reported by `controller`, if given);
/// returns [`va_event_reasons`] then.
pub async fn wait_va_event(
    cluster: &Cluster,
    va: &str,
    reason: &str,
    controller: Option<&str>,
    timeout: Duration,
) -> Vec<String> {
    eventually(timeout, &format!("event {reason} on {va}"), || async {
        let r = va_event_reasons(cluster, va, controller).await;
        r.iter().any(|x| x == reason).then_some(r)
    })
    .await
}

pub fn finalizers<K: fencecsi_cluster::Object>(o: &K) -> Vec<String> {
    o.metadata().finalizers.clone().unwrap_or_default()
}

/// A unix-socket proxy in front of a plugin whose client-to-plugin direction can be
/// closed: bytes sent while closed are held (counted), never forwarded. Dropping the
/// proxy cuts every connection.
pub struct GatedProxy {
    pub socket: PathBuf,
    open: watch::Sender<bool>,
    held: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl GatedProxy {
    pub fn start(socket: PathBuf, upstream: PathBuf) -> GatedProxy {
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).expect("binding the proxy socket");
        let (open, _) = watch::channel(true);
        let held = Arc::new(AtomicUsize::new(0));
        let gate = open.clone();
        let held2 = held.clone();
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let Ok(server) = UnixStream::connect(&upstream).await else {
                    continue;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                conns.spawn(async move {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                });
                let mut gate = gate.subscribe();
                let held = held2.clone();
                conns.spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if !*gate.borrow() {
                            held.fetch_add(n, Ordering::SeqCst);
                            if gate.wait_for(|o| *o).await.is_err() {
                                break;
                            }
                        }
                        if sw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        GatedProxy {
            socket,
            open,
            held,
            task,
        }
    }

    pub fn set_open(&self, open: bool) {
        self.open.send_replace(open);
    }

    pub fn held_bytes(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }
}

impl Drop for GatedProxy {
    fn drop(&mut self) {
        self.task.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}
