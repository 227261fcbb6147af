//! DeleteVolume, ValidateVolumeCapabilities, ListVolumes and ControllerGetVolume:
//! reading and removing volume records, and a volume's condition.

use fencecsi_proto::v1::volume_content_source::{SnapshotSource, Type as SourceType, VolumeSource};
use fencecsi_proto::v1::*;

use super::{record_error, Controller};
use crate::backend::meta::{Source, VolumeMeta, VolumeState};
use crate::capability;
use crate::error::{CsiError, CsiResult};
use crate::ids::{Parsed, VolumeId};
use crate::terms::VOL_CTX_FS_TYPE;

impl Controller {
    pub(crate) fn to_csi(&self, v: &VolumeMeta) -> Volume {
        Volume {
            capacity_bytes: v.capacity_bytes as i64,
            volume_id: v.id.clone(),
            volume_context: [(VOL_CTX_FS_TYPE.to_string(), v.fs_type.clone())].into(),
            content_source: v.source.as_ref().map(|s| VolumeContentSource {
                r#type: Some(match s {
                    Source::Snapshot(id) => SourceType::Snapshot(SnapshotSource {
                        snapshot_id: id.clone(),
                    }),
                    Source::Volume(id) => SourceType::Volume(VolumeSource {
                        volume_id: id.clone(),
                    }),
                }),
            }),
            accessible_topology: vec![self.topology()],
        }
    }

    /// DeleteVolume: removes a volume nothing is published to, and its images.
    pub(super) fn delete_volume(
        &self,
        req: DeleteVolumeRequest,
    ) -> CsiResult<DeleteVolumeResponse> {
        let id = match VolumeId::parse(&req.volume_id)? {
            Parsed::Ours(id) => id,
            // Not ours, so certainly not there: deleting it is done.
            Parsed::Foreign => return Ok(DeleteVolumeResponse {}),
        };
        let _lock = self.inflight.try_lock(id.as_str())?;
        let Some(v) = self.store.volume(&id) else {
            // A crash may have left data without a record.
            self.backend.delete_volume(&id)?;
            return Ok(DeleteVolumeResponse {});
        };
        if !v.attachments.is_empty() {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {id} is still published to {}",
                v.attachments.keys().cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        // A controller that lost the state dir must not delete what another
        // one recorded since.
        self.store
            .ensure_current(&id)
            .map_err(|e| record_error("checking the volume's record", e))?;
        self.backend.delete_volume(&id)?;
        crate::failpoint::hit("delete:after-data");
        self.store
            .remove_volume(&id)
            .map_err(|e| record_error("removing volume metadata", e))?;
        tracing::info!(volume = %id, "volume deleted");
        Ok(DeleteVolumeResponse {})
    }

    /// ValidateVolumeCapabilities.
    pub(super) fn validate_volume_capabilities(
        &self,
        req: ValidateVolumeCapabilitiesRequest,
    ) -> CsiResult<ValidateVolumeCapabilitiesResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        let (_, v) = self.existing_volume(&req.volume_id)?;
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::InvalidArgument(
                "volume_capabilities is required".into(),
            ));
        }
        let unsupported = req
            .volume_capabilities
            .iter()
            .map(capability::parse)
            .find_map(Result::err)
            .map(|e| e.to_string())
            .or_else(|| {
                req.volume_capabilities
                    .iter()
                    .filter_map(|c| capability::parse(c).ok())
                    .find_map(|a| {
                        a.fs_type
                            .filter(|f| *f != v.fs_type)
                            .map(|f| format!("volume has a {} filesystem, not {f}", v.fs_type))
                    })
            });
        let unsupported = unsupported.or_else(|| {
            self.parse_parameters(&req.parameters)
                .err()
                .map(|e| e.to_string())
        });
        Ok(match unsupported {
            Some(message) => ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message,
            },
            None => ValidateVolumeCapabilitiesResponse {
                confirmed: Some(validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context,
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: Default::default(),
                }),
                message: String::new(),
            },
        })
    }

    /// ListVolumes: records in ID order, paged by the last ID returned.
    pub(super) fn list_volumes(&self, req: ListVolumesRequest) -> CsiResult<ListVolumesResponse> {
        if req.max_entries < 0 {
            return Err(CsiError::InvalidArgument(
                "max_entries must not be negative".into(),
            ));
        }
        let after = if req.starting_token.is_empty() {
            None
        } else {
            match VolumeId::parse(&req.starting_token) {
                Ok(Parsed::Ours(id)) => Some(id.to_string()),
                _ => {
                    return Err(CsiError::Aborted(format!(
                        "starting_token {:?} is not a token this plugin issued",
                        req.starting_token
                    )))
                }
            }
        };
        let limit = if req.max_entries == 0 {
            usize::MAX
        } else {
            req.max_entries as usize
        };
        let (page, more) = self.store.volumes_after(after.as_deref(), limit);
        let next_token = if more {
            page.last().map(|v| v.id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        // One scan of the holders for the whole page.
        let snapshot = self.backend.holder_snapshot()?;
        let entries = page
            .iter()
            .map(|v| list_volumes_response::Entry {
                volume: Some(self.to_csi(v)),
                status: Some(list_volumes_response::VolumeStatus {
                    published_node_ids: v.attachments.keys().cloned().collect(),
                    volume_condition: Some(self.condition_with(v, &snapshot)),
                }),
            })
            .collect();
        Ok(ListVolumesResponse {
            entries,
            next_token,
        })
    }

    /// The volume's health as the controller sees it, including who still
    /// holds fenced generations (usage detection by backing inode).
    /// [`Controller::condition_with`] with a fresh scan of the holders.
    pub(super) fn condition(&self, v: &VolumeMeta) -> VolumeCondition {
        match self.backend.holder_snapshot() {
            Ok(snapshot) => self.condition_with(v, &snapshot),
            Err(e) => VolumeCondition {
                abnormal: true,
                message: format!("cannot inspect holders: {e}"),
            },
        }
    }

    pub(super) fn condition_with(
        &self,
        v: &VolumeMeta,
        snapshot: &[crate::kernel::loop_device::LoopInfo],
    ) -> VolumeCondition {
        let id = v.volume_id();
        if v.state == VolumeState::Ready
            && !self.backend.generation_exists(&id, v.current_generation)
        {
            return VolumeCondition {
                abnormal: true,
                message: format!("data of generation {} is missing", v.current_generation),
            };
        }
        let mut notes = Vec::new();
        for (gen, g) in &v.generations {
            let holders = self.backend.holders_in(snapshot, &id, *gen);
            let devices: Vec<String> = holders
                .iter()
                .map(|l| l.device.display().to_string())
                .collect();
            match (&g.fenced_at, devices.is_empty()) {
                (Some(_), false) => notes.push(format!(
                    "fenced generation {gen} (node {}{}) is still held by {}; that node must force-unstage it",
                    g.fenced_node.as_deref().unwrap_or("?"),
                    g.fence_reason.as_deref().map(|r| format!(", {r}")).unwrap_or_default(),
                    devices.join(", ")
                )),
                (None, false) => notes.push(format!("generation {gen} attached as {}", devices.join(", "))),
                _ => {}
            }
        }
        let abnormal = notes.iter().any(|n| n.starts_with("fenced"));
        VolumeCondition {
            abnormal,
            message: if notes.is_empty() {
                "healthy".into()
            } else {
                notes.join("; ")
            },
        }
    }

    /// ControllerGetVolume: the record, where it is published and its condition.
    pub(super) fn controller_get_volume(
        &self,
        req: ControllerGetVolumeRequest,
    ) -> CsiResult<ControllerGetVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        let (_, v) = self.existing_volume(&req.volume_id)?;
        Ok(ControllerGetVolumeResponse {
            volume: Some(self.to_csi(&v)),
            status: Some(controller_get_volume_response::VolumeStatus {
                published_node_ids: v.attachments.keys().cloned().collect(),
                volume_condition: Some(self.condition(&v)),
            }),
        })
    }
}
