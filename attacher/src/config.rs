//! The controller's configuration (library side; the binary maps its flags onto it).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// When `ControllerUnpublishVolume` is sent with `fence = true`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum FencePolicy {
    /// Fence when the plugin advertises `UNPUBLISH_FENCE` and the node may still be
    /// writing: its Node object is gone, it is not Ready, it carries the quarantine or
    /// out-of-service taint, or it still lists the volume in `status.volumesInUse`.
    #[default]
    Auto,
    /// Fence every detach (when the plugin advertises `UNPUBLISH_FENCE`).
    Always,
    /// Never fence.
    Never,
}

impl std::fmt::Display for FencePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FencePolicy::Auto => "auto",
            FencePolicy::Always => "always",
            FencePolicy::Never => "never",
        })
    }
}

/// Per-object exponential backoff: `initial`, doubling on every consecutive failure of
/// the same object, capped at `max`; reset by a success.
///
/// Hand-rolled (a multiply and a `min`, plus a failure count per key in the work queue):
/// the `backoff` crate is unmaintained (RUSTSEC-2025-0012) and keys nothing by object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for Backoff {
    /// 1 s doubling to 5 min, as external-attacher.
    fn default() -> Self {
        Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
        }
    }
}

impl Backoff {
    /// Delay before the retry that follows `failures` consecutive failures (1 = first).
    pub fn delay(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(32);
        let factor = 1u64 << exp;
        let ns = (self.initial.as_nanos() as u64).saturating_mul(factor);
        Duration::from_nanos(ns).min(self.max)
    }
}

/// Leader election on a coordination.k8s.io/v1 Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderElection {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Lease name; `None`: `external-attacher-leader-<driver>` (dots and slashes as
    /// dashes), the name upstream's external-attacher uses.
    pub lease_name: Option<String>,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
    /// How long the election may get no answer before /healthz reports unhealthy.
    pub unhealthy_after: Duration,
}

impl LeaderElection {
    /// client-go's timings (15 s / 10 s / 2 s).
    pub fn new(namespace: &str) -> Self {
        LeaderElection {
            namespace: namespace.to_string(),
            lease_name: None,
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            unhealthy_after: fencecsi_cluster::ELECTION_UNHEALTHY_AFTER,
        }
    }

    /// The Lease name for `driver`.
    pub fn lease_name_for(&self, driver: &str) -> String {
        self.lease_name.clone().unwrap_or_else(|| {
            let sanitized: String = driver
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' {
                        c.to_ascii_lowercase()
                    } else {
                        '-'
                    }
                })
                .collect();
            format!("external-attacher-leader-{sanitized}")
        })
    }
}

/// Configuration of one attacher instance.
#[derive(Debug, Clone)]
pub struct Config {
    /// The controller plugin's unix socket.
    pub csi_socket: PathBuf,
    /// Worker tasks; each processes one VolumeAttachment at a time.
    pub workers: usize,
    /// Bound on every CSI call.
    pub timeout: Duration,
    /// How often every VolumeAttachment is queued again.
    pub resync: Duration,
    pub fence: FencePolicy,
    /// Retry backoff per VolumeAttachment (also paces the start-up wait for the plugin).
    pub backoff: Backoff,
    /// `None`: this instance is active as soon as it has started.
    pub leader_election: Option<LeaderElection>,
    /// Where `/healthz` and `/metrics` are served; `None`: not served. Port 0 picks a
    /// free port (see [`crate::Status::http_addr`]).
    pub http_endpoint: Option<SocketAddr>,
    /// This instance's identity: the Lease holder and the events' reporting instance.
    pub identity: String,
    /// On shutdown, how long in-flight operations may take before they are abandoned.
    pub shutdown_grace: Duration,
}

impl Config {
    /// Defaults as the binary's: 10 workers, 30 s timeout, 60 s resync, fence auto,
    /// 1 s → 5 min backoff, no leader election, no HTTP endpoint, 30 s shutdown grace.
    pub fn new(csi_socket: impl Into<PathBuf>) -> Self {
        Config {
            csi_socket: csi_socket.into(),
            workers: 10,
            timeout: Duration::from_secs(30),
            resync: Duration::from_secs(60),
            fence: FencePolicy::Auto,
            backoff: Backoff::default(),
            leader_election: None,
            http_endpoint: None,
            identity: default_identity(),
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// See [`fencecsi_cluster::cli::default_identity`].
pub fn default_identity() -> String {
    fencecsi_cluster::cli::default_identity("fencecsi-attacher")
}

/// The duration parser every fencecsi binary shares.
pub use fencecsi_cluster::cli::parse_duration;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_initial_and_caps() {
        let b = Backoff::default();
        assert_eq!(b.delay(1), Duration::from_secs(1));
        assert_eq!(b.delay(2), Duration::from_secs(2));
        assert_eq!(b.delay(5), Duration::from_secs(16));
        assert_eq!(b.delay(9), Duration::from_secs(256));
        assert_eq!(b.delay(10), Duration::from_secs(300));
        assert_eq!(b.delay(1000), Duration::from_secs(300));
    }

    #[test]
    fn lease_name_follows_upstream_form() {
        let le = LeaderElection::new("kube-system");
        assert_eq!(
            le.lease_name_for("loop.fencecsi.io"),
            "external-attacher-leader-loop-fencecsi-io"
        );
    }
}
