//! Prometheus metrics (`prometheus-client`), served on `/metrics` in the OpenMetrics text
//! format.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Operation kinds.
pub const ATTACH: &str = "attach";
pub const DETACH: &str = "detach";
/// Operation results.
pub const SUCCESS: &str = "success";
pub const ERROR: &str = "error";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    kind: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

fn duration_histogram() -> Histogram {
    // 1 ms .. ~33 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// The attacher's metrics. Cheap to share (`Arc`); every handle updates one registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    operations: Family<OpLabels, Counter>,
    durations: Family<KindLabels, Histogram, fn() -> Histogram>,
    fences: Family<ResultLabels, Counter>,
    queue_depth: Gauge,
    active: Gauge,
    plugin_returns: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("fencecsi_attacher");
        let operations = Family::<OpLabels, Counter>::default();
        let durations = Family::<KindLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            duration_histogram,
        );
        let fences = Family::<ResultLabels, Counter>::default();
        let queue_depth = Gauge::default();
        let active = Gauge::default();
        let plugin_returns = Counter::default();
        registry.register(
            "operations",
            "CSI attach (ControllerPublishVolume) and detach (ControllerUnpublishVolume) operations by result",
            operations.clone(),
        );
        registry.register(
            "operation_duration_seconds",
            "Duration of CSI attach and detach calls",
            durations.clone(),
        );
        registry.register(
            "fences",
            "Detaches sent with fence = true, by result",
            fences.clone(),
        );
        registry.register(
            "queue_depth",
            "VolumeAttachments waiting for a worker",
            queue_depth.clone(),
        );
        registry.register(
            "active",
            "1 while this instance is the active (leading) attacher",
            active.clone(),
        );
        registry.register(
            "plugin_return_retries",
            "VolumeAttachments retried at once when the plugin answered again, past the backoff they grew while it was away",
            plugin_returns.clone(),
        );
        Metrics {
            registry,
            operations,
            durations,
            fences,
            queue_depth,
            active,
            plugin_returns,
        }
    }

    pub(crate) fn operation(&self, kind: &'static str, ok: bool, took: Duration) {
        let result = if ok { SUCCESS } else { ERROR };
        self.operations
            .get_or_create(&OpLabels { kind, result })
            .inc();
        self.durations
            .get_or_create(&KindLabels { kind })
            .observe(took.as_secs_f64());
    }

    pub(crate) fn fence(&self, ok: bool) {
        let result = if ok { SUCCESS } else { ERROR };
        self.fences.get_or_create(&ResultLabels { result }).inc();
    }

    pub(crate) fn plugin_returned(&self, retried: usize) {
        self.plugin_returns.inc_by(retried as u64);
    }

    /// VolumeAttachments retried at once because the plugin answered again.
    pub fn plugin_return_retries(&self) -> u64 {
        self.plugin_returns.get()
    }

    pub(crate) fn queue_depth_gauge(&self) -> Gauge {
        self.queue_depth.clone()
    }

    pub(crate) fn set_active(&self, active: bool) {
        self.active.set(active as i64);
    }

    /// Operations of `kind` ([`ATTACH`] / [`DETACH`]) with `result` ([`SUCCESS`] / [`ERROR`]).
    pub fn operations(&self, kind: &'static str, result: &'static str) -> u64 {
        self.operations
            .get_or_create(&OpLabels { kind, result })
            .get()
    }

    /// Fenced detaches with `result`.
    pub fn fences(&self, result: &'static str) -> u64 {
        self.fences.get_or_create(&ResultLabels { result }).get()
    }

    pub fn queue_depth(&self) -> i64 {
        self.queue_depth.get()
    }

    /// The registry in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("encoding metrics into a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_named_metrics() {
        let m = Metrics::new();
        m.operation(ATTACH, true, Duration::from_millis(3));
        m.operation(DETACH, false, Duration::from_millis(3));
        m.fence(true);
        m.set_active(true);
        m.plugin_returned(2);
        let text = m.encode();
        for needle in [
            "fencecsi_attacher_operations_total{kind=\"attach\",result=\"success\"} 1",
            "fencecsi_attacher_operations_total{kind=\"detach\",result=\"error\"} 1",
            "fencecsi_attacher_operation_duration_seconds_bucket{le=",
            "fencecsi_attacher_fences_total{result=\"success\"} 1",
            "fencecsi_attacher_queue_depth 0",
            "fencecsi_attacher_active 1",
            "fencecsi_attacher_plugin_return_retries_total 2",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
        assert_eq!(m.operations(ATTACH, SUCCESS), 1);
        assert_eq!(m.fences(SUCCESS), 1);
    }
}
