//! A snapshot of the writer's volume while it is in use, restored to a new claim: the
//! upstream CRDs and snapshot-controller (installed from a directory named by
//! `FENCECSI_E2E_SNAPSHOT_MANIFESTS`: `crd/` and `snapshot-controller/`, as in
//! kubernetes-csi/external-snapshotter's client/config and deploy/kubernetes), the shipped
//! `deploy/snapshot` class, and the real csi-snapshotter. Every record acknowledged before
//! the snapshot was asked for is in the restored volume, as an unbroken run from 1.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use super::now_nanos;
use super::writer::{self, Event, Writer, NAMESPACE};
use crate::cluster::Cluster;
use crate::kubectl::{pod_ready, wait_pod_ready};
use crate::{images, say, wait};

pub const MANIFESTS: &str = "FENCECSI_E2E_SNAPSHOT_MANIFESTS";
const SNAPSHOT: &str = "writer-snap";
const RESTORED: &str = "restored";

/// Installs the CRDs and snapshot-controller, running the controller image found among
/// the archives (the upstream manifest may name an older tag than the release).
pub fn install(c: &Cluster, manifests: &Path) -> Result<()> {
    c.kubectl
        .run(&["apply", "-k", &manifests.join("crd").display().to_string()])?;
    c.kubectl.run(&[
        "wait",
        "--for=condition=established",
        "--timeout=60s",
        "crd/volumesnapshots.snapshot.storage.k8s.io",
        "crd/volumesnapshotcontents.snapshot.storage.k8s.io",
        "crd/volumesnapshotclasses.snapshot.storage.k8s.io",
    ])?;
    let ours = images::archives_in(&c.inputs.images_dir)?
        .into_iter()
        .flat_map(|a| a.refs)
        .find(|r| r.contains("/snapshot-controller:"))
        .context("no snapshot-controller image among the archives")?;
    let rendered = c.kubectl.run(&[
        "kustomize",
        &manifests.join("snapshot-controller").display().to_string(),
    ])?;
    let rendered: String = rendered
        .lines()
        .map(|l| match l.trim_start().strip_prefix("image: ") {
            Some(r) if r.contains("/snapshot-controller:") => l.replace(r, &ours),
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    c.kubectl.apply_text(&rendered)?;
    c.kubectl.run(&[
        "apply",
        "-k",
        &c.inputs.repo.join("deploy/snapshot").display().to_string(),
    ])?;
    wait::until_explained(
        "a snapshot-controller pod Ready",
        Duration::from_secs(180),
        Duration::from_secs(2),
        || {
            let pods = c.kubectl.items(&[
                "pods",
                "-n",
                "kube-system",
                "-l",
                "app.kubernetes.io/name=snapshot-controller",
            ])?;
            Ok(if pods.iter().any(pod_ready) {
                Ok(())
            } else {
                Err(format!("{} pods, none Ready", pods.len()))
            })
        },
    )?;
    say(format!(
        "snapshot: CRDs, snapshot-controller ({ours}) and deploy/snapshot installed"
    ));
    Ok(())
}

fn restore_manifest() -> String {
    let pvc = serde_json::json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": RESTORED, "namespace": NAMESPACE},
        "spec": {
            "storageClassName": "fencecsi-ext4", "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "64Mi"}},
            "dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": SNAPSHOT}
        }
    });
    let pod = writer::claim_pod(RESTORED);
    serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [pvc, pod]}).to_string()
}

/// Snapshots the writer's claim while it writes, restores it, and checks the records.
pub fn restores_what_was_acknowledged(c: &Cluster) -> Result<()> {
    let p = writer::pod(c, Writer::FIRST)?.context("no writer")?;
    let (uid, node, _, _) = writer::pod_place(&p);
    let asked = now_nanos();
    take_snapshot(c)?;
    let restored = restored_records(c)?;
    let events = writer::events(Writer::FIRST, &c.node(&node)?.spec.log_dir(), &uid)?;
    let acked_before: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::Ack { n, at_nanos } if *at_nanos < asked => Some(*n),
            _ => None,
        })
        .collect();
    let missing: Vec<u64> = acked_before
        .iter()
        .filter(|n| !restored.contains(n))
        .copied()
        .collect();
    ensure!(
        missing.is_empty(),
        "records acknowledged before the snapshot are missing from it: {missing:?}"
    );
    let first = restored.first().copied().unwrap_or(0);
    if !restored.iter().zip(first..).all(|(r, want)| *r == want) {
        bail!("the restored records are not an unbroken run: {restored:?}");
    }
    say(format!(
        "snapshot: restored claim holds {} records, every one of the {} acknowledged before the snapshot",
        restored.len(),
        acked_before.len()
    ));
    for what in [
        ["pod", RESTORED],
        ["pvc", RESTORED],
        ["volumesnapshot", SNAPSHOT],
    ] {
        c.kubectl.run(&[
            "delete",
            what[0],
            "-n",
            NAMESPACE,
            what[1],
            "--wait=true",
            "--timeout=120s",
        ])?;
    }
    Ok(())
}

/// A VolumeSnapshot of the writer's claim, waited for until readyToUse.
fn take_snapshot(c: &Cluster) -> Result<()> {
    let snap = serde_json::json!({
        "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
        "metadata": {"name": SNAPSHOT, "namespace": NAMESPACE},
        "spec": {"volumeSnapshotClassName": "fencecsi",
                 "source": {"persistentVolumeClaimName": Writer::FIRST.claim()}}
    });
    c.kubectl.apply_text(&snap.to_string())?;
    wait::until_explained(
        "the snapshot readyToUse",
        Duration::from_secs(120),
        Duration::from_secs(1),
        || {
            let s = c
                .kubectl
                .get(&["volumesnapshot", "-n", NAMESPACE, SNAPSHOT])?;
            Ok(if s["status"]["readyToUse"] == true {
                Ok(())
            } else {
                Err(format!("status {}", s["status"]))
            })
        },
    )?;
    say("snapshot: the writer's volume, in use, snapshotted");
    Ok(())
}

/// Restores the snapshot to a new claim, mounts it in a pod and reads its records.
fn restored_records(c: &Cluster) -> Result<Vec<u64>> {
    c.kubectl.apply_text(&restore_manifest())?;
    wait_pod_ready(
        &c.kubectl,
        NAMESPACE,
        RESTORED,
        "the restored claim's pod Ready",
        Duration::from_secs(180),
    )?;
    writer::records_seen_by(c, RESTORED, RESTORED)
}
