//! What the suite needs from outside the repository, named by environment variables:
//!
//! - `FENCECSI_E2E_K8S_BIN`: a directory with etcd, kube-apiserver, kube-controller-manager,
//!   kube-scheduler, kubelet and kubectl (Kubernetes v1.32; DEVELOPERS.md says how to build
//!   them).
//! - `FENCECSI_E2E_IMAGES`: a directory of image archives (`*.tar`, docker-archive) holding
//!   every sidecar image `deploy/base` names, at its exact tag, and the pause image.
//! - `FENCECSI_E2E_PAUSE_IMAGE` (optional, default `registry.k8s.io/pause:3.10`): the
//!   reference of the pause image among those archives; containerd's sandbox image.
//! - `FENCECSI_E2E_FENCECSI_IMAGE` (optional): the fencecsi image archive; by default
//!   `scripts/image.sh` builds it from this checkout.
//!
//! Host tools: containerd, runc, ctr, the CNI plugins (bridge, host-local, loopback),
//! iptables, ip, nsenter, unshare, losetup, openssl, tar (scripts/setup.sh installs them
//! when the two directories above are given).

use std::path::{Path, PathBuf};

use anyhow::Result;

pub const K8S_BIN: &str = "FENCECSI_E2E_K8S_BIN";
pub const IMAGES: &str = "FENCECSI_E2E_IMAGES";
pub const PAUSE_IMAGE: &str = "FENCECSI_E2E_PAUSE_IMAGE";
pub const DEFAULT_PAUSE: &str = "registry.k8s.io/pause:3.10";

pub const K8S_BINARIES: [&str; 6] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kubectl",
];
const HOST_TOOLS: [&str; 10] = [
    "containerd",
    "runc",
    "ctr",
    "iptables",
    "ip",
    "nsenter",
    "unshare",
    "losetup",
    "openssl",
    "tar",
];
/// Where Debian's containernetworking-plugins puts the plugins; /opt/cni/bin elsewhere.
const CNI_DIRS: [&str; 2] = ["/usr/lib/cni", "/opt/cni/bin"];

#[derive(Debug, Clone)]
pub struct Inputs {
    pub k8s_bin: PathBuf,
    pub images_dir: PathBuf,
    pub pause_image: String,
    pub cni_bin: PathBuf,
    pub repo: PathBuf,
}

/// The inputs, or why the suite cannot run (a message naming what is missing).
pub fn from_env() -> Result<Inputs, String> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    // Relative to the repository, where the README's commands run (cargo runs the test in
    // the e2e crate's directory).
    let k8s_bin = std::env::var_os(K8S_BIN).map(|p| repo.join(p));
    let images_dir = std::env::var_os(IMAGES).map(|p| repo.join(p));
    let (Some(k8s_bin), Some(images_dir)) = (k8s_bin, images_dir) else {
        return Err(format!(
            "{K8S_BIN} (a directory with {}) and {IMAGES} (a directory of image archives: the sidecars at the tags in deploy/base, and the pause image) are not both set",
            K8S_BINARIES.join(", ")
        ));
    };
    let mut missing = Vec::new();
    for b in K8S_BINARIES {
        if !k8s_bin.join(b).is_file() {
            missing.push(format!("{}/{b}", k8s_bin.display()));
        }
    }
    if !images_dir.is_dir() {
        missing.push(format!("{} (not a directory)", images_dir.display()));
    }
    for t in HOST_TOOLS {
        if which(t).is_none() {
            missing.push(format!("{t} (scripts/setup.sh installs it)"));
        }
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root (namespaces, cgroups, loop devices)".into());
    }
    let cni_bin = CNI_DIRS
        .iter()
        .map(PathBuf::from)
        .find(|d| d.join("bridge").is_file() && d.join("host-local").is_file());
    if cni_bin.is_none() {
        missing.push("the CNI plugins bridge and host-local (containernetworking-plugins)".into());
    }
    if !missing.is_empty() {
        return Err(format!("missing: {}", missing.join("; ")));
    }
    Ok(Inputs {
        k8s_bin,
        images_dir,
        pause_image: std::env::var(PAUSE_IMAGE).unwrap_or_else(|_| DEFAULT_PAUSE.into()),
        cni_bin: cni_bin.unwrap(),
        repo,
    })
}

pub fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin"])
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file());
    found
}
