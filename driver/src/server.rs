//! Serving the CSI services on a unix socket, and shutting down cleanly:
//! stop accepting, let in-flight calls finish, remove the socket. Volumes are
//! never unmounted on exit: pods keep their data while the plugin restarts.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use fencecsi_proto::v1::controller_server::ControllerServer;
use fencecsi_proto::v1::group_controller_server::GroupControllerServer;
use fencecsi_proto::v1::identity_server::IdentityServer;
use fencecsi_proto::v1::node_server::NodeServer;
use futures::stream::BoxStream;
use futures::StreamExt;
use tokio_stream::wrappers::UnixListenerStream;

use crate::config::Config;
use crate::controller::{Controller, ControllerService, GroupControllerService};
use crate::identity::IdentityService;
use crate::node::{Node, NodeService};
use crate::socket::bind;
use crate::socket::ServeError;

/// Runs the plugin until `shutdown` resolves.
pub async fn serve(
    cfg: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve_with(cfg, shutdown, ServeHooks::default()).await
}

/// What an embedder (tests, the drill, a binary with a cluster client) adds to [`serve`].
#[derive(Default)]
pub struct ServeHooks {
    /// Where node recovery reports the node clean; `None`: logged only.
    pub clean_reporter: Option<Arc<dyn crate::node::recover::CleanReporter>>,
    /// Receives control of the node recovery loop once it runs (node modes with a
    /// non-zero `recover_interval`, or always when this is given: then a zero interval
    /// means "at start and on demand").
    pub recovery: Option<tokio::sync::oneshot::Sender<crate::node::recover::RecoveryHandle>>,
    /// The API server leader election uses (with `--leader-election`); default: the one
    /// `--kubeconfig` or the in-cluster configuration names.
    pub leader_cluster: Option<fencecsi_cluster::Cluster>,
    /// The API server the node's heartbeat goes to (with `--heartbeat-interval`); default:
    /// the one `--kubeconfig` or the in-cluster configuration names.
    pub heartbeat_cluster: Option<fencecsi_cluster::Cluster>,
    /// What happens when this controller stops leading; default: the process exits.
    pub on_lost_leadership: Option<crate::leadership::OnLostLeadership>,
    /// Arm the controller's kill switch (`locks::kill_switch`): a successor that leads the
    /// Lease SIGKILLs this whole process through it when it finds the state dir still held.
    /// Only for the driver's own process; off in a program that serves the plugin
    /// in-process (then a successor waits for the ownership lock instead).
    pub kill_switch: bool,
}

/// What an embedder learns about the plugin's metrics (see [`serve_with_metrics`]).
#[derive(Default)]
pub struct MetricsHooks {
    /// Receives the address `/metrics`, `/healthz` and `/readyz` are served on once it is
    /// bound (with `--http-endpoint` set; useful with port 0).
    pub http_endpoint: Option<tokio::sync::oneshot::Sender<std::net::SocketAddr>>,
}

/// [`serve`] with hooks.
pub async fn serve_with(
    cfg: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
    hooks: ServeHooks,
) -> Result<(), ServeError> {
    serve_with_metrics(cfg, shutdown, hooks, MetricsHooks::default()).await
}

/// [`serve_with`], also telling where the metrics are.
pub async fn serve_with_metrics(
    cfg: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
    mut hooks: ServeHooks,
    mut metrics_hooks: MetricsHooks,
) -> Result<(), ServeError> {
    cfg.validate().map_err(ServeError::Config)?;
    let socket = cfg.socket_path().map_err(ServeError::Config)?;
    let Services {
        lease,
        controller,
        node,
    } = open_services(&cfg, &mut hooks).await?;
    let metrics = Arc::new(crate::metrics::Metrics::new(
        &cfg.driver_name,
        controller
            .as_deref()
            .map(|c| crate::metrics::ControllerFigures {
                fence: &c.fence_metrics,
                fence_available: c.fence_available(),
            }),
        node.as_deref().map(|n| n.node_id.as_str()),
    ));
    // Bound before the socket, so that a taken port fails the start instead of going
    // unnoticed; served until the gRPC server has stopped.
    let http = start_http(&cfg, &metrics, node.as_ref(), &mut metrics_hooks).await?;

    // A leader serves its standbys too, which forward their sidecars' calls (`standby`).
    let leader_socket = (lease.is_some() && controller.is_some())
        .then(|| crate::locks::leader_socket(&cfg.state_dir));
    let incoming = incoming(&socket, leader_socket.as_deref())?;
    tracing::info!(endpoint = %cfg.endpoint, mode = ?cfg.mode, driver = %cfg.driver_name, node = ?cfg.node_id, leader_socket = ?leader_socket, "serving CSI");

    let (gc_stop, gc_stopped) = tokio::sync::watch::channel(false);
    let gc_task = controller.as_ref().map(|c| {
        spawn_gc(
            c.clone(),
            cfg.gc_interval.max(Duration::from_secs(1)),
            gc_stopped,
        )
    });
    let recovery = start_recovery(&cfg, node.as_ref(), &mut hooks).await?;
    let _heartbeat = start_heartbeat(&cfg, node.is_some(), &mut hooks).await?;
    // With leader election, the controller that gives up the state dir if it stops leading.
    let leading = lease.zip(controller.clone()).map(|(h, c)| {
        crate::leadership::watch_leadership(
            h,
            cfg.election.retry_period,
            c,
            hooks.on_lost_leadership.take(),
        )
    });
    let background = Background {
        leader_socket,
        gc_stop,
        gc_task,
        owner: controller.clone(),
        leading,
        recovery,
        http,
    };
    // Clients whose gRPC stack sends the socket path as `:authority` (grpcio, grpc-java)
    // are refused by h2 unless they set a valid one: see docs/grpc-clients.md.
    let result = router(&cfg, metrics, controller, node)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    background.stop().await;
    let _ = std::fs::remove_file(&socket);
    // An embedder waiting on an endpoint that was never bound learns it now.
    drop(metrics_hooks);
    tracing::info!("stopped; socket removed, volumes left mounted");
    Ok(result?)
}

/// The connections to serve: the plugin's socket, and the leader's socket for its
/// standbys when this replica leads.
fn incoming(
    socket: &std::path::Path,
    leader_socket: Option<&std::path::Path>,
) -> Result<BoxStream<'static, std::io::Result<tokio::net::UnixStream>>, ServeError> {
    let listener = bind(socket)?;
    Ok(match leader_socket {
        Some(path) => futures::stream::select(
            UnixListenerStream::new(listener),
            UnixListenerStream::new(bind(path)?),
        )
        .boxed(),
        None => UnixListenerStream::new(listener).boxed(),
    })
}

/// What runs beside the gRPC server, stopped in order once it has stopped.
struct Background {
    leader_socket: Option<std::path::PathBuf>,
    gc_stop: tokio::sync::watch::Sender<bool>,
    gc_task: Option<tokio::task::JoinHandle<()>>,
    /// The controller that owns the state dir, if this replica serves one.
    owner: Option<Arc<Controller>>,
    leading: Option<crate::leadership::Leading>,
    recovery: Option<crate::node::recover::RecoveryHandle>,
    http: Option<fencecsi_cluster::http::HttpServer>,
}

impl Background {
    async fn stop(self) {
        // While this replica still owns the state dir: a successor binds it anew once it does.
        if let Some(path) = &self.leader_socket {
            let _ = std::fs::remove_file(path);
        }
        // Let a running collection finish (it writes metadata) before giving up the state dir.
        let _ = self.gc_stop.send(true);
        if let Some(t) = self.gc_task {
            let _ = t.await;
        }
        if let Some(c) = self.owner {
            c.release_ownership();
        }
        if let Some(l) = self.leading {
            l.step_down().await;
        }
        if let Some(r) = self.recovery {
            r.abort();
        }
        if let Some(h) = self.http {
            h.stop().await;
        }
    }
}

/// The services the configured modes serve.
struct Services {
    /// The controller's Lease while it leads (with leader election).
    lease: Option<fencecsi_cluster::LeaderHandle>,
    controller: Option<Arc<Controller>>,
    node: Option<Arc<Node>>,
}

fn io_error(what: &str) -> impl FnOnce(std::io::Error) -> ServeError {
    let what = what.to_string();
    move |source| ServeError::Io { what, source }
}

async fn open_services(cfg: &Config, hooks: &mut ServeHooks) -> Result<Services, ServeError> {
    // With leader election, a standby serves only what its sidecars need until it leads.
    let (lease, controller) = if cfg.mode.controller() && cfg.election.enabled {
        let (lease, c) =
            crate::leadership::lead(cfg, hooks.leader_cluster.take(), hooks.kill_switch).await?;
        (Some(lease), Some(c))
    } else if cfg.mode.controller() {
        // Armed here too: a leader (of a later, elected deployment) can then take over.
        // Named only when given: an elected successor can then learn from the kernel that
        // this owner, if it held the Lease under that name, let go.
        let claim = crate::locks::Claim {
            arm: hooks.kill_switch,
            take_over: false,
            identity: cfg.identity.name.clone(),
        };
        let c = Controller::open_claiming(cfg.clone(), claim)
            .map_err(io_error("opening controller state"))?;
        (None, Some(c))
    } else {
        (None, None)
    };
    let node = if cfg.mode.node() {
        Some(Node::open(cfg.clone()).map_err(io_error("starting node plugin"))?)
    } else {
        None
    };
    Ok(Services {
        lease,
        controller,
        node,
    })
}

/// The `--http-endpoint` server (metrics and health), if one is configured.
async fn start_http(
    cfg: &Config,
    metrics: &Arc<crate::metrics::Metrics>,
    node: Option<&Arc<Node>>,
    metrics_hooks: &mut MetricsHooks,
) -> Result<Option<fencecsi_cluster::http::HttpServer>, ServeError> {
    let Some(endpoint) = &cfg.http_endpoint else {
        return Ok(None);
    };
    let report = crate::http::Report::new(metrics.clone(), node.map(|n| n.guard.clone()));
    let server = fencecsi_cluster::http::start(endpoint, report)
        .await
        .map_err(io_error(&format!("binding --http-endpoint {endpoint}")))?;
    if let Some(tx) = metrics_hooks.http_endpoint.take() {
        let _ = tx.send(server.local_addr());
    }
    Ok(Some(server))
}

/// The node's recovery loop, reporting the node clean where configured.
async fn start_recovery(
    cfg: &Config,
    node: Option<&Arc<Node>>,
    hooks: &mut ServeHooks,
) -> Result<Option<crate::node::recover::RecoveryHandle>, ServeError> {
    if cfg.report_node_clean && hooks.clean_reporter.is_none() && node.is_some() {
        hooks.clean_reporter = Some(node_clean_reporter(cfg).await?);
    }
    let Some(n) = node else {
        return Ok(None);
    };
    if cfg.recover_interval.is_zero() && hooks.recovery.is_none() {
        return Ok(None);
    }
    let reporter = hooks
        .clean_reporter
        .clone()
        .unwrap_or_else(|| Arc::new(crate::node::recover::LogReporter));
    let h = crate::node::recover::spawn(
        n.clone(),
        crate::node::recover::RecoveryOptions {
            interval: cfg.recover_interval,
            reporter,
        },
    );
    if let Some(tx) = hooks.recovery.take() {
        let _ = tx.send(h.clone());
    }
    Ok(Some(h))
}

/// The gRPC services of the configured modes, behind the RPC metrics.
fn router(
    cfg: &Config,
    metrics: Arc<crate::metrics::Metrics>,
    controller: Option<Arc<Controller>>,
    node: Option<Arc<Node>>,
) -> tonic::transport::server::Router<
    tower::layer::util::Stack<crate::metrics::RpcMetricsLayer, tower::layer::util::Identity>,
> {
    tonic::transport::Server::builder()
        .layer(crate::metrics::RpcMetricsLayer::new(metrics))
        .add_service(IdentityServer::new(IdentityService::new(
            cfg,
            node.as_ref().map(|n| n.guard.clone()),
        )))
        .add_optional_service(
            controller
                .clone()
                .map(|c| GroupControllerServer::new(GroupControllerService(c))),
        )
        .add_optional_service(controller.map(|c| ControllerServer::new(ControllerService(c))))
        .add_optional_service(node.map(|n| NodeServer::new(NodeService(n))))
}

fn spawn_gc(
    c: Arc<Controller>,
    every: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            let c = c.clone();
            if let Ok(n) = tokio::task::spawn_blocking(move || c.collect_garbage()).await {
                if n > 0 {
                    tracing::info!(removed = n, "fenced generations collected");
                }
            }
        }
    })
}

/// The node's heartbeat Lease, where configured; it stops when the handle is dropped.
async fn start_heartbeat(
    cfg: &Config,
    node: bool,
    hooks: &mut ServeHooks,
) -> Result<Option<crate::node::heartbeat::HeartbeatHandle>, ServeError> {
    if !node || cfg.heartbeat_interval.is_zero() {
        return Ok(None);
    }
    let cluster = match hooks.heartbeat_cluster.take() {
        Some(c) => c,
        None => cfg.kube.connect().await.map_err(|e| {
            ServeError::Config(format!("--heartbeat-interval needs a cluster client: {e}"))
        })?,
    };
    let opts = crate::node::heartbeat::HeartbeatOptions {
        namespace: cfg
            .heartbeat_namespace
            .clone()
            .unwrap_or_else(fencecsi_cluster::cli::own_namespace),
        node: node_name(cfg),
        interval: cfg.heartbeat_interval,
    };
    Ok(Some(crate::node::heartbeat::spawn(cluster, opts)))
}

/// The name of this node's Node object.
fn node_name(cfg: &Config) -> String {
    cfg.node_name
        .clone()
        .or_else(|| cfg.node_id.clone())
        .unwrap_or_default()
}

/// The binary's clean reporter: writes the Node annotation through a real
/// API server (in-cluster config, or --kubeconfig).
async fn node_clean_reporter(
    cfg: &Config,
) -> Result<Arc<dyn crate::node::recover::CleanReporter>, ServeError> {
    let cluster = cfg.kube.connect().await.map_err(|e| {
        ServeError::Config(format!("--report-node-clean needs a cluster client: {e}"))
    })?;
    let node = node_name(cfg);
    tracing::info!(node = %node, "clean reports go to the Node object");
    Ok(Arc::new(crate::node::report::NodeCleanReporter::new(
        &cluster, &node,
    )))
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: finishing in-flight calls"),
        _ = int.recv() => tracing::info!("SIGINT: finishing in-flight calls"),
    }
}
