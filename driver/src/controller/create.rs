//! CreateVolume: StorageClass parameters, the filesystem, the size, a new image or
//! a copy of a snapshot or volume, and finishing a creation a crash interrupted.

use std::collections::BTreeMap;

use fencecsi_proto::v1::volume_content_source::Type as SourceType;
use fencecsi_proto::v1::*;

use super::capacity::size_for;
use super::Controller;
use crate::backend::capacity;
use crate::backend::meta::{now_nanos, Generation, Source, VolumeMeta, VolumeState};
use crate::backend::DataRef;
use crate::capability::{self, Access};
use crate::error::{CsiError, CsiResult};
use crate::ids::{Parsed, SnapshotId, VolumeId};

/// StorageClass parameter naming the filesystem.
pub const PARAM_FS_TYPE: &str = "fsType";
/// Parameters Kubernetes sidecars may add; accepted and ignored.
pub(super) const K8S_PARAM_PREFIX: &str = "csi.storage.k8s.io/";
/// The StorageClass's filesystem as external-provisioner reads it. It strips
/// the key before CreateVolume (the filesystem comes in the capability), but
/// its capacity controller passes the class's raw parameters to GetCapacity.
const K8S_PARAM_FS_TYPE: &str = "csi.storage.k8s.io/fstype";

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

    /// CreateVolume: a new volume, empty or a copy of a snapshot or volume; idempotent by name.
    pub(super) fn create_volume(
        &self,
        req: CreateVolumeRequest,
    ) -> CsiResult<CreateVolumeResponse> {
        check_name(&req.name)?;
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
        self.check_topology(&req)?;
        let source = content_source(&req);

        let _name_lock = self.inflight.try_lock(format!("name:{}", req.name))?;
        if let Some(existing) = self.store.volume_by_name(&req.name) {
            return self.answer_existing(existing, &req, &source, &fs_type);
        }

        let size = size.map_err(CsiError::OutOfRange)?;
        // Check the source before writing anything.
        let min_from_source = self.source_size(&source)?;
        if size < min_from_source {
            return Err(CsiError::OutOfRange(format!(
                "requested {size} bytes is smaller than the source ({min_from_source} bytes)"
            )));
        }
        let mutable_parameters = super::modify::validate(&req.mutable_parameters)?;
        let meta = new_volume(&req, size, fs_type, source, mutable_parameters);
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

    /// Only volumes reachable from this state dir's kernel can be made.
    fn check_topology(&self, req: &CreateVolumeRequest) -> CsiResult<()> {
        if let Some(t) = &req.accessibility_requirements {
            let ours = self.topology();
            if !t.requisite.is_empty() && !t.requisite.contains(&ours) {
                return Err(CsiError::ResourceExhausted(format!(
                    "volumes can only be made accessible from {ours:?}"
                )));
            }
        }
        Ok(())
    }

    /// A retried create: the volume of that name, if the request matches it (finished
    /// if a crash left it Creating), else ALREADY_EXISTS.
    fn answer_existing(
        &self,
        existing: VolumeMeta,
        req: &CreateVolumeRequest,
        source: &Option<Source>,
        fs_type: &str,
    ) -> CsiResult<CreateVolumeResponse> {
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
        let fits = existing.capacity_bytes >= reqb && (lim == 0 || existing.capacity_bytes <= lim);
        if !fits || &existing.source != source || existing.fs_type != fs_type {
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
        Ok(CreateVolumeResponse {
            volume: Some(self.to_csi(&v)),
        })
    }

    /// The size of the snapshot or volume a new volume is made from (NOT_FOUND if it
    /// does not exist, INVALID_ARGUMENT if its ID is malformed); 0 without a source.
    fn source_size(&self, source: &Option<Source>) -> CsiResult<u64> {
        Ok(match source {
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
}

fn check_name(name: &str) -> CsiResult<()> {
    if name.is_empty() {
        return Err(CsiError::InvalidArgument("name is required".into()));
    }
    if name.len() > 1024 || name.chars().any(|c| c.is_control() && !c.is_whitespace()) {
        return Err(CsiError::InvalidArgument(
            "name must be at most 1024 bytes without control characters".into(),
        ));
    }
    Ok(())
}

fn content_source(req: &CreateVolumeRequest) -> Option<Source> {
    match req
        .volume_content_source
        .as_ref()
        .and_then(|s| s.r#type.as_ref())
    {
        None => None,
        Some(SourceType::Snapshot(s)) => Some(Source::Snapshot(s.snapshot_id.clone())),
        Some(SourceType::Volume(s)) => Some(Source::Volume(s.volume_id.clone())),
    }
}

/// The record of a new volume, Creating, with its first generation.
fn new_volume(
    req: &CreateVolumeRequest,
    size: u64,
    fs_type: String,
    source: Option<Source>,
    mutable_parameters: BTreeMap<String, String>,
) -> VolumeMeta {
    VolumeMeta {
        mutable_parameters,
        // Set by the store when it writes the record.
        version: 0,
        id: VolumeId::generate().to_string(),
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
    }
}
