use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser};
use fencecsi_cluster::cli::{parse_duration, KubeArgs, LeaderElectionArgs, LogFormat};
use fencecsi_podgc::{PodGc, PodGcConfig};

/// fencecsi podgc: force-deletes the stuck stateful pods of nodes that shut down, safely.
///
/// A node whose Ready condition has been False/Unknown for longer than --shutdown-grace
/// (or, where no node lifecycle controller runs, whose Lease in kube-node-lease is older
/// than --node-lease-grace) is quarantined (taint fencecsi.io/quarantine:NoSchedule),
/// its terminating pods whose every volume belongs to a CSI driver annotated
/// fencecsi.io/safe-detach="true" (never ReadWriteMany) are force-deleted with a
/// DisruptionTarget condition, and their VolumeAttachments are deleted so the attacher
/// detaches them with a write fence. The quarantine is lifted once the node is Ready,
/// holds no such VolumeAttachment, and its node plugin reported it clean.
#[derive(Debug, Parser)]
#[command(name = "fencecsi-podgc", version, about, long_about)]
struct Cli {
    #[command(flatten)]
    run: RunArgs,
    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    kube: KubeArgs,

    /// How long a node's Ready condition must have been False/Unknown (from its
    /// lastTransitionTime) before podgc acts.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    shutdown_grace: Duration,

    /// Act on a node once its Lease in kube-node-lease has not been renewed for this long,
    /// without waiting for NotReady (the kubelet renews every 10 s; the fence makes acting
    /// on a node that is only slow cost a pod restart, not data). 0 disables.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    node_lease_grace: Duration,

    /// Disruption mode: do nothing while more than this fraction of nodes is NotReady.
    #[arg(long, default_value_t = 0.55)]
    max_unhealthy_fraction: f64,

    /// Also taint quarantined nodes node.kubernetes.io/out-of-service=nodeshutdown:NoExecute
    /// (Kubernetes >= 1.28: its PodGC and attach-detach controller then cooperate). Removed
    /// again on lift, only if podgc added it.
    #[arg(long)]
    out_of_service_taint: bool,

    /// A full pass at least this often.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    resync_interval: Duration,

    /// Serve /metrics (Prometheus) and /healthz here.
    #[arg(long, default_value = "0.0.0.0:9809")]
    http_endpoint: SocketAddr,

    #[command(flatten)]
    leader_election: LeaderElectionArgs,

    /// This instance's identity (Events, leader election); default: hostname + random.
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
}

async fn run(a: RunArgs) -> anyhow::Result<()> {
    let identity = a
        .identity
        .clone()
        .unwrap_or_else(fencecsi_podgc::config::default_identity);
    let cfg = PodGcConfig {
        shutdown_grace: a.shutdown_grace,
        node_lease_grace: Some(a.node_lease_grace).filter(|d| !d.is_zero()),
        max_unhealthy_fraction: a.max_unhealthy_fraction,
        out_of_service_taint: a.out_of_service_taint,
        resync_interval: a.resync_interval,
        leader_election: a.leader_election.config("fencecsi-podgc", &identity),
        identity,
        ..Default::default()
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    let cluster = a.kube.connect().await?;
    let podgc = PodGc::new(cluster, cfg);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let http = {
        let metrics = podgc.metrics();
        let live = podgc.liveness();
        let mut rx = stop_rx.clone();
        let addr = a.http_endpoint;
        tokio::spawn(async move {
            let stop = async move {
                let _ = rx.wait_for(|v| *v).await;
            };
            fencecsi_podgc::http::serve(addr, metrics, live, stop, None).await
        })
    };
    let mut rx = stop_rx.clone();
    let controller = tokio::spawn(podgc.run(async move {
        let _ = rx.wait_for(|v| *v).await;
    }));
    tokio::select! {
        _ = fencecsi_cluster::cli::shutdown_signal("finishing the current pass") => {}
        r = http => {
            match r {
                Ok(Err(e)) => anyhow::bail!("http endpoint {}: {e}", a.http_endpoint),
                other => tracing::warn!(?other, "http server ended"),
            }
        }
    }
    let _ = stop_tx.send(true);
    controller.await??;
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
