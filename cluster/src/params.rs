//! Request parameters and results, backend-neutral.

use std::collections::BTreeMap;

/// Selectors for list and watch. Field selectors accept only the labels the API server
/// supports for the kind (see [`crate::Object::FIELDS`]); filter anything else with
/// [`crate::Api::list_filtered`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListParams {
    pub label_selector: Option<String>,
    pub field_selector: Option<String>,
}

impl ListParams {
    pub fn labels(mut self, selector: &str) -> Self {
        self.label_selector = Some(selector.to_string());
        self
    }
    pub fn fields(mut self, selector: &str) -> Self {
        self.field_selector = Some(selector.to_string());
        self
    }
}

/// A list result: the items and the resourceVersion to start a watch from.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectList<K> {
    pub items: Vec<K>,
    pub resource_version: String,
}

/// Parameters of a watch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchParams {
    pub label_selector: Option<String>,
    pub field_selector: Option<String>,
    /// `None`: the stream starts with a [`WatchEvent::Listed`] of the current state, then
    /// changes. `Some(rv)`: it starts with the changes after `rv` (from a list or an
    /// earlier event); if that point is too old to replay, it re-lists instead. The
    /// real-cluster backend always re-lists (kube-runtime's watcher starts with a list).
    pub resource_version: Option<String>,
    /// The `Listed` events carry no objects, only the point the changes start from: for a
    /// consumer that keeps nothing of the kind and reacts to changes (a full list of every
    /// pod in a large cluster is gigabytes).
    pub changes_only: bool,
    /// Bound of each watch call, in seconds (the API server's `timeoutSeconds`): the
    /// server ends the call after it and the stream goes on with a new one, resuming where
    /// it was. kube-runtime's watcher also takes it as its bound on a silent connection: a
    /// call that has delivered nothing for this long plus 5 s is taken for dead and
    /// reopened, so a connection lost without a close (a network cut, no TCP keepalive) is
    /// noticed within that time. `None`: 290 s. The embedded cluster has no connection to
    /// lose and ignores it.
    pub timeout_secs: Option<u32>,
}

impl WatchParams {
    /// Bounds each watch call to `secs` seconds (at least 1); see [`Self::timeout_secs`].
    pub fn timeout(mut self, secs: u32) -> Self {
        self.timeout_secs = Some(secs.max(1));
        self
    }
    pub fn changes_only(mut self) -> Self {
        self.changes_only = true;
        self
    }
    pub fn labels(mut self, selector: &str) -> Self {
        self.label_selector = Some(selector.to_string());
        self
    }
    pub fn fields(mut self, selector: &str) -> Self {
        self.field_selector = Some(selector.to_string());
        self
    }
    pub fn after(mut self, resource_version: &str) -> Self {
        self.resource_version = Some(resource_version.to_string());
        self
    }
}

/// One item of a watch stream.
///
/// `Listed` carries the complete current set of matching objects: at the start (unless a
/// resourceVersion was given) and again whenever the stream had to re-list because it fell
/// behind (embedded: the watcher lagged the bounded channel; kube: 410 Gone or a
/// reconnect that could not resume). A consumer replaces its cache with it; objects absent
/// from it were deleted while the stream was not looking.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchEvent<K> {
    Listed(Vec<K>),
    /// The object appeared (embedded cluster only; see `Modified`).
    Added(K),
    /// The object's new state. On a real cluster also an object that appeared:
    /// kube-runtime's watcher reports both alike, so consumers treat the two the same.
    Modified(K),
    Deleted(K),
}

/// Preconditions of a delete: both checked against the stored object, a mismatch is a
/// `Conflict` and nothing is deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Preconditions {
    pub uid: Option<String>,
    pub resource_version: Option<String>,
}

/// Options of a delete.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeleteOptions {
    /// Pods only: `Some(0)` is a force delete; `None` uses the pod's
    /// terminationGracePeriodSeconds. Other kinds are deleted without grace.
    pub grace_period_seconds: Option<i64>,
    pub preconditions: Option<Preconditions>,
}

impl DeleteOptions {
    /// A delete with grace period 0: the pod goes without waiting for a kubelet.
    pub fn force() -> Self {
        DeleteOptions {
            grace_period_seconds: Some(0),
            preconditions: None,
        }
    }
    pub fn grace_period(secs: i64) -> Self {
        DeleteOptions {
            grace_period_seconds: Some(secs),
            preconditions: None,
        }
    }
    /// Delete only the object with this uid (not a re-created one with the same name).
    pub fn with_uid(mut self, uid: &str) -> Self {
        self.preconditions.get_or_insert_with(Default::default).uid = Some(uid.to_string());
        self
    }
    pub fn with_resource_version(mut self, rv: &str) -> Self {
        self.preconditions
            .get_or_insert_with(Default::default)
            .resource_version = Some(rv.to_string());
        self
    }
}

/// What a delete did.
#[derive(Debug, Clone, PartialEq)]
pub enum DeleteOutcome<K> {
    /// The object is gone.
    Deleted,
    /// The object still exists with a deletionTimestamp: it has finalizers, or it is a pod
    /// in its grace period (waiting for a kubelet, or a force delete).
    Terminating(K),
}

impl<K> DeleteOutcome<K> {
    pub fn is_deleted(&self) -> bool {
        matches!(self, DeleteOutcome::Deleted)
    }
}

/// A change to metadata only: finalizers, labels, annotations.
///
/// Finalizer edits are set operations (add if absent, remove if present), applied
/// atomically against the latest object: the embedded backend under its lock, the kube
/// backend as a merge patch carrying the resourceVersion it read, retried on conflict.
/// With `resource_version` set, the patch applies only to that version (Conflict otherwise,
/// never retried).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetadataPatch {
    pub add_finalizers: Vec<String>,
    pub remove_finalizers: Vec<String>,
    /// `Some(v)` sets, `None` removes.
    pub labels: BTreeMap<String, Option<String>>,
    /// `Some(v)` sets, `None` removes.
    pub annotations: BTreeMap<String, Option<String>>,
    pub resource_version: Option<String>,
}

impl MetadataPatch {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn add_finalizer(mut self, f: &str) -> Self {
        self.add_finalizers.push(f.to_string());
        self
    }
    pub fn remove_finalizer(mut self, f: &str) -> Self {
        self.remove_finalizers.push(f.to_string());
        self
    }
    pub fn set_label(mut self, k: &str, v: &str) -> Self {
        self.labels.insert(k.to_string(), Some(v.to_string()));
        self
    }
    pub fn remove_label(mut self, k: &str) -> Self {
        self.labels.insert(k.to_string(), None);
        self
    }
    pub fn set_annotation(mut self, k: &str, v: &str) -> Self {
        self.annotations.insert(k.to_string(), Some(v.to_string()));
        self
    }
    pub fn remove_annotation(mut self, k: &str) -> Self {
        self.annotations.insert(k.to_string(), None);
        self
    }
    pub fn if_resource_version(mut self, rv: &str) -> Self {
        self.resource_version = Some(rv.to_string());
        self
    }

    /// Applies the patch to `meta`; returns whether anything changed. Backends that store
    /// objects themselves (the embedded cluster) patch with this.
    pub fn apply_to(
        &self,
        meta: &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    ) -> bool {
        let before = (
            meta.finalizers.clone(),
            meta.labels.clone(),
            meta.annotations.clone(),
        );
        if !self.add_finalizers.is_empty() || !self.remove_finalizers.is_empty() {
            let fins = meta.finalizers.get_or_insert_with(Vec::new);
            fins.retain(|f| !self.remove_finalizers.contains(f));
            for f in &self.add_finalizers {
                if !fins.contains(f) && !self.remove_finalizers.contains(f) {
                    fins.push(f.clone());
                }
            }
            if fins.is_empty() {
                meta.finalizers = None;
            }
        }
        apply_map(&mut meta.labels, &self.labels);
        apply_map(&mut meta.annotations, &self.annotations);
        let norm = |v: &Option<Vec<String>>| v.clone().filter(|v| !v.is_empty());
        let normm = |v: &Option<BTreeMap<String, String>>| v.clone().filter(|v| !v.is_empty());
        norm(&before.0) != norm(&meta.finalizers)
            || normm(&before.1) != normm(&meta.labels)
            || normm(&before.2) != normm(&meta.annotations)
    }
}

fn apply_map(
    target: &mut Option<BTreeMap<String, String>>,
    changes: &BTreeMap<String, Option<String>>,
) {
    if changes.is_empty() {
        return;
    }
    let map = target.get_or_insert_with(BTreeMap::new);
    for (k, v) in changes {
        match v {
            Some(v) => {
                map.insert(k.clone(), v.clone());
            }
            None => {
                map.remove(k);
            }
        }
    }
    if map.is_empty() {
        *target = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    #[test]
    fn metadata_patch_is_a_set_operation() {
        let mut m = ObjectMeta {
            finalizers: Some(vec!["a".into()]),
            ..Default::default()
        };
        assert!(!MetadataPatch::new().add_finalizer("a").apply_to(&mut m));
        assert!(MetadataPatch::new()
            .add_finalizer("b")
            .set_label("x", "1")
            .apply_to(&mut m));
        assert_eq!(
            m.finalizers.as_deref(),
            Some(&["a".to_string(), "b".to_string()][..])
        );
        assert!(MetadataPatch::new()
            .remove_finalizer("a")
            .remove_finalizer("b")
            .remove_label("x")
            .apply_to(&mut m));
        assert_eq!(m.finalizers, None);
        assert_eq!(m.labels, None);
        assert!(!MetadataPatch::new()
            .remove_finalizer("zzz")
            .apply_to(&mut m));
    }
}
