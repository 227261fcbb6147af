//! Plumbing of the tests that run a controller in this process against a real API server
//! (`podgc/tests/real_cluster.rs`, `attacher/tests/real_cluster.rs`): the kubeconfig
//! from `FENCECSI_TEST_KUBECONFIG`, a per-run name suffix and label on every object the
//! run makes, a recorder of what a watch delivers, the Events about an object, and the
//! cleanup of everything the run labelled (and the Events about it).

use std::ffi::{OsStr, OsString};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencecsi_cluster::k8s_openapi::api::events::v1::Event;
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use fencecsi_cluster::{Cluster, DeleteOptions, ListParams, Object, WatchEvent, WatchStream};
use futures::StreamExt;
use serde_json::json;

/// The variable naming the kubeconfig of the real API server.
pub const KUBECONFIG_VAR: &str = "FENCECSI_TEST_KUBECONFIG";
/// The label every object of a run carries, with the run's id as its value.
pub const RUN_LABEL: &str = "fencecsi.test/real-cluster-run";
/// Where the Events the tests look at are: those about cluster-scoped objects, and those
/// about the objects of the tests' namespace.
pub const EVENTS_NS: &str = "default";

pub fn name_of<K: Object>(o: &K) -> String {
    o.metadata().name.clone().unwrap_or_default()
}

/// The kubeconfig `FENCECSI_TEST_KUBECONFIG` names; without it, prints that `test` is
/// SKIPPED and returns `None` (the test then returns: it passes).
pub fn kubeconfig_or_skip(test: &str) -> Option<OsString> {
    let path = std::env::var_os(KUBECONFIG_VAR).filter(|p| !p.is_empty());
    if path.is_none() {
        eprintln!("SKIPPED: {test} needs {KUBECONFIG_VAR} (a kubeconfig of a real API server)");
    }
    path
}

/// One run of a test on the real API server: the cluster, and the run's id, which every
/// object of the run carries in its name and in its [`RUN_LABEL`].
#[derive(Clone)]
pub struct RunCtx {
    pub cluster: Cluster,
    pub run: String,
}

impl RunCtx {
    /// Tracing (`RUST_LOG`, warnings by default), the cluster of `kubeconfig`, and a new
    /// run id.
    pub async fn connect(kubeconfig: &OsStr) -> RunCtx {
        crate::init_tracing();
        let cluster = Cluster::from_kubeconfig(kubeconfig)
            .await
            .expect("load FENCECSI_TEST_KUBECONFIG");
        RunCtx {
            cluster,
            run: uuid::Uuid::new_v4().simple().to_string()[..8].to_string(),
        }
    }

    /// The name of the run's object `base`.
    pub fn name(&self, base: &str) -> String {
        format!("fc-{base}-{}", self.run)
    }

    /// Metadata of the run's object `name` (in `ns`), labelled.
    pub fn meta(&self, name: impl Into<String>, ns: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: ns.map(str::to_string),
            labels: Some([(RUN_LABEL.to_string(), self.run.clone())].into()),
            ..Default::default()
        }
    }

    /// The label selector of the run's objects.
    pub fn selector(&self) -> String {
        format!("{RUN_LABEL}={}", self.run)
    }

    /// Whether `e` is about an object of this run (its name carries the run's id).
    pub fn is_about_us(&self, e: &Event) -> bool {
        e.regarding
            .as_ref()
            .and_then(|r| r.name.as_deref())
            .is_some_and(|n| n.contains(&self.run))
    }

    /// Deletes the run's objects of `kinds` (in that order, their finalizers removed
    /// first) and every Event about the run's objects; returns what could not be deleted
    /// and what is left half a second later.
    pub async fn cleanup(&self, kinds: &[Sweep]) -> Vec<String> {
        let c = &self.cluster;
        let lp = ListParams::default().labels(&self.selector());
        let mut left = Vec::new();
        for k in kinds {
            left.extend((k.delete)(c, k.ns, &lp, &k.opts).await);
        }
        let events = c.api::<Event>(Some(EVENTS_NS));
        if let Ok(list) = events.list(&ListParams::default()).await {
            for e in list.items.iter().filter(|e| self.is_about_us(e)) {
                let _ = events.delete(&name_of(e), &DeleteOptions::default()).await;
            }
        }

        // What is left (deletions of objects without finalizers take effect at once).
        tokio::time::sleep(Duration::from_millis(500)).await;
        for k in kinds {
            left.extend((k.left)(c, k.ns, &lp).await);
        }
        if let Ok(list) = events.list(&ListParams::default()).await {
            left.extend(
                list.items
                    .iter()
                    .filter(|e| self.is_about_us(e))
                    .map(|e| format!("Event {}", name_of(e))),
            );
        }
        left
    }

    /// [`RunCtx::cleanup`] in a task of its own (the debug build's test thread has little
    /// stack).
    pub async fn cleanup_in_task(&self, kinds: Vec<Sweep>) -> Vec<String> {
        let ctx = self.clone();
        tokio::spawn(async move { ctx.cleanup(&kinds).await })
            .await
            .expect("cleanup task")
    }
}

/// Once everything is cleaned up: the scenario's panic again, if it failed, after saying
/// what the cleanup left.
pub fn resume_failure(outcome: Result<(), tokio::task::JoinError>, left: &[String]) {
    if let Err(e) = outcome {
        eprintln!("scenario failed; cleaned up, left: {left:?}");
        std::panic::resume_unwind(e.into_panic());
    }
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
type DeleteFn = for<'a> fn(
    &'a Cluster,
    Option<&'a str>,
    &'a ListParams,
    &'a DeleteOptions,
) -> BoxFuture<'a, Vec<String>>;
type LeftFn =
    for<'a> fn(&'a Cluster, Option<&'a str>, &'a ListParams) -> BoxFuture<'a, Vec<String>>;

/// A kind of object a run labels, for [`RunCtx::cleanup`]: where its objects are and how
/// they are deleted.
pub struct Sweep {
    ns: Option<&'static str>,
    opts: DeleteOptions,
    delete: DeleteFn,
    left: LeftFn,
}

impl Sweep {
    /// The run's objects of kind `K` in `ns` (`None`: cluster-scoped), deleted with the
    /// default options.
    pub fn of<K: Object>(ns: Option<&'static str>) -> Sweep {
        Sweep::with::<K>(ns, DeleteOptions::default())
    }

    /// As [`Sweep::of`], deleted with `opts`.
    pub fn with<K: Object>(ns: Option<&'static str>, opts: DeleteOptions) -> Sweep {
        Sweep {
            ns,
            opts,
            delete: delete_labelled::<K>,
            left: left_labelled::<K>,
        }
    }
}

fn delete_labelled<'a, K: Object>(
    c: &'a Cluster,
    ns: Option<&'a str>,
    lp: &'a ListParams,
    opts: &'a DeleteOptions,
) -> BoxFuture<'a, Vec<String>> {
    Box::pin(async move {
        let api = c.api::<K>(ns);
        let mut errors = Vec::new();
        match api.list(lp).await {
            Ok(list) => {
                for o in list.items {
                    let n = name_of(&o);
                    // Ours: the controller under test is stopped, and nothing else needs them.
                    let _ = api
                        .patch_merge(&n, &json!({"metadata": {"finalizers": null}}))
                        .await;
                    if let Err(e) = api.delete(&n, opts).await {
                        if !e.is_not_found() {
                            errors.push(format!("deleting {} {n}: {e}", K::KIND));
                        }
                    }
                }
            }
            Err(e) => errors.push(format!("listing {}: {e}", K::KIND)),
        }
        errors
    })
}

fn left_labelled<'a, K: Object>(
    c: &'a Cluster,
    ns: Option<&'a str>,
    lp: &'a ListParams,
) -> BoxFuture<'a, Vec<String>> {
    Box::pin(async move {
        match c.api::<K>(ns).list(lp).await {
            Ok(list) => list
                .items
                .iter()
                .map(|o| format!("{} {}", K::KIND, name_of(o)))
                .collect(),
            Err(_) => Vec::new(),
        }
    })
}

/// The Events (in [`EVENTS_NS`]) about the object named `name`; with `controller`, only
/// those it reported.
pub async fn events_about(c: &Cluster, name: &str, controller: Option<&str>) -> Vec<Event> {
    c.api::<Event>(Some(EVENTS_NS))
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                && controller.is_none_or(|c| e.reporting_controller.as_deref() == Some(c))
        })
        .collect()
}

/// Records what a watch delivers, until dropped.
pub struct Recorder<K> {
    events: Arc<Mutex<Vec<WatchEvent<K>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl<K: Object> Recorder<K> {
    pub fn start(mut stream: WatchStream<K>) -> Self {
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        let task = tokio::spawn(async move {
            while let Some(ev) = stream.next().await {
                sink.lock().unwrap().push(ev);
            }
        });
        Recorder { events, task }
    }

    pub fn snapshot(&self) -> Vec<WatchEvent<K>> {
        self.events.lock().unwrap().clone()
    }
}

impl<K> Drop for Recorder<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}
