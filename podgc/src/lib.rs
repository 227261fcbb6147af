//! fencecsi podgc: the pod garbage collector of the non-graceful node shutdown proposal.
//!
//! When a node has shut down or is cut off (its `Ready` condition is `False`/`Unknown` for
//! longer than a grace period, or, where no node lifecycle controller runs, its Lease in
//! `kube-node-lease` went stale), the pods on it that were already being deleted hang in
//! `Terminating`: no kubelet will ever confirm they stopped. podgc:
//!
//! 1. selects those terminating pods whose every volume is safe to take away from a node
//!    that may still be running: CSI volumes of drivers whose CSIDriver object carries
//!    `fencecsi.io/safe-detach: "true"` (they fence on detach), never ReadWriteMany. Pods
//!    without any persistent volume are selected too: they hold nothing that could be
//!    written twice, and a StatefulSet cannot replace them while they exist. Pods with a
//!    volume that cannot be fenced (another driver, in-tree or inline network volumes,
//!    ReadWriteMany, an unresolvable claim) are left alone, with a Warning Event saying why;
//! 2. quarantines the node with the `fencecsi.io/quarantine=node-shutdown:NoSchedule` taint
//!    and the `fencecsi.io/quarantined-at` annotation (optionally also the
//!    `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute` taint, so a real
//!    kube-controller-manager cooperates) before it deletes anything;
//! 3. gives each selected pod a `DisruptionTarget` condition (reason `DeletionByPodGC`) and
//!    force-deletes it (grace 0, UID precondition: a re-created pod of the same name is
//!    never deleted);
//! 4. deletes the VolumeAttachments of safe-detach drivers on that node whose volume no pod
//!    left on the node uses, so the attacher detaches them with `fence = true`;
//! 5. lifts the quarantine (and its own out-of-service taint) only when the node is Ready
//!    again, no VolumeAttachment of a safe-detach driver names it, and its node plugin
//!    reported it clean (`fencecsi.io/node-clean`) after the quarantine: see
//!    [`controller`] for how "after" is made safe against a report taken before the fence;
//! 6. does nothing while more than `max_unhealthy_fraction` of the nodes are NotReady (the
//!    node lifecycle controller's disruption mode: the likely fault is the control plane's
//!    network, not the nodes).
//!
//! The same code runs on a real API server ([`fencecsi_cluster::Cluster::kube`]) and on the
//! embedded cluster (tests, the benchmark in `benches/scale.rs`, the drill). It keeps small
//! projections of Nodes, node Leases, VolumeAttachments and CSIDrivers from watches, and
//! lists pods only for the nodes it acts on, through the `spec.nodeName` field selector
//! (indexed in the embedded cluster, served from the watch cache by a real API server): no
//! full pod list, ever.

pub mod config;
pub mod controller;
mod error;
pub mod http;
pub mod kubelet_probe;
pub mod metrics;
pub mod volumes;

pub use config::{ConfigError, PodGcConfig};
pub use controller::{disrupt_and_delete, DeleteResult, PassSummary, PodGc, PodGcHandle};
pub use error::{Error, Result};
pub use metrics::Metrics;

/// Annotations podgc keeps on a quarantined node besides the shared ones in
/// [`fencecsi_cluster::well_known`].
pub mod annotations {
    /// podgc added the out-of-service taint (so it removes it again when it lifts the
    /// quarantine; a taint an administrator set stays).
    pub const OUT_OF_SERVICE_ADDED: &str = "podgc.fencecsi.io/out-of-service-added";
    /// podgc saw the node's last VolumeAttachment of a safe-detach driver go (its fences
    /// are done) and re-stamped `fencecsi.io/quarantined-at` then.
    pub const FENCES_DONE: &str = "podgc.fencecsi.io/fences-done";
}

/// The `reportingController` of podgc's Events.
pub const CONTROLLER_NAME: &str = "fencecsi.io/podgc";
