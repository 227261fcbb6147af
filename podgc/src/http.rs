//! podgc's health ([`Liveness`]) and what it reports on its HTTP endpoint ([`Report`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// What podgc reports on `--http-endpoint` (served by [`fencecsi_cluster::http`]):
/// `/metrics`, and [`Liveness`] on both `/healthz` and `/readyz` (a standby turns the loop
/// and is ready as well as the leader).
pub struct Report {
    pub metrics: Arc<Metrics>,
    pub liveness: Arc<Liveness>,
}

impl fencecsi_cluster::http::Report for Report {
    fn metrics(&self) -> String {
        self.metrics.encode()
    }

    fn healthz(&self) -> Result<(), String> {
        if self.liveness.healthy() {
            Ok(())
        } else {
            Err("controller loop stalled".into())
        }
    }
}
