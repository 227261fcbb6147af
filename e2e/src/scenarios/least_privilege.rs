//! Least privilege on the real API server: the node plugin's own token (the projected,
//! node-bound service-account token the kubelet gave its container) cannot change another
//! Node, nor its own Node's taints or other annotations. The admission policy in
//! deploy/base refuses each with its message, which also proves the token was
//! authenticated and the request reached admission.

use std::process::Command;

use anyhow::{bail, Context, Result};

use super::install::NAMESPACE;
use crate::cluster::Cluster;
use crate::process::run;
use crate::say;

/// The token of the node plugin on `node`, read inside the node's mount namespace.
fn node_plugin_token(c: &Cluster, node: &str) -> Result<String> {
    let pods = c.kubectl.items(&[
        "pods",
        "-n",
        NAMESPACE,
        "-l",
        "app.kubernetes.io/component=node",
        "--field-selector",
        &format!("spec.nodeName={node}"),
    ])?;
    let uid = pods
        .first()
        .and_then(|p| p["metadata"]["uid"].as_str())
        .with_context(|| format!("no node plugin pod on {node}"))?;
    let path = format!(
        "/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~projected/kube-api-access/token"
    );
    let holder = c.node(node)?.holder;
    let token = run(Command::new("nsenter")
        .arg("-t")
        .arg(holder.to_string())
        .args(["-m", "-p", "--", "cat", &path]))?;
    Ok(token.trim().to_string())
}

/// `kubectl patch node <target>` as the node plugin; the refusal's text, or an error if
/// the patch went through.
fn refused_patch(c: &Cluster, token: &str, target: &str, patch: &str) -> Result<String> {
    let out = c
        .kubectl
        .cmd()
        .arg(format!("--token={token}"))
        .args(["patch", "node", target, "--type", "merge", "-p", patch])
        .output()?;
    if out.status.success() {
        bail!("the node plugin's token patched Node {target} with {patch}");
    }
    Ok(String::from_utf8_lossy(&out.stderr).into_owned())
}

pub fn node_plugin_keeps_to_its_own_node(c: &Cluster) -> Result<()> {
    let own = c.nodes[0].spec.name.clone();
    let other = c.nodes[1].spec.name.clone();
    let token = node_plugin_token(c, &own)?;
    let cases = [
        (
            other.as_str(),
            r#"{"metadata":{"annotations":{"fencecsi.io/node-clean":"1"}}}"#,
            "may change only the Node it runs on",
        ),
        (
            own.as_str(),
            // A real change: an empty list would be no change at all, and allowed.
            r#"{"spec":{"taints":[{"key":"e2e.fencecsi.io/probe","effect":"NoSchedule"}]}}"#,
            "may not change a Node's spec (taints) or labels",
        ),
        (
            own.as_str(),
            r#"{"metadata":{"annotations":{"e2e.fencecsi.io/other":"x"}}}"#,
            "may change only the fencecsi.io/node-clean annotation",
        ),
    ];
    for (target, patch, want) in cases {
        let err = refused_patch(c, &token, target, patch)?;
        if !err.contains(want) {
            bail!("patching {target} with {patch} as the node plugin of {own}: refused, but not by the policy (want {want:?}): {err}");
        }
        say(format!("least privilege: {own}'s node plugin may not patch {target} with {patch}: refused by the policy"));
    }
    Ok(())
}
