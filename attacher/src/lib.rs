//! fencecsi's VolumeAttachment controller (the role of kubernetes-csi/external-attacher),
//! with the write fence.
//!
//! It watches `storage.k8s.io/v1` VolumeAttachments whose `spec.attacher` is the CSI
//! driver's name (learned from the plugin with GetPluginInfo), and
//!
//! - **attaches**: adds the finalizer [`well_known::attacher_finalizer`] to the
//!   PersistentVolume and the VolumeAttachment, resolves the CSI node ID (CSINode, then
//!   the Node's `csi.volume.kubernetes.io/nodeid` annotation), calls
//!   `ControllerPublishVolume`, and sets `status.attached` with `attachmentMetadata` =
//!   the publish context. Failures go to `status.attachError` and are retried.
//! - **detaches** (deletionTimestamp set): calls `ControllerUnpublishVolume` — with
//!   `fence = true` when the [`FencePolicy`] says so and the plugin advertises
//!   `UNPUBLISH_FENCE` — and removes the finalizer only after it succeeded (NOT_FOUND for
//!   the volume counts as detached). Failures go to `status.detachError` and are retried.
//!   The PV keeps the finalizer while any VolumeAttachment of the driver references it.
//!
//! Work is spread over a bounded pool of workers fed by a de-duplicating queue (an object
//! is never processed by two workers at once) with per-object exponential backoff; every
//! VolumeAttachment is re-queued each resync period. With leader election, only the
//! replica holding the Lease acts. Metrics (prometheus-client), `/healthz` and `/readyz`
//! are served over HTTP (see `http`); Kubernetes Events mark each attach, detach and fence.
//!
//! # Running it in-process
//!
//! ```no_run
//! # async fn f() {
//! use std::time::Duration;
//! use fencecsi_attacher::{Attacher, Config};
//! use fencecsi_embedded_cluster::EmbeddedCluster;
//!
//! let cluster = EmbeddedCluster::new().cluster();
//! let mut cfg = Config::new("/run/fencecsi/controller.sock");
//! cfg.resync = Duration::from_secs(5);
//! let mut handle = Attacher::new(cluster.clone(), cfg).spawn();
//! handle.wait_active(Duration::from_secs(10)).await;
//! // ... create PVs, Nodes, CSINodes, VolumeAttachments ...
//! handle.shutdown().await.unwrap(); // graceful: finish in-flight calls, release the lease
//! # }
//! ```
//!
//! Or `Attacher::new(cluster, cfg).run(shutdown_future).await` to run it on the current
//! task until `shutdown_future` resolves.

pub mod config;
mod csi;
mod http;
pub mod metrics;
mod plugin_wait;
mod queue;
mod reconcile;
mod run;
mod volume;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fencecsi_cluster::Cluster;
use tokio::sync::{oneshot, watch};

pub use config::{lease_name_for, parse_duration, Backoff, Config, FencePolicy, NAME};
pub use csi::Capabilities;
/// The leader-election settings of [`Config::leader_election`], shared with the flags.
pub use fencecsi_cluster::cli::LeaderElectionArgs;
pub use fencecsi_cluster::http::HttpEndpoint;
pub use fencecsi_cluster::well_known;
pub use metrics::Metrics;
pub use reconcile::{
    REASON_ATTACHED, REASON_ATTACHMENT_LOST, REASON_ATTACH_FAILED, REASON_DETACHED,
    REASON_DETACH_FAILED, REASON_FENCED, VA_NODE_ID_ANNOTATION,
};
pub use run::REPORTING_CONTROLLER;

/// Errors that stop the attacher. Per-object failures never do: they are recorded on the
/// object and retried.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("binding the HTTP endpoint {endpoint}: {source}")]
    Http {
        endpoint: HttpEndpoint,
        source: std::io::Error,
    },
    #[error("cluster: {0}")]
    Cluster(#[from] fencecsi_cluster::Error),
    /// The instance's task panicked (or was cancelled).
    #[error("attacher task: {0}")]
    Task(tokio::task::JoinError),
}

/// Where an instance is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Phase {
    /// Looking for the CSI plugin (GetPluginInfo, ControllerGetCapabilities).
    #[default]
    Starting,
    /// Found the plugin; waiting for the Lease.
    Standby,
    /// Watching and processing VolumeAttachments.
    Active,
    /// Shutting down: no new work, in-flight calls finishing.
    Stopping,
    Stopped,
}

/// An instance's observable state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Status {
    pub phase: Phase,
    /// The CSI driver name, once the plugin answered.
    pub driver: Option<String>,
    pub capabilities: Option<Capabilities>,
    /// The bound `/metrics`, `/healthz` and `/readyz` address (the real port when 0 was
    /// asked for).
    pub http_addr: Option<SocketAddr>,
    pub identity: String,
    /// Leader election has had no answer from the API server for its unhealthy-after
    /// limit (Forbidden, unreachable): /healthz reports it, so a liveness probe restarts
    /// the pod.
    pub election_failing: bool,
}

/// One attacher instance, before it runs.
pub struct Attacher {
    cluster: Cluster,
    cfg: Config,
    metrics: Arc<Metrics>,
    status: watch::Sender<Status>,
}

impl Attacher {
    pub fn new(cluster: Cluster, cfg: Config) -> Self {
        Attacher {
            cluster,
            cfg,
            metrics: Arc::new(Metrics::new()),
            status: watch::Sender::new(Status::default()),
        }
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    pub fn status(&self) -> watch::Receiver<Status> {
        self.status.subscribe()
    }

    /// Runs until `shutdown` resolves, then stops taking work, lets in-flight operations
    /// finish (at most `shutdown_grace`), releases the Lease and returns.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), Error> {
        run::run(self.cluster, self.cfg, self.metrics, self.status, shutdown).await
    }

    /// Runs in a tokio task; the handle stops it gracefully or kills it.
    pub fn spawn(self) -> AttacherHandle {
        let status = self.status.subscribe();
        let metrics = self.metrics.clone();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(self.run(async {
            // A dropped sender is a kill (abort / drop), never a graceful stop.
            if rx.await.is_err() {
                std::future::pending::<()>().await;
            }
        }));
        AttacherHandle {
            status,
            metrics,
            stop: Some(tx),
            task: Some(task),
        }
    }
}

/// Starts an attacher in a tokio task (shorthand for `Attacher::new(..).spawn()`).
pub fn spawn(cluster: Cluster, cfg: Config) -> AttacherHandle {
    Attacher::new(cluster, cfg).spawn()
}

/// A running attacher. Dropping it kills the instance like [`AttacherHandle::abort`].
pub struct AttacherHandle {
    status: watch::Receiver<Status>,
    metrics: Arc<Metrics>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), Error>>>,
}

impl AttacherHandle {
    pub fn status(&self) -> Status {
        self.status.borrow().clone()
    }

    /// Whether the instance is running and processing VolumeAttachments.
    pub fn is_active(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
            && self.status.borrow().phase == Phase::Active
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Waits until the instance is active; false on timeout or if it stopped.
    pub async fn wait_active(&mut self, timeout: Duration) -> bool {
        let wait = self
            .status
            .wait_for(|s| matches!(s.phase, Phase::Active | Phase::Stopped));
        matches!(tokio::time::timeout(timeout, wait).await, Ok(Ok(s)) if s.phase == Phase::Active)
    }

    /// Graceful stop: no new work, in-flight operations finish, the Lease is released.
    pub async fn shutdown(mut self) -> Result<(), Error> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.task.take() {
            Some(t) => t.await.map_err(Error::Task)?,
            None => Ok(()),
        }
    }

    /// Kills the instance as a crash would: in-flight operations are dropped mid-way and
    /// the Lease is not released (others take over once it expires).
    pub async fn abort(mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for AttacherHandle {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}
