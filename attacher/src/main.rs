//! `fencecsi-attacher`: the VolumeAttachment controller as a process (a sidecar next to
//! the controller plugin).

use std::time::Duration;

use clap::Parser;
use fencecsi_attacher::config::{
    DEFAULT_DRAIN_TIMEOUT, DEFAULT_RESYNC, DEFAULT_RETRY_MAX, DEFAULT_RETRY_START, DEFAULT_TIMEOUT,
    DEFAULT_WORKERS,
};
use fencecsi_attacher::{parse_duration, Attacher, Backoff, Config, FencePolicy, NAME};
use fencecsi_cluster::cli::{IdentityArgs, KubeArgs, LeaderElectionArgs, LogFormat};
use fencecsi_cluster::http::HttpEndpoint;

/// fencecsi VolumeAttachment controller: attaches volumes with ControllerPublishVolume,
/// detaches them with ControllerUnpublishVolume, and fences nodes that may still be
/// writing (`fence = true`) so that a volume can move off a failed node safely.
#[derive(Debug, Parser)]
#[command(name = NAME, version, about, long_about = None)]
struct Args {
    /// The controller plugin's CSI endpoint (unix socket).
    #[arg(long, env = "CSI_ADDRESS", default_value = "unix:///csi/csi.sock")]
    csi_address: String,

    #[command(flatten)]
    kube: KubeArgs,

    /// Worker tasks processing VolumeAttachments concurrently.
    #[arg(long, default_value_t = DEFAULT_WORKERS)]
    workers: usize,

    /// Timeout of each CSI call (e.g. 30s, 500ms, 2m).
    #[arg(long, default_value = DEFAULT_TIMEOUT, value_parser = parse_duration)]
    timeout: Duration,

    /// How often every VolumeAttachment is processed again.
    #[arg(long = "resync-interval", default_value = DEFAULT_RESYNC,
          value_parser = parse_duration)]
    resync: Duration,

    /// When to send fence=true on detach: auto = the node may still be writing (gone,
    /// NotReady, quarantined or out-of-service, or still using the volume); always;
    /// never. Only plugins advertising UNPUBLISH_FENCE are ever asked to fence.
    #[arg(long, value_enum, default_value_t)]
    fence: FencePolicy,

    /// First retry delay after a failure; doubles per consecutive failure.
    #[arg(long, default_value = DEFAULT_RETRY_START, value_parser = parse_duration)]
    retry_interval_start: Duration,

    /// Longest retry delay.
    #[arg(long, default_value = DEFAULT_RETRY_MAX, value_parser = parse_duration)]
    retry_interval_max: Duration,

    /// Leader election on a Lease, so that of several replicas only one acts. Its
    /// Lease name defaults to external-attacher-leader-<driver>.
    #[command(flatten)]
    leader_election: LeaderElectionArgs,

    #[command(flatten)]
    identity: IdentityArgs,

    /// Serve /metrics, /healthz and /readyz on this address: ":9810" (all interfaces),
    /// "127.0.0.1:9810" or "[::1]:9810". Unset: no HTTP server.
    #[arg(long)]
    http_endpoint: Option<HttpEndpoint>,

    /// On SIGTERM, how long in-flight CSI calls may take before the process exits.
    #[arg(long = "drain-timeout", default_value = DEFAULT_DRAIN_TIMEOUT,
          value_parser = parse_duration)]
    drain_timeout: Duration,

    /// Log format (the level comes from RUST_LOG, default info).
    #[arg(long, value_enum, default_value_t)]
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
    cfg.identity = args.identity.resolve(NAME);
    cfg.http_endpoint = args.http_endpoint;
    cfg.leader_election = args.leader_election.clone();
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

#[cfg(test)]
mod tests {
    use super::*;
    use fencecsi_attacher::LeaderElectionArgs;

    #[test]
    fn the_flags_defaults_are_the_library_defaults() {
        let args = Args::try_parse_from([NAME, "--csi-address=unix:///csi/csi.sock"]).unwrap();
        let flags = config(&args).unwrap();
        let lib = Config::new(&flags.csi_socket);
        assert_eq!(flags.workers, lib.workers);
        assert_eq!(flags.timeout, lib.timeout);
        assert_eq!(flags.resync, lib.resync);
        assert_eq!(flags.fence, lib.fence);
        assert_eq!(flags.backoff, lib.backoff);
        assert_eq!(
            flags.http_endpoint, lib.http_endpoint,
            "no HTTP unless asked"
        );
        assert_eq!(flags.shutdown_grace, lib.shutdown_grace);
        // The namespace may come from POD_NAMESPACE for the flags, never for the library.
        let election = LeaderElectionArgs {
            namespace: None,
            ..flags.leader_election
        };
        assert_eq!(election, lib.leader_election, "no election unless asked");
    }

    #[test]
    fn the_http_endpoint_takes_the_sidecars_form() {
        let parse = |e: &str| Args::try_parse_from([NAME, e]).map(|a| a.http_endpoint);
        assert_eq!(
            parse("--http-endpoint=:9810").unwrap(),
            Some(HttpEndpoint::any(9810))
        );
        assert_eq!(
            parse("--http-endpoint=127.0.0.1:8080").unwrap(),
            Some(HttpEndpoint::from(std::net::SocketAddr::from((
                [127, 0, 0, 1],
                8080
            ))))
        );
        for bad in [
            "--http-endpoint=",
            "--http-endpoint=8080",
            "--http-endpoint=localhost:8080",
        ] {
            assert!(parse(bad).is_err(), "{bad} accepted");
        }
    }
}
