//! What the plugin reports on `--http-endpoint` (served by [`fencecsi_cluster::http`]):
//!
//! - `/metrics`: [`Metrics`];
//! - `/healthz` and `/readyz`: what the Probe RPC answers (`identity`): not while node
//!   recovery refuses a state dir that looks wrong. The server runs while the plugin
//!   serves its socket; a controller plugin standing by for its Lease serves neither yet.
//!
//! In the deploy manifests the kubelet still probes the livenessprobe sidecar, which calls
//! Probe: the same answer, the way every CSI plugin is probed.

use std::sync::Arc;

use crate::metrics::Metrics;
use crate::node::state_guard::StateGuard;

pub struct Report {
    metrics: Arc<Metrics>,
    /// The node plugin's state dir check (node modes).
    state_guard: Option<Arc<StateGuard>>,
}

impl Report {
    pub fn new(metrics: Arc<Metrics>, state_guard: Option<Arc<StateGuard>>) -> Arc<Self> {
        Arc::new(Report {
            metrics,
            state_guard,
        })
    }
}

impl fencecsi_cluster::http::Report for Report {
    fn metrics(&self) -> String {
        self.metrics.encode()
    }

    fn healthz(&self) -> Result<(), String> {
        match self.state_guard.as_ref().and_then(|g| g.refusal()) {
            Some(why) => Err(format!("node recovery refuses the state dir: {why}")),
            None => Ok(()),
        }
    }
}
