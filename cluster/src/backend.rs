//! What a backend of the seam serves.
//!
//! - [`KindBackend`]: the calls [`crate::Api`] makes for one kind, with the namespace
//!   already resolved ("" for a cluster-scoped kind). The real API server
//!   (`kube_backend::KubeKind`) implements it, and so does any other backend, such as the
//!   embedded cluster. An `Api` holds one as a trait object, so no call of the seam knows
//!   which backend answers it.
//! - [`ClusterBackend`]: a whole cluster that is not a kube client, handing out its
//!   `KindBackend`s. [`crate::Cluster::from_backend`] wraps one.

use std::any::{Any, TypeId};
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::BoxStream;

use crate::error::Result;
use crate::object::{HasStatus, Object};
use crate::params::{
    DeleteOptions, DeleteOutcome, ListParams, MetadataPatch, ObjectList, WatchEvent, WatchParams,
};

/// A stream of watch events. It never ends by itself and never yields errors: every
/// backend reconnects or re-lists internally (logging through `tracing`) and reports a
/// re-list as [`WatchEvent::Listed`].
pub type WatchStream<K> = BoxStream<'static, WatchEvent<K>>;

/// A predicate a list applies to each object (see [`crate::Api::list_filtered`]).
pub type Filter<'a, K> = &'a (dyn Fn(&K) -> bool + Send + Sync);

/// A cluster served by something other than a kube client (the embedded cluster of
/// tests, benchmarks and the drill).
///
/// Kinds are asked for by type, because `Cluster::api` is generic and a trait object
/// cannot be: the backend answers with the kind's [`KindBackend`] wrapped in a
/// [`ServedKind`], or `None` for a kind it does not serve.
pub trait ClusterBackend: Send + Sync {
    /// For `Debug` and messages, e.g. "embedded".
    fn name(&self) -> &'static str;

    /// The backend of the kind whose `TypeId` is `kind`.
    fn kind(&self, kind: TypeId) -> Option<ServedKind>;
}

/// One kind's [`KindBackend`] with its type erased, so a [`ClusterBackend`] can hand it
/// out; only [`ServedKind::new`] makes one, so the type inside is always the one
/// `Cluster::api` expects.
pub struct ServedKind(Box<dyn Any + Send>);

impl ServedKind {
    pub fn new<K: Object>(backend: Arc<dyn KindBackend<K>>) -> Self {
        ServedKind(Box::new(backend))
    }

    /// The backend inside, if it serves `K`.
    pub(crate) fn of<K: Object>(self) -> Option<Arc<dyn KindBackend<K>>> {
        self.0
            .downcast::<Arc<dyn KindBackend<K>>>()
            .ok()
            .map(|b| *b)
    }
}

/// The calls of one kind. See the module's comment.
pub trait KindBackend<K: Object>: Send + Sync {
    /// For `Debug`, e.g. "kube" or "embedded".
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
