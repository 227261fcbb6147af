//! Controller plugin replicas with leader election, served in the test's process
//! on an API server the test gives (the embedded one): the leadership tests and
//! the tests of what a leader does as it gives up.

use std::time::{Duration, Instant};

use fencecsi_cluster::Cluster;
use fencecsi_driver::config::{Config, Mode};
use fencecsi_driver::server::{serve_with, ServeHooks};
use fencecsi_proto::client::CsiClient;

use crate::{csi, wait_for_socket, Env};

/// The namespace of the replicas' Lease.
pub const NS: &str = "fencecsi";
/// Short leader-election timings, so that a test sees a Lease change hands in seconds.
pub const LEASE: Duration = Duration::from_secs(2);
pub const RENEW: Duration = Duration::from_millis(1500);
pub const RETRY: Duration = Duration::from_millis(200);

/// A controller replica served in this process until `stop` fires; `lost` fires when it
/// stops leading (in place of the process exit of production).
pub struct Replica {
    client: Option<CsiClient>,
    socket: std::path::PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// Fires when the replica stops leading.
    pub lost: tokio::sync::oneshot::Receiver<Instant>,
    task: tokio::task::JoinHandle<()>,
}

/// A controller plugin's config in `env` that elects a leader with the timings above.
pub fn replica_config(env: &Env, name: &str) -> Config {
    let mut cfg = env.config(Mode::Controller, None, name);
    cfg.election.enabled = true;
    cfg.election.namespace = Some(NS.into());
    cfg.identity.name = Some(name.into());
    cfg.election.lease_duration = LEASE;
    cfg.election.renew_deadline = RENEW;
    cfg.election.retry_period = RETRY;
    cfg
}

impl Replica {
    pub fn start(env: &Env, cluster: &Cluster, name: &str) -> Replica {
        Replica::start_with(replica_config(env, name), cluster)
    }

    /// A replica with `cfg` (see [`replica_config`]).
    pub fn start_with(cfg: Config, cluster: &Cluster) -> Replica {
        let socket = cfg.socket_path().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (lost_tx, lost) = tokio::sync::oneshot::channel::<Instant>();
        let hooks = ServeHooks {
            leader_cluster: Some(cluster.clone()),
            on_lost_leadership: Some(Box::new(move || {
                let _ = lost_tx.send(Instant::now());
            })),
            ..Default::default()
        };
        let task = tokio::spawn(async move {
            serve_with(
                cfg,
                async {
                    let _ = stopped.await;
                },
                hooks,
            )
            .await
            .expect("controller replica");
        });
        Replica {
            client: None,
            socket,
            stop: Some(stop),
            lost,
            task,
        }
    }

    pub async fn client(&mut self) -> CsiClient {
        if self.client.is_none() {
            self.client = Some(wait_for_socket(&self.socket).await);
        }
        self.client.clone().unwrap()
    }

    /// Waits until the replica leads and serves the state dir (a standby answers
    /// UNAVAILABLE to everything but Identity and its capabilities).
    pub async fn wait_leading(&mut self, within: Duration) -> CsiClient {
        let c = self.client().await;
        let deadline = Instant::now() + within;
        while let Err(e) = c
            .clone()
            .controller
            .list_volumes(csi::ListVolumesRequest::default())
            .await
        {
            // A standby answers UNAVAILABLE; a connection the replica closed as it
            // took over its serving ends the call CANCELLED, or INTERNAL with the
            // transport's error (an HTTP/2 GOAWAY; both seen in CI). The channel
            // reconnects on the next call.
            assert!(
                matches!(e.code(), tonic::Code::Unavailable | tonic::Code::Cancelled)
                    || closed_by_server(&e),
                "{e:?}"
            );
            assert!(Instant::now() < deadline, "the replica never led: {e:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        c
    }

    /// Whether the replica's server has ended (its serve call returned).
    pub fn has_ended(&self) -> bool {
        self.task.is_finished()
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.task.await;
    }
}

/// Whether a call failed because the server closed its connection (the
/// transport's error, not an answer of the service).
fn closed_by_server(e: &tonic::Status) -> bool {
    use std::error::Error;
    e.source()
        .is_some_and(|s| s.downcast_ref::<tonic::transport::Error>().is_some())
}
