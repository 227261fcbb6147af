//! Mutable parameters (VolumeAttributesClass): what a volume may change after it was made,
//! through `CreateVolume.mutable_parameters` and `ControllerModifyVolume`.
//!
//! One parameter: `directIO` ("true" / "false"), whether the loop devices of this volume
//! do direct I/O on the image (bypassing the page cache of the backing filesystem). It
//! overrides the node plugin's `--direct-io` default. A modify applies it at once to every
//! loop device that holds the volume's current generation (`LOOP_SET_DIRECT_IO`: the
//! controller shares the nodes' kernel), and every later attach uses it. The kernel may
//! refuse direct I/O (the backing filesystem cannot do it, or the device's block size does
//! not fit): then the device stays buffered, as an attach falls back, and the modify says
//! so in its log; the parameter is a preference, never a reason to fail I/O.

use std::collections::{BTreeMap, HashMap};

use fencecsi_proto::v1::{ControllerModifyVolumeRequest, ControllerModifyVolumeResponse};

use super::Controller;
use crate::error::{CsiError, CsiResult};

/// The mutable parameter key for direct I/O.
pub const DIRECT_IO: &str = "directIO";

/// Checks `params` (every key known, every value valid) and returns them normalised.
pub(crate) fn validate(params: &HashMap<String, String>) -> CsiResult<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (k, v) in params {
        match k.as_str() {
            DIRECT_IO => {
                let b: bool = v.parse().map_err(|_| {
                    CsiError::InvalidArgument(format!(
                        "mutable parameter {DIRECT_IO} must be \"true\" or \"false\", not {v:?}"
                    ))
                })?;
                out.insert(k.clone(), b.to_string());
            }
            other => {
                return Err(CsiError::InvalidArgument(format!(
                    "unknown mutable parameter {other:?} (this driver knows: {DIRECT_IO})"
                )))
            }
        }
    }
    Ok(out)
}

impl Controller {
    /// ControllerModifyVolume: checks and records the mutable parameters.
    pub(super) fn controller_modify_volume(
        &self,
        req: ControllerModifyVolumeRequest,
    ) -> CsiResult<ControllerModifyVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        if req.mutable_parameters.is_empty() {
            return Err(CsiError::InvalidArgument(
                "mutable_parameters is required".into(),
            ));
        }
        let params = validate(&req.mutable_parameters)?;
        let (id, _) = self.existing_volume(&req.volume_id)?;
        let _lock = self.inflight.try_lock(id.as_str())?;
        let (_, mut v) = self.existing_volume(&req.volume_id)?;
        let before = v.mutable_parameters.clone();
        v.mutable_parameters.extend(params);
        if v.mutable_parameters != before {
            self.persist(&v)?;
        }
        if let Some(dio) = v.direct_io() {
            let holders = self
                .backend
                .holders(&id, v.current_generation)
                .map_err(|e| CsiError::internal("listing the volume's loop devices", e))?;
            // `direct_io` of a device on a gate is the gate's, and the switch goes to the gate.
            for lo in holders.iter().filter(|l| l.direct_io != dio) {
                match crate::kernel::loop_device::set_direct_io(&lo.device, dio) {
                    Ok(()) => {
                        tracing::info!(volume = %id, device = %lo.device.display(), direct_io = dio, "loop device switched")
                    }
                    Err(e) => {
                        tracing::warn!(volume = %id, device = %lo.device.display(), direct_io = dio, error = %e, "the kernel refused the switch: the device keeps its mode")
                    }
                }
            }
        }
        tracing::info!(volume = %id, parameters = ?v.mutable_parameters, "volume modified");
        Ok(ControllerModifyVolumeResponse {})
    }
}
