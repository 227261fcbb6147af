//! Volume lifecycle RPCs.

use std::collections::BTreeMap;

use fencecsi_proto::v1::volume_content_source::{SnapshotSource, Type as SourceType, VolumeSource};
use fencecsi_proto::v1::*;

use super::{record_error, Controller, TOPOLOGY_KEY, VOL_CTX_FS_TYPE};
use crate::backend::capacity::{self, Policy};
use crate::backend::meta::{now_nanos, Generation, PublishLock, Source, VolumeMeta, VolumeState};
use crate::backend::DataRef;
use crate::capability::{self, Access};
use crate::error::{CsiError, CsiResult};
use crate::ids::{Parsed, SnapshotId, VolumeId};

pub(super) const DEFAULT_SIZE: u64 = 1 << 30;
/// Sizes are rounded up to 4 KiB: the block size of the filesystems the driver makes
/// and a whole number of the loop devices' sectors. No coarser: an expansion or a
/// creation answers the size asked for whenever it is 4 KiB-aligned, as the resizer and
/// csi-sanity expect.
const ALIGN: u64 = 4096;
/// StorageClass parameter naming the filesystem.
pub const PARAM_FS_TYPE: &str = "fsType";
/// Parameters Kubernetes sidecars may add; accepted and ignored.
const K8S_PARAM_PREFIX: &str = "csi.storage.k8s.io/";
/// The StorageClass's filesystem as external-provisioner reads it. It strips
/// the key before CreateVolume (the filesystem comes in the capability), but
/// its capacity controller passes the class's raw parameters to GetCapacity.
const K8S_PARAM_FS_TYPE: &str = "csi.storage.k8s.io/fstype";

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
    /// Checks StorageClass parameters and returns the filesystem they ask for.
    pub(super) fn parse_parameters(
        &self,
        params: &std::collections::HashMap<String, String>,
    ) -> CsiResult<Option<String>> {
        let mut fs = None;
        for (k, v) in params {
            if k == PARAM_FS_TYPE || k == K8S_PARAM_FS_TYPE {
                if !capability::FS_TYPES.contains(&v.as_str()) {
                    return Err(CsiError::InvalidArgument(format!(
                        "parameter {k}={v:?} is not supported (ext4, xfs)"
                    )));
                }
                if fs.as_ref().is_some_and(|f| f != v) {
                    return Err(CsiError::InvalidArgument(format!(
                        "parameters {PARAM_FS_TYPE} and {K8S_PARAM_FS_TYPE} name different filesystems"
                    )));
                }
                fs = Some(v.clone());
            } else if !k.starts_with(K8S_PARAM_PREFIX) {
                return Err(CsiError::InvalidArgument(format!(
                    "unknown parameter {k:?} (supported: fsType)"
                )));
            }
        }
        Ok(fs)
    }

    /// The filesystem for a volume: parameter, else the capabilities' choice, else the default.
    fn choose_fs(&self, param: Option<String>, access: &[Access]) -> CsiResult<String> {
        let named: Vec<&String> = access.iter().filter_map(|a| a.fs_type.as_ref()).collect();
        if let Some(p) = &param {
            if let Some(other) = named.iter().find(|f| **f != p) {
                return Err(CsiError::InvalidArgument(format!(
                    "capability asks for {other} but parameter fsType is {p}"
                )));
            }
        }
        if named.windows(2).any(|w| w[0] != w[1]) {
            return Err(CsiError::InvalidArgument(
                "capabilities name different filesystems".into(),
            ));
        }
        Ok(param
            .or_else(|| named.first().map(|s| s.to_string()))
            .unwrap_or_else(|| self.cfg.default_fs_type.clone()))
    }

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

    pub(super) fn create_volume(
        &self,
        req: CreateVolumeRequest,
    ) -> CsiResult<CreateVolumeResponse> {
        if req.name.is_empty() {
            return Err(CsiError::InvalidArgument("name is required".into()));
        }
        if req.name.len() > 1024
            || req
                .name
                .chars()
                .any(|c| c.is_control() && !c.is_whitespace())
        {
            return Err(CsiError::InvalidArgument(
                "name must be at most 1024 bytes without control characters".into(),
            ));
        }
        let access = capability::parse_all(&req.volume_capabilities)?;
        let fs_type = self.choose_fs(self.parse_parameters(&req.parameters)?, &access)?;
        let all_block = access.iter().all(|a| a.block);
        let min = capability::min_size(&fs_type, all_block);
        // A size that cannot be made is OUT_OF_RANGE, but only once no volume has this
        // name: an existing one answers first (ALREADY_EXISTS when it does not match), as
        // the spec orders the checks. A malformed range is refused at once.
        let size = match size_for(req.capacity_range.as_ref(), min, self.largest_volume()?) {
            Ok(s) => Ok(s),
            Err(CsiError::OutOfRange(m)) => Err(m),
            Err(e) => return Err(e),
        };
        if let Some(t) = &req.accessibility_requirements {
            let ours = self.topology();
            if !t.requisite.is_empty() && !t.requisite.contains(&ours) {
                return Err(CsiError::ResourceExhausted(format!(
                    "volumes can only be made accessible from {ours:?}"
                )));
            }
        }
        let source = match req
            .volume_content_source
            .as_ref()
            .and_then(|s| s.r#type.as_ref())
        {
            None => None,
            Some(SourceType::Snapshot(s)) => Some(Source::Snapshot(s.snapshot_id.clone())),
            Some(SourceType::Volume(s)) => Some(Source::Volume(s.volume_id.clone())),
        };

        let _name_lock = self.inflight.try_lock(format!("name:{}", req.name))?;
        if let Some(existing) = self.store.volume_by_name(&req.name) {
            let lim = req
                .capacity_range
                .as_ref()
                .map(|r| r.limit_bytes as u64)
                .unwrap_or(0);
            let reqb = req
                .capacity_range
                .as_ref()
                .map(|r| r.required_bytes as u64)
                .unwrap_or(0);
            let fits =
                existing.capacity_bytes >= reqb && (lim == 0 || existing.capacity_bytes <= lim);
            if !fits || existing.source != source || existing.fs_type != fs_type {
                return Err(CsiError::AlreadyExists(format!(
                    "volume {} already exists with name {:?} but a different size, source or filesystem",
                    existing.id, req.name
                )));
            }
            let v = if existing.state == VolumeState::Creating {
                self.finish_create(existing)?
            } else {
                existing
            };
            return Ok(CreateVolumeResponse {
                volume: Some(self.to_csi(&v)),
            });
        }

        let size = size.map_err(CsiError::OutOfRange)?;

        // Check the source before writing anything.
        let min_from_source = match &source {
            None => 0,
            Some(Source::Snapshot(raw)) => {
                let snap = match SnapshotId::parse(raw)? {
                    Parsed::Ours(s) => self.store.snapshot(&s).map(|m| (s, m)),
                    Parsed::Foreign => None,
                };
                let (_, m) = snap
                    .ok_or_else(|| CsiError::NotFound(format!("snapshot {raw} does not exist")))?;
                m.size_bytes
            }
            Some(Source::Volume(raw)) => self.existing_volume(raw)?.1.capacity_bytes,
        };
        if size < min_from_source {
            return Err(CsiError::OutOfRange(format!(
                "requested {size} bytes is smaller than the source ({min_from_source} bytes)"
            )));
        }

        let mutable_parameters = super::modify::validate(&req.mutable_parameters)?;
        let id = VolumeId::generate();
        let meta = VolumeMeta {
            mutable_parameters,
            // Set by the store when it writes the record.
            version: 0,
            id: id.to_string(),
            name: req.name.clone(),
            state: VolumeState::Creating,
            capacity_bytes: size,
            fs_type,
            parameters: req
                .parameters
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<BTreeMap<_, _>>(),
            source,
            created_at: now_nanos(),
            current_generation: 1,
            generations: BTreeMap::from([(
                1,
                Generation {
                    created_at: now_nanos(),
                    origin: None,
                    fenced_at: None,
                    fenced_node: None,
                    data_bytes: Some(size),
                    fence_reason: None,
                },
            )]),
            attachments: BTreeMap::new(),
            fenced_from: BTreeMap::new(),
        };
        // The capacity is taken by the record: checked and written under one guard, so
        // concurrent creates cannot both take the last of it. A retry of this name finds
        // the record above and is not checked again.
        let reserve = self.store.capacity_guard();
        self.ensure_capacity(
            capacity::volume_commitment(&meta),
            &format!("a volume of {size} bytes"),
        )?;
        // Metadata first: a crash after this point leaves a Creating record
        // that a retry with the same name completes, so no image is orphaned.
        self.persist(&meta)?;
        drop(reserve);
        crate::failpoint::hit("create:after-record");
        let v = self.finish_create(meta)?;
        tracing::info!(volume = %v.id, name = %v.name, size = v.capacity_bytes, fs = %v.fs_type, "volume created");
        Ok(CreateVolumeResponse {
            volume: Some(self.to_csi(&v)),
        })
    }

    /// Writes the data of a Creating volume and marks it Ready (idempotent).
    fn finish_create(&self, mut v: VolumeMeta) -> CsiResult<VolumeMeta> {
        let id = v.volume_id();
        let origin = match &v.source {
            None => {
                self.backend.create(&id, 1, v.capacity_bytes)?;
                None
            }
            Some(Source::Snapshot(raw)) => {
                let Ok(Parsed::Ours(sid)) = SnapshotId::parse(raw) else {
                    unreachable!("checked before the record was written")
                };
                let Some(snap) = self.store.snapshot(&sid) else {
                    return Err(CsiError::NotFound(format!(
                        "snapshot {raw} no longer exists"
                    )));
                };
                Some(self.backend.clone_data(
                    &DataRef::Snapshot(sid),
                    snap.size_bytes,
                    &id,
                    1,
                    v.capacity_bytes,
                )?)
            }
            Some(Source::Volume(raw)) => {
                let (src, _) = self.existing_volume(raw)?;
                // As for a snapshot: the source's generation and size hold
                // still (no fence, expansion or delete) during the copy.
                let _src_lock = self.inflight.try_lock(src.as_str())?;
                let m = self
                    .store
                    .volume(&src)
                    .ok_or_else(|| CsiError::NotFound(format!("volume {raw} does not exist")))?;
                let gen = m.current_generation;
                let bytes = m.data_bytes(gen);
                // A volume in use is copied at one instant (see quiesce), or
                // the clone is refused and leaves nothing, as a snapshot is.
                let quiet = self.quiesce(&src, gen, bytes).map_err(|e| match e {
                    CsiError::FailedPrecondition(_) => self.abandon_create(&id, e),
                    other => other,
                })?;
                let made = match self.backend.clone_data_in(
                    &DataRef::Generation(src.clone(), gen),
                    bytes,
                    &id,
                    1,
                    v.capacity_bytes,
                    &quiet.window(true),
                ) {
                    Ok(made) => made,
                    // Writers let go (the freeze bound) before the copy was read: refused.
                    Err(_) if quiet.expired() => {
                        let e = quiet.expiry_refusal(&src);
                        drop(quiet);
                        return Err(self.abandon_create(&id, e));
                    }
                    Err(e) => return Err(e.into()),
                };
                if let Err(e) = quiet.refuse_torn(&src, made) {
                    drop(quiet);
                    return Err(self.abandon_create(&id, e));
                }
                Some(made)
            }
        };
        if let Some(g) = v.generations.get_mut(&1) {
            g.origin = origin;
        }
        crate::failpoint::hit("create:after-data");
        v.state = VolumeState::Ready;
        self.persist(&v)?;
        Ok(v)
    }

    /// A creation refused for good (a copy that would not be point-in-time):
    /// its record and any data go, so a torn copy is never found complete by
    /// a retry (`clone_data` keeps a finished file) and no capacity stays
    /// taken. A retried CreateVolume makes the volume anew. Returns `why`.
    fn abandon_create(&self, id: &VolumeId, why: CsiError) -> CsiError {
        match self.store.remove_volume(id) {
            Ok(()) => {
                tracing::info!(volume = %id, reason = %why, "volume creation refused; nothing kept")
            }
            Err(e) => {
                tracing::warn!(volume = %id, error = %e, "cannot remove a refused creation; the next start removes it")
            }
        }
        why
    }

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

    pub(super) fn validate(
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
        snapshot: &[crate::loopdev::LoopInfo],
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

    /// The configured over-commit ratio and reserve.
    fn capacity_policy(&self) -> Policy {
        Policy::of(&self.cfg)
    }

    /// The largest volume the backend could ever hold (above it: OUT_OF_RANGE).
    fn largest_volume(&self) -> CsiResult<u64> {
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

    pub(super) fn expand(
        &self,
        req: ControllerExpandVolumeRequest,
    ) -> CsiResult<ControllerExpandVolumeResponse> {
        if req.volume_id.is_empty() {
            return Err(CsiError::InvalidArgument("volume_id is required".into()));
        }
        let range = req
            .capacity_range
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("capacity_range is required".into()))?;
        let (id, _) = self.existing_volume(&req.volume_id)?;
        let _lock = self.inflight.try_lock(id.as_str())?;
        let mut v = self
            .store
            .volume(&id)
            .ok_or_else(|| CsiError::NotFound(format!("volume {id} does not exist")))?;
        if let Some(cap) = &req.volume_capability {
            capability::parse(cap)?;
        }
        // From the record's growth until the devices are widened: a stage either
        // attached before (and is widened below) or reads the grown record (and
        // attaches it whole). Taken after the capacity guard, as snapshots do.
        let publish_lock = || {
            PublishLock::take_for_rpc(
                &self.cfg.state_dir,
                &id,
                true,
                "growing the volume's attached devices",
            )
        };
        let mut _stage_lock = None;
        let size = size_for(Some(range), v.capacity_bytes, self.largest_volume()?)?;
        if size > v.capacity_bytes {
            // A fenced current generation is immutable; the clone made at the
            // next publish is created at the recorded size instead.
            // Generations keep the data size they have now; only the
            // current one, if writable, grows.
            let old = v.capacity_bytes;
            let before = capacity::volume_commitment(&v);
            let mut grown = v.clone();
            for g in grown.generations.values_mut() {
                g.data_bytes.get_or_insert(old);
            }
            let gen = grown.current_generation;
            let from = grown.data_bytes(gen);
            let writable = !grown.current_is_fenced();
            // A device fenced away from this generation (a partial fence: other nodes
            // stay entitled) shows a window just past the data; growing the data would
            // put that window onto volume bytes. Expand once its node released it.
            if writable {
                let held = self
                    .backend
                    .holders(&id, gen)
                    .map_err(|e| CsiError::internal("listing the volume's loop devices", e))?;
                if let Some(lo) = held
                    .iter()
                    .find(|l| l.offset != 0 || crate::fence::is_fenced_device(l, from))
                {
                    return Err(CsiError::FailedPrecondition(format!(
                        "volume {id} still has a fenced loop device ({}) on generation {gen}: it can grow once that node released it",
                        lo.device.display()
                    )));
                }
            }
            if writable {
                if let Some(g) = grown.generations.get_mut(&gen) {
                    g.data_bytes = Some(size);
                }
            }
            grown.capacity_bytes = size;
            // The growth is taken like a new volume's space (under the same guard until
            // the record says so); a fenced current generation's is the larger copy the
            // next publish makes.
            let _reserve = self.store.capacity_guard();
            let growth = capacity::volume_commitment(&grown).saturating_sub(before);
            self.ensure_capacity(
                growth,
                &format!("growing volume {id} from {old} to {size} bytes"),
            )?;
            _stage_lock = Some(publish_lock()?);
            if writable {
                self.backend.grow(&id, gen, from, size)?;
                crate::failpoint::hit("expand:after-grow");
            }
            v = grown;
            self.persist(&v)?;
            crate::failpoint::hit("expand:after-record");
            tracing::info!(volume = %id, size, "volume expanded");
        }
        // Also on a retry: a widen that failed after the record was written
        // is made again. Nodes never remap devices (a node that hangs must
        // not undo a fence with a stale widen): NodeExpandVolume only grows
        // the filesystem on the device made whole here.
        let gen = v.current_generation;
        if !v.current_is_fenced()
            && !self.backend.fence_marked(&id, gen)
            && self.backend.generation_exists(&id, gen)
        {
            if _stage_lock.is_none() {
                _stage_lock = Some(publish_lock()?);
            }
            let widened = self
                .backend
                .widen(&id, gen, v.data_bytes(gen))
                .map_err(|e| match e {
                    crate::backend::BackendError::Fence(crate::fence::FenceError::Io {
                        ref source,
                        ..
                    }) if source.kind() == std::io::ErrorKind::TimedOut => CsiError::Aborted(
                        format!("volume {id}: a node process holds its image lock; retry later"),
                    ),
                    e => e.into(),
                })?;
            for lo in &widened {
                tracing::info!(volume = %id, generation = gen, device = %lo.device.display(), bytes = lo.size_bytes, "attached device widened to the volume's size");
            }
        }
        Ok(ControllerExpandVolumeResponse {
            capacity_bytes: v.capacity_bytes as i64,
            node_expansion_required: true,
        })
    }

    pub(super) fn get_volume(
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
