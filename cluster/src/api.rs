//! Typed per-kind access, dispatching to the embedded or the kube backend.

use std::marker::PhantomData;
#[cfg(feature = "embedded")]
use std::sync::Arc;

use futures::stream::BoxStream;

#[cfg(feature = "embedded")]
use crate::embedded::{KindStore, Matcher};
use crate::error::{Error, Result};
use crate::kube_backend;
use crate::object::{HasStatus, Object};
use crate::params::{
    DeleteOptions, DeleteOutcome, ListParams, MetadataPatch, ObjectList, WatchEvent, WatchParams,
};

/// A stream of watch events. It never ends by itself and never yields errors: both
/// backends reconnect or re-list internally (logging through `tracing`) and report a
/// re-list as [`WatchEvent::Listed`].
pub type WatchStream<K> = BoxStream<'static, WatchEvent<K>>;

pub(crate) enum Backend<K: Object> {
    #[cfg(feature = "embedded")]
    Embedded(Arc<KindStore<K>>),
    /// The `PhantomData` keeps `K` used when the embedded backend is compiled out.
    Kube(kube::Client, PhantomData<fn() -> K>),
}

impl<K: Object> Clone for Backend<K> {
    fn clone(&self) -> Self {
        match self {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => Backend::Embedded(s.clone()),
            Backend::Kube(c, _) => Backend::Kube(c.clone(), PhantomData),
        }
    }
}

/// Access to one kind, in one namespace or across all of them (cluster-scoped kinds
/// ignore the namespace). Cheap to clone.
///
/// Single-object calls on a namespaced kind need a namespace: the `Api`'s, or else the
/// object's own `metadata.namespace` (create/replace). Lists and watches without one span
/// all namespaces.
pub struct Api<K: Object> {
    pub(crate) backend: Backend<K>,
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
        let backend = match self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(_) => "embedded",
            Backend::Kube(..) => "kube",
        };
        write!(
            f,
            "Api<{}>({backend}, namespace {:?})",
            K::KIND,
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

    fn kube_api(client: &kube::Client, ns: &str) -> kube::Api<K> {
        K::kube_api(client.clone(), Some(ns).filter(|n| !n.is_empty()))
    }

    pub async fn get(&self, name: &str) -> Result<K> {
        let ns = self.target_ns(None)?;
        match &self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => s.get(&ns, name),
            Backend::Kube(c, _) => Ok(Self::kube_api(c, &ns).get(name).await?),
        }
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
        match &self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => {
                let m = Matcher::new::<K>(
                    self.namespace.as_deref(),
                    params.label_selector.as_deref(),
                    params.field_selector.as_deref(),
                )?;
                let (items, resource_version) = s.list(&m, filter);
                Ok(ObjectList {
                    items,
                    resource_version,
                })
            }
            Backend::Kube(c, _) => {
                let api = K::kube_api(c.clone(), self.namespace.as_deref());
                let (items, resource_version) = kube_backend::list(&api, params, filter).await?;
                Ok(ObjectList {
                    items,
                    resource_version,
                })
            }
        }
    }

    /// Creates the object. The server fills uid, creationTimestamp, resourceVersion and
    /// generation, and may reset the status (a new Pod is `Pending` whatever was sent).
    pub async fn create(&self, obj: &K) -> Result<K> {
        let ns = self.target_ns(obj.metadata().namespace.as_deref())?;
        match &self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => s.create(&ns, obj),
            Backend::Kube(c, _) => kube_backend::create(&Self::kube_api(c, &ns), obj).await,
        }
    }

    /// Replaces the object named by `obj.metadata.name`. A non-empty resourceVersion that is
    /// not the stored one is a `Conflict`; a uid that is not the stored one too. For kinds
    /// with a status subresource, status changes are ignored (use `replace_status`).
    pub async fn replace(&self, obj: &K) -> Result<K> {
        let ns = self.target_ns(obj.metadata().namespace.as_deref())?;
        match &self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => s.replace(&ns, obj),
            Backend::Kube(c, _) => kube_backend::replace(&Self::kube_api(c, &ns), obj).await,
        }
    }

    /// Adds/removes finalizers, sets/removes labels and annotations, atomically with
    /// respect to other writers. Adding a finalizer to an object being deleted is
    /// `Invalid`; removing the last finalizer of such an object deletes it.
    pub async fn patch_metadata(&self, name: &str, patch: &MetadataPatch) -> Result<K> {
        let ns = self.target_ns(None)?;
        match &self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => s.patch_metadata(&ns, name, patch),
            Backend::Kube(c, _) => {
                kube_backend::patch_metadata(&Self::kube_api(c, &ns), name, patch).await
            }
        }
    }

    /// A JSON merge patch (RFC 7386) of the object's spec and metadata: only the fields it
    /// names change, so a writer never sends back fields it did not mean to touch. Lists
    /// are replaced whole; put the `resourceVersion` read into `metadata` to make the
    /// write conditional (a `Conflict` when someone wrote in between).
    pub async fn patch_merge(&self, name: &str, patch: &serde_json::Value) -> Result<K> {
        let ns = self.target_ns(None)?;
        match &self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => s.patch_merge(&ns, name, patch),
            Backend::Kube(c, _) => {
                kube_backend::patch_merge(&Self::kube_api(c, &ns), name, patch).await
            }
        }
    }

    pub async fn delete(&self, name: &str, opts: &DeleteOptions) -> Result<DeleteOutcome<K>> {
        let ns = self.target_ns(None)?;
        match &self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => s.delete(&ns, name, opts),
            Backend::Kube(c, _) => kube_backend::delete(&Self::kube_api(c, &ns), name, opts).await,
        }
    }

    /// Watches this `Api`'s namespace (or all). See [`WatchParams`] and [`WatchEvent`].
    pub fn watch(&self, params: &WatchParams) -> Result<WatchStream<K>> {
        match &self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => {
                let m = Matcher::new::<K>(
                    self.namespace.as_deref(),
                    params.label_selector.as_deref(),
                    params.field_selector.as_deref(),
                )?;
                let stream = s.clone().watch(m, params.resource_version.as_deref())?;
                Ok(if params.changes_only {
                    use futures::StreamExt;
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
            Backend::Kube(c, _) => Ok(kube_backend::watch(
                K::kube_api(c.clone(), self.namespace.as_deref()),
                params,
            )),
        }
    }
}

impl<K: HasStatus> Api<K> {
    /// Writes only the status (status subresource): spec and metadata changes in `obj` are
    /// ignored. Stale resourceVersion is a `Conflict`.
    pub async fn replace_status(&self, obj: &K) -> Result<K> {
        let ns = self.target_ns(obj.metadata().namespace.as_deref())?;
        match &self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => s.replace_status(&ns, obj),
            Backend::Kube(c, _) => kube_backend::replace_status(&Self::kube_api(c, &ns), obj).await,
        }
    }

    /// A JSON merge patch of the status subresource; see [`Api::patch_merge`].
    pub async fn patch_status_merge(&self, name: &str, patch: &serde_json::Value) -> Result<K> {
        let ns = self.target_ns(None)?;
        match &self.backend {
            #[cfg(feature = "embedded")]
            Backend::Embedded(s) => s.patch_status_merge(&ns, name, patch),
            Backend::Kube(c, _) => {
                kube_backend::patch_status_merge(&Self::kube_api(c, &ns), name, patch).await
            }
        }
    }
}
