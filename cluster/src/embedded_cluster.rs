//! `Cluster`'s constructors and test controls for the embedded backend (feature
//! `embedded`): how tests, benchmarks and the drill make an in-memory cluster and
//! break it on purpose.

use std::sync::Arc;

use crate::embedded::{Embedded, EmbeddedConfig};
use crate::object::Object;
use crate::{Cluster, Inner};

impl Cluster {
    /// A fresh, empty in-memory cluster.
    pub fn embedded() -> Self {
        Self::embedded_with(EmbeddedConfig::default())
    }

    pub fn embedded_with(config: EmbeddedConfig) -> Self {
        Cluster {
            inner: Inner::Embedded(Arc::new(Embedded::new(config))),
        }
    }

    /// Embedded only: from now on, get, create, replace and the patches of kind `K`
    /// in `namespace` answer Forbidden, as a real API server does for a missing RBAC
    /// grant (deletes, status writes, lists and watches still answer). For tests of what a process does when
    /// it may not touch what it needs. Does nothing on a real cluster.
    pub fn deny<K: Object>(&self, namespace: &str) {
        if let Inner::Embedded(e) = &self.inner {
            e.kind::<K>().deny(namespace);
        }
    }

    /// Embedded only: undoes [`Cluster::deny`] (the callers can reach it again).
    pub fn allow<K: Object>(&self, namespace: &str) {
        if let Inner::Embedded(e) = &self.inner {
            e.kind::<K>().allow(namespace);
        }
    }

    /// Embedded only: every watch of kind `K` open now goes silent. It delivers nothing
    /// more and never ends, as a watch does whose connection was lost without the client
    /// noticing (a network cut with no TCP keepalive, a server or proxy that dropped it).
    /// Watches started later work. For tests of what a process does when its watch dies
    /// without a sign. Does nothing on a real cluster.
    pub fn cut_watches<K: Object>(&self) {
        if let Inner::Embedded(e) = &self.inner {
            e.kind::<K>().cut_watches();
        }
    }

    /// Embedded only: how many objects of kind `K` are stored (all namespaces). `None`
    /// on a real cluster. For tests and benchmarks.
    pub fn embedded_count<K: Object>(&self) -> Option<usize> {
        match &self.inner {
            Inner::Embedded(e) => Some(e.kind::<K>().len()),
            Inner::Kube(_) => None,
        }
    }
}
