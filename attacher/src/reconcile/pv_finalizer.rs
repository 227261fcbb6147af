//! This driver's finalizer on PersistentVolumes: held while any VolumeAttachment of the
//! driver references the PV, and swept at resync when a race left it behind.

use fencecsi_cluster::{ListParams, MetadataPatch};

use super::{has_finalizer, Ctx, ReconcileError};

impl Ctx {
    /// Whether a VolumeAttachment of this driver (other than `except`) references `pv`.
    pub(super) fn pv_referenced(&self, pv: &str, except: Option<&str>) -> bool {
        // Until this session's watch has listed, the cache cannot show that
        // nothing references the PV: keep the finalizer.
        if !self.listed.load(std::sync::atomic::Ordering::Acquire) {
            return true;
        }
        self.cache.state().iter().any(|va| {
            va.metadata.name.as_deref() != except
                && va.spec.source.persistent_volume_name.as_deref() == Some(pv)
        })
    }

    pub(super) async fn add_pv_finalizer(&self, pv: &str) -> Result<(), ReconcileError> {
        match self
            .pvs
            .patch_metadata(pv, &MetadataPatch::new().add_finalizer(&self.finalizer))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Err(ReconcileError::PvNotFound { pv: pv.to_string() }),
            // Deleting already: it keeps the finalizer it has.
            Err(e) if e.is_invalid() => Ok(()),
            Err(e) => Err(ReconcileError::kube(
                format!("adding the finalizer to PersistentVolume {pv}"),
                e,
            )),
        }
    }

    pub(super) async fn remove_pv_finalizer(&self, pv: &str) -> Result<(), ReconcileError> {
        match self
            .pvs
            .patch_metadata(pv, &MetadataPatch::new().remove_finalizer(&self.finalizer))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(ReconcileError::kube(
                format!("removing the finalizer of PersistentVolume {pv}"),
                e,
            )),
        }
    }

    /// Removes this driver's finalizer from PVs no VolumeAttachment of the driver
    /// references any more (e.g. after two detaches raced). Part of the resync.
    pub(crate) async fn sweep_pv_finalizers(&self) {
        if !self.listed.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let fin = self.finalizer.clone();
        let pvs = match self
            .pvs
            .list_filtered(&ListParams::default(), move |pv| {
                has_finalizer(&pv.metadata, &fin)
            })
            .await
        {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "listing PersistentVolumes for the finalizer sweep failed");
                return;
            }
        };
        for pv in pvs {
            let name = pv.metadata.name.clone().unwrap_or_default();
            if !self.pv_referenced(&name, None) {
                if let Err(e) = self.remove_pv_finalizer(&name).await {
                    tracing::warn!(pv = %name, error = %e, "finalizer sweep");
                } else {
                    tracing::info!(pv = %name, "finalizer removed: no VolumeAttachment references the PersistentVolume");
                }
            }
        }
    }
}
