//! Prometheus metrics of the plugin (prometheus-client), served on `/metrics` in the
//! OpenMetrics text format by [`crate::http`] when `--http-endpoint` is set.
//!
//! | metric | type | labels | modes |
//! |---|---|---|---|
//! | `fencecsi_driver_operations_seconds` | histogram | `driver_name`, `grpc_status_code`, `method_name` | all |
//! | `fencecsi_driver_fence_seconds` | histogram | `result` (`success`, `error`) | controller |
//! | `fencecsi_driver_fence_probe_ok` | gauge | - | controller |
//! | `fencecsi_driver_fence_late_writes_total` | counter | - | controller |
//! | `fencecsi_driver_loop_devices` | gauge | `fenced` (`true`, `false`) | node |
//!
//! `operations_seconds` is the plugin's side of the sidecars' `csi_sidecar_operations_seconds`:
//! the same labels with the same values (`method_name` the full gRPC method such as
//! `/csi.v1.Controller/ControllerPublishVolume`, `grpc_status_code` Go's spelling of the
//! code: `OK`, `NotFound`, `FailedPrecondition`, ...), and the sidecars' buckets with finer
//! ones below 100 ms. It is measured around every gRPC call by [`RpcMetricsLayer`].
//!
//! `fence_seconds` times every write fence the controller makes (a whole generation or
//! some of its holders), from the call into the backend until every holder shows only
//! the window or the fence failed; the start-up probe's fences are not counted, its
//! outcome is `fence_probe_ok` (1: the fence is offered, 0: refused, see the log).
//! `fence_late_writes_total` counts fenced generations that garbage collection found
//! written past their data (`fence::late_write_at`; logged at error with the volume).
//!
//! `loop_devices` is read from the kernel at every scrape: the bound loop devices whose
//! tag names this node (never metadata), split by whether a device shows only a fence
//! window (fenced, waiting for node recovery or an unstage) or the data.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tonic::Code;

/// Values of the `result` label of the fence histogram (as the attacher's metrics spell them).
pub const SUCCESS: &str = "success";
pub const ERROR: &str = "error";

/// Labels of `fencecsi_driver_operations_seconds`, named and ordered as the sidecars'
/// `csi_sidecar_operations_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    pub driver_name: String,
    pub grpc_status_code: &'static str,
    pub method_name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LoopLabels {
    fenced: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn operation_histogram() -> Histogram {
    // The sidecars' buckets (0.1 s .. 600 s) with 5 ms .. 50 ms below them: most of the
    // plugin's calls take milliseconds.
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 25.0, 50.0, 120.0,
        300.0, 600.0,
    ])
}

fn fence_histogram() -> Histogram {
    // A fence is a few ioctls and an fsync: milliseconds when idle, seconds when the
    // queue drains a lot of in-flight I/O or the fsync writes much back.
    Histogram::new([
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

/// Go's `codes.Code.String()`: what the sidecars put into `grpc_status_code`.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

/// The `method_name` of a request path: the full gRPC method of a CSI call
/// (`/csi.v1.Node/NodeStageVolume`), `unknown` for anything else, so that a stray
/// client cannot grow the label set without bound.
pub fn method_name(path: &str) -> String {
    let ok = path
        .strip_prefix("/csi.v1.")
        .and_then(|rest| rest.split_once('/'))
        .is_some_and(|(service, method)| {
            let word = |s: &str| {
                !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric())
            };
            word(service) && word(method)
        });
    if ok {
        path.to_string()
    } else {
        "unknown".to_string()
    }
}

/// Handle on the fence histogram, kept by the controller; clones share the values.
#[derive(Clone, Debug)]
pub struct FenceMetrics {
    seconds: HistogramFamily<ResultLabels>,
    late_writes: Counter,
}

impl Default for FenceMetrics {
    fn default() -> Self {
        let seconds = Family::new_with_constructor(fence_histogram as fn() -> Histogram);
        // Both series exist from the start, so that rates over them are defined.
        for result in [SUCCESS, ERROR] {
            let _ = seconds.get_or_create(&ResultLabels { result });
        }
        FenceMetrics {
            seconds,
            late_writes: Counter::default(),
        }
    }
}

impl FenceMetrics {
    pub fn observe(&self, ok: bool, took: Duration) {
        let result = if ok { SUCCESS } else { ERROR };
        self.seconds
            .get_or_create(&ResultLabels { result })
            .observe(took.as_secs_f64());
    }

    /// Counts a fenced generation found written past its data when collected
    /// (see `fence::late_write_at`).
    pub fn late_write_found(&self) {
        self.late_writes.inc();
    }

    /// Times `f`, a fence, and records its outcome.
    pub fn time<T, E>(&self, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let start = Instant::now();
        let r = f();
        self.observe(r.is_ok(), start.elapsed());
        r
    }
}

/// The `fencecsi_driver_loop_devices` gauge, read from the kernel at every scrape.
#[derive(Debug)]
struct LoopDevices {
    /// The 8-hex-digit node part of our loop tags ([`crate::terms::node_tag`]).
    node_tag: String,
}

impl LoopDevices {
    /// (showing data, fenced) devices of this node, as the kernel reports them now.
    fn count(&self) -> Result<(i64, i64), crate::kernel::loop_device::LoopError> {
        let mut counts = (0, 0);
        for lo in crate::kernel::loop_device::list()? {
            let ours =
                crate::terms::parse_tag_full(&lo.tag).is_some_and(|(_, _, n)| n == self.node_tag);
            if !ours {
                continue;
            }
            // A fenced device shows only the fence window: a size limit of at most the
            // window (the data of a volume is never that small).
            if lo.size_limit > 0 && lo.size_bytes <= crate::fence::WINDOW_BYTES {
                counts.1 += 1;
            } else {
                counts.0 += 1;
            }
        }
        Ok(counts)
    }
}

impl Collector for LoopDevices {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (active, fenced) = match self.count() {
            Ok(c) => c,
            Err(e) => {
                // No sample rather than a wrong one.
                tracing::warn!(error = %e, "listing loop devices for /metrics failed");
                return Ok(());
            }
        };
        let family = Family::<LoopLabels, Gauge>::default();
        family
            .get_or_create(&LoopLabels { fenced: "false" })
            .set(active);
        family
            .get_or_create(&LoopLabels { fenced: "true" })
            .set(fenced);
        let metric = encoder.encode_descriptor(
            "loop_devices",
            "Loop devices this node plugin holds, as the kernel reports them at scrape time, by whether they show only a fence window.",
            None,
            family.metric_type(),
        )?;
        family.encode(metric)
    }
}

/// What a controller hands the registry: the fence figures its fences write,
/// and whether the start-up probe proved the fence.
pub struct ControllerFigures<'a> {
    pub fence: &'a FenceMetrics,
    pub fence_available: bool,
}

/// The plugin's metrics; one registry per served plugin (tests run several in a process).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    operations: HistogramFamily<OperationLabels>,
    driver_name: String,
}

impl Metrics {
    /// Registers what the served modes have: the RPC histogram always; with a
    /// controller its fence histogram and probe result; with a node (its ID)
    /// its loop devices. The services write their figures; nothing here reads
    /// a service.
    pub fn new(
        driver_name: &str,
        controller: Option<ControllerFigures<'_>>,
        node_id: Option<&str>,
    ) -> Self {
        let mut registry = Registry::with_prefix("fencecsi_driver");
        let operations: HistogramFamily<OperationLabels> =
            Family::new_with_constructor(operation_histogram as fn() -> Histogram);
        registry.register(
            "operations_seconds",
            "Duration of the plugin's CSI calls by gRPC method and status code (as the sidecars' csi_sidecar_operations_seconds)",
            operations.clone(),
        );
        if let Some(c) = controller {
            registry.register(
                "fence_seconds",
                "Time to make a write fence (every holder remapped to the fence window, the generation fsynced), by result",
                c.fence.seconds.clone(),
            );
            registry.register(
                "fence_late_writes",
                "Fenced generations found, when garbage collection removed them, with data written past their data after the fence (a write reported done to the fenced node that is not in the data)",
                c.fence.late_writes.clone(),
            );
            let probe = Gauge::<i64>::default();
            probe.set(i64::from(c.fence_available));
            registry.register(
                "fence_probe_ok",
                "1 when the start-up probe proved the fence on the state dir's filesystem (the fence is offered), 0 when it did not",
                probe,
            );
        }
        if let Some(node_id) = node_id {
            registry.register_collector(Box::new(LoopDevices {
                node_tag: crate::terms::node_tag(node_id),
            }));
        }
        Metrics {
            registry,
            operations,
            driver_name: driver_name.to_string(),
        }
    }

    /// Records one finished call.
    pub fn observe_call(&self, method_name: String, code: Code, took: Duration) {
        self.operations
            .get_or_create(&OperationLabels {
                driver_name: self.driver_name.clone(),
                grpc_status_code: code_name(code),
                method_name,
            })
            .observe(took.as_secs_f64());
    }

    /// OpenMetrics text. Blocking: the loop device gauge asks the kernel.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        out
    }
}

/// A tower layer around the gRPC routes that times every call and records it with its
/// method and gRPC status code. The code comes from the `grpc-status` header when the
/// answer is trailers-only (how tonic answers a unary call that failed), else from the
/// trailers at the end of the body; a body dropped before its end (the client went
/// away) counts as `Canceled`.
#[derive(Clone, Debug)]
pub struct RpcMetricsLayer {
    metrics: Arc<Metrics>,
}

impl RpcMetricsLayer {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        RpcMetricsLayer { metrics }
    }
}

impl<S> tower::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetricsService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RpcMetricsService {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct RpcMetricsService<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

/// One call being timed; records exactly once (at the latest when dropped).
struct Call {
    metrics: Arc<Metrics>,
    method: String,
    start: Instant,
    done: bool,
}

impl Call {
    fn finish(&mut self, code: Code) {
        if !self.done {
            self.done = true;
            self.metrics
                .observe_call(std::mem::take(&mut self.method), code, self.start.elapsed());
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        self.finish(Code::Cancelled);
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<Code> {
    let v = headers.get("grpc-status")?;
    let n: i32 = v.to_str().ok()?.trim().parse().ok()?;
    Some(Code::from_i32(n))
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for RpcMetricsService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = http::Response<TimedBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let mut call = Call {
            metrics: self.metrics.clone(),
            method: method_name(req.uri().path()),
            start: Instant::now(),
            done: false,
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            match fut.await {
                Ok(resp) => {
                    if let Some(code) = grpc_status(resp.headers()) {
                        call.finish(code);
                    }
                    Ok(resp.map(|inner| TimedBody { inner, call }))
                }
                Err(e) => {
                    call.finish(Code::Unknown);
                    Err(e)
                }
            }
        })
    }
}

/// A response body that records its call when the trailers carry the status.
pub struct TimedBody<B> {
    inner: B,
    call: Call,
}

impl<B> hyper::body::Body for TimedBody<B>
where
    B: hyper::body::Body + Unpin,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(code) = frame.trailers_ref().and_then(grpc_status) {
                    this.call.finish(code);
                }
            }
            Poll::Ready(Some(Err(_))) => this.call.finish(Code::Internal),
            // The end without a status anywhere: not a well-formed gRPC answer.
            Poll::Ready(None) => this.call.finish(Code::Unknown),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_names_are_csi_methods_or_unknown() {
        assert_eq!(
            method_name("/csi.v1.Controller/ControllerPublishVolume"),
            "/csi.v1.Controller/ControllerPublishVolume"
        );
        assert_eq!(
            method_name("/csi.v1.Identity/Probe"),
            "/csi.v1.Identity/Probe"
        );
        for odd in [
            "/",
            "/grpc.health.v1.Health/Check",
            "/csi.v1.Node/",
            "/csi.v1.Node/a/b",
            "/csi.v1.Node/x-y",
        ] {
            assert_eq!(method_name(odd), "unknown", "{odd}");
        }
        let long = format!("/csi.v1.Node/{}", "a".repeat(65));
        assert_eq!(method_name(&long), "unknown");
    }

    #[test]
    fn codes_are_spelled_as_go_spells_them() {
        assert_eq!(code_name(Code::Ok), "OK");
        assert_eq!(code_name(Code::Cancelled), "Canceled");
        assert_eq!(code_name(Code::FailedPrecondition), "FailedPrecondition");
        assert_eq!(code_name(Code::NotFound), "NotFound");
    }

    #[test]
    fn operations_are_encoded_with_the_sidecars_labels() {
        let m = Metrics::new("loop.fencecsi.io", None, None);
        m.observe_call(
            "/csi.v1.Identity/Probe".into(),
            Code::Ok,
            Duration::from_millis(3),
        );
        m.observe_call(
            "/csi.v1.Node/NodeStageVolume".into(),
            Code::FailedPrecondition,
            Duration::from_secs(2),
        );
        let text = m.encode();
        assert!(
            text.contains("# TYPE fencecsi_driver_operations_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains(r#"fencecsi_driver_operations_seconds_count{driver_name="loop.fencecsi.io",grpc_status_code="OK",method_name="/csi.v1.Identity/Probe"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"fencecsi_driver_operations_seconds_bucket{le="1.0",driver_name="loop.fencecsi.io",grpc_status_code="FailedPrecondition",method_name="/csi.v1.Node/NodeStageVolume"} 0"#)
                && text.contains(r#"fencecsi_driver_operations_seconds_bucket{le="2.5",driver_name="loop.fencecsi.io",grpc_status_code="FailedPrecondition",method_name="/csi.v1.Node/NodeStageVolume"} 1"#),
            "{text}"
        );
        assert!(text.trim_end().ends_with("# EOF"));
    }

    #[test]
    fn fence_histogram_has_both_results_from_the_start() {
        let f = FenceMetrics::default();
        let mut registry = Registry::with_prefix("fencecsi_driver");
        registry.register("fence_seconds", "fences", f.seconds.clone());
        f.observe(true, Duration::from_millis(20));
        assert_eq!(f.time(|| Err::<(), _>("no")).unwrap_err(), "no");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains(r#"fencecsi_driver_fence_seconds_count{result="success"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"fencecsi_driver_fence_seconds_count{result="error"} 1"#),
            "{text}"
        );
    }
}
