//! NodePublishVolume / NodeUnpublishVolume: bind mounts from the staging path
//! to each pod's target path. Ephemeral inline volumes (no staging) are made and
//! removed here too, in `ephemeral`.

use std::path::{Path, PathBuf};

use fencecsi_proto::v1::*;

use super::stage::{block_staging_file, rdev};
use super::{ephemeral, remove_target, top_mount, Node};
use crate::capability;
use crate::error::{CsiError, CsiResult};
use crate::ids::{Parsed, VolumeId};
use crate::kernel::loop_device::{self, AttachOptions};
use crate::kernel::mounts::{self, PathState};
use crate::terms::loop_tag;
use crate::terms::CTX_READONLY;

impl Node {
    /// NodePublishVolume: bind-mounts the staged volume at the pod's target. An ephemeral
    /// inline volume has no staging: it goes to `publish_ephemeral`.
    pub(super) fn node_publish_volume(
        &self,
        req: NodePublishVolumeRequest,
    ) -> CsiResult<NodePublishVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if ephemeral::is_ephemeral(&req.volume_context) {
            return self.publish_ephemeral(&req);
        }
        // Arguments first, then existence (see node_stage_volume).
        let target = self.roots.check("target_path", &req.target_path)?;
        let staging = self
            .roots
            .check("staging_target_path", &req.staging_target_path)?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("volume_capability is required".into()))?;
        let access = capability::parse(cap)?;
        let id = self.our_volume(&req.volume_id)?;
        let readonly = req.readonly
            || req
                .publish_context
                .get(CTX_READONLY)
                .is_some_and(|v| v == "true")
            || access.read_only_mode();
        let _lock = self.inflight.try_lock(id.as_str())?;
        if self.read_meta(&id)?.is_none() {
            return Err(CsiError::NotFound(format!("volume {id} does not exist")));
        }

        let source = if access.block {
            block_staging_file(&staging, &id)
        } else {
            staging.clone()
        };
        if !mounts::is_mountpoint(&source).unwrap_or(false) {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} is not staged at {}",
                staging.display()
            )));
        }
        let (source, want) = self.publish_source(&id, source, access.block, readonly)?;
        if already_published(&target, want, access.block, readonly)? {
            return Ok(NodePublishVolumeResponse {});
        }
        make_target(&target, access.block)?;
        crate::failpoint::hit("publish:after-mkdir");
        mounts::bind_mount(&source, &target, readonly, &access.mount_flags).map_err(|e| {
            CsiError::internal(
                &format!("bind-mounting {} on {}", source.display(), target.display()),
                e,
            )
        })?;
        crate::failpoint::hit("publish:after-bind");
        tracing::info!(volume = %id, target = %target.display(), readonly, block = access.block, "volume published");
        Ok(NodePublishVolumeResponse {})
    }

    /// What the target is bound from, and the device it must show: the staged mount or
    /// device file, or for a read-only raw block target on a writable attachment a
    /// read-only loop device of its own on the same generation (a read-only bind mount
    /// does not stop writes through a device node: the kernel checks MNT_RDONLY on
    /// regular files and directories only).
    fn publish_source(
        &self,
        id: &VolumeId,
        staged: PathBuf,
        block: bool,
        readonly: bool,
    ) -> CsiResult<(PathBuf, (u32, u32))> {
        let want = self.source_device(&staged, block)?;
        if block && readonly {
            if let Some(twin) = self.read_only_twin(id, want)? {
                let want = rdev(&twin)
                    .map_err(|e| CsiError::internal("inspecting the read-only loop device", e))?;
                return Ok((twin, want));
            }
        }
        Ok((staged, want))
    }

    /// For a read-only raw block target: a read-only loop device on the
    /// generation behind the staged device `staged`, when that one is
    /// writable (reused if an earlier or crashed call made it; detached with
    /// the others at unstage). None when the staged device is read-only.
    fn read_only_twin(&self, id: &VolumeId, staged: (u32, u32)) -> CsiResult<Option<PathBuf>> {
        let Some((lo, gen)) = self
            .loops_of(id)?
            .into_iter()
            .find(|(l, _)| rdev(&l.device).ok() == Some(staged))
        else {
            return Err(CsiError::FailedPrecondition(format!(
                "the device staged for volume {id} is not one of its loop devices"
            )));
        };
        if lo.read_only {
            return Ok(None);
        }
        let tag = loop_tag(id, gen, &self.node_id);
        if let Some(twin) = loop_device::find_by_inode(lo.backing_dev, lo.backing_ino)
            .map_err(|e| CsiError::internal("listing loop devices", e))?
            .into_iter()
            .find(|l| l.tag == tag && l.read_only)
        {
            return Ok(Some(twin.device));
        }
        let image = self.generation_path(id, gen);
        let twin = crate::kernel::loop_gate::attach_gated(
            &image,
            &AttachOptions {
                read_only: true,
                // The staged device's mode: the twin reads the same image the same way.
                direct_io: lo.direct_io,
                tag,
                // The same window as the staged device: never the fence trailer.
                size_limit: lo.size_limit,
                logical_block_size: 0,
            },
        )
        .map_err(|e| CsiError::internal(&format!("attaching {} read-only", image.display()), e))?;
        Ok(Some(twin.device))
    }

    /// (major, minor) the mount at `source` is backed by.
    fn source_device(&self, source: &Path, block: bool) -> CsiResult<(u32, u32)> {
        if block {
            return rdev(source).map_err(|e| CsiError::internal("inspecting the staged device", e));
        }
        let m = mounts::mounts_at(source)
            .map_err(|e| CsiError::internal("reading the mount table", e))?;
        m.last().map(|m| (m.major, m.minor)).ok_or_else(|| {
            CsiError::FailedPrecondition(format!("{} is not mounted", source.display()))
        })
    }

    /// NodeUnpublishVolume: unmounts the pod's target and removes it. An ephemeral inline
    /// volume is deleted with it, in `unpublish_ephemeral`.
    pub(super) fn node_unpublish_volume(
        &self,
        req: NodeUnpublishVolumeRequest,
    ) -> CsiResult<NodeUnpublishVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        let target = self.roots.check("target_path", &req.target_path)?;
        // An ID not in our format can only be an ephemeral inline volume's.
        let id = match VolumeId::parse(&req.volume_id)? {
            Parsed::Ours(id) => id,
            Parsed::Foreign => return self.unpublish_ephemeral(&req.volume_id, &target, req.force),
        };
        let _lock = self.inflight.try_lock(id.as_str())?;
        let mounted = !matches!(mounts::path_state(&target), PathState::Missing)
            && mounts::is_mountpoint(&target).unwrap_or(true);
        if !mounted && self.read_meta(&id)?.is_none() {
            return Err(CsiError::NotFound(format!("volume {id} does not exist")));
        }
        self.unmount_path(&target, req.force)?;
        remove_target(&target)?;
        tracing::info!(volume = %id, target = %target.display(), force = req.force, "volume unpublished");
        Ok(NodeUnpublishVolumeResponse {})
    }
}

/// Whether the target already shows device `want` with this read-only flag (a retry:
/// done); ALREADY_EXISTS when it shows anything else.
fn already_published(
    target: &Path,
    want: (u32, u32),
    block: bool,
    readonly: bool,
) -> CsiResult<bool> {
    let Some(m) = top_mount(target)? else {
        return Ok(false);
    };
    // A bind of a device node shows devtmpfs in the mount table:
    // compare the device the target node stands for instead.
    let have = if block {
        rdev(target).ok()
    } else {
        Some((m.major, m.minor))
    };
    if have == Some(want) && m.read_only == readonly {
        return Ok(true);
    }
    Err(CsiError::AlreadyExists(format!(
        "{} is already mounted from another source or with read_only={}",
        target.display(),
        m.read_only
    )))
}

/// The target a bind mount needs: a file for a raw block volume (its parent made), a
/// directory for a filesystem.
fn make_target(target: &Path, block: bool) -> CsiResult<()> {
    if block {
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| CsiError::internal("creating the target's parent", e))?;
        }
        if !target.exists() {
            std::fs::File::create(target)
                .map_err(|e| CsiError::internal("creating the block target file", e))?;
        }
    } else {
        std::fs::create_dir_all(target)
            .map_err(|e| CsiError::internal("creating the target dir", e))?;
    }
    Ok(())
}
