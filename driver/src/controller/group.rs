//! The CSI GroupController service: volume group snapshots.
//!
//! A group snapshot is one snapshot per source volume, all of them the
//! volumes' state at one instant (the spec's write-order consistency: a write
//! that was acknowledged before another was issued is in every copy that holds
//! the later one). `quiesce::quiesce_group` stops every member's writers
//! together (all visible filesystems frozen at once; at most one member that
//! cannot be frozen, copied by a single reflink), every member is copied, then
//! all are thawed. A group that cannot be made at one instant is refused with
//! FAILED_PRECONDITION, never made torn.
//!
//! Records: each member is an ordinary snapshot record naming its group
//! (`SnapshotMeta::group_snapshot_id`), so ListSnapshots shows it and
//! CreateVolume restores from it; the group record (`group-snapshots/<id>.json`)
//! is written after the members and removed before them. What a crash can
//! leave is removed at the next start ([`clean_leftovers`]): copies without a
//! record (the generic `leftovers` pass), members whose group has no record,
//! temp files of the group records.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use fencecsi_proto::v1::group_controller_server::GroupController as CsiGroupController;
use fencecsi_proto::v1::group_controller_service_capability::{
    rpc::Type as RpcType, Rpc, Type as CapType,
};
use fencecsi_proto::v1::*;
use tonic::{Request, Response, Status};

use super::snapshots::{timestamp, to_csi};
use super::Controller;
use crate::backend::meta::{now_nanos, GroupSnapshotMeta, MetaStore, SnapshotMeta, GROUPS_DIR};
use crate::backend::Backend;
use crate::error::{CsiError, CsiResult};
use crate::ids::{check_token, Parsed, SnapshotId, VolumeId};
use crate::kernel::files::CloneKind;

const GROUP_PREFIX: &str = "group-";

fn generate_group_id() -> String {
    format!("{GROUP_PREFIX}{}", uuid::Uuid::new_v4().simple())
}

/// A client's group snapshot ID: INVALID_ARGUMENT when missing or unsafe,
/// `None` when harmless but not one this plugin makes.
fn parse_group_id(raw: &str) -> CsiResult<Option<String>> {
    check_token("group snapshot ID", raw)?;
    let ours = raw.strip_prefix(GROUP_PREFIX).is_some_and(|h| {
        h.len() == 32
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    });
    Ok(ours.then(|| raw.to_string()))
}

/// The snapshot IDs a Get or Delete names, checked for safety.
fn requested_snapshot_ids(raw: &[String]) -> CsiResult<BTreeSet<&str>> {
    for s in raw {
        SnapshotId::parse(s)?;
    }
    Ok(raw.iter().map(String::as_str).collect())
}

/// INVALID_ARGUMENT when the caller named snapshot IDs that are not exactly
/// the group's (the spec's "snapshot list mismatch"). An empty list is taken
/// as "not given": csi-snapshotter sends none for a group content whose status
/// it has not recorded, and refusing that would leave the group undeletable.
fn check_members(g: &GroupSnapshotMeta, asked: &BTreeSet<&str>) -> CsiResult<()> {
    let ours: BTreeSet<&str> = g.snapshot_ids.iter().map(String::as_str).collect();
    if asked.is_empty() || *asked == ours {
        return Ok(());
    }
    Err(CsiError::InvalidArgument(format!(
        "snapshot_ids {:?} do not match the members of group snapshot {} ({:?})",
        asked, g.id, ours
    )))
}

impl Controller {
    fn to_csi_group(&self, g: &GroupSnapshotMeta) -> VolumeGroupSnapshot {
        let snapshots: Vec<Snapshot> = g
            .snapshot_ids
            .iter()
            .filter_map(|raw| match SnapshotId::parse(raw) {
                Ok(Parsed::Ours(sid)) => self.store.snapshot(&sid),
                _ => None,
            })
            .map(|s| to_csi(&s))
            .collect();
        let ready =
            snapshots.len() == g.snapshot_ids.len() && snapshots.iter().all(|s| s.ready_to_use);
        VolumeGroupSnapshot {
            group_snapshot_id: g.id.clone(),
            snapshots,
            creation_time: Some(timestamp(g.created_at)),
            ready_to_use: ready,
        }
    }

    pub(super) fn create_group_snapshot(
        &self,
        req: CreateVolumeGroupSnapshotRequest,
    ) -> CsiResult<CreateVolumeGroupSnapshotResponse> {
        let sources = check_group_request(&req)?;
        let parameters: BTreeMap<String, String> = req
            .parameters
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let _name_lock = self
            .inflight
            .try_lock(format!("group-snapshot-name:{}", req.name))?;
        if let Some(existing) = self.store.group_by_name(&req.name) {
            return self.answer_existing_group(existing, &req, &sources, &parameters);
        }
        let mut vids = Vec::with_capacity(req.source_volume_ids.len());
        for raw in &req.source_volume_ids {
            vids.push(self.existing_volume(raw)?.0);
        }
        let _vol_locks = vids
            .iter()
            .map(|v| self.inflight.try_lock(v.as_str()))
            .collect::<CsiResult<Vec<_>>>()?;
        let members = self.group_members(&vids)?;
        let total: u64 = members.iter().map(|(_, _, bytes)| bytes).sum();
        let _reserved = {
            let _guard = self.store.capacity_guard();
            self.ensure_capacity(
                total,
                &format!("a group snapshot of {} volumes", members.len()),
            )?;
            self.store.reserve(total)
        };
        let gid = generate_group_id();
        let sids: Vec<SnapshotId> = vids.iter().map(|_| SnapshotId::generate()).collect();
        let (created_at, made) = self.copy_members(&members, &sids)?;
        crate::failpoint::hit("group-snapshot:after-copy");
        let snaps: Vec<SnapshotMeta> = members
            .iter()
            .zip(&sids)
            .zip(&made)
            .map(|(((vid, _, _), sid), (origin, size))| SnapshotMeta {
                id: sid.to_string(),
                name: format!("{}/{}", req.name, vid),
                source_volume_id: vid.to_string(),
                size_bytes: *size,
                created_at,
                ready: true,
                origin: Some(*origin),
                group_snapshot_id: Some(gid.clone()),
            })
            .collect();
        let group = GroupSnapshotMeta {
            id: gid.clone(),
            name: req.name.clone(),
            source_volume_ids: req.source_volume_ids.clone(),
            snapshot_ids: sids.iter().map(|s| s.to_string()).collect(),
            parameters,
            created_at,
        };
        if let Err(e) = self.store.put_group(&group, &snaps) {
            let _ = self.store.remove_group(&group);
            self.discard_copies(&sids, "its records could not be written");
            return Err(CsiError::internal("writing group snapshot metadata", e));
        }
        tracing::info!(group_snapshot = %gid, name = %req.name, volumes = ?req.source_volume_ids, snapshots = ?group.snapshot_ids, "group snapshot created");
        Ok(CreateVolumeGroupSnapshotResponse {
            group_snapshot: Some(self.to_csi_group(&group)),
        })
    }

    /// A retried create: the group of that name if it has the same volumes and
    /// parameters, else ALREADY_EXISTS.
    fn answer_existing_group(
        &self,
        existing: GroupSnapshotMeta,
        req: &CreateVolumeGroupSnapshotRequest,
        sources: &BTreeSet<&str>,
        parameters: &BTreeMap<String, String>,
    ) -> CsiResult<CreateVolumeGroupSnapshotResponse> {
        let theirs: BTreeSet<&str> = existing
            .source_volume_ids
            .iter()
            .map(String::as_str)
            .collect();
        if &theirs != sources || &existing.parameters != parameters {
            return Err(CsiError::AlreadyExists(format!(
                "group snapshot {:?} already exists for volumes {:?}{}",
                req.name,
                existing.source_volume_ids,
                if &theirs == sources {
                    " with other parameters"
                } else {
                    ""
                }
            )));
        }
        Ok(CreateVolumeGroupSnapshotResponse {
            group_snapshot: Some(self.to_csi_group(&existing)),
        })
    }

    /// Each member's current generation and its data size.
    fn group_members(&self, vids: &[VolumeId]) -> CsiResult<Vec<(VolumeId, u64, u64)>> {
        let mut members = Vec::with_capacity(vids.len());
        for vid in vids {
            let v = self
                .store
                .volume(vid)
                .ok_or_else(|| CsiError::NotFound(format!("volume {vid} does not exist")))?;
            let gen = v.current_generation;
            members.push((vid.clone(), gen, v.data_bytes(gen)));
        }
        Ok(members)
    }

    /// Copies every member at one point in time: each member's writers stop together
    /// until the last copy has read its source. A failed copy, or a member whose writers
    /// could not be stopped and whose copy is not a reflink, discards every copy and
    /// refuses. Returns the time of the copies and each copy's kind and size.
    fn copy_members(
        &self,
        members: &[(VolumeId, u64, u64)],
        sids: &[SnapshotId],
    ) -> CsiResult<(i64, Vec<(CloneKind, u64)>)> {
        // Every member's writers stop here, together, until `quiet` drops.
        // The last member's copy thaws them once it has read its source.
        let (quiet, atomic) = self.quiesce_group(members)?;
        let at = now_nanos();
        let mut made: Vec<(CloneKind, u64)> = Vec::with_capacity(members.len());
        for (i, ((vid, gen, bytes), sid)) in members.iter().zip(sids).enumerate() {
            let window = quiet.window(i + 1 == members.len());
            match self.backend.snapshot(vid, *gen, *bytes, sid, &window) {
                Ok(m) => made.push(m),
                Err(e) => {
                    let e = quiet.explain(vid, e.into());
                    drop(quiet);
                    self.discard_copies(sids, "a copy failed");
                    return Err(e);
                }
            }
        }
        if let Some(i) = atomic {
            if made[i].0 != CloneKind::Reflink {
                drop(quiet);
                self.discard_copies(sids, "no reflink");
                return Err(CsiError::FailedPrecondition(format!(
                    "volume {} is in use by writers that cannot be stopped, and its copy could not be made as a reflink: the group snapshot would not be point-in-time",
                    members[i].0
                )));
            }
        }
        Ok((at, made))
    }

    fn discard_copies(&self, sids: &[SnapshotId], why: &str) {
        for sid in sids {
            if let Err(e) = self.backend.delete_snapshot(sid) {
                tracing::warn!(snapshot = %sid, error = %e, "cannot remove the copy of a group snapshot that failed ({why}); the next start removes it");
            }
        }
    }

    pub(super) fn delete_group_snapshot(
        &self,
        req: DeleteVolumeGroupSnapshotRequest,
    ) -> CsiResult<DeleteVolumeGroupSnapshotResponse> {
        let gid = parse_group_id(&req.group_snapshot_id)?;
        let asked = requested_snapshot_ids(&req.snapshot_ids)?;
        let Some(gid) = gid else {
            return Ok(DeleteVolumeGroupSnapshotResponse {});
        };
        let _lock = self.inflight.try_lock(gid.as_str())?;
        let Some(g) = self.store.group(&gid) else {
            // Gone. A retry after a delete that removed the records but not all
            // of the data: remove the data of the members named here that no
            // record refers to any more (a recorded snapshot is never touched).
            for raw in &req.snapshot_ids {
                if let Ok(Parsed::Ours(sid)) = SnapshotId::parse(raw) {
                    if self.store.snapshot(&sid).is_none() {
                        let _l = self.inflight.try_lock(sid.as_str())?;
                        self.backend.delete_snapshot(&sid)?;
                    }
                }
            }
            return Ok(DeleteVolumeGroupSnapshotResponse {});
        };
        check_members(&g, &asked)?;
        let sids: Vec<SnapshotId> = g
            .snapshot_ids
            .iter()
            .filter_map(|raw| match SnapshotId::parse(raw) {
                Ok(Parsed::Ours(s)) => Some(s),
                _ => None,
            })
            .collect();
        let _locks = sids
            .iter()
            .map(|s| self.inflight.try_lock(s.as_str()))
            .collect::<CsiResult<Vec<_>>>()?;
        // Records first (the group's, then its members'), then data: see the module docs.
        self.store
            .remove_group(&g)
            .map_err(|e| CsiError::internal("removing group snapshot metadata", e))?;
        crate::failpoint::hit("group-snapshot-delete:after-records");
        for sid in &sids {
            self.backend.delete_snapshot(sid)?;
        }
        tracing::info!(group_snapshot = %gid, snapshots = ?g.snapshot_ids, "group snapshot deleted");
        Ok(DeleteVolumeGroupSnapshotResponse {})
    }

    pub(super) fn get_group_snapshot(
        &self,
        req: GetVolumeGroupSnapshotRequest,
    ) -> CsiResult<GetVolumeGroupSnapshotResponse> {
        let gid = parse_group_id(&req.group_snapshot_id)?;
        let asked = requested_snapshot_ids(&req.snapshot_ids)?;
        let g = gid.and_then(|g| self.store.group(&g)).ok_or_else(|| {
            CsiError::NotFound(format!(
                "group snapshot {} does not exist",
                req.group_snapshot_id
            ))
        })?;
        check_members(&g, &asked)?;
        Ok(GetVolumeGroupSnapshotResponse {
            group_snapshot: Some(self.to_csi_group(&g)),
        })
    }
}

/// Removes at start what a crash in a group snapshot call left (see the
/// module docs); runs after `leftovers::clean`, under the state dir's lock.
pub(super) fn clean_leftovers(state_dir: &Path, store: &MetaStore, backend: &dyn Backend) {
    let dir = state_dir.join(GROUPS_DIR);
    for f in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = f.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.contains(".tmp-") {
            match std::fs::remove_file(f.path()) {
                Ok(()) => tracing::info!(file = %f.path().display(), "removed a crash leftover"),
                Err(e) => {
                    tracing::warn!(file = %f.path().display(), error = %e, "cannot remove a crash leftover")
                }
            }
        }
    }
    for s in store.snapshots() {
        let Some(gid) = &s.group_snapshot_id else {
            continue;
        };
        if store.group(gid).is_some() {
            continue;
        }
        let Ok(Parsed::Ours(sid)) = SnapshotId::parse(&s.id) else {
            continue;
        };
        match store
            .remove_snapshot_record(&sid)
            .map_err(|e| e.to_string())
            .and_then(|_| backend.delete_snapshot(&sid).map_err(|e| e.to_string()))
        {
            Ok(()) => {
                tracing::info!(snapshot = %sid, group_snapshot = %gid, "removed a member of a group snapshot that a crash left without its group")
            }
            Err(e) => {
                tracing::warn!(snapshot = %sid, group_snapshot = %gid, error = %e, "cannot remove a member of an unfinished group snapshot")
            }
        }
    }
    for g in store.groups() {
        let missing: Vec<&String> = g
            .snapshot_ids
            .iter()
            .filter(|s| !store.snapshot_by_id_str(s))
            .collect();
        if !missing.is_empty() {
            tracing::warn!(group_snapshot = %g.id, ?missing, "group snapshot record names members that have no record: it is reported not ready to use");
        }
    }
}

fn capabilities() -> Vec<GroupControllerServiceCapability> {
    vec![GroupControllerServiceCapability {
        r#type: Some(CapType::Rpc(Rpc {
            r#type: RpcType::CreateDeleteGetVolumeGroupSnapshot as i32,
        })),
    }]
}

/// The tonic-facing wrapper, served with the controller service.
#[derive(Clone)]
pub struct GroupControllerService(pub Arc<Controller>);

#[tonic::async_trait]
impl CsiGroupController for GroupControllerService {
    async fn group_controller_get_capabilities(
        &self,
        _r: Request<GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<GroupControllerGetCapabilitiesResponse>, Status> {
        Ok(Response::new(GroupControllerGetCapabilitiesResponse {
            capabilities: capabilities(),
        }))
    }
    async fn create_volume_group_snapshot(
        &self,
        r: Request<CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<CreateVolumeGroupSnapshotResponse>, Status> {
        super::owned_call(&self.0, "CreateVolumeGroupSnapshot", move |c| {
            c.create_group_snapshot(r.into_inner())
        })
        .await
    }
    async fn delete_volume_group_snapshot(
        &self,
        r: Request<DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<DeleteVolumeGroupSnapshotResponse>, Status> {
        super::owned_call(&self.0, "DeleteVolumeGroupSnapshot", move |c| {
            c.delete_group_snapshot(r.into_inner())
        })
        .await
    }
    async fn get_volume_group_snapshot(
        &self,
        r: Request<GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<GetVolumeGroupSnapshotResponse>, Status> {
        super::owned_call(&self.0, "GetVolumeGroupSnapshot", move |c| {
            c.get_group_snapshot(r.into_inner())
        })
        .await
    }
}

/// What can be checked of a request before anything is read: a name, source volumes
/// named once each, no parameter but the CO's own. Returns the sources as a set.
fn check_group_request(req: &CreateVolumeGroupSnapshotRequest) -> CsiResult<BTreeSet<&str>> {
    if req.name.is_empty() {
        return Err(CsiError::InvalidArgument("name is required".into()));
    }
    if req.source_volume_ids.is_empty() {
        return Err(CsiError::InvalidArgument(
            "source_volume_ids is required".into(),
        ));
    }
    super::snapshots::refuse_own_parameters(&req.parameters, "group snapshot")?;
    let mut sources = BTreeSet::new();
    for raw in &req.source_volume_ids {
        VolumeId::parse(raw)?;
        if !sources.insert(raw.as_str()) {
            return Err(CsiError::InvalidArgument(format!(
                "source volume {raw} is named twice"
            )));
        }
    }
    Ok(sources)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_ids_are_checked_like_other_ids() {
        let g = generate_group_id();
        assert_eq!(parse_group_id(&g).unwrap(), Some(g.clone()));
        assert_eq!(parse_group_id("fake-volume-id").unwrap(), None);
        // A snapshot ID is not a group ID, nor the other way round.
        let s = SnapshotId::generate().to_string();
        assert_eq!(parse_group_id(&s).unwrap(), None);
        assert!(matches!(SnapshotId::parse(&g), Ok(Parsed::Foreign)));
        for bad in ["", "../x", "a/b", "x y"] {
            assert!(
                matches!(parse_group_id(bad), Err(CsiError::InvalidArgument(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn member_lists_match_as_sets_and_empty_means_not_given() {
        let g = GroupSnapshotMeta {
            id: generate_group_id(),
            name: "g".into(),
            source_volume_ids: vec!["vol-a".into(), "vol-b".into()],
            snapshot_ids: vec!["snap-a".into(), "snap-b".into()],
            parameters: BTreeMap::new(),
            created_at: 0,
        };
        let set = |v: &[&'static str]| v.iter().copied().collect::<BTreeSet<&str>>();
        assert!(check_members(&g, &set(&[])).is_ok());
        assert!(check_members(&g, &set(&["snap-b", "snap-a"])).is_ok());
        for wrong in [
            &["snap-a"][..],
            &["snap-a", "snap-b", "snap-c"],
            &["snap-c"],
        ] {
            assert!(matches!(
                check_members(&g, &set(wrong)),
                Err(CsiError::InvalidArgument(_))
            ));
        }
    }
}
