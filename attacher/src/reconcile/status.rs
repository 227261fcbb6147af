//! Writing a VolumeAttachment's status. Attach, detach and error recording all go
//! through here so that each write survives a concurrent update.

use fencecsi_cluster::k8s_openapi::api::storage::v1::{VolumeAttachment, VolumeAttachmentStatus};

use super::{Ctx, ReconcileError};

impl Ctx {
    /// Writes `va`'s status through `f`, re-reading on conflict. A vanished object is fine.
    pub(super) async fn set_status(
        &self,
        va: &VolumeAttachment,
        f: impl Fn(&mut VolumeAttachmentStatus),
    ) -> Result<(), ReconcileError> {
        let name = va.metadata.name.clone().unwrap_or_default();
        let mut cur = va.clone();
        for _ in 0..8 {
            let mut st = cur.status.clone().unwrap_or_default();
            f(&mut st);
            if cur.status.as_ref() == Some(&st) {
                return Ok(());
            }
            cur.status = Some(st);
            match self.vas.replace_status(&cur).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_not_found() => return Ok(()),
                Err(e) if e.is_conflict() => match self.vas.get_opt(&name).await {
                    Ok(Some(v)) => cur = v,
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        return Err(ReconcileError::kube(
                            format!("re-reading VolumeAttachment {name}"),
                            e,
                        ))
                    }
                },
                Err(e) => {
                    return Err(ReconcileError::kube(
                        format!("writing the status of VolumeAttachment {name}"),
                        e,
                    ))
                }
            }
        }
        Err(ReconcileError::StatusConflicts { name })
    }
}
