//! The controller's configuration (library side; the binary maps its flags onto it).

use std::path::PathBuf;
use std::time::Duration;

use fencecsi_cluster::cli::{default_duration, LeaderElectionArgs};
use fencecsi_cluster::http::HttpEndpoint;

/// The binary's name, and the fallback of its default identity.
pub const NAME: &str = "fencecsi-attacher";

// Defaults the flags (src/main.rs) and [`Config::new`] share.
pub const DEFAULT_WORKERS: usize = 10;
pub const DEFAULT_TIMEOUT: &str = "30s";
pub const DEFAULT_RESYNC: &str = "60s";
/// The retry backoff, as external-attacher's: 1 s doubling to 5 min.
pub const DEFAULT_RETRY_START: &str = "1s";
pub const DEFAULT_RETRY_MAX: &str = "5m";
pub const DEFAULT_DRAIN_TIMEOUT: &str = "30s";

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
            initial: default_duration(DEFAULT_RETRY_START),
            max: default_duration(DEFAULT_RETRY_MAX),
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

/// The Lease name for `driver` unless `--leader-election-lease-name` gives one:
/// `external-attacher-leader-<driver>` (dots and slashes as dashes), the name upstream's
/// external-attacher uses.
pub fn lease_name_for(driver: &str) -> String {
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
    /// Leader election on a Lease (the Lease name defaults to [`lease_name_for`] the
    /// driver). Off: this instance is active as soon as it has started.
    pub leader_election: LeaderElectionArgs,
    /// Where `/metrics`, `/healthz` and `/readyz` are served; `None`: not served. Port 0
    /// picks a free port (see [`crate::Status::http_addr`]).
    pub http_endpoint: Option<HttpEndpoint>,
    /// This instance's identity: the Lease holder and the events' reporting instance.
    pub identity: String,
    /// On shutdown, how long in-flight operations may take before they are abandoned.
    pub shutdown_grace: Duration,
}

impl Config {
    /// The binary's defaults: 10 workers, 30 s timeout, 60 s resync, fence auto,
    /// 1 s → 5 min backoff, no leader election, no HTTP endpoint, the default identity,
    /// 30 s shutdown grace.
    pub fn new(csi_socket: impl Into<PathBuf>) -> Self {
        Config {
            csi_socket: csi_socket.into(),
            workers: DEFAULT_WORKERS,
            timeout: default_duration(DEFAULT_TIMEOUT),
            resync: default_duration(DEFAULT_RESYNC),
            fence: FencePolicy::default(),
            backoff: Backoff::default(),
            leader_election: LeaderElectionArgs::default(),
            http_endpoint: None,
            identity: fencecsi_cluster::cli::default_identity(NAME),
            shutdown_grace: default_duration(DEFAULT_DRAIN_TIMEOUT),
        }
    }
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
        assert_eq!(
            lease_name_for("loop.fencecsi.io"),
            "external-attacher-leader-loop-fencecsi-io"
        );
    }
}
