//! The attach-detach controller of kube-controller-manager, reduced to what decides when a
//! CSI volume moves between nodes. It keeps its **own view** of what is attached where
//! (the actual state of world), and that view, not the VolumeAttachments, is what it acts
//! on:
//!
//! - **Attach**: a volume a pod on a node needs gets a VolumeAttachment, unless the view
//!   has a ReadWriteOnce volume attached to another node: then the pod waits
//!   ("Multi-Attach error").
//! - **Detach**: a volume no pod on its node needs any more is detached (its
//!   VolumeAttachment deleted, then dropped from the view once gone) only when the node no
//!   longer lists it in `status.volumesInUse`, or the node has the out-of-service taint, or
//!   the node is not Ready and `max_wait_for_unmount` (6 minutes) has passed.
//! - **Verification**: a VolumeAttachment deleted by someone else leaves the volume in the
//!   view until the next sync, every `sync_period` (a minute by default).
//!
//! Pods still count while terminating, until they are deleted or have finished (`Failed`,
//! `Succeeded`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{
    VolumeAttachment, VolumeAttachmentSource, VolumeAttachmentSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::{ready_condition, SimHandle};
use fencecsi_cluster::well_known::{volume_attachment_name, OUT_OF_SERVICE_TAINT_KEY};
use fencecsi_cluster::Cluster;
use fencecsi_cluster::Result;
use fencecsi_cluster::{DeleteOptions, ListParams};

/// Timing and scope of an [`AttachDetach`].
#[derive(Debug, Clone)]
pub struct AttachDetachConfig {
    /// How often the reconciler runs (100 ms upstream).
    pub interval: Duration,
    /// `--attach-detach-reconcile-sync-period` (60 s upstream).
    pub sync_period: Duration,
    /// maxWaitForUnmountDuration (6 min upstream).
    pub max_wait_for_unmount: Duration,
    /// CSI drivers whose volumes it attaches (others are left to nobody).
    pub drivers: Vec<String>,
}

impl Default for AttachDetachConfig {
    fn default() -> Self {
        AttachDetachConfig {
            interval: Duration::from_millis(100),
            sync_period: Duration::from_secs(60),
            max_wait_for_unmount: Duration::from_secs(360),
            drivers: Vec::new(),
        }
    }
}

/// How the kubelet names a CSI volume in `status.volumesInUse`.
pub fn csi_unique_name(driver: &str, handle: &str) -> String {
    format!("kubernetes.io/csi/{driver}^{handle}")
}

#[derive(Debug, Clone)]
struct Attached {
    node: String,
    pv: String,
    unique: String,
    /// When no pod on the node needed it any more.
    unused_since: Option<Instant>,
    waiting_reported: bool,
}

#[derive(Debug, Default)]
struct State {
    /// VolumeAttachment name → attachment, as the controller believes.
    view: HashMap<String, Attached>,
    last_sync: Option<Instant>,
    /// (PV, node) pairs told "Multi-Attach error" and not yet resolved.
    multi_attach_reported: HashSet<(String, String)>,
    multi_attach_errors: usize,
}

/// A step of the model worth telling (the drill prints these).
pub type Say = Arc<dyn Fn(String) + Send + Sync>;

/// The attach-detach controller model.
#[derive(Clone)]
pub struct AttachDetach {
    cluster: Cluster,
    cfg: AttachDetachConfig,
    state: Arc<Mutex<State>>,
    say: Say,
}

/// A VolumeAttachment the model deletes, and why, for its message.
struct Detach {
    name: String,
    pv: String,
    node: String,
    /// Detached while still mounted, because of the out-of-service taint.
    forced: bool,
}

/// Objects by their name.
fn by_name<K: k8s_openapi::Metadata<Ty = ObjectMeta>>(items: Vec<K>) -> HashMap<String, K> {
    items
        .into_iter()
        .map(|o| (o.metadata().name.clone().unwrap_or_default(), o))
        .collect()
}

struct Wanted {
    driver: String,
    handle: String,
    single_node: bool,
}

impl AttachDetach {
    pub fn new(cluster: &Cluster, cfg: AttachDetachConfig) -> Self {
        AttachDetach {
            cluster: cluster.clone(),
            cfg,
            state: Arc::default(),
            say: Arc::new(|m| tracing::info!("attach-detach model: {m}")),
        }
    }

    /// Where its steps are told.
    pub fn with_say(mut self, say: Say) -> Self {
        self.say = say;
        self
    }

    /// How many times a pod had to wait because its volume was still attached elsewhere
    /// in the controller's view.
    pub fn multi_attach_errors(&self) -> usize {
        self.lock().multi_attach_errors
    }

    /// The nodes the controller believes `pv` attached to.
    pub fn attached_nodes(&self, pv: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .lock()
            .view
            .values()
            .filter(|a| a.pv == pv)
            .map(|a| a.node.clone())
            .collect();
        v.sort();
        v
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the pods need: (node, PV) → volume.
    async fn desired(&self) -> Result<HashMap<(String, String), Wanted>> {
        let pods = self
            .cluster
            .api::<Pod>(None)
            .list(&ListParams::default())
            .await?;
        let mut out = HashMap::new();
        let mut pvcs: HashMap<(String, String), Option<String>> = HashMap::new();
        for p in pods.items {
            let finished = p
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|ph| ph == "Failed" || ph == "Succeeded");
            let Some(node) = p.spec.as_ref().and_then(|s| s.node_name.clone()) else {
                continue;
            };
            if finished {
                continue;
            }
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            let claims = p
                .spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .filter_map(|v| {
                    v.persistent_volume_claim
                        .as_ref()
                        .map(|c| c.claim_name.clone())
                });
            for claim in claims {
                let key = (ns.clone(), claim.clone());
                if !pvcs.contains_key(&key) {
                    let pv = self
                        .cluster
                        .api::<PersistentVolumeClaim>(Some(&ns))
                        .get_opt(&claim)
                        .await?
                        .and_then(|c| c.spec)
                        .and_then(|s| s.volume_name);
                    pvcs.insert(key.clone(), pv);
                }
                let Some(pv_name) = pvcs[&key].clone() else {
                    continue;
                };
                let Some(pv) = self
                    .cluster
                    .api::<PersistentVolume>(None)
                    .get_opt(&pv_name)
                    .await?
                else {
                    continue;
                };
                let spec = pv.spec.unwrap_or_default();
                let Some(csi) = spec.csi else { continue };
                if !self.cfg.drivers.contains(&csi.driver) {
                    continue;
                }
                let modes = spec.access_modes.unwrap_or_default();
                let single_node = !modes.is_empty()
                    && !modes
                        .iter()
                        .any(|m| m == "ReadWriteMany" || m == "ReadOnlyMany");
                out.insert(
                    (node.clone(), pv_name),
                    Wanted {
                        driver: csi.driver,
                        handle: csi.volume_handle,
                        single_node,
                    },
                );
            }
        }
        Ok(out)
    }

    /// One round of the reconciler.
    pub async fn reconcile(&self) -> Result<()> {
        let now = Instant::now();
        let desired = self.desired().await?;
        let nodes: HashMap<String, Node> = by_name(
            self.cluster
                .api::<Node>(None)
                .list(&ListParams::default())
                .await?
                .items,
        );
        let vas = self.cluster.api::<VolumeAttachment>(None);
        let existing: HashMap<String, VolumeAttachment> =
            by_name(vas.list(&ListParams::default()).await?.items);
        // At start-up the view is filled from the attachments that exist.
        let adopted = if self.lock().last_sync.is_none() {
            self.adoptable(&existing).await?
        } else {
            Vec::new()
        };
        let mut say = Vec::new();
        let to_delete = {
            let mut st = self.lock();
            if st.last_sync.is_none() {
                st.view.extend(adopted);
            }
            self.verify(&mut st, now, &existing, &mut say);
            self.plan_detaches(&mut st, now, &desired, &nodes, &existing, &mut say)
        };
        for d in to_delete {
            match vas.delete(&d.name, &DeleteOptions::default()).await {
                Ok(_) => say.push(format!(
                    "detaching {} from {}{}: VolumeAttachment deleted",
                    d.pv,
                    d.node,
                    if d.forced {
                        " (forced: out-of-service taint)"
                    } else {
                        ""
                    }
                )),
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e),
            }
        }
        let to_create = self.plan_attaches(&mut self.lock(), &desired, &existing, &mut say);
        for va in to_create {
            let (pv, node) = (
                va.spec
                    .source
                    .persistent_volume_name
                    .clone()
                    .unwrap_or_default(),
                va.spec.node_name.clone(),
            );
            match vas.create(&va).await {
                Ok(_) => say.push(format!(
                    "attaching {pv} to {node}: VolumeAttachment created"
                )),
                Err(e) if e.is_already_exists() => {}
                Err(e) => return Err(e),
            }
        }
        for m in say {
            (self.say)(m);
        }
        Ok(())
    }

    /// The existing attachments of our drivers, not being deleted, as the view's entries.
    async fn adoptable(
        &self,
        existing: &HashMap<String, VolumeAttachment>,
    ) -> Result<Vec<(String, Attached)>> {
        let mut adopted = Vec::new();
        for (name, va) in existing {
            let Some(pv) = va.spec.source.persistent_volume_name.clone() else {
                continue;
            };
            if !self.cfg.drivers.contains(&va.spec.attacher)
                || va.metadata.deletion_timestamp.is_some()
            {
                continue;
            }
            let Some(csi) = self
                .cluster
                .api::<PersistentVolume>(None)
                .get_opt(&pv)
                .await?
                .and_then(|p| p.spec)
                .and_then(|s| s.csi)
            else {
                continue;
            };
            adopted.push((
                name.clone(),
                Attached {
                    node: va.spec.node_name.clone(),
                    pv,
                    unique: csi_unique_name(&csi.driver, &csi.volume_handle),
                    unused_since: None,
                    waiting_reported: false,
                },
            ));
        }
        Ok(adopted)
    }

    /// Verification, once a sync period: attachments whose VolumeAttachment is gone
    /// leave the view.
    fn verify(
        &self,
        st: &mut State,
        now: Instant,
        existing: &HashMap<String, VolumeAttachment>,
        say: &mut Vec<String>,
    ) {
        if st
            .last_sync
            .is_some_and(|t| now.duration_since(t) < self.cfg.sync_period)
        {
            return;
        }
        st.last_sync = Some(now);
        st.view.retain(|name, a| {
            let keep = existing.contains_key(name);
            if !keep {
                say.push(format!(
                    "verification: VolumeAttachment of {} on {} is gone: marked detached",
                    a.pv, a.node
                ));
            }
            keep
        });
    }

    /// Detaches what no pod on its node needs, when it may: returns the VolumeAttachments
    /// to delete, and drops from the view those already gone.
    fn plan_detaches(
        &self,
        st: &mut State,
        now: Instant,
        desired: &HashMap<(String, String), Wanted>,
        nodes: &HashMap<String, Node>,
        existing: &HashMap<String, VolumeAttachment>,
        say: &mut Vec<String>,
    ) -> Vec<Detach> {
        let mut to_delete = Vec::new();
        let mut detached = Vec::new();
        for (name, a) in st.view.iter_mut() {
            if desired.contains_key(&(a.node.clone(), a.pv.clone())) {
                a.unused_since = None;
                continue;
            }
            let since = *a.unused_since.get_or_insert(now);
            let node = nodes.get(&a.node);
            let mounted = node
                .and_then(|n| n.status.as_ref())
                .and_then(|s| s.volumes_in_use.as_ref())
                .is_some_and(|v| v.contains(&a.unique));
            let out_of_service = node
                .and_then(|n| n.spec.as_ref())
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|ts| ts.iter().any(|t| t.key == OUT_OF_SERVICE_TAINT_KEY));
            let healthy = node
                .and_then(ready_condition)
                .is_some_and(|c| c.status == "True");
            let timed_out = now.duration_since(since) > self.cfg.max_wait_for_unmount;
            if mounted && !out_of_service && (healthy || !timed_out) {
                if !a.waiting_reported {
                    a.waiting_reported = true;
                    say.push(format!(
                        "{} is unused on {} but still in its volumesInUse: waiting for the unmount",
                        a.pv, a.node
                    ));
                }
                continue;
            }
            match existing.get(name) {
                None => detached.push(name.clone()),
                Some(v) if v.metadata.deletion_timestamp.is_none() => to_delete.push(Detach {
                    name: name.clone(),
                    pv: a.pv.clone(),
                    node: a.node.clone(),
                    forced: out_of_service && mounted,
                }),
                Some(_) => {}
            }
        }
        for name in detached {
            if let Some(a) = st.view.remove(&name) {
                say.push(format!("{} detached from {}", a.pv, a.node));
            }
        }
        to_delete
    }

    /// Attaches what pods need, unless the view has it on another node: returns the
    /// VolumeAttachments to create (the view already counts them).
    fn plan_attaches(
        &self,
        st: &mut State,
        desired: &HashMap<(String, String), Wanted>,
        existing: &HashMap<String, VolumeAttachment>,
        say: &mut Vec<String>,
    ) -> Vec<VolumeAttachment> {
        let mut to_create = Vec::new();
        for ((node, pv), w) in desired {
            let name = volume_attachment_name(&w.handle, &w.driver, node);
            if st.view.contains_key(&name) {
                continue;
            }
            let elsewhere: Vec<String> = st
                .view
                .values()
                .filter(|a| &a.pv == pv && &a.node != node)
                .map(|a| a.node.clone())
                .collect();
            let key = (pv.clone(), node.clone());
            if w.single_node && !elsewhere.is_empty() {
                if st.multi_attach_reported.insert(key) {
                    st.multi_attach_errors += 1;
                    say.push(format!("Multi-Attach error for {pv} on {node}: still attached to {} in the controller's view", elsewhere.join(", ")));
                }
                continue;
            }
            st.multi_attach_reported.remove(&key);
            st.view.insert(
                name.clone(),
                Attached {
                    node: node.clone(),
                    pv: pv.clone(),
                    unique: csi_unique_name(&w.driver, &w.handle),
                    unused_since: None,
                    waiting_reported: false,
                },
            );
            if !existing.contains_key(&name) {
                to_create.push(VolumeAttachment {
                    metadata: ObjectMeta {
                        name: Some(name),
                        ..Default::default()
                    },
                    spec: VolumeAttachmentSpec {
                        attacher: w.driver.clone(),
                        node_name: node.clone(),
                        source: VolumeAttachmentSource {
                            persistent_volume_name: Some(pv.clone()),
                            ..Default::default()
                        },
                    },
                    status: None,
                });
            }
        }
        to_create
    }

    pub fn spawn(self) -> SimHandle {
        let every = self.cfg.interval;
        SimHandle::spawn(every, move || {
            let me = self.clone();
            Box::pin(async move {
                if let Err(e) = me.reconcile().await {
                    tracing::debug!(error = %e, "attach-detach model round failed");
                }
            })
        })
    }
}
