//! One node: a namespace holder (`unshare` of mount, UTS, network and PID namespaces) in the
//! node's own cgroup, private mounts inside it for every well-known path the kubelet and
//! containerd would otherwise share with the other nodes, its own containerd and a v1.32
//! kubelet with production timing.
//!
//! Inside the node's mount namespace (a slave of the host's, so the host's mounts are seen
//! and nothing propagates back):
//! - `/run` and `/var/lib` are fresh tmpfs (containerd's socket and state, runc, CNI IPAM);
//! - `/var/lib/kubelet` is the node's own directory, made rshared (the node plugin mounts
//!   it `Bidirectional`);
//! - `/var/lib/fencecsi` is the suite's one state directory, shared by every node (the
//!   fence works at the inode: one kernel, one directory, as on kind);
//! - `/var/log` is the node's own (the kubelet's GC deletes pod log dirs it does not know).
//!
//! `/dev` is the host's, so the kubelet and the plugins see the loop devices fencecsi makes.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::network::{self, Bridge};
use crate::process::{self, run};
use crate::teardown::Teardown;
use crate::{cgroups, images, say, wait};

pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";

/// Everything a node is made from.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub name: String,
    pub ip: String,
    /// The veth's end on the host's bridge: the partition switch.
    pub host_end: String,
    /// The node's cgroup, relative to each hierarchy's root.
    pub cgroup: String,
    /// The node's directory (kubelet dir, logs, containerd root, configs).
    pub dir: PathBuf,
    /// The pod subnet of this node's CNI bridge.
    pub pod_subnet: String,
}

/// What is shared by every node.
pub struct NodeEnv<'a> {
    pub k8s_bin: &'a Path,
    pub cni_bin: &'a Path,
    pub pause_image: &'a str,
    pub state_dir: &'a Path,
    pub ca_cert: &'a Path,
    /// The bridge to wire the node to; `None` leaves it without a network (image checks).
    pub bridge: Option<&'a Bridge>,
    pub archives: &'a [PathBuf],
}

/// A running node.
#[derive(Debug, Clone)]
pub struct Node {
    pub spec: NodeSpec,
    /// The namespace holder's pid: `nsenter -t` target.
    pub holder: i32,
    pub kubelet_pgid: i32,
}

impl NodeSpec {
    pub fn kubelet_dir(&self) -> PathBuf {
        self.dir.join("kubelet")
    }
    pub fn log_dir(&self) -> PathBuf {
        self.dir.join("log")
    }
    pub fn own_logs(&self) -> PathBuf {
        self.dir.join("logs")
    }
}

/// Brings a node up: cgroup, namespaces, mounts, network, containerd (with every image
/// imported), kubelet. `kubeconfig` is the node's `system:node:<name>` identity.
pub fn start(spec: &NodeSpec, env: &NodeEnv, kubeconfig: &Path, td: &Teardown) -> Result<Node> {
    let holder = start_runtime(spec, env, td)?;
    let kubelet_pgid = start_kubelet(spec, env, holder, kubeconfig, td)?;
    Ok(Node {
        spec: spec.clone(),
        holder,
        kubelet_pgid,
    })
}

/// Everything but the kubelet: cgroup, namespaces, mounts, network (if a bridge is given),
/// containerd with every image imported. Returns the namespace holder's pid.
pub fn start_runtime(spec: &NodeSpec, env: &NodeEnv, td: &Teardown) -> Result<i32> {
    for d in [
        spec.kubelet_dir(),
        spec.log_dir(),
        spec.own_logs(),
        spec.dir.join("cni"),
    ] {
        std::fs::create_dir_all(&d)?;
    }
    cgroups::create(&spec.cgroup)?;
    let holder = start_holder(spec, td)?;
    mount_private_paths(spec, env, holder)?;
    if let Some(br) = env.bridge {
        network::wire_node(br, holder, &spec.host_end, &spec.ip, td)?;
    }
    start_containerd(spec, env, holder, td)?;
    for a in env.archives {
        images::import(holder, CONTAINERD_SOCKET, a)
            .with_context(|| format!("importing {} into {}", a.display(), spec.name))?;
    }
    say(format!(
        "{}: {} images imported",
        spec.name,
        env.archives.len()
    ));
    Ok(holder)
}

/// `sh -c` that moves itself into the node's cgroup in every hierarchy, then execs `argv`.
fn in_node_cgroup(spec: &NodeSpec, argv: &[String]) -> Result<Command> {
    let files = cgroups::procs_files(&spec.cgroup)?;
    let joins: String = files
        .iter()
        .map(|f| format!("echo $$ > '{}' && ", f.display()))
        .collect();
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(format!("{joins}exec \"$@\""))
        .arg("sh")
        .args(argv);
    Ok(c)
}

/// Starts `argv` in the node's cgroup as a daemon of its own process group, its output in
/// `<log>.log` among the node's logs, recorded for the teardown as `<node> <what>`.
/// Returns its pid (the group's id).
pub(crate) fn spawn_in_node(
    spec: &NodeSpec,
    argv: &[String],
    log: &str,
    what: &str,
    td: &Teardown,
) -> Result<i32> {
    let child = process::spawn_daemon(
        &mut in_node_cgroup(spec, argv)?,
        &spec.own_logs().join(format!("{log}.log")),
    )?;
    let pid = child.id() as i32;
    td.record_daemon(format!("{} {what}", spec.name), pid);
    Ok(pid)
}

/// The node's namespaces: mount, UTS, network and PID. The PID namespace makes the
/// node's own first process its PID 1, with a `/proc` of its own, as on a real node or a
/// kind node: what enters "PID 1's mount namespace" (the upstream suite's host-exec
/// pods) enters the node's, not the host's. `unshare --fork` stays outside as the
/// parent; the holder returned is its child, PID 1 inside.
fn start_holder(spec: &NodeSpec, td: &Teardown) -> Result<i32> {
    let argv: Vec<String> = [
        "unshare",
        "--mount",
        "--uts",
        "--net",
        "--pid",
        "--fork",
        "--mount-proc",
        "--propagation",
        "slave",
        "--",
        "sleep",
        "infinity",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let parent = spawn_in_node(spec, &argv, "holder", "namespace holder", td)?;
    wait::until(
        &format!("{}'s namespaces", spec.name),
        Duration::from_secs(10),
        Duration::from_millis(20),
        || Ok(child_running(parent, "sleep")),
    )
}

/// The child of `parent` whose command is `comm`, once it runs it.
pub fn child_running(parent: i32, comm: &str) -> Option<i32> {
    let kids = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    kids.split_whitespace()
        .filter_map(|k| k.parse::<i32>().ok())
        .find(|k| {
            std::fs::read_to_string(format!("/proc/{k}/comm")).is_ok_and(|c| c.trim() == comm)
        })
}

/// The last `NSpid` of a process: its pid inside the innermost PID namespace (the
/// node's, for a daemon of the node).
pub fn pid_in_namespace(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

fn mount_private_paths(spec: &NodeSpec, env: &NodeEnv, holder: i32) -> Result<()> {
    let script = format!(
        "set -e
mount -t tmpfs -o mode=0755 fencecsi-e2e-run /run
mount -t tmpfs -o mode=0755 fencecsi-e2e-varlib /var/lib
mkdir -p /var/lib/kubelet /var/lib/fencecsi /var/lib/cni
mount --bind '{kubelet}' /var/lib/kubelet
mount --make-rshared /var/lib/kubelet
mount --bind '{state}' /var/lib/fencecsi
mount --bind '{log}' /var/log
hostname '{name}'
",
        kubelet = spec.kubelet_dir().display(),
        state = env.state_dir.display(),
        log = spec.log_dir().display(),
        name = spec.name,
    );
    run(Command::new("nsenter")
        .arg("-t")
        .arg(holder.to_string())
        .args(["-m", "-u", "-p", "--", "sh", "-c", &script]))
    .with_context(|| format!("mounting {}'s private paths", spec.name))?;
    Ok(())
}

fn containerd_config(spec: &NodeSpec, env: &NodeEnv) -> String {
    format!(
        r#"version = 2
root = "{root}"
state = "/run/containerd"
[grpc]
  address = "{CONTAINERD_SOCKET}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  # runc cannot raise oom_score_adj without CAP_SYS_RESOURCE ("can't get final child's
  # PID from pipe: EOF"); this keeps containers at or above containerd's own value.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_conf}"
"#,
        root = spec.dir.join("containerd").display(),
        pause = env.pause_image,
        cni_bin = env.cni_bin.display(),
        cni_conf = spec.dir.join("cni").display(),
    )
}

fn cni_config(spec: &NodeSpec) -> String {
    serde_json::json!({
        "cniVersion": "0.4.0",
        "name": "fencecsi-e2e",
        "plugins": [{
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": true,
            "ipMasq": true,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": spec.pod_subnet}]],
                "routes": [{"dst": "0.0.0.0/0"}]
            }
        }]
    })
    .to_string()
}

/// `nsenter` into every namespace of the node, inside its cgroup. Entering the PID
/// namespace forks: `nsenter` stays as the parent (the process group's leader) and the
/// daemon is its child.
pub(crate) fn node_daemon_argv(holder: i32, argv: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "nsenter",
        "-t",
        &holder.to_string(),
        "-m",
        "-u",
        "-n",
        "-p",
        "--",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(argv.iter().map(|s| s.to_string()));
    v
}

fn start_containerd(spec: &NodeSpec, env: &NodeEnv, holder: i32, td: &Teardown) -> Result<()> {
    let cfg = spec.dir.join("containerd.toml");
    std::fs::write(&cfg, containerd_config(spec, env))?;
    std::fs::write(
        spec.dir.join("cni").join("10-fencecsi-e2e.conflist"),
        cni_config(spec),
    )?;
    let cfg_s = cfg.display().to_string();
    let argv = node_daemon_argv(holder, &["containerd", "--config", &cfg_s]);
    spawn_in_node(spec, &argv, "containerd", "containerd", td)?;
    wait::until(
        &format!("{}'s containerd", spec.name),
        Duration::from_secs(30),
        Duration::from_millis(200),
        || {
            Ok(run(Command::new("nsenter")
                .arg("-t")
                .arg(holder.to_string())
                .args([
                    "-m",
                    "-p",
                    "--",
                    "ctr",
                    "--address",
                    CONTAINERD_SOCKET,
                    "version",
                ]))
            .is_ok()
            .then_some(()))
        },
    )?;
    say(format!("{}: containerd up", spec.name));
    Ok(())
}

fn kubelet_config(spec: &NodeSpec, env: &NodeEnv) -> String {
    serde_json::json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "authentication": {
            "anonymous": {"enabled": false},
            "webhook": {"enabled": true},
            "x509": {"clientCAFile": env.ca_cert}
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        // Kubelets on one host must not share a cgroup tree.
        "cgroupRoot": format!("/{}", spec.cgroup),
        "containerRuntimeEndpoint": format!("unix://{CONTAINERD_SOCKET}"),
        // Production timing: Lease of 40 s, renewed (and status posted) every 10 s.
        "nodeStatusUpdateFrequency": "10s",
        "nodeLeaseDurationSeconds": 40,
        "failSwapOn": false,
        // The host's disk is shared by everything on it; only a truly full disk evicts.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%"
        },
        // No registry: an image collected could never be pulled again.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "address": spec.ip,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "clusterDomain": "cluster.local",
        "resolvConf": "/etc/resolv.conf",
        "serializeImagePulls": false,
        "podLogsDir": "/var/log/pods"
    })
    .to_string()
}

fn start_kubelet(
    spec: &NodeSpec,
    env: &NodeEnv,
    holder: i32,
    kubeconfig: &Path,
    td: &Teardown,
) -> Result<i32> {
    let args = kubelet_argv(spec, env, kubeconfig)?;
    let argv = node_daemon_argv(holder, &args.iter().map(String::as_str).collect::<Vec<_>>());
    let pgid = spawn_in_node(spec, &argv, "kubelet", "kubelet", td)?;
    say(format!(
        "{}: kubelet started (log {})",
        spec.name,
        spec.own_logs().join("kubelet.log").display()
    ));
    Ok(pgid)
}

/// The kubelet's command line (its config written beside it), as run inside the node.
pub fn kubelet_argv(spec: &NodeSpec, env: &NodeEnv, kubeconfig: &Path) -> Result<Vec<String>> {
    let cfg = spec.dir.join("kubelet.json");
    std::fs::write(&cfg, kubelet_config(spec, env))?;
    Ok(vec![
        env.k8s_bin.join("kubelet").display().to_string(),
        format!("--config={}", cfg.display()),
        format!("--kubeconfig={}", kubeconfig.display()),
        format!("--hostname-override={}", spec.name),
        format!("--node-ip={}", spec.ip),
        "--v=2".to_string(),
    ])
}

/// Restarts the kubelet only (a day-2 kubelet restart): stop its process group, start anew.
pub fn restart_kubelet(
    node: &mut Node,
    env: &NodeEnv,
    kubeconfig: &Path,
    td: &Teardown,
) -> Result<()> {
    process::stop_group(node.kubelet_pgid, Duration::from_secs(10));
    node.kubelet_pgid = start_kubelet(&node.spec, env, node.holder, kubeconfig, td)?;
    Ok(())
}

/// How often this node's kubelets registered with the API server (log lines, across
/// restarts): a restarted kubelet is up once this grows.
pub fn kubelet_registrations(spec: &NodeSpec) -> usize {
    std::fs::read_to_string(spec.own_logs().join("kubelet.log"))
        .map(|s| s.matches("\"Successfully registered node\"").count())
        .unwrap_or(0)
}
