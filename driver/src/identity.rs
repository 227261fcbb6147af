//! The CSI Identity service.

use fencecsi_proto::v1::identity_server::Identity;
use fencecsi_proto::v1::plugin_capability::{
    service::Type as ServiceType, volume_expansion::Type as ExpansionType, Service, Type,
    VolumeExpansion,
};
use fencecsi_proto::v1::*;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::config::Config;
use crate::node::state_guard::StateGuard;

pub struct IdentityService {
    name: String,
    controller: bool,
    /// The node plugin's state dir check (node modes).
    state_guard: Option<Arc<StateGuard>>,
}

impl IdentityService {
    pub fn new(cfg: &Config, state_guard: Option<Arc<StateGuard>>) -> Self {
        Self {
            name: cfg.driver_name.clone(),
            controller: cfg.mode.controller(),
            state_guard,
        }
    }
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _r: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: [(
                "csi-spec".to_string(),
                fencecsi_proto::CSI_SPEC_VERSION.to_string(),
            )]
            .into(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _r: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        let mut caps = vec![
            PluginCapability {
                r#type: Some(Type::Service(Service {
                    r#type: ServiceType::VolumeAccessibilityConstraints as i32,
                })),
            },
            PluginCapability {
                r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                    r#type: ExpansionType::Online as i32,
                })),
            },
        ];
        if self.controller {
            caps.insert(
                0,
                PluginCapability {
                    r#type: Some(Type::Service(Service {
                        r#type: ServiceType::ControllerService as i32,
                    })),
                },
            );
            // Served with the controller (volume group snapshots, see controller::group).
            caps.push(PluginCapability {
                r#type: Some(Type::Service(Service {
                    r#type: ServiceType::GroupControllerService as i32,
                })),
            });
        }
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: caps,
        }))
    }

    /// Not ready while node recovery refuses to act on a state dir that looks wrong: the
    /// liveness probe then fails, which shows the fault on the pod (events, restarts) and a
    /// restart checks again. Nothing is unmounted either way.
    async fn probe(&self, _r: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        let refused = self.state_guard.as_ref().and_then(|g| g.refusal());
        if let Some(why) = &refused {
            tracing::debug!(reason = %why, "Probe: not ready");
        }
        Ok(Response::new(ProbeResponse {
            ready: Some(refused.is_none()),
        }))
    }
}
