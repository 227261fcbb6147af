//! What an in-process API server behind `kube::Client` would cost the embedded
//! cluster's users, against what the seam costs them today (issue 27's choice
//! between a backend trait and such a server).
//!
//! Both sides read the same embedded store in the same run, rounds interleaved:
//! - baseline: the seam's embedded backend (`Api::list`, `Api::get`: typed clones);
//! - candidate: the same calls through a `kube::Client` whose transport is a tower
//!   service in this process, answering from that store as an API server would (JSON
//!   bodies, pages of 500 for lists), so the caller runs the real kube path
//!   (`kube_backend`: request building, paging, decoding).
//!
//! The candidate's extra time is the least such a server adds: it leaves out watches,
//! writes, selectors and admission, which it would also have to serve.
//!
//! ```text
//! cargo bench -p fencecsi-embedded-cluster --bench backend_cost
//! BACKEND_BENCH_PODS=150000 BACKEND_BENCH_ROUNDS=5 BACKEND_BENCH_GETS=20000 cargo bench ...
//! ```

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencecsi_cluster::k8s_openapi::api::core::v1::Pod;
use fencecsi_cluster::kube::client::Body;
use fencecsi_cluster::{Api, Cluster, ListParams};
use fencecsi_embedded_cluster::EmbeddedCluster;
use http::{Request, Response};
use serde::Serialize;
use serde_json::json;

const NAMESPACE: &str = "bench";
/// The kube backend's page size (`kube_backend::PAGE`).
const PAGE: usize = 500;

fn env_or(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().unwrap_or_else(|e| {
            eprintln!("{name}={v:?}: {e}");
            std::process::exit(2)
        }),
        _ => default,
    }
}

/// A StatefulSet pod as a kubelet reports it: about 1.1 KiB of JSON.
fn pod(i: usize) -> Pod {
    let node = format!("node-{}", i / 30);
    let conditions: Vec<_> = [
        "PodReadyToStartContainers",
        "Initialized",
        "Ready",
        "ContainersReady",
        "PodScheduled",
    ]
    .iter()
    .map(|t| json!({"type": t, "status": "True", "lastTransitionTime": "2026-11-01T00:00:00Z"}))
    .collect();
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("db-{i}"), "namespace": NAMESPACE,
            "labels": {"app": "db", "shard": format!("{}", i % 16),
                       "statefulset.kubernetes.io/pod-name": format!("db-{i}")},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-01T00:00:00Z"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "db",
                                 "uid": "7d3f1c9e-0000-4000-8000-000000000001",
                                 "controller": true, "blockOwnerDeletion": true}]
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "db", "image": "registry.example/db:1.2.3",
                            "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
                            "volumeMounts": [{"name": "data", "mountPath": "/data"},
                                             {"name": "token", "mountPath": "/var/run/secrets/token"}]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": format!("data-db-{i}")}},
                        {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}]}}],
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}]
        },
        "status": {
            "phase": "Running", "podIP": format!("10.{}.{}.{}", i >> 16 & 255, i >> 8 & 255, i & 255),
            "conditions": conditions,
            "containerStatuses": [{"name": "db", "ready": true, "restartCount": 0, "image": "registry.example/db:1.2.3",
                                   "imageID": "registry.example/db@sha256:0000", "started": true,
                                   "state": {"running": {"startedAt": "2026-11-01T00:00:00Z"}}}]
        }
    }))
    .unwrap()
}

#[derive(Serialize)]
struct ListMeta {
    #[serde(rename = "resourceVersion")]
    resource_version: String,
    #[serde(rename = "continue", skip_serializing_if = "String::is_empty")]
    continue_: String,
}

#[derive(Serialize)]
struct PodListPage<'a> {
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    kind: &'static str,
    metadata: ListMeta,
    items: &'a [Pod],
}

fn json_response(body: Vec<u8>) -> Response<Body> {
    Response::builder()
        .status(200)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap()
}

/// The list the first page read, with its resourceVersion: the later pages serve it.
type Snapshot = Mutex<Option<(Arc<Vec<Pod>>, String)>>;

/// The query parameter `key` of `uri`.
fn query<'a>(uri: &'a http::Uri, key: &str) -> Option<&'a str> {
    uri.query()?
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// One request of the candidate's transport, answered from `store`: a list page
/// (a fresh snapshot on the first page, as a server's list is one read) or a get.
async fn serve(store: &Api<Pod>, snapshot: &Snapshot, req: Request<Body>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let list_path = format!("/api/v1/namespaces/{NAMESPACE}/pods");
    if path == list_path {
        let from: usize = query(req.uri(), "continue")
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let (items, rv) = if from == 0 {
            let list = store.list(&ListParams::default()).await.unwrap();
            let taken = (Arc::new(list.items), list.resource_version);
            *snapshot.lock().unwrap() = Some(taken.clone());
            taken
        } else {
            snapshot.lock().unwrap().clone().expect("a first page")
        };
        let end = (from + PAGE).min(items.len());
        let page = PodListPage {
            api_version: "v1",
            kind: "PodList",
            metadata: ListMeta {
                resource_version: rv,
                continue_: if end < items.len() {
                    end.to_string()
                } else {
                    String::new()
                },
            },
            items: &items[from..end],
        };
        return json_response(serde_json::to_vec(&page).unwrap());
    }
    let name = path
        .strip_prefix(&format!("{list_path}/"))
        .unwrap_or_else(|| panic!("unexpected request {path}"));
    json_response(serde_json::to_vec(&store.get(name).await.unwrap()).unwrap())
}

/// A cluster whose API server is `store`, reached through kube's client.
fn through_kube_client(store: Api<Pod>) -> Cluster {
    let snapshot = Arc::new(Mutex::new(None));
    let svc = tower::service_fn(move |req: Request<Body>| {
        let (store, snapshot) = (store.clone(), snapshot.clone());
        async move { Ok::<_, Infallible>(serve(&store, &snapshot, req).await) }
    });
    Cluster::kube(fencecsi_cluster::kube::Client::new(svc, NAMESPACE))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let pods = env_or("BACKEND_BENCH_PODS", 150_000);
    let rounds = env_or("BACKEND_BENCH_ROUNDS", 5).max(1);
    let gets = env_or("BACKEND_BENCH_GETS", 20_000).max(1);
    eprintln!("backend cost: {pods} pods, {rounds} rounds, {gets} gets per round");
    let embedded = EmbeddedCluster::new();
    let store = embedded.api::<Pod>(Some(NAMESPACE));
    let loaded = Instant::now();
    for i in 0..pods {
        store.create(&pod(i)).await.unwrap();
    }
    let sample = serde_json::to_vec(&store.get("db-0").await.unwrap()).unwrap();
    eprintln!(
        "loaded in {:.1} s; one pod is {} bytes of JSON",
        loaded.elapsed().as_secs_f64(),
        sample.len()
    );
    let remote = through_kube_client(store.clone()).api::<Pod>(Some(NAMESPACE));

    let (mut list_base, mut list_cand, mut get_base, mut get_cand) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        // Alternate which side goes first, so neither always runs on a warmer cache.
        for side in [round % 2, 1 - round % 2] {
            let api = if side == 0 { &store } else { &remote };
            let t = Instant::now();
            let list = api.list(&ListParams::default()).await.unwrap();
            let took = t.elapsed();
            assert_eq!(list.items.len(), pods, "the whole list");
            let t = Instant::now();
            for i in 0..gets {
                let name = format!("db-{}", i * 7919 % pods);
                let got = api.get(&name).await.unwrap();
                assert_eq!(got.metadata.name.as_deref(), Some(name.as_str()));
            }
            let got = t.elapsed();
            if side == 0 {
                list_base.push(took);
                get_base.push(got);
            } else {
                list_cand.push(took);
                get_cand.push(got);
            }
        }
    }
    let (lb, lc) = (median(list_base), median(list_cand));
    let (gb, gc) = (median(get_base), median(get_cand));
    let per_get = |d: Duration| d.as_secs_f64() * 1e6 / gets as f64;
    println!("| medians of {rounds} rounds, {pods} pods | seam, embedded backend (baseline) | through kube::Client, in-process server | ratio |");
    println!("|---|---:|---:|---:|");
    println!(
        "| list all pods | {:.1} ms | {:.1} ms | {:.1}x |",
        ms(lb),
        ms(lc),
        lc.as_secs_f64() / lb.as_secs_f64()
    );
    println!(
        "| one get | {:.1} µs | {:.1} µs | {:.1}x |",
        per_get(gb),
        per_get(gc),
        gc.as_secs_f64() / gb.as_secs_f64()
    );
    println!(
        "extra per listed pod: {:.2} µs",
        (lc.as_secs_f64() - lb.as_secs_f64()) * 1e6 / pods as f64
    );
}
