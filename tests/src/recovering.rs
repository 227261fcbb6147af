//! A node plugin served in this process with its recovery loop under the test's control:
//! passes run at start and on demand ([`RecoveryHandle::run_now`]), and every clean report
//! is recorded.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use fencecsi_driver::config::Config;
use fencecsi_driver::node::recover::{BoxError, CleanReporter, RecoveryHandle};
use fencecsi_driver::server::{serve_with, ServeHooks};
use fencecsi_proto::client::CsiClient;
use futures::future::BoxFuture;

use crate::{csi, wait_for_socket};

/// Records the times of the clean reports it receives.
#[derive(Default)]
pub struct RecordingReporter {
    pub calls: Mutex<Vec<SystemTime>>,
}

impl CleanReporter for RecordingReporter {
    fn report_clean<'a>(
        &'a self,
        _node_id: &'a str,
        time: SystemTime,
    ) -> BoxFuture<'a, Result<bool, BoxError>> {
        self.calls.lock().unwrap().push(time);
        Box::pin(async { Ok(true) })
    }
}

pub struct RecoveringNode {
    pub recovery: RecoveryHandle,
    pub client: CsiClient,
    pub reporter: Arc<RecordingReporter>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl RecoveringNode {
    /// Serves `cfg` (a node-mode configuration) until [`RecoveringNode::stop`].
    pub async fn start(cfg: Config) -> Self {
        let socket = cfg.socket_path().unwrap();
        let reporter = Arc::new(RecordingReporter::default());
        let (rec_tx, rec_rx) = tokio::sync::oneshot::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let r: Arc<dyn CleanReporter> = reporter.clone();
        let task = tokio::spawn(async move {
            serve_with(
                cfg,
                async {
                    let _ = stop_rx.await;
                },
                ServeHooks {
                    clean_reporter: Some(r),
                    recovery: Some(rec_tx),
                    ..Default::default()
                },
            )
            .await
            .expect("node plugin");
        });
        let client = wait_for_socket(&socket).await;
        RecoveringNode {
            recovery: rec_rx.await.expect("recovery handle"),
            client,
            reporter,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// What Probe answers.
    pub async fn ready(&self) -> Option<bool> {
        self.client
            .clone()
            .identity
            .probe(csi::ProbeRequest {})
            .await
            .expect("Probe")
            .into_inner()
            .ready
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for RecoveringNode {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}
