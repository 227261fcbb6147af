//! CSI ephemeral inline volumes: a volume that lives exactly as long as one pod's
//! NodePublishVolume ... NodeUnpublishVolume on this node.
//!
//! Kubernetes calls only NodePublishVolume for an inline `csi:` volume of a pod (no
//! CreateVolume, no ControllerPublish, no NodeStage). With `podInfoOnMount: true` in the
//! CSIDriver it marks the call with `csi.storage.k8s.io/ephemeral: "true"` in the volume
//! context, next to the pod's `volumeAttributes`; the volume ID is its own invention
//! (`csi-<sha256(pod UID + volume name)>`). NodeUnpublishVolume at the pod's end is the
//! only other call.
//!
//! Where the data lives: `<node state dir>/ephemeral/<key>/data.img` (default
//! `<kubelet dir>/plugins/<driver>/ephemeral/...`), where `<key>` is 32 hex digits of
//! sha256(volume ID). Not in the shared state dir: nothing but this node ever uses the
//! volume, so no controller record, capacity count, garbage collection or state-dir
//! identity check has anything to say about it, and a missing or wrong state dir never
//! stands between a pod and its scratch space or keeps its cleanup from running. The
//! space comes from the kubelet's filesystem, like an emptyDir's. The image has no fence
//! trailer: it is never fenced, since it never leaves this node.
//!
//! Publish, step by step (each step's failpoint named): the dir and an informational
//! `volume.json`, the sparse image (`ephemeral:after-image`), a loop device tagged
//! `fcsie:<key>:<owner tag>` (`ephemeral:after-attach`), mkfs (`ephemeral:after-mkfs`), the
//! mount at the target (`ephemeral:after-mount`). What is published is read back from the
//! kernel, never from a record: the target's mount, and the tagged loop device's size.
//!
//! Nothing leaks on a crash: a volume is complete exactly when its device is mounted.
//! Anything of ours that is not mounted anywhere (a dir, an image, a tagged device) is a
//! publish that never completed, or an unpublish that did not finish. The sweep removes
//! it at node start-up (before the plugin serves) and at every recovery pass; a publish
//! that finds such leftovers for its own volume discards them and starts afresh (no data
//! can be in a volume that was never mounted); a failed publish in a live plugin rolls
//! back at once. A mounted one is in use and left alone. So a node reboot, which unmounts
//! everything, also ends every ephemeral volume's data: like a pod's emptyDir on tmpfs.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use fencecsi_proto::v1::*;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::recover::wait_unbound;
use super::stage::{device_users, fs_options, rdev};
use super::{remove_target, Node};
use crate::capability::{self, FS_TYPES};
use crate::error::{CsiError, CsiResult};
use crate::ids::{Parsed, VolumeId};
use crate::loopdev::{self, AttachOptions, LoopInfo};
use crate::mounts;
use crate::{fsops, fsutil};

/// The volume context key kubelet sets (with `podInfoOnMount`) on every NodePublishVolume:
/// "true" for an inline ephemeral volume, "false" otherwise.
pub const CTX_EPHEMERAL: &str = "csi.storage.k8s.io/ephemeral";
/// Keys kubelet owns (pod name, namespace, UID, service account, the ephemeral flag):
/// accepted and not interpreted.
const KUBELET_PREFIX: &str = "csi.storage.k8s.io/";
/// `volumeAttributes` an inline volume may set.
pub const ATTR_SIZE: &str = "size";
pub const ATTR_FS_TYPE: &str = "fsType";
const ATTRIBUTES: [&str; 2] = [ATTR_SIZE, ATTR_FS_TYPE];

/// Size when `size` is not given (images are sparse: only what is written takes space).
pub const DEFAULT_SIZE: u64 = 1 << 30;
/// The largest `size` accepted: the space comes from the kubelet's filesystem.
pub const MAX_SIZE: u64 = 64 << 30;
const MIB: u64 = 1 << 20;

/// Below the node state dir.
pub const DIR: &str = "ephemeral";
pub const IMAGE: &str = "data.img";
const INFO: &str = "volume.json";
/// Tags of ephemeral loop devices: `fcsie:<key>:<owner tag>` (47 bytes). Persistent
/// volumes' `fcsi:` tags never match it, so recovery and fences never look at these.
const TAG_PREFIX: &str = "fcsie:";
const KEY_HEX: usize = 32;

/// Whether a NodePublishVolume is for an inline ephemeral volume.
pub fn is_ephemeral(ctx: &HashMap<String, String>) -> bool {
    ctx.get(CTX_EPHEMERAL).is_some_and(|v| v == "true")
}

/// The directory key of a volume ID: 32 hex digits of its sha256.
pub fn key_of(volume_id: &str) -> String {
    hex::encode(&Sha256::digest(volume_id.as_bytes())[..KEY_HEX / 2])
}

/// Where the image and info of ephemeral volume `volume_id` live.
pub fn volume_dir(node_state_dir: &Path, volume_id: &str) -> PathBuf {
    node_state_dir.join(DIR).join(key_of(volume_id))
}

/// The owner part of this plugin's ephemeral loop tags: 8 hex digits of sha256 of the node
/// ID and the node state dir (symlinks of its existing part resolved). Several node
/// plugins may share one kernel (kind, the drill, tests), and tests even run several under
/// one node ID: a plugin only ever touches devices tagged with its own owner.
pub fn owner_tag(node_id: &str, node_state_dir: &Path) -> String {
    let dir = crate::paths::resolve_existing_prefix(node_state_dir);
    let mut h = Sha256::new();
    h.update(node_id.as_bytes());
    h.update([0]);
    h.update(dir.as_os_str().as_encoded_bytes());
    hex::encode(&h.finalize()[..4])
}

/// (key, owner tag) of an ephemeral loop device's tag.
pub fn parse_tag(tag: &str) -> Option<(&str, &str)> {
    let (key, node) = tag.strip_prefix(TAG_PREFIX)?.split_once(':')?;
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hex(key, KEY_HEX) && hex(node, 8)).then_some((key, node))
}

/// kubelet's volume IDs for inline volumes: `csi-` and 64 lowercase hex digits. An
/// unpublish of such an ID that finds nothing is done (kubelet retries a teardown until it
/// succeeds); other unknown IDs stay NOT_FOUND, as for persistent volumes.
fn is_kubelet_ephemeral_id(id: &str) -> bool {
    id.strip_prefix("csi-").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// What an inline volume asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Params {
    /// Bytes, a whole number of MiB.
    pub size: u64,
    pub fs_type: String,
}

/// Checks the volume context of an ephemeral publish: `size` and `fsType` are the only
/// attributes (besides kubelet's own `csi.storage.k8s.io/` keys); the capability's fs type
/// (a pod's `csi.fsType`) and the attribute must agree when both are set.
pub fn parse_params(
    ctx: &HashMap<String, String>,
    cap_fs: Option<&str>,
    default_fs: &str,
) -> CsiResult<Params> {
    let mut unknown: Vec<&str> = ctx
        .keys()
        .map(String::as_str)
        .filter(|k| !k.starts_with(KUBELET_PREFIX) && !ATTRIBUTES.contains(k))
        .collect();
    if !unknown.is_empty() {
        unknown.sort_unstable();
        return Err(CsiError::InvalidArgument(format!(
            "unknown volume attributes {unknown:?} for an ephemeral volume (supported: {ATTRIBUTES:?})"
        )));
    }
    let attr_fs = ctx
        .get(ATTR_FS_TYPE)
        .map(|s| s.trim())
        .filter(|s| !s.is_empty());
    let fs_type = match (attr_fs, cap_fs.filter(|s| !s.is_empty())) {
        (Some(a), Some(c)) if a != c => {
            return Err(CsiError::InvalidArgument(format!(
                "volume attribute fsType={a:?} contradicts the volume capability's fs_type {c:?}"
            )))
        }
        (Some(a), _) => a,
        (None, Some(c)) => c,
        (None, None) => default_fs,
    }
    .to_string();
    if !FS_TYPES.contains(&fs_type.as_str()) {
        return Err(CsiError::InvalidArgument(format!(
            "fsType {fs_type:?} is not supported (supported: {FS_TYPES:?})"
        )));
    }
    let min = capability::min_size(&fs_type, false);
    let size = match ctx.get(ATTR_SIZE).map(|s| s.trim()) {
        None | Some("") => DEFAULT_SIZE.max(min),
        Some(raw) => {
            let bytes = parse_quantity(raw).map_err(|why| {
                CsiError::InvalidArgument(format!(
                    "volume attribute size={raw:?} is not a size: {why} (a quantity such as \"64Mi\", \"1Gi\", \"500M\" or plain bytes)"
                ))
            })?;
            let size = bytes.div_ceil(MIB).saturating_mul(MIB);
            if size > MAX_SIZE {
                return Err(CsiError::InvalidArgument(format!(
                    "volume attribute size={raw:?} is more than the {} GiB an ephemeral volume may have",
                    MAX_SIZE >> 30
                )));
            }
            if size < min {
                return Err(CsiError::InvalidArgument(format!(
                    "volume attribute size={raw:?} is less than the {} MiB {fs_type} needs",
                    min / MIB
                )));
            }
            size
        }
    };
    Ok(Params { size, fs_type })
}

/// A Kubernetes quantity as a number of bytes, rounded up: `123`, `1.5Gi`, `64Mi`,
/// `500M`, `1e9`. Binary suffixes Ki..Ei, decimal k..E, or an exponent. No sign, no milli.
pub fn parse_quantity(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err("no number".into());
    }
    if frac.len() > 18 {
        return Err("too many decimals".into());
    }
    let digits = |d: &str| -> Result<u128, String> {
        if d.is_empty() {
            return Ok(0);
        }
        d.parse::<u128>()
            .map_err(|_| "number too large".to_string())
    };
    let scale = 10u128.pow(frac.len() as u32);
    let mantissa = digits(int)?
        .checked_mul(scale)
        .and_then(|v| v.checked_add(digits(frac).ok()?))
        .ok_or("number too large")?;
    let pow = |base: u128, exp: u32| base.checked_pow(exp).ok_or("exponent too large");
    let mult: u128 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        "k" => pow(10, 3)?,
        "M" => pow(10, 6)?,
        "G" => pow(10, 9)?,
        "T" => pow(10, 12)?,
        "P" => pow(10, 15)?,
        "E" => pow(10, 18)?,
        e if e.len() > 1 && (e.starts_with('e') || e.starts_with('E')) => {
            let exp: u32 = e[1..].parse().map_err(|_| format!("bad exponent {e:?}"))?;
            if exp > 30 {
                return Err("exponent too large".into());
            }
            pow(10, exp)?
        }
        other => return Err(format!("unknown suffix {other:?}")),
    };
    let bytes = mantissa
        .checked_mul(mult)
        .ok_or("number too large")?
        .div_ceil(scale);
    if bytes == 0 {
        return Err("a size must be more than zero".into());
    }
    u64::try_from(bytes).map_err(|_| "number too large".into())
}

/// Shown to operators in each volume's dir; never read back (the kernel is the record).
#[derive(Serialize)]
struct Info<'a> {
    volume_id: &'a str,
    node_id: &'a str,
    target_path: &'a Path,
    size_bytes: u64,
    fs_type: &'a str,
    read_only: bool,
    pod_namespace: Option<&'a str>,
    pod_name: Option<&'a str>,
    pod_uid: Option<&'a str>,
    created_at: i64,
}

/// One ephemeral volume of this node: names only.
struct Eph {
    key: String,
    dir: PathBuf,
    tag: String,
}

impl Eph {
    fn image(&self) -> PathBuf {
        self.dir.join(IMAGE)
    }
    fn lock_key(&self) -> String {
        format!("ephemeral:{}", self.key)
    }
}

/// What a sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// Keys of volumes removed (never completed, or their mount is gone).
    pub removed: Vec<String>,
    /// Keys left alone, with why (mounted, busy with a call, an error).
    pub kept: Vec<(String, String)>,
}

impl Node {
    fn ephemeral_root(&self) -> PathBuf {
        self.cfg.node_state_dir().join(DIR)
    }

    fn eph_by_key(&self, key: &str) -> Eph {
        Eph {
            key: key.to_string(),
            dir: self.ephemeral_root().join(key),
            tag: format!("{TAG_PREFIX}{key}:{}", self.ephemeral_owner),
        }
    }

    fn eph(&self, volume_id: &str) -> Eph {
        self.eph_by_key(&key_of(volume_id))
    }

    /// This node's loop devices of one ephemeral volume.
    fn eph_loops(&self, eph: &Eph) -> CsiResult<Vec<LoopInfo>> {
        Ok(loopdev::list()
            .map_err(|e| CsiError::internal("listing loop devices", e))?
            .into_iter()
            .filter(|l| l.tag == eph.tag)
            .collect())
    }

    /// An ID an ephemeral volume may have: a safe token not in our persistent format.
    fn ephemeral_id(raw: &str) -> CsiResult<()> {
        match VolumeId::parse(raw)? {
            Parsed::Foreign => Ok(()),
            Parsed::Ours(_) => Err(CsiError::InvalidArgument(format!(
                "volume ID {raw} has the form of this driver's persistent volumes; an ephemeral volume cannot use it"
            ))),
        }
    }

    pub(super) fn publish_ephemeral(
        &self,
        req: &NodePublishVolumeRequest,
    ) -> CsiResult<NodePublishVolumeResponse> {
        // Every argument before anything is looked at or made.
        let target = self.roots.check("target_path", &req.target_path)?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| CsiError::InvalidArgument("volume_capability is required".into()))?;
        let access = capability::parse(cap)?;
        if access.block {
            return Err(CsiError::InvalidArgument(
                "an ephemeral volume is a filesystem: the block access type is not supported"
                    .into(),
            ));
        }
        Self::ephemeral_id(&req.volume_id)?;
        let params = parse_params(
            &req.volume_context,
            access.fs_type.as_deref(),
            &self.cfg.default_fs_type,
        )?;
        let readonly = req.readonly || access.read_only_mode();
        let id = req.volume_id.as_str();
        let eph = self.eph(id);
        let _lock = self.inflight.try_lock(eph.lock_key())?;
        let loops = self.eph_loops(&eph)?;

        if let Some(m) = mounts::mounts_at(&target)
            .map_err(|e| CsiError::internal("reading the mount table", e))?
            .last()
        {
            let ours = loops
                .iter()
                .find(|l| rdev(&l.device).ok() == Some((m.major, m.minor)));
            return match ours {
                Some(lo)
                    if lo.size_bytes == params.size
                        && m.fs_type == params.fs_type
                        && m.read_only == readonly =>
                {
                    Ok(NodePublishVolumeResponse {})
                }
                Some(lo) => Err(CsiError::AlreadyExists(format!(
                    "ephemeral volume {id} is already published at {} with size {} bytes, {}, read_only={}; this call asks for {} bytes, {}, read_only={readonly}",
                    target.display(),
                    lo.size_bytes,
                    m.fs_type,
                    m.read_only,
                    params.size,
                    params.fs_type
                ))),
                None => Err(CsiError::AlreadyExists(format!(
                    "{} is already mounted from another source ({})",
                    target.display(),
                    m.source
                ))),
            };
        }
        for lo in &loops {
            let users = device_users(&lo.device)?;
            if let Some(u) = users.first() {
                return Err(CsiError::FailedPrecondition(format!(
                    "ephemeral volume {id} is already published at {}: an ephemeral volume has one target",
                    u.mount_point.display()
                )));
            }
        }
        if !loops.is_empty() || eph.dir.exists() {
            // Mounted nowhere, so nothing uses it: an earlier attempt died half-way
            // (or its mount went). Start afresh.
            tracing::info!(volume = id, dir = %eph.dir.display(), devices = loops.len(),
                "discarding what an unfinished publish of this ephemeral volume left");
            self.discard_ephemeral(&eph)?;
        }
        let created_target = !target.exists();
        match self.build_ephemeral(&eph, req, &target, &params, readonly, &access.mount_flags) {
            Ok(device) => {
                tracing::info!(volume = id, target = %target.display(), device = %device.display(),
                    size = params.size, fs = %params.fs_type, readonly, "ephemeral volume published");
                Ok(NodePublishVolumeResponse {})
            }
            Err(e) => {
                // The mount is the last step: nothing failed after it, so nothing is
                // mounted. Undo the rest now rather than at the next sweep.
                if let Err(undo) = self.discard_ephemeral(&eph) {
                    tracing::warn!(volume = id, error = %undo, "rolling back a failed ephemeral publish; the next sweep retries");
                }
                if created_target {
                    let _ = remove_target(&target);
                }
                Err(e)
            }
        }
    }

    /// Makes the volume and mounts it; returns its device.
    fn build_ephemeral(
        &self,
        eph: &Eph,
        req: &NodePublishVolumeRequest,
        target: &Path,
        params: &Params,
        readonly: bool,
        flags: &[String],
    ) -> CsiResult<PathBuf> {
        std::fs::create_dir_all(&eph.dir)
            .map_err(|e| CsiError::internal(&format!("creating {}", eph.dir.display()), e))?;
        let pod = |k: &str| {
            req.volume_context
                .get(&format!("{KUBELET_PREFIX}{k}"))
                .map(String::as_str)
        };
        let info = Info {
            volume_id: &req.volume_id,
            node_id: &self.node_id,
            target_path: target,
            size_bytes: params.size,
            fs_type: &params.fs_type,
            read_only: readonly,
            pod_namespace: pod("pod.namespace"),
            pod_name: pod("pod.name"),
            pod_uid: pod("pod.uid"),
            created_at: crate::backend::meta::now_nanos(),
        };
        let json = serde_json::to_vec_pretty(&info)
            .map_err(|e| CsiError::internal("encoding the volume info", e))?;
        fsops::write_atomic(&eph.dir.join(INFO), &json)
            .map_err(|e| CsiError::internal("writing the volume info", e))?;
        let image = eph.image();
        fsops::create_sparse(&image, params.size)
            .map_err(|e| CsiError::internal(&format!("creating {}", image.display()), e))?;
        crate::failpoint::hit("ephemeral:after-image");
        let lo = loopdev::attach(
            &image,
            &AttachOptions {
                read_only: false,
                direct_io: self.cfg.direct_io,
                tag: eph.tag.clone(),
                size_limit: params.size,
                logical_block_size: 0,
            },
        )
        .map_err(|e| CsiError::internal(&format!("attaching {}", image.display()), e))?;
        crate::failpoint::hit("ephemeral:after-attach");
        fsutil::mkfs(&lo.device, &params.fs_type)
            .map_err(|e| CsiError::internal(&format!("mkfs.{}", params.fs_type), e))?;
        crate::failpoint::hit("ephemeral:after-mkfs");
        std::fs::create_dir_all(target)
            .map_err(|e| CsiError::internal("creating the target dir", e))?;
        mounts::mount_device(
            &lo.device,
            target,
            &params.fs_type,
            &fs_options(&params.fs_type, readonly, flags),
            readonly,
        )
        .map_err(|e| {
            let what = format!("mounting {} on {}", lo.device.display(), target.display());
            if e.errno() == Some(nix::errno::Errno::EINVAL) && !flags.is_empty() {
                CsiError::InvalidArgument(format!(
                    "{what}: the kernel refused the mount options {flags:?}: {e}"
                ))
            } else {
                CsiError::internal(&what, e)
            }
        })?;
        crate::failpoint::hit("ephemeral:after-mount");
        Ok(lo.device)
    }

    /// Detaches the volume's devices and removes its dir. Refuses (and changes nothing
    /// more) when a device is mounted anywhere: then the volume is in use.
    fn discard_ephemeral(&self, eph: &Eph) -> CsiResult<()> {
        for lo in self.eph_loops(eph)? {
            let users = device_users(&lo.device)?;
            if !users.is_empty() {
                return Err(CsiError::FailedPrecondition(format!(
                    "{} is still mounted at {}",
                    lo.device.display(),
                    users
                        .iter()
                        .map(|m| m.mount_point.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            self.detach_ephemeral(&lo)?;
        }
        remove_dir(&eph.dir)
    }

    fn detach_ephemeral(&self, lo: &LoopInfo) -> CsiResult<()> {
        loopdev::detach(&lo.device)
            .map_err(|e| CsiError::internal(&format!("detaching {}", lo.device.display()), e))?;
        // A short-lived opener (udev's probe after mkfs) defers the unbind to its close.
        if !wait_unbound(lo, Duration::from_secs(2)) {
            tracing::warn!(device = %lo.device.display(), "loop device still bound after detach: it is released at its last close");
        }
        Ok(())
    }

    pub(super) fn unpublish_ephemeral(
        &self,
        raw_id: &str,
        target: &Path,
        force: bool,
    ) -> CsiResult<NodeUnpublishVolumeResponse> {
        let eph = self.eph(raw_id);
        let _lock = self.inflight.try_lock(eph.lock_key())?;
        let loops = self.eph_loops(&eph)?;
        let here = mounts::mounts_at(target)
            .map_err(|e| CsiError::internal("reading the mount table", e))?;
        if loops.is_empty() && !eph.dir.exists() {
            // Nothing of this volume here: done already, or never ours.
            if here.is_empty() && is_kubelet_ephemeral_id(raw_id) {
                remove_target(target)?;
                return Ok(NodeUnpublishVolumeResponse {});
            }
            return Err(CsiError::NotFound(format!(
                "volume {raw_id} does not exist"
            )));
        }
        let devs: BTreeSet<(u32, u32)> =
            loops.iter().filter_map(|l| rdev(&l.device).ok()).collect();
        if let Some(other) = here.iter().find(|m| !devs.contains(&(m.major, m.minor))) {
            return Err(CsiError::FailedPrecondition(format!(
                "{} holds a mount that is not ephemeral volume {raw_id} ({}); left alone",
                target.display(),
                other.source
            )));
        }
        if !here.is_empty() {
            self.unmount_path(target, force)?;
        }
        crate::failpoint::hit("ephemeral-unpublish:after-unmount");
        remove_target(target)?;
        for lo in &loops {
            if rdev(&lo.device).is_err() {
                continue; // gone since the listing
            }
            let users = device_users(&lo.device)?;
            if !users.is_empty() {
                if !force {
                    return Err(CsiError::FailedPrecondition(format!(
                        "ephemeral volume {raw_id} is still mounted at {} (nothing more was changed); unmount those first, or retry with force",
                        users
                            .iter()
                            .map(|m| m.mount_point.display().to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
                for m in users.iter().filter(|m| {
                    self.roots
                        .roots()
                        .iter()
                        .any(|r| m.mount_point.starts_with(r))
                }) {
                    self.unmount_path(&m.mount_point, true)?;
                }
            }
            self.detach_ephemeral(lo)?;
        }
        crate::failpoint::hit("ephemeral-unpublish:after-detach");
        remove_dir(&eph.dir)?;
        tracing::info!(volume = raw_id, target = %target.display(), force, "ephemeral volume unpublished and deleted");
        Ok(NodeUnpublishVolumeResponse {})
    }

    /// NodeGetVolumeStats of an ephemeral volume at its target.
    pub(super) fn stats_ephemeral(
        &self,
        raw_id: &str,
        path: &Path,
    ) -> CsiResult<NodeGetVolumeStatsResponse> {
        let eph = self.eph(raw_id);
        let loops = self.eph_loops(&eph)?;
        if loops.is_empty() && !eph.dir.exists() {
            return Err(CsiError::NotFound(format!(
                "volume {raw_id} does not exist"
            )));
        }
        if let Some(stale) = super::stats::stale_or_missing(path, "")? {
            return Ok(stale);
        }
        let mounted = mounts::mounts_at(path)
            .map_err(|e| CsiError::internal("reading the mount table", e))?
            .last()
            .is_some_and(|m| {
                loops
                    .iter()
                    .any(|l| rdev(&l.device).ok() == Some((m.major, m.minor)))
            });
        if !mounted {
            return Err(CsiError::NotFound(format!(
                "ephemeral volume {raw_id} is not mounted at {}",
                path.display()
            )));
        }
        let healthy = eph.image().exists();
        Ok(NodeGetVolumeStatsResponse {
            usage: super::stats::fs_usage(path)?,
            volume_condition: super::stats::condition(
                !healthy,
                if healthy {
                    "healthy".into()
                } else {
                    format!("the image {} is gone", eph.image().display())
                },
            ),
        })
    }

    /// Removes every ephemeral volume of this node that is not mounted anywhere: what a
    /// publish that never completed, or an unpublish that did not finish, left behind
    /// (dir, image, tagged loop device). Mounted ones are in use and stay. Volumes busy
    /// with a call are skipped (the call finishes or rolls back itself).
    pub fn sweep_ephemeral(&self) -> SweepReport {
        let mut out = SweepReport::default();
        let me = self.ephemeral_owner.as_str();
        let mut keys = BTreeSet::new();
        match loopdev::list() {
            Ok(all) => keys.extend(all.iter().filter_map(|l| {
                parse_tag(&l.tag)
                    .filter(|(_, n)| *n == me)
                    .map(|(k, _)| k.to_string())
            })),
            Err(e) => {
                tracing::warn!(error = %e, "ephemeral sweep: listing loop devices failed");
                out.kept.push(("*".into(), e.to_string()));
                return out;
            }
        }
        let root = self.ephemeral_root();
        match std::fs::read_dir(&root) {
            Ok(entries) => keys.extend(entries.flatten().filter_map(|e| {
                let name = e.file_name().to_str()?.to_string();
                (name.len() == KEY_HEX && name.bytes().all(|b| b.is_ascii_hexdigit()))
                    .then_some(name)
            })),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(dir = %root.display(), error = %e, "ephemeral sweep: reading the dir failed");
                out.kept.push(("*".into(), e.to_string()));
            }
        }
        for key in keys {
            let eph = self.eph_by_key(&key);
            let result = self.inflight.try_lock(eph.lock_key()).and_then(|_lock| {
                // Under the lock: a publish may have completed since the listing.
                for lo in self.eph_loops(&eph)? {
                    if let Some(u) = device_users(&lo.device)?.first() {
                        return Ok(Some(format!(
                            "in use: mounted at {}",
                            u.mount_point.display()
                        )));
                    }
                }
                self.discard_ephemeral(&eph).map(|_| None)
            });
            match result {
                Ok(None) => {
                    tracing::warn!(key = %key, dir = %eph.dir.display(),
                        "removed an ephemeral volume that is not mounted (a publish that never completed, or an unpublish that did not finish)");
                    out.removed.push(key);
                }
                Ok(Some(why)) => out.kept.push((key, why)),
                Err(e) => {
                    if !matches!(e, CsiError::Aborted(_)) {
                        tracing::warn!(key = %key, error = %e, "ephemeral sweep: left in place; retried at the next pass");
                    }
                    out.kept.push((key, e.to_string()));
                }
            }
        }
        out
    }
}

/// Removes one of our volume dirs (image, info, temp files): never anything else.
fn remove_dir(dir: &Path) -> CsiResult<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {
            let _ = dir.parent().map(fsops::fsync_dir);
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CsiError::internal(
            &format!("removing {}", dir.display()),
            e,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn quantities() {
        for (s, want) in [
            ("1", 1),
            ("64Mi", 64 << 20),
            ("1Gi", 1 << 30),
            ("1.5Gi", 3 << 29),
            ("500M", 500_000_000),
            ("2k", 2000),
            ("1e9", 1_000_000_000),
            ("1E3", 1000),
            ("0.5Ki", 512),
            (" 3Ti ", 3 << 40),
            ("1.", 1),
            (".5Mi", 1 << 19),
            ("0.0001", 1),
        ] {
            assert_eq!(parse_quantity(s), Ok(want), "{s}");
        }
        for bad in [
            "",
            "Mi",
            "-1Gi",
            "+1",
            "0",
            "0Mi",
            "1.2.3",
            "1mi",
            "100m",
            "1GB",
            "abc",
            "1e",
            "1e99",
            "99999999999999999999Ei",
            "1 Gi",
            "16Ei",
        ] {
            assert!(parse_quantity(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn params_are_checked() {
        let p = parse_params(&ctx(&[(CTX_EPHEMERAL, "true")]), None, "ext4").unwrap();
        assert_eq!(
            p,
            Params {
                size: DEFAULT_SIZE,
                fs_type: "ext4".into()
            }
        );
        let p = parse_params(
            &ctx(&[
                (CTX_EPHEMERAL, "true"),
                ("csi.storage.k8s.io/pod.name", "p"),
                (ATTR_SIZE, "100M"),
                (ATTR_FS_TYPE, "ext4"),
            ]),
            Some("ext4"),
            "xfs",
        )
        .unwrap();
        assert_eq!(p.size, 96 * MIB, "rounded up to whole MiB");
        assert_eq!(p.fs_type, "ext4");
        assert_eq!(
            parse_params(&ctx(&[]), Some("xfs"), "ext4").unwrap(),
            Params {
                size: DEFAULT_SIZE,
                fs_type: "xfs".into()
            }
        );
        for (bad, cap_fs) in [
            (ctx(&[("sizee", "1Gi")]), None),
            (ctx(&[(ATTR_SIZE, "big")]), None),
            (ctx(&[(ATTR_SIZE, "65Gi")]), None),
            (ctx(&[(ATTR_SIZE, "8Mi")]), None),
            (ctx(&[(ATTR_SIZE, "64Mi"), (ATTR_FS_TYPE, "xfs")]), None),
            (ctx(&[(ATTR_SIZE, "64Mi")]), Some("xfs")),
            (ctx(&[(ATTR_FS_TYPE, "btrfs")]), None),
            (ctx(&[]), Some("btrfs")),
            (ctx(&[(ATTR_FS_TYPE, "xfs")]), Some("ext4")),
        ] {
            assert!(
                matches!(
                    parse_params(&bad, cap_fs, "ext4"),
                    Err(CsiError::InvalidArgument(_))
                ),
                "{bad:?} with {cap_fs:?} accepted"
            );
        }
    }

    #[test]
    fn tags_and_ids() {
        let key = key_of("csi-abc");
        assert_eq!(key.len(), KEY_HEX);
        let owner = owner_tag("node-a", Path::new("/var/lib/kubelet/plugins/d"));
        assert_ne!(owner, owner_tag("node-a", Path::new("/k2/plugins/d")));
        assert_ne!(
            owner,
            owner_tag("node-b", Path::new("/var/lib/kubelet/plugins/d"))
        );
        let tag = format!("{TAG_PREFIX}{key}:{owner}");
        assert!(tag.len() <= crate::loopdev::MAX_TAG_LEN);
        assert_eq!(parse_tag(&tag), Some((key.as_str(), owner.as_str())));
        assert_eq!(
            super::super::parse_tag_full(&tag),
            None,
            "never a persistent tag"
        );
        for bad in ["fcsie:", "fcsie:xyz:00000000", "fcsi:abc:1:00000000"] {
            assert_eq!(parse_tag(bad), None, "{bad}");
        }
        let kubelet = format!("csi-{}", "0a".repeat(32));
        assert!(is_kubelet_ephemeral_id(&kubelet));
        assert!(!is_kubelet_ephemeral_id("fake-vol-id-0001"));
        assert!(!is_kubelet_ephemeral_id(&format!(
            "csi-{}",
            "0A".repeat(32)
        )));
    }
}
