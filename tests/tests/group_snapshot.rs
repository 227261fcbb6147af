//! Volume group snapshots (the CSI GroupController service).
//!
//! - One instant across members, on every backing filesystem: three volumes
//!   are staged and published on node-a while writer threads append fsync'ed
//!   sequence records to them in a fixed order ("chains": one writer goes
//!   v1 -> v2 -> v3 -> v1 ..., others go round pairs of volumes, so that no
//!   member can be copied while another one's writers still run without some
//!   chain seeing it). Group snapshots are taken while they run; every member
//!   is restored into a new volume through CreateVolume and read back. For a
//!   chain over volumes x1..xk written in that order, the volumes' states at
//!   one instant hold s(x1) >= s(x2) >= ... >= s(xk) >= s(x1) - 1 records.
//!   Positive control: three individual snapshots a little apart, same
//!   writers, same check: it must fail at least once, or the check proves
//!   nothing.
//! - A member that cannot be frozen (raw block in use): one is copied by a
//!   reflink while the others are frozen (xfs, btrfs), and the group is still
//!   one instant; with no reflinks (ext4), or with two such members, the group
//!   is refused with FAILED_PRECONDITION and nothing is left behind.
//! - The RPCs' error codes as the spec gives them (conformance style), and
//!   that group members are snapshots like the others (listed, restorable,
//!   deleted only with their group).
//! - A controller killed in the middle of a group snapshot call leaves
//!   nothing that the next start does not remove.

use std::collections::{BTreeSet, HashMap};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencecsi_driver::config::Mode;
use fencecsi_driver::failpoint;
use fencecsi_proto::v1::group_controller_client::GroupControllerClient;
use fencecsi_tests::assert_code;
use fencecsi_tests::csi::group_controller_service_capability::rpc::Type as GroupRpc;
use fencecsi_tests::csi::plugin_capability::service::Type as Svc;
use fencecsi_tests::rig::retry_aborted;
use fencecsi_tests::rig::{create_request, fresh_driver_binary, from_snapshot, Placement, Rig};
use fencecsi_tests::{
    block_cap, csi, mount_cap, region_hash, require_root, wait_for_socket, Access, Env, InProcess,
    Process,
};
use tonic::transport::Channel;
use tonic::Code;

const SIZE: i64 = 64 << 20;
/// A sequence record: the number, then the number xor a constant.
const REC: u64 = 16;
const MAGIC: u64 = 0x9e37_79b9_7f4a_7c15;
/// Where each chain of each writer run writes on a raw block volume: its own
/// 1 MiB region (the volume holds 64), so no run reads another's records.
const REGION: u64 = 1 << 20;
/// Chains per run at most (regions of one run).
const MAX_CHAINS: usize = 8;

// ---------------------------------------------------------------- records

fn record(seq: u64) -> [u8; REC as usize] {
    let mut r = [0u8; REC as usize];
    r[..8].copy_from_slice(&seq.to_le_bytes());
    r[8..].copy_from_slice(&(seq ^ MAGIC).to_le_bytes());
    r
}

/// How many records from seq 1 on are intact (the last sequence number there).
fn intact(data: &[u8]) -> u64 {
    data.chunks_exact(REC as usize)
        .zip(1u64..)
        .take_while(|(r, seq)| r[..] == record(*seq)[..])
        .count() as u64
}

/// Counts of one chain on its volumes, in the chain's write order, are what
/// one instant can show.
fn one_instant(s: &[u64]) -> bool {
    s.windows(2).all(|w| w[0] >= w[1]) && s[s.len() - 1] + 1 >= s[0]
}

// ---------------------------------------------------------------- writers

/// Where a chain writes on one volume: a file in a mounted volume (offset 0),
/// or a region of a raw block volume's device.
#[derive(Clone, Debug)]
struct Target {
    path: PathBuf,
    offset: u64,
}

/// Writer threads, one per chain. A chain writes record `seq` to each of its
/// targets in order, fsync'ing each before the next, then goes on with `seq + 1`.
struct Chains {
    stop: Arc<AtomicBool>,
    done: Vec<Arc<AtomicU64>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Chains {
    fn start(chains: Vec<Vec<Target>>) -> Chains {
        let stop = Arc::new(AtomicBool::new(false));
        let mut done = Vec::new();
        let mut threads = Vec::new();
        for targets in chains {
            let d = Arc::new(AtomicU64::new(0));
            done.push(d.clone());
            let stop = stop.clone();
            threads.push(std::thread::spawn(move || {
                let files: Vec<(std::fs::File, u64)> = targets
                    .iter()
                    .map(|t| {
                        let f = std::fs::OpenOptions::new()
                            .read(true)
                            .write(true)
                            .create(true)
                            .truncate(false)
                            .open(&t.path)
                            .unwrap_or_else(|e| panic!("opening {}: {e}", t.path.display()));
                        (f, t.offset)
                    })
                    .collect();
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    assert!(seq * REC <= REGION, "a chain outgrew its region");
                    for (f, off) in &files {
                        f.write_all_at(&record(seq), off + (seq - 1) * REC)
                            .expect("writing a record");
                        f.sync_all().expect("fsync of a record");
                    }
                    d.store(seq, Ordering::SeqCst);
                }
            }));
        }
        Chains {
            stop,
            done,
            threads,
        }
    }

    /// Per chain: the last sequence number written and fsync'ed on all its volumes.
    fn done(&self) -> Vec<u64> {
        self.done.iter().map(|d| d.load(Ordering::SeqCst)).collect()
    }

    async fn wait_each_past(&self, n: &[u64], more: u64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.done().iter().zip(n).any(|(d, n)| *d < n + more) {
            assert!(Instant::now() < deadline, "writers too slow");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().expect("a writer thread failed");
        }
    }
}

impl Drop for Chains {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

// ---------------------------------------------------------------- volumes

struct Vol {
    id: String,
    block: bool,
    at: Placement,
}

/// Where chain `c` of writer run `run` writes on a volume published at `p`:
/// every run has files (regions) of its own.
fn target(p: &Placement, block: bool, run: usize, c: usize) -> Target {
    assert!(c < MAX_CHAINS);
    if block {
        Target {
            path: p.target.clone(),
            offset: (run * MAX_CHAINS + c) as u64 * REGION,
        }
    } else {
        Target {
            path: p.target.join(format!("run-{run}-chain-{c}.log")),
            offset: 0,
        }
    }
}

/// The records of chain `c` of run `run` found on a volume published at `p`.
fn read_chain(p: &Placement, block: bool, run: usize, c: usize) -> u64 {
    let t = target(p, block, run, c);
    let data = if block {
        let f = std::fs::File::open(&t.path).unwrap();
        let mut buf = vec![0u8; REGION as usize];
        f.read_exact_at(&mut buf, t.offset).unwrap();
        buf
    } else {
        std::fs::read(&t.path).unwrap_or_default()
    };
    intact(&data)
}

fn cap_of(block: bool) -> csi::VolumeCapability {
    if block {
        block_cap(Access::SingleNodeWriter)
    } else {
        mount_cap(Access::SingleNodeWriter, "ext4")
    }
}

async fn new_vol(rig: &Rig, env: &Env, name: &str, block: bool) -> Vol {
    let cap = cap_of(block);
    let v = rig.create(name, SIZE, &cap).await;
    let at = rig
        .attach(env, &v.volume_id, "node-a", &format!("pod-{name}"), &cap)
        .await
        .unwrap();
    Vol {
        id: v.volume_id,
        block,
        at,
    }
}

async fn drop_vol(rig: &Rig, v: Vol) {
    rig.detach_and_delete(&v.at).await.unwrap();
}

/// Restores `snapshot` into a new volume, publishes it on node-a and reads
/// the records of each chain in `chains`; removes the new volume again.
async fn restore_and_read(
    rig: &Rig,
    env: &Env,
    snapshot: &str,
    block: bool,
    name: &str,
    run: usize,
    chains: &[usize],
) -> HashMap<usize, u64> {
    let cap = cap_of(block);
    let v = rig
        .create_volume(csi::CreateVolumeRequest {
            volume_content_source: from_snapshot(snapshot),
            ..create_request(name, SIZE, &cap)
        })
        .await
        .unwrap_or_else(|e| panic!("restoring {snapshot}: {e}"));
    let p = rig
        .attach(env, &v.volume_id, "node-a", &format!("pod-{name}"), &cap)
        .await
        .unwrap();
    let found = chains
        .iter()
        .map(|c| (*c, read_chain(&p, block, run, *c)))
        .collect();
    rig.detach_and_delete(&p).await.unwrap();
    found
}

// ---------------------------------------------------------------- RPC helpers

async fn group_client(env: &Env) -> GroupControllerClient<Channel> {
    GroupControllerClient::new(
        fencecsi_proto::client::connect(&env.socket("controller"))
            .await
            .unwrap(),
    )
}

fn create_req(name: &str, vols: &[&str]) -> csi::CreateVolumeGroupSnapshotRequest {
    csi::CreateVolumeGroupSnapshotRequest {
        name: name.into(),
        source_volume_ids: vols.iter().map(|v| v.to_string()).collect(),
        ..Default::default()
    }
}

/// Creates a group as a CO does: ABORTED (a member busy with another
/// operation, e.g. garbage collection) is tried again.
async fn create_group(
    g: &mut GroupControllerClient<Channel>,
    name: &str,
    vols: &[&str],
) -> Result<csi::VolumeGroupSnapshot, tonic::Status> {
    retry_aborted(|| {
        let mut g = g.clone();
        let req = create_req(name, vols);
        async move { g.create_volume_group_snapshot(req).await }
    })
    .await
    .map(|r| r.into_inner().group_snapshot.unwrap())
}

async fn delete_group(g: &mut GroupControllerClient<Channel>, group: &csi::VolumeGroupSnapshot) {
    g.delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: group.group_snapshot_id.clone(),
        snapshot_ids: group
            .snapshots
            .iter()
            .map(|s| s.snapshot_id.clone())
            .collect(),
        ..Default::default()
    })
    .await
    .unwrap();
}

/// The member of `group` taken from `vol`.
fn member<'a>(group: &'a csi::VolumeGroupSnapshot, vol: &str) -> &'a csi::Snapshot {
    group
        .snapshots
        .iter()
        .find(|s| s.source_volume_id == vol)
        .unwrap_or_else(|| panic!("no member of {} for {vol}", group.group_snapshot_id))
}

/// A group as the spec requires it: one ready member per source volume,
/// each naming the group, all taken at the group's instant.
fn check_group(group: &csi::VolumeGroupSnapshot, vols: &[&str]) {
    assert!(!group.group_snapshot_id.is_empty());
    assert!(group.ready_to_use);
    assert!(group.creation_time.is_some());
    assert_eq!(group.snapshots.len(), vols.len());
    let sources: BTreeSet<&str> = group
        .snapshots
        .iter()
        .map(|s| s.source_volume_id.as_str())
        .collect();
    assert_eq!(sources, vols.iter().copied().collect());
    for s in &group.snapshots {
        assert_eq!(s.group_snapshot_id, group.group_snapshot_id);
        assert!(s.ready_to_use);
        assert_eq!(s.creation_time, group.creation_time);
        assert_eq!(s.size_bytes, SIZE);
    }
}

fn snapshot_dirs(env: &Env) -> BTreeSet<String> {
    std::fs::read_dir(env.state_dir().join("snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

fn group_records(env: &Env) -> Vec<String> {
    std::fs::read_dir(env.state_dir().join("group-snapshots"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

async fn list_snapshots(rig: &Rig) -> Vec<csi::Snapshot> {
    rig.controller
        .clone()
        .controller
        .list_snapshots(csi::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .filter_map(|e| e.snapshot)
        .collect()
}

// ---------------------------------------------------------------- one instant

/// Chains over volume indexes: the one the issue names (all volumes in turn)
/// and pairs round the ring, so each pair of members has a writer of its own.
fn chains_over(n: usize) -> Vec<Vec<usize>> {
    let mut c = vec![(0..n).collect::<Vec<_>>()];
    for i in 0..n {
        c.push(vec![i, (i + 1) % n]);
    }
    c
}

/// Reads every member of `snapshots` (snapshot ID per volume index, in
/// `vols` order) back through restored volumes: counts per chain, in the
/// chain's order.
async fn counts(
    rig: &Rig,
    env: &Env,
    vols: &[&Vol],
    snapshots: &[String],
    run: usize,
    chains: &[Vec<usize>],
    tag: &str,
) -> Vec<Vec<u64>> {
    let mut per_vol = Vec::new();
    for (i, (v, s)) in vols.iter().zip(snapshots).enumerate() {
        let on: Vec<usize> = (0..chains.len())
            .filter(|c| chains[*c].contains(&i))
            .collect();
        per_vol
            .push(restore_and_read(rig, env, s, v.block, &format!("{tag}-r{i}"), run, &on).await);
    }
    chains
        .iter()
        .enumerate()
        .map(|(c, order)| order.iter().map(|i| per_vol[*i][&c]).collect())
        .collect()
}

/// Group snapshots of `vols` while the chains run: each is one instant, and
/// holds everything acknowledged before it was asked for. Returns the groups.
async fn group_trials(
    rig: &Rig,
    env: &Env,
    vols: &[&Vol],
    run: usize,
    trials: usize,
    tag: &str,
) -> Vec<csi::VolumeGroupSnapshot> {
    let chains = chains_over(vols.len());
    let w = Chains::start(
        chains
            .iter()
            .enumerate()
            .map(|(c, order)| {
                order
                    .iter()
                    .map(|i| target(&vols[*i].at, vols[*i].block, run, c))
                    .collect()
            })
            .collect(),
    );
    let ids: Vec<&str> = vols.iter().map(|v| v.id.as_str()).collect();
    let mut g = group_client(env).await;
    let mut taken = Vec::new();
    w.wait_each_past(&vec![0; chains.len()], 20).await;
    for t in 0..trials {
        let before = w.done();
        let group = create_group(&mut g, &format!("{tag}-group-{t}"), &ids)
            .await
            .expect("a group snapshot of volumes in use");
        let after = w.done();
        check_group(&group, &ids);
        // Let the writers get on before the next one.
        w.wait_each_past(&after, 10).await;
        taken.push((group, before, after));
    }
    w.stop();
    let mut groups = Vec::new();
    for (t, (group, before, after)) in taken.into_iter().enumerate() {
        let snaps: Vec<String> = vols
            .iter()
            .map(|v| member(&group, &v.id).snapshot_id.clone())
            .collect();
        let got = counts(rig, env, vols, &snaps, run, &chains, &format!("{tag}-g{t}")).await;
        for (c, s) in got.iter().enumerate() {
            eprintln!(
                "{tag} group {t} chain {:?}: {s:?} (acknowledged {} before, {} after)",
                chains[c], before[c], after[c]
            );
            assert!(
                one_instant(s),
                "{tag}: group snapshot {t} is not one instant: chain {:?} over {:?} holds {s:?}",
                chains[c],
                ids
            );
            assert!(
                s.iter().all(|n| *n >= before[c] && *n <= after[c] + 1),
                "{tag}: group snapshot {t}, chain {:?}: {s:?} outside [{}, {}]",
                chains[c],
                before[c],
                after[c] + 1
            );
        }
        groups.push(group);
    }
    groups
}

/// The positive control: the same writers, the members snapshotted one by one
/// (each one frozen for its own copy only), the writers a few records further
/// between two. Returns whether any trial failed the one-instant check.
async fn control_trials(
    rig: &Rig,
    env: &Env,
    vols: &[&Vol],
    run: usize,
    trials: usize,
    tag: &str,
) -> bool {
    let chains = chains_over(vols.len());
    let w = Chains::start(
        chains
            .iter()
            .enumerate()
            .map(|(c, order)| {
                order
                    .iter()
                    .map(|i| target(&vols[*i].at, vols[*i].block, run, c))
                    .collect()
            })
            .collect(),
    );
    let mut c = rig.controller.clone();
    let mut taken = Vec::new();
    w.wait_each_past(&vec![0; chains.len()], 20).await;
    for t in 0..trials {
        let mut snaps = Vec::new();
        for (i, v) in vols.iter().enumerate() {
            if i > 0 {
                // Every chain gets three records further between two members' copies,
                // so that one after another they cannot look like one instant: wait for
                // that progress, not for a pause a busy machine may leave idle.
                let now = w.done();
                w.wait_each_past(&now, 3).await;
            }
            // As a CO does, ABORTED (the volume busy with garbage
            // collection, say) is tried again.
            let req = csi::CreateSnapshotRequest {
                name: format!("{tag}-control-{t}-{i}"),
                source_volume_id: v.id.clone(),
                ..Default::default()
            };
            snaps.push(
                retry_aborted(|| {
                    let (mut c, req) = (c.clone(), req.clone());
                    async move { c.controller.create_snapshot(req).await }
                })
                .await
                .unwrap()
                .into_inner()
                .snapshot
                .unwrap()
                .snapshot_id,
            );
        }
        taken.push(snaps);
    }
    w.stop();
    let mut torn = false;
    for (t, snaps) in taken.iter().enumerate() {
        let got = counts(rig, env, vols, snaps, run, &chains, &format!("{tag}-c{t}")).await;
        for (ch, s) in got.iter().enumerate() {
            eprintln!(
                "{tag} control {t} chain {:?}: {s:?}{}",
                chains[ch],
                if one_instant(s) {
                    ""
                } else {
                    "  <- not one instant"
                }
            );
            torn |= !one_instant(s);
        }
        for s in snaps {
            c.controller
                .delete_snapshot(csi::DeleteSnapshotRequest {
                    snapshot_id: s.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
    }
    torn
}

async fn live(backing: &str) {
    require_root!();
    fencecsi_tests::init_tracing();
    let outer = Env::new();
    let mnt = fencecsi_tests::backing_fs(&outer, backing, 4 << 30);
    let env = Env::new_in(&mnt);
    let rig = Rig::start(&env, &["node-a"]).await;
    let mut g = group_client(&env).await;

    // Three filesystem volumes in use: frozen together on every backing.
    let mut vols = Vec::new();
    for i in 1..=3 {
        vols.push(new_vol(&rig, &env, &format!("{backing}-v{i}"), false).await);
    }
    let all: Vec<&Vol> = vols.iter().collect();
    let groups = group_trials(&rig, &env, &all, 0, 3, &format!("{backing}-fs")).await;
    assert!(
        control_trials(&rig, &env, &all, 1, 3, &format!("{backing}-fs")).await,
        "{backing}: snapshots of the members one after another always looked like one instant: the check cannot tell"
    );
    for group in &groups {
        delete_group(&mut g, group).await;
    }

    // Raw block members in use cannot be frozen.
    let b1 = new_vol(&rig, &env, &format!("{backing}-b1"), true).await;
    let b2 = new_vol(&rig, &env, &format!("{backing}-b2"), true).await;
    let before = snapshot_dirs(&env);
    if backing == "ext4" {
        // No reflinks: a member that keeps writing cannot be copied at the others' instant.
        let err = create_group(&mut g, "with-block", &[&b1.id, &vols[0].id])
            .await
            .expect_err("no one-instant copy of raw block in use without reflinks");
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    } else {
        // One such member: copied by a reflink while the others are frozen.
        let mixed = [&b1, &vols[0], &vols[1]];
        for group in group_trials(&rig, &env, &mixed, 2, 2, &format!("{backing}-mixed")).await {
            delete_group(&mut g, &group).await;
        }
    }
    assert_eq!(
        snapshot_dirs(&env),
        before,
        "a refused group leaves nothing"
    );
    assert!(group_records(&env).is_empty());
    // Two: their copies would be two instants, whatever the backing.
    let err = create_group(&mut g, "two-blocks", &[&b1.id, &vols[0].id, &b2.id])
        .await
        .expect_err("two members that keep writing cannot be one instant");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(
        snapshot_dirs(&env),
        before,
        "a refused group leaves nothing"
    );

    for v in vols.into_iter().chain([b1, b2]) {
        drop_vol(&rig, v).await;
    }
    assert!(group_records(&env).is_empty());
    assert!(snapshot_dirs(&env).is_empty(), "{:?}", snapshot_dirs(&env));
    rig.stop().await;
    env.assert_clean();
    drop(env);
    drop(outer);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_snapshot_is_one_instant_on_ext4_backing() {
    live("ext4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_snapshot_is_one_instant_on_xfs_backing() {
    live("xfs").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_snapshot_is_one_instant_on_btrfs_backing() {
    live("btrfs").await;
}

// ---------------------------------------------------------------- conformance

fn image(env: &Env, vol: &str) -> PathBuf {
    env.state_dir()
        .join("volumes")
        .join(vol)
        .join("gen-000001.img")
}

fn write_pattern(path: &Path, seed: u8) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let data: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    f.write_all_at(&data, 4 << 20).unwrap();
    f.sync_all().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_controller_rpcs_and_error_codes() {
    require_root!();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let rig = Rig::start(&env, &[]).await;
    let mut c = rig.controller.clone();
    let mut g = group_client(&env).await;

    // Identity: the controller offers the group controller service; a node-only
    // plugin does not, and answers its RPCs with UNIMPLEMENTED.
    let services = |caps: Vec<csi::PluginCapability>| -> BTreeSet<i32> {
        caps.into_iter()
            .filter_map(|c| match c.r#type {
                Some(csi::plugin_capability::Type::Service(s)) => Some(s.r#type),
                _ => None,
            })
            .collect()
    };
    let caps = c
        .identity
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert!(services(caps).contains(&(Svc::GroupControllerService as i32)));
    let (node_plugin, mut n) =
        InProcess::start(env.config(Mode::Node, Some("node-b"), "node-b")).await;
    let caps = n
        .identity
        .get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert!(!services(caps).contains(&(Svc::GroupControllerService as i32)));
    let mut ng = GroupControllerClient::new(
        fencecsi_proto::client::connect(&env.socket("node-b"))
            .await
            .unwrap(),
    );
    assert_code!(
        ng.group_controller_get_capabilities(csi::GroupControllerGetCapabilitiesRequest {}),
        Code::Unimplemented
    );
    node_plugin.stop().await;

    // GroupControllerGetCapabilities: exactly the one RPC capability.
    let caps = g
        .group_controller_get_capabilities(csi::GroupControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let types: Vec<i32> = caps
        .iter()
        .map(|c| match &c.r#type {
            Some(csi::group_controller_service_capability::Type::Rpc(r)) => r.r#type,
            None => panic!("a capability that is not an RPC one"),
        })
        .collect();
    assert_eq!(
        types,
        vec![GroupRpc::CreateDeleteGetVolumeGroupSnapshot as i32]
    );

    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let va = rig.create("va", SIZE, &cap).await.volume_id;
    let vb = rig.create("vb", SIZE, &cap).await.volume_id;
    let vc = rig.create("vc", SIZE, &cap).await.volume_id;
    write_pattern(&image(&env, &va), 1);
    write_pattern(&image(&env, &vb), 2);
    let hash_a = region_hash(&image(&env, &va), SIZE as u64);
    let hash_b = region_hash(&image(&env, &vb), SIZE as u64);

    // CreateVolumeGroupSnapshot: arguments.
    assert_code!(
        g.create_volume_group_snapshot(create_req("", &[&va, &vb])),
        Code::InvalidArgument
    );
    assert_code!(
        g.create_volume_group_snapshot(create_req("g1", &[])),
        Code::InvalidArgument
    );
    assert_code!(
        g.create_volume_group_snapshot(create_req("g1", &[&va, "../etc"])),
        Code::InvalidArgument
    );
    assert_code!(
        g.create_volume_group_snapshot(create_req("g1", &[&va, &va])),
        Code::InvalidArgument
    );
    assert_code!(
        g.create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
            parameters: [("color".to_string(), "blue".to_string())].into(),
            ..create_req("g1", &[&va, &vb])
        }),
        Code::InvalidArgument
    );
    assert_code!(
        g.create_volume_group_snapshot(create_req("g1", &[&va, "fake-volume-id"])),
        Code::NotFound
    );
    assert_code!(
        g.create_volume_group_snapshot(create_req(
            "g1",
            &[&va, "vol-0123456789abcdef0123456789abcdef"]
        )),
        Code::NotFound
    );
    assert!(
        snapshot_dirs(&env).is_empty() && group_records(&env).is_empty(),
        "refused calls made nothing"
    );

    // A group; idempotent by name and source set (in any order).
    let g1 = create_group(&mut g, "g1", &[&va, &vb]).await.unwrap();
    check_group(&g1, &[&va, &vb]);
    let again = create_group(&mut g, "g1", &[&vb, &va]).await.unwrap();
    assert_eq!(again, g1, "the same name and sources give the same group");
    assert_code!(
        g.create_volume_group_snapshot(create_req("g1", &[&va, &vc])),
        Code::AlreadyExists
    );
    assert_code!(
        g.create_volume_group_snapshot(create_req("g1", &[&va])),
        Code::AlreadyExists
    );
    assert_code!(
        g.create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
            parameters: [(
                "csi.storage.k8s.io/volumegroupsnapshot/name".to_string(),
                "other".to_string()
            )]
            .into(),
            ..create_req("g1", &[&va, &vb])
        }),
        Code::AlreadyExists
    );
    let ids: Vec<String> = g1.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();

    // Members are snapshots: listed with their group, found by ID and by source.
    let listed = list_snapshots(&rig).await;
    assert_eq!(listed.len(), 2);
    for s in &listed {
        assert_eq!(s.group_snapshot_id, g1.group_snapshot_id);
        assert!(ids.contains(&s.snapshot_id));
    }
    let by_id = c
        .controller
        .list_snapshots(csi::ListSnapshotsRequest {
            snapshot_id: member(&g1, &va).snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .entries;
    assert_eq!(by_id.len(), 1);
    assert_eq!(
        by_id[0].snapshot.as_ref().unwrap(),
        member(&g1, &va),
        "ListSnapshots and the group agree on a member"
    );
    // ...that cannot be deleted on their own (the spec's INVALID_ARGUMENT).
    assert_code!(
        c.controller.delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: ids[0].clone(),
            ..Default::default()
        }),
        Code::InvalidArgument
    );
    assert_eq!(list_snapshots(&rig).await.len(), 2);
    // A standalone snapshot may share the group's name: it is another object.
    let lone = c
        .controller
        .create_snapshot(csi::CreateSnapshotRequest {
            name: "g1".into(),
            source_volume_id: va.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(lone.group_snapshot_id.is_empty());
    assert!(!ids.contains(&lone.snapshot_id));
    c.controller
        .delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: lone.snapshot_id,
            ..Default::default()
        })
        .await
        .unwrap();

    // Members hold their source's data at the group's instant, whatever the source does after.
    write_pattern(&image(&env, &va), 9);
    for (vol, hash) in [(&va, &hash_a), (&vb, &hash_b)] {
        let r = rig
            .create_volume(csi::CreateVolumeRequest {
                volume_content_source: from_snapshot(&member(&g1, vol).snapshot_id),
                ..create_request(&format!("restored-{vol}"), SIZE, &cap)
            })
            .await
            .unwrap();
        assert_eq!(
            &region_hash(&image(&env, &r.volume_id), SIZE as u64),
            hash,
            "restored member of {vol}"
        );
        rig.delete(&r.volume_id).await.unwrap();
    }

    // GetVolumeGroupSnapshot.
    let get = |id: &str, snaps: &[String]| csi::GetVolumeGroupSnapshotRequest {
        group_snapshot_id: id.into(),
        snapshot_ids: snaps.to_vec(),
        ..Default::default()
    };
    assert_code!(
        g.get_volume_group_snapshot(get("", &[])),
        Code::InvalidArgument
    );
    assert_code!(
        g.get_volume_group_snapshot(get("a/b", &[])),
        Code::InvalidArgument
    );
    assert_code!(
        g.get_volume_group_snapshot(get("fake-volume-id", &[])),
        Code::NotFound
    );
    assert_code!(
        g.get_volume_group_snapshot(get("group-0123456789abcdef0123456789abcdef", &[])),
        Code::NotFound
    );
    assert_code!(
        g.get_volume_group_snapshot(get(&g1.group_snapshot_id, &ids[..1])),
        Code::InvalidArgument
    );
    assert_code!(
        g.get_volume_group_snapshot(get(&g1.group_snapshot_id, &["../x".to_string()])),
        Code::InvalidArgument
    );
    let reversed: Vec<String> = ids.iter().rev().cloned().collect();
    for asked in [&reversed[..], &[]] {
        let got = g
            .get_volume_group_snapshot(get(&g1.group_snapshot_id, asked))
            .await
            .unwrap()
            .into_inner()
            .group_snapshot
            .unwrap();
        assert_eq!(got, g1);
    }

    // A group outlives its sources, and stays idempotent.
    let g2 = create_group(&mut g, "g2", &[&vc, &vb]).await.unwrap();
    check_group(&g2, &[&vc, &vb]);
    rig.delete(&vc).await.unwrap();
    assert_eq!(
        create_group(&mut g, "g2", &[&vb, &vc]).await.unwrap(),
        g2,
        "the group is found by name even though a source is gone"
    );
    assert_code!(
        g.create_volume_group_snapshot(create_req("g3", &[&vb, &vc])),
        Code::NotFound
    );

    // DeleteVolumeGroupSnapshot.
    let del = |id: &str, snaps: &[String]| csi::DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: id.into(),
        snapshot_ids: snaps.to_vec(),
        ..Default::default()
    };
    assert_code!(
        g.delete_volume_group_snapshot(del("", &[])),
        Code::InvalidArgument
    );
    assert_code!(
        g.delete_volume_group_snapshot(del("fake-volume-id", &[])),
        Code::Ok
    );
    assert_code!(
        g.delete_volume_group_snapshot(del("group-0123456789abcdef0123456789abcdef", &ids)),
        Code::Ok
    );
    // The other group's members, or too few: a mismatch, and nothing is deleted.
    let ids2: Vec<String> = g2.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();
    assert_code!(
        g.delete_volume_group_snapshot(del(&g1.group_snapshot_id, &ids2)),
        Code::InvalidArgument
    );
    assert_code!(
        g.delete_volume_group_snapshot(del(&g1.group_snapshot_id, &ids[1..])),
        Code::InvalidArgument
    );
    assert_code!(
        g.get_volume_group_snapshot(get(&g1.group_snapshot_id, &[])),
        Code::Ok
    );
    assert_eq!(list_snapshots(&rig).await.len(), 4);
    assert_code!(
        g.delete_volume_group_snapshot(del(&g1.group_snapshot_id, &reversed)),
        Code::Ok
    );
    assert_code!(
        g.get_volume_group_snapshot(get(&g1.group_snapshot_id, &[])),
        Code::NotFound
    );
    assert_code!(
        g.delete_volume_group_snapshot(del(&g1.group_snapshot_id, &ids)),
        Code::Ok
    );
    let left: BTreeSet<String> = list_snapshots(&rig)
        .await
        .into_iter()
        .map(|s| s.snapshot_id)
        .collect();
    assert_eq!(left, ids2.iter().cloned().collect());
    assert_eq!(
        snapshot_dirs(&env),
        left,
        "the deleted members' data is gone"
    );
    // Without snapshot_ids (csi-snapshotter sends none when it has not recorded them).
    assert_code!(
        g.delete_volume_group_snapshot(del(&g2.group_snapshot_id, &[])),
        Code::Ok
    );
    assert!(list_snapshots(&rig).await.is_empty());
    assert!(snapshot_dirs(&env).is_empty());
    assert!(group_records(&env).is_empty());

    rig.delete(&va).await.unwrap();
    rig.delete(&vb).await.unwrap();
    rig.stop().await;
    env.assert_clean();
}

// ---------------------------------------------------------------- crashes

/// A controller plugin in its own process with `failpoints` armed.
async fn controller_process(
    env: &Env,
    failpoints: &str,
) -> (Process, GroupControllerClient<Channel>) {
    let cfg = env.config(Mode::Controller, None, "controller");
    let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
    let p = Process::spawn_with_env(&cfg, &[(failpoint::ENV, failpoints), ("RUST_LOG", &log)]);
    wait_for_socket(&p.socket).await;
    let g = group_client(env).await;
    (p, g)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_group_snapshot_leaves_nothing_after_restart() {
    require_root!();
    fresh_driver_binary();
    fencecsi_tests::init_tracing();
    let env = Env::new();
    let cap = mount_cap(Access::SingleNodeWriter, "ext4");
    let (mut plugin, _) = controller_process(&env, "").await;
    let mut c = wait_for_socket(&plugin.socket).await;
    let mut vols = Vec::new();
    for n in ["ca", "cb"] {
        vols.push(
            c.controller
                .create_volume(create_request(n, SIZE, &cap))
                .await
                .unwrap()
                .into_inner()
                .volume
                .unwrap()
                .volume_id,
        );
    }
    plugin.kill9();
    let ids: Vec<&str> = vols.iter().map(String::as_str).collect();

    // Killed after the copies, and after the member records: a restart removes them.
    for point in ["group-snapshot:after-copy", "group-snapshot:after-members"] {
        let (mut p, mut g) = controller_process(&env, point).await;
        let err = create_group(&mut g, "crashing", &ids)
            .await
            .expect_err("the controller dies in the call");
        assert_ne!(err.code(), Code::Ok);
        let status = p.child.wait().unwrap();
        assert!(
            !status.success(),
            "{point}: the failpoint aborts the plugin"
        );
        assert_eq!(
            snapshot_dirs(&env).len(),
            2,
            "{point}: the copies were made"
        );
        if point.ends_with("after-members") {
            assert!(
                snapshot_dirs(&env).iter().all(|s| env
                    .state_dir()
                    .join("snapshots")
                    .join(s)
                    .join("snapshot.json")
                    .exists()),
                "{point}: the member records were written"
            );
        }
        assert!(
            group_records(&env)
                .iter()
                .all(|f| !f.ends_with(".json") || f.starts_with('.')),
            "{point}: no group record"
        );
        // A restart removes it all; the CO's retry then makes the group.
        let (plugin, mut c) =
            InProcess::start(env.config(Mode::Controller, None, "controller")).await;
        assert!(
            snapshot_dirs(&env).is_empty(),
            "{point}: {:?}",
            snapshot_dirs(&env)
        );
        assert!(c
            .controller
            .list_snapshots(csi::ListSnapshotsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries
            .is_empty());
        let mut g = group_client(&env).await;
        let group = create_group(&mut g, "crashing", &ids).await.unwrap();
        check_group(&group, &ids);
        delete_group(&mut g, &group).await;
        plugin.stop().await;
        assert!(snapshot_dirs(&env).is_empty());
    }

    // Killed in a delete after the records went: the group is gone, and a
    // restart removes the data.
    let (plugin, _) = InProcess::start(env.config(Mode::Controller, None, "controller")).await;
    let mut g = group_client(&env).await;
    let group = create_group(&mut g, "deleting", &ids).await.unwrap();
    plugin.stop().await;
    let (mut p, mut g) = controller_process(&env, "group-snapshot-delete:after-records").await;
    let err = g
        .delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .expect_err("the controller dies in the call");
    assert_ne!(err.code(), Code::Ok);
    assert!(!p.child.wait().unwrap().success());
    assert_eq!(snapshot_dirs(&env).len(), 2, "the data outlived the crash");
    let (plugin, mut c) = InProcess::start(env.config(Mode::Controller, None, "controller")).await;
    assert!(snapshot_dirs(&env).is_empty());
    let mut g = group_client(&env).await;
    assert_code!(
        g.get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            ..Default::default()
        }),
        Code::NotFound
    );
    assert_code!(
        g.delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            ..Default::default()
        }),
        Code::Ok
    );
    for v in &vols {
        c.controller
            .delete_volume(csi::DeleteVolumeRequest {
                volume_id: v.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    plugin.stop().await;
    assert!(group_records(&env).is_empty());
    env.assert_clean();
}
