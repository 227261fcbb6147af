//! The node plugin's heartbeat: a Lease it renews every `--heartbeat-interval`, which podgc
//! watches to see a node stop in seconds rather than after the kubelet's Lease grace.
//!
//! The Lease is `fencecsi-node-<node>` in the plugin's namespace, labelled
//! `fencecsi.io/heartbeat=node`, with the node's name as holderIdentity
//! ([`fencecsi_cluster::well_known`]). A renewal proves that this process runs, gets CPU
//! and reaches the API server; podgc never acts on a stale heartbeat alone (it confirms with
//! a probe of the kubelet). Each call is bounded by the interval, so a call sent on a
//! connection a network cut killed is given up and the next beat tries afresh.

use std::time::Duration;

use fencecsi_cluster::k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use fencecsi_cluster::k8s_openapi::jiff::Timestamp;
use fencecsi_cluster::well_known::{heartbeat_lease_name, HEARTBEAT_LABEL};
use fencecsi_cluster::Cluster;

/// Where and how often to beat.
#[derive(Debug, Clone)]
pub struct HeartbeatOptions {
    pub namespace: String,
    pub node: String,
    pub interval: Duration,
}

/// The running heartbeat; it stops when dropped.
pub struct HeartbeatHandle(tokio::task::JoinHandle<()>);

impl Drop for HeartbeatHandle {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts beating.
pub fn spawn(cluster: Cluster, opts: HeartbeatOptions) -> HeartbeatHandle {
    tracing::info!(node = %opts.node, namespace = %opts.namespace, interval = ?opts.interval, "renewing the node's heartbeat Lease");
    HeartbeatHandle(tokio::spawn(beat(cluster, opts)))
}

async fn beat(cluster: Cluster, opts: HeartbeatOptions) {
    let api = cluster.api::<Lease>(Some(&opts.namespace));
    let name = heartbeat_lease_name(&opts.node);
    let mut tick = tokio::time::interval(opts.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The Lease as last written: renewed by replacing it, read again after a failure.
    let mut last: Option<Lease> = None;
    let mut failing = false;
    loop {
        tick.tick().await;
        let renewal = async {
            let current = match last.take() {
                Some(l) => Some(l),
                None => api.get_opt(&name).await?,
            };
            match current {
                Some(mut l) => {
                    renew(&mut l, &opts.node);
                    api.replace(&l).await
                }
                None => api.create(&new_lease(&name, &opts)).await,
            }
        };
        match tokio::time::timeout(opts.interval, renewal).await {
            Ok(Ok(l)) => {
                if failing {
                    tracing::info!("heartbeat renewed again");
                }
                failing = false;
                last = Some(l);
            }
            Ok(Err(e)) => {
                if !failing {
                    tracing::warn!(error = %e, "renewing the heartbeat failed; retrying every interval");
                }
                failing = true;
            }
            Err(_) => {
                if !failing {
                    tracing::warn!(bound = ?opts.interval, "renewing the heartbeat took longer than the interval; retrying");
                }
                failing = true;
            }
        }
    }
}

fn renew(l: &mut Lease, node: &str) {
    let spec = l.spec.get_or_insert_with(Default::default);
    spec.holder_identity = Some(node.to_string());
    spec.renew_time = Some(MicroTime(Timestamp::now()));
}

fn new_lease(name: &str, opts: &HeartbeatOptions) -> Lease {
    let now = Some(MicroTime(Timestamp::now()));
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(opts.namespace.clone()),
            labels: Some([(HEARTBEAT_LABEL.0.into(), HEARTBEAT_LABEL.1.into())].into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(opts.node.clone()),
            lease_duration_seconds: Some(
                i32::try_from(opts.interval.as_secs().max(1)).unwrap_or(i32::MAX),
            ),
            acquire_time: now.clone(),
            renew_time: now,
            ..Default::default()
        }),
    }
}
