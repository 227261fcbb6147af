//! Snapshot RPCs. A snapshot is a point-in-time copy of the data of the
//! volume's current generation (see `quiesce`): a reflink clone where the
//! backend supports it, a sparse copy otherwise. Data first, record second:
//! a crash in between leaves a directory without a record, which the next
//! start removes (`leftovers`).
//!
//! Members of a volume group snapshot (`group`) are snapshots too: listed,
//! restorable, with `group_snapshot_id` set. The spec lets a plugin refuse to
//! delete one on its own (INVALID_ARGUMENT), which this one does: a member
//! goes with its group.

use fencecsi_proto::v1::*;

use super::Controller;
use crate::backend::meta::{now_nanos, SnapshotMeta};
use crate::error::{CsiError, CsiResult};
use crate::ids::{Parsed, SnapshotId, VolumeId};
use crate::kernel::files::CloneKind;

pub(super) fn timestamp(nanos: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: nanos / 1_000_000_000,
        nanos: (nanos % 1_000_000_000) as i32,
    }
}

pub(super) fn to_csi(s: &SnapshotMeta) -> Snapshot {
    Snapshot {
        size_bytes: s.size_bytes as i64,
        snapshot_id: s.id.clone(),
        source_volume_id: s.source_volume_id.clone(),
        creation_time: Some(timestamp(s.created_at)),
        ready_to_use: s.ready,
        group_snapshot_id: s.group_snapshot_id.clone().unwrap_or_default(),
    }
}

/// Refuses any parameter but the ones Kubernetes' sidecars add: snapshots take none.
pub(super) fn refuse_own_parameters(
    parameters: &std::collections::HashMap<String, String>,
    what: &str,
) -> CsiResult<()> {
    match parameters
        .keys()
        .find(|k| !k.starts_with(super::create::K8S_PARAM_PREFIX))
    {
        Some(k) => Err(CsiError::InvalidArgument(format!(
            "unknown {what} parameter {k:?} (none are supported)"
        ))),
        None => Ok(()),
    }
}

impl Controller {
    /// CreateSnapshot: a point-in-time copy of a volume (frozen while it is read).
    pub(super) fn create_snapshot(
        &self,
        req: CreateSnapshotRequest,
    ) -> CsiResult<CreateSnapshotResponse> {
        if req.name.is_empty() {
            return Err(CsiError::InvalidArgument("name is required".into()));
        }
        if req.source_volume_id.is_empty() {
            return Err(CsiError::InvalidArgument(
                "source_volume_id is required".into(),
            ));
        }
        refuse_own_parameters(&req.parameters, "snapshot")?;
        let _name_lock = self
            .inflight
            .try_lock(format!("snapshot-name:{}", req.name))?;
        // Group members carry their group's name; they are not this call's.
        let existing = self
            .store
            .snapshots()
            .into_iter()
            .find(|s| s.name == req.name && s.group_snapshot_id.is_none());
        if let Some(existing) = existing {
            if existing.source_volume_id != req.source_volume_id {
                return Err(CsiError::AlreadyExists(format!(
                    "snapshot {:?} already exists for volume {}",
                    req.name, existing.source_volume_id
                )));
            }
            return Ok(CreateSnapshotResponse {
                snapshot: Some(to_csi(&existing)),
            });
        }
        let (vid, _) = self.existing_volume(&req.source_volume_id)?;
        let _vol_lock = self.inflight.try_lock(vid.as_str())?;
        let v = self
            .store
            .volume(&vid)
            .ok_or_else(|| CsiError::NotFound(format!("volume {vid} does not exist")))?;
        let sid = SnapshotId::generate();
        let gen = v.current_generation;
        let bytes = v.data_bytes(gen);
        // A snapshot counts its full size against the backend (an ext4 copy writes it):
        // refused like a volume that does not fit, reserved until its record is written.
        let _reserved = {
            let _guard = self.store.capacity_guard();
            self.ensure_capacity(bytes, &format!("a snapshot of volume {vid}"))?;
            self.store.reserve(bytes)
        };
        let (origin, size) = self.copy_quiesced(&vid, gen, bytes, &sid)?;
        crate::failpoint::hit("snapshot:after-copy");
        let meta = SnapshotMeta {
            id: sid.to_string(),
            name: req.name.clone(),
            source_volume_id: vid.to_string(),
            size_bytes: size,
            created_at: now_nanos(),
            ready: true,
            origin: Some(origin),
            group_snapshot_id: None,
        };
        if let Err(e) = self.store.put_snapshot(&meta) {
            let _ = self.backend.delete_snapshot(&sid);
            return Err(CsiError::internal("writing snapshot metadata", e));
        }
        tracing::info!(snapshot = %sid, volume = %vid, size, ?origin, "snapshot created");
        Ok(CreateSnapshotResponse {
            snapshot: Some(to_csi(&meta)),
        })
    }

    /// Copies generation `gen` of the volume into snapshot `sid` with its writers stopped
    /// (or as a reflink) until the copy has read it, at most --max-freeze (see quiesce);
    /// a copy that failed or may be torn is deleted.
    fn copy_quiesced(
        &self,
        vid: &VolumeId,
        gen: u64,
        bytes: u64,
        sid: &SnapshotId,
    ) -> CsiResult<(CloneKind, u64)> {
        let quiet = self.quiesce(vid, gen, bytes)?;
        crate::failpoint::pause("snapshot:before-copy", vid.as_str());
        let made = match self
            .backend
            .snapshot(vid, gen, bytes, sid, &quiet.window(true))
        {
            Ok(made) => made,
            Err(e) => {
                let e = quiet.explain(vid, e.into());
                drop(quiet);
                let _ = self.backend.delete_snapshot(sid);
                return Err(e);
            }
        };
        if let Err(e) = quiet.refuse_torn(vid, made.0) {
            let _ = self.backend.delete_snapshot(sid);
            return Err(e);
        }
        Ok(made)
    }

    /// DeleteSnapshot.
    pub(super) fn delete_snapshot(
        &self,
        req: DeleteSnapshotRequest,
    ) -> CsiResult<DeleteSnapshotResponse> {
        let sid = match SnapshotId::parse(&req.snapshot_id)? {
            Parsed::Ours(s) => s,
            Parsed::Foreign => return Ok(DeleteSnapshotResponse {}),
        };
        let _lock = self.inflight.try_lock(sid.as_str())?;
        if let Some(g) = self.store.snapshot(&sid).and_then(|s| s.group_snapshot_id) {
            return Err(CsiError::InvalidArgument(format!(
                "snapshot {sid} is part of volume group snapshot {g} and cannot be deleted on its own: delete the group (DeleteVolumeGroupSnapshot)"
            )));
        }
        // Record first, then data: a crash in between leaves unreferenced data
        // that a retried delete still removes.
        self.store
            .remove_snapshot_record(&sid)
            .map_err(|e| CsiError::internal("removing snapshot metadata", e))?;
        crate::failpoint::hit("snapshot-delete:after-record");
        self.backend.delete_snapshot(&sid)?;
        tracing::info!(snapshot = %sid, "snapshot deleted");
        Ok(DeleteSnapshotResponse {})
    }

    /// ListSnapshots.
    pub(super) fn list_snapshots(
        &self,
        req: ListSnapshotsRequest,
    ) -> CsiResult<ListSnapshotsResponse> {
        if req.max_entries < 0 {
            return Err(CsiError::InvalidArgument(
                "max_entries must not be negative".into(),
            ));
        }
        let after = if req.starting_token.is_empty() {
            None
        } else {
            match SnapshotId::parse(&req.starting_token) {
                Ok(Parsed::Ours(s)) => Some(s.to_string()),
                _ => {
                    return Err(CsiError::Aborted(format!(
                        "starting_token {:?} is not a token this plugin issued",
                        req.starting_token
                    )))
                }
            }
        };
        let mut all: Vec<SnapshotMeta> = self
            .store
            .snapshots()
            .into_iter()
            .filter(|s| req.snapshot_id.is_empty() || s.id == req.snapshot_id)
            .filter(|s| {
                req.source_volume_id.is_empty() || s.source_volume_id == req.source_volume_id
            })
            .filter(|s| after.as_ref().is_none_or(|a| s.id.as_str() > a.as_str()))
            .collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        let limit = if req.max_entries == 0 {
            usize::MAX
        } else {
            req.max_entries as usize
        };
        let more = all.len() > limit;
        all.truncate(limit);
        let next_token = if more {
            all.last().map(|s| s.id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(ListSnapshotsResponse {
            entries: all
                .iter()
                .map(|s| list_snapshots_response::Entry {
                    snapshot: Some(to_csi(s)),
                })
                .collect(),
            next_token,
        })
    }
}
