//! What a controller plugin serves while another replica leads (`--leader-election`).
//!
//! Every sidecar in a controller pod elects on a Lease of its own, so the sidecar that leads
//! may sit in a pod whose plugin stands by. A standby therefore forwards every controller
//! call to the leader, through the socket the leader serves in the state dir
//! (`locks::leader_socket`), which every replica sees on this one kernel. Its sidecars
//! then act through whichever plugin leads. It answers the Identity service and
//! ControllerGetCapabilities itself (its sidecars need them to start, with or without a
//! leader) and UNAVAILABLE while no leader answers: between leaders, or a leader that is
//! frozen (each call is bounded by [`FORWARD_BOUND`] and by its client's deadline).
//!
//! Each call dials the leader's socket anew, so a call after a takeover reaches the new
//! leader, never a connection to the old one.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fencecsi_proto::v1::controller_client::ControllerClient;
use fencecsi_proto::v1::controller_server::{Controller as CsiController, ControllerServer};
use fencecsi_proto::v1::identity_server::IdentityServer;
use fencecsi_proto::v1::*;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::config::Config;
use crate::controller::Controller;
use crate::identity::IdentityService;
use crate::socket::{bind, ServeError};

/// The longest a forwarded call waits for the leader, for a client that set no deadline.
pub const FORWARD_BOUND: Duration = Duration::from_secs(120);

/// The standby's server on `socket`, until `stopped` fires. Then the calls it still forwards
/// end at once with UNAVAILABLE (a frozen former leader would never answer them, and their
/// connections would keep the server from stopping), so the clients retry on this replica.
pub fn serve(
    cfg: &Config,
    socket: &Path,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> Result<tokio::task::JoinHandle<Result<(), ServeError>>, ServeError> {
    let listener = bind(socket)?;
    let (cut, cut_off) = tokio::sync::watch::channel(false);
    let router = tonic::transport::Server::builder()
        .add_service(IdentityServer::new(IdentityService::new(cfg, None)))
        .add_service(ControllerServer::new(ForwardingController {
            extensions: cfg.advertise_extensions,
            leader: crate::locks::leader_socket(&cfg.state_dir),
            cut_off,
        }));
    Ok(tokio::spawn(async move {
        router
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                let _ = stopped.await;
                let _ = cut.send(true);
            })
            .await
            .map_err(ServeError::from)
    }))
}

/// The controller service of a standby: capabilities answered here (the fence assumed, since
/// only the owner of the state dir may probe it: a leader whose probe fails refuses fence
/// requests with FAILED_PRECONDITION, the safe side), everything else forwarded.
struct ForwardingController {
    extensions: crate::config::Extensions,
    leader: PathBuf,
    /// True once this replica stops standing by.
    cut_off: tokio::sync::watch::Receiver<bool>,
}

impl ForwardingController {
    /// Sends `request` (its metadata too: the extension header, the deadline) to the leader.
    async fn forward<Req, Resp, F, Fut>(
        &self,
        request: Request<Req>,
        call: F,
    ) -> Result<Response<Resp>, Status>
    where
        F: FnOnce(ControllerClient<Channel>, Request<Req>) -> Fut,
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let unavailable = |why: String| {
            Status::unavailable(format!(
                "this controller plugin is a standby (another replica leads), and the leader's socket {} {why}",
                self.leader.display()
            ))
        };
        let forwarded = async {
            let channel = fencecsi_proto::client::connect(&self.leader)
                .await
                .map_err(|e| unavailable(format!("does not answer: {e}")))?;
            let (metadata, _, message) = request.into_parts();
            let request = Request::from_parts(metadata, Default::default(), message);
            call(ControllerClient::new(channel), request).await
        };
        let mut cut_off = self.cut_off.clone();
        tokio::select! {
            answered = tokio::time::timeout(FORWARD_BOUND, forwarded) => answered
                .unwrap_or_else(|_| Err(unavailable(format!("did not answer in {FORWARD_BOUND:?}")))),
            _ = cut_off.wait_for(|cut| *cut) => Err(Status::unavailable(
                "this controller plugin stopped standing by (it leads now): retry",
            )),
        }
    }
}

/// The controller service with each listed method forwarded to the leader's of the same name
/// (one macro for the whole impl, so that `async_trait` sees the expanded methods).
macro_rules! forwarding_controller {
    ($($method:ident($req:ty) -> $resp:ty;)*) => {
        #[tonic::async_trait]
        impl CsiController for ForwardingController {
            async fn controller_get_capabilities(
                &self,
                r: Request<ControllerGetCapabilitiesRequest>,
            ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
                let ext = self.extensions.shown(r.metadata());
                Ok(Response::new(ControllerGetCapabilitiesResponse {
                    capabilities: Controller::capabilities(ext, true),
                }))
            }
            $(
                async fn $method(&self, r: Request<$req>) -> Result<Response<$resp>, Status> {
                    self.forward(r, |mut c, r| async move { c.$method(r).await }).await
                }
            )*
        }
    };
}

forwarding_controller! {
    create_volume(CreateVolumeRequest) -> CreateVolumeResponse;
    delete_volume(DeleteVolumeRequest) -> DeleteVolumeResponse;
    controller_publish_volume(ControllerPublishVolumeRequest) -> ControllerPublishVolumeResponse;
    controller_unpublish_volume(ControllerUnpublishVolumeRequest) -> ControllerUnpublishVolumeResponse;
    validate_volume_capabilities(ValidateVolumeCapabilitiesRequest) -> ValidateVolumeCapabilitiesResponse;
    list_volumes(ListVolumesRequest) -> ListVolumesResponse;
    get_capacity(GetCapacityRequest) -> GetCapacityResponse;
    create_snapshot(CreateSnapshotRequest) -> CreateSnapshotResponse;
    delete_snapshot(DeleteSnapshotRequest) -> DeleteSnapshotResponse;
    list_snapshots(ListSnapshotsRequest) -> ListSnapshotsResponse;
    controller_expand_volume(ControllerExpandVolumeRequest) -> ControllerExpandVolumeResponse;
    controller_get_volume(ControllerGetVolumeRequest) -> ControllerGetVolumeResponse;
    controller_modify_volume(ControllerModifyVolumeRequest) -> ControllerModifyVolumeResponse;
}
