//! Whether a detach sends `fence = true`: the configured [`FencePolicy`], what the
//! plugin can do and, under `auto`, whether the node may still be writing.

use super::{Ctx, ReconcileError};
use crate::config::FencePolicy;
use crate::csi::Capabilities;
use crate::volume;

impl Ctx {
    /// Whether to send `fence = true`, and why.
    pub(super) async fn fence_decision(
        &self,
        node: &str,
        handle: &str,
        caps: Capabilities,
    ) -> Result<(bool, String), ReconcileError> {
        match self.cfg.fence {
            FencePolicy::Never => Ok((false, "the fence policy is never".into())),
            FencePolicy::Always if caps.unpublish_fence => {
                Ok((true, "the fence policy is always".into()))
            }
            FencePolicy::Always => {
                tracing::warn!(node, volume = handle, "fence policy is always but the plugin does not advertise UNPUBLISH_FENCE: detaching without a fence");
                Ok((false, "the plugin cannot fence".into()))
            }
            FencePolicy::Auto if !caps.unpublish_fence => {
                Ok((false, "the plugin cannot fence".into()))
            }
            FencePolicy::Auto => {
                let n = self.nodes.get_opt(node).await.map_err(|e| {
                    ReconcileError::kube(format!("reading Node {node} to decide on a fence"), e)
                })?;
                Ok(
                    match volume::node_may_be_writing(n.as_ref(), &self.driver, handle) {
                        Some(why) => (true, why),
                        None => (
                            false,
                            "the node is Ready and does not use the volume".into(),
                        ),
                    },
                )
            }
        }
    }
}
