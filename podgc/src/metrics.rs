//! Prometheus metrics (prometheus-client, OpenMetrics text on `/metrics`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

/// podgc's metrics; the handles are cheap clones sharing the registered values.
/// A kubelet probe's outcome: "yes" (it answered) or "no".
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AnsweredLabels {
    pub answered: String,
}

impl AnsweredLabels {
    pub fn of(answered: bool) -> AnsweredLabels {
        AnsweredLabels {
            answered: if answered { "yes" } else { "no" }.into(),
        }
    }
}

pub struct Metrics {
    registry: Registry,
    pub kubelet_probes: Family<AnsweredLabels, Counter>,
    /// Pods force-deleted, by why they were selected (`safe-detach-volumes`, `no-volumes`).
    pub force_deletions: Family<ReasonLabels, Counter>,
    /// Terminating pods on shut-down nodes left alone, by why (counted once per pod).
    pub skipped_pods: Family<ReasonLabels, Counter>,
    pub volume_attachments_deleted: Counter,
    pub quarantines: Counter,
    pub quarantines_lifted: Counter,
    /// Nodes carrying the quarantine taint.
    pub quarantined_nodes: Gauge,
    /// Nodes counted NotReady in the last pass.
    pub unhealthy_nodes: Gauge,
    /// 1 while more than the allowed fraction of nodes is NotReady (podgc does nothing).
    pub disruption_mode: Gauge,
    /// 1 while this instance leads (always 1 without leader election).
    pub leader: Gauge,
    pub passes: Counter,
    pub pass_duration_seconds: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("fencecsi_podgc");
        let m = Metrics {
            kubelet_probes: Family::default(),
            force_deletions: Family::default(),
            skipped_pods: Family::default(),
            volume_attachments_deleted: Counter::default(),
            quarantines: Counter::default(),
            quarantines_lifted: Counter::default(),
            quarantined_nodes: Gauge::default(),
            unhealthy_nodes: Gauge::default(),
            disruption_mode: Gauge::default(),
            leader: Gauge::default(),
            passes: Counter::default(),
            pass_duration_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            registry: Registry::default(),
        };
        registry.register(
            "force_deletions",
            "Pods force-deleted from shut-down nodes, by reason",
            m.force_deletions.clone(),
        );
        registry.register(
            "skipped_pods",
            "Terminating pods on shut-down nodes left alone, by reason",
            m.skipped_pods.clone(),
        );
        registry.register(
            "volume_attachments_deleted",
            "VolumeAttachments deleted so the attacher detaches with a fence",
            m.volume_attachments_deleted.clone(),
        );
        registry.register("quarantines", "Nodes quarantined", m.quarantines.clone());
        registry.register(
            "quarantines_lifted",
            "Quarantines lifted",
            m.quarantines_lifted.clone(),
        );
        registry.register(
            "quarantined_nodes",
            "Nodes carrying the quarantine taint",
            m.quarantined_nodes.clone(),
        );
        registry.register(
            "unhealthy_nodes",
            "Nodes counted NotReady in the last pass",
            m.unhealthy_nodes.clone(),
        );
        registry.register(
            "disruption_mode",
            "1 while too many nodes are NotReady and podgc does nothing",
            m.disruption_mode.clone(),
        );
        registry.register(
            "leader",
            "1 while this instance is the leader",
            m.leader.clone(),
        );
        registry.register("passes", "Reconcile passes run", m.passes.clone());
        registry.register(
            "kubelet_probes",
            "Probes of the kubelets of nodes whose heartbeat stopped, by whether it answered",
            m.kubelet_probes.clone(),
        );
        registry.register(
            "pass_duration_seconds",
            "Duration of a reconcile pass",
            m.pass_duration_seconds.clone(),
        );
        Metrics { registry, ..m }
    }

    pub fn force_deleted(&self, reason: &str) {
        self.force_deletions
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn skipped(&self, reason: &str) {
        self.skipped_pods
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn force_deleted_count(&self, reason: &str) -> u64 {
        self.force_deletions
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .get()
    }

    /// OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        out
    }
}
