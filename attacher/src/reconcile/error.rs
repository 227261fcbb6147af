//! Why a pass over one VolumeAttachment failed. Never fatal: the worker logs it and the
//! object is retried with backoff; attach and detach failures are also recorded on the
//! object (`failure`).
//!
//! The Display of each variant is the message `status.attachError` / `detachError`, the
//! Warning Events and the logs carry, so it names the cause itself; the cause is therefore
//! not also returned as `source()` (a chain printer would repeat it).

use tonic::Code;

use crate::volume::InvalidVolume;

#[derive(Debug, thiserror::Error)]
pub(crate) enum ReconcileError {
    /// A Kubernetes API call failed; `doing` says which ("reading Node n1").
    #[error("{doing}: {error}")]
    Kube {
        doing: String,
        error: fencecsi_cluster::Error,
    },
    #[error("PersistentVolume {pv} not found")]
    PvNotFound { pv: String },
    #[error("PersistentVolume {pv}: {error}")]
    InvalidPv { pv: String, error: InvalidVolume },
    #[error("inline volume: {0}")]
    InvalidInline(InvalidVolume),
    #[error("spec.source names neither a PersistentVolume nor an inline volume")]
    NoSource,
    #[error("node {node} has no CSI node ID for driver {driver}: neither its CSINode nor its Node annotation names it (is the node plugin registered?)")]
    NoNodeId { node: String, driver: String },
    #[error("writing the status of VolumeAttachment {name}: too many conflicts")]
    StatusConflicts { name: String },
    /// Leadership was lost (or shutdown began) before a CSI call.
    #[error("not the active attacher any more")]
    NotActive,
    #[error(
        "ControllerPublishVolume of {handle} to node {node_id} failed: {}: {}",
        code_name(.status.code()),
        .status.message()
    )]
    Publish {
        handle: String,
        node_id: String,
        status: tonic::Status,
    },
    #[error(
        "ControllerUnpublishVolume{} of {handle} from node {node_id} failed: {}: {}",
        if *.fence { " with fence" } else { "" },
        code_name(.status.code()),
        .status.message()
    )]
    Unpublish {
        handle: String,
        node_id: String,
        fence: bool,
        status: tonic::Status,
    },
}

impl ReconcileError {
    pub(crate) fn kube(doing: impl Into<String>, error: fencecsi_cluster::Error) -> Self {
        ReconcileError::Kube {
            doing: doing.into(),
            error,
        }
    }

    /// Whether a CSI call failed because the plugin was not there to answer (no socket,
    /// a plugin that cannot serve yet, or no answer within the call's timeout).
    pub(crate) fn plugin_absent(&self) -> bool {
        matches!(
            self.code(),
            Some(Code::Unavailable | Code::DeadlineExceeded)
        )
    }

    /// The gRPC code of a failed CSI call (recorded as the VolumeError's `errorCode`).
    pub(crate) fn code(&self) -> Option<Code> {
        match self {
            ReconcileError::Publish { status, .. } | ReconcileError::Unpublish { status, .. } => {
                Some(status.code())
            }
            _ => None,
        }
    }
}

fn code_name(c: Code) -> String {
    format!("{c:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_is_absent_when_it_cannot_be_reached_or_does_not_answer() {
        let publish = |code| ReconcileError::Publish {
            handle: "vol-1".into(),
            node_id: "n1".into(),
            status: tonic::Status::new(code, "x"),
        };
        assert!(publish(Code::Unavailable).plugin_absent());
        assert!(publish(Code::DeadlineExceeded).plugin_absent());
        assert!(!publish(Code::NotFound).plugin_absent());
        assert!(!publish(Code::Aborted).plugin_absent());
        assert!(!ReconcileError::NotActive.plugin_absent());
    }

    // The texts are what status.attachError/detachError and the Events carry: pinned.
    #[test]
    fn messages_read_as_recorded() {
        let publish = ReconcileError::Publish {
            handle: "vol-1".into(),
            node_id: "n1".into(),
            status: tonic::Status::new(Code::ResourceExhausted, "full"),
        };
        assert_eq!(
            publish.to_string(),
            "ControllerPublishVolume of vol-1 to node n1 failed: ResourceExhausted: full"
        );
        assert_eq!(publish.code(), Some(Code::ResourceExhausted));
        for (fence, text) in [
            (
                true,
                "ControllerUnpublishVolume with fence of vol-1 from node n1 failed: Internal: boom",
            ),
            (
                false,
                "ControllerUnpublishVolume of vol-1 from node n1 failed: Internal: boom",
            ),
        ] {
            let e = ReconcileError::Unpublish {
                handle: "vol-1".into(),
                node_id: "n1".into(),
                fence,
                status: tonic::Status::internal("boom"),
            };
            assert_eq!(e.to_string(), text);
        }
        let kube = ReconcileError::kube(
            "reading Node n1",
            fencecsi_cluster::Error::Forbidden("nodes".into()),
        );
        assert_eq!(kube.to_string(), "reading Node n1: forbidden: nodes");
        assert_eq!(kube.code(), None);
        assert_eq!(
            ReconcileError::InvalidPv {
                pv: "pv-1".into(),
                error: InvalidVolume::EmptyHandle
            }
            .to_string(),
            "PersistentVolume pv-1: the PersistentVolume has an empty volumeHandle"
        );
        assert_eq!(
            ReconcileError::InvalidInline(InvalidVolume::NotCsi).to_string(),
            "inline volume: the PersistentVolume is not a CSI volume"
        );
        assert_eq!(
            ReconcileError::NoNodeId { node: "n1".into(), driver: "d".into() }.to_string(),
            "node n1 has no CSI node ID for driver d: neither its CSINode nor its Node annotation names it (is the node plugin registered?)"
        );
    }
}
