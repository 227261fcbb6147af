//! Configuration of the controller (the binary's flags map onto this).

use std::time::Duration;

use fencecsi_cluster::LeaderElectionConfig;

/// What podgc does and when.
#[derive(Debug, Clone)]
pub struct PodGcConfig {
    /// How long a node's Ready condition must have been False/Unknown (from its
    /// lastTransitionTime) before podgc acts on it.
    pub shutdown_grace: Duration,
    /// A node whose Lease in kube-node-lease was not renewed for this long is down, and
    /// podgc acts on it then (no shutdown grace on top). Measured on podgc's own clock,
    /// from when it saw the last renewal. `None`: leases are ignored, and only the Ready
    /// condition counts (NotReady comes after the node lifecycle controller's own grace,
    /// 40-50 s).
    ///
    /// Default 15 s: the kubelet renews every 10 s, so a live node is never more than one
    /// renewal plus its latency behind, and a dead one is seen 5-15 s after it stopped.
    /// Acting on a node that is only slow is safe: the fence stops its writes, and the
    /// cost is a pod restart.
    pub node_lease_grace: Option<Duration>,
    /// Disruption mode: while more than this fraction of all nodes is NotReady, podgc
    /// does nothing.
    pub max_unhealthy_fraction: f64,
    /// Also taint quarantined nodes `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`.
    pub out_of_service_taint: bool,
    /// A full pass at least this often, even when no watch event arrives.
    pub resync_interval: Duration,
    /// Delay between a relevant watch event (node readiness, taints, annotations,
    /// attachments) and the pass it triggers, so bursts of events make one pass.
    pub debounce: Duration,
    /// Name of this instance (Events' reportingInstance, leader identity).
    pub identity: String,
    /// `None`: act without leader election (one replica, tests).
    pub leader_election: Option<LeaderElectionConfig>,
}

impl Default for PodGcConfig {
    fn default() -> Self {
        PodGcConfig {
            shutdown_grace: Duration::from_secs(30),
            node_lease_grace: Some(Duration::from_secs(15)),
            max_unhealthy_fraction: 0.55,
            out_of_service_taint: false,
            resync_interval: Duration::from_secs(5),
            debounce: Duration::from_millis(50),
            identity: default_identity(),
            leader_election: None,
        }
    }
}

/// See [`fencecsi_cluster::cli::default_identity`].
pub fn default_identity() -> String {
    fencecsi_cluster::cli::default_identity("podgc")
}

impl PodGcConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.max_unhealthy_fraction > 0.0 && self.max_unhealthy_fraction <= 1.0) {
            return Err("max_unhealthy_fraction must be in (0, 1]".into());
        }
        if self.resync_interval.is_zero() {
            return Err("resync_interval must be > 0".into());
        }
        if self.identity.is_empty() {
            return Err("identity must not be empty".into());
        }
        Ok(())
    }
}
