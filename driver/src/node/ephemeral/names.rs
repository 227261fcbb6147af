//! The names of an ephemeral volume's parts: its key (from the volume ID), its dir below
//! the node state dir, and its loop device's tag, which says whose it is.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{CsiError, CsiResult};
use crate::kernel::loop_device::{self, LoopInfo};
use crate::node::Node;

/// Below the node state dir.
pub const DIR: &str = "ephemeral";
pub const IMAGE: &str = "data.img";
/// Tags of ephemeral loop devices: `fcsie:<key>:<owner tag>` (47 bytes). Persistent
/// volumes' `fcsi:` tags never match it, so recovery and fences never look at these.
pub(super) const TAG_PREFIX: &str = "fcsie:";
pub(super) const KEY_HEX: usize = 32;

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
pub(super) fn is_kubelet_ephemeral_id(id: &str) -> bool {
    id.strip_prefix("csi-").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// One ephemeral volume of this node: names only.
pub(super) struct Eph {
    pub(super) key: String,
    pub(super) dir: PathBuf,
    pub(super) tag: String,
}

impl Eph {
    pub(super) fn image(&self) -> PathBuf {
        self.dir.join(IMAGE)
    }
    pub(super) fn lock_key(&self) -> String {
        format!("ephemeral:{}", self.key)
    }
}

impl Node {
    pub(super) fn ephemeral_root(&self) -> PathBuf {
        self.cfg.node_state_dir().join(DIR)
    }

    pub(super) fn eph_by_key(&self, key: &str) -> Eph {
        Eph {
            key: key.to_string(),
            dir: self.ephemeral_root().join(key),
            tag: format!("{TAG_PREFIX}{key}:{}", self.ephemeral_owner),
        }
    }

    pub(super) fn eph(&self, volume_id: &str) -> Eph {
        self.eph_by_key(&key_of(volume_id))
    }

    /// This node's loop devices of one ephemeral volume.
    pub(super) fn eph_loops(&self, eph: &Eph) -> CsiResult<Vec<LoopInfo>> {
        Ok(loop_device::list()
            .map_err(|e| CsiError::internal("listing loop devices", e))?
            .into_iter()
            .filter(|l| l.tag == eph.tag)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(tag.len() <= crate::kernel::loop_device::MAX_TAG_LEN);
        assert_eq!(parse_tag(&tag), Some((key.as_str(), owner.as_str())));
        assert_eq!(
            crate::terms::parse_tag_full(&tag),
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
