//! The CSI Controller service, a file per area: CreateVolume (`create`), the other
//! volume RPCs (`volumes`), GetCapacity and the capacity policy (`capacity`),
//! ControllerExpandVolume (`expand`), ControllerModifyVolume (`modify`),
//! ControllerPublish/UnpublishVolume (`publish`) with the fence policy
//! (`fence_policy`) and garbage collection (`gc`), snapshots (`snapshots`,
//! frozen copies in `quiesce` and `freeze_record`); and the GroupController
//! service (`group`: volume group snapshots). Every RPC runs its blocking
//! work (files, ioctls, clones) off the async runtime and holds the volume's
//! in-flight lock, so concurrent calls for one volume get ABORTED.

mod capacity;
mod create;
mod expand;
mod fence_policy;
mod freeze_record;
mod gc;
mod group;
mod leftovers;
pub mod modify;
pub mod publish;
mod quiesce;
mod snapshots;
mod volumes;

use std::sync::Arc;

use fencecsi_proto::v1::controller_server::Controller as CsiController;
use fencecsi_proto::v1::controller_service_capability::{
    rpc::Type as RpcType, Rpc, Type as CapType,
};
use fencecsi_proto::v1::*;
use tonic::{Request, Response, Status};

use crate::backend::image::ImageBackend;
use crate::backend::meta::MetaStore;
use crate::backend::Backend;
use crate::config::Config;
use crate::error::{CsiError, CsiResult};
use crate::ids::{Parsed, VolumeId};
use crate::locks::InFlight;
use crate::rpc::blocking;
use crate::terms::topology_of;

pub use group::GroupControllerService;
pub use quiesce::FP_COPYING;

pub struct Controller {
    /// Held until [`Controller::release_ownership`] and until every call that
    /// holds a clone ended: one controller per state dir.
    owner: std::sync::Mutex<Option<Arc<crate::locks::OwnerLock>>>,
    pub(crate) cfg: Config,
    pub(crate) store: MetaStore,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) inflight: InFlight,
    /// The state dir's identity; its topology value is what volumes are accessible from.
    pub(crate) state_id: crate::state_id::StateId,
    /// What the start-up probe of the fence on the state dir found: Err
    /// says why the fence is not offered (UNPUBLISH_FENCE not advertised,
    /// fence requests answered FAILED_PRECONDITION).
    pub(crate) fence: Result<crate::fence::ProbeReport, String>,
    /// Time to make each fence (the probe's not counted), served as `fence_seconds`.
    pub(crate) fence_metrics: crate::metrics::FenceMetrics,
    /// Generations that could not be fenced again, already logged at error level.
    unfenceable_reported: std::sync::Mutex<std::collections::HashSet<(String, u64)>>,
    /// Set when the controller gives up the state dir ([`Controller::give_up_freezes`]).
    /// Every FIFREEZE runs under the read side, so the write side waits for one
    /// that started and keeps later ones out.
    pub(crate) giving_up: std::sync::RwLock<bool>,
}

impl Controller {
    /// Opens the state dir, refused while another controller owns it.
    pub fn open(cfg: Config) -> std::io::Result<Arc<Self>> {
        Self::open_claiming(cfg, crate::locks::Claim::default())
    }

    /// Opens the state dir, taking it from a former owner as `claim` says (leader election).
    pub fn open_claiming(cfg: Config, claim: crate::locks::Claim) -> std::io::Result<Arc<Self>> {
        std::fs::create_dir_all(&cfg.state_dir)?;
        let owner = crate::locks::OwnerLock::acquire(&cfg.state_dir, claim)?;
        tracing::info!(
            generation = owner.generation,
            kill_switch = owner.armed(),
            "state dir owned"
        );
        // Before anything else: a freeze a dead controller left blocks the volume's writers.
        if owner.predecessor == crate::locks::Predecessor::KilledButHolding {
            // Its locks outlive it until it thaws, and it will never act on them.
            crate::locks::RecordsLock::forget_holder(&cfg.state_dir)?;
            freeze_record::thaw_leftovers_of_a_killed_owner(&cfg.state_dir);
        } else {
            freeze_record::thaw_leftovers(&cfg.state_dir, true);
        }
        let (state_id, made) = crate::state_id::ensure(&cfg.state_dir, &cfg.boot_id_file)
            .map_err(std::io::Error::other)?;
        if made {
            tracing::info!(state_dir = %cfg.state_dir.display(), id = %state_id.id, topology = %state_id.topology, "state dir identity made");
        }
        let backend = ImageBackend::new(&cfg.state_dir)
            .map_err(std::io::Error::other)?
            .with_fence_settle(cfg.fence_settle);
        let store = MetaStore::open(&cfg.state_dir)?;
        tracing::info!(state_dir = %cfg.state_dir.display(), volumes = store.volumes().len(), "controller state loaded");
        leftovers::clean(&cfg.state_dir, &store);
        group::clean_leftovers(&cfg.state_dir, &store, &backend);
        let fence = crate::fence::probe(&cfg.state_dir);
        match &fence {
            Ok(p) => {
                tracing::info!(filesystem = %p.filesystem, ms = p.elapsed.as_secs_f64() * 1e3, "fence proven on the state dir (write, discard, write-zeroes refused after the fence; buffered and direct-I/O loop devices)")
            }
            Err(why) => {
                tracing::error!(state_dir = %cfg.state_dir.display(), filesystem = %crate::fence::fs_name(&cfg.state_dir), reason = %why, "fence NOT available: UNPUBLISH_FENCE is not advertised and fence requests will be refused")
            }
        }
        let c = Arc::new(Controller {
            owner: std::sync::Mutex::new(Some(Arc::new(owner))),
            cfg,
            store,
            backend: Arc::new(backend),
            inflight: InFlight::new(),
            state_id,
            fence,
            fence_metrics: Default::default(),
            unfenceable_reported: Default::default(),
            giving_up: Default::default(),
        });
        // Before anything is served: generations an older driver fenced with
        // the immutable flag alone may still be written through their holders.
        let refenced = c.complete_fences();
        if refenced > 0 {
            tracing::warn!(
                generations = refenced,
                "fenced generations whose holders could still write were fenced again at start-up"
            );
        }
        Ok(c)
    }

    /// Lets a successor open the state dir once no call runs any more. Called by the server
    /// once it has stopped serving: its connection tasks may keep this object alive a little
    /// longer, and a successor must not be refused because of them. But a call whose client
    /// gave up is no longer "in flight" for the server while its body still runs and will
    /// write records: it holds its own reference ([`Controller::hold_ownership`]), so the
    /// lock is let go only when the last such body returns.
    pub fn release_ownership(&self) {
        self.owner.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// A reference to the ownership lock for the length of one call; UNAVAILABLE once the
    /// controller is stopping (a successor may be about to take the state dir).
    pub(crate) fn hold_ownership(&self) -> CsiResult<Arc<crate::locks::OwnerLock>> {
        self.owner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                CsiError::Unavailable(
                    "the controller plugin is stopping: no new call is started".into(),
                )
            })
    }

    pub(crate) fn fence_available(&self) -> bool {
        self.fence.is_ok()
    }

    pub(crate) fn fence_unavailable_reason(&self) -> String {
        match &self.fence {
            Ok(_) => String::new(),
            Err(why) => format!("the start-up probe on the state dir failed: {why}"),
        }
    }

    pub(crate) fn topology(&self) -> Topology {
        topology_of(&self.state_id.topology)
    }

    /// A client's volume ID that must name an existing volume of ours.
    pub(crate) fn existing_volume(
        &self,
        raw: &str,
    ) -> CsiResult<(VolumeId, crate::backend::meta::VolumeMeta)> {
        match VolumeId::parse(raw)? {
            Parsed::Ours(id) => match self.store.volume(&id) {
                Some(v) => Ok((id, v)),
                None => Err(CsiError::NotFound(format!("volume {raw} does not exist"))),
            },
            Parsed::Foreign => Err(CsiError::NotFound(format!("volume {raw} does not exist"))),
        }
    }

    pub(crate) fn persist(&self, v: &crate::backend::meta::VolumeMeta) -> CsiResult<()> {
        self.store
            .put_volume(v)
            .map_err(|e| record_error("writing volume metadata", e))
    }

    pub(crate) fn capabilities(extensions: bool, fence: bool) -> Vec<ControllerServiceCapability> {
        [
            RpcType::CreateDeleteVolume,
            RpcType::PublishUnpublishVolume,
            RpcType::ListVolumes,
            RpcType::GetCapacity,
            RpcType::CreateDeleteSnapshot,
            RpcType::ListSnapshots,
            RpcType::CloneVolume,
            RpcType::PublishReadonly,
            RpcType::ExpandVolume,
            RpcType::ListVolumesPublishedNodes,
            RpcType::VolumeCondition,
            RpcType::GetVolume,
            RpcType::SingleNodeMultiWriter,
            RpcType::ModifyVolume,
            RpcType::UnpublishFence,
        ]
        .into_iter()
        .filter(|t| (extensions && fence) || *t != RpcType::UnpublishFence)
        .map(|t| ControllerServiceCapability {
            r#type: Some(CapType::Rpc(Rpc { r#type: t as i32 })),
        })
        .collect()
    }
}

/// A record write refused because another controller wrote the record since
/// is ABORTED (and logged: two controllers on one state dir should never be);
/// any other failure INTERNAL.
pub(crate) fn record_error(what: &str, e: crate::backend::meta::RecordError) -> CsiError {
    match e {
        e @ crate::backend::meta::RecordError::Stale { .. } => {
            tracing::error!(error = %e, "a record write was refused: another controller plugin writes this state dir");
            CsiError::Aborted(e.to_string())
        }
        e => CsiError::internal(what, e),
    }
}

/// The tonic-facing wrapper.
#[derive(Clone)]
pub struct ControllerService(pub Arc<Controller>);

impl ControllerService {
    async fn call<T: Send + 'static>(
        &self,
        rpc: &'static str,
        f: impl FnOnce(&Controller) -> CsiResult<T> + Send + 'static,
    ) -> Result<Response<T>, Status> {
        owned_call(&self.0, rpc, f).await
    }
}

/// Runs a controller RPC's body (controller and group controller services) on the
/// blocking pool, holding the state dir's ownership lock for as long as the body runs
/// (see [`Controller::hold_ownership`]).
pub(crate) async fn owned_call<T: Send + 'static>(
    c: &Arc<Controller>,
    rpc: &'static str,
    f: impl FnOnce(&Controller) -> CsiResult<T> + Send + 'static,
) -> Result<Response<T>, Status> {
    let c = c.clone();
    blocking(rpc, move || {
        let _owner = c.hold_ownership()?;
        f(&c)
    })
    .await
}

#[tonic::async_trait]
impl CsiController for ControllerService {
    async fn create_volume(
        &self,
        r: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        self.call("CreateVolume", move |c| c.create_volume(r.into_inner()))
            .await
    }
    async fn delete_volume(
        &self,
        r: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        self.call("DeleteVolume", move |c| c.delete_volume(r.into_inner()))
            .await
    }
    async fn controller_publish_volume(
        &self,
        r: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        self.call("ControllerPublishVolume", move |c| {
            c.controller_publish_volume(r.into_inner())
        })
        .await
    }
    async fn controller_unpublish_volume(
        &self,
        r: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        self.call("ControllerUnpublishVolume", move |c| {
            c.controller_unpublish_volume(r.into_inner())
        })
        .await
    }
    async fn validate_volume_capabilities(
        &self,
        r: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        self.call("ValidateVolumeCapabilities", move |c| {
            c.validate_volume_capabilities(r.into_inner())
        })
        .await
    }
    async fn list_volumes(
        &self,
        r: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        self.call("ListVolumes", move |c| c.list_volumes(r.into_inner()))
            .await
    }
    async fn get_capacity(
        &self,
        r: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        self.call("GetCapacity", move |c| c.get_capacity(r.into_inner()))
            .await
    }
    async fn controller_get_capabilities(
        &self,
        r: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        let ext = self.0.cfg.advertise_extensions.shown(r.metadata());
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities: Controller::capabilities(ext, self.0.fence_available()),
        }))
    }
    async fn create_snapshot(
        &self,
        r: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        self.call("CreateSnapshot", move |c| c.create_snapshot(r.into_inner()))
            .await
    }
    async fn delete_snapshot(
        &self,
        r: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        self.call("DeleteSnapshot", move |c| c.delete_snapshot(r.into_inner()))
            .await
    }
    async fn list_snapshots(
        &self,
        r: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        self.call("ListSnapshots", move |c| c.list_snapshots(r.into_inner()))
            .await
    }
    async fn controller_expand_volume(
        &self,
        r: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        self.call("ControllerExpandVolume", move |c| {
            c.controller_expand_volume(r.into_inner())
        })
        .await
    }
    async fn controller_get_volume(
        &self,
        r: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        self.call("ControllerGetVolume", move |c| {
            c.controller_get_volume(r.into_inner())
        })
        .await
    }
    async fn controller_modify_volume(
        &self,
        r: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        self.call("ControllerModifyVolume", move |c| {
            c.controller_modify_volume(r.into_inner())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;

    /// A controller's configuration with everything below `dir`.
    fn controller_config(dir: &std::path::Path) -> Config {
        Config::local(
            Mode::Controller,
            None,
            dir.join("state"),
            dir.join("kubelet"),
            dir.join("c.sock"),
        )
    }

    #[test]
    fn one_controller_per_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = controller_config(dir.path());
        let first = Controller::open(cfg.clone()).unwrap();
        let err = Controller::open(cfg.clone())
            .err()
            .expect("a second controller must be refused");
        assert!(
            err.to_string()
                .contains("owned by another running controller plugin"),
            "{err}"
        );
        drop(first);
        Controller::open(cfg).expect("free again once the first one is gone");
    }

    /// A call whose client gave up still runs, and will write records: the
    /// state dir stays owned until it returns, even after the server let go.
    #[test]
    fn a_running_call_keeps_the_state_dir_owned_after_release() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = controller_config(dir.path());
        let first = Controller::open(cfg.clone()).unwrap();
        let call = first.hold_ownership().expect("a call while serving");
        first.release_ownership();
        assert!(
            matches!(first.hold_ownership(), Err(CsiError::Unavailable(_))),
            "no new call once stopping"
        );
        let err = Controller::open(cfg.clone())
            .err()
            .expect("refused while the call runs");
        assert!(err.to_string().contains("owned by another"), "{err}");
        drop(call);
        // Control: the same successor opens once the call returned, with the
        // first controller object still alive (connection tasks may keep it).
        let _second = Controller::open(cfg).expect("free once the last call returned");
        drop(first);
    }
}
