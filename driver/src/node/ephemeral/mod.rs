//! CSI ephemeral inline volumes: a volume that lives exactly as long as one pod's
//! NodePublishVolume ... NodeUnpublishVolume on this node.
//!
//! Kubernetes calls only NodePublishVolume for an inline `csi:` volume of a pod (no
//! CreateVolume, no ControllerPublish, no NodeStage). With `podInfoOnMount: true` in the
//! CSIDriver it marks the call with `csi.storage.k8s.io/ephemeral: "true"` in the volume
//! context, next to the pod's `volumeAttributes`; the volume ID is its own invention
//! (`csi-<sha256(pod UID + volume name)>`). NodeUnpublishVolume at the pod's end is the
//! only other call.
//!
//! Where the data lives: `<node state dir>/ephemeral/<key>/data.img` (default
//! `<kubelet dir>/plugins/<driver>/ephemeral/...`), where `<key>` is 32 hex digits of
//! sha256(volume ID). Not in the shared state dir: nothing but this node ever uses the
//! volume, so no controller record, capacity count, garbage collection or state-dir
//! identity check has anything to say about it, and a missing or wrong state dir never
//! stands between a pod and its scratch space or keeps its cleanup from running. The
//! space comes from the kubelet's filesystem, like an emptyDir's. The image has no fence
//! trailer: it is never fenced, since it never leaves this node.
//!
//! Publish, step by step (each step's failpoint named): the dir and an informational
//! `volume.json`, the sparse image (`ephemeral:after-image`), a loop device tagged
//! `fcsie:<key>:<owner tag>` (`ephemeral:after-attach`), mkfs (`ephemeral:after-mkfs`), the
//! mount at the target (`ephemeral:after-mount`). What is published is read back from the
//! kernel, never from a record: the target's mount, and the tagged loop device's size.
//!
//! Nothing leaks on a crash: a volume is complete exactly when its device is mounted.
//! Anything of ours that is not mounted anywhere (a dir, an image, a tagged device) is a
//! publish that never completed, or an unpublish that did not finish. The sweep removes
//! it at node start-up (before the plugin serves) and at every recovery pass; a publish
//! that finds such leftovers for its own volume discards them and starts afresh (no data
//! can be in a volume that was never mounted); a failed publish in a live plugin rolls
//! back at once. A mounted one is in use and left alone. So a node reboot, which unmounts
//! everything, also ends every ephemeral volume's data: like a pod's emptyDir on tmpfs.
//!
//! The parts, by what they do: `params.rs` (the volume context's attributes and the
//! quantity parser for `size`), `names.rs` (a volume's key, dir and loop tag), `build.rs`
//! (making one volume and taking it apart), `sweep.rs` (removing what is not mounted).
//! The RPC entry points, which `publish.rs` and `volume_stats.rs` branch into, are here.

mod build;
mod names;
mod params;
mod sweep;

pub use names::{key_of, owner_tag, parse_tag, volume_dir, DIR, IMAGE};
pub use params::{
    is_ephemeral, parse_params, parse_quantity, Params, ATTR_FS_TYPE, ATTR_SIZE, CTX_EPHEMERAL,
    DEFAULT_SIZE, MAX_SIZE,
};
pub use sweep::SweepReport;

use std::collections::BTreeSet;
use std::path::Path;

use fencecsi_proto::v1::*;

use super::stage::{device_users, rdev};
use super::{remove_target, top_mount, Node};
use crate::capability;
use crate::error::{CsiError, CsiResult};
use crate::ids::{Parsed, VolumeId};
use crate::kernel::loop_device::LoopInfo;
use crate::kernel::mounts;
use build::remove_dir;
use names::is_kubelet_ephemeral_id;

impl Node {
    /// An ID an ephemeral volume may have: a safe token not in our persistent format.
    fn ephemeral_id(raw: &str) -> CsiResult<()> {
        match VolumeId::parse(raw)? {
            Parsed::Foreign => Ok(()),
            Parsed::Ours(_) => Err(CsiError::InvalidArgument(format!(
                "volume ID {raw} has the form of this driver's persistent volumes; an ephemeral volume cannot use it"
            ))),
        }
    }

    /// NodePublishVolume of an ephemeral inline volume: every argument checked, then the
    /// volume made and mounted at the target (`build`); a failure is rolled back at once.
    pub(super) fn publish_ephemeral(
        &self,
        req: &NodePublishVolumeRequest,
    ) -> CsiResult<NodePublishVolumeResponse> {
        // Every argument before anything is looked at or made.
        let target = self.roots.check("target_path", &req.target_path)?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("volume_capability is required".into()))?;
        let access = capability::parse(cap)?;
        if access.block {
            return Err(CsiError::InvalidArgument(
                "an ephemeral volume is a filesystem: the block access type is not supported"
                    .into(),
            ));
        }
        Self::ephemeral_id(&req.volume_id)?;
        let params = parse_params(
            &req.volume_context,
            access.fs_type.as_deref(),
            &self.cfg.default_fs_type,
        )?;
        let readonly = req.readonly || access.read_only_mode();
        let id = req.volume_id.as_str();
        let eph = self.eph(id);
        let _lock = self.inflight.try_lock(eph.lock_key())?;
        let loops = self.eph_loops(&eph)?;

        if already_published(id, &target, &loops, &params, readonly)? {
            return Ok(NodePublishVolumeResponse {});
        }
        for lo in &loops {
            let users = device_users(&lo.device)?;
            if let Some(u) = users.first() {
                return Err(CsiError::FailedPrecondition(format!(
                    "ephemeral volume {id} is already published at {}: an ephemeral volume has one target",
                    u.mount_point.display()
                )));
            }
        }
        if !loops.is_empty() || eph.dir.exists() {
            // Mounted nowhere, so nothing uses it: an earlier attempt died half-way
            // (or its mount went). Start afresh.
            tracing::info!(volume = id, dir = %eph.dir.display(), devices = loops.len(),
                "discarding what an unfinished publish of this ephemeral volume left");
            self.discard_ephemeral(&eph)?;
        }
        let created_target = !target.exists();
        match self.build_ephemeral(&eph, req, &target, &params, readonly, &access.mount_flags) {
            Ok(device) => {
                tracing::info!(volume = id, target = %target.display(), device = %device.display(),
                    size = params.size, fs = %params.fs_type, readonly, "ephemeral volume published");
                Ok(NodePublishVolumeResponse {})
            }
            Err(e) => {
                // The mount is the last step: nothing failed after it, so nothing is
                // mounted. Undo the rest now rather than at the next sweep.
                if let Err(undo) = self.discard_ephemeral(&eph) {
                    tracing::warn!(volume = id, error = %undo, "rolling back a failed ephemeral publish; the next sweep retries");
                }
                if created_target {
                    let _ = remove_target(&target);
                }
                Err(e)
            }
        }
    }

    /// NodeUnpublishVolume of an ephemeral inline volume: unmounts the target, detaches the
    /// device and deletes the volume's dir; with `force`, its other mounts under the
    /// kubelet dir go first.
    pub(super) fn unpublish_ephemeral(
        &self,
        raw_id: &str,
        target: &Path,
        force: bool,
    ) -> CsiResult<NodeUnpublishVolumeResponse> {
        let eph = self.eph(raw_id);
        let _lock = self.inflight.try_lock(eph.lock_key())?;
        let loops = self.eph_loops(&eph)?;
        let here = mounts::mounts_at(target)
            .map_err(|e| CsiError::internal("reading the mount table", e))?;
        if loops.is_empty() && !eph.dir.exists() {
            // Nothing of this volume here: done already, or never ours.
            if here.is_empty() && is_kubelet_ephemeral_id(raw_id) {
                remove_target(target)?;
                return Ok(NodeUnpublishVolumeResponse {});
            }
            return Err(CsiError::NotFound(format!(
                "volume {raw_id} does not exist"
            )));
        }
        let devs: BTreeSet<(u32, u32)> =
            loops.iter().filter_map(|l| rdev(&l.device).ok()).collect();
        if let Some(other) = here.iter().find(|m| !devs.contains(&(m.major, m.minor))) {
            return Err(CsiError::FailedPrecondition(format!(
                "{} holds a mount that is not ephemeral volume {raw_id} ({}); left alone",
                target.display(),
                other.source
            )));
        }
        if !here.is_empty() {
            self.unmount_path(target, force)?;
        }
        crate::failpoint::hit("ephemeral-unpublish:after-unmount");
        remove_target(target)?;
        for lo in &loops {
            if rdev(&lo.device).is_err() {
                continue; // gone since the listing
            }
            let users = device_users(&lo.device)?;
            if !users.is_empty() {
                if !force {
                    return Err(CsiError::FailedPrecondition(format!(
                        "ephemeral volume {raw_id} is still mounted at {} (nothing more was changed); unmount those first, or retry with force",
                        users
                            .iter()
                            .map(|m| m.mount_point.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
                self.unmount_users_under_roots(&users)?;
            }
            self.detach_ephemeral(lo)?;
        }
        crate::failpoint::hit("ephemeral-unpublish:after-detach");
        remove_dir(&eph.dir)?;
        tracing::info!(volume = raw_id, target = %target.display(), force, "ephemeral volume unpublished and deleted");
        Ok(NodeUnpublishVolumeResponse {})
    }

    /// NodeGetVolumeStats of an ephemeral volume at its target.
    pub(super) fn stats_ephemeral(
        &self,
        raw_id: &str,
        path: &Path,
    ) -> CsiResult<NodeGetVolumeStatsResponse> {
        let eph = self.eph(raw_id);
        let loops = self.eph_loops(&eph)?;
        if loops.is_empty() && !eph.dir.exists() {
            return Err(CsiError::NotFound(format!(
                "volume {raw_id} does not exist"
            )));
        }
        if let Some(stale) = super::volume_stats::stale_or_missing(path, "")? {
            return Ok(stale);
        }
        let mounted = mounts::mounts_at(path)
            .map_err(|e| CsiError::internal("reading the mount table", e))?
            .last()
            .is_some_and(|m| {
                loops
                    .iter()
                    .any(|l| rdev(&l.device).ok() == Some((m.major, m.minor)))
            });
        if !mounted {
            return Err(CsiError::NotFound(format!(
                "ephemeral volume {raw_id} is not mounted at {}",
                path.display()
            )));
        }
        let healthy = eph.image().exists();
        Ok(NodeGetVolumeStatsResponse {
            usage: super::volume_stats::fs_usage(path)?,
            volume_condition: super::volume_stats::condition(
                !healthy,
                if healthy {
                    "healthy".into()
                } else {
                    format!("the image {} is gone", eph.image().display())
                },
            ),
        })
    }
}

/// Whether the target already shows this ephemeral volume as asked (a retry: done);
/// ALREADY_EXISTS when it shows it otherwise, or anything else.
fn already_published(
    id: &str,
    target: &Path,
    loops: &[LoopInfo],
    params: &Params,
    readonly: bool,
) -> CsiResult<bool> {
    let Some(m) = top_mount(target)? else {
        return Ok(false);
    };
    let ours = loops
        .iter()
        .find(|l| rdev(&l.device).ok() == Some((m.major, m.minor)));
    match ours {
        Some(lo)
            if lo.size_bytes == params.size
                && m.fs_type == params.fs_type
                && m.read_only == readonly =>
        {
            Ok(true)
        }
        Some(lo) => Err(CsiError::AlreadyExists(format!(
            "ephemeral volume {id} is already published at {} with size {} bytes, {}, read_only={}; this call asks for {} bytes, {}, read_only={readonly}",
            target.display(),
            lo.size_bytes,
            m.fs_type,
            m.read_only,
            params.size,
            params.fs_type
        ))),
        None => Err(CsiError::AlreadyExists(format!(
            "{} is already mounted from another source ({})",
            target.display(),
            m.source
        ))),
    }
}
