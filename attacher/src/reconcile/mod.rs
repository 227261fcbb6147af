//! Attach and detach of one VolumeAttachment. Everything here is idempotent: a pass can
//! be cut short anywhere (timeout, crash, lost leadership) and the next pass, by this or
//! another instance, finishes the job.
//!
//! ## Layout
//!
//! - here: [`Ctx`], the public annotation and event-reason names, and the entry point
//!   [`Ctx::reconcile`], which picks attach or detach;
//! - `attach`: adding the finalizers and node-ID annotation, `ControllerPublishVolume`;
//! - `detach`: `ControllerUnpublishVolume` and letting the object go;
//! - `fence`: whether a detach sends `fence = true`;
//! - `resolve`: the CSI volume behind a VolumeAttachment and the CSI node ID of a node;
//! - `status`: conflict-tolerant status writes;
//! - `failure`: recording a failed attach or detach (status error, Warning event);
//! - `error`: [`ReconcileError`], why a pass failed;
//! - `pv_finalizer`: this driver's finalizer on PersistentVolumes, and the resync sweep;
//! - `published`: the resync's check of attachments against ListVolumes' published nodes;
//! - `enqueue`: which watch updates queue the object.

mod attach;
mod detach;
mod enqueue;
mod error;
mod failure;
mod fence;
mod published;
mod pv_finalizer;
mod resolve;
mod status;

use std::sync::{Arc, RwLock};

use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, PersistentVolume};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{CSINode, VolumeAttachment};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::kube::runtime::reflector::store::Writer;
use fencecsi_cluster::kube::runtime::reflector::Store;
use fencecsi_cluster::{object_ref, Api, EventRecorder, EventType};

use crate::config::Config;
use crate::csi::{Capabilities, Csi};
use crate::metrics::Metrics;

pub(crate) use enqueue::should_enqueue;
pub(crate) use error::ReconcileError;

/// On a VolumeAttachment: the CSI node ID it was published to, so a detach still knows
/// it after the Node and its CSINode are gone. Upstream external-attacher's name.
pub const VA_NODE_ID_ANNOTATION: &str = "csi.alpha.kubernetes.io/node-id";

/// Event reasons on VolumeAttachments.
pub const REASON_ATTACHED: &str = "Attached";
pub const REASON_ATTACH_FAILED: &str = "AttachFailed";
pub const REASON_DETACHED: &str = "Detached";
pub const REASON_DETACH_FAILED: &str = "DetachFailed";
pub const REASON_FENCED: &str = "Fenced";
/// The plugin no longer lists the volume as published to the node (see `published`).
pub const REASON_ATTACHMENT_LOST: &str = "AttachmentLost";

/// What one pass needs; shared by the workers of an instance.
pub(crate) struct Ctx {
    pub cfg: Config,
    pub driver: String,
    pub finalizer: String,
    pub csi: Csi,
    pub caps: RwLock<Capabilities>,
    pub metrics: Arc<Metrics>,
    pub events: Arc<EventRecorder>,
    pub vas: Api<VolumeAttachment>,
    pub pvs: Api<PersistentVolume>,
    pub nodes: Api<Node>,
    pub csinodes: Api<CSINode>,
    /// VolumeAttachments of this driver, as last seen on the watch (kube-runtime's
    /// reflector store, written only by the watch consumer in run.rs).
    pub cache: Store<VolumeAttachment>,
    /// The store's one writer: held by the watch of the current session.
    pub cache_writer: tokio::sync::Mutex<Writer<VolumeAttachment>>,
    /// Whether this session's watch has listed VolumeAttachments. Until it
    /// has, the cache is empty or left from an earlier session, and nothing
    /// may be concluded from what it lacks (a PV finalizer removed, an
    /// attachment judged lost).
    pub listed: std::sync::atomic::AtomicBool,
    /// Whether this instance may act (leads, or runs without election). Checked before
    /// every CSI call.
    pub may_act: Arc<dyn Fn() -> bool + Send + Sync>,
}

fn has_finalizer(meta: &ObjectMeta, f: &str) -> bool {
    meta.finalizers
        .as_ref()
        .is_some_and(|fs| fs.iter().any(|x| x == f))
}

fn now() -> Time {
    Time(Timestamp::now())
}

impl Ctx {
    pub(crate) fn caps(&self) -> Capabilities {
        *self.caps.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn is_ours(&self, va: &VolumeAttachment) -> bool {
        va.spec.attacher == self.driver
    }

    /// One pass over the VolumeAttachment `name`. `Err` means: retry with backoff.
    pub(crate) async fn reconcile(&self, name: &str) -> Result<(), ReconcileError> {
        let va = match self.vas.get_opt(name).await {
            Ok(Some(va)) => va,
            Ok(None) => return Ok(()),
            Err(e) => {
                return Err(ReconcileError::kube(
                    format!("reading VolumeAttachment {name}"),
                    e,
                ))
            }
        };
        if !self.is_ours(&va) {
            return Ok(());
        }
        if va.metadata.deletion_timestamp.is_some() {
            self.detach(va).await
        } else {
            self.attach(va).await
        }
    }

    fn event(&self, va: &VolumeAttachment, t: EventType, reason: &'static str, msg: String) {
        let regarding = object_ref(va);
        let rec = self.events.clone();
        tokio::spawn(async move {
            if let Err(e) = rec.record(&regarding, t, reason, &msg).await {
                tracing::debug!(error = %e, reason, "recording an event failed");
            }
        });
    }
}
