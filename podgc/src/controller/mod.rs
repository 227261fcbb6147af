//! The controller loop.
//!
//! One task owns everything: it applies watch events of Nodes, node Leases,
//! VolumeAttachments and CSIDrivers to small projections, and runs a *pass* when a relevant
//! event arrived (after a short debounce), when a NotReady node crosses its grace period,
//! and at least every `resync_interval`. Unfinished pods are watched but not kept: a pod of
//! a down node turning terminating (an eviction) triggers a pass, which lists the pods of
//! each node it acts on with the `spec.nodeName` field selector.
//!
//! ## Disruption mode, the out-of-service taint
//!
//! While more than `max_unhealthy_fraction` of the nodes are NotReady, podgc does nothing;
//! when that ends, every node still NotReady gets a fresh grace (its heartbeats may simply
//! not have arrived yet), as the node lifecycle controller does. The out-of-service taint
//! makes Kubernetes force-delete every pod on the node and force-detach every volume,
//! whatever the driver; podgc sets it only when all of that is fenced, and otherwise evicts
//! the fenced stateful pods itself (`pass::handle_node`).
//!
//! ## Quarantine and the clean report
//!
//! The node plugin reports the node clean (`fencecsi.io/node-clean`, an RFC 3339 time) after
//! a recovery pass that found nothing fenced, with the time that pass *started*. A report
//! taken before the attacher made the fences proves nothing: the node would then still hold
//! the frozen generations. So podgc re-stamps `fencecsi.io/quarantined-at` when it sees the
//! node's last VolumeAttachment of a safe-detach driver go (the attacher removes its
//! finalizer only after `ControllerUnpublishVolume(fence = true)` returned), marking that
//! with `podgc.fencecsi.io/fences-done`. A clean report counts only if it is newer than
//! that; reporters that find their report too old answer "report again" and the node
//! plugin does so after its next pass. Times are compared across clocks (the node's and
//! podgc's): keep them in sync (NTP), as Kubernetes itself expects.
//!
//! ## Layout
//!
//! - `run`: [`PodGc`], its handle, and the task loop that feeds the caches and times passes;
//! - `caches`: the projections the watches feed;
//! - `pass`: one pass: which nodes are down, disruption mode, what to lift and act on;
//! - `fast_path`: the node plugin's heartbeat confirmed by a kubelet probe;
//! - `classify`: which pods of a down node podgc may force-delete;
//! - `quarantine`: the taints and annotations podgc writes on a node;
//! - `delete`: force-deleting pods; `detach`: deleting the VolumeAttachments left behind;
//! - `lift`: when and how a quarantine ends;
//! - `events`: recording Events, one Warning per pod left alone.

mod caches;
mod classify;
mod delete;
mod detach;
mod events;
mod fast_path;
mod lift;
mod pass;
mod quarantine;
mod run;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use fencecsi_cluster::k8s_openapi::api::core::v1::ObjectReference;
use fencecsi_cluster::k8s_openapi::jiff::{SignedDuration, Timestamp};
use fencecsi_cluster::{Cluster, EventRecorder};

use crate::config::PodGcConfig;
use crate::metrics::Metrics;
use caches::Caches;
use fast_path::Probes;

pub use delete::{disrupt_and_delete, DeleteResult};
pub use pass::PassSummary;
pub use run::{PodGc, PodGcHandle};

fn now() -> Timestamp {
    Timestamp::now()
}

fn sd(d: Duration) -> SignedDuration {
    SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX)
}

/// The state of the controller task. Declared here, with private fields, so that every
/// submodule's `impl Runner` can reach them.
struct Runner {
    cluster: Cluster,
    cfg: PodGcConfig,
    metrics: Arc<Metrics>,
    recorder: EventRecorder,
    caches: Caches,
    /// Kubelet probes of nodes whose heartbeat stopped (`fast_path`).
    probes: Probes,
    in_disruption: bool,
    /// When podgc last restarted every node's clocks: when disruption mode ended, and
    /// when this instance started leading (it knows nothing of the time before; the node
    /// lifecycle controller restarts its timers then too). No node's grace starts
    /// earlier: a node NotReady since an outage began may be one whose heartbeats have
    /// simply not arrived yet, and a standby that takes over after an outage must not
    /// act on it at once.
    clocks_restarted: Option<Timestamp>,
    /// Pod UIDs already warned about (per node), so a skipped pod gets one Event.
    warned: HashMap<String, HashSet<String>>,
    /// Nodes told about (Event) why the out-of-service taint stays off them.
    oos_withheld: HashSet<String>,
    seq: u64,
    lease_ref: ObjectReference,
}
