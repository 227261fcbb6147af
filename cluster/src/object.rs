//! The kinds the controllers use and the per-kind API-server behaviour the embedded backend
//! needs to imitate.
//!
//! The kube backend gets all of this from the real API server; the embedded backend gets it
//! from these trait methods. Each method mirrors one piece of a kind's registry strategy in
//! kube-apiserver (PrepareForCreate, PrepareForUpdate, CheckGracefulDelete, field labels),
//! kept to what the controllers can observe.

use std::fmt::Debug;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    Node, PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimStatus,
    PersistentVolumeStatus, Pod, PodStatus,
};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode, VolumeAttachment};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A Kubernetes object kind that can be used through the seam.
///
/// Implemented here for Node, Pod, PersistentVolume, PersistentVolumeClaim,
/// VolumeAttachment, CSINode, CSIDriver, Lease (coordination.k8s.io/v1) and Event
/// (events.k8s.io/v1). A kind added here must also be added to the kinds the embedded
/// cluster serves (`embedded-cluster/src/handle.rs`), or `Cluster::api` panics on it there.
pub trait Object:
    k8s_openapi::Resource
    + k8s_openapi::Metadata<Ty = ObjectMeta>
    + Clone
    + Debug
    + PartialEq
    + Serialize
    + DeserializeOwned
    + Send
    + Sync
    + 'static
{
    /// Namespaced (Pod, PVC, Lease, Event) or cluster-scoped (the rest).
    const NAMESPACED: bool;

    /// Field selector labels the API server supports for this kind (besides
    /// `metadata.name` and `metadata.namespace`, which every kind supports).
    const FIELDS: &'static [&'static str] = &[];

    /// A field whose equality selector the embedded backend serves from an index
    /// (Pod: `spec.nodeName`, so "pods on node X" does not scan 150,000 pods).
    const INDEXED_FIELD: Option<&'static str> = None;

    /// A `kube::Api` for this kind, namespaced when `namespace` is given.
    fn kube_api(client: kube::Client, namespace: Option<&str>) -> kube::Api<Self>;

    /// Value of a supported field label (`""` when unset, like the API server).
    fn field(&self, name: &str) -> String {
        let m = self.metadata();
        match name {
            "metadata.name" => m.name.clone().unwrap_or_default(),
            "metadata.namespace" => m.namespace.clone().unwrap_or_default(),
            _ => String::new(),
        }
    }

    /// Creation-time normalisation (PrepareForCreate + defaulting): e.g. a new Pod's status
    /// is reset to `Pending` whatever the client sent.
    fn prepare_for_create(&mut self) {}

    /// Copies the status from `other`. Kinds with a status subresource keep the stored
    /// status on a main-resource update, and take only the status on a status update.
    /// A no-op for kinds without one.
    fn copy_status_from(&mut self, _other: &Self) {}

    /// True if the parts that make `metadata.generation` move (spec-like fields) differ.
    fn spec_differs(&self, other: &Self) -> bool;

    /// Graceful deletion (only Pods have it): the grace period the API server would use for
    /// a delete with `requested` seconds, or `None` if the kind is deleted without grace.
    fn graceful_delete_period(&self, _requested: Option<i64>) -> Option<i64> {
        None
    }
}

/// Kinds with a status subresource: `replace_status` exists only for these, and their
/// main-resource updates ignore status.
pub trait HasStatus: Object {}

macro_rules! kube_api {
    (namespaced) => {
        fn kube_api(client: kube::Client, namespace: Option<&str>) -> kube::Api<Self> {
            match namespace {
                Some(ns) => kube::Api::namespaced(client, ns),
                None => kube::Api::all(client),
            }
        }
    };
    (cluster) => {
        fn kube_api(client: kube::Client, _namespace: Option<&str>) -> kube::Api<Self> {
            kube::Api::all(client)
        }
    };
}

macro_rules! status_subresource {
    ($ty:ty) => {
        impl HasStatus for $ty {}
    };
}

macro_rules! copy_status {
    () => {
        fn copy_status_from(&mut self, other: &Self) {
            self.status = other.status.clone();
        }
    };
}

impl Object for Pod {
    const NAMESPACED: bool = true;
    const FIELDS: &'static [&'static str] = &["spec.nodeName", "status.phase"];
    const INDEXED_FIELD: Option<&'static str> = Some("spec.nodeName");
    kube_api!(namespaced);
    copy_status!();

    fn field(&self, name: &str) -> String {
        match name {
            "spec.nodeName" => self
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .unwrap_or_default(),
            "status.phase" => self
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default(),
            _ => meta_field(self, name),
        }
    }

    fn prepare_for_create(&mut self) {
        // The pod strategy discards a client-supplied status; defaulting sets the grace period.
        self.status = Some(PodStatus {
            phase: Some("Pending".into()),
            ..Default::default()
        });
        if let Some(spec) = self.spec.as_mut() {
            spec.termination_grace_period_seconds.get_or_insert(30);
        }
    }

    fn spec_differs(&self, other: &Self) -> bool {
        self.spec != other.spec
    }

    fn graceful_delete_period(&self, requested: Option<i64>) -> Option<i64> {
        // Mirrors podStrategy.CheckGracefulDelete: an unscheduled or finished pod has no
        // kubelet to wait for, so it goes at once.
        let spec = self.spec.as_ref();
        let mut period = requested
            .or_else(|| spec.and_then(|s| s.termination_grace_period_seconds))
            .unwrap_or(0);
        if spec
            .and_then(|s| s.node_name.as_deref())
            .unwrap_or("")
            .is_empty()
        {
            period = 0;
        }
        let phase = self.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Failed") | Some("Succeeded")) {
            period = 0;
        }
        Some(period)
    }
}
status_subresource!(Pod);

impl Object for Node {
    const NAMESPACED: bool = false;
    const FIELDS: &'static [&'static str] = &["spec.unschedulable"];
    kube_api!(cluster);
    copy_status!();

    fn field(&self, name: &str) -> String {
        match name {
            "spec.unschedulable" => self
                .spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false)
                .to_string(),
            _ => meta_field(self, name),
        }
    }

    // A Node keeps the status it is created with: kubelet registers nodes that way.

    fn spec_differs(&self, other: &Self) -> bool {
        self.spec != other.spec
    }
}
status_subresource!(Node);

impl Object for PersistentVolume {
    const NAMESPACED: bool = false;
    const FIELDS: &'static [&'static str] = &[];
    kube_api!(cluster);
    copy_status!();

    fn prepare_for_create(&mut self) {
        self.status = Some(PersistentVolumeStatus {
            phase: Some("Pending".into()),
            ..Default::default()
        });
    }

    fn spec_differs(&self, other: &Self) -> bool {
        self.spec != other.spec
    }
}
status_subresource!(PersistentVolume);

impl Object for PersistentVolumeClaim {
    const NAMESPACED: bool = true;
    kube_api!(namespaced);
    copy_status!();

    fn prepare_for_create(&mut self) {
        self.status = Some(PersistentVolumeClaimStatus {
            phase: Some("Pending".into()),
            ..Default::default()
        });
    }

    fn spec_differs(&self, other: &Self) -> bool {
        self.spec != other.spec
    }
}
status_subresource!(PersistentVolumeClaim);

impl Object for VolumeAttachment {
    const NAMESPACED: bool = false;
    kube_api!(cluster);
    copy_status!();

    fn prepare_for_create(&mut self) {
        // storage/v1 drops a client-supplied status on create: only the attacher sets it.
        self.status = None;
    }

    fn spec_differs(&self, other: &Self) -> bool {
        self.spec != other.spec
    }
}
status_subresource!(VolumeAttachment);

impl Object for CSINode {
    const NAMESPACED: bool = false;
    kube_api!(cluster);

    // CSINode has no status subresource: its (new, optional) status is written with the
    // object like any other field.
    fn spec_differs(&self, other: &Self) -> bool {
        self.spec != other.spec || self.status != other.status
    }
}

impl Object for CSIDriver {
    const NAMESPACED: bool = false;
    kube_api!(cluster);

    fn spec_differs(&self, other: &Self) -> bool {
        self.spec != other.spec
    }
}

impl Object for Lease {
    const NAMESPACED: bool = true;
    kube_api!(namespaced);

    fn spec_differs(&self, other: &Self) -> bool {
        self.spec != other.spec
    }
}

impl Object for Event {
    const NAMESPACED: bool = true;
    kube_api!(namespaced);

    fn spec_differs(&self, other: &Self) -> bool {
        let strip = |e: &Event| Event {
            metadata: ObjectMeta::default(),
            ..e.clone()
        };
        strip(self) != strip(other)
    }
}

fn meta_field<K: k8s_openapi::Metadata<Ty = ObjectMeta>>(obj: &K, name: &str) -> String {
    let m = obj.metadata();
    match name {
        "metadata.name" => m.name.clone().unwrap_or_default(),
        "metadata.namespace" => m.namespace.clone().unwrap_or_default(),
        _ => String::new(),
    }
}
