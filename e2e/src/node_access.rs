//! A way into the nodes, as the upstream suite's kubelet-restart specs ([Disruptive])
//! expect one: SSH as root to each node's address, where `systemctl stop|start|restart
//! kubelet` and `systemctl show kubelet` act on that node's kubelet.
//!
//! Each node gets its own sshd, run inside the node's namespaces and cgroup (so `mount`
//! shows the node's mounts, and a kubelet it starts is the node's and is cleaned up with
//! it), listening on the node's address only, with a key made for this run. `systemctl`
//! is a script of this suite, bound over `/usr/local/sbin` inside the node's mount
//! namespace only (the first directory of root's PATH in an SSH session); it knows one
//! unit, the kubelet, by a pid file.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::cluster::Cluster;
use crate::node::{self, Node};
use crate::process::run;
use crate::teardown::Teardown;
use crate::{say, wait};

pub const SSHD: &str = "/usr/sbin/sshd";

/// The client's side: the private key the suite logs in with, as root.
#[derive(Debug, Clone)]
pub struct Access {
    pub key: PathBuf,
    pub user: String,
}

/// Starts an sshd in every node and returns the key that opens them.
pub fn open(c: &Cluster, td: &Teardown) -> Result<Access> {
    let dir = c.run_dir.join("ssh");
    std::fs::create_dir_all(&dir)?;
    let key = dir.join("id_ed25519");
    keygen(&key)?;
    let authorized = dir.join("authorized_keys");
    std::fs::copy(key.with_extension("pub"), &authorized)?;
    for n in &c.nodes {
        let kubeconfig = c.node_kubeconfig(&n.spec.name)?;
        let kubelet = node::kubelet_argv(&n.spec, &c.node_env(), &kubeconfig)?;
        start_sshd(n, &authorized, &kubelet, td)
            .with_context(|| format!("a way into {}", n.spec.name))?;
    }
    say(format!(
        "node access: sshd on every node, root with {}",
        key.display()
    ));
    Ok(Access {
        key,
        user: "root".into(),
    })
}

fn keygen(path: &Path) -> Result<()> {
    run(Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "fencecsi-e2e", "-f"])
        .arg(path))
    .with_context(|| format!("ssh-keygen {}", path.display()))?;
    Ok(())
}

fn start_sshd(n: &Node, authorized: &Path, kubelet: &[String], td: &Teardown) -> Result<()> {
    let dir = n.spec.dir.join("ssh");
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin)?;
    let host_key = dir.join("host_ed25519");
    keygen(&host_key)?;
    let pid_file = dir.join("kubelet.pid");
    // The kubelet the suite started is the unit's first process; the script runs in
    // the node's PID namespace, so it is named by its pid there.
    let kubelet_pid = node::child_running(n.kubelet_pgid, "kubelet")
        .and_then(node::pid_in_namespace)
        .context("the node's kubelet is not running")?;
    std::fs::write(&pid_file, format!("{kubelet_pid}\n"))?;
    let log = n.spec.own_logs().join("kubelet.log");
    write_executable(
        &bin.join("systemctl"),
        &systemctl_script(&pid_file, &log, kubelet),
    )?;
    let config = dir.join("sshd_config");
    std::fs::write(
        &config,
        sshd_config(&n.spec.ip, &host_key, authorized, &dir.join("sshd.pid")),
    )?;
    run(Command::new("nsenter")
        .arg("-t")
        .arg(n.holder.to_string())
        .args(["-m", "-p", "--", "sh", "-c"])
        .arg(format!(
            "set -e; mkdir -p /run/sshd; mount --bind '{}' /usr/local/sbin",
            bin.display()
        )))
    .context("binding systemctl into the node")?;
    let config_s = config.display().to_string();
    let argv = node::node_daemon_argv(n.holder, &[SSHD, "-D", "-e", "-f", &config_s]);
    node::spawn_in_node(&n.spec, &argv, "sshd", "sshd", td)?;
    let addr: SocketAddr = format!("{}:22", n.spec.ip).parse()?;
    wait::until(
        &format!("{}'s sshd", n.spec.name),
        Duration::from_secs(20),
        Duration::from_millis(100),
        || {
            Ok(TcpStream::connect_timeout(&addr, Duration::from_secs(1))
                .is_ok()
                .then_some(()))
        },
    )?;
    Ok(())
}

fn write_executable(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}

fn sshd_config(ip: &str, host_key: &Path, authorized: &Path, pid: &Path) -> String {
    format!(
        "ListenAddress {ip}:22
HostKey {host_key}
AuthorizedKeysFile {authorized}
PidFile {pid}
AllowUsers root
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The keys live under the build directory, whose modes are not sshd's business here.
StrictModes no
",
        host_key = host_key.display(),
        authorized = authorized.display(),
        pid = pid.display(),
    )
}

/// Single-quotes `s` for sh.
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// `systemctl` for one unit, the kubelet: stop waits (bounded) for the process to end,
/// start runs the kubelet's own command line in the background of the node.
fn systemctl_script(pid_file: &Path, log: &Path, kubelet: &[String]) -> String {
    let argv: Vec<String> = kubelet.iter().map(|a| quoted(a)).collect();
    format!(
        r#"#!/bin/sh
# systemctl of a fencecsi e2e node: one unit, kubelet.
pid_file={pid_file}
# A kubelet that died unreaped (a zombie) still reads "kubelet" as its name: not running.
# Name and state come from one read of its status, so a process reaped between two
# reads cannot look alive.
running() {{
  pid=$(cat "$pid_file" 2>/dev/null) && [ -n "$pid" ] || return 1
  status=$(cat "/proc/$pid/status" 2>/dev/null) || return 1
  printf '%s\n' "$status" | grep -q '^Name:[[:space:]]*kubelet$' &&
    ! printf '%s\n' "$status" | grep -q '^State:[[:space:]]*Z'
}}
# A kubelet that ends between the check and the signal is what stop wants. Each wait is
# bounded: 30 s for SIGTERM, then 10 s for SIGKILL to take (a process still tearing
# down its threads is not a zombie yet).
stop() {{
  running || return 0
  kill -TERM "$pid" 2>/dev/null
  i=0
  while running && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
  running || return 0
  kill -KILL "$pid" 2>/dev/null
  i=0
  while running && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  ! running
}}
# The kubelet runs under a shell of its own that waits for it, so it is reaped when it
# ends (the node's PID 1 reaps nothing).
start() {{
  running && return 0
  rm -f "$pid_file"
  setsid sh -c '"$@" & echo $! >"$0"; wait' "$pid_file" {argv} >>{log} 2>&1 </dev/null &
  # Started once the kubelet runs under its name (the pid is written before the exec).
  i=0
  while ! running && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  running
}}
case "$1 $2" in
  "stop kubelet") stop ;;
  "start kubelet") start ;;
  "restart kubelet") stop; start ;;
  "show kubelet") if running; then echo active; else echo inactive; fi ;;
  "is-active kubelet") if running; then echo active; else echo inactive; exit 3; fi ;;
  *) echo "systemctl here knows one unit, kubelet: start, stop, restart, show, is-active" >&2; exit 1 ;;
esac
"#,
        pid_file = quoted(&pid_file.display().to_string()),
        log = quoted(&log.display().to_string()),
        argv = argv.join(" "),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_a_quote() {
        assert_eq!(quoted("a'b"), r"'a'\''b'");
    }

    #[test]
    fn the_script_knows_only_the_kubelet() {
        let s = systemctl_script(
            Path::new("/n/kubelet.pid"),
            Path::new("/n/kubelet.log"),
            &["/bin/kubelet".into(), "--v=2".into()],
        );
        assert!(s.contains("\"$pid_file\" '/bin/kubelet' '--v=2' >>'/n/kubelet.log'"));
        assert!(s.contains(r#""show kubelet")"#));
    }

    /// The script on real processes: a "kubelet" (a copy of sleep under that name) is
    /// started, seen, stopped and seen stopped, several times over; a stop of a stopped
    /// unit succeeds.
    #[test]
    fn the_script_starts_and_stops_a_kubelet() {
        /// Stops whatever the test started and removes its directory, also on failure.
        struct Scratch(PathBuf);
        impl Drop for Scratch {
            fn drop(&mut self) {
                let _ = Command::new(self.0.join("systemctl"))
                    .args(["stop", "kubelet"])
                    .status();
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let dir = Scratch(
            std::env::temp_dir().join(format!("fencecsi-systemctl-{}", std::process::id())),
        );
        std::fs::create_dir_all(&dir.0).unwrap();
        let kubelet = dir.0.join("kubelet");
        std::fs::copy("/bin/sleep", &kubelet).unwrap();
        let script = dir.0.join("systemctl");
        let pid_file = dir.0.join("kubelet.pid");
        write_executable(
            &script,
            &systemctl_script(
                &pid_file,
                &dir.0.join("kubelet.log"),
                &[kubelet.display().to_string(), "600".into()],
            ),
        )
        .unwrap();
        let ctl = |verb: &str| {
            let out = Command::new(&script)
                .args([verb, "kubelet"])
                .output()
                .unwrap();
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).trim().to_string(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            )
        };
        for round in 0..5 {
            assert_eq!(ctl("show").1, "inactive", "round {round}");
            assert!(ctl("start").0, "round {round}");
            assert_eq!(ctl("show").1, "active", "round {round}");
            let pid: i32 = std::fs::read_to_string(&pid_file)
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            let (ok, _, err) = ctl("stop");
            assert!(ok && err.is_empty(), "round {round}: stop failed: {err}");
            assert_eq!(ctl("show").1, "inactive", "round {round}");
            assert!(
                std::fs::read_to_string(format!("/proc/{pid}/status")).map_or(true, |s| s
                    .lines()
                    .any(|l| l.starts_with("State:") && l.contains('Z'))),
                "round {round}: the kubelet outlived its stop"
            );
        }
        assert!(ctl("stop").0, "stopping a stopped unit");
    }
}
