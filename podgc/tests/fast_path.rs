//! The fast path on the embedded cluster: the node plugin's real heartbeat
//! (`fencecsi_driver::node::heartbeat`) and real TLS servers standing in for the kubelets'
//! serving ports (`openssl s_server`, frozen with SIGSTOP as a frozen cgroup freezes a
//! kubelet). The kubelet Lease path is off and the shutdown grace is an hour, so only the
//! fast path can act; nothing here runs a node lifecycle controller.
//!
//! Each "nothing is fenced" case ends with its positive control: the same world, one
//! kubelet frozen, and the node is fenced.

mod common;

use std::time::Duration;

use common::kubelet_tls::KubeletTls;
use common::world::*;
use common::*;
use fencecsi_cluster::k8s_openapi::api::coordination::v1::Lease;
use fencecsi_cluster::k8s_openapi::api::core::v1::{
    DaemonEndpoint, Node, NodeAddress, NodeDaemonEndpoints, Pod,
};
use fencecsi_cluster::well_known::{heartbeat_lease_name, QUARANTINE_TAINT_KEY};
use fencecsi_cluster::Cluster;
use fencecsi_driver::node::heartbeat::{self, HeartbeatHandle, HeartbeatOptions};
use fencecsi_podgc::config::HeartbeatConfig;
use fencecsi_podgc::kubelet_probe::{probe_kubelet, Answer, NoAnswer};
use fencecsi_podgc::metrics::AnsweredLabels;
use fencecsi_podgc::{PassSummary, PodGc, PodGcConfig, PodGcHandle};

const HEARTBEAT_NS: &str = "fencecsi";
const NODES: [&str; 3] = ["n1", "n2", "n3"];
/// Generous: a probe of a kubelet that answers must never run out on a busy machine.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Three nodes, each with a beating node plugin and an answering kubelet, a terminating
/// stateful pod db-0 on n1, and podgc with only the fast path.
struct World {
    c: Cluster,
    kubelets: Vec<KubeletTls>,
    beats: Vec<Option<HeartbeatHandle>>,
    h: PodGcHandle,
}

async fn point_at_kubelet(c: &Cluster, node: &str, k: &KubeletTls) {
    let api = c.api::<Node>(None);
    let mut n = api.get(node).await.unwrap();
    let status = n.status.get_or_insert_with(Default::default);
    status.addresses = Some(vec![NodeAddress {
        type_: "InternalIP".into(),
        address: k.addr.ip().to_string(),
    }]);
    status.daemon_endpoints = Some(NodeDaemonEndpoints {
        kubelet_endpoint: Some(DaemonEndpoint {
            port: i32::from(k.addr.port()),
        }),
    });
    api.replace_status(&n).await.unwrap();
}

impl World {
    async fn start() -> World {
        let c = cluster(&NODES).await;
        let mut kubelets = Vec::new();
        let mut beats = Vec::new();
        for n in NODES {
            let k = KubeletTls::start();
            point_at_kubelet(&c, n, &k).await;
            kubelets.push(k);
            beats.push(Some(heartbeat::spawn(
                c.clone(),
                HeartbeatOptions {
                    namespace: HEARTBEAT_NS.into(),
                    node: n.into(),
                    interval: Duration::from_millis(100),
                },
            )));
        }
        pod(&c, "db-0", "n1", Some((SAFE, "ReadWriteOnce"))).await;
        terminate(&c, "db-0").await;
        // podgc's first list then holds every heartbeat: a node never seen beating is
        // never acted on by the fast path.
        let leases = c.api::<Lease>(Some(HEARTBEAT_NS));
        for n in NODES {
            wait_for("the heartbeat Lease", || async {
                leases
                    .get_opt(&heartbeat_lease_name(n))
                    .await
                    .unwrap()
                    .is_some()
            })
            .await;
        }
        let h = PodGc::new(
            c.clone(),
            PodGcConfig {
                shutdown_grace: Duration::from_secs(3600),
                node_lease_grace: None,
                heartbeat: Some(HeartbeatConfig {
                    namespace: HEARTBEAT_NS.into(),
                    grace: Duration::from_secs(1),
                    probe_timeout: PROBE_TIMEOUT,
                }),
                ..cfg()
            },
        )
        .spawn();
        World {
            c,
            kubelets,
            beats,
            h,
        }
    }

    fn stop_heartbeat(&mut self, i: usize) {
        self.beats[i] = None;
    }

    fn probes(&self, answered: bool) -> u64 {
        self.h
            .metrics()
            .kubelet_probes
            .get_or_create(&AnsweredLabels::of(answered))
            .get()
    }

    /// Passes until one satisfies `f`; returns every pass seen, that one last.
    async fn passes_until(&self, what: &str, f: impl Fn(&PassSummary) -> bool) -> Vec<PassSummary> {
        let mut seen = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let s = self.h.next_pass().await;
            let done = f(&s);
            seen.push(s);
            if done {
                return seen;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for: {what}"
            );
        }
    }

    /// Lets podgc see n1 and the nodes in `answering` with stale heartbeats answer probes,
    /// at least `rounds` more answered probes in all, and asserts that no pass on the way
    /// acted or counted a node down.
    async fn nothing_acted_while_kubelets_answer(&self, answering: &[&str], rounds: u64) {
        let from = self.probes(true);
        let seen = self
            .passes_until("kubelets probed and answering", |s| {
                answering
                    .iter()
                    .all(|n| s.kubelet_answered.iter().any(|a| a == n))
                    && self.probes(true) >= from + rounds
            })
            .await;
        for s in &seen {
            assert_eq!(s.unhealthy, 0, "{s:?}");
            assert!(
                s.quarantined_now.is_empty() && s.force_deleted.is_empty(),
                "{s:?}"
            );
            assert!(!s.disruption_mode, "{s:?}");
        }
        assert_eq!(self.probes(false), 0, "a kubelet did not answer");
        let pods = self.c.api::<Pod>(Some(NS));
        assert!(pods.get_opt("db-0").await.unwrap().is_some());
        let n1 = self.c.api::<Node>(None).get("n1").await.unwrap();
        assert!(!has_taint(&n1, QUARANTINE_TAINT_KEY));
    }

    /// Passes until podgc is in disruption mode; none on the way quarantined or
    /// force-deleted anything, and db-0 is still there.
    async fn nothing_fenced_until_disruption_mode(&self) {
        let seen = self
            .passes_until("disruption mode", |s| s.disruption_mode)
            .await;
        for s in &seen {
            assert!(
                s.quarantined_now.is_empty() && s.force_deleted.is_empty(),
                "{s:?}"
            );
        }
        let pods = self.c.api::<Pod>(Some(NS));
        assert!(pods.get_opt("db-0").await.unwrap().is_some());
    }

    /// n1 gets fenced: quarantined and db-0 force-deleted, by the fast path.
    async fn n1_fenced_by_the_fast_path(&self) {
        let pods = self.c.api::<Pod>(Some(NS));
        wait_for("db-0 force-deleted", || async {
            pods.get_opt("db-0").await.unwrap().is_none()
        })
        .await;
        let n1 = self.c.api::<Node>(None).get("n1").await.unwrap();
        assert!(has_taint(&n1, QUARANTINE_TAINT_KEY));
        let ev = events(&self.c, "TerminatingPodsForceDeleted").await;
        let note = ev[0].note.clone().unwrap_or_default();
        assert!(note.contains("has not renewed its heartbeat"), "{note}");
        assert!(note.contains("does not answer"), "{note}");
        assert!(self.probes(false) >= 1);
    }

    async fn stop(self) {
        self.h.shutdown().await.unwrap();
    }
}

/// The probe's rule on real processes: a serving TLS server answers, a frozen one is
/// silent until the bound (its kernel still accepts the connection), a gone one refuses.
#[tokio::test]
async fn a_kubelet_answers_until_it_is_frozen_or_gone() {
    let k = KubeletTls::start();
    assert_eq!(
        probe_kubelet(k.addr, PROBE_TIMEOUT).await.unwrap(),
        Answer::Handshake
    );
    k.freeze();
    let frozen = probe_kubelet(k.addr, Duration::from_millis(500)).await;
    assert!(matches!(frozen, Err(NoAnswer::Silent(_))), "{frozen:?}");
    k.thaw();
    // The thawed server first finishes the frozen probe's connection, then answers.
    assert_eq!(
        probe_kubelet(k.addr, PROBE_TIMEOUT).await.unwrap(),
        Answer::Handshake
    );
    let addr = k.addr;
    drop(k);
    let gone = probe_kubelet(addr, PROBE_TIMEOUT).await;
    assert!(matches!(gone, Err(NoAnswer::Connect(_))), "{gone:?}");
}

/// A frozen node (its node plugin stops beating, its kubelet is frozen) is fenced by the
/// fast path alone, while its Node still says Ready. Control first: beating nodes, passes
/// go by, nothing is probed.
#[tokio::test]
async fn a_node_whose_heartbeat_stops_and_whose_kubelet_is_frozen_is_fenced() {
    let mut w = World::start().await;
    w.passes_until("a few quiet passes", |s| s.seq >= 5).await;
    assert_eq!(w.probes(true) + w.probes(false), 0, "nothing is stale");
    w.stop_heartbeat(0);
    w.kubelets[0].freeze();
    w.n1_fenced_by_the_fast_path().await;
    let n1 = w.c.api::<Node>(None).get("n1").await.unwrap();
    let ready = n1.status.and_then(|s| s.conditions).unwrap_or_default();
    assert!(ready
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True"));
    w.kubelets[0].thaw();
    w.stop().await;
}

/// Only the node plugin stops (it crashed, crash-loops or is being rolled): its kubelet
/// still answers, and nothing is fenced however long that lasts. Control: its kubelet then
/// freezes too, and the node is fenced.
#[tokio::test]
async fn a_node_plugin_that_stops_fences_nothing_while_its_kubelet_answers() {
    let mut w = World::start().await;
    w.stop_heartbeat(0);
    w.nothing_acted_while_kubelets_answer(&["n1"], 3).await;
    w.kubelets[0].freeze();
    w.n1_fenced_by_the_fast_path().await;
    w.kubelets[0].thaw();
    w.stop().await;
}

/// Every heartbeat stops at once, as when the API server is slow or restarts, or podgc's
/// watch is behind: every kubelet answers, so nothing is down and nothing is fenced.
/// Control: n1's kubelet freezes, and n1 alone is fenced.
#[tokio::test]
async fn heartbeats_that_stop_everywhere_at_once_fence_nothing_while_kubelets_answer() {
    let mut w = World::start().await;
    for i in 0..NODES.len() {
        w.stop_heartbeat(i);
    }
    w.nothing_acted_while_kubelets_answer(&NODES, 6).await;
    w.kubelets[0].freeze();
    w.n1_fenced_by_the_fast_path().await;
    for n in ["n2", "n3"] {
        let node = w.c.api::<Node>(None).get(n).await.unwrap();
        assert!(!has_taint(&node, QUARANTINE_TAINT_KEY), "{n}");
    }
    w.kubelets[0].thaw();
    w.stop().await;
}

/// Every node down by both signals at once is disruption mode: the fault is likely
/// podgc's own network, and nothing is fenced. Control: two kubelets answer again, and n1,
/// still down, is fenced.
#[tokio::test]
async fn every_node_down_at_once_is_disruption_mode() {
    let mut w = World::start().await;
    for i in 0..NODES.len() {
        w.stop_heartbeat(i);
        w.kubelets[i].freeze();
    }
    w.nothing_fenced_until_disruption_mode().await;
    w.kubelets[1].thaw();
    w.kubelets[2].thaw();
    w.n1_fenced_by_the_fast_path().await;
    w.kubelets[0].thaw();
    w.stop().await;
}

/// A kubelet that refuses at once does not get its node fenced while other stale nodes'
/// probes are still out: they could make this a disruption. Made deterministic: n2 and n3
/// go stale first with frozen kubelets (their probes run the full bound), and only then
/// n1, whose kubelet is gone (its probe is refused at once, well within that bound).
/// Without the hold, n1 would be fenced on its refusal. Then every node is down:
/// disruption mode, nothing fenced. Control: n2 and n3 answer again, and n1 is fenced.
#[tokio::test]
async fn an_instant_refusal_waits_for_the_probes_still_out() {
    let mut w = World::start().await;
    for i in [1, 2] {
        w.stop_heartbeat(i);
        w.kubelets[i].freeze();
    }
    // Stale as podgc counts it (the grace is 1 s) before n1's heartbeat stops.
    let leases = w.c.api::<Lease>(Some(HEARTBEAT_NS));
    for n in ["n2", "n3"] {
        wait_for("the heartbeat to go stale", || async {
            let renewed = leases
                .get(&heartbeat_lease_name(n))
                .await
                .unwrap()
                .spec
                .and_then(|s| s.renew_time)
                .expect("the heartbeat Lease has a renewTime");
            let since =
                fencecsi_cluster::k8s_openapi::jiff::Timestamp::now().duration_since(renewed.0);
            since.as_millis() > 1200
        })
        .await;
    }
    w.stop_heartbeat(0);
    // Gone: its port refuses connections.
    let gone = w.kubelets.remove(0);
    drop(gone);
    w.nothing_fenced_until_disruption_mode().await;
    // Control: n2 and n3 (now kubelets[0] and [1]) answer again; n1, refused, is fenced.
    w.kubelets[0].thaw();
    w.kubelets[1].thaw();
    w.n1_fenced_by_the_fast_path().await;
    w.stop().await;
}
