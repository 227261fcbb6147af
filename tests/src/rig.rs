//! A controller plugin plus several node plugins, each node with its own
//! kubelet-like dir, all in this process, sharing one state dir and kernel:
//! the topology the fence is built for. Helpers drive a volume through the
//! same RPC sequence a CO uses.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use fencecsi_driver::config::Mode;
use fencecsi_proto::client::CsiClient;
use tonic::Status;

use crate::{csi, Env, InProcess};

/// Calls `f` again while it answers ABORTED (another operation on the same
/// volume, e.g. the controller's garbage collection, is in flight): what a
/// CO does with that code.
pub async fn retry_aborted<T, F, Fut>(mut f: F) -> Result<T, Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Status>>,
{
    let mut tries = 0;
    loop {
        match f().await {
            Err(e) if e.code() == tonic::Code::Aborted && tries < 100 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
}

pub struct Rig {
    pub controller: CsiClient,
    pub nodes: HashMap<String, CsiClient>,
    plugins: Vec<InProcess>,
    /// Whether `plugins[0]` is the controller (not with [`Rig::start_nodes`]).
    own_controller: bool,
}

/// Where a volume is staged and published on one node.
#[derive(Debug, Clone)]
pub struct Placement {
    pub node: String,
    pub volume_id: String,
    pub staging: PathBuf,
    pub target: PathBuf,
    pub cap: csi::VolumeCapability,
    pub publish_context: HashMap<String, String>,
}

impl Placement {
    /// The generation this placement was published on.
    pub fn generation(&self) -> u64 {
        self.publish_context[fencecsi_driver::terms::CTX_GENERATION]
            .parse()
            .unwrap()
    }
}

impl Rig {
    /// Starts a controller (in its own process-local server) and one node
    /// plugin per name.
    pub async fn start(env: &Env, nodes: &[&str]) -> Rig {
        Self::start_with(env, nodes, |_| {}).await
    }

    /// As [`Rig::start`], with each plugin's configuration adjusted first.
    pub async fn start_with(
        env: &Env,
        nodes: &[&str],
        tweak: impl Fn(&mut fencecsi_driver::config::Config),
    ) -> Rig {
        let mut plugins = Vec::new();
        let mut cfg = env.config(Mode::Controller, None, "controller");
        tweak(&mut cfg);
        let (p, controller) = InProcess::start(cfg).await;
        plugins.push(p);
        let (nodes, node_plugins) = Self::node_plugins(env, nodes, &tweak).await;
        plugins.extend(node_plugins);
        Rig {
            controller,
            nodes,
            plugins,
            own_controller: true,
        }
    }

    /// One node plugin in this process per name, each configuration adjusted first.
    async fn node_plugins(
        env: &Env,
        nodes: &[&str],
        tweak: &dyn Fn(&mut fencecsi_driver::config::Config),
    ) -> (HashMap<String, CsiClient>, Vec<InProcess>) {
        let mut plugins = Vec::new();
        let mut clients = HashMap::new();
        for n in nodes {
            let mut cfg = env.config(Mode::Node, Some(n), &format!("node-{n}"));
            tweak(&mut cfg);
            let (p, c) = InProcess::start(cfg).await;
            plugins.push(p);
            clients.insert(n.to_string(), c);
        }
        (clients, plugins)
    }

    /// Node plugins in this process for `nodes`, with a controller served
    /// elsewhere (say, a driver process a test kills and restarts: it sets
    /// [`Rig::controller`] to the new one's client itself).
    pub async fn start_nodes(env: &Env, nodes: &[&str], controller: CsiClient) -> Rig {
        let (nodes, plugins) = Self::node_plugins(env, nodes, &|_| {}).await;
        Rig {
            controller,
            nodes,
            plugins,
            own_controller: false,
        }
    }

    /// Stops the controller plugin and starts a new one on the same state
    /// dir, as a crash or an upgrade would.
    pub async fn restart_controller(&mut self, env: &Env) {
        assert!(self.own_controller, "this rig's controller runs elsewhere");
        let old = self.plugins.remove(0);
        old.stop().await;
        let (p, controller) =
            InProcess::start(env.config(Mode::Controller, None, "controller")).await;
        self.plugins.insert(0, p);
        self.controller = controller;
    }

    pub fn node(&self, n: &str) -> CsiClient {
        self.nodes[n].clone()
    }

    pub async fn create(&self, name: &str, size: i64, cap: &csi::VolumeCapability) -> csi::Volume {
        self.create_volume(create_request(name, size, cap))
            .await
            .expect("CreateVolume")
    }

    /// CreateVolume with `req` as given (a content source, a topology): the
    /// volume, or the error for the test to check.
    pub async fn create_volume(
        &self,
        req: csi::CreateVolumeRequest,
    ) -> Result<csi::Volume, Status> {
        self.controller
            .clone()
            .controller
            .create_volume(req)
            .await
            .map(|r| r.into_inner().volume.expect("volume in response"))
    }

    /// [`Rig::create`], then [`Rig::attach`] of the new volume: a volume in
    /// use on `node`, where most tests start.
    pub async fn create_attached(
        &self,
        env: &Env,
        name: &str,
        size: i64,
        cap: &csi::VolumeCapability,
        node: &str,
        pod: &str,
    ) -> (csi::Volume, Placement) {
        let vol = self.create(name, size, cap).await;
        let p = self
            .attach(env, &vol.volume_id, node, pod, cap)
            .await
            .expect("attaching the new volume");
        (vol, p)
    }

    /// ControllerPublish, NodeStage, NodePublish on `node`.
    pub async fn attach(
        &self,
        env: &Env,
        volume_id: &str,
        node: &str,
        pod: &str,
        cap: &csi::VolumeCapability,
    ) -> Result<Placement, Status> {
        let ctx = retry_aborted(|| {
            let mut c = self.controller.clone();
            let req = publish_request(volume_id, node, cap);
            async move { c.controller.controller_publish_volume(req).await }
        })
        .await?
        .into_inner()
        .publish_context;
        let staging = env.staging_path(node, volume_id);
        let target = env.target_path(node, pod, volume_id);
        std::fs::create_dir_all(target.parent().unwrap()).unwrap();
        let mut n = self.node(node);
        n.node
            .node_stage_volume(stage_request(volume_id, &staging, cap, &ctx))
            .await?;
        n.node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: volume_id.into(),
                publish_context: ctx.clone(),
                staging_target_path: staging.to_string_lossy().into(),
                target_path: target.to_string_lossy().into(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await?;
        Ok(Placement {
            node: node.into(),
            volume_id: volume_id.into(),
            staging,
            target,
            cap: cap.clone(),
            publish_context: ctx,
        })
    }

    /// ControllerPublish of `volume_id` to `node`, once (an ABORTED comes back as the
    /// answer, unlike in [`Rig::attach`]): the publish context.
    pub async fn publish(
        &self,
        volume_id: &str,
        node: &str,
        cap: &csi::VolumeCapability,
    ) -> Result<HashMap<String, String>, Status> {
        self.controller
            .clone()
            .controller
            .controller_publish_volume(publish_request(volume_id, node, cap))
            .await
            .map(|r| r.into_inner().publish_context)
    }

    /// NodeUnpublish and NodeUnstage (with or without force).
    pub async fn node_teardown(&self, p: &Placement, force: bool) -> Result<(), Status> {
        let mut n = self.node(&p.node);
        n.node
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: p.volume_id.clone(),
                target_path: p.target.to_string_lossy().into(),
                force,
            })
            .await?;
        n.node
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: p.volume_id.clone(),
                staging_target_path: p.staging.to_string_lossy().into(),
                force,
            })
            .await?;
        Ok(())
    }

    /// What a CO does when the pod is gone: NodeUnpublish, NodeUnstage and
    /// ControllerUnpublish of `p`, none forced or fenced.
    pub async fn detach(&self, p: &Placement) -> Result<(), Status> {
        self.node_teardown(p, false).await?;
        self.unpublish(&p.volume_id, &p.node, false).await
    }

    /// [`Rig::detach`], then DeleteVolume: the volume is gone.
    pub async fn detach_and_delete(&self, p: &Placement) -> Result<(), Status> {
        self.detach(p).await?;
        self.delete(&p.volume_id).await
    }

    pub async fn unpublish(&self, volume_id: &str, node: &str, fence: bool) -> Result<(), Status> {
        retry_aborted(|| {
            let mut c = self.controller.clone();
            let req = csi::ControllerUnpublishVolumeRequest {
                volume_id: volume_id.into(),
                node_id: node.into(),
                fence,
                ..Default::default()
            };
            async move { c.controller.controller_unpublish_volume(req).await }
        })
        .await
        .map(|_| ())
    }

    pub async fn delete(&self, volume_id: &str) -> Result<(), Status> {
        retry_aborted(|| {
            let mut c = self.controller.clone();
            let req = csi::DeleteVolumeRequest {
                volume_id: volume_id.into(),
                ..Default::default()
            };
            async move { c.controller.delete_volume(req).await }
        })
        .await
        .map(|_| ())
    }

    /// DeleteVolume, which must succeed: [`Rig::delete`] again, up to 100 rounds in all,
    /// while it answers ABORTED (the controller's garbage collection holds the volume).
    pub async fn delete_once_free(&self, volume_id: &str) {
        for _ in 0..100 {
            match self.delete(volume_id).await {
                Ok(()) => return,
                Err(e) if e.code() == tonic::Code::Aborted => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await
                }
                Err(e) => panic!("DeleteVolume: {e:?}"),
            }
        }
        panic!("DeleteVolume kept being aborted");
    }

    /// DeleteSnapshot of `snapshot_id`, which must succeed.
    pub async fn delete_snapshot(&self, snapshot_id: String) {
        self.controller
            .clone()
            .controller
            .delete_snapshot(csi::DeleteSnapshotRequest {
                snapshot_id,
                ..Default::default()
            })
            .await
            .unwrap();
    }

    /// ControllerGetVolume's status of `volume_id` (its condition, its nodes).
    pub async fn volume_status(
        &self,
        volume_id: &str,
    ) -> csi::controller_get_volume_response::VolumeStatus {
        self.controller
            .clone()
            .controller
            .controller_get_volume(csi::ControllerGetVolumeRequest {
                volume_id: volume_id.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap()
    }

    pub async fn stop(self) {
        for p in self.plugins {
            p.stop().await;
        }
    }
}

/// The IDs ListVolumes answers (one page).
pub async fn volume_ids(ctl: &mut CsiClient) -> std::collections::BTreeSet<String> {
    ctl.controller
        .list_volumes(csi::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .filter_map(|e| e.volume.map(|v| v.volume_id))
        .collect()
}

/// The CreateVolumeRequest fields every create sets: `size` bytes of `cap`.
/// Others (a content source, a topology) go in with `..create_request(..)`.
pub fn create_request(
    name: &str,
    size: i64,
    cap: &csi::VolumeCapability,
) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange {
            required_bytes: size,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap.clone()],
        ..Default::default()
    }
}

/// The ControllerPublishVolumeRequest of `volume_id` to `node` as `cap`.
pub fn publish_request(
    volume_id: &str,
    node: &str,
    cap: &csi::VolumeCapability,
) -> csi::ControllerPublishVolumeRequest {
    csi::ControllerPublishVolumeRequest {
        volume_id: volume_id.into(),
        node_id: node.into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    }
}

/// The NodeStageVolumeRequest a CO sends once `ctx` came back from
/// ControllerPublish.
pub fn stage_request(
    volume_id: &str,
    staging: &Path,
    cap: &csi::VolumeCapability,
    ctx: &HashMap<String, String>,
) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: volume_id.into(),
        publish_context: ctx.clone(),
        staging_target_path: staging.to_string_lossy().into(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    }
}

/// A content source: the snapshot `snapshot_id` (a restore).
pub fn from_snapshot(snapshot_id: &str) -> Option<csi::VolumeContentSource> {
    use csi::volume_content_source::{SnapshotSource, Type};
    Some(csi::VolumeContentSource {
        r#type: Some(Type::Snapshot(SnapshotSource {
            snapshot_id: snapshot_id.into(),
        })),
    })
}

/// A content source: the volume `volume_id` (a clone).
pub fn from_volume(volume_id: &str) -> Option<csi::VolumeContentSource> {
    use csi::volume_content_source::{Type, VolumeSource};
    Some(csi::VolumeContentSource {
        r#type: Some(Type::Volume(VolumeSource {
            volume_id: volume_id.into(),
        })),
    })
}

/// A small deterministic PRNG for randomised timing (seed printed by tests).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }
    pub fn from_env(var: &str) -> (Self, u64) {
        let seed = std::env::var(var)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        (Rng::new(seed), seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo).max(1)
    }
}

/// The driver binary [`fresh_driver_binary`] built, once it has.
static FAILPOINT_DRIVER: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

pub(crate) fn failpoint_driver() -> Option<PathBuf> {
    FAILPOINT_DRIVER.get().cloned()
}

/// Builds the driver binary with the `failpoints` feature once per test
/// process, so that tests running it (crash tests arm failpoints through
/// `FENCECSI_FAILPOINTS`) run the sources under test with the failpoints in:
/// `cargo test -p fencecsi-tests` does not build it by itself, and a plain
/// `cargo build` leaves the feature off. Returns its path, which
/// [`crate::driver_binary`] returns from then on.
///
/// Cargo puts the binary at target/debug/fencecsi-driver whatever its
/// features, so a `cargo build -p fencecsi-driver` running meanwhile replaces
/// it with one without failpoints: the build is hard-linked to a name of its
/// own, fencecsi-driver-failpoints, once it is seen to hold them.
pub fn fresh_driver_binary() -> PathBuf {
    FAILPOINT_DRIVER
        .get_or_init(|| {
            let dir = crate::bin_dir();
            let bin = dir.join("fencecsi-driver-failpoints");
            let tmp = dir.join(format!("fencecsi-driver-failpoints.{}", std::process::id()));
            for _ in 0..3 {
                let out = std::process::Command::new(env!("CARGO"))
                    .args(["build", "-p", "fencecsi-driver", "--bin", "fencecsi-driver"])
                    .args(["--features", "failpoints"])
                    .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
                    .output()
                    .expect("running cargo build");
                assert!(
                    out.status.success(),
                    "building fencecsi-driver failed:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let _ = std::fs::remove_file(&tmp);
                std::fs::hard_link(dir.join("fencecsi-driver"), &tmp)
                    .expect("linking the driver binary");
                let bytes = std::fs::read(&tmp).expect("reading the driver binary");
                // failpoint::ENV, which this library (also built without the
                // feature, for the drill) cannot name.
                if bytes_contain(&bytes, b"FENCECSI_FAILPOINTS") {
                    // A rename, not a copy: a copy onto a binary another test
                    // process runs would fail (ETXTBSY).
                    std::fs::rename(&tmp, &bin).expect("renaming the driver binary");
                    return bin;
                }
                let _ = std::fs::remove_file(&tmp);
            }
            panic!(
                "{} has no failpoints after 3 builds with them: another build without \
                 the feature keeps replacing it",
                dir.join("fencecsi-driver").display()
            )
        })
        .clone()
}

/// Whether `needle` occurs in `haystack`.
fn bytes_contain(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The NodeUnpublishVolumeRequest of `volume_id` at `target`, not forced.
pub fn unpublish_request(volume_id: &str, target: &Path) -> csi::NodeUnpublishVolumeRequest {
    csi::NodeUnpublishVolumeRequest {
        volume_id: volume_id.into(),
        target_path: target.to_string_lossy().into(),
        force: false,
    }
}

/// The NodeUnstageVolumeRequest of `volume_id` at `staging`, not forced.
pub fn unstage_request(volume_id: &str, staging: &Path) -> csi::NodeUnstageVolumeRequest {
    csi::NodeUnstageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into(),
        force: false,
    }
}

/// Asserts the gRPC outcome of a call (a future of a `Result<_, Status>`):
/// `Code::Ok` or the expected error code.
#[macro_export]
macro_rules! assert_code {
    ($call:expr, $code:expr) => {{
        let r = $call.await;
        let got = match &r {
            ::core::result::Result::Ok(_) => ::tonic::Code::Ok,
            ::core::result::Result::Err(s) => s.code(),
        };
        assert_eq!(
            got,
            $code,
            "{} -> {:?}",
            stringify!($call),
            r.as_ref().err().map(|s| s.message().to_string())
        );
    }};
}
