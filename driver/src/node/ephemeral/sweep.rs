//! The sweep: what a publish that never completed, or an unpublish that did not finish,
//! left of an ephemeral volume goes at node start-up and at every recovery pass.

use std::collections::BTreeSet;

use super::names::{parse_tag, KEY_HEX};
use crate::error::CsiError;
use crate::kernel::loop_device;
use crate::node::stage::device_users;
use crate::node::Node;

/// What a sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// Keys of volumes removed (never completed, or their mount is gone).
    pub removed: Vec<String>,
    /// Keys left alone, with why (mounted, busy with a call, an error).
    pub kept: Vec<(String, String)>,
}

impl Node {
    /// Removes every ephemeral volume of this node that is not mounted anywhere: what a
    /// publish that never completed, or an unpublish that did not finish, left behind
    /// (dir, image, tagged loop device). Mounted ones are in use and stay. Volumes busy
    /// with a call are skipped (the call finishes or rolls back itself).
    pub fn sweep_ephemeral(&self) -> SweepReport {
        let mut out = SweepReport::default();
        let me = self.ephemeral_owner.as_str();
        let mut keys = BTreeSet::new();
        match loop_device::list() {
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
