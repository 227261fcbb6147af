//! Recording Kubernetes Events (events.k8s.io/v1) over the seam.
//!
//! events.k8s.io/v1 is what client-go's and kube-runtime's current recorders write;
//! `kubectl describe` and `kubectl events` show it. Events are best-effort: callers should
//! log a failure and carry on, never fail a reconcile because an event was not written.
//!
//! On a real API server this is kube-runtime's recorder: a repeat of the same event about
//! the same object within its cache window becomes one Event with a growing `series`
//! (a merge patch), not a new object each time. The embedded cluster creates one Event
//! per call, which is what its tests count.

use std::sync::atomic::{AtomicU64, Ordering};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;

use crate::error::Result;
use crate::object::Object;
use crate::Cluster;

/// Event type: `Normal` for expected progress, `Warning` for something an operator
/// should look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// A reference to `obj` for an event's `regarding` field.
pub fn object_ref<K: Object>(obj: &K) -> ObjectReference {
    let m = obj.metadata();
    ObjectReference {
        api_version: Some(K::API_VERSION.to_string()),
        kind: Some(K::KIND.to_string()),
        name: m.name.clone(),
        namespace: m.namespace.clone(),
        uid: m.uid.clone(),
        resource_version: m.resource_version.clone(),
        field_path: None,
    }
}

/// Writes events on behalf of one controller instance.
pub struct EventRecorder {
    cluster: Cluster,
    controller: String,
    instance: String,
    seq: AtomicU64,
    /// Set on a real cluster.
    kube: Option<kube::runtime::events::Recorder>,
}

impl std::fmt::Debug for EventRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventRecorder")
            .field("cluster", &self.cluster)
            .field("controller", &self.controller)
            .field("instance", &self.instance)
            .finish()
    }
}

/// API server limits on events.k8s.io/v1 fields.
const NOTE_MAX: usize = 1024;
const REASON_MAX: usize = 128;

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl EventRecorder {
    /// `reporting_controller` must be a qualified name such as `fencecsi.io/podgc`;
    /// `reporting_instance` identifies the process (e.g. pod name).
    pub fn new(cluster: &Cluster, reporting_controller: &str, reporting_instance: &str) -> Self {
        let instance = truncate(reporting_instance, 128);
        let kube = cluster.kube_client().map(|client| {
            kube::runtime::events::Recorder::new(
                client,
                kube::runtime::events::Reporter {
                    controller: reporting_controller.to_string(),
                    instance: Some(instance.clone()),
                },
            )
        });
        EventRecorder {
            cluster: cluster.clone(),
            controller: reporting_controller.to_string(),
            instance,
            seq: AtomicU64::new(0),
            kube,
        }
    }

    /// Records one event about `regarding`. It goes into the object's namespace, or
    /// `default` for cluster-scoped objects (as kubectl expects for Node events).
    pub async fn record(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        message: &str,
    ) -> Result<()> {
        let reason = truncate(reason, REASON_MAX);
        if let Some(rec) = &self.kube {
            use kube::runtime::events as rt;
            let ev = rt::Event {
                type_: match type_ {
                    EventType::Normal => rt::EventType::Normal,
                    EventType::Warning => rt::EventType::Warning,
                },
                action: reason.clone(),
                reason,
                note: Some(truncate(message, NOTE_MAX)),
                secondary: None,
            };
            // kube-runtime files an Event about a cluster-scoped object (no
            // namespace) in "default", where kubectl looks, and keeps the
            // reference's empty namespace, which `kubectl describe` matches.
            // Its series key compares whole references: without the
            // resourceVersion, a repeat after a status write still joins the
            // series. As in client-go, the note is not part of the key: a
            // series shows the first message and a count.
            let mut regarding = regarding.clone();
            regarding.resource_version = None;
            return Ok(rec.publish(&ev, &regarding).await?);
        }
        let namespace = regarding
            .namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "default".into());
        let now = Timestamp::now();
        // client-go names events `<object>.<unix nanos in hex>`; a sequence number keeps two
        // events in the same nanosecond apart.
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let suffix = format!(".{:x}{:x}", now.as_nanosecond(), seq);
        let base = regarding.name.clone().unwrap_or_else(|| "event".into());
        let base = truncate(&base, 253 - suffix.len());
        let event = Event {
            metadata: ObjectMeta {
                name: Some(format!("{}{suffix}", base.trim_end_matches(['.', '-']))),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
            event_time: Some(MicroTime(
                Timestamp::from_microsecond(now.as_microsecond()).unwrap_or(now),
            )),
            action: Some(reason.clone()),
            reason: Some(reason),
            note: Some(truncate(message, NOTE_MAX)),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(type_.as_str().to_string()),
            ..Default::default()
        };
        self.cluster
            .api::<Event>(Some(&namespace))
            .create(&event)
            .await
            .map(drop)
    }
}
