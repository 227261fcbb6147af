//! The workload: a StatefulSet of one pod (in the fencecsi image, whose shell and
//! coreutils suffice) appending numbered 9-byte records to its volume, each fsync'ed by
//! `dd conv=fsync`, and printing `ack N <unix nanos>` only after that fsync returned, or
//! `fail N <unix nanos>` when the write or the fsync failed. A new pod resumes after the
//! last whole record in the file.
//!
//! Acknowledgements are read from the node's own pod log files (the kubelet's CRI log
//! format), so they are readable while the node is cut off.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::cluster::Cluster;
use crate::kubectl::pod_ready;

pub const NAMESPACE: &str = "fencecsi-e2e";
pub const NAME: &str = "writer";
pub const POD: &str = "writer-0";

const SCRIPT: &str = r#"f=/data/records
touch "$f"
# A record cut short by the failover would glue onto the next one: start on a new line.
if [ -s "$f" ] && [ -n "$(tail -c 1 "$f")" ]; then echo >> "$f"; fi
i=$(grep -E '^[0-9]{8}$' "$f" | tail -n 1)
i=$(expr "${i:-0}" + 0)
echo "start $(hostname) after $i"
while :; do
  i=$((i+1))
  if printf '%08d\n' "$i" | dd of="$f" oflag=append conv=notrunc,fsync status=none 2>/tmp/dd.err; then
    echo "ack $i $(date +%s%N)"
  else
    echo "fail $i $(date +%s%N) $(head -c 160 /tmp/dd.err | tr '\n' ' ')"
    i=$((i-1))
  fi
  sleep 0.2
done
"#;

/// The namespace, and the StatefulSet with its claim template on `storage_class`. Kept
/// off `avoid` (the controller's node, so that cutting the writer's node leaves the
/// controller alone) and preferring `prefer`.
pub fn manifest(storage_class: &str, avoid: &str, prefer: &str) -> String {
    let sts = serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "serviceName": NAME,
            "replicas": 1,
            "selector": {"matchLabels": {"app": NAME}},
            "template": {
                "metadata": {"labels": {"app": NAME}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "affinity": {"nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [avoid]}]}
                        ]},
                        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference":
                            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [prefer]}]}
                        }]
                    }},
                    "containers": [{
                        "name": NAME,
                        "image": "fencecsi:0.1.0",
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["sh", "-c", SCRIPT],
                        "securityContext": {"runAsUser": 0},
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}]
                    }]
                }
            },
            "volumeClaimTemplates": [{
                "metadata": {"name": "data"},
                "spec": {
                    "storageClassName": storage_class,
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "64Mi"}}
                }
            }]
        }
    });
    let ns = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}});
    // One JSON document: kubectl reads a stream starting with `{` as a single JSON object.
    serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [ns, sts]}).to_string()
}

/// One line the writer printed.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Ack { n: u64, at_nanos: i64 },
    Fail { n: u64, at_nanos: i64, why: String },
}

/// The writer's log file on `node_log_dir` for the pod with `uid` (the kubelet names the
/// dir `<namespace>_<pod>_<uid>`), concatenated over container restarts.
pub fn events(node_log_dir: &Path, uid: &str) -> Result<Vec<Event>> {
    let dir = node_log_dir
        .join("pods")
        .join(format!("{NAMESPACE}_{POD}_{uid}"))
        .join(NAME);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        for line in std::fs::read_to_string(&f)?.lines() {
            // CRI format: <time> <stream> <P|F> <text>
            let text = line.splitn(4, ' ').nth(3).unwrap_or("");
            if let Some(e) = parse_event(text) {
                out.push(e);
            }
        }
    }
    Ok(out)
}

fn parse_event(text: &str) -> Option<Event> {
    let mut it = text.splitn(4, ' ');
    let kind = it.next()?;
    let n = it.next()?.parse().ok()?;
    let at_nanos = it.next()?.parse().ok()?;
    match kind {
        "ack" => Some(Event::Ack { n, at_nanos }),
        "fail" => Some(Event::Fail {
            n,
            at_nanos,
            why: it.next().unwrap_or("").to_string(),
        }),
        _ => None,
    }
}

/// The highest acknowledged record.
pub fn last_ack(events: &[Event]) -> Option<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Ack { n, .. } => Some(*n),
            _ => None,
        })
        .max()
}

/// The writer pod as the API server has it, if any.
pub fn pod(c: &Cluster) -> Result<Option<Value>> {
    let pods = c.kubectl.items(&[
        "pods",
        "-n",
        NAMESPACE,
        "--field-selector",
        &format!("metadata.name={POD}"),
    ])?;
    Ok(pods.into_iter().next())
}

/// `(uid, node, running, ready)` of the writer pod.
pub fn pod_place(p: &Value) -> (String, String, bool, bool) {
    (
        p["metadata"]["uid"].as_str().unwrap_or("").to_string(),
        p["spec"]["nodeName"].as_str().unwrap_or("").to_string(),
        p["status"]["phase"] == "Running" && p["metadata"]["deletionTimestamp"].is_null(),
        pod_ready(p),
    )
}

/// A pod named `name` (its one container too) that mounts claim `name` at /data and
/// sleeps, as root (the volume's root directory is root's): for looking into a volume.
pub fn claim_pod(name: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": name, "image": "fencecsi:0.1.0", "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "infinity"], "securityContext": {"runAsUser": 0},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}]
            }],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": name}}]
        }
    })
}

/// The records file as the running writer pod sees it: every whole record, in order.
pub fn records_in_volume(c: &Cluster) -> Result<Vec<u64>> {
    records_seen_by(c, POD, NAME)
}

/// The records file as container `container` of pod `pod` sees it at /data/records.
pub fn records_seen_by(c: &Cluster, pod: &str, container: &str) -> Result<Vec<u64>> {
    let out = c.kubectl.run(&[
        "exec",
        "-n",
        NAMESPACE,
        pod,
        "-c",
        container,
        "--",
        "cat",
        "/data/records",
    ])?;
    Ok(out
        .lines()
        .filter(|l| l.len() == 8 && l.bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|l| l.parse().ok())
        .collect())
}

/// Every acknowledged record of `acked` is in `present`; returns the missing ones.
pub fn missing_acks(acked: &[Event], present: &[u64]) -> Vec<u64> {
    let have: std::collections::BTreeSet<u64> = present.iter().copied().collect();
    acked
        .iter()
        .filter_map(|e| match e {
            Event::Ack { n, .. } if !have.contains(n) => Some(*n),
            _ => None,
        })
        .collect()
}

/// The PersistentVolume's CSI volume handle of the writer's claim.
pub fn volume_handle(c: &Cluster) -> Result<String> {
    let pvc = c
        .kubectl
        .get(&["pvc", "-n", NAMESPACE, &format!("data-{POD}")])?;
    let pv = pvc["spec"]["volumeName"]
        .as_str()
        .context("claim not bound")?;
    let pv = c.kubectl.get(&["pv", pv])?;
    match pv["spec"]["csi"]["volumeHandle"].as_str() {
        Some(h) => Ok(h.to_string()),
        None => bail!("PV {pv} has no CSI volume handle"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_acks_and_failures() {
        assert_eq!(
            parse_event("ack 12 1700000000123456789"),
            Some(Event::Ack {
                n: 12,
                at_nanos: 1_700_000_000_123_456_789
            })
        );
        assert!(matches!(
            parse_event("fail 13 1 dd: error writing"),
            Some(Event::Fail { n: 13, .. })
        ));
        assert_eq!(parse_event("start e2e-node-1 after 0"), None);
    }

    #[test]
    fn missing_acks_names_only_acknowledged_records() {
        let ev = vec![
            Event::Ack { n: 1, at_nanos: 0 },
            Event::Ack { n: 2, at_nanos: 0 },
            Event::Fail {
                n: 3,
                at_nanos: 0,
                why: String::new(),
            },
        ];
        assert_eq!(missing_acks(&ev, &[1]), vec![2]);
        assert!(missing_acks(&ev, &[1, 2]).is_empty());
    }
}
