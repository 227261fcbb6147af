use std::time::Duration;

use clap::{Args, Parser};
use fencecsi_cluster::cli::{
    parse_duration, IdentityArgs, KubeArgs, LeaderElectionArgs, LogFormat,
};
use fencecsi_cluster::http::HttpEndpoint;
use fencecsi_podgc::config::{
    HeartbeatConfig, DEFAULT_HEARTBEAT_GRACE, DEFAULT_KUBELET_PROBE_TIMEOUT,
    DEFAULT_MAX_UNHEALTHY_FRACTION, DEFAULT_NODE_LEASE_GRACE, DEFAULT_RESYNC_INTERVAL,
    DEFAULT_SHUTDOWN_GRACE, NAME,
};
use fencecsi_podgc::{PodGc, PodGcConfig};

/// fencecsi podgc: force-deletes the stuck stateful pods of nodes that shut down, safely.
///
/// A node whose Ready condition has been False/Unknown for longer than --shutdown-grace
/// (or, where no node lifecycle controller runs, whose Lease in kube-node-lease is older
/// than --node-lease-grace, or whose node plugin's heartbeat stopped while its kubelet does
/// not answer) is quarantined (taint fencecsi.io/quarantine:NoSchedule),
/// its terminating pods whose every volume belongs to a CSI driver annotated
/// fencecsi.io/safe-detach="true" (never ReadWriteMany) are force-deleted with a
/// DisruptionTarget condition, and their VolumeAttachments are deleted so the attacher
/// detaches them with a write fence. The quarantine is lifted once the node is Ready,
/// holds no such VolumeAttachment, and its node plugin reported it clean.
#[derive(Debug, Parser)]
#[command(name = NAME, version, about, long_about)]
struct Cli {
    #[command(flatten)]
    run: RunArgs,
    /// Log format.
    #[arg(long, value_enum, default_value_t)]
    log_format: LogFormat,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    kube: KubeArgs,

    /// How long a node's Ready condition must have been False/Unknown (from its
    /// lastTransitionTime) before podgc acts.
    #[arg(long, default_value = DEFAULT_SHUTDOWN_GRACE, value_parser = parse_duration)]
    shutdown_grace: Duration,

    /// Act on a node once its Lease in kube-node-lease has not been renewed for this long,
    /// without waiting for NotReady (the kubelet renews every 10 s; the fence makes acting
    /// on a node that is only slow cost a pod restart, not data). 0 disables.
    #[arg(long, default_value = DEFAULT_NODE_LEASE_GRACE, value_parser = parse_duration)]
    node_lease_grace: Duration,

    /// The fast path: once a node plugin's heartbeat Lease (fencecsi.io/heartbeat=node) has
    /// not been renewed for this long, probe the node's kubelet (a TLS handshake on its
    /// serving port); a node whose kubelet does not answer either is down at once. Each
    /// signal alone can lie (a crashed node plugin, a slow API server, a restarting
    /// kubelet); both at once mean the node is frozen, dead or cut off. 0 disables.
    #[arg(long, default_value = DEFAULT_HEARTBEAT_GRACE, value_parser = parse_duration)]
    heartbeat_grace: Duration,

    /// Namespace of the heartbeat Leases (the node plugin's); default: podgc's own
    /// (POD_NAMESPACE, else the service-account namespace file, else "default").
    #[arg(long, env = "POD_NAMESPACE")]
    heartbeat_namespace: Option<String>,

    /// Bound of one kubelet probe (connect and TLS handshake).
    #[arg(long, default_value = DEFAULT_KUBELET_PROBE_TIMEOUT, value_parser = parse_duration)]
    kubelet_probe_timeout: Duration,

    /// Disruption mode: do nothing while more than this fraction of nodes is NotReady.
    #[arg(long, default_value_t = DEFAULT_MAX_UNHEALTHY_FRACTION)]
    max_unhealthy_fraction: f64,

    /// Also taint quarantined nodes node.kubernetes.io/out-of-service=nodeshutdown:NoExecute
    /// (Kubernetes >= 1.28: its PodGC and attach-detach controller then cooperate). Removed
    /// again on lift, only if podgc added it.
    #[arg(long)]
    out_of_service_taint: bool,

    /// A full pass at least this often.
    #[arg(long, default_value = DEFAULT_RESYNC_INTERVAL, value_parser = parse_duration)]
    resync_interval: Duration,

    /// Serve /metrics (Prometheus), /healthz and /readyz (both fail once the controller
    /// loop has stalled) on this address: ":9809" (all interfaces), "127.0.0.1:9809" or
    /// "[::1]:9809". Unset: no HTTP server.
    #[arg(long)]
    http_endpoint: Option<HttpEndpoint>,

    /// Leader election on a Lease (default name fencecsi-podgc), so that of several
    /// replicas only one acts.
    #[command(flatten)]
    leader_election: LeaderElectionArgs,

    #[command(flatten)]
    identity: IdentityArgs,
}

impl RunArgs {
    fn config(&self) -> Result<PodGcConfig, String> {
        self.leader_election.validate()?;
        let identity = self.identity.resolve(NAME);
        let cfg = PodGcConfig {
            shutdown_grace: self.shutdown_grace,
            node_lease_grace: Some(self.node_lease_grace).filter(|d| !d.is_zero()),
            heartbeat: (!self.heartbeat_grace.is_zero()).then(|| HeartbeatConfig {
                namespace: self
                    .heartbeat_namespace
                    .clone()
                    .unwrap_or_else(fencecsi_cluster::cli::own_namespace),
                grace: self.heartbeat_grace,
                probe_timeout: self.kubelet_probe_timeout,
            }),
            max_unhealthy_fraction: self.max_unhealthy_fraction,
            out_of_service_taint: self.out_of_service_taint,
            resync_interval: self.resync_interval,
            leader_election: self.leader_election.config(NAME, &identity),
            identity,
            ..Default::default()
        };
        cfg.validate().map_err(|e| e.to_string())?;
        Ok(cfg)
    }
}

async fn run(a: RunArgs) -> anyhow::Result<()> {
    let cfg = a.config().map_err(anyhow::Error::msg)?;
    let cluster = a.kube.connect().await?;
    let podgc = PodGc::new(cluster, cfg);
    // Bound before the controller starts, so that a taken port fails the start.
    let http = match &a.http_endpoint {
        Some(e) => Some(
            fencecsi_cluster::http::start(e, podgc.report())
                .await
                .map_err(|err| anyhow::anyhow!("binding --http-endpoint {e}: {err}"))?,
        ),
        None => None,
    };
    podgc
        .run(fencecsi_cluster::cli::shutdown_signal(
            "finishing the current pass",
        ))
        .await?;
    if let Some(h) = http {
        h.stop().await;
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    fencecsi_cluster::cli::init_logging(cli.log_format, "info");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = rt.block_on(run(cli.run));
    if let Err(e) = result {
        tracing::error!(error = %e, "fencecsi-podgc failed");
        eprintln!("fencecsi-podgc: {e:#}");
        std::process::exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flags_defaults_are_the_library_defaults() {
        let cli = Cli::try_parse_from([NAME]).unwrap();
        let flags = cli.run.config().unwrap();
        let lib = PodGcConfig::default();
        assert_eq!(flags.shutdown_grace, lib.shutdown_grace);
        assert_eq!(flags.node_lease_grace, lib.node_lease_grace);
        assert_eq!(flags.max_unhealthy_fraction, lib.max_unhealthy_fraction);
        assert_eq!(flags.out_of_service_taint, lib.out_of_service_taint);
        assert_eq!(flags.resync_interval, lib.resync_interval);
        let (f, l) = (flags.heartbeat.unwrap(), lib.heartbeat.unwrap());
        assert_eq!((f.grace, f.probe_timeout), (l.grace, l.probe_timeout));
        assert!(flags.leader_election.is_none() && lib.leader_election.is_none());
        assert_eq!(cli.run.http_endpoint, None, "no HTTP unless asked");
    }

    #[test]
    fn the_shared_flags_parse() {
        let cli = Cli::try_parse_from([
            NAME,
            "--http-endpoint=:9809",
            "--leader-election=true",
            "--leader-election-namespace=fencecsi",
            "--identity=podgc-0",
        ])
        .unwrap();
        assert_eq!(cli.run.http_endpoint, Some(HttpEndpoint::any(9809)));
        let cfg = cli.run.config().unwrap();
        assert_eq!(cfg.identity, "podgc-0");
        let le = cfg.leader_election.unwrap();
        assert_eq!(
            (le.namespace.as_str(), le.lease_name.as_str()),
            ("fencecsi", NAME)
        );
        assert_eq!(le.identity, "podgc-0");
        for bad in ["--http-endpoint=0.0.0.0", "--http-endpoint="] {
            assert!(Cli::try_parse_from([NAME, bad]).is_err(), "{bad} accepted");
        }
    }
}
