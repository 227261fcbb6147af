//! Install: after `kubectl apply -k deploy/base`, every fencecsi pod is Ready, every node's
//! CSINode lists the driver, and the controller's leader Leases are taken.

use std::time::Duration;

use anyhow::Result;

use crate::cluster::Cluster;
use crate::kubectl::pod_ready;
use crate::{say, wait};

pub const NAMESPACE: &str = "fencecsi";
pub const DRIVER: &str = "loop.fencecsi.io";

/// The controller Deployment's replicas, as deploy/base sets them.
fn controller_replicas(c: &Cluster) -> Result<usize> {
    let d = c
        .kubectl
        .get(&["deployment", "-n", NAMESPACE, "fencecsi-controller"])?;
    Ok(d["spec"]["replicas"].as_u64().unwrap_or(1) as usize)
}

/// Waits (bounded) until the shipped deployment is up on every node.
pub fn wait_installed(c: &Cluster) -> Result<()> {
    let nodes = c.nodes.len();
    let replicas = controller_replicas(c)?;
    wait::until_explained(
        "every fencecsi pod Ready (the controller replicas, one node pod per node)",
        Duration::from_secs(240),
        Duration::from_secs(2),
        || {
            let pods = c.kubectl.items(&["pods", "-n", NAMESPACE])?;
            let ready = |component: &str| {
                pods.iter()
                    .filter(|p| {
                        p["metadata"]["labels"]["app.kubernetes.io/component"] == component
                            && pod_ready(p)
                    })
                    .count()
            };
            let (ctl, node) = (ready("controller"), ready("node"));
            Ok(if ctl == replicas && node == nodes {
                Ok(())
            } else {
                Err(format!(
                    "{ctl}/{replicas} controller and {node}/{nodes} node pods Ready; {}",
                    pod_summary(&pods)
                ))
            })
        },
    )?;
    say("install: every fencecsi pod is Ready");
    wait::until_explained(
        "every CSINode to list loop.fencecsi.io",
        Duration::from_secs(60),
        Duration::from_secs(1),
        || {
            let csinodes = c.kubectl.items(&["csinodes"])?;
            let with: Vec<String> = csinodes
                .iter()
                .filter(|n| {
                    n["spec"]["drivers"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|d| d["name"] == DRIVER)
                })
                .filter_map(|n| n["metadata"]["name"].as_str().map(String::from))
                .collect();
            Ok(if with.len() == nodes {
                Ok(())
            } else {
                Err(format!("CSINodes listing the driver: {with:?}"))
            })
        },
    )?;
    say("install: every CSINode lists loop.fencecsi.io");
    Ok(())
}

/// `name phase ready node` of each pod, for messages.
pub fn pod_summary(pods: &[serde_json::Value]) -> String {
    pods.iter()
        .map(|p| {
            format!(
                "{} {} ready={} on {}",
                p["metadata"]["name"].as_str().unwrap_or("?"),
                p["status"]["phase"].as_str().unwrap_or("?"),
                pod_ready(p),
                p["spec"]["nodeName"].as_str().unwrap_or("-")
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The controller Deployment's pods.
fn controller_pods(c: &Cluster) -> Result<Vec<serde_json::Value>> {
    c.kubectl.items(&[
        "pods",
        "-n",
        NAMESPACE,
        "-l",
        "app.kubernetes.io/component=controller",
    ])
}

/// The controller pods that are not being deleted, by name, with their nodes.
pub fn controller_pods_placed(c: &Cluster) -> Result<Vec<(String, String)>> {
    Ok(controller_pods(c)?
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|p| {
            Some((
                p["metadata"]["name"].as_str()?.to_string(),
                p["spec"]["nodeName"].as_str()?.to_string(),
            ))
        })
        .collect())
}

/// The holder of the controller plugin's Lease (a pod name), if any.
pub fn plugin_lease_holder(c: &Cluster) -> Result<Option<String>> {
    let l = c
        .kubectl
        .get(&["lease", "-n", NAMESPACE, "fencecsi-controller-plugin"])?;
    Ok(l["spec"]["holderIdentity"].as_str().map(String::from))
}

/// The controller pod whose plugin leads (holds the plugin's Lease), waiting (bounded) for
/// one of the current pods to hold it.
pub fn controller_pod(c: &Cluster) -> Result<String> {
    wait::until_explained(
        "a current controller pod to hold the plugin's Lease",
        Duration::from_secs(90),
        Duration::from_secs(1),
        || {
            let holder = plugin_lease_holder(c)?;
            let pods = controller_pods_placed(c)?;
            Ok(match holder {
                Some(h) if pods.iter().any(|(name, _)| *name == h) => Ok(h),
                other => Err(format!("held by {other:?}; pods {pods:?}")),
            })
        },
    )
}

/// The node the leading controller pod runs on.
pub fn controller_node(c: &Cluster) -> Result<String> {
    let leader = controller_pod(c)?;
    controller_pods_placed(c)?
        .into_iter()
        .find(|(name, _)| *name == leader)
        .map(|(_, node)| node)
        .ok_or_else(|| anyhow::anyhow!("the leading controller pod is not scheduled"))
}
