//! fencecsi's local failover drill.
//!
//! One process, this machine: the embedded cluster and its simulations (kubelet heartbeats,
//! node lifecycle, taint eviction), the real CSI driver (one controller plugin, one node
//! plugin per node, each node with its own kubelet-like dir), the attacher and podgc, all
//! on real loop devices under one temp dir ([`fencecsi_tests::Env`]). The drill adds the
//! small stand-ins a real cluster would have ([`standins`]: provisioner, attach-detach
//! controller, StatefulSet controller; [`kubelet`]: a mini kubelet per node whose
//! "container" is a writer process appending fsync'ed numbered records, see [`writer`]),
//! then runs [`scenario`]: node A shuts down while its writers keep writing, and the drill
//! watches the failover to node B and the return of node A.

pub mod kubelet;
pub mod procs;
pub mod report;
pub mod scenario;
pub mod standins;
pub mod writer;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use report::{Report, Step};
pub use scenario::run;

/// The drill's knobs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Number of nodes (≥ 2). Node A is `node-a`, then `node-b`, ...
    pub nodes: usize,
    /// Number of PVC + pod pairs (StatefulSet replicas) started on node A.
    pub volumes: usize,
    /// `ext4` or `xfs`.
    pub fs: String,
    /// The binary that runs the writer (`<exe> writer <path>`): the drill binary itself.
    pub writer_exe: PathBuf,
    /// Timeout of each waited-for step.
    pub step_timeout: Duration,
    /// Records every writer must have acknowledged before node A shuts down.
    pub min_records: u64,
    /// Milliseconds between two records of a writer.
    pub write_interval_ms: u64,
    /// Node lifecycle: lease age after which a node turns Ready=Unknown (Kubernetes: 40 s).
    pub node_monitor_grace: Duration,
    /// How often the kubelets renew their node Lease (Kubernetes: 10 s).
    pub lease_renew_interval: Duration,
    /// podgc's node lease grace (`--node-lease-grace`, default 15 s).
    pub podgc_lease_grace: Duration,
    /// tolerationSeconds of the writer pods for not-ready/unreachable (Kubernetes' default
    /// toleration: 300 s).
    pub toleration_seconds: i64,
    /// podgc's shutdown grace (production default: 30 s).
    pub podgc_shutdown_grace: Duration,
    /// Also start a pod whose PV belongs to a driver without the safe-detach annotation:
    /// podgc must then withhold the out-of-service taint and leave that pod alone.
    pub unsafe_pod: bool,
    /// The attach-detach controller's verification period
    /// (`--attach-detach-reconcile-sync-period`, 60 s in Kubernetes): how long it may
    /// believe a volume still attached after its VolumeAttachment went behind its back.
    pub adc_sync_period: Duration,
    /// Where progress lines go (already prefixed with the time since the start).
    pub progress: Progress,
}

impl Options {
    pub fn new(writer_exe: PathBuf) -> Self {
        Options {
            nodes: 2,
            volumes: 1,
            fs: "ext4".into(),
            writer_exe,
            step_timeout: Duration::from_secs(60),
            min_records: 20,
            write_interval_ms: 10,
            node_monitor_grace: Duration::from_secs(2),
            lease_renew_interval: Duration::from_millis(250),
            podgc_lease_grace: Duration::from_secs(2),
            // Kubernetes' default: podgc's out-of-service taint evicts the pods
            // at once anyway, which is what the drill shows.
            toleration_seconds: 300,
            podgc_shutdown_grace: Duration::from_secs(1),
            unsafe_pod: false,
            adc_sync_period: Duration::from_secs(60),
            progress: Progress::stderr(),
        }
    }

    /// Kubernetes' and fencecsi's production timing: kubelets renew their Lease every
    /// 10 s, the node lifecycle controller waits 40 s, pods tolerate NotReady for 300 s,
    /// the attach-detach controller verifies every 60 s, and podgc runs with its defaults
    /// (15 s lease grace, 30 s shutdown grace). What a user's cluster does.
    pub fn production(mut self) -> Self {
        let podgc = fencecsi_podgc::PodGcConfig::default();
        self.lease_renew_interval = Duration::from_secs(10);
        self.node_monitor_grace = Duration::from_secs(40);
        self.toleration_seconds = 300;
        self.adc_sync_period = Duration::from_secs(60);
        self.podgc_lease_grace = podgc.node_lease_grace.unwrap_or(Duration::from_secs(15));
        self.podgc_shutdown_grace = podgc.shutdown_grace;
        self.step_timeout = self.step_timeout.max(Duration::from_secs(150));
        self
    }
}

/// A progress sink: prints `[  +1.234s] message`.
#[derive(Clone)]
pub struct Progress {
    sink: Arc<dyn Fn(&str) + Send + Sync>,
    start: Arc<Mutex<Instant>>,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress")
    }
}

impl Progress {
    pub fn new(sink: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Progress {
            sink: Arc::new(sink),
            start: Arc::new(Mutex::new(Instant::now())),
        }
    }
    pub fn stderr() -> Self {
        Self::new(|s| eprintln!("{s}"))
    }
    pub fn stdout() -> Self {
        Self::new(|s| println!("{s}"))
    }
    pub fn quiet() -> Self {
        Self::new(|_| {})
    }
    pub(crate) fn reset(&self) {
        *self.start.lock().unwrap() = Instant::now();
    }
    pub fn start(&self) -> Instant {
        *self.start.lock().unwrap()
    }
    pub fn elapsed(&self) -> Duration {
        self.start().elapsed()
    }
    pub fn say(&self, msg: impl AsRef<str>) {
        let t = self.elapsed().as_secs_f64();
        (self.sink)(&format!("[{t:>8.3}s] {}", msg.as_ref()));
    }
    /// A line without time prefix (tables, figures).
    pub fn raw(&self, msg: impl AsRef<str>) {
        (self.sink)(msg.as_ref());
    }
}

/// Namespace of the drill's workload.
pub const NAMESPACE: &str = "drill";
/// The name of the drill's StorageClass (held by the provisioner stand-in: the embedded
/// cluster has no StorageClass kind).
pub const STORAGE_CLASS: &str = "fencecsi";
/// The driver without safe detach used by the `unsafe_pod` check.
pub const UNSAFE_DRIVER: &str = "other.example.com";
/// The records file in each volume.
pub const RECORDS_FILE: &str = "records.dat";

/// Node names: node-a, node-b, ...
pub fn node_names(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("node-{}", (b'a' + (i as u8 % 26)) as char))
        .collect()
}
