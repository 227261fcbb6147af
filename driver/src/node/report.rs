//! The node plugin's clean report, written to the Node object.
//!
//! [`NodeCleanReporter`] implements the driver's
//! [`CleanReporter`](super::recover::CleanReporter): the node plugin calls
//! it after every recovery pass that left nothing fenced, with the time the pass started.
//! It keeps the node's quarantine annotations from a watch on that one Node (as a kubelet
//! watches its own Node), so a call costs nothing unless a write is due, and writes
//! `fencecsi.io/node-clean` only when the node is quarantined and has no report newer than
//! `fencecsi.io/quarantined-at` yet.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use super::recover::{BoxError, CleanReporter};
use fencecsi_cluster::k8s_openapi::api::core::v1::Node;
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::well_known::{NODE_CLEAN_ANNOTATION, QUARANTINED_AT_ANNOTATION};
use fencecsi_cluster::{Cluster, MetadataPatch, WatchEvent, WatchParams};
use futures::future::BoxFuture;
use futures::StreamExt;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Seen {
    quarantined_at: Option<Timestamp>,
    clean_at: Option<Timestamp>,
}

impl Seen {
    fn of(n: &Node) -> Seen {
        let a = n.metadata.annotations.as_ref();
        let get = |k: &str| {
            a.and_then(|a| a.get(k))
                .and_then(|v| v.parse::<Timestamp>().ok())
        };
        Seen {
            quarantined_at: get(QUARANTINED_AT_ANNOTATION),
            clean_at: get(NODE_CLEAN_ANNOTATION),
        }
    }
}

/// Writes the node-clean report onto one Node (named like the CSI node ID unless given).
pub struct NodeCleanReporter {
    cluster: Cluster,
    node: String,
    seen: Arc<Mutex<Option<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl NodeCleanReporter {
    /// Starts watching Node `node_name`. Needs a tokio runtime.
    pub fn new(cluster: &Cluster, node_name: &str) -> Self {
        let seen = Arc::new(Mutex::new(None));
        let s = seen.clone();
        let c = cluster.clone();
        let name = node_name.to_string();
        let task = tokio::spawn(async move {
            let params = WatchParams::default().fields(&format!("metadata.name={name}"));
            let mut w = match c.api::<Node>(None).watch(&params) {
                Ok(w) => w,
                Err(e) => {
                    tracing::warn!(node = %name, error = %e, "cannot watch the Node; clean reports read it on demand");
                    return;
                }
            };
            while let Some(ev) = w.next().await {
                let v = match ev {
                    WatchEvent::Listed(items) => items.first().map(Seen::of),
                    WatchEvent::Added(n) | WatchEvent::Modified(n) => Some(Seen::of(&n)),
                    WatchEvent::Deleted(_) => None,
                };
                *s.lock().unwrap_or_else(|e| e.into_inner()) = Some(v.unwrap_or_default());
            }
        });
        NodeCleanReporter {
            cluster: cluster.clone(),
            node: node_name.to_string(),
            seen,
            task,
        }
    }

    async fn current(&self) -> Result<Seen, BoxError> {
        if let Some(s) = self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Ok(s);
        }
        let n = self.cluster.api::<Node>(None).get_opt(&self.node).await?;
        Ok(n.as_ref().map(Seen::of).unwrap_or_default())
    }
}

impl Drop for NodeCleanReporter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl CleanReporter for NodeCleanReporter {
    fn report_clean<'a>(
        &'a self,
        _node_id: &'a str,
        time: SystemTime,
    ) -> BoxFuture<'a, Result<bool, BoxError>> {
        Box::pin(async move {
            let seen = self.current().await?;
            let Some(qa) = seen.quarantined_at else {
                return Ok(true); // not quarantined: nothing to report
            };
            if seen.clean_at.is_some_and(|c| c > qa) {
                return Ok(true); // already reported for this quarantine
            }
            let t = Timestamp::try_from(time)?;
            if t <= qa {
                return Ok(false); // the pass started before the quarantine (or the fences)
            }
            let written = self
                .cluster
                .api::<Node>(None)
                .patch_metadata(
                    &self.node,
                    &MetadataPatch::new().set_annotation(NODE_CLEAN_ANNOTATION, &t.to_string()),
                )
                .await?;
            *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(Seen::of(&written));
            tracing::info!(node = %self.node, clean_at = %t, quarantined_at = %qa, "node reported clean");
            Ok(true)
        })
    }
}
