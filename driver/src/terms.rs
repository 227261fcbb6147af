//! The terms the driver's services share, in one neutral place: the keys of
//! the publish and volume contexts, the topology key, and the format of the
//! tags on our loop devices (which the controller's fence policy and the
//! metrics read back).

use fencecsi_proto::v1::Topology;

use crate::error::CsiError;
use crate::ids::{Parsed, VolumeId};

/// Keys of the publish_context the node plugin reads.
pub const CTX_GENERATION: &str = "loop.fencecsi.io/generation";
pub const CTX_FS_TYPE: &str = "loop.fencecsi.io/fs-type";
pub const CTX_READONLY: &str = "loop.fencecsi.io/readonly";
/// Key of the volume_context carrying the filesystem.
pub const VOL_CTX_FS_TYPE: &str = "fsType";
/// Topology key: nodes and controller sharing a kernel and a state dir can share
/// loop-image volumes. Its value is the state dir's (reboot-proof) topology value, see
/// [`crate::state_id`]; the key keeps its old name because PVs carry it.
pub const TOPOLOGY_KEY: &str = "topology.loop.fencecsi.io/kernel";

/// The topology [`TOPOLOGY_KEY`] = `value`.
pub fn topology_of(value: &str) -> Topology {
    Topology {
        segments: [(TOPOLOGY_KEY.to_string(), value.to_string())].into(),
    }
}

/// Parses a generation number from a publish context.
pub fn generation_from_context(
    ctx: &std::collections::HashMap<String, String>,
) -> Option<Result<u64, CsiError>> {
    ctx.get(CTX_GENERATION).map(|g| {
        g.parse::<u64>().map_err(|_| {
            CsiError::InvalidArgument(format!("publish_context generation {g:?} is not a number"))
        })
    })
}

/// Loop devices this driver attaches carry
/// `fcsi:<volume hex>:<generation hex>:<node>` as their file name, where
/// `<node>` is 8 hex digits of sha256(node ID): at most 63 bytes, the
/// kernel's limit. The tag tells cleanup which devices are ours at all
/// (never kubelet's own block-volume lock device, say) and, since several
/// node plugins may share one kernel (kind, the drill), which node's.
const TAG_PREFIX: &str = "fcsi:";

/// 8 hex digits naming a node inside loop tags.
pub fn node_tag(node_id: &str) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(&Sha256::digest(node_id.as_bytes())[..4])
}

pub fn loop_tag(vol: &VolumeId, gen: u64, node_id: &str) -> String {
    let hex = vol.as_str().trim_start_matches("vol-");
    format!("{TAG_PREFIX}{hex}:{gen:x}:{}", node_tag(node_id))
}

/// (volume, generation) of one of our loop devices, from its tag.
pub fn parse_tag(tag: &str) -> Option<(VolumeId, u64)> {
    parse_tag_full(tag).map(|(v, g, _)| (v, g))
}

/// (volume, generation, node tag) of one of our loop devices.
pub fn parse_tag_full(tag: &str) -> Option<(VolumeId, u64, &str)> {
    let rest = tag.strip_prefix(TAG_PREFIX)?;
    let mut parts = rest.split(':');
    let (hex, gen, node) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || node.len() != 8 || !node.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    match VolumeId::parse(&format!("vol-{hex}")) {
        Ok(Parsed::Ours(v)) => Some((v, u64::from_str_radix(gen, 16).ok()?, node)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_foreign_tags_are_ignored() {
        let v = VolumeId::generate();
        let tag = loop_tag(&v, 7, "node-a");
        assert_eq!(parse_tag(&tag), Some((v.clone(), 7)));
        assert_eq!(
            parse_tag_full(&tag).map(|t| t.2.to_string()),
            Some(node_tag("node-a"))
        );
        assert_ne!(node_tag("node-a"), node_tag("node-b"));
        assert!(
            loop_tag(&v, u64::MAX, "n").len() <= crate::kernel::loop_device::MAX_TAG_LEN,
            "must fit lo_file_name"
        );
        assert_eq!(
            parse_tag(&loop_tag(&v, u64::MAX, "n")),
            Some((v.clone(), u64::MAX))
        );
        for other in [
            "/var/lib/kubelet/plugins/x",
            "fcsi:",
            "fcsi:x:1:00000000",
            "fcsi:../../etc:1:00000000",
            "fencecsi:vol-1:1",
        ] {
            assert_eq!(parse_tag(other), None, "{other}");
        }
    }
}
