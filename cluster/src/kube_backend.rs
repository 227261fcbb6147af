//! The real-cluster backend: thin calls through kube-rs, a metadata patch that is safe
//! against concurrent finalizer edits (kube's `Api` leaves that to the caller), and the
//! watch, which is kube-runtime's watcher.

use std::marker::PhantomData;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::StreamExt;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{json, Map, Value};

use crate::backend::{Filter, KindBackend, WatchStream};
use crate::error::{Error, Result};
use crate::object::{HasStatus, Object};
use crate::params::{
    DeleteOptions, DeleteOutcome, ListParams, MetadataPatch, ObjectList, WatchEvent, WatchParams,
};

/// Page size of lists: keeps single responses small when listing 150,000 pods.
const PAGE: u32 = 500;
/// Server-side watch timeout unless the caller bounds it (`WatchParams::timeout`); the
/// API server caps it below 300 s anyway. kube-runtime's watcher reopens a call that
/// delivered nothing for this plus 5 s.
const WATCH_TIMEOUT_SECS: u32 = 290;
/// A metadata patch retries this many times on conflicts with other writers.
const PATCH_RETRIES: usize = 16;

fn kube_list_params(lp: &ListParams) -> kube::api::ListParams {
    let mut p = kube::api::ListParams::default().limit(PAGE);
    p.label_selector = lp.label_selector.clone();
    p.field_selector = lp.field_selector.clone();
    p
}

fn is_gone(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 410)
}

/// Lists every page; the resourceVersion is the first page's (the list is one snapshot).
/// An expired continue token (410) restarts the list.
pub(crate) async fn list<K: Object>(
    api: &kube::Api<K>,
    lp: &ListParams,
    filter: &(dyn Fn(&K) -> bool + Send + Sync),
) -> Result<(Vec<K>, String)> {
    let mut restarts = 0;
    'outer: loop {
        let mut p = kube_list_params(lp);
        let mut items = Vec::new();
        let mut rv = None;
        loop {
            let page = match api.list(&p).await {
                Ok(page) => page,
                Err(e) if is_gone(&e) && p.continue_token.is_some() && restarts < 3 => {
                    restarts += 1;
                    continue 'outer;
                }
                Err(e) => return Err(e.into()),
            };
            if rv.is_none() {
                rv = page.metadata.resource_version.clone();
            }
            items.extend(page.items.into_iter().filter(|o| filter(o)));
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(c) => p.continue_token = Some(c),
                None => return Ok((items, rv.unwrap_or_default())),
            }
        }
    }
}

pub(crate) async fn create<K: Object>(api: &kube::Api<K>, obj: &K) -> Result<K> {
    Ok(api.create(&PostParams::default(), obj).await?)
}

pub(crate) async fn replace<K: Object>(api: &kube::Api<K>, obj: &K) -> Result<K> {
    let name = obj.metadata().name.clone().unwrap_or_default();
    Ok(api.replace(&name, &PostParams::default(), obj).await?)
}

pub(crate) async fn replace_status<K: HasStatus>(api: &kube::Api<K>, obj: &K) -> Result<K> {
    let name = obj.metadata().name.clone().unwrap_or_default();
    Ok(api
        .replace_status(&name, &PostParams::default(), obj)
        .await?)
}

/// Read, apply the patch locally, send a JSON merge patch that carries the resourceVersion
/// read (so the server rejects it if anyone wrote in between), retry on conflict. This
/// makes finalizer add/remove a set operation even though merge patch replaces lists whole.
pub(crate) async fn patch_metadata<K: Object>(
    api: &kube::Api<K>,
    name: &str,
    patch: &MetadataPatch,
) -> Result<K> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let current = api.get(name).await?;
        let rv = current
            .metadata()
            .resource_version
            .clone()
            .unwrap_or_default();
        if let Some(want) = &patch.resource_version {
            if *want != rv {
                return Err(Error::Conflict(format!(
                    "{} {name}: resourceVersion {want} is stale (now {rv})",
                    K::KIND
                )));
            }
        }
        let mut meta = current.metadata().clone();
        if !patch.apply_to(&mut meta) {
            return Ok(current);
        }
        let mut m = Map::new();
        m.insert("resourceVersion".into(), json!(rv));
        if !patch.add_finalizers.is_empty() || !patch.remove_finalizers.is_empty() {
            m.insert(
                "finalizers".into(),
                json!(meta.finalizers.clone().unwrap_or_default()),
            );
        }
        if !patch.labels.is_empty() {
            m.insert("labels".into(), json!(patch.labels));
        }
        if !patch.annotations.is_empty() {
            m.insert("annotations".into(), json!(patch.annotations));
        }
        let body = json!({ "metadata": Value::Object(m) });
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
        {
            Ok(obj) => return Ok(obj),
            Err(e) => {
                let e = Error::from(e);
                if e.is_conflict() && patch.resource_version.is_none() && attempt < PATCH_RETRIES {
                    continue;
                }
                return Err(e);
            }
        }
    }
}

pub(crate) async fn patch_merge<K: Object>(
    api: &kube::Api<K>,
    name: &str,
    patch: &Value,
) -> Result<K> {
    Ok(api
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await?)
}

pub(crate) async fn patch_status_merge<K: Object>(
    api: &kube::Api<K>,
    name: &str,
    patch: &Value,
) -> Result<K> {
    Ok(api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(patch))
        .await?)
}

pub(crate) async fn delete<K: Object>(
    api: &kube::Api<K>,
    name: &str,
    opts: &DeleteOptions,
) -> Result<DeleteOutcome<K>> {
    // Negative grace means 1 s to the API server; the kube type is unsigned.
    let grace = opts.grace_period_seconds.map(|g| {
        if g < 0 {
            1
        } else {
            g.min(u32::MAX as i64) as u32
        }
    });
    let preconditions = opts
        .preconditions
        .as_ref()
        .map(|p| kube::api::Preconditions {
            uid: p.uid.clone(),
            resource_version: p.resource_version.clone(),
        });
    let dp = kube::api::DeleteParams {
        grace_period_seconds: grace,
        preconditions,
        ..Default::default()
    };
    let res = api.delete(name, &dp).await?;
    // Pods come back as the object even when deleted at once, so decide from its state: it
    // remains only while finalizers are pending or a grace period is running.
    Ok(match res.left() {
        Some(obj) => {
            let m = obj.metadata();
            let fins = m.finalizers.as_ref().is_some_and(|f| !f.is_empty());
            let grace = m.deletion_grace_period_seconds.unwrap_or(0) > 0;
            if m.deletion_timestamp.is_some() && (fins || grace) {
                DeleteOutcome::Terminating(obj)
            } else {
                DeleteOutcome::Deleted
            }
        }
        None => DeleteOutcome::Deleted,
    })
}

/// The seam's watch on a real API server: kube-runtime's watcher, which lists in
/// pages, resumes from the last resourceVersion it saw (bookmarks included), re-lists
/// when that is too old (410), and backs off on errors. This turns its events into the
/// seam's: one `Listed` per (re-)list, then changes.
///
/// Two differences from the embedded cluster, both allowed by the seam: an add and an
/// update both arrive as `Modified` (kube-runtime does not tell them apart, and no
/// caller needs it), and a start `after` a resourceVersion re-lists instead of
/// replaying (kube-runtime always starts with a list).
pub(crate) fn watch<K: Object>(
    api: kube::Api<K>,
    params: &WatchParams,
) -> BoxStream<'static, WatchEvent<K>> {
    use kube::runtime::watcher::{self, Event};
    use kube::runtime::WatchStreamExt;
    let mut cfg = watcher::Config::default()
        .page_size(PAGE)
        .timeout(params.timeout_secs.unwrap_or(WATCH_TIMEOUT_SECS));
    if let Some(l) = &params.label_selector {
        cfg = cfg.labels(l);
    }
    if let Some(f) = &params.field_selector {
        cfg = cfg.fields(f);
    }
    // A consumer that keeps nothing gets empty lists: the objects are dropped page by
    // page as they arrive, so a list of every pod is never held.
    let keep = !params.changes_only;
    let inner = watcher::watcher(api, cfg).default_backoff().boxed();
    futures::stream::unfold((inner, Vec::new()), move |(mut inner, mut listed)| async move {
        loop {
            match inner.next().await? {
                Ok(Event::Init) => listed.clear(),
                Ok(Event::InitApply(o)) => {
                    if keep {
                        listed.push(o)
                    }
                }
                Ok(Event::InitDone) => {
                    let items = std::mem::take(&mut listed);
                    return Some((WatchEvent::Listed(items), (inner, listed)));
                }
                Ok(Event::Apply(o)) => return Some((WatchEvent::Modified(o), (inner, listed))),
                Ok(Event::Delete(o)) => return Some((WatchEvent::Deleted(o), (inner, listed))),
                Err(e) => {
                    tracing::warn!(kind = K::KIND, error = %e, "watch failed; retrying with backoff")
                }
            }
        }
    })
    .boxed()
}

/// The seam's calls for kind `K` on a real API server.
pub(crate) struct KubeKind<K> {
    client: kube::Client,
    kind: PhantomData<fn() -> K>,
}

impl<K: Object> KubeKind<K> {
    pub(crate) fn new(client: kube::Client) -> Self {
        KubeKind {
            client,
            kind: PhantomData,
        }
    }

    /// kube's `Api` for a single-object call in `ns` ("" for a cluster-scoped kind).
    fn api(&self, ns: &str) -> kube::Api<K> {
        K::kube_api(self.client.clone(), Some(ns).filter(|n| !n.is_empty()))
    }

    /// kube's `Api` for a list or watch of `namespace` (`None`: all, or cluster-scoped).
    fn api_over(&self, namespace: Option<&str>) -> kube::Api<K> {
        K::kube_api(self.client.clone(), namespace)
    }
}

impl<K: Object> KindBackend<K> for KubeKind<K> {
    fn name(&self) -> &'static str {
        "kube"
    }

    fn get<'a>(&'a self, ns: &'a str, name: &'a str) -> BoxFuture<'a, Result<K>> {
        Box::pin(async move { Ok(self.api(ns).get(name).await?) })
    }

    fn list<'a>(
        &'a self,
        namespace: Option<&'a str>,
        params: &'a ListParams,
        filter: Filter<'a, K>,
    ) -> BoxFuture<'a, Result<ObjectList<K>>> {
        Box::pin(async move {
            let (items, resource_version) = list(&self.api_over(namespace), params, filter).await?;
            Ok(ObjectList {
                items,
                resource_version,
            })
        })
    }

    fn create<'a>(&'a self, ns: &'a str, obj: &'a K) -> BoxFuture<'a, Result<K>> {
        Box::pin(async move { create(&self.api(ns), obj).await })
    }

    fn replace<'a>(&'a self, ns: &'a str, obj: &'a K) -> BoxFuture<'a, Result<K>> {
        Box::pin(async move { replace(&self.api(ns), obj).await })
    }

    fn patch_metadata<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        patch: &'a MetadataPatch,
    ) -> BoxFuture<'a, Result<K>> {
        Box::pin(async move { patch_metadata(&self.api(ns), name, patch).await })
    }

    fn patch_merge<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        patch: &'a Value,
    ) -> BoxFuture<'a, Result<K>> {
        Box::pin(async move { patch_merge(&self.api(ns), name, patch).await })
    }

    fn delete<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        opts: &'a DeleteOptions,
    ) -> BoxFuture<'a, Result<DeleteOutcome<K>>> {
        Box::pin(async move { delete(&self.api(ns), name, opts).await })
    }

    fn watch(
        self: Arc<Self>,
        namespace: Option<&str>,
        params: &WatchParams,
    ) -> Result<WatchStream<K>> {
        Ok(watch(self.api_over(namespace), params))
    }

    fn replace_status<'a>(&'a self, ns: &'a str, obj: &'a K) -> BoxFuture<'a, Result<K>>
    where
        K: HasStatus,
    {
        Box::pin(async move { replace_status(&self.api(ns), obj).await })
    }

    fn patch_status_merge<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        patch: &'a Value,
    ) -> BoxFuture<'a, Result<K>>
    where
        K: HasStatus,
    {
        Box::pin(async move { patch_status_merge(&self.api(ns), name, patch).await })
    }
}
