//! `fencecsi-attacher`: the VolumeAttachment controller as a process (a sidecar next to
//! the controller plugin).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use fencecsi_attacher::{parse_duration, Attacher, Backoff, Config, FencePolicy, LeaderElection};
use fencecsi_cluster::cli::{KubeArgs, LeaderElectionArgs, LogFormat};

/// fencecsi VolumeAttachment controller: attaches volumes with ControllerPublishVolume,
/// detaches them with ControllerUnpublishVolume, and fences nodes that may still be
/// writing (`fence = true`) so that a volume can move off a failed node safely.
#[derive(Debug, Parser)]
#[command(name = "fencecsi-attacher", version, about, long_about = None)]
struct Args {
    /// The controller plugin's CSI endpoint (unix socket).
    #[arg(long, env = "CSI_ADDRESS", default_value = "unix:///csi/csi.sock")]
    csi_address: String,

    #[command(flatten)]
    kube: KubeArgs,

    /// Worker tasks processing VolumeAttachments concurrently.
    #[arg(long, default_value_t = 10)]
    workers: usize,

    /// Timeout of each CSI call (e.g. 30s, 500ms, 2m).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    timeout: Duration,

    /// How often every VolumeAttachment is processed again.
    #[arg(long = "resync-interval", alias = "resync", default_value = "60s",
          value_parser = parse_duration)]
    resync: Duration,

    /// When to send fence=true on detach: auto = the node may still be writing (gone,
    /// NotReady, quarantined or out-of-service, or still using the volume); always;
    /// never. Only plugins advertising UNPUBLISH_FENCE are ever asked to fence.
    #[arg(long, value_enum, default_value_t = FencePolicy::Auto)]
    fence: FencePolicy,

    /// First retry delay after a failure; doubles per consecutive failure.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    retry_interval_start: Duration,

    /// Longest retry delay.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    retry_interval_max: Duration,

    /// Leader election on a Lease, so that of several replicas only one acts. Its
    /// Lease name defaults to external-attacher-leader-<driver>.
    #[command(flatten)]
    leader_election: LeaderElectionArgs,

    /// This replica's identity in the Lease and in events [default: $POD_NAME or the
    /// host name, plus a random suffix].
    #[arg(long)]
    identity: Option<String>,

    /// Address serving /healthz and /metrics; empty to disable.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http_endpoint: String,

    /// On SIGTERM, how long in-flight CSI calls may take before the process exits.
    #[arg(long = "drain-timeout", alias = "shutdown-grace", default_value = "30s",
          value_parser = parse_duration)]
    drain_timeout: Duration,

    /// Log format (the level comes from RUST_LOG, default info).
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

fn config(args: &Args) -> Result<Config, String> {
    if !args.csi_address.starts_with("unix://") && !args.csi_address.starts_with('/') {
        return Err(format!(
            "--csi-address {:?}: only unix sockets are supported (unix:///path)",
            args.csi_address
        ));
    }
    let mut cfg = Config::new(fencecsi_proto::client::socket_path(&args.csi_address));
    cfg.workers = args.workers;
    cfg.timeout = args.timeout;
    cfg.resync = args.resync;
    cfg.fence = args.fence;
    cfg.backoff = Backoff {
        initial: args.retry_interval_start,
        max: args.retry_interval_max,
    };
    cfg.shutdown_grace = args.drain_timeout;
    if let Some(id) = &args.identity {
        cfg.identity = id.clone();
    }
    cfg.http_endpoint = if args.http_endpoint.is_empty() {
        None
    } else {
        Some(
            args.http_endpoint
                .parse::<SocketAddr>()
                .map_err(|e| format!("--http-endpoint {:?}: {e}", args.http_endpoint))?,
        )
    };
    let e = &args.leader_election;
    if e.enabled {
        let ns = e
            .namespace
            .clone()
            .unwrap_or_else(fencecsi_cluster::cli::own_namespace);
        let mut le = LeaderElection::new(&ns);
        le.lease_name = e.lease_name.clone();
        le.lease_duration = e.lease_duration;
        le.renew_deadline = e.renew_deadline;
        le.retry_period = e.retry_period;
        le.unhealthy_after = e.unhealthy_after;
        cfg.leader_election = Some(le);
    }
    Ok(cfg)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    fencecsi_cluster::cli::init_logging(args.log_format, "info");
    let cfg = match config(&args) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let cluster = match args.kube.connect().await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot reach the Kubernetes API");
            return std::process::ExitCode::from(1);
        }
    };
    tracing::info!(socket = %cfg.csi_socket.display(), workers = cfg.workers, fence = %cfg.fence, identity = %cfg.identity, "fencecsi-attacher starting");
    match Attacher::new(cluster, cfg)
        .run(fencecsi_cluster::cli::shutdown_signal("stopping"))
        .await
    {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "fencecsi-attacher failed");
            std::process::ExitCode::FAILURE
        }
    }
}
