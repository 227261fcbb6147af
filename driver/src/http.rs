//! `/metrics` over plain HTTP/1 (hyper), when `--http-endpoint` is set. Liveness is not
//! served here: the livenessprobe sidecar calls the plugin's Probe RPC.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::metrics::{Metrics, CONTENT_TYPE};

/// Serves `listener` until this future is dropped (it owns the connections).
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let mut conns = JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let (stream, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accepting an HTTP connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        conns.spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let metrics = metrics.clone();
                async move { Ok::<_, Infallible>(respond(&req, metrics).await) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "HTTP connection ended with an error");
            }
        });
    }
}

fn reply(code: StatusCode, ctype: &str, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, ctype)
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

async fn respond(req: &Request<Incoming>, metrics: Arc<Metrics>) -> Response<Full<Bytes>> {
    if req.uri().path() != "/metrics" {
        return reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /metrics\n".into(),
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".into(),
        );
    }
    // The loop device gauge lists devices with ioctls: off the async workers.
    match tokio::task::spawn_blocking(move || metrics.encode()).await {
        Ok(text) => reply(StatusCode::OK, CONTENT_TYPE, text),
        Err(e) => reply(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            format!("encoding metrics failed: {e}\n"),
        ),
    }
}
