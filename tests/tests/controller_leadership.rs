//! Controller plugin replicas with leader election (`--leader-election`), on the
//! embedded API server: one serves the state dir; a standby serves only what its
//! sidecars need (Identity, capabilities) and answers everything else UNAVAILABLE;
//! a leader that cannot renew its Lease gives up within the renew deadline, with no
//! API server to ask; the standby then takes over the same state dir and its volumes.

use std::time::{Duration, Instant};

use fencecsi_cluster::k8s_openapi::api::coordination::v1::Lease;
use fencecsi_cluster::Cluster;
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::replica::{Replica, LEASE, NS, RENEW, RETRY};
use fencecsi_tests::rig::{create_request, volume_ids};
use fencecsi_tests::{csi, mount_cap, require_root, Access, Env};
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
    let cluster = Cluster::embedded();

    let mut a = Replica::start(&env, &cluster, "controller-a");
    let mut ca = a.client().await;
    let vol = eventually(60, "replica a leads and serves", || {
        let mut c = ca.clone();
        async move { create(&mut c, "pvc-a").await.ok() }
    })
    .await;

    // The standby answers its sidecars' start-up calls, and nothing that touches the
    // state dir (the positive control: the same call on the leader succeeded).
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
    let err = create(&mut cb, "pvc-b")
        .await
        .expect_err("a standby serves no volume call");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(
        volume_ids(&mut ca).await,
        [vol.clone()].into(),
        "a still serves"
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
    let err = create(&mut cb, "pvc-b")
        .await
        .expect_err("A still owns the state dir");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
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
    assert_eq!(ids.len(), 2);

    for id in ids {
        cb.controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: id,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    b.stop().await;
    env.assert_clean();
}
