//! The watch-side filter: which VolumeAttachment updates queue a pass.

use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;

use super::VA_NODE_ID_ANNOTATION;

/// Whether a watch update should queue the object. External-attacher's rule — not when
/// only the attach/detach error changed — widened to every change this attacher makes
/// itself: the status (only the attacher writes it), its own finalizer and node-ID
/// annotation being added. Those are followed by the backoff (on failure) or need
/// nothing (on success); queuing them at once would bypass the backoff and double every
/// attach. Anything else queues: spec, deletion, finalizers or annotations changed by
/// someone else, and resyncs (same resourceVersion). A status changed by someone else
/// is repaired at the next resync.
pub(crate) fn should_enqueue(
    old: Option<&VolumeAttachment>,
    new: &VolumeAttachment,
    finalizer: &str,
) -> bool {
    let Some(old) = old else { return true };
    if old.metadata.resource_version == new.metadata.resource_version {
        return true;
    }
    let mut sanitized = new.clone();
    let m = &mut sanitized.metadata;
    m.resource_version = old.metadata.resource_version.clone();
    m.managed_fields = old.metadata.managed_fields.clone();
    sanitized.status = old.status.clone();
    // Our finalizer added (nothing else changed in the list).
    let mut with_ours = old.metadata.finalizers.clone().unwrap_or_default();
    if !with_ours.iter().any(|f| f == finalizer) {
        with_ours.push(finalizer.to_string());
    }
    if m.finalizers.as_deref().unwrap_or_default() == with_ours.as_slice() {
        m.finalizers = old.metadata.finalizers.clone();
    }
    // Our node-ID annotation set (nothing else changed in the map).
    if let Some(a) = m.annotations.as_mut() {
        let mut a2 = a.clone();
        a2.remove(VA_NODE_ID_ANNOTATION);
        let mut o = old.metadata.annotations.clone().unwrap_or_default();
        o.remove(VA_NODE_ID_ANNOTATION);
        if a2 == o {
            m.annotations = old.metadata.annotations.clone();
        }
    }
    sanitized != *old
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::now;
    use fencecsi_cluster::k8s_openapi::api::storage::v1::{
        VolumeAttachmentSpec, VolumeAttachmentStatus, VolumeError,
    };
    use fencecsi_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn va(rv: &str) -> VolumeAttachment {
        VolumeAttachment {
            metadata: ObjectMeta {
                name: Some("va".into()),
                resource_version: Some(rv.into()),
                ..Default::default()
            },
            spec: VolumeAttachmentSpec {
                attacher: "d".into(),
                node_name: "n".into(),
                ..Default::default()
            },
            status: None,
        }
    }

    const FIN: &str = "external-attacher/d";

    #[test]
    fn own_writes_do_not_requeue() {
        let should_enqueue =
            |a: Option<&VolumeAttachment>, b: &VolumeAttachment| super::should_enqueue(a, b, FIN);
        let old = va("1");
        assert!(should_enqueue(None, &old));
        assert!(should_enqueue(Some(&old), &old), "resync (same rv) queues");
        let mut err = va("2");
        err.status = Some(VolumeAttachmentStatus {
            attach_error: Some(VolumeError {
                message: Some("boom".into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        assert!(!should_enqueue(Some(&old), &err));
        let mut err2 = err.clone();
        err2.metadata.resource_version = Some("3".into());
        err2.status
            .as_mut()
            .unwrap()
            .attach_error
            .as_mut()
            .unwrap()
            .message = Some("again".into());
        assert!(!should_enqueue(Some(&err), &err2));
        let mut attached = err2.clone();
        attached.metadata.resource_version = Some("4".into());
        attached.status.as_mut().unwrap().attached = true;
        assert!(!should_enqueue(Some(&err2), &attached), "our status write");
        let mut deleting = va("5");
        deleting.metadata.deletion_timestamp = Some(now());
        assert!(should_enqueue(Some(&old), &deleting));

        let mut ours = va("6");
        ours.metadata.finalizers = Some(vec![FIN.into()]);
        ours.metadata.annotations =
            Some([(VA_NODE_ID_ANNOTATION.to_string(), "n1".to_string())].into());
        assert!(
            !should_enqueue(Some(&old), &ours),
            "our finalizer and annotation"
        );
        let mut gone = ours.clone();
        gone.metadata.resource_version = Some("7".into());
        gone.metadata.finalizers = None;
        assert!(
            should_enqueue(Some(&ours), &gone),
            "our finalizer removed by someone else"
        );
        let mut other = ours.clone();
        other.metadata.resource_version = Some("8".into());
        other.metadata.finalizers = Some(vec![FIN.into(), "someone/else".into()]);
        assert!(should_enqueue(Some(&ours), &other));
        let mut label = ours.clone();
        label.metadata.resource_version = Some("9".into());
        label
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert("x".into(), "y".into());
        assert!(should_enqueue(Some(&ours), &label));
    }
}
