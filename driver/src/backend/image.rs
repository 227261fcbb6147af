//! The loop-image backend: each generation is a sparse image file under
//! `<state>/volumes/<id>/gen-<n>.img`, snapshots under
//! `<state>/snapshots/<id>/data.img`. The fence works wherever the
//! controller and the nodes share this directory and the kernel.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::{Backend, BackendError, Capacity, DataRef};
use crate::fence::{self, FenceReport};
use crate::ids::{SnapshotId, VolumeId};
use crate::kernel::files::{self, CloneKind, SourceWindow};
use crate::kernel::loop_device::LoopInfo;

pub struct ImageBackend {
    root: PathBuf,
    /// Whether the state dir's filesystem makes reflinks (checked once).
    reflink: bool,
    /// How long a fence settles its holders before moving them (see `fence::SETTLE`).
    fence_settle: std::time::Duration,
}

impl ImageBackend {
    pub fn new(state_dir: &Path) -> Result<Self, BackendError> {
        for sub in ["volumes", "snapshots"] {
            std::fs::create_dir_all(state_dir.join(sub)).map_err(BackendError::io(format!(
                "creating {}",
                state_dir.join(sub).display()
            )))?;
        }
        Ok(Self {
            root: state_dir.to_path_buf(),
            reflink: files::can_reflink(state_dir),
            fence_settle: fence::SETTLE,
        })
    }

    /// The backend with fences that settle for `settle` (`--fence-settle`).
    pub fn with_fence_settle(self, settle: std::time::Duration) -> Self {
        Self {
            fence_settle: settle,
            ..self
        }
    }

    pub fn volume_dir(&self, vol: &VolumeId) -> PathBuf {
        self.root.join("volumes").join(vol.as_str())
    }

    fn snapshot_path(&self, snap: &SnapshotId) -> PathBuf {
        self.root
            .join("snapshots")
            .join(snap.as_str())
            .join("data.img")
    }

    /// Busy when a loop device still holds the generation (checked fresh,
    /// from the kernel, right before anything is removed).
    fn ensure_free(&self, vol: &VolumeId, gen: u64) -> Result<(), BackendError> {
        let held = self.holders(vol, gen)?;
        if held.is_empty() {
            return Ok(());
        }
        Err(BackendError::Busy(format!(
            "generation {gen} of {vol} is still held by {}",
            held.iter()
                .map(|l| l.device.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )))
    }

    fn ensure_dir(dir: &Path) -> Result<(), BackendError> {
        if !dir.exists() {
            std::fs::create_dir_all(dir)
                .map_err(BackendError::io(format!("creating {}", dir.display())))?;
            files::fsync_parent(dir).map_err(BackendError::io("syncing directory"))?;
        }
        Ok(())
    }
}

impl Backend for ImageBackend {
    fn kind(&self) -> &'static str {
        "loop-image"
    }

    fn create(&self, vol: &VolumeId, gen: u64, size: u64) -> Result<(), BackendError> {
        let path = self.generation_path(vol, gen);
        Self::ensure_dir(&self.volume_dir(vol))?;
        let size = size + fence::TRAILER_BYTES;
        match files::create_sparse(&path, size) {
            // A retry after a crash finds the file it made: make sure it is the right size.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => files::grow(&path, size),
            other => other,
        }
        .map_err(BackendError::io(format!("creating {}", path.display())))
    }

    fn clone_data_in(
        &self,
        src: &DataRef,
        src_bytes: u64,
        vol: &VolumeId,
        gen: u64,
        size: u64,
        window: &dyn SourceWindow,
    ) -> Result<CloneKind, BackendError> {
        let from = match src {
            DataRef::Generation(v, g) => self.generation_path(v, *g),
            DataRef::Snapshot(s) => self.snapshot_path(s),
        };
        let to = self.generation_path(vol, gen);
        Self::ensure_dir(&self.volume_dir(vol))?;
        if to.exists() {
            // Left by an earlier attempt that completed the rename: clone_file
            // only renames a finished copy into place.
            tracing::info!(path = %to.display(), "clone target already complete from an earlier attempt");
            return Ok(CloneKind::SparseCopy);
        }
        files::clone_file_in(
            &from,
            &to,
            src_bytes.min(size),
            size + fence::TRAILER_BYTES,
            window,
        )
        .map_err(BackendError::io(format!(
            "cloning {} to {}",
            from.display(),
            to.display()
        )))
    }

    fn snapshot(
        &self,
        vol: &VolumeId,
        gen: u64,
        data_bytes: u64,
        snap: &SnapshotId,
        window: &dyn SourceWindow,
    ) -> Result<(CloneKind, u64), BackendError> {
        let to = self.snapshot_path(snap);
        Self::ensure_dir(to.parent().expect("snapshot path has a parent"))?;
        let from = self.generation_path(vol, gen);
        let kind = if to.exists() {
            CloneKind::SparseCopy
        } else {
            files::clone_file_in(&from, &to, data_bytes, data_bytes, window)
                .map_err(BackendError::io(format!("snapshotting {}", from.display())))?
        };
        let size = std::fs::metadata(&to)
            .map_err(BackendError::io("reading snapshot size"))?
            .len();
        Ok((kind, size))
    }

    fn reflinks(&self) -> bool {
        self.reflink
    }

    fn delete_snapshot(&self, snap: &SnapshotId) -> Result<(), BackendError> {
        let dir = self.root.join("snapshots").join(snap.as_str());
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(BackendError::io(format!("removing {}", dir.display()))(e))
            }
            _ => Ok(()),
        }
    }

    fn grow(&self, vol: &VolumeId, gen: u64, old: u64, size: u64) -> Result<(), BackendError> {
        let path = self.generation_path(vol, gen);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(BackendError::io(format!("opening {}", path.display())))?;
        // The old trailer becomes data: cut it off (it reads as zeros again),
        // then extend to the new data plus a new trailer. Attachments show
        // only [0, old) meanwhile, so nothing in use moves.
        file.set_len(old)
            .and_then(|_| file.set_len(size + fence::TRAILER_BYTES))
            .and_then(|_| file.sync_all())
            .map_err(BackendError::io(format!("growing {}", path.display())))
    }

    fn widen(
        &self,
        vol: &VolumeId,
        gen: u64,
        data_bytes: u64,
    ) -> Result<Vec<LoopInfo>, BackendError> {
        Ok(fence::widen_holders(
            &self.generation_path(vol, gen),
            data_bytes,
        )?)
    }

    fn ensure_trailer(
        &self,
        vol: &VolumeId,
        gen: u64,
        data_bytes: u64,
    ) -> Result<(), BackendError> {
        Ok(fence::ensure_trailer(
            &self.generation_path(vol, gen),
            data_bytes,
        )?)
    }

    fn freeze(
        &self,
        vol: &VolumeId,
        gen: u64,
        data_bytes: u64,
    ) -> Result<FenceReport, BackendError> {
        Ok(fence::freeze(
            &self.generation_path(vol, gen),
            data_bytes,
            self.fence_settle,
        )?)
    }

    fn fence_marked(&self, vol: &VolumeId, gen: u64) -> bool {
        fence::marker_path(&self.generation_path(vol, gen)).exists()
    }

    fn fence_devices(
        &self,
        vol: &VolumeId,
        gen: u64,
        data_bytes: u64,
        pick: &dyn Fn(&LoopInfo) -> bool,
    ) -> Result<FenceReport, BackendError> {
        Ok(fence::fence_devices(
            &self.generation_path(vol, gen),
            data_bytes,
            pick,
            self.fence_settle,
        )?)
    }

    fn holders(&self, vol: &VolumeId, gen: u64) -> Result<Vec<LoopInfo>, BackendError> {
        let path = self.generation_path(vol, gen);
        if !path.exists() {
            return Ok(Vec::new());
        }
        Ok(fence::holders(&path)?)
    }

    fn holder_snapshot(&self) -> Result<Vec<LoopInfo>, BackendError> {
        crate::kernel::loop_device::list().map_err(|e| {
            BackendError::io("listing loop devices")(std::io::Error::other(e.to_string()))
        })
    }

    fn holders_in(&self, snapshot: &[LoopInfo], vol: &VolumeId, gen: u64) -> Vec<LoopInfo> {
        match files::dev_ino(&self.generation_path(vol, gen)) {
            Ok((dev, ino)) => snapshot
                .iter()
                .filter(|l| l.backing_dev == dev && l.backing_ino == ino)
                .cloned()
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    fn remove_generation(&self, vol: &VolumeId, gen: u64) -> Result<(), BackendError> {
        let path = self.generation_path(vol, gen);
        let marker = fence::marker_path(&path);
        if path.exists() {
            self.ensure_free(vol, gen)?;
            if fence::is_frozen(&path)? {
                fence::thaw(&path)?;
            }
            std::fs::remove_file(&path)
                .map_err(BackendError::io(format!("removing {}", path.display())))?;
            crate::failpoint::hit("gc:after-image-removed");
        }
        // Also when the image is already gone: a crash between the image's
        // removal and the record's would otherwise leave the marker forever.
        match std::fs::remove_file(&marker) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(BackendError::io(format!("removing {}", marker.display()))(
                    e,
                ))
            }
            _ => {}
        }
        files::fsync_parent(&path).map_err(BackendError::io("syncing directory"))
    }

    fn delete_volume(&self, vol: &VolumeId) -> Result<(), BackendError> {
        let dir = self.volume_dir(vol);
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(BackendError::io(format!("reading {}", dir.display()))(e)),
        };
        let gens: Vec<u64> = entries
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().to_string();
                name.strip_prefix("gen-")
                    .and_then(|n| n.strip_suffix(".img"))
                    .and_then(|n| n.parse().ok())
            })
            .collect();
        // Every generation must be free before any is removed: a delete that
        // stops half way would leave a record pointing at missing data.
        for gen in &gens {
            self.ensure_free(vol, *gen)?;
        }
        for gen in gens {
            self.remove_generation(vol, gen)?;
        }
        std::fs::remove_dir_all(&dir)
            .map_err(BackendError::io(format!("removing {}", dir.display())))?;
        files::fsync_parent(&dir).map_err(BackendError::io("syncing directory"))
    }

    fn capacity(&self) -> Result<Capacity, BackendError> {
        let st = nix::sys::statvfs::statvfs(&self.root)
            .map_err(|e| BackendError::io("statvfs of the state dir")(e.into()))?;
        let frag = st.fragment_size() as u64;
        Ok(Capacity {
            total_bytes: st.blocks() as u64 * frag,
            available_bytes: st.blocks_available() as u64 * frag,
        })
    }

    fn allocated(&self, what: &DataRef) -> Result<u64, BackendError> {
        let path = match what {
            DataRef::Generation(v, g) => self.generation_path(v, *g),
            DataRef::Snapshot(s) => self.snapshot_path(s),
        };
        let bytes = if self.reflink {
            exclusive_bytes(&path)
        } else {
            // Nothing is shared without reflinks: the blocks the file holds.
            std::fs::metadata(&path).map(|m| m.blocks() * 512)
        };
        match bytes {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
            other => other.map_err(BackendError::io(format!(
                "reading the allocation of {}",
                path.display()
            ))),
        }
    }

    fn generation_path(&self, vol: &VolumeId, gen: u64) -> PathBuf {
        self.volume_dir(vol).join(format!("gen-{gen:06}.img"))
    }
}

/// `struct fiemap` of linux/fiemap.h (the request header).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct Fiemap {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
}

/// `struct fiemap_extent` of linux/fiemap.h.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct FiemapExtent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

const FIEMAP_BATCH: usize = 256;

/// The header followed by room for [`FIEMAP_BATCH`] extents, as the ioctl expects.
#[repr(C)]
struct FiemapRequest {
    head: Fiemap,
    extents: [FiemapExtent; FIEMAP_BATCH],
}

const FIEMAP_EXTENT_LAST: u32 = 0x0000_0001;
/// Data compressed or otherwise encoded: its length is not what it takes on disk.
const FIEMAP_EXTENT_ENCODED: u32 = 0x0000_0008;
/// The extent is shared with another file (a reflink clone or snapshot of it).
const FIEMAP_EXTENT_SHARED: u32 = 0x0000_2000;

nix::ioctl_readwrite!(fs_ioc_fiemap, b'f', 11, Fiemap);

/// Bytes of `path` in extents that no other file shares (FIEMAP): what the file holds
/// by itself on a reflink filesystem. Encoded (compressed) extents are not counted either,
/// since their mapped length is not their size on disk: the result never exceeds what
/// removing or overwriting the file would give back.
fn exclusive_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path)?;
    let mut req = Box::new(FiemapRequest {
        head: Fiemap::default(),
        extents: [FiemapExtent::default(); FIEMAP_BATCH],
    });
    let (mut start, mut total) = (0u64, 0u64);
    loop {
        req.head = Fiemap {
            start,
            length: u64::MAX,
            extent_count: FIEMAP_BATCH as u32,
            ..Default::default()
        };
        // SAFETY: a valid fd, and a header followed by room for `extent_count` extents.
        unsafe { fs_ioc_fiemap(file.as_raw_fd(), &mut req.head) }.map_err(std::io::Error::from)?;
        let n = (req.head.mapped_extents as usize).min(FIEMAP_BATCH);
        if n == 0 {
            return Ok(total);
        }
        for e in &req.extents[..n] {
            if e.flags & (FIEMAP_EXTENT_SHARED | FIEMAP_EXTENT_ENCODED) == 0 {
                total += e.length;
            }
        }
        let last = req.extents[n - 1];
        if last.flags & FIEMAP_EXTENT_LAST != 0 {
            return Ok(total);
        }
        start = last.logical + last.length;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn exclusive_bytes_counts_written_extents_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        files::create_sparse(&path, 64 << 20).unwrap();
        assert_eq!(
            exclusive_bytes(&path).unwrap(),
            0,
            "a sparse file holds nothing"
        );
        let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all(&vec![0xAB; 3 << 20]).unwrap();
        f.sync_all().unwrap();
        let held = exclusive_bytes(&path).unwrap();
        assert!(
            (3 << 20..=4 << 20).contains(&held),
            "3 MiB written, {held} bytes held"
        );
    }
}
