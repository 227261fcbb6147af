//! Volume, snapshot and node bookkeeping as JSON files next to the data,
//! written atomically (temp, fsync, rename, fsync dir). The controller keeps
//! an in-memory copy; node plugins read the files fresh, since another
//! process (the controller) writes them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::ids::{Parsed, SnapshotId, VolumeId};
use crate::kernel::files::{self, CloneKind};

/// Where group snapshot records live: `<state>/group-snapshots/<id>.json`.
pub const GROUPS_DIR: &str = "group-snapshots";

pub fn now_nanos() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumeState {
    /// Metadata written, data not yet complete: a retry of CreateVolume finishes it.
    Creating,
    Ready,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "id")]
pub enum Source {
    Snapshot(String),
    Volume(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Generation {
    pub created_at: i64,
    /// How its data came to be (None: created empty).
    pub origin: Option<CloneKind>,
    /// Set once the fence on this generation was made.
    pub fenced_at: Option<i64>,
    /// The node whose attachment was fenced away.
    pub fenced_node: Option<String>,
    /// Bytes of volume data in the image (the fence trailer follows). None
    /// in records written before it was kept: the volume's capacity then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_bytes: Option<u64>,
    /// Why the fence was made when no one asked for it (the kernel showed a
    /// node still holding the generation): shown in the volume condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence_reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub generation: u64,
    pub readonly: bool,
    pub block: bool,
    pub published_at: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMeta {
    pub id: String,
    pub name: String,
    pub state: VolumeState,
    pub capacity_bytes: u64,
    pub fs_type: String,
    pub parameters: BTreeMap<String, String>,
    pub source: Option<Source>,
    pub created_at: i64,
    pub current_generation: u64,
    pub generations: BTreeMap<u64, Generation>,
    /// node ID -> attachment.
    pub attachments: BTreeMap<String, Attachment>,
    /// node ID -> generation it was fenced from; publishing to that node is
    /// refused until nothing holds that generation any more.
    // Named "quarantined" in records written before; not podgc's node quarantine.
    #[serde(alias = "quarantined")]
    pub fenced_from: BTreeMap<String, u64>,
    /// What `CreateVolume`/`ControllerModifyVolume` set (see `controller::modify`).
    #[serde(default)]
    pub mutable_parameters: BTreeMap<String, String>,
    /// Bumped by every write ([`MetaStore::put_volume`]): a write based on an
    /// older version (another controller wrote since) is refused. 0 in
    /// records written before versions were kept.
    #[serde(default)]
    pub version: u64,
}

impl VolumeMeta {
    /// The volume's direct-I/O choice, if it made one (otherwise the node's default).
    pub fn direct_io(&self) -> Option<bool> {
        self.mutable_parameters
            .get(crate::controller::modify::DIRECT_IO)
            .and_then(|v| v.parse().ok())
    }

    pub fn volume_id(&self) -> VolumeId {
        match VolumeId::parse(&self.id) {
            Ok(Parsed::Ours(v)) => v,
            _ => unreachable!("metadata is only loaded for well-formed IDs"),
        }
    }

    pub fn current(&self) -> Option<&Generation> {
        self.generations.get(&self.current_generation)
    }

    /// Bytes of data in generation `gen` (the rest of its image is trailer).
    pub fn data_bytes(&self, gen: u64) -> u64 {
        self.generations
            .get(&gen)
            .and_then(|g| g.data_bytes)
            .unwrap_or(self.capacity_bytes)
    }

    pub fn current_is_fenced(&self) -> bool {
        self.current().is_some_and(|g| g.fenced_at.is_some())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotMeta {
    pub id: String,
    pub name: String,
    pub source_volume_id: String,
    pub size_bytes: u64,
    pub created_at: i64,
    pub ready: bool,
    pub origin: Option<CloneKind>,
    /// The volume group snapshot this snapshot is a member of (see
    /// `controller::group`): it is deleted only with its group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_snapshot_id: Option<String>,
}

/// A volume group snapshot: member snapshots of several volumes taken at one
/// instant. Its members are ordinary snapshot records that name it; the group
/// record is written after them and removed before them, so a member whose
/// group has no record is what a crash left (see `controller::group`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSnapshotMeta {
    pub id: String,
    pub name: String,
    /// As the request named them (compared as a set).
    pub source_volume_ids: Vec<String>,
    /// One member per source volume, in the same order.
    pub snapshot_ids: Vec<String>,
    /// The request's parameters (part of its identity for idempotency).
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// The instant the members were copied at.
    pub created_at: i64,
}

/// What a node plugin registers so the controller can tell real nodes from
/// unknown ones (ControllerPublishVolume answers NOT_FOUND for those).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node_id: String,
    pub max_volumes: i64,
    pub registered_at: i64,
}

#[derive(Default)]
struct Cache {
    volumes: BTreeMap<String, VolumeMeta>,
    snapshots: BTreeMap<String, SnapshotMeta>,
    groups: BTreeMap<String, GroupSnapshotMeta>,
}

/// A volume record write or removal refused, or failed.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The record on disk is not the one this store last read or wrote:
    /// another controller changed it meanwhile. Nothing was written.
    #[error("volume {id}: its record on disk is {on_disk}, this controller last saw {ours}: another controller wrote it since; nothing written")]
    Stale {
        id: String,
        on_disk: String,
        ours: String,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// How a record's version reads in [`RecordError::Stale`].
fn version_text(v: Option<u64>) -> String {
    match v {
        Some(v) => format!("version {v}"),
        None => "absent".into(),
    }
}

/// Space promised to a copy in the making ([`MetaStore::reserve`]); given back when
/// dropped, by which time the copy's record (or its failure) accounts for it.
pub struct Reservation<'a> {
    store: &'a MetaStore,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut r = self
            .store
            .reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *r = r.saturating_sub(self.bytes);
    }
}

pub struct MetaStore {
    root: PathBuf,
    cache: Mutex<Cache>,
    /// Held from a capacity check to the record that takes the space (see
    /// [`MetaStore::capacity_guard`]).
    capacity: Mutex<()>,
    /// Bytes promised to copies still being made (see [`MetaStore::reserve`]).
    reserved: Mutex<u64>,
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> std::io::Result<Option<T>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn write_json<T: Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    let dir = path.parent().expect("metadata path has a parent");
    if !dir.exists() {
        std::fs::create_dir_all(dir)?;
        files::fsync_parent(dir)?;
    }
    files::write_atomic(
        path,
        &serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?,
    )
}

impl MetaStore {
    /// Loads every volume and snapshot record under `state_dir`.
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        let store = MetaStore {
            root: state_dir.to_path_buf(),
            cache: Mutex::new(Cache::default()),
            capacity: Mutex::new(()),
            reserved: Mutex::new(0),
        };
        let mut cache = Cache::default();
        for (kind, file) in [("volumes", "volume.json"), ("snapshots", "snapshot.json")] {
            let dir = state_dir.join(kind);
            std::fs::create_dir_all(&dir)?;
            for entry in std::fs::read_dir(&dir)?.flatten() {
                let path = entry.path().join(file);
                if kind == "volumes" {
                    if let Some(v) = read_json::<VolumeMeta>(&path)? {
                        cache.volumes.insert(v.id.clone(), v);
                    }
                } else if let Some(s) = read_json::<SnapshotMeta>(&path)? {
                    cache.snapshots.insert(s.id.clone(), s);
                }
            }
        }
        let groups = state_dir.join(GROUPS_DIR);
        std::fs::create_dir_all(&groups)?;
        for entry in std::fs::read_dir(&groups)?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // Temp files of an interrupted atomic write start with a dot.
            if name.starts_with('.') || !name.ends_with(".json") {
                continue;
            }
            if let Some(g) = read_json::<GroupSnapshotMeta>(&entry.path())? {
                cache.groups.insert(g.id.clone(), g);
            }
        }
        std::fs::create_dir_all(state_dir.join("nodes"))?;
        *store.cache.lock().unwrap() = cache;
        Ok(store)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serialises the calls that take capacity (CreateVolume, ControllerExpandVolume,
    /// snapshots): each holds it from its check of the capacity until the record, or
    /// the [`MetaStore::reserve`]ation, that takes the space is made, so two calls
    /// cannot both take the last of it. The accounting itself is computed from the
    /// records and reservations (see [`super::capacity`]), never kept as a counter.
    pub fn capacity_guard(&self) -> std::sync::MutexGuard<'_, ()> {
        self.capacity.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Promises `bytes` to a copy whose record is written only once the copy is
    /// done (a snapshot), until the returned reservation drops: taken under the
    /// capacity guard, which is then let go, so a long copy holds up no other call
    /// that takes capacity.
    pub fn reserve(&self, bytes: u64) -> Reservation<'_> {
        *self.reserved.lock().unwrap_or_else(|p| p.into_inner()) += bytes;
        Reservation { store: self, bytes }
    }

    /// What the live reservations promise.
    pub fn reserved_bytes(&self) -> u64 {
        *self.reserved.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn volume_path(state_dir: &Path, id: &str) -> PathBuf {
        state_dir.join("volumes").join(id).join("volume.json")
    }

    pub fn volume(&self, id: &VolumeId) -> Option<VolumeMeta> {
        self.lock().volumes.get(id.as_str()).cloned()
    }

    pub fn volume_by_name(&self, name: &str) -> Option<VolumeMeta> {
        self.lock()
            .volumes
            .values()
            .find(|v| v.name == name)
            .cloned()
    }

    pub fn volumes(&self) -> Vec<VolumeMeta> {
        self.lock().volumes.values().cloned().collect()
    }

    /// Volumes with IDs strictly after `after`, in ID order, at most `limit`.
    pub fn volumes_after(&self, after: Option<&str>, limit: usize) -> (Vec<VolumeMeta>, bool) {
        let cache = self.lock();
        let iter: Box<dyn Iterator<Item = &VolumeMeta>> = match after {
            Some(a) => Box::new(
                cache
                    .volumes
                    .range::<str, _>((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded))
                    .map(|(_, v)| v),
            ),
            None => Box::new(cache.volumes.values()),
        };
        let mut page: Vec<VolumeMeta> = iter.take(limit.saturating_add(1)).cloned().collect();
        let more = page.len() > limit;
        page.truncate(limit);
        (page, more)
    }

    /// Writes `v` as the next version of its record, if the record on disk
    /// is still the one this store last read or wrote (compare and swap,
    /// under `records.lock` so two controllers cannot both pass the check):
    /// a controller that lost the state dir cannot write over a newer record.
    pub fn put_volume(&self, v: &VolumeMeta) -> Result<(), RecordError> {
        let _w = crate::locks::RecordsLock::take(&self.root)?;
        let ours = self.check_unchanged(&v.id)?;
        let mut next = v.clone();
        next.version = ours.map_or(0, |o| o + 1);
        write_json(&Self::volume_path(&self.root, &v.id), &next)?;
        self.lock().volumes.insert(v.id.clone(), next);
        Ok(())
    }

    /// Forgets a volume whose data the backend has already removed (refused,
    /// like [`MetaStore::put_volume`], when another controller wrote it since;
    /// a record already gone is forgotten: the data went with its directory).
    pub fn remove_volume(&self, id: &VolumeId) -> Result<(), RecordError> {
        let _w = crate::locks::RecordsLock::take(&self.root)?;
        if Self::volume_path(&self.root, id.as_str()).exists() {
            self.check_unchanged(id.as_str())?;
        }
        let dir = self.root.join("volumes").join(id.as_str());
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
        files::fsync_dir(&self.root.join("volumes"))?;
        self.lock().volumes.remove(id.as_str());
        Ok(())
    }

    /// Refuses (Stale) when another controller wrote `id`'s record since this
    /// store last read or wrote it: checked before data is deleted.
    pub fn ensure_current(&self, id: &VolumeId) -> Result<(), RecordError> {
        let _w = crate::locks::RecordsLock::take(&self.root)?;
        self.check_unchanged(id.as_str()).map(drop)
    }

    /// The version of `id`'s record this store holds, after checking the
    /// disk holds the same (absent on both counts as the same).
    fn check_unchanged(&self, id: &str) -> Result<Option<u64>, RecordError> {
        let on_disk =
            read_json::<VolumeMeta>(&Self::volume_path(&self.root, id))?.map(|d| d.version);
        let ours = self.lock().volumes.get(id).map(|c| c.version);
        if on_disk != ours {
            return Err(RecordError::Stale {
                id: id.to_string(),
                on_disk: version_text(on_disk),
                ours: version_text(ours),
            });
        }
        Ok(ours)
    }

    /// How many volumes are attached to `node`.
    pub fn attachments_on(&self, node: &str) -> usize {
        self.lock()
            .volumes
            .values()
            .filter(|v| v.attachments.contains_key(node))
            .count()
    }

    pub fn snapshot(&self, id: &SnapshotId) -> Option<SnapshotMeta> {
        self.lock().snapshots.get(id.as_str()).cloned()
    }

    pub fn snapshot_by_name(&self, name: &str) -> Option<SnapshotMeta> {
        self.lock()
            .snapshots
            .values()
            .find(|s| s.name == name)
            .cloned()
    }

    /// Whether a volume record with this ID is loaded.
    pub fn volume_by_id_str(&self, id: &str) -> bool {
        self.lock().volumes.contains_key(id)
    }

    /// Whether a snapshot record with this ID is loaded.
    pub fn snapshot_by_id_str(&self, id: &str) -> bool {
        self.lock().snapshots.contains_key(id)
    }

    pub fn snapshots(&self) -> Vec<SnapshotMeta> {
        self.lock().snapshots.values().cloned().collect()
    }

    pub fn put_snapshot(&self, s: &SnapshotMeta) -> std::io::Result<()> {
        write_json(
            &self
                .root
                .join("snapshots")
                .join(&s.id)
                .join("snapshot.json"),
            s,
        )?;
        self.lock().snapshots.insert(s.id.clone(), s.clone());
        Ok(())
    }

    pub fn remove_snapshot_record(&self, id: &SnapshotId) -> std::io::Result<()> {
        let p = self
            .root
            .join("snapshots")
            .join(id.as_str())
            .join("snapshot.json");
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        self.lock().snapshots.remove(id.as_str());
        Ok(())
    }

    fn snapshot_record_path(&self, id: &str) -> PathBuf {
        self.root.join("snapshots").join(id).join("snapshot.json")
    }

    fn group_record_path(&self, id: &str) -> PathBuf {
        self.root.join(GROUPS_DIR).join(format!("{id}.json"))
    }

    pub fn group(&self, id: &str) -> Option<GroupSnapshotMeta> {
        self.lock().groups.get(id).cloned()
    }

    pub fn group_by_name(&self, name: &str) -> Option<GroupSnapshotMeta> {
        self.lock()
            .groups
            .values()
            .find(|g| g.name == name)
            .cloned()
    }

    pub fn groups(&self) -> Vec<GroupSnapshotMeta> {
        self.lock().groups.values().cloned().collect()
    }

    /// Records a group and its members: every member record first, the group
    /// record last (a crash in between leaves members without a group, which
    /// the next start removes). The in-memory view takes all of them at once,
    /// so no caller sees a member before its group.
    pub fn put_group(
        &self,
        g: &GroupSnapshotMeta,
        members: &[SnapshotMeta],
    ) -> std::io::Result<()> {
        for m in members {
            write_json(&self.snapshot_record_path(&m.id), m)?;
        }
        crate::failpoint::hit("group-snapshot:after-members");
        write_json(&self.group_record_path(&g.id), g)?;
        let mut cache = self.lock();
        for m in members {
            cache.snapshots.insert(m.id.clone(), m.clone());
        }
        cache.groups.insert(g.id.clone(), g.clone());
        Ok(())
    }

    /// Forgets a group and its members' records (not their data): the group
    /// record first, so a crash part way leaves members without a group, which
    /// the next start removes. The in-memory view drops them all at once, once
    /// every file is gone (a failed call leaves it whole for the retry).
    pub fn remove_group(&self, g: &GroupSnapshotMeta) -> std::io::Result<()> {
        match std::fs::remove_file(self.group_record_path(&g.id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        files::fsync_dir(&self.root.join(GROUPS_DIR))?;
        for sid in &g.snapshot_ids {
            match std::fs::remove_file(self.snapshot_record_path(sid)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        let mut cache = self.lock();
        for sid in &g.snapshot_ids {
            cache.snapshots.remove(sid);
        }
        cache.groups.remove(&g.id);
        Ok(())
    }

    pub fn register_node(state_dir: &Path, rec: &NodeRecord) -> std::io::Result<()> {
        write_json(
            &state_dir
                .join("nodes")
                .join(format!("{}.json", rec.node_id)),
            rec,
        )
    }

    pub fn node(&self, node_id: &str) -> std::io::Result<Option<NodeRecord>> {
        read_json(&self.root.join("nodes").join(format!("{node_id}.json")))
    }

    /// A fresh read from disk, for node plugins (the controller writes).
    pub fn read_volume(state_dir: &Path, id: &VolumeId) -> std::io::Result<Option<VolumeMeta>> {
        read_json(&Self::volume_path(state_dir, id.as_str()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(id: &str) -> VolumeMeta {
        VolumeMeta {
            id: id.into(),
            name: format!("name-{id}"),
            state: VolumeState::Ready,
            capacity_bytes: 1 << 20,
            fs_type: "ext4".into(),
            parameters: BTreeMap::new(),
            source: None,
            created_at: now_nanos(),
            current_generation: 1,
            generations: BTreeMap::from([(
                1,
                Generation {
                    created_at: 0,
                    origin: None,
                    fenced_at: None,
                    fenced_node: None,
                    data_bytes: None,
                    fence_reason: None,
                },
            )]),
            mutable_parameters: BTreeMap::new(),
            attachments: BTreeMap::new(),
            fenced_from: BTreeMap::new(),
            version: 0,
        }
    }

    /// Two controllers on one state dir (a stale one whose call went on after
    /// a successor started): the stale one's write over the newer record is
    /// refused and changes nothing; the successor's writes go on.
    #[test]
    fn a_write_based_on_an_older_record_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let id = VolumeId::generate().to_string();
        let first = MetaStore::open(dir.path()).unwrap();
        first.put_volume(&meta(&id)).unwrap();
        let second = MetaStore::open(dir.path()).unwrap();
        let mut grown = second.volume_by_name(&format!("name-{id}")).unwrap();
        grown.capacity_bytes = 2 << 20;
        second.put_volume(&grown).unwrap();

        let mut stale = first.volume_by_name(&format!("name-{id}")).unwrap();
        stale.fs_type = "xfs".into();
        let err = first.put_volume(&stale).unwrap_err();
        assert!(matches!(err, RecordError::Stale { .. }), "{err}");
        let parsed = match VolumeId::parse(&id).unwrap() {
            Parsed::Ours(v) => v,
            Parsed::Foreign => unreachable!(),
        };
        let err = first.remove_volume(&parsed).unwrap_err();
        assert!(matches!(err, RecordError::Stale { .. }), "{err}");
        let err = first.ensure_current(&parsed).unwrap_err();
        assert!(matches!(err, RecordError::Stale { .. }), "{err}");
        let on_disk = MetaStore::read_volume(dir.path(), &parsed)
            .unwrap()
            .unwrap();
        assert_eq!(on_disk.capacity_bytes, 2 << 20, "the newer record stands");
        assert_eq!(on_disk.fs_type, "ext4");
        // Control: the successor, whose view is current, writes again.
        grown.fs_type = "xfs".into();
        second.put_volume(&grown).unwrap();
        let on_disk = MetaStore::read_volume(dir.path(), &parsed)
            .unwrap()
            .unwrap();
        assert_eq!((on_disk.fs_type.as_str(), on_disk.version), ("xfs", 2));
    }

    #[test]
    fn records_from_before_the_rename_still_load() {
        let mut json = serde_json::to_value(meta("vol-old")).unwrap();
        let obj = json.as_object_mut().unwrap();
        obj.remove("fenced_from");
        obj.insert("quarantined".into(), serde_json::json!({"node-a": 3}));
        let v: VolumeMeta = serde_json::from_value(json).unwrap();
        assert_eq!(v.fenced_from.get("node-a"), Some(&3));
    }

    #[test]
    fn groups_and_members_survive_a_reopen_and_go_together() {
        let dir = tempfile::tempdir().unwrap();
        let store = MetaStore::open(dir.path()).unwrap();
        // A snapshot record written before groups existed still loads.
        let old = serde_json::json!({
            "id": SnapshotId::generate().to_string(), "name": "old",
            "source_volume_id": "vol-x", "size_bytes": 1, "created_at": 0,
            "ready": true, "origin": null,
        });
        let old: SnapshotMeta = serde_json::from_value(old).unwrap();
        assert_eq!(old.group_snapshot_id, None);
        store.put_snapshot(&old).unwrap();
        let gid = "group-0123456789abcdef0123456789abcdef".to_string();
        let members: Vec<SnapshotMeta> = (0..2)
            .map(|i| SnapshotMeta {
                id: SnapshotId::generate().to_string(),
                name: format!("g/{i}"),
                group_snapshot_id: Some(gid.clone()),
                ..old.clone()
            })
            .collect();
        let g = GroupSnapshotMeta {
            id: gid.clone(),
            name: "g".into(),
            source_volume_ids: vec!["vol-a".into(), "vol-b".into()],
            snapshot_ids: members.iter().map(|m| m.id.clone()).collect(),
            parameters: BTreeMap::new(),
            created_at: 7,
        };
        store.put_group(&g, &members).unwrap();
        let reopened = MetaStore::open(dir.path()).unwrap();
        assert_eq!(reopened.group(&gid), Some(g.clone()));
        assert_eq!(reopened.group_by_name("g"), Some(g.clone()));
        assert_eq!(reopened.snapshots().len(), 3);
        reopened.remove_group(&g).unwrap();
        assert_eq!(reopened.group(&gid), None);
        assert_eq!(reopened.snapshots(), vec![old.clone()]);
        let again = MetaStore::open(dir.path()).unwrap();
        assert!(again.groups().is_empty());
        assert_eq!(again.snapshots(), vec![old]);
    }

    #[test]
    fn records_survive_a_reopen_and_pages_are_ordered() {
        let dir = tempfile::tempdir().unwrap();
        let store = MetaStore::open(dir.path()).unwrap();
        let ids: Vec<String> = (0..5).map(|_| VolumeId::generate().to_string()).collect();
        for id in &ids {
            store.put_volume(&meta(id)).unwrap();
        }
        let reopened = MetaStore::open(dir.path()).unwrap();
        let mut sorted = ids.clone();
        sorted.sort();
        let (first, more) = reopened.volumes_after(None, 2);
        assert!(more);
        assert_eq!(
            first.iter().map(|v| v.id.clone()).collect::<Vec<_>>(),
            sorted[..2]
        );
        let (rest, more) = reopened.volumes_after(Some(&sorted[1]), 10);
        assert!(!more);
        assert_eq!(rest.len(), 3);
        assert_eq!(
            reopened
                .volume_by_name(&format!("name-{}", ids[3]))
                .unwrap()
                .id,
            ids[3]
        );
    }
}
