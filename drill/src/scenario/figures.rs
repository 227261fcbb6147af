//! The figures of a run: per volume (records lost, bytes after the fence, generations,
//! UIDs) and overall (timeline, failover time, the comparison with plain Kubernetes),
//! gathered into the [`Report`]; a loss or a byte after the fence is a failure.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use fencecsi_tests::records;

use super::observer::{Obs, Shared};
use crate::kubelet::Board;
use crate::report::{Comparison, Report, Step, TimelineEntry, UnsafePodResult, VolumeResult};
use crate::Options;

/// Per-volume results, once node A is back. `fenced_diff` holds the bytes that differ
/// between each pod's fenced generation and its copy.
pub(super) fn volume_results(
    board: &Board,
    shared: &Shared,
    fenced_diff: &HashMap<String, u64>,
    failures: &mut Vec<String>,
) -> Vec<VolumeResult> {
    let mut per_volume: Vec<VolumeResult> = vec![];
    let vols = shared.lock().unwrap().vols.clone();
    for v in &vols {
        let a = board.by_uid(&v.old_uid).unwrap();
        let b = board.by_uid(v.new_uid.as_deref().unwrap()).unwrap();
        let acked = a.acked.load(Ordering::SeqCst);
        let lost = if acked >= 0 {
            records::missing(&b.found, acked as u64)
        } else {
            vec![]
        };
        if !v.deleted_with_condition {
            failures.push(format!(
                "{}: not force-deleted, or deleted without the DisruptionTarget condition and the Failed phase",
                v.pod
            ));
        }
        per_volume.push(VolumeResult {
            pod: v.pod.clone(),
            pv: v.pv.clone(),
            volume_id: v.handle.clone(),
            old_uid: v.old_uid.clone(),
            new_uid: b.uid.clone(),
            new_node: b.node.clone(),
            old_generation: v.old_generation,
            new_generation: b.generation,
            acked_on_a: acked,
            lost,
            failed_writes_on_a: a.errors.load(Ordering::SeqCst),
            fenced_generation_immutable: v.fenced_immutable,
            bytes_after_fence: fenced_diff.get(&v.pod).copied().unwrap_or(0),
            acked_on_b: b.acked.load(Ordering::SeqCst),
        });
    }
    per_volume
}

/// The scenario's report. What only [`super::run`] knows after the Env guard's cleanup
/// (leftovers, env dir, duration) is left empty here.
pub(super) fn report(
    opts: &Options,
    o: &Obs,
    per_volume: Vec<VolumeResult>,
    unsafe_pod: Option<UnsafePodResult>,
    mut failures: Vec<String>,
) -> Report {
    let timeline: Vec<TimelineEntry> = o
        .steps
        .iter()
        .map(|(s, t)| TimelineEntry { step: *s, t: *t })
        .collect();
    let mut sorted = timeline.clone();
    sorted.sort_by(|a, b| a.t.total_cmp(&b.t));
    let records_lost: u64 = per_volume.iter().map(|v| v.lost.len() as u64).sum();
    let bytes_after_fence: u64 = per_volume.iter().map(|v| v.bytes_after_fence).sum();
    if records_lost > 0 {
        failures.push(format!("{records_lost} acknowledged record(s) lost"));
    }
    if bytes_after_fence > 0 {
        failures.push(format!(
            "{bytes_after_fence} byte(s) reached the fenced generation after the fence"
        ));
    }
    let get = |s: Step| o.steps.get(&s).copied();
    let failover_s = match (get(Step::NotReady), get(Step::PublishedOnB)) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let power_off_to_published_s = match (get(Step::NodeDown), get(Step::PublishedOnB)) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let comparison = match (
        get(Step::NodeDown),
        get(Step::Quarantined),
        get(Step::PublishedOnB),
    ) {
        (Some(down), Some(q), Some(pb)) => {
            let k8s = 40.0 + 300.0 + 360.0;
            let mech = pb - q;
            let lease_grace = fencecsi_podgc::PodGcConfig::default()
                .node_lease_grace
                .unwrap_or_default()
                .as_secs_f64();
            let proj = lease_grace + mech;
            Some(Comparison {
                kubernetes_deployment_s: k8s,
                kubernetes_statefulset: "never, without a human (pods stay Terminating)",
                fencecsi_measured_from_shutdown_s: pb - down,
                fencecsi_mechanics_s: mech,
                fencecsi_projected_production_s: proj,
                ratio: k8s / proj,
            })
        }
        _ => None,
    };
    Report {
        ok: failures.is_empty(),
        failures,
        nodes: opts.nodes,
        volumes: opts.volumes,
        fs: opts.fs.clone(),
        timeline: sorted,
        failover_s,
        power_off_to_published_s,
        records_lost,
        bytes_after_fence,
        quarantine_lifted: o.steps.contains_key(&Step::QuarantineLifted),
        per_volume,
        comparison,
        unsafe_pod,
        multi_attach_errors: 0,
        env_dir: String::new(),
        leftover_mounts: 0,
        leftover_loop_devices: 0,
        writers_left: 0,
        duration_s: 0.0,
    }
}
