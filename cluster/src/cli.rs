//! What every fencecsi binary spells the same way: durations, the log
//! format and its set-up, the API-server connection, the leader-election flags
//! (with the lease in the pod's own namespace by default), `--identity`, and shutdown
//! signals. One module, so `--help` reads alike across the driver, the attacher and podgc
//! (`--http-endpoint` is [`crate::http`]'s).
//!
//! A default that a library constructor also needs is written once, as a `const` the flag
//! and the constructor both use; durations as their flag's text, read with
//! [`default_duration`].

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

/// Longest duration any flag takes (about 31 years): large enough for
/// anything meaningful, small enough that arithmetic never overflows.
const MAX_SECS: f64 = 1e9;

/// A duration: `500ms`, `10s`, `2m`, `1h`, or a plain number of seconds
/// (`10`, `0.5`); a space before the unit is allowed. Never negative,
/// never more than 1e9 s, never a panic.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (like 10s, 500ms, 2m, 1h)"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1e3,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        other => return Err(format!("unknown unit {other:?} in {s:?} (ms, s, m, h)")),
    };
    if !secs.is_finite() || !(0.0..=MAX_SECS).contains(&secs) {
        return Err(format!("{s:?} is out of range (0 to {MAX_SECS} s)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum LogFormat {
    /// Human-readable lines; coloured only on a terminal.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Logs to stderr at `RUST_LOG` (default `default_filter`). Colour codes
/// only when stderr is a terminal, so files and log collectors get plain text.
pub fn init_logging(format: LogFormat, default_filter: &str) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let ansi = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// Where Kubernetes mounts the pod's own namespace for its service account.
pub const SERVICE_ACCOUNT_NAMESPACE_FILE: &str =
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// Namespace used when neither `--leader-election-namespace`, POD_NAMESPACE
/// nor the service-account file names one (a process outside a pod).
pub const FALLBACK_NAMESPACE: &str = "default";

/// The pod's own namespace: the service-account namespace file, else
/// [`FALLBACK_NAMESPACE`].
pub fn own_namespace() -> String {
    own_namespace_from(std::path::Path::new(SERVICE_ACCOUNT_NAMESPACE_FILE))
}

fn own_namespace_from(file: &std::path::Path) -> String {
    std::fs::read_to_string(file)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| FALLBACK_NAMESPACE.to_string())
}

/// A replica's identity (Events, leader election) when none is given: `$POD_NAME`, else
/// the host name (or `fallback`) plus a random suffix. A pod name is unique while the pod
/// lives, and a container restarted in it replaces a process that is gone: keeping the
/// name lets it take its Lease back at once instead of waiting for it to expire.
pub fn default_identity(fallback: &str) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
    identity_from(std::env::var("POD_NAME").ok(), host, fallback)
}

fn identity_from(pod_name: Option<String>, host: Option<String>, fallback: &str) -> String {
    if let Some(pod) = pod_name.filter(|s| !s.trim().is_empty()) {
        return pod.trim().to_string();
    }
    let base = host
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| fallback.to_string());
    // Outside a pod nothing makes the host name unique to one process.
    format!("{base}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
}

/// `--identity`, the same in every binary.
#[derive(Debug, Clone, Default, Args)]
pub struct IdentityArgs {
    /// This replica's name in the leader-election Lease and in Events; default: $POD_NAME,
    /// else the host name plus a random suffix.
    #[arg(long = "identity", value_name = "IDENTITY")]
    pub name: Option<String>,
}

impl IdentityArgs {
    /// The name given, else [`default_identity`] (`binary` where neither $POD_NAME nor a
    /// host name is there).
    pub fn resolve(&self, binary: &str) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| default_identity(binary))
    }
}

/// A default duration in its flag's spelling (the `default_value` of the flag), as a value
/// for the library constructors: one text, so the two never differ.
pub fn default_duration(text: &'static str) -> Duration {
    parse_duration(text).unwrap_or_else(|e| panic!("a default duration does not parse: {e}"))
}

/// Leader-election timing defaults: client-go's (15 s, 10 s, 2 s).
pub const LEASE_DURATION: &str = "15s";
pub const RENEW_DEADLINE: &str = "10s";
pub const RETRY_PERIOD: &str = "2s";
/// How long an election may go without an answer from the API server before the process
/// reports itself unhealthy (see [`crate::LeaderHandle::healthy`]): long enough to ride
/// out an API-server restart, short enough that a Forbidden Lease (missing RBAC, wrong
/// namespace) is noticed within minutes.
pub const UNHEALTHY_AFTER: &str = "2m";

/// The API-server connection flag, the same in every binary that talks to one.
#[derive(Debug, Clone, Default, Args)]
pub struct KubeArgs {
    /// Kubeconfig file to use; default: $KUBECONFIG (all of its paths) or
    /// ~/.kube/config, else the in-cluster configuration.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
}

impl KubeArgs {
    /// A client for the API server these flags name.
    pub async fn connect(&self) -> crate::Result<crate::Cluster> {
        crate::Cluster::connect(self.kubeconfig.as_deref()).await
    }
}

/// The leader-election flags, the same in every binary that elects (the upstream
/// sidecars' names). Off unless asked, in every binary and in the library defaults: the
/// driver must run without an API server (local use, csi-sanity), and the deploy
/// manifests turn it on where it is wanted.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct LeaderElectionArgs {
    /// Leader election on a Lease: of several replicas only the one holding it acts (the
    /// controller plugin serves its state dir only then, and exits once it cannot renew).
    /// Needs an API server. `--leader-election` alone means true.
    #[arg(long = "leader-election", default_value_t = false,
          num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub enabled: bool,
    /// Namespace of the election Lease; default: the pod's own namespace
    /// (POD_NAMESPACE, else the service-account namespace file, else "default").
    #[arg(long = "leader-election-namespace", env = "POD_NAMESPACE")]
    pub namespace: Option<String>,
    /// Name of the election Lease; default: the binary's own (fencecsi-driver:
    /// fencecsi-controller-plugin; fencecsi-attacher: external-attacher-leader-<driver>;
    /// fencecsi-podgc: fencecsi-podgc).
    #[arg(long = "leader-election-lease-name")]
    pub lease_name: Option<String>,
    /// How long a lease is valid without renewal: a standby takes it over after that.
    #[arg(long = "leader-election-lease-duration",
          default_value = LEASE_DURATION, value_parser = parse_duration)]
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up leading (shorter than
    /// the lease duration).
    #[arg(long = "leader-election-renew-deadline",
          default_value = RENEW_DEADLINE, value_parser = parse_duration)]
    pub renew_deadline: Duration,
    /// How often candidates try to take or renew the Lease.
    #[arg(long = "leader-election-retry-period",
          default_value = RETRY_PERIOD, value_parser = parse_duration)]
    pub retry_period: Duration,
    /// How long the election may get no answer from the API server (a Lease it is
    /// forbidden to touch, an unreachable server) before /healthz reports unhealthy.
    #[arg(long = "leader-election-unhealthy-after",
          default_value = UNHEALTHY_AFTER, value_parser = parse_duration)]
    pub unhealthy_after: Duration,
    /// Lead only while this other Lease (same namespace) is held by this replica's
    /// identity, and give the own Lease up when it moves: containers of one pod that share
    /// the identity (the pod name) then lead together, where the one they follow leads.
    #[arg(long = "leader-election-follow", value_name = "LEASE")]
    pub follow: Option<String>,
}

impl Default for LeaderElectionArgs {
    /// The flags' defaults (election off), without reading the environment.
    fn default() -> Self {
        LeaderElectionArgs {
            enabled: false,
            namespace: None,
            lease_name: None,
            lease_duration: default_duration(LEASE_DURATION),
            renew_deadline: default_duration(RENEW_DEADLINE),
            retry_period: default_duration(RETRY_PERIOD),
            unhealthy_after: default_duration(UNHEALTHY_AFTER),
            follow: None,
        }
    }
}

impl LeaderElectionArgs {
    /// What the elector would refuse later, said at start with the flags' names.
    pub fn validate(&self) -> Result<(), String> {
        if !self.enabled {
            return Ok(());
        }
        if self.renew_deadline >= self.lease_duration {
            return Err(
                "--leader-election-renew-deadline must be shorter than --leader-election-lease-duration"
                    .into(),
            );
        }
        if self.retry_period >= self.renew_deadline {
            return Err(
                "--leader-election-retry-period must be shorter than --leader-election-renew-deadline"
                    .into(),
            );
        }
        Ok(())
    }

    /// The election config, or None when election is off. `default_lease`: the Lease
    /// name unless `--leader-election-lease-name` gives one.
    pub fn config(
        &self,
        default_lease: &str,
        identity: &str,
    ) -> Option<crate::LeaderElectionConfig> {
        self.enabled.then(|| {
            let ns = self.namespace.clone().unwrap_or_else(own_namespace);
            crate::LeaderElectionConfig::new(
                &ns,
                self.lease_name.as_deref().unwrap_or(default_lease),
                identity,
            )
            .with_timing(self.lease_duration, self.renew_deadline, self.retry_period)
            .unhealthy_after(self.unhealthy_after)
            .following(self.follow.as_deref())
        })
    }
}

/// Resolves on SIGTERM or SIGINT (logged with `what` it interrupts).
pub async fn shutdown_signal(what: &str) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: {what}"),
        _ = int.recv() => tracing::info!("SIGINT: {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration(" 10 s ").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert_eq!(parse_duration("0.5").unwrap(), Duration::from_millis(500));
        for bad in ["", "s", "-1s", "10d", "1e3", "nan", &"9".repeat(30)] {
            assert!(parse_duration(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn own_namespace_reads_the_service_account_file() {
        let dir = tempfile_dir();
        let f = dir.join("namespace");
        assert_eq!(own_namespace_from(&f), FALLBACK_NAMESPACE, "no file");
        std::fs::write(&f, "fencecsi\n").unwrap();
        assert_eq!(own_namespace_from(&f), "fencecsi");
        std::fs::write(&f, "  \n").unwrap();
        assert_eq!(own_namespace_from(&f), FALLBACK_NAMESPACE, "empty file");
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("fencecsi-cli-test-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn leader_flags_default_off_and_match_the_library_defaults() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            le: LeaderElectionArgs,
        }
        let t = T::try_parse_from(["t", "--leader-election-namespace=x"]).unwrap();
        assert_eq!(
            t.le,
            LeaderElectionArgs {
                namespace: Some("x".into()),
                ..Default::default()
            }
        );
        let lib = crate::LeaderElectionConfig::new("x", "l", "i");
        let d = LeaderElectionArgs::default();
        assert_eq!(
            (
                d.lease_duration,
                d.renew_deadline,
                d.retry_period,
                d.unhealthy_after
            ),
            (
                lib.lease_duration,
                lib.renew_deadline,
                lib.retry_period,
                lib.unhealthy_after
            )
        );
        assert!(d.config("l", "i").is_none(), "off by default");
        let t = T::try_parse_from([
            "t",
            "--leader-election",
            "--leader-election-lease-name",
            "l",
        ])
        .unwrap();
        assert!(t.le.enabled);
        assert_eq!(t.le.lease_name.as_deref(), Some("l"));
        let t = T::try_parse_from(["t", "--leader-election=false"]).unwrap();
        assert!(!t.le.enabled);
        // The spellings of before the first release are gone.
        for old in [
            "--leader-elect",
            "--leader-elect-namespace=x",
            "--leader-election-id=l",
        ] {
            assert!(T::try_parse_from(["t", old]).is_err(), "{old} accepted");
        }
    }

    #[test]
    fn leader_flags_refuse_timings_the_elector_would() {
        let on = LeaderElectionArgs {
            enabled: true,
            ..Default::default()
        };
        assert_eq!(on.validate(), Ok(()));
        let bad = LeaderElectionArgs {
            renew_deadline: on.lease_duration,
            ..on.clone()
        };
        assert!(bad.validate().unwrap_err().contains("renew-deadline"));
        let bad = LeaderElectionArgs {
            retry_period: on.renew_deadline,
            ..on.clone()
        };
        assert!(bad.validate().unwrap_err().contains("retry-period"));
        let off = LeaderElectionArgs {
            enabled: false,
            ..bad
        };
        assert_eq!(off.validate(), Ok(()), "nothing to check when off");
    }

    #[test]
    fn identity_is_the_one_given_else_the_pod_else_a_unique_default() {
        let given = IdentityArgs {
            name: Some("replica-a".into()),
        };
        assert_eq!(given.resolve("fencecsi-x"), "replica-a");
        assert_eq!(
            identity_from(Some("ctl-7f9c-abcde".into()), Some("node-1\n".into()), "x"),
            "ctl-7f9c-abcde",
            "a pod keeps its name across container restarts"
        );
        let (a, b) = (
            identity_from(Some(String::new()), Some("node-1\n".into()), "x"),
            identity_from(None, Some("node-1".into()), "x"),
        );
        assert!(
            a.starts_with("node-1-") && b.starts_with("node-1-"),
            "{a} {b}"
        );
        assert_ne!(
            a, b,
            "two processes on one host never share a default identity"
        );
        assert!(identity_from(None, None, "fencecsi-x").starts_with("fencecsi-x-"));
    }
}
