//! The fencecsi image, built from this checkout by scripts/image.sh (or named by
//! FENCECSI_E2E_FENCECSI_IMAGE), imported into a containerd started for the test in its
//! own namespaces and cgroup, and run by runc:
//! - its three binaries start, as the image's user, and the tools the driver calls
//!   (mkfs.ext4, mkfs.xfs, losetup, blkid, CA certificates) are in it;
//! - its driver, with the node DaemonSet's container settings (root, privileged, read-only
//!   root filesystem, the DaemonSet's host paths, the kubelet dir's mounts propagated back
//!   to the node), serves CSI on a socket: an ext4 and an xfs volume are made, staged on a
//!   loop device, written, restaged with their data intact, and fenced, checked on the
//!   kernel's objects from the host.
//!
//! Needs no fetched binary: runs wherever containerd, runc and debootstrap are installed, as
//! root (`scripts/setup.sh --tests`, which scripts/test.sh runs, installs them; debootstrap
//! needs a Debian mirror, deb.debian.org unless FENCECSI_DEBIAN_MIRROR names another).

#[path = "image_in_containerd/csi_from_image.rs"]
mod csi_from_image;

use std::path::PathBuf;

use anyhow::{Context, Result};
use fencecsi_e2e::image_run::NodeCtr;
use fencecsi_e2e::node::{self, NodeEnv, NodeSpec};
use fencecsi_e2e::teardown::{Made, Teardown};
use fencecsi_e2e::{images, inputs, say, state_fs};

const IMAGE: &str = "docker.io/library/fencecsi:0.1.0";

fn missing_tools() -> Vec<&'static str> {
    let mut tools = vec![
        "containerd",
        "runc",
        "ctr",
        "nsenter",
        "unshare",
        "mkfs.xfs",
    ];
    if std::env::var_os("FENCECSI_E2E_FENCECSI_IMAGE").is_none() {
        tools.push("debootstrap");
    }
    let mut missing: Vec<&str> = tools
        .into_iter()
        .filter(|t| inputs::which(t).is_none())
        .collect();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root");
    }
    missing
}

#[test]
fn fencecsi_image_runs_its_binaries_and_serves_csi_under_containerd() {
    let missing = missing_tools();
    if !missing.is_empty() {
        skipped(&format!(
            "\n==== SKIPPED: fencecsi-e2e image_in_containerd ====\nmissing: {}\n(scripts/setup.sh --tests, which scripts/test.sh runs, installs containerd, runc and debootstrap)\n===================================================\n",
            missing.join(", ")
        ));
        return;
    }
    let td = Teardown::new();
    td.on_signals();
    let guard = td.guard();
    let result = check_image(&td);
    drop(guard);
    result.unwrap();
}

fn check_image(td: &Teardown) -> Result<()> {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let image = images::fencecsi_image(&repo)?;
    let id = std::process::id();
    let dir = repo.join("target").join("e2e").join(format!("image-{id}"));
    std::fs::create_dir_all(&dir)?;
    td.record(Made::Dir { path: dir.clone() });
    // Made before the node, so that its loop devices are detached and it is unmounted
    // only once the node and the plugin are gone.
    let state = state_fs::make(&dir, 2 << 30, td)?;
    let cg = format!("fencecsi-e2e-image-{id}");
    fencecsi_e2e::cgroups::create(&cg)?;
    td.record(Made::Cgroup { rel: cg.clone() });
    let spec = NodeSpec {
        name: "e2e-image".into(),
        ip: String::new(),
        host_end: String::new(),
        cgroup: format!("{cg}/node"),
        dir: dir.join("node"),
        pod_subnet: "10.254.0.0/24".into(),
    };
    let cni = inputs::which("bridge").unwrap_or_else(|| PathBuf::from("/usr/lib/cni/bridge"));
    let archives = vec![image];
    let env = NodeEnv {
        k8s_bin: &dir,
        cni_bin: cni.parent().context("cni dir")?,
        pause_image: "registry.k8s.io/pause:3.10",
        state_dir: &state,
        ca_cert: &dir,
        bridge: None,
        archives: &archives,
    };
    let holder = node::start_runtime(&spec, &env, td)?;
    let ctr = NodeCtr { holder };
    check_binaries_and_tools(&ctr)?;
    let plugin = csi_from_image::Plugin::start(&ctr, IMAGE, &spec, &state, &cg, td)?;
    plugin.check_volumes(&["ext4", "xfs"])
}

/// The image's binaries start as the image configures them, and the driver's tools are in
/// it.
fn check_binaries_and_tools(ctr: &NodeCtr) -> Result<()> {
    let help = ctr.run_image(IMAGE, "fencecsi-help", &[])?;
    assert!(
        help.contains("--state-dir"),
        "fencecsi-driver --help (the image's CMD) printed:\n{help}"
    );
    say("image: CMD fencecsi-driver --help runs as the image's user");
    for b in ["fencecsi-attacher", "fencecsi-podgc"] {
        let out = ctr.run_image(IMAGE, &format!("{b}-help"), &[b, "--help"])?;
        assert!(
            out.contains("--leader-election"),
            "{b} --help printed:\n{out}"
        );
    }
    let tools = ctr.run_image(
        IMAGE,
        "fencecsi-tools",
        &["sh", "-c", "id -u; mkfs.ext4 -V 2>&1 | head -1; mkfs.xfs -V; losetup --version; blkid --version; test -s /etc/ssl/certs/ca-certificates.crt && echo ca-ok"],
    )?;
    say(format!(
        "image: tools: {}",
        tools.trim().replace('\n', " | ")
    ));
    assert!(
        tools.starts_with("65532"),
        "the image's default user is 65532: {tools}"
    );
    for want in ["mke2fs", "mkfs.xfs", "losetup", "blkid", "ca-ok"] {
        assert!(
            tools.contains(want),
            "{want} missing from the image: {tools}"
        );
    }
    Ok(())
}

/// The SKIPPED banner, written to the process's stderr itself: libtest captures
/// `eprintln!` of a passing test, and a skip must be seen.
fn skipped(msg: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(msg.as_bytes());
}
