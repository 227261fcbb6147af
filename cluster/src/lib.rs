//! fencecsi's cluster seam: the one API the attacher and pod GC controllers use, with two
//! backends.
//!
//! - [`Cluster::kube`]: a real API server through kube-rs (production).
//! - [`Cluster::from_backend`]: any other [`ClusterBackend`]. The one in this workspace
//!   is the embedded in-memory cluster of crate `fencecsi-embedded-cluster`, with the Kubernetes
//!   semantics the controllers rely on: tests, benchmarks and the local drill run the
//!   unchanged controllers on it. The production binaries do not link it.
//!
//! Objects are k8s-openapi types (Kubernetes 1.37 API): Node, Pod, PersistentVolume,
//! PersistentVolumeClaim, VolumeAttachment, CSINode, CSIDriver, Lease
//! (coordination.k8s.io/v1) and Event (events.k8s.io/v1, the API kube-runtime's and
//! client-go's current recorders write).
//!
//! A controller is written once against [`Cluster`] and [`Api`]:
//!
//! ```no_run
//! use fencecsi_cluster::k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeAttachmentStatus};
//! use fencecsi_cluster::{Cluster, MetadataPatch, WatchEvent, WatchParams};
//! use futures::StreamExt;
//! const FIN: &str = "external-attacher/fencecsi.example.com";
//!
//! // Production: `Cluster::connect(None).await?` (kube's usual configuration, watches
//! // paced); tests, benchmarks and the drill: `EmbeddedCluster::new().cluster()`.
//! async fn attach_loop(cluster: &Cluster) -> fencecsi_cluster::Result<()> {
//!     let vas = cluster.api::<VolumeAttachment>(None);
//!     let mut events = vas.watch(&WatchParams::default())?; // Listed(all), then changes
//!     while let Some(ev) = events.next().await {
//!         let (WatchEvent::Added(va) | WatchEvent::Modified(va)) = ev else { continue };
//!         let name = va.metadata.name.clone().unwrap_or_default();
//!         if va.metadata.deletion_timestamp.is_some() {
//!             // ... ControllerUnpublishVolume(fence = true) ..., then let the object go:
//!             vas.patch_metadata(&name, &MetadataPatch::new().remove_finalizer(FIN)).await?;
//!         } else if !va.status.as_ref().is_some_and(|s| s.attached) {
//!             vas.patch_metadata(&name, &MetadataPatch::new().add_finalizer(FIN)).await?;
//!             // ... ControllerPublishVolume ...
//!             let mut done = vas.get(&name).await?;
//!             done.status = Some(VolumeAttachmentStatus { attached: true, ..Default::default() });
//!             match vas.replace_status(&done).await {
//!                 Err(e) if e.is_conflict() => continue, // changed meanwhile: the next event retries
//!                 other => { other?; }
//!             }
//!         }
//!     }
//!     Ok(())
//! }
//! ```
//!
//! The seam's contract is tested on both backends in `fencecsi-embedded-cluster`'s
//! `tests/contract.rs` (the real one only when `FENCECSI_TEST_KUBECONFIG` names a
//! kubeconfig); this crate's `tests/kube_mock.rs` drives the kube backend against a
//! scripted API server.

mod api;
mod backend;
pub mod cli;
mod error;
mod events;
pub mod http;
mod kube_backend;
mod leader;
mod object;
mod params;
mod selector;
pub mod watch_pacing;
pub mod well_known;

use std::any::TypeId;
use std::path::Path;
use std::sync::Arc;

pub use api::Api;
pub use backend::{ClusterBackend, Filter, KindBackend, ServedKind, WatchStream};
pub use error::{Error, Result};
pub use events::{object_ref, EventRecorder, EventType};
pub use leader::{LeaderElectionConfig, LeaderElector, LeaderHandle, VacancyProof};
pub use object::{HasStatus, Object};
pub use params::{
    DeleteOptions, DeleteOutcome, ListParams, MetadataPatch, ObjectList, Preconditions, WatchEvent,
    WatchParams,
};
pub use selector::{FieldSelector, LabelSelector};

/// Re-exported so controllers use exactly the versions this crate was built with.
pub use k8s_openapi;
pub use kube;

#[derive(Clone)]
enum Inner {
    Kube(kube::Client),
    /// Another backend: the embedded cluster of tests, benchmarks and the drill.
    Other(Arc<dyn ClusterBackend>),
}

/// A handle on a cluster, real or embedded. Cheap to clone; clones share the cluster.
#[derive(Clone)]
pub struct Cluster {
    inner: Inner,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Kube(_) => f.write_str("Cluster(kube)"),
            Inner::Other(b) => write!(f, "Cluster({})", b.name()),
        }
    }
}

impl Cluster {
    /// A real API server through kube-rs.
    pub fn kube(client: kube::Client) -> Self {
        Cluster {
            inner: Inner::Kube(client),
        }
    }

    /// A cluster served by `backend` (the embedded cluster's constructor uses this).
    pub fn from_backend(backend: Arc<dyn ClusterBackend>) -> Self {
        Cluster {
            inner: Inner::Other(backend),
        }
    }

    /// A real API server from a kubeconfig file (its current context).
    pub async fn from_kubeconfig(path: impl AsRef<Path>) -> Result<Self> {
        Self::connect(Some(path.as_ref())).await
    }

    /// A real API server: the kubeconfig file given, else kube's usual
    /// search ($KUBECONFIG, ~/.kube/config, then the in-cluster
    /// configuration). The client paces its watches (see `watch_pacing`).
    pub async fn connect(kubeconfig: Option<&Path>) -> Result<Self> {
        let config = match kubeconfig {
            Some(path) => {
                let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| {
                    Error::Other(format!("reading kubeconfig {}: {e}", path.display()))
                })?;
                kube::Config::from_custom_kubeconfig(
                    kc,
                    &kube::config::KubeConfigOptions::default(),
                )
                .await
                .map_err(|e| Error::Other(format!("loading kubeconfig {}: {e}", path.display())))?
            }
            None => kube::Config::infer()
                .await
                .map_err(|e| Error::Other(format!("no cluster configuration: {e}")))?,
        };
        let client = kube::client::ClientBuilder::try_from(config)
            .map_err(Error::from)?
            .with_layer(&watch_pacing::PaceWatches::default())
            .build();
        Ok(Self::kube(client))
    }

    /// Whether this is a real API server (not the embedded cluster).
    pub fn is_kube(&self) -> bool {
        matches!(self.inner, Inner::Kube(_))
    }

    /// Typed access to kind `K`, bound to `namespace` (ignored for cluster-scoped kinds;
    /// `None` on a namespaced kind means all namespaces for list/watch).
    pub fn api<K: Object>(&self, namespace: Option<&str>) -> Api<K> {
        let backend: Arc<dyn KindBackend<K>> = match &self.inner {
            Inner::Kube(c) => Arc::new(kube_backend::KubeKind::new(c.clone())),
            Inner::Other(b) => b
                .kind(TypeId::of::<K>())
                .and_then(ServedKind::of::<K>)
                // A programming error of the backend, found by the first test that asks.
                .unwrap_or_else(|| panic!("the {} cluster does not serve {}", b.name(), K::KIND)),
        };
        let namespace = if K::NAMESPACED {
            namespace.map(str::to_string)
        } else {
            None
        };
        Api { backend, namespace }
    }

    /// The kube-rs client behind a real cluster (`None` for the embedded one).
    pub(crate) fn kube_client(&self) -> Option<kube::Client> {
        match &self.inner {
            Inner::Kube(c) => Some(c.clone()),
            Inner::Other(_) => None,
        }
    }
}
