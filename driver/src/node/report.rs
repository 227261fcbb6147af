//! The node plugin's clean report, written to the Node object.
//!
//! [`NodeCleanReporter`] implements the driver's
//! [`CleanReporter`](super::recover::CleanReporter): the node plugin calls
//! it after every recovery pass that left nothing fenced, with the time the pass started.
//! It keeps the node's quarantine annotations from a watch on that one Node (as a kubelet
//! watches its own Node), and writes `fencecsi.io/node-clean` only when the node is
//! quarantined and has no report newer than `fencecsi.io/quarantined-at` yet.
//!
//! A watch can die without a sign: after a network cut with no TCP keepalive the client
//! still waits on a connection the server has dropped, and every change after that is lost
//! until kube-runtime gives up on it (after 295 s by default; kube's client configuration
//! has no TCP keepalive to set). So the watch is not trusted for long:
//! - each watch call is bounded to [`WATCH_TIMEOUT_SECS`], and kube-runtime takes a call
//!   that delivered nothing for that plus 5 s for dead and reopens it;
//! - what the watch said is used for at most [`MAX_CACHE_AGE`] after it said it; a pass
//!   that comes later reads the Node afresh (and logs it when that read finds a quarantine
//!   the watch missed). The watch last spoke before the cut, so after a cut longer than
//!   that the first clean pass once the node is back reads the Node and reports; after a
//!   shorter one, a pass at most [`MAX_CACHE_AGE`] later does. A quiet Node costs at most
//!   one GET per [`MAX_CACHE_AGE`], less than the kubelet's own GET of its Node every 10 s;
//! - every call to the API server is bounded by [`CALL_TIMEOUT`], so a request sent on a
//!   connection the cut killed fails (and the next pass retries) instead of holding up the
//!   recovery loop.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use super::recover::{BoxError, CleanReporter};
use fencecsi_cluster::k8s_openapi::api::core::v1::Node;
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::well_known::{NODE_CLEAN_ANNOTATION, QUARANTINED_AT_ANNOTATION};
use fencecsi_cluster::{Cluster, MetadataPatch, WatchEvent, WatchParams};
use futures::future::BoxFuture;
use futures::StreamExt;

/// Bound of each call of the Node watch (the API server's `timeoutSeconds`).
pub const WATCH_TIMEOUT_SECS: u32 = 30;
/// How long what the watch last said is used without reading the Node afresh.
pub const MAX_CACHE_AGE: Duration = Duration::from_secs(15);
/// Bound of each read or write of the Node.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

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

/// What the watch or a read last said about the Node, and when.
#[derive(Debug, Clone)]
struct Cached {
    seen: Seen,
    at: Instant,
}

type Cache = Arc<Mutex<Option<Cached>>>;

fn store(cache: &Cache, seen: Seen) {
    *cache.lock().unwrap_or_else(|e| e.into_inner()) = Some(Cached {
        seen,
        at: Instant::now(),
    });
}

/// `call`, or an error once it has taken [`CALL_TIMEOUT`].
async fn bounded<T>(
    what: &str,
    call: impl Future<Output = fencecsi_cluster::Result<T>>,
) -> Result<T, BoxError> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(format!("{what}: no answer within {CALL_TIMEOUT:?}").into()),
    }
}

/// Writes the node-clean report onto one Node (named like the CSI node ID unless given).
pub struct NodeCleanReporter {
    cluster: Cluster,
    node: String,
    cache: Cache,
    max_cache_age: Duration,
    task: tokio::task::JoinHandle<()>,
}

impl NodeCleanReporter {
    /// Starts watching Node `node_name`. Needs a tokio runtime.
    pub fn new(cluster: &Cluster, node_name: &str) -> Self {
        let cache: Cache = Arc::new(Mutex::new(None));
        let s = cache.clone();
        let c = cluster.clone();
        let name = node_name.to_string();
        let task = tokio::spawn(async move {
            let params = WatchParams::default()
                .fields(&format!("metadata.name={name}"))
                .timeout(WATCH_TIMEOUT_SECS);
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
                store(&s, v.unwrap_or_default());
            }
        });
        NodeCleanReporter {
            cluster: cluster.clone(),
            node: node_name.to_string(),
            cache,
            max_cache_age: MAX_CACHE_AGE,
            task,
        }
    }

    /// How long what the watch last said is used before a pass reads the Node afresh
    /// (default [`MAX_CACHE_AGE`]).
    pub fn with_max_cache_age(mut self, age: Duration) -> Self {
        self.max_cache_age = age;
        self
    }

    fn cached(&self) -> Option<Cached> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The Node's annotations: what the watch said if it said it recently enough, else a
    /// fresh read.
    async fn current(&self) -> Result<Seen, BoxError> {
        let cached = self.cached();
        if let Some(c) = &cached {
            if c.at.elapsed() <= self.max_cache_age {
                return Ok(c.seen.clone());
            }
        }
        let n = bounded(
            "reading the Node",
            self.cluster.api::<Node>(None).get_opt(&self.node),
        )
        .await?;
        let fresh = n.as_ref().map(Seen::of).unwrap_or_default();
        if let (Some(c), Some(qa)) = (&cached, fresh.quarantined_at) {
            if c.seen.quarantined_at != Some(qa) {
                tracing::warn!(
                    node = %self.node,
                    quarantined_at = %qa,
                    watch_said = ?c.seen.quarantined_at,
                    watch_silent_secs = c.at.elapsed().as_secs(),
                    "a fresh read of the Node found a quarantine its watch missed (the watch may be dead)"
                );
            }
        }
        // Unless the watch spoke meanwhile: then what it said is as new as this.
        let mut guard = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().map(|c| c.at) == cached.map(|c| c.at) {
            *guard = Some(Cached {
                seen: fresh.clone(),
                at: Instant::now(),
            });
        }
        Ok(fresh)
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
            let written = bounded(
                "writing node-clean",
                self.cluster.api::<Node>(None).patch_metadata(
                    &self.node,
                    &MetadataPatch::new().set_annotation(NODE_CLEAN_ANNOTATION, &t.to_string()),
                ),
            )
            .await?;
            store(&self.cache, Seen::of(&written));
            tracing::info!(node = %self.node, clean_at = %t, quarantined_at = %qa, "node reported clean");
            Ok(true)
        })
    }
}

#[cfg(test)]
mod tests {
    //! The report with a Node watch that goes silent (`EmbeddedCluster::cut_watches`: nothing more
    //! arrives and nothing says so) and, as the control, with a live one. `pass` stands in
    //! for the recovery loop: a clean pass calls `report_clean` with its start time.

    use super::*;
    use fencecsi_embedded_cluster::sim::ready_node;
    use fencecsi_embedded_cluster::EmbeddedCluster;

    const NODE: &str = "n1";
    /// Time between recovery passes here.
    const PASS: Duration = Duration::from_millis(50);
    /// How long the reporters of these tests use what their watch said.
    const AGE: Duration = Duration::from_millis(500);
    /// The bound on a report that must come (normally within a cache age and a pass): for
    /// liveness only, so generous that a busy machine keeps it.
    const BOUND: Duration = Duration::from_secs(30);
    /// How long the control that must not report is watched: several cache ages, more
    /// than the reporters above take to report (a busy machine only lengthens it).
    const WINDOW: Duration = Duration::from_secs(3);

    async fn cluster() -> EmbeddedCluster {
        let c = EmbeddedCluster::new();
        c.api::<Node>(None).create(&ready_node(NODE)).await.unwrap();
        c
    }

    /// The reporter, once its watch has listed the Node.
    async fn reporter(c: &Cluster, age: Duration) -> NodeCleanReporter {
        let r = NodeCleanReporter::new(c, NODE).with_max_cache_age(age);
        tokio::time::timeout(BOUND, async {
            while r.cached().is_none() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the watch listed the Node");
        r
    }

    /// podgc's side: the node is quarantined now.
    async fn quarantine(c: &Cluster) -> Timestamp {
        let t = Timestamp::now();
        c.api::<Node>(None)
            .patch_metadata(
                NODE,
                &MetadataPatch::new().set_annotation(QUARANTINED_AT_ANNOTATION, &t.to_string()),
            )
            .await
            .unwrap();
        // Passes from now on start after the stamp.
        tokio::time::sleep(Duration::from_millis(5)).await;
        t
    }

    async fn clean_at(c: &Cluster) -> Option<Timestamp> {
        let n = c.api::<Node>(None).get(NODE).await.unwrap();
        n.metadata
            .annotations
            .and_then(|a| a.get(NODE_CLEAN_ANNOTATION).cloned())
            .map(|s| s.parse().unwrap())
    }

    /// Clean passes every [`PASS`] until node-clean is on the Node (how long that took) or
    /// `bound` has passed (`None`).
    async fn passes_until_reported(
        c: &Cluster,
        r: &NodeCleanReporter,
        bound: Duration,
    ) -> Option<Duration> {
        let start = Instant::now();
        while start.elapsed() < bound {
            r.report_clean(NODE, SystemTime::now()).await.unwrap();
            if clean_at(c).await.is_some() {
                return Some(start.elapsed());
            }
            tokio::time::sleep(PASS).await;
        }
        None
    }

    #[tokio::test]
    async fn a_quarantine_behind_a_dead_watch_is_reported_within_the_cache_age() {
        let c = cluster().await;
        let r = reporter(&c, AGE).await;
        assert!(r.report_clean(NODE, SystemTime::now()).await.unwrap());
        assert_eq!(clean_at(&c).await, None, "not quarantined: nothing written");

        c.cut_watches::<Node>();
        let qa = quarantine(&c).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            r.cached().unwrap().seen.quarantined_at,
            None,
            "the cut watch must not have delivered the quarantine"
        );
        passes_until_reported(&c, &r, BOUND)
            .await
            .unwrap_or_else(|| panic!("node-clean not written within {BOUND:?}"));
        assert!(clean_at(&c).await.unwrap() > qa);
        // The fresh read is remembered: later passes have nothing to write.
        let before = clean_at(&c).await;
        tokio::time::sleep(PASS).await;
        assert!(r.report_clean(NODE, SystemTime::now()).await.unwrap());
        assert_eq!(clean_at(&c).await, before);
    }

    /// The control for the cut: a reporter that trusts its watch for ever (the behaviour
    /// before issue 18) reports nothing behind a cut watch.
    #[tokio::test]
    async fn a_reporter_that_trusts_a_dead_watch_reports_nothing() {
        let c = cluster().await;
        let r = reporter(&c, Duration::MAX).await;
        c.cut_watches::<Node>();
        quarantine(&c).await;
        assert_eq!(
            passes_until_reported(&c, &r, WINDOW).await,
            None,
            "the cut watch delivered the quarantine after all"
        );
    }

    /// The positive control: with a live watch the same passes report, from the watch
    /// alone (trusted for ever).
    #[tokio::test]
    async fn a_quarantine_seen_by_a_live_watch_is_reported() {
        let c = cluster().await;
        let r = reporter(&c, Duration::MAX).await;
        let qa = quarantine(&c).await;
        passes_until_reported(&c, &r, BOUND)
            .await
            .unwrap_or_else(|| panic!("node-clean not written within {BOUND:?}"));
        assert!(clean_at(&c).await.unwrap() > qa);
        assert_eq!(r.cached().unwrap().seen.quarantined_at, Some(qa));
    }
}
