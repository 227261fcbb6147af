//! Configuration of the controller (the binary's flags map onto this).

use std::time::Duration;

use fencecsi_cluster::cli::default_duration;
use fencecsi_cluster::LeaderElectionConfig;

/// The binary's name: the fallback of its default identity, and its Lease's default name.
pub const NAME: &str = "fencecsi-podgc";

// Defaults the flags (src/main.rs) and [`PodGcConfig::default`] share.
pub const DEFAULT_SHUTDOWN_GRACE: &str = "30s";
pub const DEFAULT_NODE_LEASE_GRACE: &str = "15s";
pub const DEFAULT_MAX_UNHEALTHY_FRACTION: f64 = 0.55;
pub const DEFAULT_RESYNC_INTERVAL: &str = "5s";
pub const DEFAULT_HEARTBEAT_GRACE: &str = "2s";
pub const DEFAULT_KUBELET_PROBE_TIMEOUT: &str = "1s";
/// The namespace the node plugins' heartbeat Leases are in when none is given: deploy/base's.
pub const DEFAULT_HEARTBEAT_NAMESPACE: &str = "fencecsi";

/// The fast path: a node is down when its node plugin's heartbeat stopped *and* its kubelet
/// does not answer a TLS handshake. Either signal alone can lie (a crashed node plugin, an
/// API server that is slow, a kubelet restarting); both at once mean the node is frozen,
/// dead or cut off from podgc and from the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatConfig {
    /// Where the heartbeat Leases are (`fencecsi.io/heartbeat=node`, one per node).
    pub namespace: String,
    /// A heartbeat not renewed for this long (podgc's clock, from when it saw the last
    /// renewal) makes podgc probe the node's kubelet. The node plugin renews every second
    /// in deploy/base, so 2 s is one missed renewal plus latency.
    pub grace: Duration,
    /// Bound of one kubelet probe (connect and TLS handshake).
    pub probe_timeout: Duration,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        HeartbeatConfig {
            namespace: DEFAULT_HEARTBEAT_NAMESPACE.into(),
            grace: default_duration(DEFAULT_HEARTBEAT_GRACE),
            probe_timeout: default_duration(DEFAULT_KUBELET_PROBE_TIMEOUT),
        }
    }
}

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
    /// The fast path ([`HeartbeatConfig`]); `None`: off. A node without a heartbeat Lease
    /// (no node plugin, or one that does not beat) is never acted on by it.
    pub heartbeat: Option<HeartbeatConfig>,
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
            shutdown_grace: default_duration(DEFAULT_SHUTDOWN_GRACE),
            node_lease_grace: Some(default_duration(DEFAULT_NODE_LEASE_GRACE)),
            heartbeat: Some(HeartbeatConfig::default()),
            max_unhealthy_fraction: DEFAULT_MAX_UNHEALTHY_FRACTION,
            out_of_service_taint: false,
            resync_interval: default_duration(DEFAULT_RESYNC_INTERVAL),
            debounce: Duration::from_millis(50),
            identity: fencecsi_cluster::cli::default_identity(NAME),
            leader_election: None,
        }
    }
}

/// What [`PodGcConfig::validate`] rejects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("max_unhealthy_fraction must be in (0, 1]")]
    MaxUnhealthyFraction,
    #[error("resync_interval must be > 0")]
    ZeroResyncInterval,
    #[error("identity must not be empty")]
    EmptyIdentity,
    #[error("the heartbeat grace and the kubelet probe timeout must be > 0")]
    ZeroHeartbeatTiming,
    #[error("the heartbeat namespace must not be empty")]
    EmptyHeartbeatNamespace,
}

impl PodGcConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.max_unhealthy_fraction > 0.0 && self.max_unhealthy_fraction <= 1.0) {
            return Err(ConfigError::MaxUnhealthyFraction);
        }
        if self.resync_interval.is_zero() {
            return Err(ConfigError::ZeroResyncInterval);
        }
        if self.identity.is_empty() {
            return Err(ConfigError::EmptyIdentity);
        }
        if let Some(h) = &self.heartbeat {
            if h.grace.is_zero() || h.probe_timeout.is_zero() {
                return Err(ConfigError::ZeroHeartbeatTiming);
            }
            if h.namespace.is_empty() {
                return Err(ConfigError::EmptyHeartbeatNamespace);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The binary reports these texts as they are.
    #[test]
    fn validate_names_what_is_wrong() {
        let ok = PodGcConfig::default();
        assert_eq!(ok.validate(), Ok(()));
        let mut c = ok.clone();
        c.max_unhealthy_fraction = 0.0;
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "max_unhealthy_fraction must be in (0, 1]"
        );
        let mut c = ok.clone();
        c.resync_interval = Duration::ZERO;
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "resync_interval must be > 0"
        );
        let mut c = ok.clone();
        c.heartbeat.as_mut().unwrap().probe_timeout = Duration::ZERO;
        assert_eq!(c.validate(), Err(ConfigError::ZeroHeartbeatTiming));
        let mut c = ok.clone();
        c.heartbeat.as_mut().unwrap().namespace.clear();
        assert_eq!(c.validate(), Err(ConfigError::EmptyHeartbeatNamespace));
        let mut c = ok;
        c.identity.clear();
        assert_eq!(c.validate(), Err(ConfigError::EmptyIdentity));
        assert_eq!(
            ConfigError::EmptyIdentity.to_string(),
            "identity must not be empty"
        );
    }
}
