//! Install: after `kubectl apply -k deploy/base`, every fencecsi pod is Ready, every node's
//! CSINode lists the driver, and the controller's leader Leases are taken.

use std::time::Duration;

use anyhow::Result;

use crate::cluster::Cluster;
use crate::kubectl::pod_ready;
use crate::{say, wait};

pub const NAMESPACE: &str = "fencecsi";
pub const DRIVER: &str = "loop.fencecsi.io";

/// Waits (bounded) until the shipped deployment is up on every node.
pub fn wait_installed(c: &Cluster) -> Result<()> {
    let nodes = c.nodes.len();
    wait::until_explained(
        "every fencecsi pod Ready (1 controller, one node pod per node)",
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
            Ok(if ctl == 1 && node == nodes {
                Ok(())
            } else {
                Err(format!(
                    "{ctl}/1 controller and {node}/{nodes} node pods Ready; {}",
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

/// The name of the controller pod that is not being deleted.
pub fn controller_pod(c: &Cluster) -> Result<String> {
    controller_pods(c)?
        .iter()
        .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
        .find_map(|p| p["metadata"]["name"].as_str().map(String::from))
        .ok_or_else(|| anyhow::anyhow!("no controller pod"))
}

/// The node the controller pod runs on.
pub fn controller_node(c: &Cluster) -> Result<String> {
    controller_pods(c)?
        .iter()
        .find_map(|p| p["spec"]["nodeName"].as_str().map(String::from))
        .ok_or_else(|| anyhow::anyhow!("no controller pod is scheduled"))
}
