//! Point-in-time copies of a volume in use (snapshots, clones of a live
//! volume). A copy must equal the volume at one instant:
//!
//! - a filesystem on a writing holder that is mounted where this process can
//!   see it is frozen (`FIFREEZE`) for the copy: its writers block, its
//!   dirty data reaches the image first, and the copy is a clean filesystem;
//! - a holder that cannot be frozen (a raw block volume, or a mount in
//!   another mount namespace) is copied atomically only where the backing
//!   filesystem makes reflinks (xfs, btrfs: the clone takes the image's
//!   inode lock, so it sees every write before it and none after). On a
//!   backing filesystem without reflinks there is no way to stop the loop
//!   device's writers for the length of a copy, so the copy is refused
//!   rather than made torn.
//!
//! A group of volumes (`group`) is copied at one instant when every member's
//! writers are stopped together: all visible filesystems are frozen first,
//! then every member is copied, then all are thawed. A member that cannot be
//! frozen keeps writing during the copies, so the copies are one instant only
//! if that member is copied atomically (a reflink) while all the others are
//! frozen: the frozen members do not change between their freeze and the
//! thaw, so each equals its state at the instant of that one reflink. Two
//! such members would be copied at two different instants, with writes to
//! either in between; such a group is refused. See [`Controller::quiesce_group`].

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use super::Controller;
use crate::backend::meta::PublishLock;
use crate::error::{CsiError, CsiResult};
use crate::fsops::CloneKind;
use crate::ids::VolumeId;
use crate::mounts;

// _IOWR('X', 119, int) and _IOWR('X', 120, int) from include/uapi/linux/fs.h.
const FIFREEZE: libc::c_ulong = 0xC004_5877;
const FITHAW: libc::c_ulong = 0xC004_5878;

/// Filesystems frozen for a copy; thawed when dropped, error or not.
pub(crate) struct Quiesced {
    frozen: Vec<(File, PathBuf)>,
    /// Set when a writer of the volume could not be stopped: the copy is one
    /// instant only if it is a reflink (the caller checks what it made).
    pub(crate) reflink_required: bool,
    /// The volumes' publish locks, held from the holder scan until after the
    /// thaw: a node's stage waits, so no writer the scan did not see (and
    /// so neither froze nor reflinked around) can start during the copy.
    _stages_held: Vec<PublishLock>,
}

impl Drop for Quiesced {
    fn drop(&mut self) {
        for (dir, path) in self.frozen.drain(..) {
            // SAFETY: ioctl on a directory fd we own; the argument is unused.
            if unsafe { libc::ioctl(dir.as_raw_fd(), FITHAW, 0) } != 0 {
                let e = std::io::Error::last_os_error();
                tracing::error!(mount = %path.display(), error = %e, "could not thaw a filesystem frozen for a snapshot");
            } else {
                tracing::debug!(mount = %path.display(), "filesystem thawed after the copy");
            }
        }
    }
}

impl Quiesced {
    /// Refuses a copy made while this lived that is not one instant: a plain
    /// copy (say, the reflink failed and the backend fell back) of a volume
    /// whose writers kept going. The caller removes what it made.
    pub(crate) fn refuse_torn(&self, id: &VolumeId, made: CloneKind) -> CsiResult<()> {
        if self.reflink_required && made != CloneKind::Reflink {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} is in use by writers that cannot be stopped, and the copy could not be made as a reflink: it would not be point-in-time"
            )));
        }
        Ok(())
    }
}

impl Controller {
    /// Stops every writer of generation `gen` for as long as the result
    /// lives (see the module docs), or refuses with FAILED_PRECONDITION.
    pub(crate) fn quiesce(&self, id: &VolumeId, gen: u64, data_bytes: u64) -> CsiResult<Quiesced> {
        let mut q = Quiesced {
            frozen: Vec::new(),
            reflink_required: false,
            _stages_held: self.hold_stages([id])?,
        };
        let running = self.freeze_writers(id, gen, data_bytes, &mut q)?;
        if let Some(dev) = running.first() {
            if !self.backend.reflinks() {
                return Err(self.no_reflink_refusal(id, dev));
            }
            q.reflink_required = true;
        }
        Ok(q)
    }

    /// The publish locks of `ids`, exclusive, taken in one order (sorted), so
    /// two group snapshots sharing members cannot deadlock.
    fn hold_stages<'a>(
        &self,
        ids: impl IntoIterator<Item = &'a VolumeId>,
    ) -> CsiResult<Vec<PublishLock>> {
        let mut ids: Vec<&VolumeId> = ids.into_iter().collect();
        ids.sort();
        ids.dedup();
        ids.into_iter()
            .map(|id| {
                PublishLock::take_for_rpc(
                    &self.cfg.state_dir,
                    id,
                    true,
                    "locking the volume against new stages for the copy",
                )
            })
            .collect()
    }

    /// Stops the writers of every member of a group at once, for as long as
    /// the result lives: returns the frozen filesystems, and the index in
    /// `members` (volume, generation, data bytes) of the one member whose
    /// writers could not be stopped, if there is one. That member must be
    /// copied by one reflink while the result lives; the copies are then the
    /// members' state at the instant of that reflink. Refuses (FAILED_PRECONDITION,
    /// everything thawed) when more than one member keeps writers, or one does
    /// and the state dir makes no reflinks.
    pub(crate) fn quiesce_group(
        &self,
        members: &[(VolumeId, u64, u64)],
    ) -> CsiResult<(Quiesced, Option<usize>)> {
        let mut q = Quiesced {
            frozen: Vec::new(),
            reflink_required: false,
            _stages_held: self.hold_stages(members.iter().map(|(id, _, _)| id))?,
        };
        let mut running: Vec<(usize, PathBuf)> = Vec::new();
        for (i, (id, gen, bytes)) in members.iter().enumerate() {
            if let Some(dev) = self
                .freeze_writers(id, *gen, *bytes, &mut q)?
                .into_iter()
                .next()
            {
                running.push((i, dev));
            }
        }
        match running.as_slice() {
            [] => Ok((q, None)),
            [(i, dev)] if self.backend.reflinks() => {
                tracing::info!(volume = %members[*i].0, device = %dev.display(), "group member cannot be frozen: it is copied by a reflink while every other member is frozen");
                q.reflink_required = true;
                Ok((q, Some(*i)))
            }
            [(i, dev)] => Err(self.no_reflink_refusal(&members[*i].0, dev)),
            many => Err(CsiError::FailedPrecondition(format!(
                "volumes {} are in use through {} (raw block volumes, or mounts this controller cannot see): their writers cannot be stopped, and copies of two volumes that keep writing are not taken at one instant, so the group snapshot would not be point-in-time. Snapshot the group when at most one of them is in use that way",
                many.iter()
                    .map(|(i, _)| members[*i].0.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                many.iter()
                    .map(|(_, d)| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            ))),
        }
    }

    fn no_reflink_refusal(&self, id: &VolumeId, dev: &std::path::Path) -> CsiError {
        CsiError::FailedPrecondition(format!(
            "volume {id} is in use through {} (a raw block volume, or a mount this controller cannot see) and the state dir's filesystem ({}) makes no reflinks: a copy now would not be point-in-time. Copy it (snapshot or clone) when it is not in use, or keep the state dir on xfs or btrfs",
            dev.display(),
            crate::fence::fs_name(&self.cfg.state_dir)
        ))
    }

    /// Freezes the filesystem of every writing holder of `gen` that this
    /// process can see (adding it to `q`); returns the writing holders that
    /// could not be frozen.
    fn freeze_writers(
        &self,
        id: &VolumeId,
        gen: u64,
        data_bytes: u64,
        q: &mut Quiesced,
    ) -> CsiResult<Vec<PathBuf>> {
        let mut running = Vec::new();
        let holders = self.backend.holders(id, gen)?;
        for lo in holders.iter().filter(|l| !l.read_only) {
            if crate::fence::is_fenced_device(lo, data_bytes) {
                continue; // fenced: can no longer write the data
            }
            let rdev = std::fs::metadata(&lo.device)
                .map_err(|e| CsiError::internal("inspecting a holder", e))?
                .rdev();
            let (major, minor) = (libc::major(rdev), libc::minor(rdev));
            let mounted = mounts::mounts_of_device(major, minor)
                .map_err(|e| CsiError::internal("reading the mount table", e))?;
            // A filesystem on the device, mounted as a directory (a raw block
            // volume's bind-mounted device node is a file and cannot be frozen).
            let mut frozen = false;
            if let Some(m) = mounted.iter().find(|m| m.mount_point.is_dir()) {
                let dir = File::open(&m.mount_point)
                    .map_err(|e| CsiError::internal("opening a mount to freeze it", e))?;
                // SAFETY: ioctl on a directory fd we own; the argument is unused.
                if unsafe { libc::ioctl(dir.as_raw_fd(), FIFREEZE, 0) } == 0 {
                    tracing::info!(volume = %id, generation = gen, mount = %m.mount_point.display(), "filesystem frozen for a point-in-time copy");
                    q.frozen.push((dir, m.mount_point.clone()));
                    frozen = true;
                } else {
                    let e = std::io::Error::last_os_error();
                    match e.raw_os_error() {
                        // Frozen by someone else already: they may thaw it in the
                        // middle of our copy, so it counts as still written (a reflink
                        // is then required, or the copy is refused).
                        Some(libc::EBUSY | libc::EOPNOTSUPP | libc::ENOTTY) => {}
                        _ => {
                            return Err(CsiError::internal(
                                &format!(
                                    "freezing {} for a point-in-time copy",
                                    m.mount_point.display()
                                ),
                                e,
                            ))
                        }
                    }
                }
            }
            if !frozen {
                running.push(lo.device.clone());
            }
        }
        Ok(running)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quiesced(reflink_required: bool) -> Quiesced {
        Quiesced {
            frozen: Vec::new(),
            reflink_required,
            _stages_held: Vec::new(),
        }
    }

    /// Snapshots and clones share this check: a plain copy of a volume whose
    /// writers kept going is refused; with the writers stopped any copy is one
    /// instant, and a reflink always is.
    #[test]
    fn a_plain_copy_of_a_running_volume_is_refused() {
        let id = VolumeId::generate();
        let e = quiesced(true)
            .refuse_torn(&id, CloneKind::SparseCopy)
            .unwrap_err();
        assert!(matches!(e, CsiError::FailedPrecondition(_)), "{e:?}");
        assert!(quiesced(true).refuse_torn(&id, CloneKind::Reflink).is_ok());
        assert!(quiesced(false)
            .refuse_torn(&id, CloneKind::SparseCopy)
            .is_ok());
    }
}
