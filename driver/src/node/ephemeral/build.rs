//! Making one ephemeral volume (dir, info, image, loop device, filesystem, mount) and
//! taking it apart again.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fencecsi_proto::v1::*;
use serde::Serialize;

use super::names::Eph;
use super::params::{Params, KUBELET_PREFIX};
use crate::error::{CsiError, CsiResult};
use crate::kernel::loop_device::{self, AttachOptions, LoopInfo};
use crate::kernel::mounts;
use crate::kernel::{files, filesystem};
use crate::node::recover::wait_unbound;
use crate::node::stage::{device_users, fs_options};
use crate::node::Node;

const INFO: &str = "volume.json";

/// Shown to operators in each volume's dir; never read back (the kernel is the record).
#[derive(Serialize)]
struct Info<'a> {
    volume_id: &'a str,
    node_id: &'a str,
    target_path: &'a Path,
    size_bytes: u64,
    fs_type: &'a str,
    read_only: bool,
    pod_namespace: Option<&'a str>,
    pod_name: Option<&'a str>,
    pod_uid: Option<&'a str>,
    created_at: i64,
}

impl Node {
    /// Makes the volume and mounts it; returns its device.
    pub(super) fn build_ephemeral(
        &self,
        eph: &Eph,
        req: &NodePublishVolumeRequest,
        target: &Path,
        params: &Params,
        readonly: bool,
        flags: &[String],
    ) -> CsiResult<PathBuf> {
        std::fs::create_dir_all(&eph.dir)
            .map_err(|e| CsiError::internal(&format!("creating {}", eph.dir.display()), e))?;
        let pod = |k: &str| {
            req.volume_context
                .get(&format!("{KUBELET_PREFIX}{k}"))
                .map(String::as_str)
        };
        let info = Info {
            volume_id: &req.volume_id,
            node_id: &self.node_id,
            target_path: target,
            size_bytes: params.size,
            fs_type: &params.fs_type,
            read_only: readonly,
            pod_namespace: pod("pod.namespace"),
            pod_name: pod("pod.name"),
            pod_uid: pod("pod.uid"),
            created_at: crate::backend::meta::now_nanos(),
        };
        let json = serde_json::to_vec_pretty(&info)
            .map_err(|e| CsiError::internal("encoding the volume info", e))?;
        files::write_atomic(&eph.dir.join(INFO), &json)
            .map_err(|e| CsiError::internal("writing the volume info", e))?;
        let image = eph.image();
        files::create_sparse(&image, params.size)
            .map_err(|e| CsiError::internal(&format!("creating {}", image.display()), e))?;
        crate::failpoint::hit("ephemeral:after-image");
        let lo = loop_device::attach(
            &image,
            &AttachOptions {
                read_only: false,
                direct_io: self.cfg.direct_io,
                tag: eph.tag.clone(),
                size_limit: params.size,
                logical_block_size: 0,
            },
        )
        .map_err(|e| CsiError::internal(&format!("attaching {}", image.display()), e))?;
        crate::failpoint::hit("ephemeral:after-attach");
        filesystem::mkfs(&lo.device, &params.fs_type)
            .map_err(|e| CsiError::internal(&format!("mkfs.{}", params.fs_type), e))?;
        crate::failpoint::hit("ephemeral:after-mkfs");
        std::fs::create_dir_all(target)
            .map_err(|e| CsiError::internal("creating the target dir", e))?;
        mounts::mount_device(
            &lo.device,
            target,
            &params.fs_type,
            &fs_options(&params.fs_type, readonly, flags),
            readonly,
        )
        .map_err(|e| {
            let what = format!("mounting {} on {}", lo.device.display(), target.display());
            if e.errno() == Some(nix::errno::Errno::EINVAL) && !flags.is_empty() {
                CsiError::InvalidArgument(format!(
                    "{what}: the kernel refused the mount options {flags:?}: {e}"
                ))
            } else {
                CsiError::internal(&what, e)
            }
        })?;
        crate::failpoint::hit("ephemeral:after-mount");
        Ok(lo.device)
    }

    /// Detaches the volume's devices and removes its dir. Refuses (and changes nothing
    /// more) when a device is mounted anywhere: then the volume is in use.
    pub(super) fn discard_ephemeral(&self, eph: &Eph) -> CsiResult<()> {
        for lo in self.eph_loops(eph)? {
            let users = device_users(&lo.device)?;
            if !users.is_empty() {
                return Err(CsiError::FailedPrecondition(format!(
                    "{} is still mounted at {}",
                    lo.device.display(),
                    users
                        .iter()
                        .map(|m| m.mount_point.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            self.detach_ephemeral(&lo)?;
        }
        remove_dir(&eph.dir)
    }

    pub(super) fn detach_ephemeral(&self, lo: &LoopInfo) -> CsiResult<()> {
        loop_device::detach(&lo.device)
            .map_err(|e| CsiError::internal(&format!("detaching {}", lo.device.display()), e))?;
        // A short-lived opener (udev's probe after mkfs) defers the unbind to its close.
        if !wait_unbound(lo, Duration::from_secs(2)) {
            tracing::warn!(device = %lo.device.display(), "loop device still bound after detach: it is released at its last close");
        }
        Ok(())
    }
}

/// Removes one of our volume dirs (image, info, temp files): never anything else.
pub(super) fn remove_dir(dir: &Path) -> CsiResult<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {
            let _ = dir.parent().map(files::fsync_dir);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CsiError::internal(
            &format!("removing {}", dir.display()),
            e,
        )),
    }
}
