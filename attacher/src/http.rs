//! `/healthz` and `/metrics` over HTTP/1.1 (hyper 1 with hyper-util's tokio glue).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http::{header, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::metrics::{Metrics, CONTENT_TYPE};
use crate::Status;

pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

/// Serves until dropped (the connections are owned by this future).
pub(crate) async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    status: watch::Receiver<Status>,
) {
    let mut conns = JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let (stream, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accepting an HTTP connection failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        let status = status.clone();
        conns.spawn(async move {
            let svc = service_fn(move |req| {
                let r = respond(&req, &metrics, &status.borrow());
                async move { Ok::<_, Infallible>(r) }
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

fn respond(req: &Request<Incoming>, metrics: &Metrics, status: &Status) -> Response<Full<Bytes>> {
    let reply = |code: StatusCode, ctype: &str, body: String| {
        Response::builder()
            .status(code)
            .header(header::CONTENT_TYPE, ctype)
            .body(Full::new(Bytes::from(body)))
            .expect("static response parts are valid")
    };
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".into(),
        );
    }
    match req.uri().path() {
        "/healthz" => {
            // Alive as long as the run loop is and its election gets answers: a
            // standby replica is healthy too, one forbidden from its Lease is not.
            if status.election_failing {
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "leader election gets no answer from the API server (forbidden or unreachable)\n".into(),
                )
            } else if status.phase == crate::Phase::Stopped {
                reply(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "stopped\n".into(),
                )
            } else {
                reply(StatusCode::OK, "text/plain", "ok\n".into())
            }
        }
        "/metrics" => reply(StatusCode::OK, CONTENT_TYPE, metrics.encode()),
        _ => reply(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /healthz or /metrics\n".into(),
        ),
    }
}
