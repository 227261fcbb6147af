//! Controller plugin replicas with leader election (`--leader-election`), on the
//! embedded API server: one serves the state dir; a standby answers what its sidecars
//! need to start (Identity, capabilities) and forwards everything else to the leader;
//! a leader that cannot renew its Lease gives up within the renew deadline, with no
//! API server to ask; the standby then takes over the same state dir and its volumes.

use std::time::{Duration, Instant};

use fencecsi_cluster::k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use fencecsi_cluster::Cluster;
use fencecsi_driver::config::Mode;
use fencecsi_embedded_cluster::EmbeddedCluster;
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::replica::{Replica, LEASE, NS, RENEW, RETRY};
use fencecsi_tests::rig::{create_request, volume_ids};
use fencecsi_tests::{csi, mount_cap, require_root, wait_for_socket, Access, Env, Process};
use tonic::Code;

/// Polls `f` until it answers Some; fails with `what` after `secs`.
async fn eventually<T, F, Fut>(secs: u64, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client of the socket the leader serves its standbys on.
async fn a_client_of_the_leader_socket(env: &Env) -> CsiClient {
    CsiClient::connect(&fencecsi_driver::locks::leader_socket(&env.state_dir()))
        .await
        .expect("the leader serves its standbys")
}

async fn create(c: &mut CsiClient, name: &str) -> Result<String, tonic::Status> {
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    c.controller
        .create_volume(create_request(name, 32 << 20, &cap))
        .await
        .map(|r| r.into_inner().volume.unwrap().volume_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_the_state_dir_from_a_leader_that_cannot_renew() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let cluster = EmbeddedCluster::new();

    let mut a = Replica::start(&env, &cluster, "controller-a");
    let mut ca = a.client().await;
    let vol = eventually(60, "replica a leads and serves", || {
        let mut c = ca.clone();
        async move { create(&mut c, "pvc-a").await.ok() }
    })
    .await;

    // The standby answers its sidecars' start-up calls itself, and forwards the rest to
    // the leader through the leader's socket in the state dir: a volume created through b
    // is a's (b has not opened the state dir: it does not lead).
    let mut b = Replica::start(&env, &cluster, "controller-b");
    let mut cb = b.client().await;
    let probe = cb
        .identity
        .probe(csi::ProbeRequest {})
        .await
        .expect("a standby answers Probe");
    assert_eq!(probe.into_inner().ready, Some(true));
    let caps = cb
        .controller
        .controller_get_capabilities(csi::ControllerGetCapabilitiesRequest {})
        .await
        .expect("a standby answers ControllerGetCapabilities")
        .into_inner();
    assert!(!caps.capabilities.is_empty());
    let through_b = create(&mut cb, "pvc-through-b")
        .await
        .expect("a standby forwards to the leader");
    assert_eq!(
        volume_ids(&mut ca).await,
        [vol.clone(), through_b.clone()].into(),
        "the leader made the volume asked of the standby"
    );
    let owner = fencecsi_driver::locks::owner_of(&env.state_dir())
        .unwrap()
        .expect("owned");
    assert_eq!(owner.pid, std::process::id(), "one owner");
    assert_eq!(
        owner.identity, "controller-a",
        "the leader's generation names its Lease identity"
    );

    // The leader's node is cut off: no Lease renewal goes through any more. It gives up
    // on its own, with no API server to ask. (When, against its renew deadline, is a
    // figure, printed below: the time it noticed includes the scheduling of its watcher,
    // which a busy machine stretches. What keeps two replicas off the state dir is its
    // ownership lock, checked below: b waits for it.)
    let cut = Instant::now();
    cluster.deny::<Lease>(NS);
    let lost_at = tokio::time::timeout(RENEW * 20, &mut a.lost)
        .await
        .expect("the leader gives up without its Lease")
        .unwrap();
    let gave_up = lost_at - cut;
    // Here A does not exit (as a frozen process would not): B gets the Lease but not the
    // state dir, and waits for it as a standby rather than giving up.
    cluster.allow::<Lease>(NS);
    eventually(60, "replica b takes the Lease", || {
        let c = cluster.clone();
        async move {
            let l = c
                .api::<Lease>(Some(NS))
                .get("fencecsi-controller-plugin")
                .await
                .ok()?;
            let holder = l.spec?.holder_identity?;
            (holder == "controller-b").then_some(())
        }
    })
    .await;
    // b leads (it holds the Lease it took), yet the state dir is still A's. The pause
    // gives b time to try for it (b records no attempt to wait for); a busy machine can
    // only make it try less, never make the check fail.
    tokio::time::sleep(LEASE).await;
    let err = a_client_of_the_leader_socket(&env)
        .await
        .controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await;
    assert!(
        err.is_ok(),
        "A still owns the state dir and serves it: {err:?}"
    );
    assert!(
        !b.has_ended(),
        "b waits for the state dir, it does not give up"
    );
    // What production does at the cut: the process exits and its ownership lock goes
    // with it.
    a.stop().await;
    let healed = Instant::now();
    let cb2 = cb.clone();
    eventually(60, "replica b takes over", || {
        let mut c = cb2.clone();
        async move { create(&mut c, "pvc-b").await.ok() }
    })
    .await;
    let took = healed.elapsed();
    eprintln!("leader gave up {gave_up:?} after the cut (renew deadline {RENEW:?}, retry {RETRY:?}); the standby served {took:?} after the former leader let go of the state dir");
    let ids = volume_ids(&mut cb).await;
    assert!(ids.contains(&vol), "b serves the volume a created: {ids:?}");
    assert!(ids.contains(&through_b), "{ids:?}");
    assert_eq!(ids.len(), 3);

    delete_all(&mut cb, ids).await;
    b.stop().await;
    env.assert_clean();
}

/// A leader killed (a power-off, a crash) still holds its Lease for an hour, as far as the
/// API server knows; the standby learns from the kernel that it let go of the state dir
/// (its generation's lock is free) and takes the Lease and the state dir over at once,
/// with the volume the former leader made. Expiry cannot explain it: the Lease lasts an
/// hour. The controls are the contract's (a holder that runs, renews or is someone else
/// is waited for) and the lock's (a frozen holder keeps its lock: the_lock_says_when_a_lease_holder_let_go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_at_once_from_a_leader_that_was_killed() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let cluster = EmbeddedCluster::new();
    // The former leader, in a process of its own, owning the state dir under its name.
    let mut cfg = env.config(Mode::Controller, None, "controller-a");
    cfg.identity.name = Some("controller-a".into());
    let mut a = Process::spawn(&cfg);
    let mut ca = wait_for_socket(&a.socket).await;
    let vol = create(&mut ca, "pvc-a").await.expect("a serves");
    assert_eq!(
        fencecsi_driver::locks::owner_of(&env.state_dir())
            .unwrap()
            .map(|h| h.identity)
            .as_deref(),
        Some("controller-a"),
        "a's generation names it"
    );
    hold_the_lease_as(&cluster, "controller-a").await;

    let mut b = Replica::start(&env, &cluster, "controller-b");
    let mut cb = b.client().await;
    let err = create(&mut cb, "pvc-b").await.expect_err("a leads");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");

    a.kill9();
    let through_b = eventually(60, "b takes over from the killed leader", || {
        let mut c = cb.clone();
        async move { create(&mut c, "pvc-b").await.ok() }
    })
    .await;
    let lease = cluster
        .api::<Lease>(Some(NS))
        .get("fencecsi-controller-plugin")
        .await
        .unwrap();
    assert_eq!(
        lease.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("controller-b")
    );
    let ids = volume_ids(&mut cb).await;
    assert_eq!(
        ids,
        [vol, through_b].into(),
        "b serves a's volume and its own"
    );
    delete_all(&mut cb, ids).await;
    b.stop().await;
    env.assert_clean();
}

async fn delete_all(c: &mut CsiClient, ids: std::collections::BTreeSet<String>) {
    for id in ids {
        c.controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: id,
                ..Default::default()
            })
            .await
            .unwrap();
    }
}

/// Someone else holds the controller plugin's Lease, for an hour, and serves nothing.
async fn hold_the_lease_elsewhere(cluster: &Cluster) -> Lease {
    hold_the_lease_as(cluster, "elsewhere").await
}

/// `holder` holds the controller plugin's Lease, for an hour.
async fn hold_the_lease_as(cluster: &Cluster, holder: &str) -> Lease {
    let now = MicroTime(fencecsi_cluster::k8s_openapi::jiff::Timestamp::now());
    cluster
        .api::<Lease>(Some(NS))
        .create(&Lease {
            metadata: ObjectMeta {
                name: Some("fencecsi-controller-plugin".into()),
                namespace: Some(NS.into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                lease_duration_seconds: Some(3600),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
}

/// Deletes the Lease [`hold_the_lease_elsewhere`] made, so that a replica may take it.
async fn release_the_lease(cluster: &Cluster, held: &Lease) {
    cluster
        .api::<Lease>(Some(NS))
        .delete(held.metadata.name.as_deref().unwrap(), &Default::default())
        .await
        .unwrap();
}

/// A standby whose leader does not answer (none serves the state dir: between leaders, or
/// one paused) refuses volume calls with UNAVAILABLE, the code its sidecars retry, and says
/// why; it still answers its sidecars' start-up calls. The positive control: the same call
/// goes through once a leader serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_without_a_leader_answers_unavailable() {
    require_root!();
    let env = Env::new();
    let cluster = EmbeddedCluster::new();
    let held = hold_the_lease_elsewhere(&cluster).await;
    let mut b = Replica::start(&env, &cluster, "controller-b");
    let mut cb = b.client().await;
    cb.identity
        .probe(csi::ProbeRequest {})
        .await
        .expect("a standby answers Probe");
    let err = create(&mut cb, "pvc").await.expect_err("no leader serves");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("standby"), "{err:?}");

    // Positive control: the Lease given up, b leads and the same call is served.
    release_the_lease(&cluster, &held).await;
    let vol = eventually(60, "b leads and serves", || {
        let mut c = cb.clone();
        async move { create(&mut c, "pvc").await.ok() }
    })
    .await;
    cb.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: vol,
            ..Default::default()
        })
        .await
        .unwrap();
    b.stop().await;
    env.assert_clean();
}

/// A call the standby forwards to a leader that never answers (frozen: its socket accepts,
/// nothing replies) does not hold up the standby's own takeover: once it leads, the standby
/// cuts such calls off within its short drain and serves, rather than wait for them as long
/// as their clients would (`standby::FORWARD_BOUND`, longer than the bound below).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_forwarded_to_a_frozen_leader_does_not_hold_up_the_takeover() {
    require_root!();
    let env = Env::new();
    let cluster = EmbeddedCluster::new();
    let held = hold_the_lease_elsewhere(&cluster).await;
    // The frozen leader: a socket that is listened on and never accepted from.
    let socket = fencecsi_driver::locks::leader_socket(&env.state_dir());
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    let frozen = std::os::unix::net::UnixListener::bind(&socket).unwrap();

    let mut b = Replica::start(&env, &cluster, "controller-b");
    let cb = b.client().await;
    let mut c = cb.clone();
    let hanging = tokio::spawn(async move { create(&mut c, "pvc-hanging").await });
    // The call reached the frozen leader (queued on its socket) before b leads.
    eventually(60, "the forwarded call to reach the frozen leader", || {
        let listening = socket_has_a_connection_queued(&socket);
        async move { listening.then_some(()) }
    })
    .await;
    assert!(
        !hanging.is_finished(),
        "the forwarded call waits for the frozen leader"
    );

    release_the_lease(&cluster, &held).await;
    let vol = eventually(60, "b takes over and serves", || {
        let mut c = cb.clone();
        async move { create(&mut c, "pvc").await.ok() }
    })
    .await;
    let cut = hanging.await.unwrap();
    assert!(
        cut.is_err(),
        "the call to the frozen leader was cut off: {cut:?}"
    );
    drop(frozen);
    let mut cb = cb;
    cb.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: vol,
            ..Default::default()
        })
        .await
        .unwrap();
    b.stop().await;
    env.assert_clean();
}

/// Whether the unix socket at `path` has a connection waiting to be accepted (its accept
/// queue, the `Recv-Q` of a listening socket in /proc/net/unix's terms: flags `__SO_ACCEPTCON`
/// with a peer queued shows as a second entry on the same path).
fn socket_has_a_connection_queued(path: &std::path::Path) -> bool {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    let named = table
        .lines()
        .filter(|l| l.ends_with(&*path.to_string_lossy()))
        .count();
    named >= 2
}
