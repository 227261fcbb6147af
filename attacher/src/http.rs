//! What the attacher reports on `--http-endpoint` (served by [`fencecsi_cluster::http`]):
//!
//! - `/metrics`: [`Metrics`];
//! - `/healthz`: alive as long as the run loop is and its election gets answers: a standby
//!   replica is healthy too, one forbidden from its Lease is not;
//! - `/readyz`: healthy, and past start-up (the plugin answered) until it stops: a standby
//!   is ready as well as the leader.

use std::sync::Arc;

use tokio::sync::watch;

use crate::metrics::Metrics;
use crate::{Phase, Status};

pub(crate) struct Report {
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) status: watch::Receiver<Status>,
}

impl fencecsi_cluster::http::Report for Report {
    fn metrics(&self) -> String {
        self.metrics.encode()
    }

    fn healthz(&self) -> Result<(), String> {
        let s = self.status.borrow();
        if s.election_failing {
            Err(
                "leader election gets no answer from the API server (forbidden or unreachable)"
                    .into(),
            )
        } else if s.phase == Phase::Stopped {
            Err("stopped".into())
        } else {
            Ok(())
        }
    }

    fn readyz(&self) -> Result<(), String> {
        self.healthz()?;
        match self.status.borrow().phase {
            Phase::Standby | Phase::Active => Ok(()),
            Phase::Starting => Err("starting: waiting for the CSI plugin".into()),
            Phase::Stopping | Phase::Stopped => Err("stopping".into()),
        }
    }
}
