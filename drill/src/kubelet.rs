//! A mini kubelet per node. For the pods bound to its node: waits until the pod's
//! VolumeAttachment is attached, NodeStage + NodePublish through its node plugin, starts
//! the "container" (a writer process on the published dir) and marks the pod Running. For
//! pods being deleted (or gone): kills the container, NodeUnpublish, NodeUnstage, and
//! finishes the deletion. It lists what it has staged, or is about to stage, in the
//! node's `status.volumesInUse` (before the mount, as the kubelet does): the attach-detach
//! controller does not detach a volume listed there. A stopped kubelet does nothing at
//! all; its containers keep running, its node plugin keeps serving and its last
//! `volumesInUse` stays (the partitioned node).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Context};
use fencecsi_cluster::k8s_openapi::api::core::v1::Node;
use fencecsi_cluster::k8s_openapi::api::core::v1::{
    PersistentVolume, PersistentVolumeClaim, Pod, PodCondition, PodStatus,
};
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::well_known::{volume_attachment_name, DRIVER_NAME};
use fencecsi_cluster::{Cluster, DeleteOptions, ListParams};
use fencecsi_embedded_cluster::sim::attach_detach::csi_unique_name;
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::rig::retry_aborted;
use fencecsi_tests::{csi, mount_cap, Access};
use sha2::{Digest, Sha256};

use crate::procs::{Container, Procs};
use crate::{Progress, RECORDS_FILE};

/// A pod whose volume a kubelet published and whose container it started.
#[derive(Clone, Debug)]
pub struct Published {
    pub pod: String,
    pub uid: String,
    pub node: String,
    pub pv: String,
    pub handle: String,
    pub generation: u64,
    pub target: PathBuf,
    /// The records file as found when the container started (before it wrote anything).
    pub found: Arc<Vec<u8>>,
    pub acked: Arc<AtomicI64>,
    pub errors: Arc<AtomicU64>,
    pub resumed_at: Arc<AtomicI64>,
}

/// What all kubelets share with the scenario.
#[derive(Clone, Default)]
pub struct Board {
    pub published: Arc<Mutex<Vec<Published>>>,
}

impl Board {
    pub fn by_uid(&self, uid: &str) -> Option<Published> {
        self.published
            .lock()
            .unwrap()
            .iter()
            .find(|p| p.uid == uid)
            .cloned()
    }
}

/// A pod's volume as the kubelet stages and publishes it.
struct AttachedVolume {
    pv_name: String,
    handle: String,
    publish_context: HashMap<String, String>,
    volume_context: HashMap<String, String>,
    generation: u64,
    cap: csi::VolumeCapability,
}

struct Started {
    container: Container,
    handle: String,
    volume_id: String,
    target: PathBuf,
    pod_dir: PathBuf,
}

#[derive(Default)]
struct State {
    started: HashMap<String, Started>,
    /// volume handle → staging path
    staged: HashMap<String, PathBuf>,
    last_err: HashMap<String, String>,
    /// The node's `volumesInUse` as last written.
    reported: Option<BTreeSet<String>>,
}

pub struct Kubelet {
    running: Arc<AtomicBool>,
    state: Arc<tokio::sync::Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
    node: String,
    progress: Progress,
}

struct Ctx {
    cluster: Cluster,
    node: String,
    dir: PathBuf,
    client: CsiClient,
    board: Board,
    procs: Procs,
    exe: PathBuf,
    interval_ms: u64,
    progress: Progress,
}

impl Kubelet {
    #[allow(clippy::too_many_arguments)]
    pub fn spawn(
        cluster: &Cluster,
        node: &str,
        kubelet_dir: PathBuf,
        client: CsiClient,
        board: Board,
        procs: Procs,
        exe: PathBuf,
        interval_ms: u64,
        progress: Progress,
    ) -> Kubelet {
        let running = Arc::new(AtomicBool::new(true));
        let state = Arc::new(tokio::sync::Mutex::new(State::default()));
        let ctx = Ctx {
            cluster: cluster.clone(),
            node: node.to_string(),
            dir: kubelet_dir,
            client,
            board,
            procs,
            exe,
            interval_ms,
            progress: progress.clone(),
        };
        let (r, s) = (running.clone(), state.clone());
        let task = tokio::spawn(async move {
            loop {
                if r.load(Ordering::SeqCst) {
                    let mut st = s.lock().await;
                    if r.load(Ordering::SeqCst) {
                        if let Err(e) = ctx.tick(&mut st).await {
                            tracing::debug!(node = %ctx.node, error = %e, "kubelet tick");
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Kubelet {
            running,
            state,
            task,
            node: node.to_string(),
            progress,
        }
    }

    /// The node shuts down: the kubelet stops acting. Containers keep running.
    pub fn stop(&self) {
        self.running.store(false, Ordering::SeqCst);
    }

    /// The node reboots: its containers die, the kubelet forgets what it had started
    /// (mounts are left for the node plugin's recovery), and starts again.
    pub async fn reboot(&self) -> usize {
        self.running.store(false, Ordering::SeqCst);
        let mut st = self.state.lock().await;
        let n = st.started.len();
        for (_, s) in st.started.drain() {
            s.container.kill().await;
        }
        st.staged.clear();
        st.last_err.clear();
        st.reported = None;
        drop(st);
        self.progress.say(format!(
            "kubelet {}: rebooted; {n} container(s) killed, kubelet running again",
            self.node
        ));
        self.running.store(true, Ordering::SeqCst);
        n
    }

    /// Stops the loop and kills every container (end of the drill).
    pub async fn shutdown(self) {
        self.running.store(false, Ordering::SeqCst);
        self.task.abort();
        let mut st = self.state.lock().await;
        for (_, s) in st.started.drain() {
            s.container.kill().await;
        }
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn staging_path(dir: &Path, handle: &str) -> PathBuf {
    dir.join("plugins/kubernetes.io/csi")
        .join(DRIVER_NAME)
        .join(hex::encode(Sha256::digest(handle.as_bytes())))
        .join("globalmount")
}

fn claim_of(p: &Pod) -> Option<String> {
    p.spec
        .as_ref()?
        .volumes
        .as_ref()?
        .iter()
        .find_map(|v| v.persistent_volume_claim.as_ref())
        .map(|c| c.claim_name.clone())
}

impl Ctx {
    async fn tick(&self, st: &mut State) -> anyhow::Result<()> {
        let pods = self
            .cluster
            .api::<Pod>(None)
            .list(&ListParams::default().fields(&format!("spec.nodeName={}", self.node)))
            .await?
            .items;
        let mut present = HashSet::new();
        for p in &pods {
            let uid = p.metadata.uid.clone().unwrap_or_default();
            let name = p.metadata.name.clone().unwrap_or_default();
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            present.insert(uid.clone());
            if p.metadata.deletion_timestamp.is_some() {
                if let Some(s) = st.started.remove(&uid) {
                    self.teardown(st, s, &name).await;
                }
                match self
                    .cluster
                    .api::<Pod>(Some(&ns))
                    .delete(&name, &DeleteOptions::force().with_uid(&uid))
                    .await
                {
                    Ok(_) => self.progress.say(format!(
                        "kubelet {}: pod {name} stopped, deletion finished",
                        self.node
                    )),
                    Err(e) if e.is_not_found() || e.is_conflict() => {}
                    Err(e) => return Err(e.into()),
                }
            } else if !st.started.contains_key(&uid) {
                match self.start(st, p).await {
                    Ok(()) => {
                        st.last_err.remove(&uid);
                    }
                    Err(e) => {
                        let msg = format!("{e:#}");
                        if st.last_err.get(&uid) != Some(&msg) {
                            if !msg.starts_with("waiting") {
                                self.progress
                                    .say(format!("kubelet {}: pod {name}: {msg}", self.node));
                            }
                            st.last_err.insert(uid.clone(), msg);
                        }
                    }
                }
            }
        }
        let gone: Vec<String> = st
            .started
            .keys()
            .filter(|u| !present.contains(*u))
            .cloned()
            .collect();
        for uid in gone {
            let s = st.started.remove(&uid).unwrap();
            self.teardown(st, s, &uid).await;
        }
        self.report_in_use(st, None).await
    }

    /// Writes the node's `volumesInUse`: what is staged, and `staging` (about to be).
    async fn report_in_use(&self, st: &mut State, staging: Option<&str>) -> anyhow::Result<()> {
        let want: BTreeSet<String> = st
            .staged
            .keys()
            .map(String::as_str)
            .chain(staging)
            .map(|h| csi_unique_name(DRIVER_NAME, h))
            .collect();
        if st.reported.as_ref() == Some(&want) {
            return Ok(());
        }
        self.cluster
            .api::<Node>(None)
            .patch_status_merge(
                &self.node,
                &serde_json::json!({ "status": { "volumesInUse": want } }),
            )
            .await?;
        st.reported = Some(want);
        Ok(())
    }

    async fn start(&self, st: &mut State, p: &Pod) -> anyhow::Result<()> {
        let uid = p.metadata.uid.clone().unwrap_or_default();
        let name = p.metadata.name.clone().unwrap_or_default();
        let ns = p.metadata.namespace.clone().unwrap_or_default();
        let v = self.attached_volume(p, &ns).await?;
        let staging = staging_path(&self.dir, &v.handle);
        if !st.staged.contains_key(&v.handle) {
            self.report_in_use(st, Some(&v.handle)).await?;
            self.stage(&v, &staging).await?;
            st.staged.insert(v.handle.clone(), staging.clone());
            self.progress.say(format!(
                "kubelet {}: staged {} (generation {})",
                self.node, v.pv_name, v.generation
            ));
        }
        let pod_dir = self.dir.join("pods").join(&uid);
        let target = pod_dir
            .join("volumes/kubernetes.io~csi")
            .join(&v.pv_name)
            .join("mount");
        std::fs::create_dir_all(target.parent().unwrap())?;
        self.publish(&v, &staging, &target).await?;
        let file = target.join(RECORDS_FILE);
        let found = std::fs::read(&file).unwrap_or_default();
        let container = Container::spawn(&self.procs, &self.exe, &file, self.interval_ms)?;
        self.board.published.lock().unwrap().push(Published {
            pod: name.clone(),
            uid: uid.clone(),
            node: self.node.clone(),
            pv: v.pv_name.clone(),
            handle: v.handle.clone(),
            generation: v.generation,
            target: target.clone(),
            found: Arc::new(found),
            acked: container.acked.clone(),
            errors: container.errors.clone(),
            resumed_at: container.started_at_seq.clone(),
        });
        st.started.insert(
            uid.clone(),
            Started {
                container,
                handle: v.handle.clone(),
                volume_id: v.handle.clone(),
                target,
                pod_dir,
            },
        );
        self.progress.say(format!(
            "kubelet {}: published {} for pod {name} (uid {}), container started",
            self.node,
            v.pv_name,
            &uid[..8.min(uid.len())]
        ));
        self.mark_running(&ns, &name, &uid).await
    }

    /// The pod's volume, once its claim is bound and its VolumeAttachment attached to
    /// this node; an error says what is still awaited.
    async fn attached_volume(&self, p: &Pod, ns: &str) -> anyhow::Result<AttachedVolume> {
        let claim = claim_of(p).ok_or_else(|| anyhow!("no PVC volume"))?;
        let pvc = self
            .cluster
            .api::<PersistentVolumeClaim>(Some(ns))
            .get_opt(&claim)
            .await?
            .ok_or_else(|| anyhow!("waiting for PVC {claim}"))?;
        let pv_name = pvc
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .ok_or_else(|| anyhow!("waiting for PVC {claim} to be bound"))?;
        let pv = self
            .cluster
            .api::<PersistentVolume>(None)
            .get(&pv_name)
            .await?;
        let csi_src = pv
            .spec
            .as_ref()
            .and_then(|s| s.csi.clone())
            .ok_or_else(|| anyhow!("PV {pv_name} is not a CSI volume"))?;
        if csi_src.driver != DRIVER_NAME {
            return Err(anyhow!(
                "waiting: driver {} has no node plugin here",
                csi_src.driver
            ));
        }
        let handle = csi_src.volume_handle.clone();
        let va_name = volume_attachment_name(&handle, &csi_src.driver, &self.node);
        let va = self
            .cluster
            .api::<VolumeAttachment>(None)
            .get_opt(&va_name)
            .await?
            .ok_or_else(|| anyhow!("waiting for VolumeAttachment"))?;
        let status = va.status.unwrap_or_default();
        if !status.attached || va.metadata.deletion_timestamp.is_some() {
            return Err(anyhow!("waiting for attach"));
        }
        let publish_context: HashMap<String, String> = status
            .attachment_metadata
            .unwrap_or_default()
            .into_iter()
            .collect();
        let generation: u64 = publish_context
            .get(fencecsi_driver::terms::CTX_GENERATION)
            .and_then(|g| g.parse().ok())
            .unwrap_or(0);
        Ok(AttachedVolume {
            cap: mount_cap(
                Access::SingleNodeWriter,
                csi_src.fs_type.as_deref().unwrap_or("ext4"),
            ),
            volume_context: csi_src
                .volume_attributes
                .clone()
                .unwrap_or_default()
                .into_iter()
                .collect(),
            pv_name,
            handle,
            publish_context,
            generation,
        })
    }

    async fn stage(&self, v: &AttachedVolume, staging: &Path) -> anyhow::Result<()> {
        retry_aborted(|| {
            let mut c = self.client.clone();
            let req = csi::NodeStageVolumeRequest {
                volume_id: v.handle.clone(),
                publish_context: v.publish_context.clone(),
                staging_target_path: staging.to_string_lossy().into(),
                volume_capability: Some(v.cap.clone()),
                volume_context: v.volume_context.clone(),
                ..Default::default()
            };
            async move { c.node.node_stage_volume(req).await }
        })
        .await
        .context("NodeStageVolume")?;
        Ok(())
    }

    async fn publish(
        &self,
        v: &AttachedVolume,
        staging: &Path,
        target: &Path,
    ) -> anyhow::Result<()> {
        retry_aborted(|| {
            let mut c = self.client.clone();
            let req = csi::NodePublishVolumeRequest {
                volume_id: v.handle.clone(),
                publish_context: v.publish_context.clone(),
                staging_target_path: staging.to_string_lossy().into(),
                target_path: target.to_string_lossy().into(),
                volume_capability: Some(v.cap.clone()),
                volume_context: v.volume_context.clone(),
                ..Default::default()
            };
            async move { c.node.node_publish_volume(req).await }
        })
        .await
        .context("NodePublishVolume")?;
        Ok(())
    }

    /// Running + Ready, unless the pod is gone or was replaced meanwhile.
    async fn mark_running(&self, ns: &str, name: &str, uid: &str) -> anyhow::Result<()> {
        let pods = self.cluster.api::<Pod>(Some(ns));
        for _ in 0..5 {
            let Some(mut cur) = pods.get_opt(name).await? else {
                break;
            };
            if cur.metadata.uid.as_deref() != Some(uid) {
                break;
            }
            cur.status = Some(PodStatus {
                phase: Some("Running".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: "True".into(),
                    ..Default::default()
                }]),
                ..Default::default()
            });
            match pods.replace_status(&cur).await {
                Ok(_) => break,
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    async fn teardown(&self, st: &mut State, s: Started, what: &str) {
        s.container.kill().await;
        let r = retry_aborted(|| {
            let mut c = self.client.clone();
            let req = csi::NodeUnpublishVolumeRequest {
                volume_id: s.volume_id.clone(),
                target_path: s.target.to_string_lossy().into(),
                force: false,
            };
            async move { c.node.node_unpublish_volume(req).await }
        })
        .await;
        if let Err(e) = r {
            self.progress.say(format!(
                "kubelet {}: NodeUnpublish for {what}: {e}",
                self.node
            ));
        }
        let _ = std::fs::remove_dir_all(&s.pod_dir);
        let still_used = st.started.values().any(|o| o.handle == s.handle);
        if !still_used {
            if let Some(staging) = st.staged.remove(&s.handle) {
                let r = retry_aborted(|| {
                    let mut c = self.client.clone();
                    let req = csi::NodeUnstageVolumeRequest {
                        volume_id: s.volume_id.clone(),
                        staging_target_path: staging.to_string_lossy().into(),
                        force: false,
                    };
                    async move { c.node.node_unstage_volume(req).await }
                })
                .await;
                if let Err(e) = r {
                    self.progress.say(format!(
                        "kubelet {}: NodeUnstage for {what}: {e}",
                        self.node
                    ));
                }
            }
        }
    }
}
