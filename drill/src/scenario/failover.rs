//! The failover's phases on the running set-up: the writers on node A, node A shutting
//! down, the checks on node B, the pod of the driver without safe detach, node A's return.

use std::sync::atomic::Ordering;

use anyhow::anyhow;
use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, Pod};
use fencecsi_cluster::k8s_openapi::api::events::v1::Event;
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::well_known::*;
use fencecsi_cluster::{Cluster, ListParams};
use fencecsi_tests::records;

use super::observer::{mark, wait_step, Shared, VolObs};
use super::setup::Rig;
use super::wait_until;
use crate::kubelet::Board;
use crate::report::{Step, UnsafePodResult};
use crate::{Options, NAMESPACE};

/// Waits until every writer on node A has acknowledged `min_records`, then hands the
/// observer its volumes (pod, PV, handle, UID, generation, A's VolumeAttachment).
pub(super) async fn writers_on_a(
    cluster: &Cluster,
    opts: &Options,
    board: &Board,
    shared: &Shared,
    node_a: &str,
) -> anyhow::Result<()> {
    let p = &opts.progress;
    let pods = cluster.api::<Pod>(Some(NAMESPACE));
    let min = opts.min_records as i64;
    wait_until(
        "every writer on node A acknowledging records",
        opts.step_timeout,
        || async {
            let pb = board.published.lock().unwrap().clone();
            Ok(
                pb.len() >= opts.volumes
                    && pb.iter().all(|x| x.acked.load(Ordering::SeqCst) >= min),
            )
        },
    )
    .await?;
    let mut vols = Vec::new();
    for i in 0..opts.volumes {
        let name = format!("writer-{i}");
        let pod = pods.get(&name).await?;
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let pubd = board
            .by_uid(&uid)
            .ok_or_else(|| anyhow!("{name} not published"))?;
        vols.push(VolObs {
            pod: name,
            pv: pubd.pv.clone(),
            handle: pubd.handle.clone(),
            old_uid: uid,
            old_generation: pubd.generation,
            va_a: volume_attachment_name(&pubd.handle, DRIVER_NAME, node_a),
            ..Default::default()
        });
    }
    {
        let mut o = shared.lock().unwrap();
        o.vols = vols.clone();
        let t = p.elapsed().as_secs_f64();
        mark(&mut o, Step::WritersAcked, t, p, "");
    }
    Ok(())
}

/// Node A shuts down: its heartbeat and its kubelet stop, its writers keep writing.
/// Marking NodeDown arms the observer.
pub(super) fn shut_down_a(rig: &Rig, opts: &Options, shared: &Shared) {
    let p = &opts.progress;
    rig.hbs[0].stop();
    rig.kubelets[0].stop();
    {
        let mut o = shared.lock().unwrap();
        let t = p.elapsed().as_secs_f64();
        mark(&mut o, Step::NodeDown, t, p, "");
    }
}

/// On node B: the records A acknowledged are there, and B's writers work.
pub(super) async fn verify_on_b(
    opts: &Options,
    board: &Board,
    shared: &Shared,
    vols: &[VolObs],
    failures: &mut Vec<String>,
) {
    let p = &opts.progress;
    let mut lost_now = 0;
    for v in vols {
        let a = board.by_uid(&v.old_uid).unwrap();
        let b = board.by_uid(v.new_uid.as_deref().unwrap()).unwrap();
        let acked = a.acked.load(Ordering::SeqCst);
        if acked >= 0 {
            lost_now += records::missing(&b.found, acked as u64).len();
        }
    }
    {
        let mut o = shared.lock().unwrap();
        let t = p.elapsed().as_secs_f64();
        mark(
            &mut o,
            Step::RecordsVerified,
            t,
            p,
            &format!(" ({lost_now} missing so far)"),
        );
    }
    // The writers on B work.
    let new_uids: Vec<String> = vols.iter().filter_map(|v| v.new_uid.clone()).collect();
    if let Err(e) = wait_until(
        "writers on B acknowledging records",
        opts.step_timeout,
        || async {
            Ok(new_uids.iter().all(|u| {
                board.by_uid(u).is_some_and(|b| {
                    b.acked.load(Ordering::SeqCst) >= b.resumed_at.load(Ordering::SeqCst) + 5
                })
            }))
        },
    )
    .await
    {
        failures.push(format!("{e:#}"));
    }
}

/// The pod of the driver without safe detach: with it on node A, podgc must not set the
/// out-of-service taint (it would make Kubernetes force-delete the pod and force-detach
/// its volume, unfenced), must say so in a Warning, and must leave the pod and its
/// attachment alone.
pub(super) async fn unsafe_pod(
    cluster: &Cluster,
    node_a: &str,
    opts: &Options,
) -> anyhow::Result<UnsafePodResult> {
    let p = &opts.progress;
    let other = cluster
        .api::<Pod>(Some(NAMESPACE))
        .get_opt("other-0")
        .await?;
    let attachment_kept = cluster
        .api::<VolumeAttachment>(None)
        .list_filtered(&ListParams::default(), |va| {
            va.spec.source.persistent_volume_name.as_deref() == Some("pv-other")
                && va.spec.node_name == node_a
                && va.metadata.deletion_timestamp.is_none()
        })
        .await?
        .len()
        == 1;
    let node = cluster.api::<Node>(None).get(node_a).await?;
    let no_out_of_service_taint = !node
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .iter()
        .any(|t| t.key == OUT_OF_SERVICE_TAINT_KEY);
    let ev = cluster
        .api::<Event>(None)
        .list_filtered(&ListParams::default(), |e| {
            e.reason.as_deref() == Some("OutOfServiceTaintWithheld")
                && e.type_.as_deref() == Some("Warning")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(node_a)
        })
        .await?;
    let r = UnsafePodResult {
        untouched: other.is_some_and(|o| o.metadata.deletion_timestamp.is_none()),
        attachment_kept,
        no_out_of_service_taint,
        warning_event: ev.first().and_then(|e| e.note.clone()),
    };
    p.say(format!(
        "pod other-0 (driver without safe-detach): untouched={}, attachment kept={}, no out-of-service taint={}, Warning: {}",
        r.untouched,
        r.attachment_kept,
        r.no_out_of_service_taint,
        r.warning_event.as_deref().unwrap_or("none")
    ));
    Ok(r)
}

/// Node A returns (its kubelet reboots, its heartbeat resumes) and podgc must lift the
/// quarantine once A's node plugin reports it clean.
pub(super) async fn bring_back_a(
    rig: &Rig,
    opts: &Options,
    shared: &Shared,
    failures: &mut Vec<String>,
) {
    let p = &opts.progress;
    rig.kubelets[0].reboot().await;
    rig.hbs[0].start();
    {
        let mut o = shared.lock().unwrap();
        let t = p.elapsed().as_secs_f64();
        mark(&mut o, Step::NodeBack, t, p, "");
    }
    let rec = rig.plugins[0].recovery.clone();
    let mut released_logged = false;
    let lifted = wait_step(shared, Step::QuarantineLifted, opts.step_timeout).await;
    if let Some(r) = rec.latest() {
        if r.clean {
            released_logged = true;
        }
    }
    if let Err(e) = lifted {
        failures.push(format!("{e:#}"));
    }
    let _ = released_logged;
}
