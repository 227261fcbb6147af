//! What a backend of the seam serves for one kind: the calls [`crate::Api`] makes, with
//! the namespace already resolved ("" for a cluster-scoped kind). The real API server
//! (`kube_backend::KubeKind`) and the embedded cluster (`embedded::KindStore`) each
//! implement it, and an `Api` holds one as a trait object, so no call of the seam knows
//! which backend answers it.

use std::sync::Arc;

use futures::future::BoxFuture;

use crate::api::WatchStream;
use crate::error::Result;
use crate::object::{HasStatus, Object};
use crate::params::{
    DeleteOptions, DeleteOutcome, ListParams, MetadataPatch, ObjectList, WatchParams,
};

/// A predicate a list applies to each object (see [`crate::Api::list_filtered`]).
pub(crate) type Filter<'a, K> = &'a (dyn Fn(&K) -> bool + Send + Sync);

pub(crate) trait KindBackend<K: Object>: Send + Sync {
    /// For `Debug`: "kube" or "embedded".
    fn name(&self) -> &'static str;

    fn get<'a>(&'a self, ns: &'a str, name: &'a str) -> BoxFuture<'a, Result<K>>;

    /// Lists `namespace` (all when `None`), keeping only what `filter` accepts.
    fn list<'a>(
        &'a self,
        namespace: Option<&'a str>,
        params: &'a ListParams,
        filter: Filter<'a, K>,
    ) -> BoxFuture<'a, Result<ObjectList<K>>>;

    fn create<'a>(&'a self, ns: &'a str, obj: &'a K) -> BoxFuture<'a, Result<K>>;

    fn replace<'a>(&'a self, ns: &'a str, obj: &'a K) -> BoxFuture<'a, Result<K>>;

    fn patch_metadata<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        patch: &'a MetadataPatch,
    ) -> BoxFuture<'a, Result<K>>;

    fn patch_merge<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<K>>;

    fn delete<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        opts: &'a DeleteOptions,
    ) -> BoxFuture<'a, Result<DeleteOutcome<K>>>;

    /// Watches `namespace` (all when `None`).
    fn watch(
        self: Arc<Self>,
        namespace: Option<&str>,
        params: &WatchParams,
    ) -> Result<WatchStream<K>>;

    fn replace_status<'a>(&'a self, ns: &'a str, obj: &'a K) -> BoxFuture<'a, Result<K>>
    where
        K: HasStatus;

    fn patch_status_merge<'a>(
        &'a self,
        ns: &'a str,
        name: &'a str,
        patch: &'a serde_json::Value,
    ) -> BoxFuture<'a, Result<K>>
    where
        K: HasStatus;
}
