//! The kube backend's own logic, checked against a scripted fake API server (a tower
//! service behind `kube::Client::new`): request shapes, delete outcome classification,
//! conflict-retrying metadata patches, paged lists, and the watch loop's re-list on
//! `410 Gone` and resume after the server closes a watch (kube-runtime's watcher, through
//! the seam's adapter).
//!
//! This does not replace the contract run against a real API server; it covers the
//! plumbing that the embedded backend cannot exercise.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencecsi_cluster::k8s_openapi::api::core::v1::Pod;
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::kube::client::Body;
use fencecsi_cluster::{
    Cluster, DeleteOptions, DeleteOutcome, ListParams, MetadataPatch, WatchEvent, WatchParams,
};
use futures::StreamExt;
use http::{Request, Response};
use http_body_util::BodyExt;
use serde_json::{json, Value};

#[derive(Debug, Clone)]
struct Seen {
    method: String,
    uri: String,
    body: String,
}

type Handler = dyn Fn(&Seen, usize) -> (u16, String) + Send + Sync;

/// A cluster whose API server answers with `handler(request, index of the request)`.
fn fake(
    handler: impl Fn(&Seen, usize) -> (u16, String) + Send + Sync + 'static,
) -> (Cluster, Arc<Mutex<Vec<Seen>>>) {
    let log = Arc::new(Mutex::new(Vec::<Seen>::new()));
    let handler: Arc<Handler> = Arc::new(handler);
    let l = log.clone();
    let svc = tower::service_fn(move |req: Request<Body>| {
        let log = l.clone();
        let handler = handler.clone();
        async move {
            let (parts, body) = req.into_parts();
            let bytes = body
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            let seen = Seen {
                method: parts.method.to_string(),
                uri: parts.uri.to_string(),
                body: String::from_utf8_lossy(&bytes).into_owned(),
            };
            let n = {
                let mut log = log.lock().unwrap();
                log.push(seen.clone());
                log.len() - 1
            };
            let (code, text) = handler(&seen, n);
            Ok::<_, Infallible>(
                Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(Body::from(text.into_bytes()))
                    .unwrap(),
            )
        }
    });
    (
        Cluster::kube(fencecsi_cluster::kube::Client::new(svc, "default")),
        log,
    )
}

fn va(name: &str, rv: &str) -> Value {
    json!({
        "apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment",
        "metadata": {"name": name, "resourceVersion": rv, "uid": format!("uid-{name}")},
        "spec": {"attacher": "d", "nodeName": "n", "source": {"persistentVolumeName": "pv"}}
    })
}

fn pod(name: &str, rv: &str, extra_meta: Value) -> Value {
    let mut meta = json!({"name": name, "namespace": "ns", "resourceVersion": rv, "uid": "u1"});
    meta.as_object_mut()
        .unwrap()
        .extend(extra_meta.as_object().unwrap().clone());
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"containers": [{"name": "c"}]}})
}

fn status(code: u16, reason: &str) -> String {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason, "message": reason})
        .to_string()
}

fn list(items: Vec<Value>, rv: &str, cont: Option<&str>) -> String {
    json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": rv, "continue": cont}, "items": items})
        .to_string()
}

fn watch_lines(events: &[(&str, Value)]) -> String {
    events
        .iter()
        .map(|(t, o)| json!({"type": t, "object": o}).to_string() + "\n")
        .collect()
}

async fn next<K: Clone + Send + 'static>(
    s: &mut fencecsi_cluster::WatchStream<K>,
) -> WatchEvent<K> {
    // A bound on liveness only: the fake server answers at once.
    tokio::time::timeout(Duration::from_secs(60), s.next())
        .await
        .expect("watch event in time")
        .expect("stream open")
}

fn names(items: &[VolumeAttachment]) -> Vec<String> {
    items
        .iter()
        .map(|v| v.metadata.name.clone().unwrap())
        .collect()
}

#[tokio::test]
async fn watch_relists_on_gone_and_resumes_after_close() {
    // A scripted sequence is clearer than a stateful server: the n-th request gets the n-th answer.
    let script: Vec<(&str, &str, u16, String)> = vec![
        (
            "GET",
            "limit=500",
            200,
            list(vec![va("a", "5")], "10", None),
        ),
        (
            "GET",
            "resourceVersion=10",
            200,
            watch_lines(&[
                ("ADDED", va("b", "11")),
                (
                    "ERROR",
                    serde_json::from_str::<Value>(&status(410, "Expired")).unwrap(),
                ),
            ]),
        ),
        (
            "GET",
            "limit=500",
            200,
            list(vec![va("a", "5"), va("b", "11")], "20", None),
        ),
        (
            "GET",
            "resourceVersion=20",
            200,
            watch_lines(&[("MODIFIED", va("b", "21"))]),
        ),
        (
            "GET",
            "resourceVersion=21",
            200,
            watch_lines(&[("DELETED", va("a", "22"))]),
        ),
    ];
    let script = Arc::new(script);
    let s2 = script.clone();
    let (cluster, log) = fake(move |req, n| {
        let (method, needle, code, body) =
            s2.get(n)
                .cloned()
                .unwrap_or(("GET", "", 200, String::new()));
        assert_eq!(req.method, method, "request {n}: {}", req.uri);
        assert!(
            req.uri.contains(needle),
            "request {n} should contain {needle:?}: {}",
            req.uri
        );
        (code, body)
    });
    let vas = cluster.api::<VolumeAttachment>(None);
    let mut w = vas.watch(&WatchParams::default().labels("app=x")).unwrap();

    let WatchEvent::Listed(items) = next(&mut w).await else {
        panic!("first is Listed")
    };
    assert_eq!(names(&items), ["a"]);
    // kube-runtime's watcher reports an add as an update (the seam allows it).
    let WatchEvent::Modified(b) = next(&mut w).await else {
        panic!("then Modified (the add)")
    };
    assert_eq!(b.metadata.name.as_deref(), Some("b"));
    let WatchEvent::Listed(items) = next(&mut w).await else {
        panic!("410 re-lists")
    };
    assert_eq!(names(&items), ["a", "b"]);
    let WatchEvent::Modified(b) = next(&mut w).await else {
        panic!("then Modified")
    };
    assert_eq!(b.metadata.resource_version.as_deref(), Some("21"));
    // The server closed the watch: it resumes from the last resourceVersion seen.
    let WatchEvent::Deleted(a) = next(&mut w).await else {
        panic!("then Deleted after resume")
    };
    assert_eq!(a.metadata.name.as_deref(), Some("a"));

    let log = log.lock().unwrap().clone();
    assert!(
        log[0].uri.contains("labelSelector=app%3Dx"),
        "selector passed: {}",
        log[0].uri
    );
    assert!(log[1].uri.contains("watch=true") && log[1].uri.contains("labelSelector=app%3Dx"));
    assert!(
        log[1]
            .uri
            .starts_with("/apis/storage.k8s.io/v1/volumeattachments?"),
        "{}",
        log[1].uri
    );
}

#[tokio::test]
async fn a_changes_only_watch_keeps_nothing_from_its_list() {
    let (cluster, _log) = fake(|req, n| match n {
        0 => {
            assert!(req.uri.contains("limit=500"), "{}", req.uri);
            (200, list(vec![va("a", "5"), va("b", "6")], "10", None))
        }
        1 => {
            assert!(req.uri.contains("resourceVersion=10"), "{}", req.uri);
            (200, watch_lines(&[("ADDED", va("c", "11"))]))
        }
        // Later resumes: an empty, open-then-closed watch.
        _ => (200, String::new()),
    });
    let vas = cluster.api::<VolumeAttachment>(None);
    let mut w = vas.watch(&WatchParams::default().changes_only()).unwrap();
    let WatchEvent::Listed(items) = next(&mut w).await else {
        panic!("first is Listed")
    };
    assert!(items.is_empty(), "nothing kept: {:?}", names(&items));
    // Control: the same stream does deliver what changes after the list.
    let WatchEvent::Modified(c) = next(&mut w).await else {
        panic!("then the change")
    };
    assert_eq!(c.metadata.name.as_deref(), Some("c"));
}

#[tokio::test]
async fn a_repeated_event_becomes_a_series() {
    // The API server echoes what it was sent, as it does for a create or a patch.
    let (cluster, log) = fake(|req, _| {
        (
            if req.method == "POST" { 201 } else { 200 },
            req.body.clone(),
        )
    });
    let rec = fencecsi_cluster::EventRecorder::new(&cluster, "fencecsi.io/test", "test-0");
    let va = VolumeAttachment {
        metadata: fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("va-1".into()),
            uid: Some("u-1".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut r = fencecsi_cluster::object_ref(&va);
    for rv in ["5", "6"] {
        // A status write between two repeats changes the object's
        // resourceVersion; the repeat still joins the series.
        r.resource_version = Some(rv.into());
        rec.record(
            &r,
            fencecsi_cluster::EventType::Warning,
            "FenceFailed",
            "no fence",
        )
        .await
        .unwrap();
    }
    // Control: another reason is another Event.
    rec.record(&r, fencecsi_cluster::EventType::Normal, "Fenced", "fenced")
        .await
        .unwrap();
    let log = log.lock().unwrap().clone();
    let calls: Vec<(&str, bool)> = log
        .iter()
        .map(|s| {
            (
                s.method.as_str(),
                s.uri
                    .starts_with("/apis/events.k8s.io/v1/namespaces/default/events"),
            )
        })
        .collect();
    assert_eq!(
        calls,
        [("POST", true), ("PATCH", true), ("POST", true)],
        "{log:#?}"
    );
    let first: Value = serde_json::from_str(&log[0].body).unwrap();
    let patch: Value = serde_json::from_str(&log[1].body).unwrap();
    assert_eq!(first["reason"], "FenceFailed");
    assert_eq!(first["reportingController"], "fencecsi.io/test");
    assert_eq!(first["regarding"]["uid"], "u-1");
    // A cluster-scoped object's reference keeps its empty namespace (what
    // `kubectl describe` matches); the Event itself lives in "default".
    assert!(first["regarding"].get("namespace").is_none(), "{first}");
    assert_eq!(patch["series"]["count"], 2, "{patch}");
    assert!(log[1]
        .uri
        .contains(first["metadata"]["name"].as_str().unwrap()));
}

/// A watch whose connection goes silent after its headers (a network cut the client does
/// not hear of: no close, no error) is taken for dead once it has delivered nothing for its
/// bound (`WatchParams::timeout`, sent as `timeoutSeconds`) plus kube-runtime's 5 s, and
/// reopened from where it was. Without a bound the watch asks for 290 s, so a dead one
/// stays unnoticed for 295 s.
#[tokio::test]
async fn a_silent_watch_is_reopened_after_its_timeout() {
    use http_body_util::{Either, Full, StreamBody};
    let log = Arc::new(Mutex::new(Vec::<(Instant, String)>::new()));
    let l = log.clone();
    let svc = tower::service_fn(move |req: Request<Body>| {
        let l = l.clone();
        async move {
            let uri = req.uri().to_string();
            let n = {
                let mut l = l.lock().unwrap();
                l.push((Instant::now(), uri));
                l.len() - 1
            };
            let bytes = |text: String| async move {
                Body::from(text.into_bytes()).collect_bytes().await.unwrap()
            };
            let body = match n {
                0 => Either::Left(Full::new(bytes(list(vec![va("a", "5")], "10", None)).await)),
                // The first watch: headers, then nothing ever again.
                1 => {
                    // (`once(..).take(0)` only names the frame type for `pending`.)
                    let some = bytes(" ".into()).await;
                    Either::Right(StreamBody::new(
                        futures::stream::once(
                            async move { Full::new(some).frame().await.unwrap() },
                        )
                        .take(0)
                        .chain(futures::stream::pending()),
                    ))
                }
                2 => Either::Left(Full::new(
                    bytes(watch_lines(&[("MODIFIED", va("a", "11"))])).await,
                )),
                _ => Either::Left(Full::new(bytes(String::new()).await)),
            };
            Ok::<_, Infallible>(
                Response::builder()
                    .status(200)
                    .header("content-type", "application/json")
                    .body(body)
                    .unwrap(),
            )
        }
    });
    let cluster = Cluster::kube(fencecsi_cluster::kube::Client::new(svc, "default"));
    // Before the client can start any timer of its own.
    let started = Instant::now();
    let mut w = cluster
        .api::<VolumeAttachment>(None)
        .watch(&WatchParams::default().timeout(1))
        .unwrap();
    let WatchEvent::Listed(items) = next(&mut w).await else {
        panic!("first is Listed")
    };
    assert_eq!(names(&items), ["a"]);
    // Far below the 295 s of an unbounded watch: a bound on liveness only.
    let ev = tokio::time::timeout(Duration::from_secs(120), w.next())
        .await
        .expect("the silent watch was reopened in time")
        .expect("stream open");
    let WatchEvent::Modified(a) = ev else {
        panic!("then the change, from the reopened watch: {ev:?}")
    };
    assert_eq!(a.metadata.resource_version.as_deref(), Some("11"));

    let log = log.lock().unwrap().clone();
    let (_, silent) = &log[1];
    let (reopened_at, reopened) = &log[2];
    assert!(
        silent.contains("watch=true") && silent.contains("timeoutSeconds=1"),
        "{silent}"
    );
    assert!(
        reopened.contains("watch=true") && reopened.contains("resourceVersion=10"),
        "resumed, not re-listed: {reopened}"
    );
    // The client sent the silent watch after `started` and could give it up no sooner
    // than its bound after that (1 s + 5 s), so the reopened one reached the server at
    // least that long after `started`: a lower bound a late test or a busy machine only
    // lengthens. (Measured from when the server saw the silent watch instead, a server
    // that saw it late would shorten it.)
    let silent_for = reopened_at.duration_since(started);
    assert!(
        silent_for >= Duration::from_secs(5),
        "reopened {silent_for:?} after the watch began: the bound is 1 s + 5 s"
    );
    assert!(
        silent_for < Duration::from_secs(120),
        "reopened only after {silent_for:?}: the bound is 1 s + 5 s, not 295 s"
    );

    // Control: without a bound the watch asks for kube-runtime's longest.
    let (cluster, log) = fake(|_, n| match n {
        0 => (200, list(vec![], "10", None)),
        _ => (200, String::new()),
    });
    let mut w = cluster
        .api::<VolumeAttachment>(None)
        .watch(&WatchParams::default())
        .unwrap();
    assert!(matches!(next(&mut w).await, WatchEvent::Listed(_)));
    let watch = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(s) = log.lock().unwrap().get(1) {
                return s.uri.clone();
            }
            // The watcher starts its watch call only when polled.
            let _ = tokio::time::timeout(Duration::from_millis(10), w.next()).await;
        }
    })
    .await
    .expect("the watch was started");
    assert!(watch.contains("timeoutSeconds=290"), "{watch}");
}

/// A server (or proxy) that ends every watch at once: kube-runtime reopens it
/// without an error, so only the client's pacing keeps it from a busy loop.
#[tokio::test]
async fn a_watch_closed_at_once_is_reopened_at_most_once_a_second() {
    /// How many watch requests reached the server, and the time from before the watch
    /// began to after they were counted (everything counted was sent within it).
    async fn watch_requests_in(paced: bool, window: Duration) -> (usize, Duration) {
        let log = Arc::new(Mutex::new(Vec::<String>::new()));
        let l = log.clone();
        let svc = tower::service_fn(move |req: Request<Body>| {
            let l = l.clone();
            async move {
                let uri = req.uri().to_string();
                let body = if uri.contains("watch=true") {
                    l.lock().unwrap().push(uri);
                    String::new()
                } else {
                    list(vec![], "1", None)
                };
                Ok::<_, Infallible>(
                    Response::builder()
                        .status(200)
                        .header("content-type", "application/json")
                        .body(Body::from(body.into_bytes()))
                        .unwrap(),
                )
            }
        });
        let builder = fencecsi_cluster::kube::client::ClientBuilder::new(svc, "default");
        let client = if paced {
            builder
                .with_layer(&fencecsi_cluster::watch_pacing::PaceWatches::default())
                .build()
        } else {
            builder.build()
        };
        let vas = Cluster::kube(client).api::<VolumeAttachment>(None);
        let started = std::time::Instant::now();
        let mut w = vas.watch(&WatchParams::default()).unwrap();
        let WatchEvent::Listed(_) = next(&mut w).await else {
            panic!("first is Listed")
        };
        // Nothing else ever arrives; the stream keeps reopening meanwhile.
        let _ = tokio::time::timeout(window, w.next()).await;
        let n = log.lock().unwrap().len();
        (n, started.elapsed())
    }
    /// The most watch requests a stream paced to one start per second can send in
    /// `span`: one at once, then one per whole second. A busy machine only lengthens
    /// the measured span, which only raises this.
    fn paced_most(span: Duration) -> usize {
        1 + span.as_secs() as usize
    }
    let window = Duration::from_millis(2500);
    let (paced, span) = watch_requests_in(true, window).await;
    assert!(
        (1..=paced_most(span)).contains(&paced),
        "{paced} watch requests in {span:?} with pacing"
    );
    // Control: without the layer, the same stream re-sends the watch continuously:
    // more often than pacing allows.
    let (unpaced, span) = watch_requests_in(false, window).await;
    assert!(
        unpaced > paced_most(span),
        "only {unpaced} watch requests in {span:?} without pacing"
    );
}

#[tokio::test]
async fn list_follows_continue_tokens() {
    let (cluster, log) = fake(|req, _| {
        if req.uri.contains("continue=tok") {
            (200, list(vec![va("c", "7")], "99", None))
        } else {
            (
                200,
                list(vec![va("a", "5"), va("b", "6")], "42", Some("tok")),
            )
        }
    });
    let out = cluster
        .api::<VolumeAttachment>(None)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert_eq!(names(&out.items), ["a", "b", "c"]);
    assert_eq!(
        out.resource_version, "42",
        "snapshot resourceVersion is the first page's"
    );
    assert_eq!(log.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn patch_metadata_sends_resource_version_and_retries_conflicts() {
    let (cluster, log) = fake(|req, n| match (req.method.as_str(), n) {
        ("GET", 0) => (200, pod("p", "1", json!({"finalizers": ["a"]})).to_string()),
        ("PATCH", 1) => (409, status(409, "Conflict")),
        ("GET", 2) => (
            200,
            pod("p", "2", json!({"finalizers": ["a", "z"]})).to_string(),
        ),
        ("PATCH", 3) => (
            200,
            pod("p", "3", json!({"finalizers": ["z", "b"]})).to_string(),
        ),
        other => panic!("unexpected request {other:?}: {}", req.uri),
    });
    let pods = cluster.api::<Pod>(Some("ns"));
    let out = pods
        .patch_metadata(
            "p",
            &MetadataPatch::new()
                .add_finalizer("b")
                .remove_finalizer("a")
                .set_label("l", "v"),
        )
        .await
        .unwrap();
    assert_eq!(out.metadata.resource_version.as_deref(), Some("3"));
    let log = log.lock().unwrap().clone();
    assert_eq!(log[1].uri, "/api/v1/namespaces/ns/pods/p?");
    let body: Value = serde_json::from_str(&log[3].body).unwrap();
    assert_eq!(
        body["metadata"]["resourceVersion"], "2",
        "patch carries the resourceVersion read"
    );
    assert_eq!(
        body["metadata"]["finalizers"],
        json!(["z", "b"]),
        "set operation on the latest list"
    );
    assert_eq!(body["metadata"]["labels"], json!({"l": "v"}));
}

#[tokio::test]
async fn patch_metadata_with_explicit_resource_version_does_not_retry() {
    let (cluster, log) = fake(|_, n| match n {
        0 => (200, pod("p", "5", json!({})).to_string()),
        _ => panic!("no write expected"),
    });
    let err = cluster
        .api::<Pod>(Some("ns"))
        .patch_metadata(
            "p",
            &MetadataPatch::new()
                .add_finalizer("x")
                .if_resource_version("4"),
        )
        .await
        .unwrap_err();
    assert!(err.is_conflict(), "{err}");
    assert_eq!(log.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn delete_outcomes_and_options() {
    let (cluster, log) = fake(|req, n| {
        match n {
        // Graceful: the pod comes back with deletionTimestamp and a running grace period.
        0 => (
            200,
            pod("p", "2", json!({"deletionTimestamp": "2030-01-01T00:00:00Z", "deletionGracePeriodSeconds": 30}))
                .to_string(),
        ),
        // Force delete of a pod: the server returns the pod object, grace 0, no finalizers.
        1 => (
            200,
            pod("p", "3", json!({"deletionTimestamp": "2030-01-01T00:00:00Z", "deletionGracePeriodSeconds": 0}))
                .to_string(),
        ),
        // Other kinds return a Status when gone.
        2 => (200, json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 200}).to_string()),
        // Finalizers pending.
        3 => (
            200,
            {
                let mut v = va("v", "9");
                v["metadata"]["deletionTimestamp"] = json!("2030-01-01T00:00:00Z");
                v["metadata"]["finalizers"] = json!(["f"]);
                v["metadata"]["deletionGracePeriodSeconds"] = json!(0);
                v.to_string()
            },
        ),
        4 => (409, status(409, "Conflict")),
        5 => (404, status(404, "NotFound")),
        _ => panic!("unexpected {}", req.uri),
    }
    });
    let pods = cluster.api::<Pod>(Some("ns"));
    let vas = cluster.api::<VolumeAttachment>(None);
    assert!(matches!(
        pods.delete("p", &DeleteOptions::grace_period(30))
            .await
            .unwrap(),
        DeleteOutcome::Terminating(_)
    ));
    assert!(pods
        .delete("p", &DeleteOptions::force().with_uid("u1"))
        .await
        .unwrap()
        .is_deleted());
    assert!(vas
        .delete("v", &DeleteOptions::default())
        .await
        .unwrap()
        .is_deleted());
    assert!(matches!(
        vas.delete("v", &DeleteOptions::default()).await.unwrap(),
        DeleteOutcome::Terminating(_)
    ));
    assert!(pods
        .delete("p", &DeleteOptions::force().with_uid("stale"))
        .await
        .unwrap_err()
        .is_conflict());
    assert!(pods
        .delete("p", &DeleteOptions::force())
        .await
        .unwrap_err()
        .is_not_found());

    let log = log.lock().unwrap().clone();
    assert_eq!(log[1].method, "DELETE");
    assert_eq!(log[1].uri, "/api/v1/namespaces/ns/pods/p?");
    let body: Value = serde_json::from_str(&log[1].body).unwrap();
    assert_eq!(body["gracePeriodSeconds"], 0);
    assert_eq!(body["preconditions"]["uid"], "u1");
    assert_eq!(log[2].uri, "/apis/storage.k8s.io/v1/volumeattachments/v?");
}
