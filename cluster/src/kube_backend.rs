//! The real-cluster backend: thin calls through kube-rs, plus the two things kube's `Api`
//! leaves to the caller: a metadata patch that is safe against concurrent finalizer edits,
//! and a watch that re-lists and reconnects by itself.

use std::time::{Duration, Instant};

use futures::stream::BoxStream;
use futures::StreamExt;
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{json, Map, Value};

use crate::error::{from_status, Error, Result};
use crate::object::{HasStatus, Object};
use crate::params::{
    DeleteOptions, DeleteOutcome, ListParams, MetadataPatch, WatchEvent, WatchParams,
};

/// Page size of lists: keeps single responses small when listing 150,000 pods.
const PAGE: u32 = 500;
/// Server-side watch timeout; the API server caps it below 300 s anyway.
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

enum Phase<K> {
    List,
    Watch(String),
    Streaming(
        String,
        BoxStream<'static, kube::Result<kube::core::WatchEvent<K>>>,
        Instant,
    ),
}

struct KubeWatch<K: Object> {
    api: kube::Api<K>,
    params: WatchParams,
    phase: Phase<K>,
    backoff: Duration,
}

const MIN_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

impl<K: Object> KubeWatch<K> {
    async fn pause(&mut self, what: &str, err: &(dyn std::fmt::Display + Sync)) {
        tracing::warn!(kind = K::KIND, error = %err, retry_in = ?self.backoff, "watch {what} failed");
        tokio::time::sleep(self.backoff).await;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }

    async fn next_event(&mut self) -> WatchEvent<K> {
        loop {
            match std::mem::replace(&mut self.phase, Phase::List) {
                Phase::List => match list(&self.api, &self.params.list_params(), &|_| {
                    !self.params.changes_only
                })
                .await
                {
                    Ok((items, rv)) => {
                        self.phase = Phase::Watch(rv);
                        return WatchEvent::Listed(items);
                    }
                    Err(e) => self.pause("list", &e).await,
                },
                Phase::Watch(rv) => {
                    let mut wp = kube::api::WatchParams::default().timeout(WATCH_TIMEOUT_SECS);
                    wp.label_selector = self.params.label_selector.clone();
                    wp.field_selector = self.params.field_selector.clone();
                    match self.api.watch(&wp, &rv).await {
                        Ok(s) => self.phase = Phase::Streaming(rv, s.boxed(), Instant::now()),
                        Err(e) if is_gone(&e) => self.phase = Phase::List,
                        Err(e) => {
                            self.phase = Phase::Watch(rv);
                            self.pause("start", &e).await;
                        }
                    }
                }
                Phase::Streaming(rv, mut s, started) => {
                    let item = s.next().await;
                    let rv_of = |o: &K| {
                        o.metadata()
                            .resource_version
                            .clone()
                            .unwrap_or_else(|| rv.clone())
                    };
                    use kube::core::WatchEvent as W;
                    match item {
                        Some(Ok(W::Added(o))) => {
                            self.backoff = MIN_BACKOFF;
                            self.phase = Phase::Streaming(rv_of(&o), s, started);
                            return WatchEvent::Added(o);
                        }
                        Some(Ok(W::Modified(o))) => {
                            self.backoff = MIN_BACKOFF;
                            self.phase = Phase::Streaming(rv_of(&o), s, started);
                            return WatchEvent::Modified(o);
                        }
                        Some(Ok(W::Deleted(o))) => {
                            self.backoff = MIN_BACKOFF;
                            self.phase = Phase::Streaming(rv_of(&o), s, started);
                            return WatchEvent::Deleted(o);
                        }
                        Some(Ok(W::Bookmark(b))) => {
                            self.phase = Phase::Streaming(b.metadata.resource_version, s, started);
                        }
                        Some(Ok(W::Error(status))) if status.code == 410 => {
                            self.phase = Phase::List
                        }
                        Some(Ok(W::Error(status))) => {
                            self.phase = Phase::Watch(rv);
                            self.pause("stream", &from_status(&status)).await;
                        }
                        Some(Err(e)) => {
                            self.phase = Phase::Watch(rv);
                            self.pause("stream", &e).await;
                        }
                        // The server ended the watch (its timeout): resume where we were. A
                        // watch that keeps closing at once (a proxy cutting it) backs off
                        // instead of spinning.
                        None => {
                            self.phase = Phase::Watch(rv);
                            if started.elapsed() < Duration::from_secs(1) {
                                self.pause("stream (closed at once)", &"closed").await;
                            }
                        }
                    }
                }
            }
        }
    }
}

pub(crate) fn watch<K: Object>(
    api: kube::Api<K>,
    params: &WatchParams,
) -> BoxStream<'static, WatchEvent<K>> {
    let phase = match &params.resource_version {
        Some(rv) => Phase::Watch(rv.clone()),
        None => Phase::List,
    };
    let w = KubeWatch {
        api,
        params: params.clone(),
        phase,
        backoff: MIN_BACKOFF,
    };
    futures::stream::unfold(w, |mut w| async move {
        let ev = w.next_event().await;
        Some((ev, w))
    })
    .boxed()
}
