//! The workload: a StatefulSet of one pod (in the fencecsi image, whose shell and
//! coreutils suffice) appending numbered 9-byte records to its volume, each fsync'ed by
//! `dd conv=fsync`, and printing `ack N <unix nanos>` only after that fsync returned, or
//! `fail N <unix nanos>` when the write or the fsync failed. A new pod resumes after the
//! last whole record in the file.
//!
//! Acknowledgements are read from the node's own pod log files (the kubelet's CRI log
//! format), so they are readable while the node is cut off.
//!
//! There are two such StatefulSets ([`Writer::FIRST`], [`Writer::SECOND`]): the second is
//! the workload on another node that fails while the controller itself fails over.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::cluster::Cluster;
use crate::kubectl::pod_ready;
use crate::wait;

pub const NAMESPACE: &str = "fencecsi-e2e";

/// One writer StatefulSet: its name, and the name of its one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Writer {
    pub name: &'static str,
    pub pod: &'static str,
}

impl Writer {
    pub const FIRST: Writer = Writer {
        name: "writer",
        pod: "writer-0",
    };
    pub const SECOND: Writer = Writer {
        name: "writer-b",
        pod: "writer-b-0",
    };

    /// The claim its pod's volume is bound through (from the claim template `data`).
    pub fn claim(self) -> String {
        format!("data-{}", self.pod)
    }
}

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

/// The namespace, and `w`'s StatefulSet with its claim template on `storage_class`. Kept
/// off the nodes `avoid` (the controller's, so that cutting the writer's node leaves the
/// controller alone) and preferring `prefer`.
pub fn manifest(w: Writer, storage_class: &str, avoid: &[&str], prefer: &str) -> String {
    let name = w.name;
    let sts = serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "affinity": {"nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": avoid}]}
                        ]},
                        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference":
                            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [prefer]}]}
                        }]
                    }},
                    "containers": [{
                        "name": name,
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

/// `w`'s log file on `node_log_dir` for the pod with `uid` (the kubelet names the dir
/// `<namespace>_<pod>_<uid>`), concatenated over container restarts.
pub fn events(w: Writer, node_log_dir: &Path, uid: &str) -> Result<Vec<Event>> {
    let dir = node_log_dir
        .join("pods")
        .join(format!("{NAMESPACE}_{}_{uid}", w.pod))
        .join(w.name);
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

/// Waits until `w`'s pod is Ready and has acknowledged at least `min_acks` records.
pub fn wait_writing(
    c: &Cluster,
    w: Writer,
    min_acks: u64,
    limit: Duration,
) -> Result<(String, String)> {
    wait::until_explained(
        &format!("{} to be Ready and writing", w.pod),
        limit,
        Duration::from_secs(1),
        || {
            let Some(p) = pod(c, w)? else {
                return Ok(Err(format!("no pod {}", w.pod)));
            };
            let (uid, node, running, ready) = pod_place(&p);
            if !(running && ready) {
                return Ok(Err(format!(
                    "{} on {node:?} running={running} ready={ready}",
                    w.pod
                )));
            }
            let n = c.node(&node)?;
            let acks = events(w, &n.spec.log_dir(), &uid)
                .map(|e| last_ack(&e).unwrap_or(0))
                .unwrap_or(0);
            Ok(if acks >= min_acks {
                Ok((uid, node))
            } else {
                Err(format!("{acks} records acknowledged on {node}"))
            })
        },
    )
}

/// `w`'s pod as the API server has it, if any.
pub fn pod(c: &Cluster, w: Writer) -> Result<Option<Value>> {
    let pods = c.kubectl.items(&[
        "pods",
        "-n",
        NAMESPACE,
        "--field-selector",
        &format!("metadata.name={}", w.pod),
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

/// The records file as `w`'s running pod sees it: every whole record, in order.
pub fn records_in_volume(c: &Cluster, w: Writer) -> Result<Vec<u64>> {
    records_seen_by(c, w.pod, w.name)
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

/// The PersistentVolume's CSI volume handle of `w`'s claim.
pub fn volume_handle(c: &Cluster, w: Writer) -> Result<String> {
    let pvc = c.kubectl.get(&["pvc", "-n", NAMESPACE, &w.claim()])?;
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
