//! Client-side pacing of watch requests. kube-runtime's watcher reopens a
//! watch the server (or a proxy in between) closed, at once and without an
//! error, so its backoff never applies: a proxy that cuts every watch
//! immediately would get the same watch re-sent as fast as it answers. This
//! layer lets each distinct watch (path and selectors) start at most once per
//! [`MIN_WATCH_INTERVAL`]; other requests pass untouched.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use tokio::time::Instant;
use tower::{Layer, Service};

/// The shortest time between two starts of the same watch.
pub const MIN_WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// The layer; clones share one record of when each watch last started.
#[derive(Clone, Default)]
pub struct PaceWatches {
    last: Arc<Mutex<HashMap<String, Instant>>>,
}

impl<S> Layer<S> for PaceWatches {
    type Service = Paced<S>;
    fn layer(&self, inner: S) -> Paced<S> {
        Paced {
            inner,
            last: self.last.clone(),
        }
    }
}

/// The service [`PaceWatches`] makes.
#[derive(Clone)]
pub struct Paced<S> {
    inner: S,
    last: Arc<Mutex<HashMap<String, Instant>>>,
}

/// The watch a request starts, as path plus selectors; None for other requests.
fn watch_key<B>(req: &Request<B>) -> Option<String> {
    let query = req.uri().query()?;
    if !query
        .split('&')
        .any(|p| p == "watch=true" || p == "watch=1")
    {
        return None;
    }
    let selectors: Vec<&str> = query
        .split('&')
        .filter(|p| p.starts_with("labelSelector=") || p.starts_with("fieldSelector="))
        .collect();
    Some(format!("{}?{}", req.uri().path(), selectors.join("&")))
}

impl<S, B> Service<Request<B>> for Paced<S>
where
    S: Service<Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let start_at = watch_key(&req).map(|key| {
            let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let at = match last.get(&key) {
                Some(prev) if *prev + MIN_WATCH_INTERVAL > now => *prev + MIN_WATCH_INTERVAL,
                _ => now,
            };
            last.insert(key, at);
            at
        });
        // The client's request futures send nothing until polled, so waiting
        // before the first poll delays the request itself.
        let fut = self.inner.call(req);
        Box::pin(async move {
            if let Some(at) = start_at {
                tokio::time::sleep_until(at).await;
            }
            fut.await
        })
    }
}
