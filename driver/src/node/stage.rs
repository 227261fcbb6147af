//! NodeStageVolume / NodeUnstageVolume: the loop device and the staging mount.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use fencecsi_proto::v1::*;

use super::{remove_target, top_mount, Node};
use crate::backend::meta::VolumeMeta;
use crate::capability;
use crate::error::{CsiError, CsiResult};
use crate::ids::VolumeId;
use crate::kernel::filesystem::{self, FsKind};
use crate::kernel::loop_device::{self, AttachOptions, LoopInfo};
use crate::kernel::mounts::{self, PathState};
use crate::locks::PublishLock;
use crate::terms::loop_tag;
use crate::terms::{generation_from_context, CTX_FS_TYPE, CTX_READONLY};

/// (major, minor) of a device node.
pub(crate) fn rdev(path: &Path) -> std::io::Result<(u32, u32)> {
    let r = std::fs::metadata(path)?.rdev();
    Ok((libc::major(r), libc::minor(r)))
}

/// Every mount of a loop device (none when it vanished meanwhile).
pub(super) fn device_users(device: &Path) -> CsiResult<Vec<mounts::MountEntry>> {
    let Ok((major, minor)) = rdev(device) else {
        return Ok(Vec::new());
    };
    mounts::mounts_of_device(major, minor)
        .map_err(|e| CsiError::internal("reading the mount table", e))
}

/// Mount points for a message.
fn mount_points(users: &[mounts::MountEntry]) -> String {
    users
        .iter()
        .map(|m| m.mount_point.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where a block volume's device is bind-mounted inside its staging dir.
pub(crate) fn block_staging_file(staging: &Path, id: &VolumeId) -> PathBuf {
    staging.join(id.as_str())
}

/// Mount options we always add: xfs refuses a second mount of the same UUID
/// (a clone after a fence shares it with the fenced copy), and read-only
/// attachments must not replay a journal they cannot write.
pub(crate) fn fs_options(fs: &str, readonly: bool, flags: &[String]) -> Vec<String> {
    let mut opts = flags.to_vec();
    if fs == "xfs" {
        opts.push("nouuid".into());
    }
    if readonly {
        opts.push(if fs == "xfs" {
            "norecovery".into()
        } else {
            "noload".into()
        });
    }
    opts
}

/// An xfs filesystem smaller than its device (a volume grown while unstaged, or
/// restored from a snapshot into a larger one) is grown once mounted, the only way
/// xfs grows. Sizes come from the superblock, so an up-to-date volume costs one read.
fn grow_xfs_to_device(device: &Path, staging: &Path) -> CsiResult<()> {
    let fs_size = filesystem::xfs_size(device)
        .map_err(|e| CsiError::internal("reading the xfs superblock", e))?;
    let dev_size = filesystem::block_device_size(device)
        .map_err(|e| CsiError::internal("reading the device size", e))?;
    if dev_size < fs_size + 4096 {
        return Ok(());
    }
    filesystem::grow(device, staging, "xfs")
        .map_err(|e| CsiError::internal("growing xfs to its device", e))?;
    tracing::info!(device = %device.display(), from = fs_size, to = dev_size, "xfs grown to its device at stage");
    Ok(())
}

/// An ext4 filesystem smaller than its device was expanded while it could not
/// grow online (NodeExpandVolume without CAP_SYS_RESOURCE answers
/// FAILED_PRECONDITION and promises this): grow it offline, before it is
/// mounted. Sizes are read from the superblock, so an up-to-date volume
/// costs one 1 KiB read; a gap under one 4 KiB block (a size cut by
/// limit_bytes to a non-aligned value) is left alone.
fn grow_ext4_to_device(device: &Path) -> CsiResult<()> {
    let fs_size = filesystem::ext4_size(device)
        .map_err(|e| CsiError::internal("reading the ext4 superblock", e))?;
    let dev_size = filesystem::block_device_size(device)
        .map_err(|e| CsiError::internal("reading the device size", e))?;
    if dev_size < fs_size + 4096 {
        return Ok(());
    }
    filesystem::grow_offline(device, "ext4")
        .map_err(|e| CsiError::internal("growing the ext4 filesystem before mounting", e))?;
    tracing::info!(device = %device.display(), from = fs_size, to = dev_size, "ext4 filesystem grown offline to its device");
    Ok(())
}

/// Whether a whole-generation fence began on `image` (its marker, or the
/// immutable flag an older fence set): such a generation is never attached
/// for writing.
fn fenced_whole(image: &Path) -> bool {
    crate::fence::marker_path(image).exists()
        || crate::kernel::files::is_immutable(image).unwrap_or(false)
}

fn overtaken(id: &VolumeId, gen: u64) -> CsiError {
    CsiError::FailedPrecondition(format!(
        "generation {gen} of volume {id} was fenced while this node attached it: nothing was staged"
    ))
}

impl Node {
    /// NodeStageVolume: attaches the generation the controller recorded for this node as a
    /// tagged loop device and mounts it (or binds the device) at the staging path.
    pub(super) fn node_stage_volume(
        &self,
        req: NodeStageVolumeRequest,
    ) -> CsiResult<NodeStageVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        // Every argument is checked before the volume is looked up: a missing
        // or unsafe field is INVALID_ARGUMENT even for an unknown volume.
        let staging = self
            .roots
            .check("staging_target_path", &req.staging_target_path)?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("volume_capability is required".into()))?;
        let access = capability::parse(cap)?;
        let id = self.our_volume(&req.volume_id)?;
        let _lock = self.inflight.try_lock(id.as_str())?;
        let meta = self
            .read_meta(&id)?
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;

        let (gen, recorded_ro) = self.published_generation(&id, &meta, &req.publish_context)?;
        let readonly = recorded_ro
            || req
                .publish_context
                .get(CTX_READONLY)
                .is_some_and(|v| v == "true")
            || access.read_only_mode();
        let image = self.generation_path(&id, gen);
        if !image.exists() {
            return Err(CsiError::NotFound(format!(
                "generation {gen} of volume {id} has no data at {}",
                image.display()
            )));
        }

        self.refuse_second_staging(&id, &staging)?;
        crate::failpoint::pause("stage:before-attach", &staging.to_string_lossy());
        let lo = self.attach_published(
            &id,
            (gen, recorded_ro),
            readonly,
            &image,
            &staging,
            &req.publish_context,
        )?;
        crate::failpoint::hit("stage:after-attach");
        if access.block {
            self.stage_block(&id, &staging, &lo)?;
        } else {
            let fs = access
                .fs_type
                .clone()
                .or_else(|| req.publish_context.get(CTX_FS_TYPE).cloned())
                .unwrap_or_else(|| meta.fs_type.clone());
            self.stage_fs(&staging, &lo, &fs, readonly, &access.mount_flags)?;
        }
        crate::failpoint::hit("stage:after-mount");
        tracing::info!(volume = %id, generation = gen, device = %lo.device.display(), staging = %staging.display(), block = access.block, readonly, "volume staged");
        Ok(NodeStageVolumeResponse {})
    }

    /// Attaches the published generation, checked again under the volume's publish lock:
    /// the record read before may be stale by now (an unpublish with no holder to fence
    /// and a publish to another node may have happened since). Attached before the lock is
    /// let go, so the controller either sees this device or this stage sees the change.
    fn attach_published(
        &self,
        id: &VolumeId,
        published: (u64, bool),
        readonly: bool,
        image: &Path,
        staging: &Path,
        ctx: &std::collections::HashMap<String, String>,
    ) -> CsiResult<LoopInfo> {
        let gen = published.0;
        let _publish_lock = PublishLock::take_for_rpc(
            &self.cfg.state_dir,
            id,
            false,
            "locking the volume's attachments",
        )?;
        let meta = self
            .read_meta(id)?
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        if self.published_generation(id, &meta, ctx)? != published {
            return Err(CsiError::FailedPrecondition(format!(
                "the controller changed the attachment of volume {id} to node {} while it was being staged; nothing was attached",
                self.node_id
            )));
        }
        crate::failpoint::pause("stage:locked-before-attach", &staging.to_string_lossy());
        let opts = AttachOptions {
            read_only: readonly,
            direct_io: meta.direct_io().unwrap_or(self.cfg.direct_io),
            tag: loop_tag(id, gen, &self.node_id),
            size_limit: meta.data_bytes(gen),
            logical_block_size: 0,
        };
        let key = staging.to_string_lossy();
        let lo = self.find_or_attach(id, gen, image, opts, &key)?;
        self.refuse_attach_a_fence_overtook(id, gen, image, &lo, meta.data_bytes(gen))?;
        Ok(lo)
    }

    /// The generation the controller's record publishes to this node, and
    /// whether read-only. The record, not the caller's context, decides: a
    /// context naming another generation (stale, or forged) would give two
    /// nodes the same bytes. A fenced generation is refused.
    fn published_generation(
        &self,
        id: &VolumeId,
        meta: &VolumeMeta,
        ctx: &std::collections::HashMap<String, String>,
    ) -> CsiResult<(u64, bool)> {
        let recorded = meta.attachments.get(&self.node_id).ok_or_else(|| {
            CsiError::FailedPrecondition(format!(
                "volume {id} is not published to node {} (ControllerPublishVolume first)",
                self.node_id
            ))
        })?;
        let gen = recorded.generation;
        if let Some(claimed) = generation_from_context(ctx) {
            let claimed = claimed?;
            if claimed != gen {
                return Err(CsiError::FailedPrecondition(format!(
                    "publish_context names generation {claimed} of volume {id}, but the controller published generation {gen} to node {}",
                    self.node_id
                )));
            }
        }
        if meta
            .generations
            .get(&gen)
            .is_some_and(|g| g.fenced_at.is_some())
        {
            return Err(CsiError::FailedPrecondition(format!(
                "generation {gen} of volume {id} was fenced: this node's attachment was revoked; the volume must be published again"
            )));
        }
        Ok((gen, recorded.readonly))
    }

    /// Reuses our loop device on this generation if a crashed attempt left
    /// one; otherwise attaches a new one.
    fn find_or_attach(
        &self,
        id: &VolumeId,
        gen: u64,
        image: &Path,
        opts: AttachOptions,
        pause_key: &str,
    ) -> CsiResult<LoopInfo> {
        let (readonly, tag) = (opts.read_only, opts.tag.clone());
        // Shared with other attaches, exclusive with a fence on this image:
        // a fence either sees this device or this attach sees its flag.
        let _fence_lock = crate::locks::BackingLock::on_path(
            image,
            false,
            crate::locks::CONTROLLER_LOCK_WAIT,
        )
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::TimedOut => CsiError::Aborted(format!(
                "generation {gen} of volume {id}: the image is locked by a fence or another attach; retry later"
            )),
            _ => CsiError::internal("locking the image against a concurrent fence", e),
        })?;
        if !readonly && fenced_whole(image) {
            return Err(CsiError::FailedPrecondition(format!(
                "generation {gen} of volume {id} is fenced: it cannot be attached for writing"
            )));
        }
        crate::failpoint::pause("stage:attach-checked", pause_key);
        let (dev, ino) = crate::kernel::files::dev_ino(image)
            .map_err(|e| CsiError::internal("inspecting the image", e))?;
        let existing = loop_device::find_by_inode(dev, ino)
            .map_err(|e| CsiError::internal("listing loop devices", e))?;
        let mut ours: Vec<LoopInfo> = existing.into_iter().filter(|l| l.tag == tag).collect();
        // A read-only twin made for a read-only raw block target (see
        // publish) may sit beside the staged device: prefer the same mode.
        ours.sort_by_key(|l| l.read_only != readonly);
        if let Some(lo) = ours.into_iter().next() {
            if lo.read_only != readonly {
                return Err(CsiError::AlreadyExists(format!(
                    "volume {id} is already attached as {} with read_only={}",
                    lo.device.display(),
                    lo.read_only
                )));
            }
            return Ok(lo);
        }
        crate::kernel::loop_gate::attach_gated(image, &opts).map_err(|e| {
            // A fence that did not wait for this attach set the immutable
            // flag meanwhile: that, not the kernel's EPERM, is the reason.
            if !readonly && fenced_whole(image) {
                overtaken(id, gen)
            } else {
                CsiError::internal(&format!("attaching {}", image.display()), e)
            }
        })
    }

    /// After the attach: a fence that did not wait for this node's lock (a
    /// node that hangs must not hold it up) may have made its marker and
    /// scanned the holders between the check above and the attach, and so
    /// missed this device. The marker is made before that scan, so it is
    /// seen here: the device, not used yet, is fenced and released, and the
    /// stage refused.
    fn refuse_attach_a_fence_overtook(
        &self,
        id: &VolumeId,
        gen: u64,
        image: &Path,
        lo: &LoopInfo,
        data_bytes: u64,
    ) -> CsiResult<()> {
        // The path may also name another inode by now: a fence that did not wait
        // for this attach, a publish elsewhere and a collection of the released
        // generation (its image and marker gone) may all have happened meanwhile.
        let same_inode = crate::kernel::files::dev_ino(image)
            .is_ok_and(|(dev, ino)| (dev, ino) == (lo.backing_dev, lo.backing_ino));
        if lo.read_only || (same_inode && !fenced_whole(image)) {
            return Ok(());
        }
        // An image gone from its path holds nothing anyone will read again: the
        // device is only released.
        let mine = |l: &LoopInfo| l.device == lo.device;
        // The full settle: the device may be one an earlier stage attached and
        // mounted (a repeated NodeStage finds it by its tag), with writes in flight.
        if same_inode {
            let settle = self.cfg.fence_settle;
            if let Err(e) = crate::fence::fence_devices(image, data_bytes, &mine, settle) {
                tracing::error!(volume = %id, generation = gen, device = %lo.device.display(), error = %e, "could not fence this node's device on a fenced generation");
            }
        }
        if let Err(e) = loop_device::detach(&lo.device) {
            tracing::warn!(volume = %id, generation = gen, device = %lo.device.display(), error = %e, "could not release this node's device on a fenced generation");
        }
        tracing::warn!(volume = %id, generation = gen, device = %lo.device.display(), "a fence overtook this attach: the device is fenced and released");
        Err(overtaken(id, gen))
    }

    fn stage_block(&self, id: &VolumeId, staging: &Path, lo: &LoopInfo) -> CsiResult<()> {
        std::fs::create_dir_all(staging)
            .map_err(|e| CsiError::internal("creating the staging dir", e))?;
        crate::failpoint::hit("stage:after-mkdir");
        let file = block_staging_file(staging, id);
        let want =
            rdev(&lo.device).map_err(|e| CsiError::internal("inspecting the loop device", e))?;
        if mounts::is_mountpoint(&file).unwrap_or(false) {
            return match rdev(&file) {
                Ok(have) if have == want => Ok(()),
                _ => Err(CsiError::AlreadyExists(format!(
                    "{} already holds another device",
                    file.display()
                ))),
            };
        }
        if !file.exists() {
            std::fs::File::create(&file)
                .map_err(|e| CsiError::internal("creating the block staging file", e))?;
            crate::failpoint::hit("stage:after-mkfile");
        }
        mounts::bind_mount(&lo.device, &file, false, &[])
            .map_err(|e| CsiError::internal("bind-mounting the loop device", e))
    }

    fn stage_fs(
        &self,
        staging: &Path,
        lo: &LoopInfo,
        fs: &str,
        readonly: bool,
        flags: &[String],
    ) -> CsiResult<()> {
        if already_staged(staging, lo, fs)? {
            return Ok(());
        }
        ready_filesystem(lo, fs, readonly)?;
        std::fs::create_dir_all(staging)
            .map_err(|e| CsiError::internal("creating the staging dir", e))?;
        crate::failpoint::hit("stage:after-mkdir");
        mounts::mount_device(
            &lo.device,
            staging,
            fs,
            &fs_options(fs, readonly, flags),
            readonly,
        )
        .map_err(|e| {
            let what = format!("mounting {} on {}", lo.device.display(), staging.display());
            // EINVAL with options the caller chose: the options are at fault.
            if e.errno() == Some(nix::errno::Errno::EINVAL) && !flags.is_empty() {
                CsiError::InvalidArgument(format!(
                    "{what}: the kernel refused the mount options {flags:?}: {e}"
                ))
            } else {
                CsiError::internal(&what, e)
            }
        })?;
        if fs == "xfs" && !readonly {
            if let Err(e) = grow_xfs_to_device(&lo.device, staging) {
                // Unmounted again, so a retried stage finds nothing staged and grows anew
                // rather than answering OK at the old size.
                if let Err(u) = mounts::unmount(staging) {
                    tracing::warn!(staging = %staging.display(), error = %u, "unmounting after a failed grow");
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// A volume is staged at one path per node. A second staging path for a
    /// volume that is already staged (its device mounted somewhere that is
    /// not this path) is refused and changes nothing: two staging mounts of
    /// one device could not both be unstaged.
    fn refuse_second_staging(&self, id: &VolumeId, staging: &Path) -> CsiResult<()> {
        let block_file = block_staging_file(staging, id);
        for (lo, _) in self.loops_of(id)? {
            let users = device_users(&lo.device)?;
            if users.is_empty()
                || users
                    .iter()
                    .any(|m| m.mount_point == staging || m.mount_point == block_file)
            {
                continue;
            }
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} is already staged on this node ({} mounted at {}); unstage it there first (nothing was changed)",
                lo.device.display(),
                mount_points(&users)
            )));
        }
        Ok(())
    }

    /// NodeUnstageVolume: unmounts the staging path and detaches the volume's loop devices
    /// (`unstage_volume`, which recovery shares).
    pub(super) fn node_unstage_volume(
        &self,
        req: NodeUnstageVolumeRequest,
    ) -> CsiResult<NodeUnstageVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        let staging = self
            .roots
            .check("staging_target_path", &req.staging_target_path)?;
        let id = self.our_volume(&req.volume_id)?;
        let _lock = self.inflight.try_lock(id.as_str())?;
        self.unstage_volume(&id, &staging, req.force)?;
        Ok(NodeUnstageVolumeResponse {})
    }

    /// Unmounts the staging mount, detaches our loop devices for the volume
    /// once nothing uses them, removes what staging created. With `force`,
    /// busy, aborted and stale mounts are torn down too.
    pub(crate) fn unstage_volume(
        &self,
        id: &VolumeId,
        staging: &Path,
        force: bool,
    ) -> CsiResult<()> {
        let block_file = block_staging_file(staging, id);
        let loops = self.loops_of(id)?;
        if !force {
            // Refuse before touching anything: a device still published
            // elsewhere means the CO has not unpublished yet.
            for (lo, _) in &loops {
                let users = device_users(&lo.device)?;
                let others: Vec<String> = users
                    .iter()
                    .filter(|m| m.mount_point != staging && m.mount_point != block_file)
                    .map(|m| m.mount_point.display().to_string())
                    .collect();
                if !others.is_empty() {
                    return Err(CsiError::FailedPrecondition(format!(
                        "{} is still published at {}; unpublish first (nothing was changed)",
                        lo.device.display(),
                        others.join(", ")
                    )));
                }
            }
        }
        // Decide from the mount table, never by looking inside: the staging
        // mount may be a fenced filesystem where every lookup fails with EIO.
        let mounted_at = |p: &Path| {
            mounts::mounts_at(p)
                .map(|m| !m.is_empty())
                .map_err(|e| CsiError::internal("reading the mount table", e))
        };
        if mounted_at(staging)? {
            self.unmount_path(staging, force)?;
        } else if mounted_at(&block_file)? {
            self.unmount_path(&block_file, force)?;
        }
        crate::failpoint::hit("unstage:after-unmount");
        for (lo, gen) in &loops {
            if rdev(&lo.device).is_err() {
                continue; // the device node vanished since the listing
            }
            let users = device_users(&lo.device)?;
            if !users.is_empty() {
                if !force {
                    return Err(CsiError::FailedPrecondition(format!(
                        "{} is still mounted at {}; unpublish first",
                        lo.device.display(),
                        mount_points(&users)
                    )));
                }
                self.unmount_users_under_roots(&users)?;
            }
            loop_device::detach(&lo.device).map_err(|e| {
                CsiError::internal(&format!("detaching {}", lo.device.display()), e)
            })?;
            tracing::info!(volume = %id, generation = gen, device = %lo.device.display(), force, "loop device detached");
            crate::failpoint::hit("unstage:after-detach");
        }
        remove_target(&block_file)?;
        if staging.exists() {
            // The staging dir itself belongs to the CO; only an empty one is removed.
            match std::fs::remove_dir(staging) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) && !force => {
                    tracing::debug!(staging = %staging.display(), "staging dir not empty; left in place")
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => {
                    tracing::warn!(staging = %staging.display(), "staging dir not empty after force unstage; left in place")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(CsiError::internal("removing the staging dir", e)),
            }
        }
        tracing::info!(volume = %id, staging = %staging.display(), force, "volume unstaged");
        Ok(())
    }

    /// Force-unmounts the mounts of a device that lie below the kubelet's dirs this
    /// plugin may touch; mounts elsewhere (not ours to undo) are left.
    pub(crate) fn unmount_users_under_roots(&self, users: &[mounts::MountEntry]) -> CsiResult<()> {
        let ours = |m: &&mounts::MountEntry| {
            self.roots
                .roots()
                .iter()
                .any(|r| m.mount_point.starts_with(r))
        };
        for m in users.iter().filter(ours) {
            self.unmount_path(&m.mount_point, true)?;
        }
        Ok(())
    }

    /// Unmounts whatever is mounted at `path` (all stacked mounts).
    /// Without force a busy mount is FAILED_PRECONDITION and stays mounted.
    pub(crate) fn unmount_path(&self, path: &Path, force: bool) -> CsiResult<()> {
        let state = mounts::path_state(path);
        if matches!(state, PathState::Missing) {
            return Ok(());
        }
        if force {
            mounts::force_unmount(path).map_err(|e| {
                CsiError::internal(&format!("force-unmounting {}", path.display()), e)
            })?;
            return Ok(());
        }
        loop {
            match mounts::unmount(path) {
                Ok(mounts::Unmount::NotMounted) => return Ok(()),
                Ok(mounts::Unmount::Unmounted) => continue,
                Err(mounts::MountError::Busy { .. }) => {
                    return Err(CsiError::FailedPrecondition(format!(
                        "{} is busy (open files or a working directory); nothing was changed. Retry with force to tear it down",
                        path.display()
                    )))
                }
                Err(e) => {
                    return Err(if matches!(state, PathState::Stale(_)) {
                        CsiError::FailedPrecondition(format!("{} is a stale mountpoint ({e}); retry with force", path.display()))
                    } else {
                        CsiError::internal(&format!("unmounting {}", path.display()), e)
                    })
                }
            }
        }
    }
}

/// Whether `staging` already has this device mounted with `fs` (a retry: done);
/// ALREADY_EXISTS when it has anything else.
fn already_staged(staging: &Path, lo: &LoopInfo, fs: &str) -> CsiResult<bool> {
    let (major, minor) =
        rdev(&lo.device).map_err(|e| CsiError::internal("inspecting the loop device", e))?;
    let Some(m) = top_mount(staging)? else {
        return Ok(false);
    };
    if (m.major, m.minor) != (major, minor) {
        return Err(CsiError::AlreadyExists(format!(
            "{} already has another filesystem mounted ({})",
            staging.display(),
            m.source
        )));
    }
    if m.fs_type != fs {
        return Err(CsiError::AlreadyExists(format!(
            "{} is already staged with {}, not {fs}",
            staging.display(),
            m.fs_type
        )));
    }
    Ok(true)
}

/// The device holds filesystem `fs`, ready to mount: made on a blank volume, an ext4
/// grown to the device (xfs grows only mounted); anything else is refused.
fn ready_filesystem(lo: &LoopInfo, fs: &str, readonly: bool) -> CsiResult<()> {
    match filesystem::probe(&lo.device).map_err(|e| CsiError::internal("probing the device", e))? {
        FsKind::Blank if readonly => Err(CsiError::FailedPrecondition(
            "the volume is blank and attached read-only: it cannot be formatted".into(),
        )),
        FsKind::Blank => {
            filesystem::mkfs(&lo.device, fs)
                .map_err(|e| CsiError::internal(&format!("mkfs.{fs}"), e))?;
            tracing::info!(device = %lo.device.display(), fs, "filesystem created on blank volume");
            crate::failpoint::hit("stage:after-mkfs");
            Ok(())
        }
        FsKind::Ext4 if fs == "ext4" => {
            if !readonly {
                grow_ext4_to_device(&lo.device)?;
            }
            Ok(())
        }
        // xfs grows only mounted: see after the mount.
        FsKind::Xfs if fs == "xfs" => Ok(()),
        other => Err(CsiError::FailedPrecondition(format!(
            "the volume holds {other:?}, not {fs}; refusing to mount or format it"
        ))),
    }
}
