//! The graceful teardown: the pods are deleted so the real chain unpublishes, unstages
//! and detaches their volumes, then everything the set-up started is stopped. Whatever
//! is left after that is the Env guard's to clean up (see [`super::run`]).

use std::time::Duration;

use fencecsi_cluster::k8s_openapi::api::core::v1::Pod;
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::well_known::*;
use fencecsi_cluster::{Cluster, DeleteOptions, ListParams};

use super::setup::Rig;
use super::wait_until;
use crate::standins::Task;
use crate::{Options, NAMESPACE};

pub(super) async fn graceful(cluster: &Cluster, opts: &Options, rig: Rig, observer: Task) {
    let p = &opts.progress;
    let Rig {
        sts,
        kubelets,
        adc,
        adc_model: _,
        provisioner,
        podgc,
        attacher,
        plugins,
        controller_client,
        controller,
        eviction,
        lifecycle,
        hbs,
    } = rig;
    // The StatefulSet stand-in goes first, or it would re-create the pods deleted here.
    drop(sts);
    let pods = cluster.api::<Pod>(Some(NAMESPACE));
    for i in 0..opts.volumes {
        let _ = pods
            .delete(&format!("writer-{i}"), &DeleteOptions::default())
            .await;
    }
    let vas = cluster.api::<VolumeAttachment>(None);
    if let Err(e) = wait_until(
        "pods and attachments gone",
        Duration::from_secs(30),
        || async {
            Ok(pods
                .list_filtered(&ListParams::default(), |p| {
                    p.metadata
                        .name
                        .as_deref()
                        .is_some_and(|n| n.starts_with("writer-"))
                })
                .await?
                .is_empty()
                && vas
                    .list_filtered(&ListParams::default(), |v| v.spec.attacher == DRIVER_NAME)
                    .await?
                    .is_empty())
        },
    )
    .await
    {
        p.say(format!("teardown: {e:#} (the Env guard cleans up)"));
    } else {
        p.say("teardown: pods deleted, volumes unpublished, unstaged and detached");
    }
    drop(observer);
    for k in kubelets {
        k.shutdown().await;
    }
    adc.shutdown().await;
    drop(provisioner);
    let _ = podgc.shutdown().await;
    let _ = attacher.shutdown().await;
    for hb in hbs {
        hb.shutdown().await;
    }
    for pl in plugins {
        pl.stop().await;
    }
    controller.stop().await;
    // The node simulations last: they keep the Nodes' conditions true to the end.
    drop(controller_client);
    drop(eviction);
    drop(lifecycle);
}
