//! The nodes' network: a bridge in the host namespace carrying the API server's address,
//! and per node a veth pair whose inner end is the node's `eth0`. A partition takes the
//! host end down. Inside each node: the default route, IP forwarding, and a DNAT of the
//! `kubernetes` Service IP to the API server (no kube-proxy runs).

use std::process::Command;

use anyhow::Result;

use crate::control_plane::{API_PORT, SERVICE_IP};
use crate::process::{run, sh};
use crate::teardown::{Made, Teardown};

pub struct Bridge {
    pub name: String,
    /// The host's (and API server's) address on it.
    pub ip: String,
    pub prefix: u8,
}

/// A /24 in 10.0.0.0/8 that no route of the host's covers yet.
pub fn free_subnet() -> Result<String> {
    let routes = sh("ip", &["-4", "route", "show", "table", "all"])?;
    for third in (200..250).rev() {
        let net = format!("10.{third}.0");
        if !routes.contains(&format!("{net}.")) && !routes.contains("10.0.0.0/8") {
            return Ok(net);
        }
    }
    anyhow::bail!("no free 10.x.0.0/24 for the suite's bridge")
}

/// Makes the bridge `name` with `<net>.1/24`.
pub fn make_bridge(name: &str, net: &str, td: &Teardown) -> Result<Bridge> {
    sh("ip", &["link", "add", name, "type", "bridge"])?;
    td.record(Made::Link { name: name.into() });
    let ip = format!("{net}.1");
    sh("ip", &["addr", "add", &format!("{ip}/24"), "dev", name])?;
    sh("ip", &["link", "set", name, "up"])?;
    Ok(Bridge {
        name: name.into(),
        ip,
        prefix: 24,
    })
}

/// `nsenter` into the network (and mount, for iptables' lock file, and PID, where that
/// mount namespace's /proc belongs) namespace of `holder`.
pub fn in_node(holder: i32, prog: &str, args: &[&str]) -> Result<String> {
    run(Command::new("nsenter")
        .arg("-t")
        .arg(holder.to_string())
        .args(["-m", "-n", "-p", "--", prog])
        .args(args))
}

/// Wires node `holder` to the bridge: veth `host_end` on the bridge, `eth0` inside with
/// `node_ip`, default route via the bridge, forwarding on, and the Service DNAT.
pub fn wire_node(
    br: &Bridge,
    holder: i32,
    host_end: &str,
    node_ip: &str,
    td: &Teardown,
) -> Result<()> {
    sh(
        "ip",
        &[
            "link",
            "add",
            host_end,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &holder.to_string(),
        ],
    )?;
    td.record(Made::Link {
        name: host_end.into(),
    });
    sh("ip", &["link", "set", host_end, "master", &br.name])?;
    sh("ip", &["link", "set", host_end, "up"])?;
    in_node(holder, "ip", &["link", "set", "lo", "up"])?;
    in_node(
        holder,
        "ip",
        &[
            "addr",
            "add",
            &format!("{node_ip}/{}", br.prefix),
            "dev",
            "eth0",
        ],
    )?;
    in_node(holder, "ip", &["link", "set", "eth0", "up"])?;
    in_node(holder, "ip", &["route", "add", "default", "via", &br.ip])?;
    in_node(holder, "sysctl", &["-q", "-w", "net.ipv4.ip_forward=1"])?;
    let to = format!("{}:{API_PORT}", br.ip);
    // PREROUTING for pods (through the CNI bridge), OUTPUT for the node's own processes.
    for chain in ["PREROUTING", "OUTPUT"] {
        in_node(
            holder,
            "iptables",
            &[
                "-w",
                "-t",
                "nat",
                "-A",
                chain,
                "-d",
                &format!("{SERVICE_IP}/32"),
                "-p",
                "tcp",
                "--dport",
                "443",
                "-j",
                "DNAT",
                "--to-destination",
                &to,
            ],
        )?;
    }
    Ok(())
}

/// Cuts the node off: its veth's host end goes down (both directions stop).
pub fn partition(host_end: &str) -> Result<()> {
    sh("ip", &["link", "set", host_end, "down"])?;
    Ok(())
}

/// Heals a [`partition`].
pub fn heal(host_end: &str) -> Result<()> {
    sh("ip", &["link", "set", host_end, "up"])?;
    Ok(())
}
