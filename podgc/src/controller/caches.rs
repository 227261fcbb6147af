//! The projections the watches feed: only what a pass reads of Nodes, node Leases,
//! VolumeAttachments and CSIDrivers. Each `apply_*` says whether the event calls for a
//! pass soon.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use fencecsi_cluster::k8s_openapi::api::coordination::v1::Lease;
use fencecsi_cluster::k8s_openapi::api::core::v1::{Node, Pod, Taint};
use fencecsi_cluster::k8s_openapi::api::storage::v1::{CSIDriver, VolumeAttachment};
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::well_known::{
    heartbeat_lease_name, NODE_CLEAN_ANNOTATION, QUARANTINED_AT_ANNOTATION, QUARANTINE_TAINT_KEY,
    SAFE_DETACH_ANNOTATION,
};
use fencecsi_cluster::WatchEvent;

use super::now;
use crate::annotations::{FENCES_DONE, OUT_OF_SERVICE_ADDED};

fn parse_time(s: Option<&String>) -> Option<Timestamp> {
    s.and_then(|s| s.parse::<Timestamp>().ok())
}

/// Readiness of a node as its Ready condition says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Readiness {
    True,
    /// False or Unknown since this time.
    NotReady(Timestamp),
    /// No Ready condition (never posted status).
    Missing,
}

/// What podgc keeps of a Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct NodeInfo {
    pub(super) ready: Readiness,
    pub(super) quarantined: bool,
    pub(super) quarantined_at: Option<Timestamp>,
    pub(super) clean_at: Option<Timestamp>,
    pub(super) fences_done: bool,
    oos_added: bool,
    /// Where its kubelet serves (first InternalIP, else ExternalIP; the daemon endpoint's
    /// port): what the fast path probes.
    pub(super) kubelet: Option<SocketAddr>,
}

/// The kubelet's serving port when the Node does not say.
const DEFAULT_KUBELET_PORT: u16 = 10250;

fn kubelet_endpoint(n: &Node) -> Option<SocketAddr> {
    let status = n.status.as_ref()?;
    let addresses = status.addresses.as_deref().unwrap_or(&[]);
    let ip = ["InternalIP", "ExternalIP"].iter().find_map(|kind| {
        addresses
            .iter()
            .filter(|a| a.type_ == *kind)
            .find_map(|a| a.address.parse::<IpAddr>().ok())
    })?;
    let port = status
        .daemon_endpoints
        .as_ref()
        .and_then(|d| d.kubelet_endpoint.as_ref())
        .and_then(|e| u16::try_from(e.port).ok())
        .filter(|p| *p != 0)
        .unwrap_or(DEFAULT_KUBELET_PORT);
    Some(SocketAddr::new(ip, port))
}

impl NodeInfo {
    pub(super) fn of(n: &Node, previous: Option<&NodeInfo>) -> NodeInfo {
        let cond = n
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
        let ready = match cond {
            None => Readiness::Missing,
            Some(c) if c.status == "True" => Readiness::True,
            Some(c) => {
                let since = c.last_transition_time.as_ref().map(|t| t.0).unwrap_or_else(
                    // No transition time: from when we first saw it NotReady.
                    || match previous.map(|p| &p.ready) {
                        Some(Readiness::NotReady(t)) => *t,
                        _ => now(),
                    },
                );
                Readiness::NotReady(since)
            }
        };
        let ann = n.metadata.annotations.as_ref();
        let get = |k: &str| ann.and_then(|a| a.get(k));
        NodeInfo {
            ready,
            quarantined: taints(n).iter().any(|t| t.key == QUARANTINE_TAINT_KEY),
            quarantined_at: parse_time(get(QUARANTINED_AT_ANNOTATION)),
            clean_at: parse_time(get(NODE_CLEAN_ANNOTATION)),
            fences_done: get(FENCES_DONE).is_some(),
            oos_added: get(OUT_OF_SERVICE_ADDED).is_some(),
            kubelet: kubelet_endpoint(n),
        }
    }

    /// Whether the Node, as this projection of it says, lets its quarantine go: it carries
    /// the quarantine, is Ready, its fences are done (`quarantined-at` re-stamped when its
    /// last VolumeAttachment of a safe-detach driver went), and its clean report is newer
    /// than that stamp. `Ok((quarantined_at, clean_at))`, or what holds the quarantine.
    /// The VolumeAttachments are not the Node's to say: the caller checks them.
    pub(super) fn liftable(&self) -> Result<(Timestamp, Timestamp), QuarantineHeld> {
        if !self.quarantined {
            return Err(QuarantineHeld::NotQuarantined);
        }
        if self.ready != Readiness::True {
            return Err(QuarantineHeld::NotReady(self.ready.clone()));
        }
        if !self.fences_done {
            return Err(QuarantineHeld::FencesNotDone);
        }
        let (Some(qa), Some(clean)) = (self.quarantined_at, self.clean_at) else {
            return Err(QuarantineHeld::NoCleanReport {
                quarantined_at: self.quarantined_at,
                clean_at: self.clean_at,
            });
        };
        if clean <= qa {
            return Err(QuarantineHeld::CleanReportTooOld {
                clean_at: clean,
                quarantined_at: qa,
            });
        }
        Ok((qa, clean))
    }
}

/// What keeps a Node's quarantine from being lifted ([`NodeInfo::liftable`]); its text is
/// logged when the API server's Node disagrees with the cache.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum QuarantineHeld {
    #[error("it carries no quarantine taint")]
    NotQuarantined,
    #[error("it is not Ready ({0:?})")]
    NotReady(Readiness),
    #[error("its fences are not marked done")]
    FencesNotDone,
    #[error("no clean report after the quarantine (quarantined-at {quarantined_at:?}, node-clean {clean_at:?})")]
    NoCleanReport {
        quarantined_at: Option<Timestamp>,
        clean_at: Option<Timestamp>,
    },
    #[error("its clean report ({clean_at}) is not newer than quarantined-at ({quarantined_at})")]
    CleanReportTooOld {
        clean_at: Timestamp,
        quarantined_at: Timestamp,
    },
}

pub(super) fn taints(n: &Node) -> &[Taint] {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or(&[])
}

#[derive(Debug, Clone)]
pub(super) struct LeaseInfo {
    renew: Option<String>,
    /// podgc's clock when it saw `renew` change.
    pub(super) observed: Timestamp,
}

/// Which node a Lease speaks for: the kubelet's Lease is named after its node; a heartbeat
/// Lease names its node in holderIdentity, and counts only under its own name (see
/// [`heartbeat_lease_name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LeaseKind {
    Kubelet,
    Heartbeat,
}

impl LeaseKind {
    fn node_of(self, l: &Lease) -> Option<String> {
        let name = l.metadata.name.clone()?;
        match self {
            LeaseKind::Kubelet => Some(name),
            LeaseKind::Heartbeat => {
                let holder = l.spec.as_ref()?.holder_identity.clone()?;
                (heartbeat_lease_name(&holder) == name).then_some(holder)
            }
        }
    }
}

/// The renewals of one kind of Lease, per node, as podgc saw them arrive.
#[derive(Debug)]
pub(super) struct Renewals {
    kind: LeaseKind,
    by_node: HashMap<String, LeaseInfo>,
}

fn renew_of(l: &Lease) -> Option<String> {
    l.spec
        .as_ref()
        .and_then(|s| s.renew_time.as_ref())
        .map(|t| t.0.to_string())
}

impl Renewals {
    pub(super) fn new(kind: LeaseKind) -> Renewals {
        Renewals {
            kind,
            by_node: HashMap::new(),
        }
    }

    pub(super) fn get(&self, node: &str) -> Option<&LeaseInfo> {
        self.by_node.get(node)
    }

    fn upsert(&mut self, old: Option<&LeaseInfo>, node: String, l: &Lease, now: Timestamp) {
        let renew = renew_of(l);
        let observed = match old {
            Some(o) if o.renew == renew => o.observed,
            _ => now,
        };
        self.by_node.insert(node, LeaseInfo { renew, observed });
    }

    /// Applies a watch event; returns whether it was the list (the cache is synced).
    pub(super) fn apply(&mut self, ev: WatchEvent<Lease>) -> bool {
        let now = now();
        match ev {
            WatchEvent::Listed(items) => {
                let old = std::mem::take(&mut self.by_node);
                for l in &items {
                    if let Some(node) = self.kind.node_of(l) {
                        self.upsert(old.get(&node), node, l, now);
                    }
                }
                true
            }
            WatchEvent::Added(l) | WatchEvent::Modified(l) => {
                if let Some(node) = self.kind.node_of(&l) {
                    let old = self.by_node.get(&node).cloned();
                    self.upsert(old.as_ref(), node, &l, now);
                }
                false
            }
            WatchEvent::Deleted(l) => {
                if let Some(node) = self.kind.node_of(&l) {
                    self.by_node.remove(&node);
                }
                false
            }
        }
    }

    /// Compares a Lease read just now with what the watch delivered: `true` when it is
    /// still the renewal podgc last saw, so the node really has not renewed since then.
    /// Otherwise the watch was behind (an API server restart, a stalled stream), and the
    /// renewal is recorded as seen now.
    pub(super) fn unchanged(&mut self, fresh: &Lease) -> bool {
        let Some(node) = self.kind.node_of(fresh) else {
            return false;
        };
        let renew = renew_of(fresh);
        match self.by_node.get(&node) {
            Some(l) if l.renew == renew => true,
            _ => {
                self.by_node.insert(
                    node,
                    LeaseInfo {
                        renew,
                        observed: now(),
                    },
                );
                false
            }
        }
    }

    /// The renewals by node.
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (&String, &LeaseInfo)> {
        self.by_node.iter()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct VaInfo {
    node: String,
    pub(super) pv: Option<String>,
    pub(super) attacher: String,
    pub(super) deleting: bool,
}

impl VaInfo {
    fn of(va: &VolumeAttachment) -> VaInfo {
        VaInfo {
            node: va.spec.node_name.clone(),
            pv: va.spec.source.persistent_volume_name.clone(),
            attacher: va.spec.attacher.clone(),
            deleting: va.metadata.deletion_timestamp.is_some(),
        }
    }
}

/// The projections the watches feed.
pub(super) struct Caches {
    pub(super) nodes: HashMap<String, NodeInfo>,
    /// The kubelets' Leases in kube-node-lease.
    pub(super) leases: Renewals,
    /// The node plugins' heartbeat Leases.
    pub(super) heartbeats: Renewals,
    pub(super) vas: HashMap<String, VaInfo>,
    pub(super) vas_by_node: HashMap<String, HashSet<String>>,
    /// CSIDriver name -> carries safe-detach "true".
    pub(super) drivers: HashMap<String, bool>,
    pub(super) synced_nodes: bool,
    pub(super) synced_leases: bool,
    /// Listed (not needed for a pass: see [`Caches::synced`]).
    pub(super) synced_heartbeats: bool,
    pub(super) synced_vas: bool,
    pub(super) synced_drivers: bool,
}

impl Caches {
    /// Empty; a Lease watch that is not opened counts as synced.
    pub(super) fn new(watch_leases: bool, watch_heartbeats: bool) -> Caches {
        Caches {
            nodes: HashMap::new(),
            leases: Renewals::new(LeaseKind::Kubelet),
            heartbeats: Renewals::new(LeaseKind::Heartbeat),
            vas: HashMap::new(),
            vas_by_node: HashMap::new(),
            drivers: HashMap::new(),
            synced_nodes: false,
            synced_leases: !watch_leases,
            synced_heartbeats: !watch_heartbeats,
            synced_vas: false,
            synced_drivers: false,
        }
    }

    /// Whether every watch a pass needs has listed. The heartbeats are not among them: the
    /// fast path only adds a way to see a node down, and a heartbeat watch that cannot
    /// list (RBAC from before it, another namespace) must not stop podgc; its errors are
    /// logged, and the fast path stays off until it lists.
    pub(super) fn synced(&self) -> bool {
        self.synced_nodes && self.synced_leases && self.synced_vas && self.synced_drivers
    }

    /// The renewals of `kind`.
    pub(super) fn renewals(&mut self, kind: LeaseKind) -> &mut Renewals {
        match kind {
            LeaseKind::Kubelet => &mut self.leases,
            LeaseKind::Heartbeat => &mut self.heartbeats,
        }
    }

    /// A kubelet Lease event. A renewal of a lease counted as stale makes the node healthy
    /// again at the next pass; none calls for a pass sooner.
    pub(super) fn apply_lease(&mut self, ev: WatchEvent<Lease>) -> bool {
        if self.leases.apply(ev) {
            self.synced_leases = true;
            return true;
        }
        false
    }

    /// A heartbeat Lease event; as [`Caches::apply_lease`].
    pub(super) fn apply_heartbeat(&mut self, ev: WatchEvent<Lease>) -> bool {
        if self.heartbeats.apply(ev) {
            self.synced_heartbeats = true;
            return true;
        }
        false
    }

    /// Returns whether a pass should follow soon.
    pub(super) fn apply_node(&mut self, ev: WatchEvent<Node>) -> bool {
        let upsert = |c: &mut Caches, n: &Node| -> bool {
            let name = n.metadata.name.clone().unwrap_or_default();
            let info = NodeInfo::of(n, c.nodes.get(&name));
            c.nodes.insert(name, info.clone()) != Some(info)
        };
        match ev {
            WatchEvent::Listed(items) => {
                let old = std::mem::take(&mut self.nodes);
                for n in &items {
                    let name = n.metadata.name.clone().unwrap_or_default();
                    let info = NodeInfo::of(n, old.get(&name));
                    self.nodes.insert(name, info);
                }
                self.synced_nodes = true;
                true
            }
            WatchEvent::Added(n) | WatchEvent::Modified(n) => upsert(self, &n),
            WatchEvent::Deleted(n) => {
                let name = n.metadata.name.clone().unwrap_or_default();
                self.nodes.remove(&name).is_some()
            }
        }
    }

    /// Pods are not kept: an event only says whether a pass should follow, and it should
    /// when a pod of a node that is not Ready (or is quarantined) turns terminating or goes,
    /// so that an eviction is acted on at once rather than at the next resync.
    pub(super) fn apply_pod(&self, ev: WatchEvent<Pod>) -> bool {
        let concerns = |p: &Pod| {
            let node = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
            node.and_then(|n| self.nodes.get(n))
                .is_some_and(|i| i.quarantined || i.ready != Readiness::True)
        };
        match ev {
            WatchEvent::Listed(_) => false,
            WatchEvent::Added(p) | WatchEvent::Modified(p) => {
                p.metadata.deletion_timestamp.is_some() && concerns(&p)
            }
            WatchEvent::Deleted(p) => concerns(&p),
        }
    }

    fn remove_va(&mut self, name: &str) -> Option<VaInfo> {
        let old = self.vas.remove(name)?;
        if let Some(set) = self.vas_by_node.get_mut(&old.node) {
            set.remove(name);
            if set.is_empty() {
                self.vas_by_node.remove(&old.node);
            }
        }
        Some(old)
    }

    fn put_va(&mut self, va: &VolumeAttachment) -> (Option<VaInfo>, VaInfo) {
        let name = va.metadata.name.clone().unwrap_or_default();
        let old = self.remove_va(&name);
        let info = VaInfo::of(va);
        self.vas_by_node
            .entry(info.node.clone())
            .or_default()
            .insert(name.clone());
        self.vas.insert(name, info.clone());
        (old, info)
    }

    /// Records a VolumeAttachment read from the API server that the watch has not
    /// delivered (yet), as the watch would have.
    pub(super) fn note_va(&mut self, va: &VolumeAttachment) {
        self.put_va(va);
    }

    pub(super) fn apply_va(&mut self, ev: WatchEvent<VolumeAttachment>) -> bool {
        let quarantined = |c: &Caches, node: &str| c.nodes.get(node).is_some_and(|n| n.quarantined);
        match ev {
            WatchEvent::Listed(items) => {
                self.vas.clear();
                self.vas_by_node.clear();
                for va in &items {
                    self.put_va(va);
                }
                self.synced_vas = true;
                true
            }
            WatchEvent::Added(va) | WatchEvent::Modified(va) => {
                let (old, new) = self.put_va(&va);
                old.as_ref() != Some(&new) && quarantined(self, &new.node)
            }
            WatchEvent::Deleted(va) => {
                let name = va.metadata.name.clone().unwrap_or_default();
                self.remove_va(&name)
                    .is_some_and(|old| quarantined(self, &old.node))
            }
        }
    }

    pub(super) fn apply_driver(&mut self, ev: WatchEvent<CSIDriver>) -> bool {
        let safe = |d: &CSIDriver| {
            d.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SAFE_DETACH_ANNOTATION))
                .is_some_and(|v| v == "true")
        };
        match ev {
            WatchEvent::Listed(items) => {
                self.drivers = items
                    .iter()
                    .map(|d| (d.metadata.name.clone().unwrap_or_default(), safe(d)))
                    .collect();
                self.synced_drivers = true;
            }
            WatchEvent::Added(d) | WatchEvent::Modified(d) => {
                self.drivers
                    .insert(d.metadata.name.clone().unwrap_or_default(), safe(&d));
            }
            WatchEvent::Deleted(d) => {
                self.drivers.remove(&d.metadata.name.unwrap_or_default());
            }
        }
        true
    }

    pub(super) fn safe_vas_on(&self, node: &str) -> usize {
        self.vas_by_node.get(node).map_or(0, |set| {
            set.iter()
                .filter(|n| {
                    self.vas
                        .get(*n)
                        .is_some_and(|v| self.drivers.get(&v.attacher).copied().unwrap_or(false))
                })
                .count()
        })
    }

    /// VolumeAttachments on `node` of drivers that do not declare safe detach: what the
    /// out-of-service taint would make the attach-detach controller force-detach unfenced.
    pub(super) fn foreign_vas_on(&self, node: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .vas_by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter(|n| {
                self.vas
                    .get(*n)
                    .is_some_and(|v| !self.drivers.get(&v.attacher).copied().unwrap_or(false))
            })
            .cloned()
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencecsi_cluster::k8s_openapi::api::coordination::v1::LeaseSpec;
    use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};

    fn lease(renewed: i64) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                renew_time: Some(MicroTime(Timestamp::from_second(renewed).unwrap())),
                ..Default::default()
            }),
        }
    }

    /// What a lift needs of the Node, one thing missing at a time (the lift checks a Node
    /// read afresh with the same function as the cache's).
    #[test]
    fn a_node_is_liftable_only_quarantined_ready_fenced_and_clean_after_the_stamp() {
        let qa = Timestamp::from_second(1_000).unwrap();
        let ok = NodeInfo {
            ready: Readiness::True,
            quarantined: true,
            quarantined_at: Some(qa),
            clean_at: Some(Timestamp::from_second(1_001).unwrap()),
            fences_done: true,
            oos_added: false,
            kubelet: None,
        };
        assert_eq!(
            ok.liftable(),
            Ok((qa, Timestamp::from_second(1_001).unwrap()))
        );
        let refused = |f: &dyn Fn(&mut NodeInfo), why: &str| {
            let mut n = ok.clone();
            f(&mut n);
            let e = n.liftable().unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        };
        refused(&|n| n.quarantined = false, "no quarantine");
        refused(&|n| n.ready = Readiness::NotReady(qa), "not Ready");
        refused(&|n| n.ready = Readiness::Missing, "not Ready");
        refused(&|n| n.fences_done = false, "fences");
        refused(&|n| n.clean_at = None, "no clean report");
        refused(&|n| n.quarantined_at = None, "no clean report");
        refused(&|n| n.clean_at = Some(qa), "not newer");
    }

    /// The Lease read before acting decides: the renewal the watch delivered means stale;
    /// a newer one means the watch was behind, and it counts as seen now.
    #[test]
    fn a_fresh_read_of_a_stale_looking_lease_decides() {
        let mut c = Caches::new(true, true);
        c.apply_lease(WatchEvent::Listed(vec![lease(1_000)]));
        let seen = c.leases.get("n1").unwrap().observed;
        assert!(c.leases.unchanged(&lease(1_000)));
        assert_eq!(
            c.leases.get("n1").unwrap().observed,
            seen,
            "unchanged: the clock keeps running"
        );
        assert!(
            !c.leases.unchanged(&lease(1_010)),
            "renewed behind the watch's back"
        );
        assert!(
            c.leases.get("n1").unwrap().observed > seen,
            "the renewal counts from now"
        );
        assert!(c.leases.unchanged(&lease(1_010)));
    }

    /// A heartbeat Lease speaks for the node its holderIdentity names, and only under
    /// that node's heartbeat name: another Lease in the namespace (a leader election's)
    /// or one naming a node other than its own name says is ignored.
    #[test]
    fn a_heartbeat_counts_only_under_its_own_nodes_name() {
        let beat = |name: &str, holder: &str| {
            let mut l = lease(1_000);
            l.metadata.name = Some(name.into());
            l.spec.as_mut().unwrap().holder_identity = Some(holder.into());
            l
        };
        let mut c = Caches::new(true, true);
        assert!(!c.synced());
        c.apply_heartbeat(WatchEvent::Listed(vec![
            beat(&heartbeat_lease_name("n1"), "n1"),
            beat(&heartbeat_lease_name("n2"), "n3"),
            beat("fencecsi-podgc", "podgc-0"),
        ]));
        assert!(c.synced_heartbeats);
        assert!(!c.synced(), "nothing else has listed yet");
        let nodes: Vec<&String> = c.heartbeats.iter().map(|(n, _)| n).collect();
        assert_eq!(nodes, vec!["n1"]);
        assert!(c.leases.get("n1").is_none(), "kubelet Leases are apart");
    }

    /// A pass needs every watch but the heartbeats': one that cannot list (RBAC from before
    /// the fast path) must not stop podgc.
    #[test]
    fn podgc_is_synced_without_the_heartbeats() {
        let mut c = Caches::new(true, true);
        c.apply_node(WatchEvent::Listed(vec![]));
        c.apply_lease(WatchEvent::Listed(vec![]));
        c.apply_va(WatchEvent::Listed(vec![]));
        assert!(!c.synced(), "the CSIDrivers have not listed");
        c.apply_driver(WatchEvent::Listed(vec![]));
        assert!(c.synced() && !c.synced_heartbeats);
    }
}
