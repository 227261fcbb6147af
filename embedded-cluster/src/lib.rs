//! fencecsi's embedded cluster: an in-memory backend of the cluster seam
//! (`fencecsi_cluster::Cluster`), with the Kubernetes semantics the controllers rely on
//! (resourceVersion conflicts, finalizers, deletionTimestamp and pod grace periods, force
//! delete, delete preconditions, status subresource, ordered watches with bounded memory).
//! See [`store`] for the rules it follows.
//!
//! Tests, benchmarks and the local drill run the unchanged controllers on it, beside
//! [`sim`]: small simulations of what the kubelet and kube-controller-manager do. The
//! production binaries do not depend on this crate (deploy/tests/manifests.rs checks it).
//!
//! ```
//! # #[tokio::main] async fn main() {
//! use fencecsi_cluster::k8s_openapi::api::core::v1::Node;
//! use fencecsi_embedded_cluster::EmbeddedCluster;
//!
//! let embedded = EmbeddedCluster::new();
//! let cluster = embedded.cluster(); // what the components take
//! assert!(cluster.api::<Node>(None).get_opt("n1").await.unwrap().is_none());
//! embedded.cut_watches::<Node>(); // a control a real cluster does not have
//! # }
//! ```
//!
//! The seam's contract, on this backend and (when `FENCECSI_TEST_KUBECONFIG` names a
//! kubeconfig) on a real API server, is `tests/contract.rs`.

mod handle;
mod kind_backend;
pub mod sim;
pub mod store;

pub use handle::EmbeddedCluster;
pub use store::EmbeddedConfig;
