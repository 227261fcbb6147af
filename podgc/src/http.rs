//! `/metrics` and `/healthz` over plain HTTP/1 (hyper).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// Liveness: the controller loop stamps this; `/healthz` fails when it is older than
/// `stale_after` (a stuck loop).
#[derive(Debug)]
pub struct Liveness {
    last: std::sync::Mutex<Instant>,
    stale_after: Duration,
    /// Set while the run loop knows it cannot do its job (a failing election),
    /// so /healthz turns red at once instead of after the staleness limit.
    failing: std::sync::atomic::AtomicBool,
}

impl Liveness {
    pub fn new(stale_after: Duration) -> Self {
        Liveness {
            last: std::sync::Mutex::new(Instant::now()),
            stale_after,
            failing: Default::default(),
        }
    }
    pub fn stamp(&self) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.failing
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }
    pub fn fail(&self) {
        self.failing
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
    pub fn healthy(&self) -> bool {
        !self.failing.load(std::sync::atomic::Ordering::Relaxed)
            && self
                .last
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .elapsed()
                < self.stale_after
    }
}

fn text(status: StatusCode, ctype: &str, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("content-type", ctype)
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts")
}

/// Binds `addr` and serves until `shutdown` resolves. Returns the bound address through
/// `bound` (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    liveness: Arc<Liveness>,
    shutdown: impl Future<Output = ()> + Send,
    bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tracing::info!(addr = %local, "serving /metrics and /healthz");
    if let Some(b) = bound {
        let _ = b.send(local);
    }
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let metrics = metrics.clone();
        let liveness = liveness.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let metrics = metrics.clone();
                let liveness = liveness.clone();
                async move {
                    Ok::<_, Infallible>(match req.uri().path() {
                        "/metrics" => text(
                            StatusCode::OK,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            metrics.encode(),
                        ),
                        "/healthz" | "/livez" | "/readyz" if liveness.healthy() => {
                            text(StatusCode::OK, "text/plain", "ok\n".into())
                        }
                        "/healthz" | "/livez" | "/readyz" => text(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "text/plain",
                            "controller loop stalled\n".into(),
                        ),
                        _ => text(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
                    })
                }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "http connection ended with an error");
            }
        });
    }
}
