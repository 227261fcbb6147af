//! What a VolumeAttachment points at: the CSI volume (from its PV or inline spec) and
//! the CSI node ID of its node.

use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;

use super::{Ctx, ReconcileError};
use crate::volume::{self, CsiVolume};

impl Ctx {
    /// The PV name (if any) and the CSI volume of `va`.
    pub(super) async fn volume_of(
        &self,
        va: &VolumeAttachment,
    ) -> Result<(Option<String>, CsiVolume), ReconcileError> {
        let src = &va.spec.source;
        if let Some(pv_name) = &src.persistent_volume_name {
            let pv = match self.pvs.get_opt(pv_name).await {
                Ok(Some(pv)) => pv,
                Ok(None) => {
                    return Err(ReconcileError::PvNotFound {
                        pv: pv_name.clone(),
                    })
                }
                Err(e) => {
                    return Err(ReconcileError::kube(
                        format!("reading PersistentVolume {pv_name}"),
                        e,
                    ))
                }
            };
            let spec = pv.spec.unwrap_or_default();
            let v = volume::csi_volume(&spec, &self.driver).map_err(|error| {
                ReconcileError::InvalidPv {
                    pv: pv_name.clone(),
                    error,
                }
            })?;
            Ok((Some(pv_name.clone()), v))
        } else if let Some(spec) = &src.inline_volume_spec {
            let v =
                volume::csi_volume(spec, &self.driver).map_err(ReconcileError::InvalidInline)?;
            Ok((None, v))
        } else {
            Err(ReconcileError::NoSource)
        }
    }

    /// The CSI node ID of `node`: CSINode first, then the Node annotation.
    pub(super) async fn node_id(&self, node: &str) -> Result<String, ReconcileError> {
        if let Some(cn) = self
            .csinodes
            .get_opt(node)
            .await
            .map_err(|e| ReconcileError::kube(format!("reading CSINode {node}"), e))?
        {
            if let Some(id) = volume::node_id_from_csinode(&cn, &self.driver) {
                return Ok(id);
            }
        }
        if let Some(n) = self
            .nodes
            .get_opt(node)
            .await
            .map_err(|e| ReconcileError::kube(format!("reading Node {node}"), e))?
        {
            if let Some(id) = volume::node_id_from_annotation(&n, &self.driver) {
                return Ok(id);
            }
        }
        Err(ReconcileError::NoNodeId {
            node: node.to_string(),
            driver: self.driver.clone(),
        })
    }
}
