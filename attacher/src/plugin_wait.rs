//! Work that failed because the plugin was away waits for the plugin, not for a backoff
//! that grew while it was away.
//!
//! While a VolumeAttachment waits so (`WorkQueue::add_waiting_for_plugin`), the plugin
//! is probed every [`PROBE_INTERVAL`]; the first probe it answers (ready) retries every
//! waiting object at once. An object retried so that fails the same way again before a
//! probe finds the plugin away keeps its backoff: a plugin that answers Probe but fails
//! such calls (a leader it forwards to is gone, a call slower than the timeout) is not
//! called once a second for it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tonic::Status;

use crate::metrics::Metrics;
use crate::queue::WorkQueue;

/// How often the plugin is probed while work waits for it.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// Runs until the queue shuts down: releases the queue's plugin waiters when the
/// plugin answers. `probe` is one bounded Probe call.
pub(crate) async fn retry_when_plugin_answers<F, Fut>(
    queue: Arc<WorkQueue>,
    metrics: Arc<Metrics>,
    interval: Duration,
    probe: F,
) where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<(), Status>>,
{
    let mut away = false;
    while queue.until_waiting_for_plugin().await {
        tokio::time::sleep(interval).await;
        match probe().await {
            Err(status) => {
                if !away {
                    tracing::info!(error = %status, "the plugin does not answer; attachments that failed for that are retried once it does");
                }
                away = true;
                queue.plugin_away();
            }
            Ok(()) => {
                let keys = queue.plugin_back();
                if !keys.is_empty() {
                    metrics.plugin_returned(keys.len());
                    tracing::info!(
                        count = keys.len(),
                        ?keys,
                        "the plugin answers: retrying now what failed while it was away"
                    );
                }
                away = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Backoff;
    use std::collections::VecDeque;
    use std::sync::Mutex;

    type Script = Arc<Mutex<VecDeque<bool>>>;

    /// The watcher with scripted probe answers (past the script the plugin stays away).
    fn watcher(
        answers: Vec<bool>,
    ) -> (
        Arc<WorkQueue>,
        Arc<Metrics>,
        tokio::task::JoinHandle<()>,
        Script,
    ) {
        let hour = Duration::from_secs(3600);
        let queue = Arc::new(WorkQueue::new(
            Backoff {
                initial: hour,
                max: hour,
            },
            None,
        ));
        let metrics = Arc::new(Metrics::new());
        let script: Script = Arc::new(Mutex::new(VecDeque::from(answers)));
        let task = {
            let (q, m, s) = (queue.clone(), metrics.clone(), script.clone());
            let probe = move || {
                let up = s.lock().unwrap().pop_front().unwrap_or(false);
                async move {
                    if up {
                        Ok(())
                    } else {
                        Err(Status::unavailable("gone"))
                    }
                }
            };
            tokio::spawn(retry_when_plugin_answers(
                q,
                m,
                Duration::from_millis(1),
                probe,
            ))
        };
        (queue, metrics, task, script)
    }

    #[tokio::test]
    async fn waiting_work_is_queued_when_the_plugin_answers_after_an_outage() {
        let (queue, metrics, task, _) = watcher(vec![false, false, true]);
        queue.add_waiting_for_plugin("va-1");
        // Handed out now, not after its hour of backoff.
        assert_eq!(queue.get().await.as_deref(), Some("va-1"));
        assert_eq!(metrics.plugin_return_retries(), 1);
        assert_eq!(queue.failures("va-1"), 0);
        queue.shut_down();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn a_plugin_that_answers_probe_but_fails_the_call_gets_it_once() {
        let (queue, metrics, task, script) = watcher(vec![true, true]);
        queue.add_waiting_for_plugin("va-1");
        assert_eq!(queue.get().await.as_deref(), Some("va-1"));
        queue.done("va-1");
        // The retry fails the same way; the plugin still answers Probe.
        queue.add_waiting_for_plugin("va-1");
        while queue.waits_for_plugin() {
            tokio::task::yield_now().await;
        }
        assert!(script.lock().unwrap().is_empty(), "both probes ran");
        assert_eq!(metrics.plugin_return_retries(), 1);
        assert_eq!(queue.failures("va-1"), 1, "back on its backoff");
        queue.shut_down();
        task.await.unwrap();
    }
}
