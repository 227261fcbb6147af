//! etcd, kube-apiserver, kube-controller-manager (every controller, default grace
//! periods) and kube-scheduler on the host, the API server on the suite's bridge address
//! so that nodes in their own network namespaces reach it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::certs::Pki;
use crate::teardown::Teardown;
use crate::{process, say, wait};

/// The `kubernetes` Service's IP (first of the service range): pods reach the API server
/// there, so it is in the serving certificate and DNAT'd in each node.
pub const SERVICE_IP: &str = "10.96.0.1";
pub const SERVICE_RANGE: &str = "10.96.0.0/12";
pub const API_PORT: u16 = 6443;

/// A token-authenticated identity: one line of the API server's token file and one
/// kubeconfig.
pub struct Identity {
    pub user: String,
    pub groups: Vec<String>,
    pub token: String,
}

pub struct ControlPlane {
    pub url: String,
    pub admin_kubeconfig: PathBuf,
    pub dir: PathBuf,
    /// Tokens of the node identities, by node name.
    pub node_kubeconfigs: Vec<(String, PathBuf)>,
    /// The API server's process group (its pid).
    pub apiserver_pgid: i32,
}

fn random_token() -> Result<String> {
    let mut b = [0u8; 16];
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Writes a kubeconfig for `id` against `url` with the cluster CA.
pub fn write_kubeconfig(path: &Path, url: &str, ca: &Path, id: &Identity) -> Result<()> {
    let doc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {"server": url, "certificate-authority": ca}}],
        "users": [{"name": id.user, "user": {"token": id.token}}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": id.user}}],
        "current-context": "e2e",
    });
    std::fs::write(path, serde_json::to_vec_pretty(&doc)?)?;
    Ok(())
}

fn free_local_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Starts the control plane; `bind_ip` is the bridge address, `nodes` the node names
/// (each gets a `system:node:<name>` identity).
pub fn start(
    bin: &Path,
    dir: &Path,
    pki: &Pki,
    bind_ip: &str,
    nodes: &[String],
    td: &Teardown,
) -> Result<ControlPlane> {
    std::fs::create_dir_all(dir.join("logs"))?;
    let url = format!("https://{bind_ip}:{API_PORT}");
    let ids = write_identities(dir, &url, pki, nodes)?;
    let etcd_url = start_etcd(bin, dir, td)?;
    let apiserver_pgid = start_apiserver(bin, dir, pki, bind_ip, &etcd_url, &ids.tokens, td)?;
    let cp = ControlPlane {
        url,
        admin_kubeconfig: ids.admin,
        dir: dir.into(),
        node_kubeconfigs: ids.nodes,
        apiserver_pgid,
    };
    wait_ready(bin, &cp)?;
    start_controllers(bin, dir, pki, &ids.controller_manager, &ids.scheduler, td)?;
    Ok(cp)
}

/// The token file the API server authenticates with, and a kubeconfig per identity.
struct Identities {
    tokens: PathBuf,
    admin: PathBuf,
    controller_manager: PathBuf,
    scheduler: PathBuf,
    /// (node name, kubelet kubeconfig)
    nodes: Vec<(String, PathBuf)>,
}

/// An admin, the controller manager, the scheduler and `system:node:<name>` for each
/// node, each with a random token.
fn write_identities(dir: &Path, url: &str, pki: &Pki, nodes: &[String]) -> Result<Identities> {
    let mk = |user: &str, groups: &[&str]| -> Result<Identity> {
        Ok(Identity {
            user: user.into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            token: random_token()?,
        })
    };
    let admin = mk("e2e-admin", &["system:masters"])?;
    let kcm = mk("system:kube-controller-manager", &[])?;
    let sched = mk("system:kube-scheduler", &[])?;
    let node_ids: Vec<Identity> = nodes
        .iter()
        .map(|n| mk(&format!("system:node:{n}"), &["system:nodes"]))
        .collect::<Result<_>>()?;
    let mut csv = String::new();
    for id in [&admin, &kcm, &sched].into_iter().chain(node_ids.iter()) {
        csv += &format!(
            "{},{},{},\"{}\"\n",
            id.token,
            id.user,
            id.user,
            id.groups.join(",")
        );
    }
    let tokens = dir.join("tokens.csv");
    std::fs::write(&tokens, csv)?;
    let kc = |name: &str, id: &Identity| -> Result<PathBuf> {
        let p = dir.join(format!("{name}.kubeconfig"));
        write_kubeconfig(&p, url, &pki.ca_cert, id)?;
        Ok(p)
    };
    let admin_kc = kc("admin", &admin)?;
    let kcm_kc = kc("controller-manager", &kcm)?;
    let sched_kc = kc("scheduler", &sched)?;
    let node_kcs = nodes
        .iter()
        .zip(&node_ids)
        .map(|(n, id)| Ok((n.clone(), kc(&format!("kubelet-{n}"), id)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(Identities {
        tokens,
        admin: admin_kc,
        controller_manager: kcm_kc,
        scheduler: sched_kc,
        nodes: node_kcs,
    })
}

/// kube-controller-manager (every controller) and kube-scheduler.
fn start_controllers(
    bin: &Path,
    dir: &Path,
    pki: &Pki,
    kcm_kc: &Path,
    sched_kc: &Path,
    td: &Teardown,
) -> Result<()> {
    daemon(
        "kube-controller-manager",
        Command::new(bin.join("kube-controller-manager"))
            .args(identity_args(kcm_kc))
            .arg("--controllers=*")
            .arg("--use-service-account-credentials=true")
            .arg(format!(
                "--service-account-private-key-file={}",
                pki.sa_key.display()
            ))
            .arg(format!("--root-ca-file={}", pki.ca_cert.display()))
            .arg(format!(
                "--cluster-signing-cert-file={}",
                pki.ca_cert.display()
            ))
            .arg(format!(
                "--cluster-signing-key-file={}",
                pki.ca_key.display()
            ))
            .arg(format!("--service-cluster-ip-range={SERVICE_RANGE}"))
            .args(LOOPBACK_ONLY),
        dir,
        td,
    )?;
    daemon(
        "kube-scheduler",
        Command::new(bin.join("kube-scheduler"))
            .args(identity_args(sched_kc))
            .args(LOOPBACK_ONLY),
        dir,
        td,
    )?;
    Ok(())
}

/// The controller manager's and the scheduler's own endpoints: loopback, a free port
/// (nothing here scrapes them), and logs at the level that shows their decisions.
const LOOPBACK_ONLY: [&str; 3] = ["--bind-address=127.0.0.1", "--secure-port=0", "--v=2"];

/// A component's identity: one kubeconfig for its client, and for checking who calls
/// its own (loopback) endpoints.
fn identity_args(kubeconfig: &Path) -> [String; 3] {
    [
        "kubeconfig",
        "authentication-kubeconfig",
        "authorization-kubeconfig",
    ]
    .map(|flag| format!("--{flag}={}", kubeconfig.display()))
}

/// Starts `cmd` in a process group of its own, recorded for the teardown; its pid.
fn daemon(name: &str, cmd: &mut Command, dir: &Path, td: &Teardown) -> Result<i32> {
    let log = dir.join("logs").join(format!("{name}.log"));
    let child = process::spawn_daemon(cmd, &log)?;
    td.record_daemon(name, child.id() as i32);
    say(format!(
        "control plane: {name} started (log {})",
        log.display()
    ));
    Ok(child.id() as i32)
}

fn start_etcd(bin: &Path, dir: &Path, td: &Teardown) -> Result<String> {
    let client = format!("http://127.0.0.1:{}", free_local_port()?);
    let peer = format!("http://127.0.0.1:{}", free_local_port()?);
    daemon(
        "etcd",
        Command::new(bin.join("etcd"))
            .arg("--name=e2e")
            .arg(format!("--data-dir={}", dir.join("etcd").display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=e2e={peer}"))
            // No metrics listener on a fixed port.
            .arg("--listen-metrics-urls=")
            // The cluster lives for one run; fsync stalls on a disk shared with other
            // work stopped the API server for ~20 s once (every node NotReady at once,
            // podgc in disruption mode), which is the disk's, not what is measured.
            .arg("--unsafe-no-fsync=true"),
        dir,
        td,
    )?;
    Ok(client)
}

fn start_apiserver(
    bin: &Path,
    dir: &Path,
    pki: &Pki,
    bind_ip: &str,
    etcd_url: &str,
    tokens: &Path,
    td: &Teardown,
) -> Result<i32> {
    let f = |flag: &str, p: &Path| format!("--{flag}={}", p.display());
    daemon(
        "kube-apiserver",
        Command::new(bin.join("kube-apiserver"))
            .arg(format!("--etcd-servers={etcd_url}"))
            .arg(format!("--bind-address={bind_ip}"))
            .arg(format!("--advertise-address={bind_ip}"))
            .arg(format!("--secure-port={API_PORT}"))
            .arg(f("tls-cert-file", &pki.apiserver_cert))
            .arg(f("tls-private-key-file", &pki.apiserver_key))
            .arg(f("client-ca-file", &pki.ca_cert))
            .arg(f("token-auth-file", tokens))
            .arg("--authorization-mode=Node,RBAC")
            .arg("--enable-admission-plugins=NodeRestriction")
            .arg(format!("--service-cluster-ip-range={SERVICE_RANGE}"))
            .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
            .arg(f("service-account-key-file", &pki.sa_pub))
            .arg(f("service-account-signing-key-file", &pki.sa_key))
            .arg(f("kubelet-client-certificate", &pki.kubelet_client_cert))
            .arg(f("kubelet-client-key", &pki.kubelet_client_key))
            // Kubelets are dialled at their node IPs: their host names resolve nowhere.
            .arg("--kubelet-preferred-address-types=InternalIP")
            .arg("--allow-privileged=true")
            .arg("--v=1"),
        dir,
        td,
    )
}

fn wait_ready(bin: &Path, cp: &ControlPlane) -> Result<()> {
    wait::until(
        "the API server's /readyz",
        Duration::from_secs(90),
        Duration::from_millis(500),
        || {
            let out = Command::new(bin.join("kubectl"))
                .arg(format!("--kubeconfig={}", cp.admin_kubeconfig.display()))
                .args(["get", "--raw=/readyz"])
                .output()
                .context("kubectl")?;
            Ok(out.status.success().then_some(()))
        },
    )?;
    say(format!("control plane: API server ready at {}", cp.url));
    Ok(())
}
