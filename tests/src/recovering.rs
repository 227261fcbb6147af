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

/// Records the times of the clean reports it receives, and passes each on to
/// another reporter if it has one (else answers that it was written).
#[derive(Default)]
pub struct RecordingReporter {
    pub calls: Mutex<Vec<SystemTime>>,
    inner: Option<Box<dyn CleanReporter>>,
}

impl RecordingReporter {
    /// Records, then passes each report on to `inner` (a cluster reporter, say).
    pub fn passing_to(inner: impl CleanReporter + 'static) -> Self {
        RecordingReporter {
            calls: Mutex::default(),
            inner: Some(Box::new(inner)),
        }
    }
}

impl CleanReporter for RecordingReporter {
    fn report_clean<'a>(
        &'a self,
        node_id: &'a str,
        time: SystemTime,
    ) -> BoxFuture<'a, Result<bool, BoxError>> {
        self.calls.lock().unwrap().push(time);
        match &self.inner {
            Some(inner) => inner.report_clean(node_id, time),
            None => Box::pin(async { Ok(true) }),
        }
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
        Self::start_reporting_to(cfg, Arc::new(RecordingReporter::default())).await
    }

    /// As [`RecoveringNode::start`], reporting to `reporter` (which may outlive this
    /// plugin and serve the next one started on the node).
    pub async fn start_reporting_to(cfg: Config, reporter: Arc<RecordingReporter>) -> Self {
        let socket = cfg.socket_path().unwrap();
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
