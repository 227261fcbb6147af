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

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use super::Controller;
use crate::error::{CsiError, CsiResult};
use crate::ids::VolumeId;
use crate::mounts;

// _IOWR('X', 119, int) and _IOWR('X', 120, int) from include/uapi/linux/fs.h.
const FIFREEZE: libc::c_ulong = 0xC004_5877;
const FITHAW: libc::c_ulong = 0xC004_5878;

/// Filesystems frozen for a copy; thawed when dropped, error or not.
pub(crate) struct Quiesced {
    frozen: Vec<(File, PathBuf)>,
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

impl Controller {
    /// Stops every writer of generation `gen` for as long as the result
    /// lives (see the module docs), or refuses with FAILED_PRECONDITION.
    pub(crate) fn quiesce(&self, id: &VolumeId, gen: u64, data_bytes: u64) -> CsiResult<Quiesced> {
        let mut q = Quiesced { frozen: Vec::new() };
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
                        // Frozen by someone else already: still frozen, not ours to thaw.
                        Some(libc::EBUSY) => frozen = true,
                        Some(libc::EOPNOTSUPP | libc::ENOTTY) => {}
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
            if frozen {
                continue;
            } else if !self.backend.reflinks() {
                return Err(CsiError::FailedPrecondition(format!(
                    "volume {id} is in use through {} (a raw block volume, or a mount this controller cannot see) and the state dir's filesystem ({}) makes no reflinks: a copy now would not be point-in-time. Snapshot it when it is not in use, or keep the state dir on xfs or btrfs",
                    lo.device.display(),
                    crate::fence::fs_name(&self.cfg.state_dir)
                )));
            }
        }
        Ok(q)
    }
}
