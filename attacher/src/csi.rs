//! The CSI calls the attacher makes, each bounded by the per-call timeout.
//!
//! The channel is lazy (`connect_lazy`): it dials the socket on first use and again after
//! the plugin went away, so a restarted plugin is picked up without restarting the
//! attacher. A call that fails meanwhile (UNAVAILABLE) is an ordinary failure: the worker
//! records it and the object is retried with backoff.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use fencecsi_proto::client::{connect_lazy, CsiClient};
use fencecsi_proto::v1::controller_service_capability::rpc::Type as RpcType;
use fencecsi_proto::v1::controller_service_capability::Type as CapType;
use fencecsi_proto::v1::*;
use tonic::{Code, Status};

/// What the controller plugin can do, from ControllerGetCapabilities.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    pub publish_unpublish: bool,
    pub unpublish_fence: bool,
    /// LIST_VOLUMES with LIST_VOLUMES_PUBLISHED_NODES: the plugin can say where each
    /// volume is published, so attachments can be checked against it.
    pub list_published: bool,
}

#[derive(Clone)]
pub(crate) struct Csi {
    client: CsiClient,
    timeout: Duration,
}

impl Csi {
    pub(crate) fn new(socket: &Path, timeout: Duration) -> Self {
        Csi {
            client: CsiClient::new(connect_lazy(socket)),
            timeout,
        }
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        // Say we understand the fence extensions: plugins show
        // UNPUBLISH_FENCE only to callers that do.
        let mut r = fencecsi_proto::client::with_extensions(msg);
        r.set_timeout(self.timeout);
        r
    }

    async fn bounded<T>(
        &self,
        rpc: &str,
        fut: impl std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    ) -> Result<T, Status> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map(tonic::Response::into_inner),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "{rpc} did not answer within {:?}",
                self.timeout
            ))),
        }
    }

    pub(crate) async fn plugin_name(&self) -> Result<String, Status> {
        let mut c = self.client.identity.clone();
        let r = self
            .bounded(
                "GetPluginInfo",
                c.get_plugin_info(self.request(GetPluginInfoRequest {})),
            )
            .await?;
        if r.name.is_empty() {
            return Err(Status::internal(
                "GetPluginInfo returned an empty driver name",
            ));
        }
        Ok(r.name)
    }

    /// Whether the plugin answers Probe and says it is ready (an answer without
    /// `ready` is ready, as the spec says).
    pub(crate) async fn ready(&self) -> Result<(), Status> {
        let mut c = self.client.identity.clone();
        let r = self
            .bounded("Probe", c.probe(self.request(ProbeRequest {})))
            .await?;
        match r.ready {
            Some(false) => Err(Status::unavailable("Probe: not ready")),
            _ => Ok(()),
        }
    }

    pub(crate) async fn capabilities(&self) -> Result<Capabilities, Status> {
        let mut c = self.client.controller.clone();
        let r = match self
            .bounded(
                "ControllerGetCapabilities",
                c.controller_get_capabilities(self.request(ControllerGetCapabilitiesRequest {})),
            )
            .await
        {
            Ok(r) => r,
            // A plugin without a controller service attaches nothing.
            Err(s) if s.code() == Code::Unimplemented => return Ok(Capabilities::default()),
            Err(s) => return Err(s),
        };
        let mut caps = Capabilities::default();
        let (mut list, mut published) = (false, false);
        for cap in r.capabilities {
            if let Some(CapType::Rpc(rpc)) = cap.r#type {
                match RpcType::try_from(rpc.r#type) {
                    Ok(RpcType::PublishUnpublishVolume) => caps.publish_unpublish = true,
                    Ok(RpcType::UnpublishFence) => caps.unpublish_fence = true,
                    Ok(RpcType::ListVolumes) => list = true,
                    Ok(RpcType::ListVolumesPublishedNodes) => published = true,
                    _ => {}
                }
            }
        }
        caps.list_published = list && published;
        Ok(caps)
    }

    pub(crate) async fn publish(
        &self,
        req: ControllerPublishVolumeRequest,
    ) -> Result<HashMap<String, String>, Status> {
        let mut c = self.client.controller.clone();
        Ok(self
            .bounded(
                "ControllerPublishVolume",
                c.controller_publish_volume(self.request(req)),
            )
            .await?
            .publish_context)
    }

    /// Every volume the plugin knows, with the IDs of the nodes it is published to (all
    /// pages of ListVolumes).
    pub(crate) async fn published_nodes(
        &self,
    ) -> Result<HashMap<String, std::collections::HashSet<String>>, Status> {
        let mut out = HashMap::new();
        let mut token = String::new();
        loop {
            let mut c = self.client.controller.clone();
            let r = self
                .bounded(
                    "ListVolumes",
                    c.list_volumes(self.request(ListVolumesRequest {
                        max_entries: 500,
                        starting_token: token.clone(),
                    })),
                )
                .await?;
            for e in r.entries {
                let Some(v) = e.volume else { continue };
                let nodes = e.status.map(|s| s.published_node_ids).unwrap_or_default();
                out.insert(v.volume_id, nodes.into_iter().collect());
            }
            if r.next_token.is_empty() {
                return Ok(out);
            }
            token = r.next_token;
        }
    }

    pub(crate) async fn unpublish(
        &self,
        req: ControllerUnpublishVolumeRequest,
    ) -> Result<(), Status> {
        let mut c = self.client.controller.clone();
        self.bounded(
            "ControllerUnpublishVolume",
            c.controller_unpublish_volume(self.request(req)),
        )
        .await
        .map(|_| ())
    }
}
