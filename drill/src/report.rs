//! The drill's result: timeline, figures, comparison with plain Kubernetes.

use serde::Serialize;

use crate::Progress;

/// Timeline steps, in the order they must happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    WritersAcked,
    NodeDown,
    NotReady,
    Quarantined,
    ForceDeleted,
    AttachmentDeleted,
    Fenced,
    PodRecreated,
    AttachedOnB,
    PublishedOnB,
    RecordsVerified,
    NodeBack,
    NodeCleaned,
    QuarantineLifted,
}

impl Step {
    pub fn describe(self) -> &'static str {
        match self {
            Step::WritersAcked => "every writer on node A acknowledged records",
            Step::NodeDown => {
                "node A shut down (heartbeat + kubelet stopped; writers keep writing)"
            }
            Step::NotReady => "node A NotReady (node lifecycle)",
            Step::Quarantined => "node A quarantined (podgc taint)",
            Step::ForceDeleted => "pod(s) force-deleted with DisruptionTarget (podgc)",
            Step::AttachmentDeleted => "VolumeAttachment(s) on A deleted",
            Step::Fenced => "detached with fence (attacher: Fenced event)",
            Step::PodRecreated => "pod(s) re-created on B (new UID)",
            Step::AttachedOnB => "VolumeAttachment(s) on B attached",
            Step::PublishedOnB => "volume(s) staged + published on B",
            Step::RecordsVerified => "records acknowledged on A verified on B",
            Step::NodeBack => "node A back (writers killed as by a reboot)",
            Step::NodeCleaned => "node A's plugin released fenced volumes, reported clean",
            Step::QuarantineLifted => "quarantine lifted (podgc)",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TimelineEntry {
    pub step: Step,
    /// Seconds since the drill started.
    pub t: f64,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct VolumeResult {
    pub pod: String,
    pub pv: String,
    pub volume_id: String,
    pub old_uid: String,
    pub new_uid: String,
    pub new_node: String,
    pub old_generation: u64,
    pub new_generation: u64,
    /// Last record the writer on A acknowledged (-1: none).
    pub acked_on_a: i64,
    /// Records 0..=acked_on_a missing or damaged on B.
    pub lost: Vec<u64>,
    /// Writes the writer on A attempted after the fence and saw fail.
    pub failed_writes_on_a: u64,
    pub fenced_generation_immutable: bool,
    pub bytes_after_fence: u64,
    /// Records the writer on B acknowledged.
    pub acked_on_b: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// 40 s node-monitor grace + 300 s NoExecute toleration + 360 s forced detach.
    pub kubernetes_deployment_s: f64,
    /// StatefulSet pods: never without a human.
    pub kubernetes_statefulset: &'static str,
    /// fencecsi in this drill, from node shutdown (the drill's short graces).
    pub fencecsi_measured_from_shutdown_s: f64,
    /// Mechanics: from podgc's quarantine to the volume published on B.
    pub fencecsi_mechanics_s: f64,
    /// Worst case with production defaults: podgc's node lease grace (15 s: a dead node's
    /// Lease goes stale 5-15 s after power-off, as the kubelet renews every 10 s) + the
    /// mechanics. `--production` measures it.
    pub fencecsi_projected_production_s: f64,
    /// kubernetes_deployment_s / fencecsi_projected_production_s.
    pub ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub ok: bool,
    pub failures: Vec<String>,
    pub nodes: usize,
    pub volumes: usize,
    pub fs: String,
    pub timeline: Vec<TimelineEntry>,
    /// NotReady → the last volume published on B.
    pub failover_s: Option<f64>,
    /// Node A's shutdown (its kubelet and heartbeat stop) → the last volume published on
    /// B: what a user waits.
    pub power_off_to_published_s: Option<f64>,
    pub records_lost: u64,
    pub bytes_after_fence: u64,
    pub quarantine_lifted: bool,
    pub per_volume: Vec<VolumeResult>,
    pub comparison: Option<Comparison>,
    pub unsafe_pod: Option<UnsafePodResult>,
    /// Times a pod waited because the attach-detach controller still saw its volume on
    /// another node ("Multi-Attach error"), and how many of those waits were still open
    /// when the failover ended.
    pub multi_attach_errors: usize,
    pub env_dir: String,
    pub leftover_mounts: usize,
    pub leftover_loop_devices: usize,
    pub writers_left: usize,
    pub duration_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct UnsafePodResult {
    /// The pod is still there and was never evicted (no deletion started).
    pub untouched: bool,
    /// Its VolumeAttachment on node A is still there.
    pub attachment_kept: bool,
    /// Node A never got the out-of-service taint.
    pub no_out_of_service_taint: bool,
    /// podgc's `OutOfServiceTaintWithheld` Warning on node A.
    pub warning_event: Option<String>,
}

impl Report {
    pub fn time_of(&self, s: Step) -> Option<f64> {
        self.timeline.iter().find(|e| e.step == s).map(|e| e.t)
    }

    pub fn print(&self, p: &Progress) {
        self.print_timeline(p);
        self.print_figures(p);
        self.print_comparison(p);
        p.raw("");
        p.raw(format!(
            "Cleanup: {} mount(s), {} loop device(s), {} writer(s) left; env {}",
            self.leftover_mounts, self.leftover_loop_devices, self.writers_left, self.env_dir
        ));
        if self.ok {
            p.raw(format!("RESULT: PASS ({:.1} s)", self.duration_s));
        } else {
            p.raw(format!("RESULT: FAIL: {}", self.failures.join("; ")));
        }
    }

    fn print_timeline(&self, p: &Progress) {
        p.raw("");
        p.raw("Timeline (seconds since start; Δ from NotReady)");
        p.raw(format!(
            "  {:<20} {:>9} {:>9}  {}",
            "step", "t", "Δ", "what"
        ));
        let nr = self.time_of(Step::NotReady);
        for e in &self.timeline {
            let d = nr
                .map(|n| format!("{:+9.3}", e.t - n))
                .unwrap_or_else(|| format!("{:>9}", "-"));
            p.raw(format!(
                "  {:<20} {:>9.3} {}  {}",
                serde_json::to_value(e.step).unwrap().as_str().unwrap_or(""),
                e.t,
                d,
                e.step.describe()
            ));
        }
    }

    fn print_figures(&self, p: &Progress) {
        p.raw("");
        p.raw(format!(
            "Figures ({} node(s), {} volume(s), {})",
            self.nodes, self.volumes, self.fs
        ));
        match self.failover_s {
            Some(f) => p.raw(format!(
                "  failover (NotReady → volume published on B): {f:.3} s"
            )),
            None if self.power_off_to_published_s.is_some() => p.raw(
                "  failover (NotReady → volume published on B): done before the node turned NotReady (podgc acted on its Lease)",
            ),
            None => p.raw("  failover: did not complete"),
        }
        if let Some(f) = self.power_off_to_published_s {
            p.raw(format!(
                "  node A shut down → volume published on B: {f:.3} s"
            ));
        }
        for v in &self.per_volume {
            p.raw(format!(
                "  {} ({}): acked on A ≤ #{}, lost {}, failed writes on A after fence {}, generation {} → {}, fenced gen immutable {}, bytes after fence {}, acked on B ≤ #{}",
                v.pod, v.volume_id, v.acked_on_a, v.lost.len(), v.failed_writes_on_a,
                v.old_generation, v.new_generation, v.fenced_generation_immutable,
                v.bytes_after_fence, v.acked_on_b
            ));
        }
        p.raw(format!("  records lost: {} (must be 0)", self.records_lost));
        p.raw(format!(
            "  bytes that reached the fenced generation after the fence: {} (must be 0)",
            self.bytes_after_fence
        ));
        p.raw(format!("  quarantine lifted: {}", self.quarantine_lifted));
        p.raw(format!(
            "  Multi-Attach waits (the attach-detach controller still saw a volume on node A): {}",
            self.multi_attach_errors
        ));
        if let Some(u) = &self.unsafe_pod {
            p.raw(format!(
                "  pod of a driver without safe-detach: untouched {}, attachment kept {}, no out-of-service taint {}, Warning: {}",
                u.untouched,
                u.attachment_kept,
                u.no_out_of_service_taint,
                u.warning_event.as_deref().unwrap_or("none")
            ));
        }
    }

    fn print_comparison(&self, p: &Progress) {
        if let Some(c) = &self.comparison {
            p.raw("");
            p.raw("Compared with plain Kubernetes (same timeline: from the node's shutdown)");
            p.raw(format!(
                "  Kubernetes, Deployment pods: 40 s monitor grace + 300 s NoExecute toleration + 360 s forced detach = {:.0} s",
                c.kubernetes_deployment_s
            ));
            p.raw(format!(
                "  Kubernetes, StatefulSet pods: {}",
                c.kubernetes_statefulset
            ));
            p.raw(format!(
                "  fencecsi, measured in this run: {:.1} s from shutdown; mechanics quarantine → published {:.2} s",
                c.fencecsi_measured_from_shutdown_s, c.fencecsi_mechanics_s
            ));
            p.raw(format!(
                "  fencecsi, projected with production defaults (worst case): {:.0} s node lease grace + {:.2} s = {:.1} s  ({:.1}x faster; --production measures it)",
                c.fencecsi_projected_production_s - c.fencecsi_mechanics_s,
                c.fencecsi_mechanics_s,
                c.fencecsi_projected_production_s,
                c.ratio
            ));
        }
    }
}
