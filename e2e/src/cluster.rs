//! The whole cluster: run directory, PKI, bridge, control plane, four nodes, images, and
//! the shipped deployment (`kubectl apply -k deploy/base`, unchanged).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::control_plane::{self, ControlPlane, SERVICE_IP};
use crate::images::{self, Archive};
use crate::inputs::Inputs;
use crate::kubectl::{self, Kubectl};
use crate::node::{self, Node, NodeEnv, NodeSpec};
use crate::teardown::{Made, Teardown};
use crate::{certs, network, say, state_fs, wait};

/// Four, so that two nodes can fail at once (the leading controller's and a writer's)
/// without reaching podgc's disruption threshold (`--max-unhealthy-fraction`, 0.55).
pub const NODE_COUNT: usize = 4;

/// Size of the state directory's own filesystem (a sparse image: only what is written
/// takes disk space); room for the upstream suite's volume-limit spec, 64 volumes on a node.
const STATE_FS_BYTES: u64 = 32 << 30;

pub struct Cluster {
    pub run_dir: PathBuf,
    pub state_dir: PathBuf,
    pub kubectl: Kubectl,
    pub control_plane: ControlPlane,
    pub nodes: Vec<Node>,
    pub bridge: network::Bridge,
    pub pki: certs::Pki,
    pub archives: Vec<PathBuf>,
    pub inputs: Inputs,
}

/// A short id for names with length limits (links: 15 bytes).
fn run_id() -> String {
    format!("{}", std::process::id())
}

/// `target/e2e/run-<id>`, new, with room for the images.
fn make_run_dir(inputs: &Inputs, id: &str, td: &Teardown) -> Result<PathBuf> {
    let run_dir = inputs
        .repo
        .join("target")
        .join("e2e")
        .join(format!("run-{id}"));
    if run_dir.exists() {
        bail!("{} exists already", run_dir.display());
    }
    std::fs::create_dir_all(&run_dir)?;
    td.record(Made::Dir {
        path: run_dir.clone(),
    });
    check_free_space(&run_dir)?;
    say(format!("run directory {}", run_dir.display()));
    Ok(run_dir)
}

/// The CA and the API server's serving certificate, for every name it is reached by.
fn make_pki(run_dir: &Path, bridge: &network::Bridge) -> Result<certs::Pki> {
    certs::make(
        &run_dir.join("pki"),
        &[SERVICE_IP, &bridge.ip, "127.0.0.1"],
        &[
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
            "localhost",
        ],
    )
}

/// The nodes' names, addresses on the bridge, cgroups, directories and pod subnets.
fn node_specs(id: &str, net: &str, cgroup_root: &str, run_dir: &Path) -> Vec<NodeSpec> {
    (1..=NODE_COUNT)
        .map(|i| NodeSpec {
            name: format!("e2e-node-{i}"),
            ip: format!("{net}.{}", 10 + i),
            host_end: format!("fe2e{id}n{i}"),
            cgroup: format!("{cgroup_root}/node-{i}"),
            dir: run_dir.join(format!("node-{i}")),
            pod_subnet: format!("10.{}.{i}.0/24", pod_net_octet(net)),
        })
        .collect()
}

/// Brings everything up. On error the caller's teardown undoes what was made.
pub fn bring_up(inputs: &Inputs, td: &Teardown) -> Result<Cluster> {
    let id = run_id();
    let run_dir = make_run_dir(inputs, &id, td)?;
    let state_dir = state_fs::make(&run_dir, STATE_FS_BYTES, td)?;

    let archives = collect_images(inputs)?;
    let net = network::free_subnet()?;
    let bridge = network::make_bridge(&format!("fe2e{id}br"), &net, td)?;
    let pki = make_pki(&run_dir, &bridge)?;
    let cgroup_root = format!("fencecsi-e2e-{id}");
    crate::cgroups::create(&cgroup_root)?;
    td.record(Made::Cgroup {
        rel: cgroup_root.clone(),
    });
    let specs = node_specs(&id, &net, &cgroup_root, &run_dir);
    let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    let cp = control_plane::start(
        &inputs.k8s_bin,
        &run_dir.join("control-plane"),
        &pki,
        &bridge.ip,
        &names,
        td,
    )?;
    let kubectl = Kubectl::new(&inputs.k8s_bin, &cp.admin_kubeconfig);
    // A Node object left from an earlier run would count as Ready at once.
    let mut del = vec!["delete", "node", "--ignore-not-found"];
    del.extend(names.iter().map(String::as_str));
    kubectl.run(&del)?;

    let mut cluster = Cluster {
        run_dir,
        state_dir,
        kubectl,
        control_plane: cp,
        nodes: Vec::new(),
        bridge,
        pki,
        archives,
        inputs: inputs.clone(),
    };
    for spec in &specs {
        let n = node::start(
            spec,
            &cluster.node_env(),
            &cluster.node_kubeconfig(&spec.name)?,
            td,
        )?;
        cluster.nodes.push(n);
    }
    cluster.wait_nodes_ready(&names, Duration::from_secs(120))?;
    Ok(cluster)
}

/// Four nodes each hold every image twice (content store and unpacked snapshots):
/// about 4 GiB with the fencecsi image and the six sidecars.
const NEEDED_FREE_BYTES: u64 = 5 << 30;

fn check_free_space(dir: &Path) -> Result<()> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())?;
    // SAFETY: statvfs writes into the zeroed struct we own; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error()).context("statvfs");
    }
    let free = st.f_bavail as u64 * st.f_frsize as u64;
    say(format!(
        "disk free for the run: {:.1} GiB",
        free as f64 / (1u64 << 30) as f64
    ));
    if free < NEEDED_FREE_BYTES {
        bail!(
            "only {:.1} GiB free under {}; the run needs about {} GiB",
            free as f64 / (1u64 << 30) as f64,
            dir.display(),
            NEEDED_FREE_BYTES >> 30
        );
    }
    Ok(())
}

/// Pod subnets live in a /16 next to the node subnet's octet, so they never overlap it.
fn pod_net_octet(net: &str) -> u8 {
    let third: u8 = net
        .split('.')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    third.wrapping_sub(1)
}

/// The image archives: every one in FENCECSI_E2E_IMAGES and the fencecsi image; each image
/// deploy/base names, and the pause image, must be among them.
fn collect_images(inputs: &Inputs) -> Result<Vec<PathBuf>> {
    let mut archives: Vec<Archive> = images::archives_in(&inputs.images_dir)?;
    let fencecsi = images::fencecsi_image(&inputs.repo)?;
    archives.push(Archive {
        refs: images::archive_refs(&fencecsi)?,
        path: fencecsi,
    });
    let rendered = crate::process::run(
        std::process::Command::new(inputs.k8s_bin.join("kubectl"))
            .arg("kustomize")
            .arg(inputs.repo.join("deploy/base")),
    )?;
    let mut wanted = images::images_in_manifests(&rendered);
    wanted.push(inputs.pause_image.clone());
    let have: Vec<String> = archives
        .iter()
        .flat_map(|a| a.refs.iter().map(|r| images::normalize(r)))
        .collect();
    let missing: Vec<&String> = wanted
        .iter()
        .filter(|w| !have.contains(&images::normalize(w)))
        .collect();
    if !missing.is_empty() {
        bail!(
            "no image archive holds {missing:?} (archives: {:?})",
            archives
                .iter()
                .map(|a| (&a.path, &a.refs))
                .collect::<Vec<_>>()
        );
    }
    say(format!(
        "images: {} archives cover every image deploy/base names",
        archives.len()
    ));
    Ok(archives.into_iter().map(|a| a.path).collect())
}

impl Cluster {
    pub fn node_env(&self) -> NodeEnv<'_> {
        NodeEnv {
            k8s_bin: &self.inputs.k8s_bin,
            cni_bin: &self.inputs.cni_bin,
            pause_image: &self.inputs.pause_image,
            state_dir: &self.state_dir,
            ca_cert: &self.pki.ca_cert,
            bridge: Some(&self.bridge),
            archives: &self.archives,
        }
    }

    pub fn node_kubeconfig(&self, name: &str) -> Result<PathBuf> {
        self.control_plane
            .node_kubeconfigs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| p.clone())
            .with_context(|| format!("no kubeconfig for {name}"))
    }

    pub fn node(&self, name: &str) -> Result<&Node> {
        self.nodes
            .iter()
            .find(|n| n.spec.name == name)
            .with_context(|| format!("no node {name}"))
    }

    pub fn wait_nodes_ready(&self, names: &[String], limit: Duration) -> Result<()> {
        wait::until_explained("every node Ready", limit, Duration::from_secs(1), || {
            let nodes = self.kubectl.items(&["nodes"])?;
            let not_ready: Vec<&String> = names
                .iter()
                .filter(|n| {
                    !nodes.iter().any(|o| {
                        o["metadata"]["name"] == n.as_str() && kubectl::condition_true(o, "Ready")
                    })
                })
                .collect();
            Ok(if not_ready.is_empty() {
                Ok(())
            } else {
                Err(format!("not Ready: {not_ready:?}"))
            })
        })?;
        say(format!("nodes Ready: {}", names.join(", ")));
        Ok(())
    }

    /// `kubectl apply -k deploy/base`, unchanged.
    pub fn apply_deploy_base(&self) -> Result<()> {
        let base = self.inputs.repo.join("deploy/base");
        say(format!("kubectl apply -k {}", base.display()));
        let out = self
            .kubectl
            .run(&["apply", "-k", &base.display().to_string()])?;
        for l in out.lines() {
            say(format!("  {l}"));
        }
        Ok(())
    }

    /// Node logs and the state directory, for a failure report.
    pub fn logs_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Copies every log (control plane, each node's daemons and pod logs) beside the run
    /// directory before the teardown removes it.
    pub fn save_logs(&self) {
        let dst = self.run_dir.with_file_name(format!(
            "{}-logs",
            self.run_dir
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
        ));
        let _ = std::fs::create_dir_all(&dst);
        let mut srcs = vec![self.run_dir.join("control-plane").join("logs")];
        for n in &self.nodes {
            srcs.push(n.spec.own_logs());
            srcs.push(n.spec.log_dir());
        }
        for s in srcs {
            let name = s
                .strip_prefix(&self.run_dir)
                .map(|p| p.to_string_lossy().replace('/', "-"))
                .unwrap_or_default();
            let _ = std::process::Command::new("cp")
                .arg("-a")
                .arg(&s)
                .arg(dst.join(name))
                .status();
        }
        say(format!("logs saved in {}", dst.display()));
    }
}
