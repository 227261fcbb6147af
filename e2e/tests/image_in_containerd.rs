//! The fencecsi image, built from this checkout by scripts/image.sh (or named by
//! FENCECSI_E2E_FENCECSI_IMAGE), imported into a containerd started for the test in its
//! own namespaces and cgroup, and run by runc: its binaries start and the tools the driver
//! calls (mkfs.ext4, mkfs.xfs, losetup, blkid, CA certificates) are in it. Needs no
//! fetched binary: runs wherever containerd, runc and debootstrap are installed, as root
//! (`scripts/setup.sh --tests`, which scripts/test.sh runs, installs them; debootstrap needs
//! a Debian mirror, deb.debian.org unless FENCECSI_DEBIAN_MIRROR names another).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};
use fencecsi_e2e::node::{self, NodeEnv, NodeSpec, CONTAINERD_SOCKET};
use fencecsi_e2e::process::run;
use fencecsi_e2e::teardown::{Made, Teardown};
use fencecsi_e2e::{images, inputs, say};

const IMAGE: &str = "docker.io/library/fencecsi:0.1.0";

fn missing_tools() -> Vec<&'static str> {
    let mut tools = vec!["containerd", "runc", "ctr", "nsenter", "unshare"];
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
fn fencecsi_image_runs_its_binaries_and_tools_under_containerd() {
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
    let state = dir.join("state");
    std::fs::create_dir_all(&state)?;
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
    let ctr_run = |name: &str, argv: &[&str]| -> Result<String> {
        run(Command::new("nsenter")
            .arg("-t")
            .arg(holder.to_string())
            .args([
                "-m",
                "-u",
                "-n",
                "--",
                "ctr",
                "--address",
                CONTAINERD_SOCKET,
                "-n",
                "k8s.io",
                "run",
                "--rm",
                IMAGE,
                name,
            ])
            .args(argv))
    };
    let help = ctr_run("fencecsi-help", &[])?;
    assert!(
        help.contains("--state-dir"),
        "fencecsi-driver --help (the image's CMD) printed:\n{help}"
    );
    say("image: CMD fencecsi-driver --help runs as the image's user");
    for b in ["fencecsi-attacher", "fencecsi-podgc"] {
        let out = ctr_run(&format!("{b}-help"), &[b, "--help"])?;
        assert!(
            out.contains("--leader-election"),
            "{b} --help printed:\n{out}"
        );
    }
    let tools = ctr_run(
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
