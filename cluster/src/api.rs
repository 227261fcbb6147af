//! Typed per-kind access: the namespace rules here, the calls by the backend behind it.

use std::sync::Arc;

use crate::backend::{KindBackend, WatchStream};
use crate::error::{Error, Result};
use crate::object::{HasStatus, Object};
use crate::params::{
    DeleteOptions, DeleteOutcome, ListParams, MetadataPatch, ObjectList, WatchParams,
};

/// Access to one kind, in one namespace or across all of them (cluster-scoped kinds
/// ignore the namespace). Cheap to clone.
///
/// Single-object calls on a namespaced kind need a namespace: the `Api`'s, or else the
/// object's own `metadata.namespace` (create/replace). Lists and watches without one span
/// all namespaces.
pub struct Api<K: Object> {
    pub(crate) backend: Arc<dyn KindBackend<K>>,
    pub(crate) namespace: Option<String>,
}

impl<K: Object> Clone for Api<K> {
    fn clone(&self) -> Self {
        Api {
            backend: self.backend.clone(),
            namespace: self.namespace.clone(),
        }
    }
}

impl<K: Object> std::fmt::Debug for Api<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Api<{}>({}, namespace {:?})",
            K::KIND,
            self.backend.name(),
            self.namespace
        )
    }
}

impl<K: Object> Api<K> {
    /// The namespace this `Api` is bound to (always `None` for cluster-scoped kinds).
    pub fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref()
    }

    /// Namespace for a single-object call ("" for cluster-scoped kinds).
    fn target_ns(&self, obj_ns: Option<&str>) -> Result<String> {
        if !K::NAMESPACED {
            return Ok(String::new());
        }
        match (self.namespace.as_deref(), obj_ns.filter(|n| !n.is_empty())) {
            (Some(a), Some(b)) if a != b => Err(Error::Invalid(format!(
                "the namespace of the object ({b}) does not match the namespace of the request ({a})"
            ))),
            (Some(a), _) => Ok(a.to_string()),
            (None, Some(b)) => Ok(b.to_string()),
            (None, None) => Err(Error::Invalid(format!("{} is namespaced: a namespace is required", K::KIND))),
        }
    }

    pub async fn get(&self, name: &str) -> Result<K> {
        let ns = self.target_ns(None)?;
        self.backend.get(&ns, name).await
    }

    /// `get`, with NotFound as `None`.
    pub async fn get_opt(&self, name: &str) -> Result<Option<K>> {
        match self.get(name).await {
            Ok(o) => Ok(Some(o)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub async fn list(&self, params: &ListParams) -> Result<ObjectList<K>> {
        self.list_inner(params, &|_| true).await
    }

    /// List with an extra predicate. The embedded backend runs it on the stored objects
    /// under its read lock and clones only the matches (cheap on 150,000 pods); the kube
    /// backend applies the selectors on the server and the predicate on the client.
    pub async fn list_filtered(
        &self,
        params: &ListParams,
        filter: impl Fn(&K) -> bool + Send + Sync,
    ) -> Result<Vec<K>> {
        Ok(self.list_inner(params, &filter).await?.items)
    }

    async fn list_inner(
        &self,
        params: &ListParams,
        filter: &(dyn Fn(&K) -> bool + Send + Sync),
    ) -> Result<ObjectList<K>> {
        self.backend
            .list(self.namespace.as_deref(), params, filter)
            .await
    }

    /// Creates the object. The server fills uid, creationTimestamp, resourceVersion and
    /// generation, and may reset the status (a new Pod is `Pending` whatever was sent).
    pub async fn create(&self, obj: &K) -> Result<K> {
        let ns = self.target_ns(obj.metadata().namespace.as_deref())?;
        self.backend.create(&ns, obj).await
    }

    /// Replaces the object named by `obj.metadata.name`. A non-empty resourceVersion that is
    /// not the stored one is a `Conflict`; a uid that is not the stored one too. For kinds
    /// with a status subresource, status changes are ignored (use `replace_status`).
    pub async fn replace(&self, obj: &K) -> Result<K> {
        let ns = self.target_ns(obj.metadata().namespace.as_deref())?;
        self.backend.replace(&ns, obj).await
    }

    /// Adds/removes finalizers, sets/removes labels and annotations, atomically with
    /// respect to other writers. Adding a finalizer to an object being deleted is
    /// `Invalid`; removing the last finalizer of such an object deletes it.
    pub async fn patch_metadata(&self, name: &str, patch: &MetadataPatch) -> Result<K> {
        let ns = self.target_ns(None)?;
        self.backend.patch_metadata(&ns, name, patch).await
    }

    /// A JSON merge patch (RFC 7386) of the object's spec and metadata: only the fields it
    /// names change, so a writer never sends back fields it did not mean to touch. Lists
    /// are replaced whole; put the `resourceVersion` read into `metadata` to make the
    /// write conditional (a `Conflict` when someone wrote in between).
    pub async fn patch_merge(&self, name: &str, patch: &serde_json::Value) -> Result<K> {
        let ns = self.target_ns(None)?;
        self.backend.patch_merge(&ns, name, patch).await
    }

    pub async fn delete(&self, name: &str, opts: &DeleteOptions) -> Result<DeleteOutcome<K>> {
        let ns = self.target_ns(None)?;
        self.backend.delete(&ns, name, opts).await
    }

    /// Watches this `Api`'s namespace (or all). See [`WatchParams`] and [`crate::WatchEvent`].
    ///
    /// On a real API server the watch begins when the stream is first polled: its
    /// initial list is taken then, and only later writes follow it. A caller that must see
    /// every write from some point on polls until the first [`crate::WatchEvent::Listed`]
    /// before that point. (The embedded cluster subscribes at once; do not rely on it.)
    pub fn watch(&self, params: &WatchParams) -> Result<WatchStream<K>> {
        self.backend
            .clone()
            .watch(self.namespace.as_deref(), params)
    }
}

impl<K: HasStatus> Api<K> {
    /// Writes only the status (status subresource): spec and metadata changes in `obj` are
    /// ignored. Stale resourceVersion is a `Conflict`.
    pub async fn replace_status(&self, obj: &K) -> Result<K> {
        let ns = self.target_ns(obj.metadata().namespace.as_deref())?;
        self.backend.replace_status(&ns, obj).await
    }

    /// A JSON merge patch of the status subresource; see [`Api::patch_merge`].
    pub async fn patch_status_merge(&self, name: &str, patch: &serde_json::Value) -> Result<K> {
        let ns = self.target_ns(None)?;
        self.backend.patch_status_merge(&ns, name, patch).await
    }
}
