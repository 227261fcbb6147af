//! One pass: count the NotReady nodes, stand still in disruption mode, check every
//! quarantined node for a lift, and act on each node NotReady for longer than the grace.

use std::collections::HashSet;

use fencecsi_cluster::k8s_openapi::api::coordination::v1::Lease;
use fencecsi_cluster::k8s_openapi::api::core::v1::Pod;
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::well_known::{heartbeat_lease_name, NODE_LEASE_NAMESPACE};
use fencecsi_cluster::{EventType, ListParams};

use super::caches::{LeaseKind, NodeInfo, Readiness};
use super::classify::{classify_pods, NodePods};
use super::{now, sd, Runner};
use crate::Result;

/// What one pass did (published after every pass; tests and the drill wait on it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassSummary {
    pub seq: u64,
    pub leader: bool,
    pub nodes: usize,
    pub unhealthy: usize,
    pub disruption_mode: bool,
    pub quarantined_now: Vec<String>,
    pub force_deleted: Vec<String>,
    pub skipped: Vec<String>,
    pub volume_attachments_deleted: Vec<String>,
    pub lifted: Vec<String>,
    /// Nodes carrying the quarantine taint after the pass.
    pub quarantined: usize,
    /// Nodes whose heartbeat is stale but whose kubelet answered a probe since: not down.
    pub kubelet_answered: Vec<String>,
}

/// A node podgc counts as down: the Suspect state of docs/lifecycle.md.
#[derive(Debug, Clone)]
pub(super) struct Suspect {
    /// Since when it counts as down (for disruption mode).
    since: Timestamp,
    /// When podgc may act on it.
    pub(super) act_at: Timestamp,
    why: SuspectBy,
}

#[derive(Debug, Clone)]
enum SuspectBy {
    NotReady,
    /// The Lease, last seen renewed then.
    Lease(Timestamp),
    /// The heartbeat, last seen renewed then, and why the kubelet did not answer.
    Heartbeat(Timestamp, String),
}

fn fraction(unhealthy: usize, nodes: usize) -> f64 {
    if nodes == 0 {
        0.0
    } else {
        unhealthy as f64 / nodes as f64
    }
}

impl Runner {
    /// Whether the node is down and when podgc may act on it. Three ways, the earliest
    /// wins:
    /// - its Ready condition False/Unknown: act `shutdown_grace` after the transition
    ///   (the node lifecycle controller has already waited its own grace for Unknown; a
    ///   kubelet reporting False is alive, so the grace is long);
    /// - its Lease unrenewed for `node_lease_grace` (podgc's clock, from when it saw the
    ///   last renewal): act then. The kubelet renews every 10 s, so a dead node is seen
    ///   within seconds of the grace, long before NotReady;
    /// - its node plugin's heartbeat stale and its kubelet not answering (`fast_path`):
    ///   act at once.
    ///
    /// Neither of the first two clocks starts before disruption mode last ended or podgc
    /// started leading; the fast path's probe checks the node as it is now instead.
    fn suspect(&self, name: &str, info: &NodeInfo, now: Timestamp) -> Option<Suspect> {
        let floor = |t: Timestamp| match self.clocks_restarted {
            Some(ended) if ended > t => ended,
            _ => t,
        };
        let by_condition = match info.ready {
            Readiness::NotReady(t) => Some(Suspect {
                since: floor(t),
                act_at: floor(t) + sd(self.cfg.shutdown_grace),
                why: SuspectBy::NotReady,
            }),
            _ => None,
        };
        let by_lease = self.cfg.node_lease_grace.and_then(|g| {
            let l = self.caches.leases.get(name)?;
            let stale_at = floor(l.observed) + sd(g);
            (stale_at <= now).then_some(Suspect {
                since: stale_at,
                act_at: stale_at,
                why: SuspectBy::Lease(floor(l.observed)),
            })
        });
        let by_heartbeat = self
            .down_by_heartbeat(name, now)
            .map(|(stale, why)| Suspect {
                since: stale.stale_at,
                act_at: stale.stale_at,
                why: SuspectBy::Heartbeat(stale.renewed, why),
            });
        [by_condition, by_lease, by_heartbeat]
            .into_iter()
            .flatten()
            .min_by_key(|s| s.act_at)
    }

    pub(super) async fn pass(&mut self) -> PassSummary {
        self.seq += 1;
        let now = now();
        let mut s = PassSummary {
            seq: self.seq,
            leader: true,
            nodes: self.caches.nodes.len(),
            ..Default::default()
        };
        self.forget_probes_of_gone_nodes();
        self.launch_probes(now);
        s.kubelet_answered = self
            .caches
            .nodes
            .keys()
            .filter(|n| self.answered_since_stale(n, now))
            .cloned()
            .collect();
        s.kubelet_answered.sort();
        let unhealthy: Vec<(String, Suspect)> = self
            .caches
            .nodes
            .iter()
            .filter_map(|(n, i)| self.suspect(n, i, now).map(|d| (n.clone(), d)))
            .collect();
        s.unhealthy = unhealthy.len();
        self.metrics.unhealthy_nodes.set(unhealthy.len() as i64);
        if self.disruption_mode(unhealthy.len(), &mut s, now).await {
            s.quarantined = self.count_quarantined();
            return s;
        }
        // Nodes still down start their grace now (see `suspect`).
        let unhealthy: Vec<(String, Suspect)> = unhealthy
            .into_iter()
            .filter_map(|(n, _)| {
                let info = self.caches.nodes.get(&n)?;
                Some((n.clone(), self.suspect(&n, info, now)?))
            })
            .collect();
        // Heartbeats stop for every node at once when podgc itself is cut off, and the
        // probes' answers then come back one by one: acting on the first to fail would
        // fence a node before disruption mode can count the rest. So the fast path holds
        // while the nodes still awaiting a probe could make this a disruption.
        let hold_fast_path =
            self.fraction_over(unhealthy.len() + self.awaiting_probe(now), s.nodes);
        let unhealthy_set: HashSet<&str> = unhealthy.iter().map(|(n, _)| n.as_str()).collect();
        self.check_quarantines(&unhealthy_set, &mut s).await;
        self.warned
            .retain(|n, _| unhealthy_set.contains(n.as_str()));
        self.oos_withheld
            .retain(|n| unhealthy_set.contains(n.as_str()));
        for (name, down) in unhealthy {
            if now < down.act_at {
                continue;
            }
            if hold_fast_path && matches!(down.why, SuspectBy::Heartbeat(..)) {
                tracing::info!(node = %name, "down by its heartbeat and kubelet, but other nodes await their probe: acting once they are in");
                continue;
            }
            let still_down = match down.why {
                SuspectBy::NotReady => true,
                SuspectBy::Lease(_) => self.still_stale(LeaseKind::Kubelet, &name).await,
                SuspectBy::Heartbeat(..) => self.still_stale(LeaseKind::Heartbeat, &name).await,
            };
            if !still_down {
                continue;
            }
            if let Err(e) = self.handle_node(&name, &down, &mut s).await {
                tracing::warn!(node = %name, error = %e, "acting on a shut-down node failed; retried next pass");
            }
        }
        s.quarantined = self.count_quarantined();
        s
    }

    /// Whether too many nodes are down to act (the fault is then likely the control
    /// plane's network): enters and leaves disruption mode, with an Event each way.
    /// Leaving it restarts every down node's grace.
    async fn disruption_mode(
        &mut self,
        unhealthy: usize,
        s: &mut PassSummary,
        now: Timestamp,
    ) -> bool {
        let fraction = fraction(unhealthy, s.nodes);
        let disruption = self.fraction_over(unhealthy, s.nodes);
        self.metrics.disruption_mode.set(disruption as i64);
        s.disruption_mode = disruption;
        if disruption {
            if !self.in_disruption {
                let msg = format!(
                    "{} of {} nodes ({:.0}%) are NotReady, more than the {:.0}% podgc acts under: the fault is likely the control plane's network, not the nodes. podgc quarantines, deletes and lifts nothing until fewer nodes are NotReady.",
                    unhealthy, s.nodes, fraction * 100.0, self.cfg.max_unhealthy_fraction * 100.0
                );
                tracing::warn!(
                    unhealthy,
                    nodes = s.nodes,
                    "entering disruption mode: {msg}"
                );
                self.event(
                    self.lease_ref.clone(),
                    EventType::Warning,
                    "DisruptionMode",
                    &msg,
                )
                .await;
            }
            self.in_disruption = true;
            return true;
        }
        if self.in_disruption {
            let msg = format!(
                "{} of {} nodes are down: podgc acts again, and the grace of every node still down starts now",
                unhealthy, s.nodes
            );
            self.clocks_restarted = Some(now);
            tracing::info!("{msg}");
            self.event(
                self.lease_ref.clone(),
                EventType::Normal,
                "DisruptionModeEnded",
                &msg,
            )
            .await;
            self.in_disruption = false;
        }
        false
    }

    /// Whether `unhealthy` of `nodes` is more than disruption mode lets podgc act under.
    fn fraction_over(&self, unhealthy: usize, nodes: usize) -> bool {
        fraction(unhealthy, nodes) > self.cfg.max_unhealthy_fraction
    }

    /// Quarantined nodes: re-stamp after the fences, lift when clean.
    async fn check_quarantines(&mut self, unhealthy: &HashSet<&str>, s: &mut PassSummary) {
        let quarantined: Vec<String> = self
            .caches
            .nodes
            .iter()
            .filter(|(_, i)| i.quarantined)
            .map(|(n, _)| n.clone())
            .collect();
        for name in quarantined {
            match self
                .maybe_lift(&name, unhealthy.contains(name.as_str()))
                .await
            {
                Ok(true) => s.lifted.push(name),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(node = %name, error = %e, "checking the quarantine failed")
                }
            }
        }
    }

    /// A node about to be acted on because a Lease of `kind` (the kubelet's, or its
    /// heartbeat) looks stale: read that Lease itself. The watch may be behind (it backs
    /// off after an API server restart), and a renewal it has not delivered yet must not
    /// make a live node look dead. Unsure (the read fails) counts as not stale: the next
    /// pass tries again.
    pub(super) async fn still_stale(&mut self, kind: LeaseKind, node: &str) -> bool {
        let (namespace, name) = match kind {
            LeaseKind::Kubelet => (NODE_LEASE_NAMESPACE.to_string(), node.to_string()),
            LeaseKind::Heartbeat => match &self.cfg.heartbeat {
                Some(h) => (h.namespace.clone(), heartbeat_lease_name(node)),
                None => return false,
            },
        };
        match self
            .cluster
            .api::<Lease>(Some(&namespace))
            .get_opt(&name)
            .await
        {
            Ok(Some(fresh)) => {
                let stale = self.caches.renewals(kind).unchanged(&fresh);
                if !stale {
                    tracing::info!(
                        node,
                        lease = %name,
                        "the Lease was renewed after all (the watch was behind): not acting"
                    );
                }
                stale
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(node, lease = %name, error = %e, "reading the Lease failed: not acting on the node this pass");
                false
            }
        }
    }

    fn count_quarantined(&self) -> usize {
        let n = self.caches.nodes.values().filter(|i| i.quarantined).count();
        self.metrics.quarantined_nodes.set(n as i64);
        n
    }

    /// Acts on one node that has been NotReady for longer than the grace.
    async fn handle_node(&mut self, node: &str, down: &Suspect, s: &mut PassSummary) -> Result<()> {
        let pods = self
            .cluster
            .api::<Pod>(None)
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await?
            .items;
        let why = match &down.why {
            SuspectBy::NotReady => format!(
                "node {node} has been NotReady since {} (longer than the shutdown grace of {}s)",
                down.since,
                self.cfg.shutdown_grace.as_secs()
            ),
            SuspectBy::Lease(renewed) => format!(
                "node {node} has not renewed its Lease since {renewed} (longer than the node lease grace of {}s)",
                self.cfg.node_lease_grace.unwrap_or_default().as_secs()
            ),
            SuspectBy::Heartbeat(renewed, probe) => format!(
                "node {node}'s node plugin has not renewed its heartbeat since {renewed} (longer than the heartbeat grace of {:?}) and {probe}",
                self.cfg.heartbeat.as_ref().map(|h| h.grace).unwrap_or_default()
            ),
        };
        let NodePods {
            mut selected,
            mut keep_pvs,
            skipped,
            safe_running,
            at_risk,
        } = classify_pods(&self.cluster, &self.caches.drivers, &pods).await?;
        self.warn_skipped(node, &why, &pods, skipped, s).await;

        // The out-of-service taint makes the taint manager evict every pod on the node at
        // once (nothing tolerates it by default), upstream PodGC force-delete them and the
        // attach-detach controller force-detach their volumes, whatever the driver. podgc
        // sets it only when all of that is fenced; otherwise it does the fenced part itself:
        // it evicts the stateful pods whose every volume is fenced and leaves the rest.
        let foreign = self.caches.foreign_vas_on(node);
        let withheld = self.cfg.out_of_service_taint && !(at_risk.is_empty() && foreign.is_empty());
        let oos = self.cfg.out_of_service_taint && !withheld;
        if withheld && !(selected.is_empty() && safe_running.is_empty()) {
            self.warn_oos_withheld(node, &why, &at_risk, &foreign).await;
        }
        let evicts_running = !safe_running.is_empty();
        if withheld {
            selected.extend(safe_running);
        } else {
            for (_, _, pvs) in safe_running {
                keep_pvs.extend(pvs);
            }
        }
        if (!selected.is_empty() || (oos && evicts_running))
            && self.ensure_quarantine(node, &why, oos).await?
        {
            s.quarantined_now.push(node.to_string());
            if oos && selected.is_empty() {
                tracing::warn!(node, "quarantined with the out-of-service taint so its stateful pods are evicted now");
            }
        }
        if !selected.is_empty() {
            self.force_delete(node, &why, selected, &mut keep_pvs, s)
                .await;
        }

        // Detach what nothing on the node uses any more (also retries of earlier passes).
        self.detach_unused(node, &keep_pvs, s).await
    }
}
