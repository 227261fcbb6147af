//! Recording a failed attach or detach on the VolumeAttachment: attachError /
//! detachError in its status and a Warning event.

use fencecsi_cluster::k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeError};
use fencecsi_cluster::EventType;
use tonic::Code;

use super::{now, Ctx, ReconcileError, REASON_ATTACH_FAILED, REASON_DETACH_FAILED};

/// Which half of the VolumeAttachment's life an error belongs to.
#[derive(Debug, Clone, Copy)]
pub(super) enum Op {
    Attach,
    Detach,
}

impl Ctx {
    fn volume_error(msg: &str, code: Option<Code>) -> VolumeError {
        VolumeError {
            message: Some(msg.to_string()),
            time: Some(now()),
            error_code: code.map(|c| c as i32),
        }
    }

    /// Records a failed attach or detach in the VolumeAttachment's status
    /// (attachError / detachError) and, unless it repeats the last error, as
    /// a Warning event; returns the error so the queue backs off.
    pub(super) async fn failed(
        &self,
        va: &VolumeAttachment,
        op: Op,
        error: ReconcileError,
    ) -> Result<(), ReconcileError> {
        let msg = error.to_string();
        let code = error.code();
        let last = va.status.as_ref().and_then(|s| match op {
            Op::Attach => s.attach_error.as_ref(),
            Op::Detach => s.detach_error.as_ref(),
        });
        let repeated = last.and_then(|e| e.message.as_deref()) == Some(msg.as_str());
        let err = Self::volume_error(&msg, code);
        if let Err(e) = self
            .set_status(va, |s| match op {
                Op::Attach => s.attach_error = Some(err.clone()),
                Op::Detach => s.detach_error = Some(err.clone()),
            })
            .await
        {
            tracing::warn!(error = %e, ?op, "recording the error in the VolumeAttachment status failed");
        }
        if !repeated {
            let reason = match op {
                Op::Attach => REASON_ATTACH_FAILED,
                Op::Detach => REASON_DETACH_FAILED,
            };
            self.event(va, EventType::Warning, reason, msg);
        }
        Err(error)
    }
}
