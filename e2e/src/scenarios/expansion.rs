//! Expansion through the real external-resizer: a claim of the shipped `fencecsi-xfs`
//! class, mounted by a pod, grown by patching the claim; the pod sees the larger
//! filesystem. (xfs: growing a mounted ext4 needs CAP_SYS_RESOURCE, which some machines'
//! root lacks, and the driver then refuses cleanly.)

use std::time::Duration;

use anyhow::{Context, Result};

use super::writer::{self, NAMESPACE};
use crate::cluster::Cluster;
use crate::kubectl::wait_pod_ready;
use crate::{say, wait};

const NAME: &str = "grow";

fn manifest() -> String {
    let pvc = serde_json::json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {"storageClassName": "fencecsi-xfs", "accessModes": ["ReadWriteOnce"],
                 "resources": {"requests": {"storage": "300Mi"}}}
    });
    let pod = writer::claim_pod(NAME);
    let ns = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}});
    serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [ns, pvc, pod]}).to_string()
}

/// The size in bytes of the filesystem the pod sees at /data.
fn fs_bytes(c: &Cluster) -> Result<u64> {
    let out = c.kubectl.run(&[
        "exec",
        "-n",
        NAMESPACE,
        NAME,
        "--",
        "df",
        "-B1",
        "--output=size",
        "/data",
    ])?;
    out.lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .with_context(|| format!("parsing df: {out}"))
}

pub fn claim_grows_online(c: &Cluster) -> Result<()> {
    c.kubectl.apply_text(&manifest())?;
    wait_pod_ready(
        &c.kubectl,
        NAMESPACE,
        NAME,
        "the expansion pod Ready",
        Duration::from_secs(180),
    )?;
    let before = fs_bytes(c)?;
    say(format!(
        "expansion: xfs claim mounted, {before} bytes; growing 300Mi -> 400Mi"
    ));
    c.kubectl.run(&[
        "patch",
        "pvc",
        "-n",
        NAMESPACE,
        NAME,
        "--type",
        "merge",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"400Mi"}}}}"#,
    ])?;
    let after = wait::until_explained(
        "the claim to show 400Mi and the pod a larger filesystem",
        Duration::from_secs(180),
        Duration::from_secs(1),
        || {
            let pvc = c.kubectl.get(&["pvc", "-n", NAMESPACE, NAME])?;
            let cap = pvc["status"]["capacity"]["storage"]
                .as_str()
                .unwrap_or("")
                .to_string();
            let size = fs_bytes(c)?;
            Ok(if cap == "400Mi" && size > before {
                Ok(size)
            } else {
                Err(format!(
                    "capacity {cap:?}, filesystem {size} bytes, conditions {}",
                    pvc["status"]["conditions"]
                ))
            })
        },
    )?;
    say(format!(
        "expansion: the pod sees {after} bytes (was {before})"
    ));
    for kind in ["pod", "pvc"] {
        c.kubectl.run(&[
            "delete",
            kind,
            "-n",
            NAMESPACE,
            NAME,
            "--wait=true",
            "--timeout=120s",
        ])?;
    }
    Ok(())
}
