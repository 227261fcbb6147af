//! The fast path: a node whose node plugin stopped renewing its heartbeat Lease for the
//! heartbeat grace gets its kubelet probed ([`crate::kubelet_probe`]); it counts as down
//! only while the latest probe started after the heartbeat went stale found no answer.
//!
//! The two signals travel different ways: the heartbeat from the node to the API server,
//! the probe from podgc to the node. A node plugin that crashes or is rolled stops the
//! first and not the second; a slow or restarting API server (or a watch that is behind)
//! stops the first for every node at once, and every kubelet still answers; a kubelet that
//! restarts stops the second and not the first. Only a node that is frozen, dead or cut
//! off stops both. While a heartbeat stays stale its kubelet is probed again every grace,
//! so a node that comes back stops counting as down by this path at the next probe.

use std::collections::{HashMap, HashSet};

use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use tokio::sync::mpsc;

use super::{now, sd, Runner};
use crate::config::HeartbeatConfig;
use crate::kubelet_probe::probe_kubelet;
use crate::metrics::AnsweredLabels;

/// One finished probe of a node's kubelet.
#[derive(Debug, Clone)]
pub(super) struct ProbeOutcome {
    pub(super) started: Timestamp,
    /// `Ok(how it answered)` or `Err(why there was no answer)`.
    pub(super) answer: Result<String, String>,
}

/// The probes in flight and the last outcome of each node's.
pub(super) struct Probes {
    in_flight: HashSet<String>,
    last: HashMap<String, ProbeOutcome>,
    done: mpsc::UnboundedSender<(String, ProbeOutcome)>,
}

impl Probes {
    /// Probes report on `done`'s receiver; the loop hands each to [`Runner::note_probe`].
    pub(super) fn new(done: mpsc::UnboundedSender<(String, ProbeOutcome)>) -> Probes {
        Probes {
            in_flight: HashSet::new(),
            last: HashMap::new(),
            done,
        }
    }
}

/// A node's heartbeat that went stale: when it was last seen renewed and when it went stale.
#[derive(Debug, Clone, Copy)]
pub(super) struct StaleHeartbeat {
    pub(super) renewed: Timestamp,
    pub(super) stale_at: Timestamp,
}

impl Runner {
    fn heartbeat_cfg(&self) -> Option<&HeartbeatConfig> {
        self.cfg.heartbeat.as_ref()
    }

    /// When `node`'s heartbeat goes (or went) stale; `None` without a heartbeat. Unlike the
    /// other signals' clocks, this one does not restart when podgc starts leading or
    /// disruption mode ends: a standby has watched the heartbeats all along, and the probe
    /// that must confirm is a check of the node as it is now, not a count of missed
    /// renewals that may not have arrived yet.
    pub(super) fn heartbeat_stale_at(&self, node: &str) -> Option<StaleHeartbeat> {
        let h = self.heartbeat_cfg()?;
        let renewed = self.caches.heartbeats.get(node)?.observed;
        Some(StaleHeartbeat {
            renewed,
            stale_at: renewed + sd(h.grace),
        })
    }

    /// `node`'s heartbeat, when it is stale at `now`.
    fn stale_heartbeat(&self, node: &str, now: Timestamp) -> Option<StaleHeartbeat> {
        self.heartbeat_stale_at(node).filter(|s| s.stale_at <= now)
    }

    /// The latest probe of `node` that started after its heartbeat went stale.
    fn probe_since(&self, node: &str, stale: StaleHeartbeat) -> Option<&ProbeOutcome> {
        self.probes
            .last
            .get(node)
            .filter(|p| p.started >= stale.stale_at)
    }

    /// Down by the fast path: heartbeat stale, and the latest probe since then found no
    /// answer. `(stale heartbeat, why the kubelet did not answer)`.
    pub(super) fn down_by_heartbeat(
        &self,
        node: &str,
        now: Timestamp,
    ) -> Option<(StaleHeartbeat, String)> {
        let stale = self.stale_heartbeat(node, now)?;
        let why = self.probe_since(node, stale)?.answer.clone().err()?;
        Some((stale, why))
    }

    /// Nodes whose heartbeat is stale and whose kubelet has not been probed since (none
    /// finished): each may turn out down.
    pub(super) fn awaiting_probe(&self, now: Timestamp) -> usize {
        self.caches
            .nodes
            .iter()
            .filter(|(n, i)| {
                i.kubelet.is_some()
                    && self
                        .stale_heartbeat(n, now)
                        .is_some_and(|s| self.probe_since(n, s).is_none())
            })
            .count()
    }

    /// Whether `node`'s heartbeat is stale and its kubelet answered since (the pass
    /// summary's `kubelet_answered`).
    pub(super) fn answered_since_stale(&self, node: &str, now: Timestamp) -> bool {
        self.stale_heartbeat(node, now)
            .and_then(|s| self.probe_since(node, s))
            .is_some_and(|p| p.answer.is_ok())
    }

    /// When `node`'s kubelet is next due a probe: when its heartbeat goes stale, then a
    /// grace after each probe while it stays stale. `None`: no heartbeat, or no address.
    pub(super) fn next_probe_at(&self, node: &str) -> Option<Timestamp> {
        let h = self.heartbeat_cfg()?;
        self.caches.nodes.get(node)?.kubelet?;
        let stale = self.heartbeat_stale_at(node)?;
        Some(match self.probe_since(node, stale) {
            Some(p) => p.started + sd(h.grace),
            None => stale.stale_at,
        })
    }

    /// Starts a probe of every kubelet that is due one (and has none in flight).
    pub(super) fn launch_probes(&mut self, at: Timestamp) {
        let Some(timeout) = self.heartbeat_cfg().map(|h| h.probe_timeout) else {
            return;
        };
        let due: Vec<(String, std::net::SocketAddr)> = self
            .caches
            .nodes
            .iter()
            .filter(|(n, _)| !self.probes.in_flight.contains(*n))
            .filter(|(n, _)| self.next_probe_at(n).is_some_and(|t| t <= at))
            .filter_map(|(n, i)| Some((n.clone(), i.kubelet?)))
            .collect();
        for (node, addr) in due {
            self.probes.in_flight.insert(node.clone());
            let done = self.probes.done.clone();
            tokio::spawn(async move {
                let started = now();
                let answer = probe_kubelet(addr, timeout)
                    .await
                    .map(|a| format!("{a:?}"))
                    .map_err(|e| format!("its kubelet at {addr} does not answer: {e}"));
                let _ = done.send((node, ProbeOutcome { started, answer }));
            });
        }
    }

    /// Records a finished probe; returns whether it calls for a pass soon (no answer).
    pub(super) fn note_probe(&mut self, node: String, outcome: ProbeOutcome) -> bool {
        self.probes.in_flight.remove(&node);
        let was_answering = self.probes.last.get(&node).is_none_or(|p| p.answer.is_ok());
        match &outcome.answer {
            Err(why) if was_answering => {
                tracing::warn!(node = %node, "its node plugin's heartbeat stopped and {why}")
            }
            Ok(how) if !was_answering => {
                tracing::info!(node = %node, answer = %how, "its kubelet answers again")
            }
            Ok(how) => {
                tracing::debug!(node = %node, answer = %how, "its heartbeat is stale, but its kubelet answers: not down")
            }
            Err(_) => {}
        }
        let down = outcome.answer.is_err();
        self.metrics
            .kubelet_probes
            .get_or_create(&AnsweredLabels::of(!down))
            .inc();
        self.probes.last.insert(node, outcome);
        down
    }

    /// Forgets probes of nodes that are gone.
    pub(super) fn forget_probes_of_gone_nodes(&mut self) {
        let nodes = &self.caches.nodes;
        self.probes.last.retain(|n, _| nodes.contains_key(n));
    }

    /// When each kubelet not being probed is next due a probe (for the loop's deadline).
    pub(super) fn probe_deadlines(&self) -> impl Iterator<Item = Timestamp> + '_ {
        self.caches
            .nodes
            .keys()
            .filter(|n| !self.probes.in_flight.contains(*n))
            .filter_map(|n| self.next_probe_at(n))
    }
}
