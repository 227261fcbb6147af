//! The embedded cluster's store of one kind as a backend of the seam. The store answers
//! at once, so each call is a ready future.

use std::future::ready;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::StreamExt;

use fencecsi_cluster::{
    DeleteOptions, DeleteOutcome, Filter, HasStatus, KindBackend, ListParams, MetadataPatch,
    Object, ObjectList, Result, WatchEvent, WatchParams, WatchStream,
};

use crate::store::{KindStore, Matcher};

impl<K: Object> KindBackend<K> for KindStore<K> {
    fn name(&self) -> &'static str {
        "embedded"
    }

    fn get<'a>(&'a self, ns: &'a str, name: &'a str) -> BoxFuture<'a, Result<K>> {
        Box::pin(ready(KindStore::get(self, ns, name)))
    }

    fn list<'a>(
        &'a self,
        namespace: Option<&'a str>,
        params: &'a ListParams,
        filter: Filter<'a, K>,
    ) -> BoxFuture<'a, Result<ObjectList<K>>> {
        let listed = Matcher::new::<K>(
            namespace,
            params.label_selector.as_deref(),
            params.field_selector.as_deref(),
        )
        .map(|m| {
            let (items, resource_version) = KindStore::list(self, &m, filter);
            ObjectList {
                items,
                resource_version,
            }
        });
        Box::pin(ready(listed))
    }

    fn create<'a>(&'a self, ns: &'a str, obj: &'a K) -> BoxFuture<'a, Result<K>> {
        Box::pin(ready(KindStore::create(self, ns, obj)))
    }

    fn replace<'a>(&'a self, ns: &'a str, obj: &'a K) -> BoxFuture<'a, Result<K>> {
        Box::pin(ready(KindStore::replace(self, ns, obj)))
    }

    fn patch_metadata<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        patch: &'a MetadataPatch,
    ) -> BoxFuture<'a, Result<K>> {
        Box::pin(ready(KindStore::patch_metadata(self, ns, name, patch)))
    }

    fn patch_merge<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<K>> {
        Box::pin(ready(KindStore::patch_merge(self, ns, name, patch)))
    }

    fn delete<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        opts: &'a DeleteOptions,
    ) -> BoxFuture<'a, Result<DeleteOutcome<K>>> {
        Box::pin(ready(KindStore::delete(self, ns, name, opts)))
    }

    fn watch(
        self: Arc<Self>,
        namespace: Option<&str>,
        params: &WatchParams,
    ) -> Result<WatchStream<K>> {
        let m = Matcher::new::<K>(
            namespace,
            params.label_selector.as_deref(),
            params.field_selector.as_deref(),
        )?;
        let stream = KindStore::watch(self, m, params.resource_version.as_deref())?;
        Ok(if params.changes_only {
            // What a consumer that keeps nothing gets: empty lists.
            stream
                .map(|ev| match ev {
                    WatchEvent::Listed(_) => WatchEvent::Listed(Vec::new()),
                    ev => ev,
                })
                .boxed()
        } else {
            stream
        })
    }

    fn replace_status<'a>(&'a self, ns: &'a str, obj: &'a K) -> BoxFuture<'a, Result<K>>
    where
        K: HasStatus,
    {
        Box::pin(ready(KindStore::replace_status(self, ns, obj)))
    }

    fn patch_status_merge<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<K>>
    where
        K: HasStatus,
    {
        Box::pin(ready(KindStore::patch_status_merge(self, ns, name, patch)))
    }
}
