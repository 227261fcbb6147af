//! The plugin's `/metrics` (`--http-endpoint`): RPC durations by method and gRPC code as
//! the sidecars label them, the fence histogram, and the loop devices the node holds as
//! the kernel shows them.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fencecsi_driver::config::Mode;
use fencecsi_tests::{csi, mount_cap, require_root, Access, Env, InProcess};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

const DRIVER: &str = fencecsi_driver::config::DEFAULT_DRIVER_NAME;

/// GET over a fresh connection: (status code, body).
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut raw = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut raw))
        .await
        .expect("the metrics endpoint answers in time")
        .unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status line");
    if status == 200 && path == "/metrics" {
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/openmetrics-text"),
            "{head}"
        );
    }
    (status, body.to_string())
}

async fn scrape(addr: SocketAddr) -> String {
    let (status, body) = get(addr, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.trim_end().ends_with("# EOF"), "{body}");
    body
}

/// The value of the sample `name{labels}`, if present.
fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = if labels.is_empty() {
        format!("{name} ")
    } else {
        format!("{name}{{{labels}}} ")
    };
    text.lines()
        .find_map(|l| l.strip_prefix(key.as_str()))
        .map(|v| v.trim().parse().expect("a number"))
}

/// `fencecsi_driver_operations_seconds_count` of one method and code (0 when absent).
fn calls(text: &str, method: &str, code: &str) -> f64 {
    sample(
        text,
        "fencecsi_driver_operations_seconds_count",
        &format!(r#"driver_name="{DRIVER}",grpc_status_code="{code}",method_name="{method}""#),
    )
    .unwrap_or(0.0)
}

/// `fencecsi_driver_loop_devices` as (showing data, fenced).
fn loop_gauge(text: &str) -> (f64, f64) {
    let get = |fenced: &str| {
        sample(
            text,
            "fencecsi_driver_loop_devices",
            &format!(r#"fenced="{fenced}""#),
        )
        .unwrap_or_else(|| panic!("no loop device gauge (fenced={fenced}):\n{text}"))
    };
    (get("false"), get("true"))
}

const PUBLISH: &str = "/csi.v1.Controller/ControllerPublishVolume";
const UNPUBLISH: &str = "/csi.v1.Controller/ControllerUnpublishVolume";
const STAGE: &str = "/csi.v1.Node/NodeStageVolume";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_endpoint_counts_rpcs_by_code_fences_and_loop_devices() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    // A node ID of this run only: the gauge counts the kernel's devices tagged with it.
    let node_id = format!("metrics-{}", std::process::id());
    let mut cfg = env.config(Mode::All, Some(&node_id), "all");
    cfg.http_endpoint = Some("127.0.0.1:0".parse().unwrap());
    let (plugin, mut c, addr) = InProcess::start_with_metrics(cfg).await;
    assert_ne!(addr.port(), 0, "the real port is reported");

    let (status, _) = get(addr, "/").await;
    assert_eq!(status, 404);
    let (status, _) = get(addr, "/metrics/x").await;
    assert_eq!(status, 404);
    // Liveness and readiness: what Probe answers (ready: the state dir is the known one).
    assert_eq!(get(addr, "/healthz").await, (200, "ok\n".into()));
    assert_eq!(get(addr, "/readyz").await, (200, "ok\n".into()));

    let text = scrape(addr).await;
    assert_eq!(
        sample(&text, "fencecsi_driver_fence_probe_ok", ""),
        Some(1.0),
        "the fence is proven on the test dir:\n{text}"
    );
    assert_eq!(
        sample(&text, "fencecsi_driver_fence_late_writes_total", ""),
        Some(0.0),
        "no late write, and the counter is there from the start:\n{text}"
    );
    assert_eq!(loop_gauge(&text), (0.0, 0.0));
    // The plugin's own readiness check (wait_for_socket) went through the layer.
    assert!(
        calls(&text, "/csi.v1.Identity/Probe", "OK") >= 1.0,
        "{text}"
    );
    for result in ["success", "error"] {
        assert_eq!(
            sample(
                &text,
                "fencecsi_driver_fence_seconds_count",
                &format!(r#"result="{result}""#)
            ),
            Some(0.0),
            "{text}"
        );
    }

    // A call that fails with a known code: an answer carried in the headers (trailers-only).
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let missing = c
        .controller
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: "vol-0123456789abcdef0123456789abcdef".into(),
            node_id: node_id.clone(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .expect_err("no such volume");
    assert_eq!(missing.code(), Code::NotFound, "{missing}");

    // A volume held by a loop device on the node: created, published, staged, published.
    let vol = c
        .controller
        .create_volume(csi::CreateVolumeRequest {
            name: "metrics".into(),
            capacity_range: Some(csi::CapacityRange {
                required_bytes: 64 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let id = vol.volume_id.clone();
    let ctx = c
        .controller
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: id.clone(),
            node_id: node_id.clone(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    let staging = env.staging_path(&node_id, &id);
    let target = env.target_path(&node_id, "pod-1", &id);
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    c.node
        .node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: id.clone(),
            publish_context: ctx.clone(),
            staging_target_path: staging.to_string_lossy().into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    c.node
        .node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: id.clone(),
            publish_context: ctx.clone(),
            staging_target_path: staging.to_string_lossy().into(),
            target_path: target.to_string_lossy().into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await
        .unwrap();

    let text = scrape(addr).await;
    assert_eq!(env.loops().len(), 1, "one loop device holds the volume");
    assert_eq!(
        loop_gauge(&text),
        (1.0, 0.0),
        "the gauge shows what the kernel shows:\n{text}"
    );
    assert_eq!(calls(&text, PUBLISH, "OK"), 1.0, "{text}");
    assert_eq!(calls(&text, PUBLISH, "NotFound"), 1.0, "{text}");
    assert_eq!(calls(&text, STAGE, "OK"), 1.0, "{text}");

    // The fence: unpublished from the node while its loop device still holds the volume.
    c.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: node_id.clone(),
            fence: true,
            ..Default::default()
        })
        .await
        .expect("fenced unpublish");

    let text = scrape(addr).await;
    assert_eq!(calls(&text, UNPUBLISH, "OK"), 1.0, "{text}");
    let fences = sample(
        &text,
        "fencecsi_driver_fence_seconds_count",
        r#"result="success""#,
    )
    .expect("fence histogram");
    assert!(fences >= 1.0, "{text}");
    assert_eq!(
        sample(
            &text,
            "fencecsi_driver_fence_seconds_count",
            r#"result="error""#
        ),
        Some(0.0)
    );
    let took = sample(
        &text,
        "fencecsi_driver_fence_seconds_sum",
        r#"result="success""#,
    )
    .unwrap();
    assert!(took > 0.0 && took < 10.0, "fence took {took} s");
    assert_eq!(
        env.loops().len(),
        1,
        "the fenced device stays until unstaged"
    );
    assert_eq!(
        loop_gauge(&text),
        (0.0, 1.0),
        "the node's device shows only the fence window:\n{text}"
    );
    // Every bucket line of the histograms is well formed and cumulative.
    let buckets: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.starts_with("fencecsi_driver_fence_seconds_bucket{")
                && l.contains(r#"result="success""#)
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(buckets.len() > 5, "{text}");
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "{buckets:?}");
    assert_eq!(*buckets.last().unwrap(), fences);

    // Clean up: the fenced node releases the volume (force, as after a fence), then delete.
    c.node
        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: id.clone(),
            target_path: target.to_string_lossy().into(),
            force: true,
        })
        .await
        .unwrap();
    c.node
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.to_string_lossy().into(),
            force: true,
        })
        .await
        .unwrap();
    // A bound on liveness only.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !env.loops().is_empty() {
        assert!(
            Instant::now() < deadline,
            "loop devices left: {:?}",
            env.loops()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = scrape(addr).await;
    assert_eq!(loop_gauge(&text), (0.0, 0.0), "{text}");
    fencecsi_tests::rig::retry_aborted(|| {
        let mut c = c.clone();
        let req = csi::DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        };
        async move { c.controller.delete_volume(req).await }
    })
    .await
    .expect("DeleteVolume");

    plugin.stop().await;
    // The endpoint goes with the plugin.
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "/metrics still served after the plugin stopped"
    );
    env.assert_clean();
}
