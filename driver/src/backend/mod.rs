//! Storage backend. The CSI layer speaks to storage only through the
//! [`Backend`] trait (data: generations, clones, the fence) and the
//! [`meta::MetaStore`] (bookkeeping), so another backend, for example a
//! networked one with real blocklisting, can be added without touching it.

pub mod capacity;
pub mod image;
pub mod meta;

use std::path::PathBuf;

use crate::fence::{FenceError, FenceReport};
use crate::ids::{SnapshotId, VolumeId};
use crate::kernel::files::{self, CloneKind, SourceWindow};
use crate::kernel::loop_device::LoopInfo;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Fence(#[from] FenceError),
    #[error("{0}")]
    Busy(String),
}

impl BackendError {
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BackendError {
        let what = what.into();
        move |source| BackendError::Io { what, source }
    }
}

impl From<BackendError> for crate::error::CsiError {
    fn from(e: BackendError) -> Self {
        use crate::error::CsiError;
        match e {
            BackendError::Fence(FenceError::Unsupported(_)) => {
                CsiError::FailedPrecondition(e.to_string())
            }
            BackendError::Busy(m) => CsiError::FailedPrecondition(m),
            BackendError::Io { ref source, .. } if source.raw_os_error() == Some(libc::ENOSPC) => {
                CsiError::ResourceExhausted(e.to_string())
            }
            other => CsiError::Internal(other.to_string()),
        }
    }
}

/// Where a clone reads from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataRef {
    Generation(VolumeId, u64),
    Snapshot(SnapshotId),
}

#[derive(Debug, Clone, Copy)]
pub struct Capacity {
    pub total_bytes: u64,
    pub available_bytes: u64,
}

/// Storage operations on volume data. A volume's data lives in numbered
/// generations; a fenced generation is never written again and is removed
/// only once nothing holds it.
pub trait Backend: Send + Sync + 'static {
    /// Short name for logs and volume context (e.g. "loop-image").
    fn kind(&self) -> &'static str;
    /// Creates an empty (sparse) generation.
    fn create(&self, vol: &VolumeId, gen: u64, size: u64) -> Result<(), BackendError>;
    /// Makes `vol`/`gen` a copy of the first `src_bytes` of `src` (its data,
    /// never a trailer), with `size` bytes of data. The source must not
    /// change meanwhile: fenced, or quiesced by the caller (then through
    /// [`Backend::clone_data_in`]).
    fn clone_data(
        &self,
        src: &DataRef,
        src_bytes: u64,
        vol: &VolumeId,
        gen: u64,
        size: u64,
    ) -> Result<CloneKind, BackendError> {
        self.clone_data_in(src, src_bytes, vol, gen, size, &files::Unbounded)
    }
    /// [`Backend::clone_data`] of a source that holds still only while
    /// `window` is open (a volume in use, quiesced by the caller): the copy
    /// stops when it closes and tells it when the source has been read.
    fn clone_data_in(
        &self,
        src: &DataRef,
        src_bytes: u64,
        vol: &VolumeId,
        gen: u64,
        size: u64,
        window: &dyn SourceWindow,
    ) -> Result<CloneKind, BackendError>;
    /// Copies the first `data_bytes` of a generation as a snapshot; returns
    /// its size. The caller quiesces the generation (see `controller::quiesce`);
    /// `window` is how long it holds still, as in [`Backend::clone_data_in`].
    fn snapshot(
        &self,
        vol: &VolumeId,
        gen: u64,
        data_bytes: u64,
        snap: &SnapshotId,
        window: &dyn SourceWindow,
    ) -> Result<(CloneKind, u64), BackendError>;
    /// Whether copies are reflinks (atomic against concurrent writers).
    fn reflinks(&self) -> bool;
    fn delete_snapshot(&self, snap: &SnapshotId) -> Result<(), BackendError>;
    /// Grows a generation's data from `old` to `size` bytes (never shrinks),
    /// moving the fence trailer behind it.
    fn grow(&self, vol: &VolumeId, gen: u64, old: u64, size: u64) -> Result<(), BackendError>;
    /// Makes every unfenced loop device on a generation show its whole data
    /// (see [`crate::fence::widen_holders`]); the devices widened.
    fn widen(
        &self,
        vol: &VolumeId,
        gen: u64,
        data_bytes: u64,
    ) -> Result<Vec<LoopInfo>, BackendError>;
    /// Gives a generation its fence trailer if it has none (older images).
    fn ensure_trailer(&self, vol: &VolumeId, gen: u64, data_bytes: u64)
        -> Result<(), BackendError>;
    /// The write fence on a whole generation: see [`crate::fence`].
    fn freeze(
        &self,
        vol: &VolumeId,
        gen: u64,
        data_bytes: u64,
    ) -> Result<FenceReport, BackendError>;
    /// Whether a whole-generation fence was started on `gen` (its marker
    /// exists), even if the controller died before recording it.
    fn fence_marked(&self, vol: &VolumeId, gen: u64) -> bool;
    /// Fences only the holders `pick` selects, leaving the generation writable.
    fn fence_devices(
        &self,
        vol: &VolumeId,
        gen: u64,
        data_bytes: u64,
        pick: &dyn Fn(&LoopInfo) -> bool,
    ) -> Result<FenceReport, BackendError>;
    /// Who still holds a generation (attached loop devices).
    fn holders(&self, vol: &VolumeId, gen: u64) -> Result<Vec<LoopInfo>, BackendError>;
    /// Every holder there is now, in one scan (filter it with
    /// [`Backend::holders_in`] when asking about many generations at once).
    fn holder_snapshot(&self) -> Result<Vec<LoopInfo>, BackendError>;
    /// The holders of one generation within a snapshot.
    fn holders_in(&self, snapshot: &[LoopInfo], vol: &VolumeId, gen: u64) -> Vec<LoopInfo>;
    /// Deletes a generation no one holds (thawing it first if fenced).
    fn remove_generation(&self, vol: &VolumeId, gen: u64) -> Result<(), BackendError>;
    /// Deletes all that is left of a volume.
    fn delete_volume(&self, vol: &VolumeId) -> Result<(), BackendError>;
    /// The size of the backend's storage and its free space now (see [`capacity`] for
    /// what is promised of it).
    fn capacity(&self) -> Result<Capacity, BackendError>;
    /// Bytes of storage that the data of `what` (a generation's image, a snapshot) holds
    /// by itself: allocated to it and shared with nothing else, so that the storage would
    /// lose them if it were written in full or removed. Extents a reflink shares with
    /// another file are not counted. 0 when it does not exist.
    fn allocated(&self, what: &DataRef) -> Result<u64, BackendError>;
    /// The file a node attaches for a generation.
    fn generation_path(&self, vol: &VolumeId, gen: u64) -> PathBuf;
    /// Whether the generation's data still exists.
    fn generation_exists(&self, vol: &VolumeId, gen: u64) -> bool {
        self.generation_path(vol, gen).exists()
    }
    /// The length of the generation's image (data and trailer), None without one.
    fn image_bytes(&self, vol: &VolumeId, gen: u64) -> Option<u64> {
        std::fs::metadata(self.generation_path(vol, gen))
            .ok()
            .map(|m| m.len())
    }
}
