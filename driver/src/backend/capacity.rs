//! Capacity accounting: what the backend has promised, and what it may still promise.
//!
//! Images are sparse, so the free space of the state dir's filesystem says nothing about
//! what the volumes already made will take once they are written; a driver that reports it
//! over-commits without limit, and the filesystem then fills up under the pods (ENOSPC on
//! the backing file becomes EIO inside the volume). So the controller counts promises. They
//! are recomputed on every call from the records and the files (nothing is kept as a counter
//! that could drift, and a restart finds the same figures):
//!
//! - **committed `C`**: for every volume record (those still being created too), every
//!   generation it still has: the current one, and the fenced ones until garbage collection
//!   has removed them; each its data bytes plus the fence trailer. A volume whose current
//!   generation is fenced also counts the generation the next publish will make (its
//!   capacity plus a trailer): on ext4 that publish copies the volume, and the fence has
//!   promised that copy already. Every snapshot counts its size. Reflink copies (xfs, btrfs)
//!   count in full as well: copy on write gives each side its own blocks as it is written.
//! - **outstanding `U`**: the part of `C` not allocated yet, image by image:
//!   `Σ max(0, promise − bytes the image alone holds)` ([`Backend::allocated`]; on reflink
//!   filesystems extents shared with another image do not count as held, which overstates
//!   `U` while they are shared, never understates it).
//! - `T`: the filesystem's size and `F` its free space (statvfs `f_blocks`, `f_bavail`:
//!   what other files on it have taken is gone from `F`); `R`: the reserve
//!   (`--capacity-reserve`, default 5% of `T`); `r`: `--overcommit-ratio` (default 1).
//!
//! ```text
//! headroom = max(0, min( r·(T − R) − C,      the promise budget
//!                        r·(F − R) − U ))    what is free for promises not yet written
//! ```
//!
//! At `r = 1` the second term says that every image can be written in full and the reserve
//! still stays free, whatever else lives on the filesystem; it is the binding one as soon
//! as anything else takes space. Above 1, promises may exceed the space by that factor, both
//! in total and against what is free now: as data is written, the room for new promises
//! shrinks with the free space.
//!
//! A new volume of `s` bytes needs `s` + trailer of headroom (CreateVolume refuses it with
//! RESOURCE_EXHAUSTED otherwise); growing one needs the growth. GetCapacity reports
//! headroom − trailer, the largest volume that fits now. A fence and the publish that
//! follows it are never refused for capacity (a fence that fails is worse than a full
//! backend): what they take is counted, and new volumes are refused instead.
//! A volume larger than `r·(T − R)` − trailer could never fit: OUT_OF_RANGE.

use std::fmt;

use super::meta::{MetaStore, VolumeMeta};
use super::{Backend, BackendError, Capacity, DataRef};
use crate::config::{CapacityReserve, Config};
use crate::fence::TRAILER_BYTES;
use crate::ids::{Parsed, SnapshotId, VolumeId};

/// The configured over-commit ratio and reserve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    pub overcommit_ratio: f64,
    pub reserve: CapacityReserve,
}

impl Policy {
    pub fn of(cfg: &Config) -> Self {
        Policy {
            overcommit_ratio: cfg.overcommit_ratio,
            reserve: cfg.capacity_reserve,
        }
    }

    /// `r · bytes`, exact at r = 1.
    fn scale(&self, bytes: u64) -> u64 {
        if self.overcommit_ratio == 1.0 {
            bytes
        } else {
            (bytes as f64 * self.overcommit_ratio).min(u64::MAX as f64) as u64
        }
    }

    /// `r·(T − R)`: what all promises together may add up to.
    pub fn budget(&self, cap: &Capacity) -> u64 {
        self.scale(cap.total_bytes - self.reserve.bytes_of(cap.total_bytes))
    }

    /// The largest volume this backend could hold even with nothing else on it.
    pub fn largest_volume(&self, cap: &Capacity) -> u64 {
        self.budget(cap).saturating_sub(TRAILER_BYTES)
    }
}

/// What one volume record promises (see the module docs).
pub fn volume_commitment(v: &VolumeMeta) -> u64 {
    let generations: u64 = v
        .generations
        .keys()
        .map(|g| v.data_bytes(*g) + TRAILER_BYTES)
        .sum();
    generations + pending_generation(v).unwrap_or(0)
}

/// The generation the next publish of a volume with a fenced current generation makes.
fn pending_generation(v: &VolumeMeta) -> Option<u64> {
    v.current_is_fenced()
        .then_some(v.capacity_bytes + TRAILER_BYTES)
}

/// The figures of one accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Assessment {
    /// `T`: the filesystem's size.
    pub total: u64,
    /// `F`: its free space.
    pub free: u64,
    /// `R`.
    pub reserve: u64,
    /// `r·(T − R)`.
    pub budget: u64,
    /// `C`.
    pub committed: u64,
    /// `U`.
    pub outstanding: u64,
    /// `r·(F − R)` (negative when less than the reserve is free).
    pub free_for_promises: i128,
}

impl Assessment {
    /// Bytes that new images (or growth) may still take.
    pub fn headroom(&self) -> u64 {
        let budget_left = self.budget as i128 - self.committed as i128;
        let physical_left = self.free_for_promises - self.outstanding as i128;
        budget_left.min(physical_left).max(0) as u64
    }

    /// The largest new volume that fits now (its image carries a trailer too).
    pub fn available_for_volume(&self) -> u64 {
        self.headroom().saturating_sub(TRAILER_BYTES)
    }
}

impl fmt::Display for Assessment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes left: {} committed of a budget of {}; {} of it not yet written, against {} free for promises (filesystem {} bytes, {} free, reserve {})",
            self.headroom(),
            self.committed,
            self.budget,
            self.outstanding,
            self.free_for_promises.max(0),
            self.total,
            self.free,
            self.reserve
        )
    }
}

/// Accounts every promise in `store` against `backend` (see the module docs).
pub fn assess(
    policy: &Policy,
    backend: &dyn Backend,
    store: &MetaStore,
) -> Result<Assessment, BackendError> {
    let cap = backend.capacity()?;
    let (mut committed, mut outstanding) = (0u64, 0u64);
    let mut count = |what: Option<DataRef>, promise: u64| -> Result<(), BackendError> {
        let held = match &what {
            Some(w) => backend.allocated(w)?,
            None => 0,
        };
        committed += promise;
        outstanding += promise.saturating_sub(held);
        Ok(())
    };
    for v in store.volumes() {
        let id = match VolumeId::parse(&v.id) {
            Ok(Parsed::Ours(id)) => Some(id),
            _ => None,
        };
        for gen in v.generations.keys() {
            let what = id.clone().map(|id| DataRef::Generation(id, *gen));
            count(what, v.data_bytes(*gen) + TRAILER_BYTES)?;
        }
        if let Some(p) = pending_generation(&v) {
            count(None, p)?;
        }
    }
    for s in store.snapshots() {
        let what = match SnapshotId::parse(&s.id) {
            Ok(Parsed::Ours(sid)) => Some(DataRef::Snapshot(sid)),
            _ => None,
        };
        count(what, s.size_bytes)?;
    }
    // Copies in the making, not recorded yet: all of it still to be allocated.
    count(None, store.reserved_bytes())?;
    let reserve = policy.reserve.bytes_of(cap.total_bytes);
    let above_reserve = cap.available_bytes as i128 - reserve as i128;
    Ok(Assessment {
        total: cap.total_bytes,
        free: cap.available_bytes,
        reserve,
        budget: policy.budget(&cap),
        committed,
        outstanding,
        free_for_promises: if above_reserve > 0 {
            policy.scale(above_reserve as u64) as i128
        } else {
            above_reserve
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn assessment(free: u64, committed: u64, outstanding: u64, ratio: f64) -> Assessment {
        let policy = Policy {
            overcommit_ratio: ratio,
            reserve: CapacityReserve::Bytes(10 * MIB),
        };
        let cap = Capacity {
            total_bytes: 110 * MIB,
            available_bytes: free,
        };
        let reserve = policy.reserve.bytes_of(cap.total_bytes);
        Assessment {
            total: cap.total_bytes,
            free,
            reserve,
            budget: policy.budget(&cap),
            committed,
            outstanding,
            free_for_promises: policy.scale(free.saturating_sub(reserve)) as i128,
        }
    }

    #[test]
    fn headroom_is_the_tighter_of_budget_and_free_space() {
        // Empty: everything above the reserve.
        assert_eq!(assessment(110 * MIB, 0, 0, 1.0).headroom(), 100 * MIB);
        // 60 promised, none written: 40 left either way.
        assert_eq!(
            assessment(110 * MIB, 60 * MIB, 60 * MIB, 1.0).headroom(),
            40 * MIB
        );
        // Other files took 30 of the free space: the physical side binds.
        assert_eq!(
            assessment(80 * MIB, 60 * MIB, 60 * MIB, 1.0).headroom(),
            10 * MIB
        );
        // Written data is not counted twice: 20 of the 60 written.
        assert_eq!(
            assessment(90 * MIB, 60 * MIB, 40 * MIB, 1.0).headroom(),
            40 * MIB
        );
        // Over-committed (a fence copy is never refused): nothing left, not negative.
        assert_eq!(
            assessment(110 * MIB, 130 * MIB, 130 * MIB, 1.0).headroom(),
            0
        );
        // Less free than the reserve.
        assert_eq!(assessment(5 * MIB, 0, 0, 1.0).headroom(), 0);
        // Ratio 2: twice the budget and twice the free space for promises.
        let a = assessment(110 * MIB, 60 * MIB, 60 * MIB, 2.0);
        assert_eq!(a.headroom(), 140 * MIB);
        assert_eq!(a.available_for_volume(), 139 * MIB);
    }

    #[test]
    fn a_fenced_current_generation_promises_the_next_one() {
        use crate::backend::meta::Generation;
        let gen = |fenced: bool| Generation {
            created_at: 0,
            origin: None,
            fenced_at: fenced.then_some(1),
            fenced_node: None,
            data_bytes: Some(16 * MIB),
            fence_reason: None,
        };
        // From JSON, as a record on disk is: fields added later keep their defaults.
        let mut v: VolumeMeta = serde_json::from_value(serde_json::json!({
            "id": VolumeId::generate().to_string(),
            "name": "v",
            "state": "ready",
            "capacity_bytes": 16 * MIB,
            "fs_type": "ext4",
            "parameters": {},
            "source": null,
            "created_at": 0,
            "current_generation": 1,
            "generations": {},
            "attachments": {},
            "fenced_from": {},
        }))
        .unwrap();
        v.generations.insert(1, gen(false));
        let one = 16 * MIB + TRAILER_BYTES;
        assert_eq!(volume_commitment(&v), one);
        v.generations.insert(1, gen(true));
        assert_eq!(
            volume_commitment(&v),
            2 * one,
            "fenced: the copy is promised"
        );
        v.generations.insert(2, gen(false));
        v.current_generation = 2;
        assert_eq!(volume_commitment(&v), 2 * one, "published: the copy exists");
        v.generations.remove(&1);
        assert_eq!(volume_commitment(&v), one, "collected");
        // Grown while fenced: the next generation has the new size.
        v.generations.insert(2, gen(true));
        v.capacity_bytes = 32 * MIB;
        assert_eq!(volume_commitment(&v), one + 32 * MIB + TRAILER_BYTES);
    }

    #[test]
    fn the_largest_volume_is_the_budget_less_a_trailer() {
        let cap = Capacity {
            total_bytes: 1000 * MIB,
            available_bytes: 0,
        };
        let p = Policy {
            overcommit_ratio: 1.0,
            reserve: CapacityReserve::Percent(5.0),
        };
        assert_eq!(p.largest_volume(&cap), 950 * MIB - TRAILER_BYTES);
        let p = Policy {
            overcommit_ratio: 1.5,
            ..p
        };
        assert_eq!(p.largest_volume(&cap), 1425 * MIB - TRAILER_BYTES);
    }
}
