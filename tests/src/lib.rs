//! Shared harness for fencecsi's end-to-end tests and benchmarks.
//!
//! Everything a test makes lives under one temp dir: the state dir (volume
//! images), one kubelet-like dir per node, and the plugin sockets. The
//! [`Env`] guard tears it all down on drop, also when the test fails: it
//! unmounts every mount below the temp dir, detaches every loop device whose
//! backing file is below it (and only those), and clears immutable flags so
//! the files can be removed. Nothing outside the temp dir is touched.

pub mod bench;
pub mod real_cluster;
pub mod records;
pub mod recovering;
pub mod replica;
pub mod rig;
pub mod writer;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fencecsi_driver::config::{Config, Mode};
use fencecsi_proto::client::CsiClient;
use fencecsi_proto::v1::volume_capability::{
    access_mode::Mode as AccessMode, AccessType, BlockVolume, MountVolume,
};
use fencecsi_proto::v1::VolumeCapability;
use sha2::{Digest, Sha256};

pub use fencecsi_proto::v1 as csi;

/// Whether this process can do what the tests need (root, loop devices).
pub fn can_run_kernel_tests() -> bool {
    nix::unistd::geteuid().is_root() && Path::new("/dev/loop-control").exists()
}

/// Skips a test loudly when it cannot run here (never silently passes in CI:
/// CI runs as root, where this is always true).
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::can_run_kernel_tests() {
            if std::env::var_os("CI").is_some() {
                panic!("kernel tests need root and /dev/loop-control, and CI must provide them");
            }
            eprintln!("SKIPPED: needs root and /dev/loop-control");
            return;
        }
    };
}

pub fn init_tracing() {
    init_tracing_at("warn");
}

/// Like [`init_tracing`], at `level` unless RUST_LOG says otherwise: for tests
/// whose expected warnings (a fence per run) would bury a failure's message.
pub fn init_tracing_at(level: &str) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| level.into()),
        )
        .with_test_writer()
        .try_init();
}

/// A temp dir holding one test's state, kubelet dirs and sockets.
pub struct Env {
    pub dir: tempfile::TempDir,
}

impl Env {
    pub fn new() -> Self {
        // Under /var/tmp-like storage on the real disk: the backing filesystem
        // must support the immutable flag (tmpfs does not for our purposes).
        let base = std::env::var_os("FENCECSI_TEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        Self::new_in(&base)
    }

    /// An env below `base` (e.g. a backend filesystem mounted by an outer env).
    pub fn new_in(base: &Path) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("fencecsi-test-")
            .tempdir_in(base)
            .expect("creating the test dir");
        Env { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn state_dir(&self) -> PathBuf {
        self.path().join("state")
    }

    /// The kubelet-like root of one node.
    pub fn kubelet_dir(&self, node: &str) -> PathBuf {
        self.path().join("nodes").join(node).join("kubelet")
    }

    pub fn socket(&self, name: &str) -> PathBuf {
        self.path().join("sock").join(format!("{name}.sock"))
    }

    /// A configuration for a plugin of this env.
    pub fn config(&self, mode: Mode, node: Option<&str>, socket_name: &str) -> Config {
        let kubelet = node
            .map(|n| self.kubelet_dir(n))
            .unwrap_or_else(|| self.path().join("nodes/none/kubelet"));
        let mut cfg = Config::local(
            mode,
            node,
            self.state_dir(),
            kubelet,
            self.socket(socket_name),
        );
        cfg.gc_interval = Duration::from_secs(1);
        cfg
    }

    /// Staging and publish paths laid out as kubelet does.
    pub fn staging_path(&self, node: &str, volume_id: &str) -> PathBuf {
        let h = hex::encode(Sha256::digest(volume_id.as_bytes()));
        self.kubelet_dir(node)
            .join("plugins/kubernetes.io/csi")
            .join(fencecsi_driver::config::DEFAULT_DRIVER_NAME)
            .join(h)
            .join("globalmount")
    }

    pub fn target_path(&self, node: &str, pod_uid: &str, pv: &str) -> PathBuf {
        self.kubelet_dir(node)
            .join("pods")
            .join(pod_uid)
            .join("volumes/kubernetes.io~csi")
            .join(pv)
            .join("mount")
    }

    /// Mounts below this env, deepest first.
    pub fn mounts(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = fencecsi_driver::kernel::mounts::mounts()
            .unwrap_or_default()
            .into_iter()
            .map(|m| m.mount_point)
            .filter(|m| m.starts_with(self.path()))
            .collect();
        v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        v
    }

    /// The attachments on this env's images: a loop device whose backing
    /// file lies below this env, or, for a gate, the device stacked on it
    /// (one entry per attachment, as the driver counts them).
    pub fn loops(&self) -> Vec<PathBuf> {
        let (gates_and_plain, stacked) = self.loop_layers();
        let mut out: Vec<PathBuf> = stacked.iter().map(|(d, _)| d.clone()).collect();
        out.extend(
            gates_and_plain
                .into_iter()
                .filter(|d| !stacked.iter().any(|(_, under)| under == d)),
        );
        out
    }

    /// Loop devices over this env's files, and (device, the device under
    /// it) for those stacked on one of them.
    fn loop_layers(&self) -> (Vec<PathBuf>, Vec<(PathBuf, PathBuf)>) {
        let backing: Vec<(PathBuf, String)> = std::fs::read_dir("/sys/block")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
            .filter_map(|e| {
                let b = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
                let b = b.trim().trim_end_matches(" (deleted)").to_string();
                Some((PathBuf::from("/dev").join(e.file_name()), b))
            })
            .collect();
        let ours: Vec<PathBuf> = backing
            .iter()
            .filter(|(_, b)| Path::new(b).starts_with(self.path()))
            .map(|(d, _)| d.clone())
            .collect();
        let stacked = backing
            .iter()
            .filter(|(_, b)| ours.iter().any(|d| Path::new(b) == d))
            .map(|(d, b)| (d.clone(), PathBuf::from(b)))
            .collect();
        (ours, stacked)
    }

    /// Asserts nothing of this env is mounted or attached.
    pub fn assert_clean(&self) {
        assert_eq!(
            self.mounts(),
            Vec::<PathBuf>::new(),
            "mounts left below the test dir"
        );
        // A gate is unbound at its last close, which a udev probe of the
        // device (its capacity changed) may hold for a moment.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !self.loops().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(
            self.loops(),
            Vec::<PathBuf>::new(),
            "loop devices left on the test's images"
        );
    }

    /// Tears down mounts and loop devices of this env; returns what it found.
    pub fn teardown(&self) -> (usize, usize) {
        let mounts = self.mounts();
        for m in &mounts {
            let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
        }
        let loops = self.loops();
        for l in &loops {
            let _ = fencecsi_driver::kernel::loop_device::detach(l);
        }
        // A gate goes with the device on it (autoclear); one left bare is detached too.
        for l in self.loop_layers().0 {
            let _ = fencecsi_driver::kernel::loop_device::detach(&l);
        }
        clear_immutable(&self.state_dir());
        (mounts.len(), loops.len())
    }
}

impl Default for Env {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let (m, l) = self.teardown();
        if m + l > 0 && !std::thread::panicking() {
            eprintln!("test env teardown removed {m} mounts and {l} loop devices");
        }
    }
}

fn clear_immutable(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => clear_immutable(&p),
            Ok(t)
                if t.is_file()
                    && fencecsi_driver::kernel::files::is_immutable(&p).unwrap_or(false) =>
            {
                let _ = fencecsi_driver::kernel::files::set_immutable(&p, false);
            }
            _ => {}
        }
    }
}

/// A plugin served in this process (fast; for most tests).
pub struct InProcess {
    pub socket: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl InProcess {
    pub async fn start(cfg: Config) -> (Self, CsiClient) {
        let socket = cfg.socket_path().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            if let Err(e) = fencecsi_driver::server::serve(cfg, async {
                let _ = rx.await;
            })
            .await
            {
                panic!("in-process plugin failed: {e}");
            }
        });
        let client = wait_for_socket(&socket).await;
        (
            InProcess {
                socket,
                stop: Some(tx),
                task: Some(task),
            },
            client,
        )
    }

    /// [`InProcess::start`] with `cfg.http_endpoint` served; returns where `/metrics` is
    /// (the bound port when `cfg` asked for port 0).
    pub async fn start_with_metrics(cfg: Config) -> (Self, CsiClient, std::net::SocketAddr) {
        assert!(cfg.http_endpoint.is_some(), "set cfg.http_endpoint");
        let socket = cfg.socket_path().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            if let Err(e) = fencecsi_driver::server::serve_with_metrics(
                cfg,
                async {
                    let _ = rx.await;
                },
                Default::default(),
                fencecsi_driver::server::MetricsHooks {
                    http_endpoint: Some(addr_tx),
                },
            )
            .await
            {
                panic!("in-process plugin failed: {e}");
            }
        });
        let addr = addr_rx.await.expect("the plugin binds its HTTP endpoint");
        let client = wait_for_socket(&socket).await;
        (
            InProcess {
                socket,
                stop: Some(tx),
                task: Some(task),
            },
            client,
            addr,
        )
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

/// ControllerUnpublish from every node, then DeleteVolume.
pub async fn unpublish_and_delete(c: &mut CsiClient, vol: &str) {
    c.controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: vol.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    c.controller
        .delete_volume(csi::DeleteVolumeRequest {
            volume_id: vol.into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("DeleteVolume {vol}: {e}"));
}

/// The smallest test world: a fresh [`Env`] and one plugin in this process serving
/// every service as node "node-a" (the conformance and bad-input suites).
/// [`AllInOne::finish`] stops the plugin and asserts that nothing of the env is left
/// mounted or attached. For a controller with node plugins, see [`rig::Rig`].
pub struct AllInOne {
    // Dropped in this order (a test that panics): the plugin stops before the env
    // tears down its mounts and loop devices.
    pub client: CsiClient,
    pub plugin: InProcess,
    pub env: Env,
}

impl AllInOne {
    pub async fn start() -> Self {
        init_tracing();
        let env = Env::new();
        let (plugin, client) = InProcess::start(env.config(Mode::All, Some("node-a"), "all")).await;
        AllInOne {
            client,
            plugin,
            env,
        }
    }

    /// Stops the plugin, then [`Env::assert_clean`].
    pub async fn finish(self) {
        self.plugin.stop().await;
        self.env.assert_clean();
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// Waits until a plugin answers Probe on `socket`.
pub async fn wait_for_socket(socket: &Path) -> CsiClient {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if socket.exists() {
            if let Ok(mut c) = CsiClient::connect(socket).await {
                if c.identity.probe(csi::ProbeRequest {}).await.is_ok() {
                    return c;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "plugin on {} did not come up",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Where cargo puts the binaries of this build (target/debug): the test
/// executable's directory, or its parent for one in deps/.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.parent()
        .and_then(|d| {
            if d.ends_with("deps") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .expect("target dir")
        .to_path_buf()
}

/// The driver binary to run: the one with failpoints once
/// [`rig::fresh_driver_binary`] has built it in this process, else the one
/// built next to the test executable.
pub fn driver_binary() -> PathBuf {
    if let Some(bin) = rig::failpoint_driver() {
        return bin;
    }
    let bin = bin_dir().join("fencecsi-driver");
    assert!(
        bin.exists(),
        "{} not built: run `cargo build -p fencecsi-driver` (cargo test --workspace builds it)",
        bin.display()
    );
    bin
}

/// A plugin in its own process (for crash and signal tests). Killed on drop.
pub struct Process {
    pub child: Child,
    pub socket: PathBuf,
}

impl Process {
    pub fn spawn(cfg: &Config) -> Self {
        Self::spawn_with_env(cfg, &[])
    }

    /// Like [`Process::spawn`], with extra environment variables for the
    /// driver (e.g. `("FENCECSI_FAILPOINTS", "stage:after-attach")`). Core
    /// dumps are off: a failpoint aborts the process on purpose.
    pub fn spawn_with_env(cfg: &Config, envs: &[(&str, &str)]) -> Self {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(driver_binary());
        cmd.envs(envs.iter().copied());
        // SAFETY: setrlimit is async-signal-safe; nothing else runs in the child.
        unsafe {
            cmd.pre_exec(|| {
                let none = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::setrlimit(libc::RLIMIT_CORE, &none);
                Ok(())
            });
        }
        cmd.arg("--endpoint").arg(&cfg.endpoint);
        cmd.arg("--mode").arg(cfg.mode.name());
        cmd.arg("--state-dir").arg(&cfg.state_dir);
        // Each mode's own flags only: the binary refuses the other mode's.
        if cfg.mode.node() {
            if let Some(n) = &cfg.node_id {
                cmd.arg("--node-id").arg(n);
            }
            cmd.arg("--kubelet-dir").arg(&cfg.kubelet_dir);
            if let Some(d) = &cfg.node_state_dir {
                cmd.arg("--node-state-dir").arg(d);
            }
            if cfg.state_dir_must_be_mount {
                cmd.arg("--state-dir-must-be-mount");
            }
        }
        if cfg.mode.controller() {
            if let Some(id) = &cfg.identity.name {
                cmd.arg("--identity").arg(id);
            }
            cmd.arg("--gc-interval")
                .arg(format!("{}ms", cfg.gc_interval.as_millis()))
                .arg("--max-freeze")
                .arg(format!("{}ms", cfg.max_freeze.as_millis()));
        }
        cmd.arg("--max-volumes-per-node")
            .arg(cfg.max_volumes_per_node.to_string())
            .arg("--default-fs-type")
            .arg(&cfg.default_fs_type)
            .arg("--driver-name")
            .arg(&cfg.driver_name)
            .arg("--direct-io")
            .arg(cfg.direct_io.to_string())
            .arg("--boot-id-file")
            .arg(&cfg.boot_id_file);
        if let Some(a) = cfg.http_endpoint {
            cmd.arg("--http-endpoint").arg(a.to_string());
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let child = cmd.spawn().expect("spawning fencecsi-driver");
        Process {
            child,
            socket: cfg.socket_path().unwrap(),
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn sigterm(&mut self) -> std::process::ExitStatus {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        self.child.wait().expect("waiting for the driver")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub fn mount_cap(mode: AccessMode, fs: &str) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        })),
    }
}

pub fn block_cap(mode: AccessMode) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(csi::volume_capability::AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

pub fn sha256_file(path: &Path) -> String {
    hex::encode(Sha256::digest(
        std::fs::read(path).expect("reading file to hash"),
    ))
}

pub use fencecsi_proto::v1::volume_capability::access_mode::Mode as Access;

/// A hash of a file's logical content that reads only where data may be:
/// the file is cut into 64 KiB chunks, all-zero chunks are skipped, every
/// other chunk is hashed with its index. Holes read as zeros, so the result
/// depends on content only, not on how the filesystem happens to lay out or
/// report extents (ext4 reports unwritten extents by page-cache state), and an
/// empty 16 GiB image hashes in microseconds.
pub fn sparse_hash(path: &Path) -> String {
    region_hash(path, u64::MAX)
}

/// [`sparse_hash`] of the first `limit` bytes only: a generation's data
/// region, without the fence trailer behind it (which a racing request may
/// reach by design).
pub fn region_hash(path: &Path, limit: u64) -> String {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    const CHUNK: u64 = 64 << 10;
    let f = std::fs::File::open(path).expect("opening image to hash");
    let len = f.metadata().unwrap().len().min(limit);
    let fd = f.as_raw_fd();
    let mut h = Sha256::new();
    h.update(len.to_le_bytes());
    let mut buf = vec![0u8; CHUNK as usize];
    let mut next_chunk = 0u64;
    let mut pos = 0u64;
    while pos < len {
        // SAFETY: lseek on a valid fd.
        let data = unsafe { libc::lseek(fd, pos as i64, libc::SEEK_DATA) };
        if data < 0 {
            break;
        }
        // SAFETY: as above.
        let hole = (unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) } as u64).min(len);
        if data as u64 >= len {
            break;
        }
        let first = (data as u64 / CHUNK).max(next_chunk);
        let last = hole.div_ceil(CHUNK);
        for idx in first..last {
            let off = idx * CHUNK;
            let n = (len - off).min(CHUNK) as usize;
            f.read_exact_at(&mut buf[..n], off).expect("reading image");
            if buf[..n].iter().any(|&b| b != 0) {
                h.update(idx.to_le_bytes());
                h.update(&buf[..n]);
            }
        }
        next_chunk = last;
        pos = hole.max(last * CHUNK);
    }
    hex::encode(h.finalize())
}

/// Path of a generation's image in an env's state dir.
pub fn generation_path(env: &Env, volume_id: &str, gen: u64) -> PathBuf {
    env.state_dir()
        .join("volumes")
        .join(volume_id)
        .join(format!("gen-{gen:06}.img"))
}

/// CLOCK_MONOTONIC in ns (what the writer stamps its acknowledgements with).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Makes a `kind` (ext4, xfs, btrfs) filesystem on a loop device over a
/// sparse image in `outer` and mounts it: a backing filesystem for a state
/// dir. The outer env's teardown unmounts and detaches it, failing or not.
pub fn backing_fs(outer: &Env, kind: &str, size: u64) -> PathBuf {
    use fencecsi_driver::kernel::loop_device::{self, AttachOptions};
    let img = outer.path().join(format!("{kind}-backing.img"));
    fencecsi_driver::kernel::files::create_sparse(&img, size).unwrap();
    let lo = loop_device::attach(
        &img,
        &AttachOptions {
            read_only: false,
            direct_io: false,
            tag: format!("fcsi-test-backing-{kind}"),
            size_limit: 0,
            logical_block_size: 0,
        },
    )
    .unwrap();
    if kind == "btrfs" {
        let st = std::process::Command::new("mkfs.btrfs")
            .args(["-f", "-q"])
            .arg(&lo.device)
            .status()
            .expect("mkfs.btrfs (btrfs-progs) runs");
        assert!(st.success(), "mkfs.btrfs failed");
    } else {
        fencecsi_driver::kernel::filesystem::mkfs(&lo.device, kind).unwrap();
    }
    let mnt = outer.path().join(format!("{kind}-backing"));
    std::fs::create_dir_all(&mnt).unwrap();
    fencecsi_driver::kernel::mounts::mount_device(&lo.device, &mnt, kind, &[], false).unwrap();
    mnt
}

/// The file a loop device reads and writes: its backing file, or, for a
/// device stacked on a gate, the gate's.
pub fn backing_file_of(device: &Path) -> PathBuf {
    let sys = |d: &Path| {
        let name = d.file_name().unwrap().to_string_lossy().to_string();
        let b = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
            .unwrap_or_else(|e| panic!("backing file of {}: {e}", d.display()));
        PathBuf::from(b.trim().trim_end_matches(" (deleted)"))
    };
    let b = sys(device);
    if b.to_string_lossy().starts_with("/dev/loop") {
        sys(&b)
    } else {
        b
    }
}

/// Whether /proc/locks shows a waiter blocked on an flock of `path`.
pub fn flock_waiter_on(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).unwrap();
    let want = format!(
        "{:02x}:{:02x}:{}",
        libc::major(m.dev()),
        libc::minor(m.dev()),
        m.ino()
    );
    std::fs::read_to_string("/proc/locks")
        .unwrap()
        .lines()
        .any(|l| l.contains("->") && l.contains("FLOCK") && l.split_whitespace().any(|f| f == want))
}

/// Whether a thread of process `pid` is named `name` (`comm`): how the tests see a
/// driver thread held at a failpoint's stall point.
pub fn has_thread_named(pid: u32, name: &str) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name))
}
