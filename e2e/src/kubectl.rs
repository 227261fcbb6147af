//! kubectl with the admin kubeconfig; objects come back as JSON.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde_json::Value;

use crate::process::run;

#[derive(Clone)]
pub struct Kubectl {
    pub bin: PathBuf,
    pub kubeconfig: PathBuf,
}

impl Kubectl {
    pub fn new(k8s_bin: &Path, kubeconfig: &Path) -> Self {
        Self {
            bin: k8s_bin.join("kubectl"),
            kubeconfig: kubeconfig.into(),
        }
    }

    pub fn cmd(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .arg("--request-timeout=10s");
        c
    }

    /// `kubectl <args>`, its stdout.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        run(self.cmd().args(args))
    }

    /// `kubectl get <args> -o json`.
    pub fn get(&self, args: &[&str]) -> Result<Value> {
        let out = run(self.cmd().arg("get").args(args).args(["-o", "json"]))?;
        serde_json::from_str(&out).with_context(|| format!("parsing kubectl get {args:?}"))
    }

    /// The items of a list `get`.
    pub fn items(&self, args: &[&str]) -> Result<Vec<Value>> {
        Ok(self.get(args)?["items"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Applies a manifest given as text.
    pub fn apply_text(&self, manifest: &str) -> Result<String> {
        use std::io::Write;
        let mut child = self
            .cmd()
            .args(["apply", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        child.stdin.take().unwrap().write_all(manifest.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            anyhow::bail!(
                "kubectl apply failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// Waits, at most `limit`, until pod `ns/name` is Ready; the timeout names `what` and
/// the pod's last phase.
pub fn wait_pod_ready(
    k: &Kubectl,
    ns: &str,
    name: &str,
    what: &str,
    limit: std::time::Duration,
) -> Result<()> {
    crate::wait::until_explained(what, limit, std::time::Duration::from_secs(1), || {
        let p = k.get(&["pod", "-n", ns, name])?;
        Ok(if pod_ready(&p) {
            Ok(())
        } else {
            Err(format!("phase {}", p["status"]["phase"]))
        })
    })
}

/// A pod's Ready condition.
pub fn pod_ready(pod: &Value) -> bool {
    condition_true(pod, "Ready")
}

pub fn condition_true(obj: &Value, ty: &str) -> bool {
    obj["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == ty && c["status"] == "True")
}

/// The taint keys of a Node.
pub fn taint_keys(node: &Value) -> Vec<String> {
    node["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["key"].as_str().map(String::from))
        .collect()
}
