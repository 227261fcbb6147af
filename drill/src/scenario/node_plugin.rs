//! The node plugins: served in this process with the two hooks the drill depends on, the
//! recovery handle and the clean reports on the Node that let podgc lift the quarantine.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context};
use fencecsi_cluster::Cluster;
use fencecsi_driver::config::Mode;
use fencecsi_driver::node::recover::{CleanReporter, RecoveryHandle};
use fencecsi_driver::node::report::NodeCleanReporter;
use fencecsi_driver::server::{serve_with, ServeHooks};
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::{wait_for_socket, Env};

/// A node plugin served in this process with recovery and a clean reporter. Stopped on drop.
pub(super) struct NodePlugin {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    pub(super) recovery: RecoveryHandle,
    pub(super) client: CsiClient,
}

impl NodePlugin {
    pub(super) async fn start(env: &Env, cluster: &Cluster, node: &str) -> anyhow::Result<Self> {
        let mut cfg = env.config(Mode::Node, Some(node), &format!("node-{node}"));
        cfg.recover_interval = Duration::from_secs(1);
        let socket = cfg.socket_path().map_err(|e| anyhow!(e))?;
        let reporter: Arc<dyn CleanReporter> = Arc::new(NodeCleanReporter::new(cluster, node));
        let (rec_tx, rec_rx) = tokio::sync::oneshot::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            if let Err(e) = serve_with(
                cfg,
                async {
                    let _ = stop_rx.await;
                },
                ServeHooks {
                    clean_reporter: Some(reporter),
                    recovery: Some(rec_tx),
                    ..Default::default()
                },
            )
            .await
            {
                tracing::error!(error = %e, "node plugin failed");
            }
        });
        let client = wait_for_socket(&socket).await;
        Ok(NodePlugin {
            stop: Some(stop),
            task: Some(task),
            recovery: rec_rx.await.context("recovery handle")?,
            client,
        })
    }

    pub(super) async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for NodePlugin {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}
