//! GetCapacity and the capacity policy every creation and expansion goes through:
//! sizes from capacity ranges, the largest volume, and what can be promised now.

use fencecsi_proto::v1::*;

use super::Controller;
use crate::backend::capacity::{self, Policy};
use crate::capability;
use crate::error::{CsiError, CsiResult};
use crate::terms::TOPOLOGY_KEY;

/// The size of a volume whose capacity range asks for nothing.
pub(super) const DEFAULT_SIZE: u64 = 1 << 30;
/// Sizes are rounded up to 4 KiB: the block size of the filesystems the driver makes
/// and a whole number of the loop devices' sectors. No coarser: an expansion or a
/// creation answers the size asked for whenever it is 4 KiB-aligned, as the resizer and
/// csi-sanity expect.
const ALIGN: u64 = 4096;

fn round_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// Resolves a CSI capacity range into a size: INVALID_ARGUMENT when the range
/// is malformed, OUT_OF_RANGE when it cannot be met: below the minimum, or above
/// `largest`, the largest volume the backend could ever hold (whether the size fits
/// the capacity left now is checked separately: RESOURCE_EXHAUSTED).
pub(super) fn size_for(range: Option<&CapacityRange>, min: u64, largest: u64) -> CsiResult<u64> {
    let (req, lim) = range
        .map(|r| (r.required_bytes, r.limit_bytes))
        .unwrap_or((0, 0));
    if req < 0 || lim < 0 {
        return Err(CsiError::InvalidArgument(
            "capacity_range values must not be negative".into(),
        ));
    }
    let (req, lim) = (req as u64, lim as u64);
    if lim != 0 && req > lim {
        return Err(CsiError::InvalidArgument(format!(
            "required_bytes {req} exceeds limit_bytes {lim}"
        )));
    }
    let mut size = if req == 0 {
        DEFAULT_SIZE.max(min)
    } else {
        round_up(req).max(min)
    };
    if lim != 0 && size > lim {
        // Rounding up or the filesystem minimum overshot the limit: use the
        // limit itself when it is still big enough.
        size = if lim >= min.max(req) {
            lim
        } else {
            return Err(CsiError::OutOfRange(format!("no size between {req} and {lim} bytes works: the minimum for this volume is {min} bytes")));
        };
        if req == 0 && size < min {
            return Err(CsiError::OutOfRange(format!(
                "limit_bytes {lim} is below the minimum {min}"
            )));
        }
    }
    if size > largest {
        return Err(CsiError::OutOfRange(format!(
            "{size} bytes is larger than the backend can ever hold: at most {largest} bytes (its size less the reserve, times the over-commit ratio, less the fence trailer)"
        )));
    }
    Ok(size)
}

impl Controller {
    /// The configured over-commit ratio and reserve.
    fn capacity_policy(&self) -> Policy {
        Policy::of(&self.cfg)
    }

    /// The largest volume the backend could ever hold (above it: OUT_OF_RANGE).
    pub(super) fn largest_volume(&self) -> CsiResult<u64> {
        Ok(self
            .capacity_policy()
            .largest_volume(&self.backend.capacity()?))
    }

    /// The capacity accounting now (see [`crate::backend::capacity`]).
    pub(crate) fn assess_capacity(&self) -> CsiResult<capacity::Assessment> {
        Ok(capacity::assess(
            &self.capacity_policy(),
            &*self.backend,
            &self.store,
        )?)
    }

    /// RESOURCE_EXHAUSTED unless `bytes` more can be promised now. The caller holds
    /// [`crate::backend::meta::MetaStore::capacity_guard`] until its record is written.
    pub(super) fn ensure_capacity(&self, bytes: u64, what: &str) -> CsiResult<()> {
        let a = self.assess_capacity()?;
        if bytes > a.headroom() {
            tracing::warn!(
                need = bytes,
                headroom = a.headroom(),
                committed = a.committed,
                outstanding = a.outstanding,
                "refused for capacity: {what}"
            );
            return Err(CsiError::ResourceExhausted(format!(
                "out of capacity: {what} needs {bytes} bytes of the backend (with its fence trailer), and {a}"
            )));
        }
        Ok(())
    }

    /// GetCapacity: the largest volume CreateVolume takes now.
    pub(super) fn get_capacity(&self, req: GetCapacityRequest) -> CsiResult<GetCapacityResponse> {
        let fs = self
            .parse_parameters(&req.parameters)?
            .unwrap_or_else(|| self.cfg.default_fs_type.clone());
        let access: Result<Vec<_>, _> = req
            .volume_capabilities
            .iter()
            .map(capability::parse)
            .collect();
        let a = self.assess_capacity()?;
        let none = GetCapacityResponse {
            available_capacity: 0,
            maximum_volume_size: Some(0),
            ..Default::default()
        };
        let Ok(access) = access else {
            // Nothing with those capabilities can be provisioned.
            return Ok(none);
        };
        // A segment of another state dir and kernel: CreateVolume cannot make volumes
        // accessible there (it refuses such a requisite topology), so nothing is available.
        let ours = self.topology();
        if req.accessible_topology.as_ref().is_some_and(|t| {
            t.segments
                .get(TOPOLOGY_KEY)
                .is_some_and(|v| Some(v) != ours.segments.get(TOPOLOGY_KEY))
        }) {
            return Ok(none);
        }
        let block = !access.is_empty() && access.iter().all(|a| a.block);
        let available = a.available_for_volume() as i64;
        Ok(GetCapacityResponse {
            available_capacity: available,
            // The largest volume CreateVolume takes now. (The Kubernetes scheduler prefers
            // this over the capacity when both are published: it must not be larger.)
            maximum_volume_size: Some(available),
            minimum_volume_size: Some(capability::min_size(&fs, block) as i64),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(req: i64, lim: i64) -> CapacityRange {
        CapacityRange {
            required_bytes: req,
            limit_bytes: lim,
        }
    }

    #[test]
    fn sizes_round_up_and_respect_limits() {
        let t = 1 << 40;
        assert_eq!(size_for(None, 16 << 20, t).unwrap(), DEFAULT_SIZE);
        assert_eq!(size_for(Some(&range(1, 0)), 16 << 20, t).unwrap(), 16 << 20);
        assert_eq!(
            size_for(Some(&range((5 << 20) + 1, 0)), 1 << 20, t).unwrap(),
            (5 << 20) + 4096
        );
        assert_eq!(
            size_for(Some(&range((5 << 20) + 8192, 0)), 1 << 20, t).unwrap(),
            (5 << 20) + 8192,
            "an aligned size is answered as asked"
        );
        assert_eq!(
            size_for(Some(&range((5 << 20) + 1, (5 << 20) + 100)), 1 << 20, t).unwrap(),
            (5 << 20) + 100
        );
        assert!(matches!(
            size_for(Some(&range(-1, 0)), 1, t),
            Err(CsiError::InvalidArgument(_))
        ));
        assert!(matches!(
            size_for(Some(&range(10, 5)), 1, t),
            Err(CsiError::InvalidArgument(_))
        ));
        assert!(matches!(
            size_for(Some(&range(0, 1 << 20)), 300 << 20, t),
            Err(CsiError::OutOfRange(_))
        ));
        assert!(matches!(
            size_for(Some(&range(2 << 40, 0)), 1, t),
            Err(CsiError::OutOfRange(_))
        ));
    }
}
