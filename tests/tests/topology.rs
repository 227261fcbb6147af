//! The topology value survives a reboot (issue 12).
//!
//! `topology.loop.fencecsi.io/kernel` goes into every PV's node affinity, which cannot be
//! changed, so the value must not change when the host reboots. It is the state dir's
//! identity's value: the boot ID current when the identity was made. Reboots are faked
//! with `Config::boot_id_file`.

use std::path::{Path, PathBuf};

use fencecsi_driver::config::{Config, Mode, DEFAULT_DRIVER_NAME};
use fencecsi_driver::terms::{topology_of, TOPOLOGY_KEY};
use fencecsi_proto::client::CsiClient;
use fencecsi_tests::rig::{create_request, Placement, Rig};
use fencecsi_tests::{csi, mount_cap, require_root, Access, Env, InProcess};

fn cap() -> csi::VolumeCapability {
    mount_cap(Access::SingleNodeWriter, "ext4")
}

/// Boots the "machine": the boot ID the plugins read.
fn boot(env: &Env, id: &str) -> PathBuf {
    let p = env.path().join("boot_id");
    std::fs::write(&p, format!("{id}\n")).unwrap();
    p
}

async fn start(env: &Env, boot_file: &Path) -> Rig {
    let f = boot_file.to_path_buf();
    Rig::start_with(env, &["node-a"], move |c: &mut Config| {
        c.boot_id_file = f.clone()
    })
    .await
}

async fn node_topology(c: &CsiClient) -> String {
    let info = c
        .clone()
        .node
        .node_get_info(csi::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    info.accessible_topology.unwrap().segments[TOPOLOGY_KEY].clone()
}

async fn ready(c: &CsiClient) -> Option<bool> {
    c.clone()
        .identity
        .probe(csi::ProbeRequest {})
        .await
        .unwrap()
        .into_inner()
        .ready
}

/// CreateVolume as the external-provisioner sends it: requisite = the selected node's topology.
async fn create_on(rig: &Rig, name: &str, topology: &csi::Topology) -> csi::Volume {
    rig.create_volume(csi::CreateVolumeRequest {
        accessibility_requirements: Some(csi::TopologyRequirement {
            requisite: vec![topology.clone()],
            preferred: vec![topology.clone()],
        }),
        ..create_request(name, 64 << 20, &cap())
    })
    .await
    .unwrap_or_else(|e| panic!("CreateVolume {name}: {e:?}"))
}

fn write_text(p: &Placement, text: &str) {
    use std::io::Write;
    let mut f = std::fs::File::create(p.target.join("record")).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.sync_all().unwrap();
}

fn read_text(p: &Placement) -> String {
    std::fs::read_to_string(p.target.join("record")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_and_volumes_survive_a_reboot() {
    require_root!();
    let env = Env::new();
    let boot_file = boot(&env, "boot-before");
    let rig = start(&env, &boot_file).await;
    let before = node_topology(&rig.node("node-a")).await;
    assert_eq!(before, "boot-before", "a new state dir takes the boot ID");
    let topo = topology_of(&before);
    let vol = create_on(&rig, "pv-reboot", &topo).await;
    assert_eq!(vol.accessible_topology, vec![topo.clone()]);
    let p = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-1", &cap())
        .await
        .unwrap();
    write_text(&p, "before the reboot");
    rig.detach(&p).await.unwrap();
    rig.stop().await;

    // The host reboots: another boot ID for controller and node.
    boot(&env, "boot-after");
    let rig = start(&env, &boot_file).await;
    assert_eq!(node_topology(&rig.node("node-a")).await, before);
    let again = create_on(&rig, "pv-reboot", &topo).await;
    assert_eq!(again.volume_id, vol.volume_id, "CreateVolume is idempotent");
    assert_eq!(again.accessible_topology, vec![topo.clone()]);
    let p = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-2", &cap())
        .await
        .expect("publish and stage after the reboot");
    assert_eq!(read_text(&p), "before the reboot");
    // A volume made after the reboot lands in the same topology.
    let new = create_on(&rig, "pv-after", &topo).await;
    assert_eq!(new.accessible_topology, vec![topo.clone()]);
    rig.detach(&p).await.unwrap();
    for v in [&vol.volume_id, &new.volume_id] {
        rig.delete(v).await.unwrap();
    }
    rig.stop().await;
    env.assert_clean();
}

/// Upgrade from a version that reported the live boot ID and kept no identity: the PVs
/// provisioned in the boot during which the upgrade happens carry that boot ID, and keep
/// publishing after later reboots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_with_the_legacy_boot_id_value_still_publishes() {
    require_root!();
    let env = Env::new();
    let boot_file = boot(&env, "boot-legacy");
    let rig = start(&env, &boot_file).await;
    let vol = rig.create("pv-legacy", 64 << 20, &cap()).await;
    let legacy = vol.accessible_topology[0].clone();
    assert_eq!(legacy.segments[TOPOLOGY_KEY], "boot-legacy");
    let p = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-1", &cap())
        .await
        .unwrap();
    write_text(&p, "legacy");
    rig.stop().await;
    // What the old version did not have: the state dir's identity, the node's record of it.
    std::fs::remove_file(env.state_dir().join(fencecsi_driver::state_id::FILE)).unwrap();
    std::fs::remove_file(
        env.kubelet_dir("node-a")
            .join("plugins")
            .join(DEFAULT_DRIVER_NAME)
            .join(fencecsi_driver::state_id::FILE),
    )
    .unwrap();

    // The upgrade, in the same boot, while the volume is mounted on node-a: the node takes
    // the new identity (the state dir knows the volume it holds) and the value is the
    // boot ID the PV carries.
    let rig = start(&env, &boot_file).await;
    assert_eq!(ready(&rig.node("node-a")).await, Some(true));
    assert_eq!(
        node_topology(&rig.node("node-a")).await,
        legacy.segments[TOPOLOGY_KEY]
    );
    rig.detach(&p).await.unwrap();
    rig.stop().await;

    // Reboots after the upgrade change nothing.
    boot(&env, "boot-later");
    let rig = start(&env, &boot_file).await;
    assert_eq!(
        node_topology(&rig.node("node-a")).await,
        legacy.segments[TOPOLOGY_KEY]
    );
    let again = create_on(&rig, "pv-legacy", &legacy).await;
    assert_eq!(again.volume_id, vol.volume_id);
    let p = rig
        .attach(&env, &vol.volume_id, "node-a", "pod-2", &cap())
        .await
        .expect("the legacy volume publishes and stages");
    assert_eq!(read_text(&p), "legacy");
    rig.detach(&p).await.unwrap();
    rig.delete(&vol.volume_id).await.unwrap();
    rig.stop().await;
    env.assert_clean();
}

/// A fresh install whose node plugin starts before the controller: it reports the value
/// the controller then writes, and is healthy (nothing to protect yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_before_the_controller_agrees_with_it() {
    require_root!();
    let env = Env::new();
    let boot_file = boot(&env, "boot-first");
    let with_boot = |mut c: Config| {
        c.boot_id_file = boot_file.clone();
        c
    };
    let (node, nc) =
        InProcess::start(with_boot(env.config(Mode::Node, Some("node-a"), "node"))).await;
    assert_eq!(ready(&nc).await, Some(true));
    assert_eq!(node_topology(&nc).await, "boot-first");
    let (controller, _) =
        InProcess::start(with_boot(env.config(Mode::Controller, None, "controller"))).await;
    let id = fencecsi_driver::state_id::read(&env.state_dir())
        .unwrap()
        .expect("the controller made the identity");
    assert_eq!(id.topology, "boot-first");
    node.stop().await;
    // Restarted after a reboot, the node reports the state dir's value.
    boot(&env, "boot-second");
    let (node, nc) =
        InProcess::start(with_boot(env.config(Mode::Node, Some("node-a"), "node"))).await;
    assert_eq!(node_topology(&nc).await, "boot-first");
    assert_eq!(ready(&nc).await, Some(true));
    node.stop().await;
    controller.stop().await;
    env.assert_clean();
}
