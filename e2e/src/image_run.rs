//! Running what the fencecsi image holds under containerd and runc, in a node's
//! namespaces, without a kubelet.
//!
//! The node plugin runs with the node DaemonSet's container settings: from the image's root
//! filesystem, read-only (`readOnlyRootFilesystem`), as root and privileged, with its host
//! paths (/dev, the kubelet dir with its mounts propagated back to the node, the state dir,
//! the socket dir). ctr 1.6 has no `--user` and the image's default user is 65532, so the
//! plugin is started with `ctr run --rootfs` on the image unpacked into a snapshot of its
//! own (`ctr images mount --rw`, where runc makes the mount points, as on a kubelet's
//! container layer), which takes the default spec's root user; `--read-only` then makes
//! that root read-only.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::node::CONTAINERD_SOCKET;
use crate::process::run;

/// `ctr` against the containerd of the node whose namespaces `holder` holds.
pub struct NodeCtr {
    pub holder: i32,
}

/// Where the image's root filesystem is mounted, in the node's mount namespace (its /run
/// is the node's own tmpfs).
pub const IMAGE_ROOTFS: &str = "/run/fencecsi-e2e-image-rootfs";

impl NodeCtr {
    fn ctr(&self) -> Command {
        let mut c = Command::new("nsenter");
        c.arg("-t")
            .arg(self.holder.to_string())
            .args([
                "-m",
                "-u",
                "-n",
                "-p",
                "--",
                "ctr",
                "--address",
                CONTAINERD_SOCKET,
            ])
            .args(["-n", "k8s.io"]);
        c
    }

    /// `ctr run --rm image name argv…` as the image configures it (its user, its CMD when
    /// `argv` is empty); returns what it printed.
    pub fn run_image(&self, image: &str, name: &str, argv: &[&str]) -> Result<String> {
        run(self.ctr().args(["run", "--rm", image, name]).args(argv))
    }

    /// Mounts a writable snapshot of the image's root filesystem at [`IMAGE_ROOTFS`] (the
    /// image itself does not change).
    pub fn mount_image(&self, image: &str) -> Result<()> {
        run(Command::new("nsenter")
            .arg("-t")
            .arg(self.holder.to_string())
            .args(["-m", "-p", "--", "mkdir", "-p", IMAGE_ROOTFS]))?;
        run(self
            .ctr()
            .args(["images", "mount", "--rw", image, IMAGE_ROOTFS]))
        .with_context(|| format!("ctr images mount {image}"))?;
        Ok(())
    }

    /// Starts `argv` from [`IMAGE_ROOTFS`] as the node DaemonSet's plugin container:
    /// root, privileged, root filesystem read-only, the DaemonSet's host paths, in cgroup `cgroup` (relative to each
    /// hierarchy's root), its output in `log`. Detached: the caller stops it (by its
    /// cgroup).
    pub fn start_privileged(
        &self,
        name: &str,
        cgroup: &str,
        log: &Path,
        argv: &[&str],
    ) -> Result<()> {
        let bind = |src: &str, dst: &str| format!("type=bind,src={src},dst={dst},options=rbind:rw");
        // `mountPropagation: Bidirectional`: what the plugin mounts below the kubelet dir
        // is the node's too (runc wants the root shared for that, as the kubelet asks).
        let kubelet =
            "type=bind,src=/var/lib/kubelet,dst=/var/lib/kubelet,options=rbind:rshared:rw";
        run(self
            .ctr()
            .args(["run", "--detach", "--rootfs", "--read-only", "--privileged"])
            .arg("--rootfs-propagation=rshared")
            .arg(format!("--cgroup=/{cgroup}"))
            .arg(format!("--log-uri=file://{}", log.display()))
            .args(["--mount", &bind("/dev", "/dev")])
            .args(["--mount", kubelet])
            .args(["--mount", &bind("/var/lib/fencecsi", "/var/lib/fencecsi")])
            .args([
                "--mount",
                &bind("/var/lib/kubelet/plugins/loop.fencecsi.io", "/csi"),
            ])
            .args([IMAGE_ROOTFS, name])
            .args(argv))
        .with_context(|| format!("ctr run {name} from the image's root filesystem"))?;
        Ok(())
    }
}
