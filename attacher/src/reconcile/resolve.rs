//! What a VolumeAttachment points at: the CSI volume (from its PV or inline spec) and
//! the CSI node ID of its node.

use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;

use super::Ctx;
use crate::volume::{self, CsiVolume};

impl Ctx {
    /// The PV name (if any) and the CSI volume of `va`.
    pub(super) async fn volume_of(
        &self,
        va: &VolumeAttachment,
    ) -> Result<(Option<String>, CsiVolume), String> {
        let src = &va.spec.source;
        if let Some(pv_name) = &src.persistent_volume_name {
            let pv = match self.pvs.get_opt(pv_name).await {
                Ok(Some(pv)) => pv,
                Ok(None) => return Err(format!("PersistentVolume {pv_name} not found")),
                Err(e) => return Err(format!("reading PersistentVolume {pv_name}: {e}")),
            };
            let spec = pv.spec.unwrap_or_default();
            let v = volume::csi_volume(&spec, &self.driver)
                .map_err(|e| format!("PersistentVolume {pv_name}: {e}"))?;
            Ok((Some(pv_name.clone()), v))
        } else if let Some(spec) = &src.inline_volume_spec {
            let v = volume::csi_volume(spec, &self.driver)
                .map_err(|e| format!("inline volume: {e}"))?;
            Ok((None, v))
        } else {
            Err("spec.source names neither a PersistentVolume nor an inline volume".into())
        }
    }

    /// The CSI node ID of `node`: CSINode first, then the Node annotation.
    pub(super) async fn node_id(&self, node: &str) -> Result<String, String> {
        if let Some(cn) = self
            .csinodes
            .get_opt(node)
            .await
            .map_err(|e| format!("reading CSINode {node}: {e}"))?
        {
            if let Some(id) = volume::node_id_from_csinode(&cn, &self.driver) {
                return Ok(id);
            }
        }
        if let Some(n) = self
            .nodes
            .get_opt(node)
            .await
            .map_err(|e| format!("reading Node {node}: {e}"))?
        {
            if let Some(id) = volume::node_id_from_annotation(&n, &self.driver) {
                return Ok(id);
            }
        }
        Err(format!(
            "node {node} has no CSI node ID for driver {}: neither its CSINode nor its Node annotation names it (is the node plugin registered?)",
            self.driver
        ))
    }
}
