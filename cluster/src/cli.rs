//! What every fencecsi binary spells the same way: durations, the log
//! format and its set-up, the API-server connection, the leader-election flags
//! (with the lease in the pod's own namespace by default), and shutdown signals. One module, so
//! `--help` reads alike across the driver, the attacher and podgc.

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
/// the host name, else `fallback`, plus a random suffix, so two replicas never share one.
pub fn default_identity(fallback: &str) -> String {
    let base = std::env::var("POD_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|s| s.trim().to_string())
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| fallback.to_string());
    format!("{base}-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
}

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

/// The leader-election flags, the same in every binary that elects.
#[derive(Debug, Clone, Args)]
pub struct LeaderElectionArgs {
    /// Use leader election (one active replica). `--leader-election` alone means true.
    #[arg(long = "leader-election", alias = "leader-elect", default_value_t = true,
          num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    pub enabled: bool,
    /// Namespace of the election Lease; default: the pod's own namespace
    /// (POD_NAMESPACE, else the service-account namespace file, else "default").
    #[arg(
        long = "leader-election-namespace",
        alias = "leader-elect-namespace",
        env = "POD_NAMESPACE"
    )]
    pub namespace: Option<String>,
    /// Name of the election Lease; default: the binary's own.
    #[arg(
        long = "leader-election-lease-name",
        alias = "leader-elect-lease-name",
        alias = "leader-election-id"
    )]
    pub lease_name: Option<String>,
    /// How long a lease is valid without renewal.
    #[arg(long = "leader-election-lease-duration", alias = "leader-elect-lease-duration",
          default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up leading.
    #[arg(long = "leader-election-renew-deadline", alias = "leader-elect-renew-deadline",
          default_value = "10s", value_parser = parse_duration)]
    pub renew_deadline: Duration,
    /// How often candidates retry.
    #[arg(long = "leader-election-retry-period", alias = "leader-elect-retry-period",
          default_value = "2s", value_parser = parse_duration)]
    pub retry_period: Duration,
    /// How long the election may get no answer from the API server (a Lease it is
    /// forbidden to touch, an unreachable server) before /healthz reports unhealthy.
    #[arg(long = "leader-election-unhealthy-after", default_value = "2m",
          value_parser = parse_duration)]
    pub unhealthy_after: Duration,
}

impl LeaderElectionArgs {
    /// The election config, or None when election is off.
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
    fn leader_flags_old_spellings_still_parse() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            le: LeaderElectionArgs,
        }
        let t = T::try_parse_from(["t", "--leader-elect=false", "--leader-elect-namespace", "x"])
            .unwrap();
        assert!(!t.le.enabled);
        assert_eq!(t.le.namespace.as_deref(), Some("x"));
        let t = T::try_parse_from(["t", "--leader-election", "--leader-election-id", "l"]).unwrap();
        assert!(t.le.enabled);
        assert_eq!(t.le.lease_name.as_deref(), Some("l"));
    }
}
