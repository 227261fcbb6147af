//! The node plugin from the image, serving CSI on its socket (`--mode all`: one process
//! serves Identity, Controller and Node, as on a one-node cluster; the DaemonSet runs
//! `--mode node` beside a controller Deployment), and the checks made through it. Its
//! volumes are seen from the host on the kernel's objects: the loop devices backed by files
//! on the state filesystem (`losetup`), the mounts as the node sees them (the holder's
//! /proc/<pid>/mountinfo: they propagated back), the files in them (through the node's
//! /proc/<pid>/root) and the image files.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use fencecsi_driver::kernel::loop_gate::SHUT_LIMIT;
use fencecsi_e2e::image_run::NodeCtr;
use fencecsi_e2e::node::NodeSpec;
use fencecsi_e2e::process::sh;
use fencecsi_e2e::teardown::{Made, Teardown};
use fencecsi_e2e::{cgroups, say, wait};
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::{csi, mount_cap, region_hash, sha256_file, Access};

const NODE: &str = "e2e-image";
/// xfs needs 300 MiB at least.
const VOLUME_BYTES: i64 = 320 << 20;
/// Every CSI call and host-side check of one volume's round trip, together.
const ROUND_TRIP_BOUND: Duration = Duration::from_secs(300);
/// What the control write puts in each 4 KiB block: found in the image after the write,
/// and only then.
const CONTROL_BLOCK: &[u8; 32] = b"fencecsi image test control blk\n";

/// The plugin container and a client on its socket.
pub struct Plugin {
    rt: tokio::runtime::Runtime,
    csi: PluginCsi,
}

struct PluginCsi {
    client: CsiClient,
    /// The node's namespace holder: the node's view of the mounts.
    holder: i32,
    /// The node's kubelet dir on the host: /var/lib/kubelet in the node and the plugin.
    kubelet: PathBuf,
    state: PathBuf,
    state_dev: u64,
}

/// One volume, its paths as the plugin sees them.
struct Vol {
    id: String,
    bytes: u64,
    cap: csi::VolumeCapability,
    context: std::collections::HashMap<String, String>,
    staging: String,
    target: String,
}

impl Plugin {
    /// Starts fencecsi-driver from the image in cgroup `<cg>/plugin` and waits until it
    /// answers Probe on its socket.
    pub fn start(
        ctr: &NodeCtr,
        image: &str,
        spec: &NodeSpec,
        state: &Path,
        cg: &str,
        td: &Teardown,
    ) -> Result<Plugin> {
        let socket = spec.kubelet_dir().join("plugins/loop.fencecsi.io/csi.sock");
        std::fs::create_dir_all(socket.parent().unwrap())?;
        ctr.mount_image(image)?;
        let plugin_cg = format!("{cg}/plugin");
        td.record(Made::Cgroup {
            rel: plugin_cg.clone(),
        });
        let log = spec.dir.join("plugin.log");
        let argv = [
            "/usr/local/bin/fencecsi-driver",
            "--mode",
            "all",
            "--node-id",
            NODE,
            // No cluster here: nothing is fenced away from this node behind its back.
            "--recover-interval",
            "0",
        ];
        ctr.start_privileged("fencecsi-node-plugin", &plugin_cg, &log, &argv)?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let up = wait::until(
            "the plugin from the image to answer Probe",
            Duration::from_secs(60),
            Duration::from_millis(200),
            || {
                let Some(pid) = plugin_pid(&plugin_cg)? else {
                    return Ok(None);
                };
                let probe = async {
                    let mut c = CsiClient::connect(&socket).await?;
                    c.identity.probe(csi::ProbeRequest {}).await?;
                    anyhow::Ok(c)
                };
                let bounded = async { tokio::time::timeout(Duration::from_secs(10), probe).await };
                let c = rt.block_on(bounded)??;
                Ok(Some((pid, c)))
            },
        );
        let (pid, client) = up.map_err(|e| e.context(log_tail(&log)))?;
        say(format!(
            "image: fencecsi-driver from the image serves CSI on {} (pid {pid})",
            socket.display()
        ));
        Ok(Plugin {
            rt,
            csi: PluginCsi {
                client,
                holder: ctr.holder,
                kubelet: spec.kubelet_dir(),
                state: state.to_path_buf(),
                state_dev: std::fs::metadata(state)?.dev(),
            },
        })
    }

    /// For each filesystem: make a volume, stage, write, restage, read back, fence, clean
    /// up. Ends with no loop device left on the state filesystem.
    pub fn check_volumes(mut self, fs_types: &[&str]) -> Result<()> {
        for fs in fs_types {
            // The timer is made inside the runtime (it needs its reactor).
            let checks = async {
                tokio::time::timeout(ROUND_TRIP_BOUND, self.csi.round_trip_and_fence(fs)).await
            };
            self.rt
                .block_on(checks)
                .map_err(|_| anyhow::anyhow!("not done within {ROUND_TRIP_BOUND:?}"))
                .and_then(|r| r)
                .with_context(|| format!("{fs} volume through the plugin from the image"))?;
        }
        ensure!(
            self.csi.loop_devices()?.is_empty(),
            "loop devices left on the state filesystem: {:?}",
            self.csi.loop_devices()?
        );
        Ok(())
    }
}

impl PluginCsi {
    async fn round_trip_and_fence(&mut self, fs: &str) -> Result<()> {
        let vol = self.create_and_attach(fs).await?;
        self.stage_and_publish(&vol).await?;
        ensure!(
            self.loop_devices()?.len() == 1,
            "one loop device per staged volume"
        );
        let payload = self.in_node(&vol.target).join("payload.bin");
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        write_synced(&payload, &data)?;
        let written = sha256_file(&payload);
        self.unstage(&vol, false).await?;
        // The device goes when its last user closes it (autoclear).
        wait::until(
            "unstage to detach the loop device",
            Duration::from_secs(10),
            Duration::from_millis(50),
            || Ok(self.loop_devices()?.is_empty().then_some(())),
        )?;
        ensure!(
            !self.mounted(&vol.staging)? && !self.mounted(&vol.target)?,
            "unstage and unpublish unmounted, in the node too"
        );
        self.stage_and_publish(&vol).await?;
        ensure!(
            sha256_file(&payload) == written,
            "the data survived unstage and restage"
        );
        say(format!(
            "image: {fs} volume made, staged on a loop device, written, restaged intact"
        ));
        let (image, at_fence) = self.fence_and_check(&vol).await?;
        self.unstage(&vol, true).await?;
        ensure!(
            region_hash(&image, vol.bytes) == at_fence,
            "the image changed after the fence, by the time the node let go"
        );
        self.client
            .controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: vol.id.clone(),
                ..Default::default()
            })
            .await?;
        ensure!(
            !self.state.join("volumes").join(&vol.id).exists(),
            "DeleteVolume removed the volume's images"
        );
        Ok(())
    }

    async fn create_and_attach(&mut self, fs: &str) -> Result<Vol> {
        let cap = mount_cap(Access::SingleNodeWriter, fs);
        let created = self
            .client
            .controller
            .create_volume(csi::CreateVolumeRequest {
                name: format!("pvc-image-{fs}"),
                capacity_range: Some(csi::CapacityRange {
                    required_bytes: VOLUME_BYTES,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![cap.clone()],
                ..Default::default()
            })
            .await?
            .into_inner()
            .volume
            .context("CreateVolume answered no volume")?;
        let context = self
            .client
            .controller
            .controller_publish_volume(csi::ControllerPublishVolumeRequest {
                volume_id: created.volume_id.clone(),
                node_id: NODE.into(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await?
            .into_inner()
            .publish_context;
        let staging =
            format!("/var/lib/kubelet/plugins/kubernetes.io/csi/loop.fencecsi.io/{fs}/globalmount");
        let target =
            format!("/var/lib/kubelet/pods/pod-{fs}/volumes/kubernetes.io~csi/pv-{fs}/mount");
        // What the kubelet makes before it calls the plugin.
        for p in [&staging, &target] {
            std::fs::create_dir_all(self.on_host(p).parent().unwrap())?;
        }
        Ok(Vol {
            id: created.volume_id,
            bytes: created.capacity_bytes as u64,
            cap,
            context,
            staging,
            target,
        })
    }

    async fn stage_and_publish(&mut self, v: &Vol) -> Result<()> {
        self.client
            .node
            .node_stage_volume(csi::NodeStageVolumeRequest {
                volume_id: v.id.clone(),
                publish_context: v.context.clone(),
                staging_target_path: v.staging.clone(),
                volume_capability: Some(v.cap.clone()),
                ..Default::default()
            })
            .await?;
        self.client
            .node
            .node_publish_volume(csi::NodePublishVolumeRequest {
                volume_id: v.id.clone(),
                publish_context: v.context.clone(),
                staging_target_path: v.staging.clone(),
                target_path: v.target.clone(),
                volume_capability: Some(v.cap.clone()),
                ..Default::default()
            })
            .await?;
        ensure!(
            self.mounted(&v.staging)? && self.mounted(&v.target)?,
            "stage and publish mounted the volume, and the mounts reached the node"
        );
        Ok(())
    }

    async fn unstage(&mut self, v: &Vol, force: bool) -> Result<()> {
        self.client
            .node
            .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: v.id.clone(),
                target_path: v.target.clone(),
                force,
            })
            .await?;
        self.client
            .node
            .node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: v.id.clone(),
                staging_target_path: v.staging.clone(),
                force,
            })
            .await?;
        Ok(())
    }

    /// The fence, with its positive control: a write before it reaches the image, the
    /// fence shuts the gate (the loop device over the image, under the node's device) and
    /// moves its empty window into the trailer, a write after it fails and changes
    /// nothing. Returns the image and its data's hash at the fence.
    async fn fence_and_check(&mut self, v: &Vol) -> Result<(PathBuf, String)> {
        let image = self.generation_image(&v.id)?;
        let mounted_dir = self.in_node(&v.target);
        let control: Vec<u8> = CONTROL_BLOCK.repeat(4096 / CONTROL_BLOCK.len());
        ensure!(
            !holds_block(&image, v.bytes, &control)?,
            "the control block is in the image before it was written"
        );
        write_synced(&mounted_dir.join("before-fence"), &control.repeat(256))?;
        ensure!(
            holds_block(&image, v.bytes, &control)?,
            "control: a write before the fence reaches the image"
        );
        let [device_before] = <[_; 1]>::try_from(self.loop_devices()?)
            .map_err(|d| anyhow::anyhow!("one loop device expected: {d:?}"))?;
        self.client
            .controller
            .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
                volume_id: v.id.clone(),
                node_id: NODE.into(),
                fence: true,
                ..Default::default()
            })
            .await?;
        let at_fence = region_hash(&image, v.bytes);
        let late = write_synced(&mounted_dir.join("after-fence"), &vec![9u8; 1 << 20]);
        ensure!(late.is_err(), "a write after the fence must fail");
        ensure!(
            region_hash(&image, v.bytes) == at_fence,
            "the image changed after the fence returned"
        );
        let devices = self.loop_devices()?;
        ensure!(
            devices.iter().any(|d| d.name == device_before.name
                && d.window.0 >= v.bytes
                && d.window.1 == SHUT_LIMIT),
            "the fence shut the gate and moved its window into the trailer: before {device_before:?}, after {devices:?}"
        );
        say(format!(
            "image: fence held (gate {} shut, the late write failed: {})",
            device_before.name,
            late.unwrap_err()
        ));
        Ok((image, at_fence))
    }

    /// The volume's one generation image, on the host.
    fn generation_image(&self, id: &str) -> Result<PathBuf> {
        let dir = self.state.join("volumes").join(id);
        let mut gens: Vec<PathBuf> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let n = p.file_name().unwrap().to_string_lossy();
                n.starts_with("gen-") && n.ends_with(".img")
            })
            .collect();
        ensure!(
            gens.len() == 1,
            "one generation in {}: {gens:?}",
            dir.display()
        );
        Ok(gens.remove(0))
    }

    /// A path as the node sees it, through its root (and so its mounts).
    fn in_node(&self, path: &str) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{path}", self.holder))
    }

    /// A path below /var/lib/kubelet, in the host's view (the directory, not its mounts).
    fn on_host(&self, path: &str) -> PathBuf {
        self.kubelet
            .join(path.strip_prefix("/var/lib/kubelet/").unwrap())
    }

    fn mounted(&self, path: &str) -> Result<bool> {
        let info = std::fs::read_to_string(format!("/proc/{}/mountinfo", self.holder))?;
        Ok(info.lines().any(|l| l.split(' ').nth(4) == Some(path)))
    }

    /// Loop devices backed by a file on the state filesystem: the gates (the node's
    /// devices are stacked on them).
    fn loop_devices(&self) -> Result<Vec<LoopDevice>> {
        let out = sh(
            "losetup",
            &[
                "--list",
                "--json",
                "--output",
                "NAME,OFFSET,SIZELIMIT,BACK-MAJ:MIN",
            ],
        )?;
        if out.trim().is_empty() {
            return Ok(Vec::new());
        }
        let want = format!(
            "{}:{}",
            libc::major(self.state_dev),
            libc::minor(self.state_dev)
        );
        let v: serde_json::Value = serde_json::from_str(&out)?;
        Ok(v["loopdevices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| d["back-maj:min"].as_str().map(str::trim) == Some(want.as_str()))
            .map(|d| LoopDevice {
                name: d["name"].as_str().unwrap_or_default().to_string(),
                window: (number(&d["offset"]), number(&d["sizelimit"])),
            })
            .collect())
    }
}

#[derive(Debug)]
struct LoopDevice {
    name: String,
    /// (offset, size limit) into the backing file.
    window: (u64, u64),
}

/// losetup prints numbers as JSON numbers or strings, depending on its version.
fn number(v: &serde_json::Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
        .unwrap_or(0)
}

/// The plugin's process in its cgroup: the one named fencecsi-driver.
fn plugin_pid(cgroup: &str) -> Result<Option<i32>> {
    Ok(cgroups::pids_below(cgroup)?.into_iter().find(|p| {
        std::fs::read_to_string(format!("/proc/{p}/comm"))
            .is_ok_and(|c| c.trim() == "fencecsi-driver")
    }))
}

/// Whether a 4 KiB-aligned block of the image's first `limit` bytes equals `block`.
fn holds_block(image: &Path, limit: u64, block: &[u8]) -> Result<bool> {
    use std::io::Read;
    let mut f = std::fs::File::open(image)?.take(limit);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            match f.read(&mut buf[filled..])? {
                0 => break,
                n => filled += n,
            }
        }
        if buf[..filled].chunks_exact(block.len()).any(|c| c == block) {
            return Ok(true);
        }
        if filled < buf.len() {
            return Ok(false);
        }
    }
}

fn write_synced(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(data)?;
    f.sync_all()
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    format!(
        "the plugin's log ({}), last lines:\n{}",
        log.display(),
        lines[lines.len().saturating_sub(30)..].join("\n")
    )
}
