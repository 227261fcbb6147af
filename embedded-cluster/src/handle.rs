//! The embedded cluster as a [`Cluster`]: how tests, benchmarks and the drill make one,
//! and the controls that break it on purpose.

use std::any::TypeId;
use std::ops::Deref;
use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode, VolumeAttachment};

use fencecsi_cluster::{Cluster, ClusterBackend, KindBackend, Object, ServedKind};

use crate::store::{Embedded, EmbeddedConfig};

impl ClusterBackend for Embedded {
    fn name(&self) -> &'static str {
        "embedded"
    }

    fn kind(&self, kind: TypeId) -> Option<ServedKind> {
        // Every kind the seam implements `Object` for.
        macro_rules! serve {
            ($($k:ty),*) => {
                $(if kind == TypeId::of::<$k>() {
                    return Some(ServedKind::new(self.store::<$k>() as Arc<dyn KindBackend<$k>>));
                })*
            };
        }
        serve!(
            Node,
            Pod,
            PersistentVolume,
            PersistentVolumeClaim,
            VolumeAttachment,
            CSINode,
            CSIDriver,
            Lease,
            Event
        );
        None
    }
}

/// A fresh in-memory cluster. It derefs to its [`Cluster`], which the components take;
/// the controls below exist only here, so nothing can call them on a real cluster.
#[derive(Clone)]
pub struct EmbeddedCluster {
    embedded: Arc<Embedded>,
    cluster: Cluster,
}

impl Default for EmbeddedCluster {
    fn default() -> Self {
        Self::with_config(EmbeddedConfig::default())
    }
}

impl Deref for EmbeddedCluster {
    type Target = Cluster;

    fn deref(&self) -> &Cluster {
        &self.cluster
    }
}

impl EmbeddedCluster {
    /// A fresh, empty in-memory cluster.
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_config(config: EmbeddedConfig) -> Self {
        let embedded = Arc::new(Embedded::new(config));
        let cluster = Cluster::from_backend(embedded.clone());
        EmbeddedCluster { embedded, cluster }
    }

    /// The cluster, for the components (a clone shares the store).
    pub fn cluster(&self) -> Cluster {
        self.cluster.clone()
    }

    /// From now on, get, create, replace and the patches of kind `K` in `namespace`
    /// answer Forbidden, as a real API server does for a missing RBAC grant (deletes,
    /// status writes, lists and watches still answer). For tests of what a process does
    /// when it may not touch what it needs.
    pub fn deny<K: Object>(&self, namespace: &str) {
        self.embedded.store::<K>().deny(namespace);
    }

    /// Undoes [`EmbeddedCluster::deny`] (the callers can reach it again).
    pub fn allow<K: Object>(&self, namespace: &str) {
        self.embedded.store::<K>().allow(namespace);
    }

    /// Every watch of kind `K` open now goes silent. It delivers nothing more and never
    /// ends, as a watch does whose connection was lost without the client noticing (a
    /// network cut with no TCP keepalive, a server or proxy that dropped it). Watches
    /// started later work. For tests of what a process does when its watch dies without
    /// a sign.
    pub fn cut_watches<K: Object>(&self) {
        self.embedded.store::<K>().cut_watches();
    }

    /// How many objects of kind `K` are stored (all namespaces). For tests and
    /// benchmarks.
    pub fn count<K: Object>(&self) -> usize {
        self.embedded.store::<K>().len()
    }
}

#[cfg(test)]
mod tests {
    use fencecsi_cluster::ListParams;

    use super::*;

    async fn served<K: Object>(c: &Cluster) {
        let listed = c.api::<K>(None).list(&ListParams::default()).await;
        assert!(listed.unwrap().items.is_empty(), "{}", K::KIND);
    }

    /// Each kind the seam implements `Object` for is served (another would panic).
    #[tokio::test]
    async fn serves_every_kind_of_the_seam() {
        let c = EmbeddedCluster::new().cluster();
        served::<Node>(&c).await;
        served::<Pod>(&c).await;
        served::<PersistentVolume>(&c).await;
        served::<PersistentVolumeClaim>(&c).await;
        served::<VolumeAttachment>(&c).await;
        served::<CSINode>(&c).await;
        served::<CSIDriver>(&c).await;
        served::<Lease>(&c).await;
        served::<Event>(&c).await;
    }
}
