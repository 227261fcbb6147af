//! Command-line configuration of the plugin.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

pub const DEFAULT_DRIVER_NAME: &str = "loop.fencecsi.io";

// Defaults the flags and [`Config::local`] share (each written once, here or as the
// enum's `#[default]`).
pub const DEFAULT_MAX_VOLUMES_PER_NODE: i64 = 64;
pub const DEFAULT_FS_TYPE: &str = "ext4";
pub const DEFAULT_GC_INTERVAL: &str = "10s";
pub const DEFAULT_MAX_FREEZE: &str = "10s";
pub const DEFAULT_FENCE_SETTLE: &str = "250ms";
pub const DEFAULT_OVERCOMMIT_RATIO: f64 = 1.0;
pub const DEFAULT_CAPACITY_RESERVE: CapacityReserve = CapacityReserve::Percent(5.0);

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Identity + Controller: volume lifecycle, attachments and fences.
    Controller,
    /// Identity + Node: loop devices and mounts on this node.
    Node,
    /// Both, in one process (local use and conformance runs).
    All,
}

impl Mode {
    pub fn controller(self) -> bool {
        matches!(self, Mode::Controller | Mode::All)
    }
    pub fn node(self) -> bool {
        matches!(self, Mode::Node | Mode::All)
    }
    /// The mode as `--mode` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Controller => "controller",
            Mode::Node => "node",
            Mode::All => "all",
        }
    }
}

/// When the fence extensions (UNPUBLISH_FENCE, FORCE_UNPUBLISH) are advertised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Extensions {
    /// Only to callers that send the `x-fencecsi-extensions` request header
    /// (fencecsi's attacher does): standard COs, sidecars and conformance
    /// suites that reject unknown capability values see a standard driver.
    #[default]
    Negotiated,
    /// To every caller.
    Always,
    /// To nobody (the RPCs still honour `fence`/`force` if sent).
    Never,
}

impl Extensions {
    /// Whether a request with these headers sees the extensions.
    pub fn shown(self, metadata: &tonic::metadata::MetadataMap) -> bool {
        match self {
            Extensions::Always => true,
            Extensions::Never => false,
            Extensions::Negotiated => {
                metadata.contains_key(fencecsi_proto::client::EXTENSIONS_HEADER)
            }
        }
    }
}

pub use fencecsi_cluster::cli::{default_duration, parse_duration, LogFormat};
pub use fencecsi_cluster::http::HttpEndpoint;

/// `--fence-settle`: from 10 ms (a shorter settle gives a late write hardly any
/// time to land) to 1 s. The fence holds the image's lock through its settle,
/// and node attaches and detaches wait at most `locks::NODE_LOCK_WAIT` (2 s)
/// for it: a detach that went ahead without the lock could lose its autoclear.
pub fn parse_fence_settle(s: &str) -> Result<std::time::Duration, String> {
    let d = parse_duration(s)?;
    let (min, max) = (
        std::time::Duration::from_millis(10),
        std::time::Duration::from_secs(1),
    );
    if d < min || d > max {
        return Err(format!("{s:?}: the fence settle must be from 10ms to 1s"));
    }
    Ok(d)
}

/// `--max-freeze`: a duration of at least one second (a freeze shorter than
/// that would refuse even small copies on a busy machine).
pub fn parse_max_freeze(s: &str) -> Result<std::time::Duration, String> {
    let d = parse_duration(s)?;
    if d < std::time::Duration::from_secs(1) {
        return Err(format!("{s:?}: the freeze bound must be at least 1s"));
    }
    Ok(d)
}

/// `--overcommit-ratio`: a finite number, at least 1.
pub fn parse_overcommit_ratio(s: &str) -> Result<f64, String> {
    let r: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number (the over-commit ratio: 1, 1.5, 2, ...)"))?;
    check_overcommit_ratio(r)?;
    Ok(r)
}

fn check_overcommit_ratio(r: f64) -> Result<(), String> {
    if !r.is_finite() || r < 1.0 {
        return Err(format!(
            "the over-commit ratio must be a number of at least 1 (1 = no over-commit), not {r}"
        ));
    }
    if r > 1000.0 {
        return Err(format!(
            "an over-commit ratio of {r} promises practically unlimited space: at most 1000"
        ));
    }
    Ok(())
}

/// `--capacity-reserve`: space of the state dir's filesystem kept out of the capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CapacityReserve {
    /// A share of the filesystem's size, in percent (0 to below 100).
    Percent(f64),
    /// A fixed number of bytes.
    Bytes(u64),
}

impl CapacityReserve {
    /// The reserve on a filesystem of `total` bytes (never more than `total`).
    pub fn bytes_of(self, total: u64) -> u64 {
        match self {
            CapacityReserve::Percent(p) => ((total as f64) * p / 100.0).ceil() as u64,
            CapacityReserve::Bytes(b) => b,
        }
        .min(total)
    }

    fn check(self) -> Result<(), String> {
        match self {
            CapacityReserve::Percent(p) if !p.is_finite() || !(0.0..100.0).contains(&p) => Err(
                format!("a capacity reserve of {p}% is out of range (0% to below 100%)"),
            ),
            _ => Ok(()),
        }
    }
}

impl std::fmt::Display for CapacityReserve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CapacityReserve::Percent(p) => write!(f, "{p}%"),
            CapacityReserve::Bytes(b) => write!(f, "{b}"),
        }
    }
}

/// Parses `--capacity-reserve`: "5%", "0", "2GiB", "512Mi", "10G", "1048576".
/// Size suffixes are powers of 1024 (K, M, G, T, with or without "i" and "B").
pub fn parse_reserve(s: &str) -> Result<CapacityReserve, String> {
    let t = s.trim();
    let bad =
        || format!("{s:?} is not a capacity reserve (a share like \"5%\" or a size like \"2GiB\")");
    if let Some(p) = t.strip_suffix('%') {
        let p: f64 = p.trim().parse().map_err(|_| bad())?;
        let r = CapacityReserve::Percent(p);
        r.check()?;
        return Ok(r);
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let shift = match unit.trim().trim_end_matches('B').trim_end_matches('i') {
        "" => 0,
        "K" | "k" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift)
        .map(CapacityReserve::Bytes)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// The `--help` heading of the flags only the controller plugin reads. The headings are
/// the one place that says which mode reads a flag: [`Config::from_command_line`]
/// refuses a flag under one of them in a mode that would ignore it.
pub const CONTROLLER_FLAGS: &str = "Controller plugin (--mode controller or all)";
/// The `--help` heading of the flags only the node plugin reads.
pub const NODE_FLAGS: &str = "Node plugin (--mode node or all)";

/// fencecsi CSI plugin: volumes are sparse image files under --state-dir,
/// attached on nodes as real loop devices, with a write fence on detach.
#[derive(Debug, Clone, Parser)]
#[command(name = "fencecsi-driver", version, about, long_about = None)]
pub struct Config {
    /// gRPC endpoint to serve on; only unix sockets are supported.
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,

    /// Which CSI services this process serves.
    #[arg(long, value_enum, default_value = "all")]
    pub mode: Mode,

    /// This node's ID as reported by NodeGetInfo (required in node and all modes).
    #[arg(long, env = "NODE_ID", help_heading = NODE_FLAGS)]
    pub node_id: Option<String>,

    /// Where volume images and their metadata live. Controller and node plugins
    /// must see the same directory (and the same kernel) for the fence to hold.
    #[arg(long, default_value = "/var/lib/fencecsi")]
    pub state_dir: PathBuf,

    /// The kubelet root. Staging and target paths must lie below it.
    #[arg(long, default_value = "/var/lib/kubelet", help_heading = NODE_FLAGS)]
    pub kubelet_dir: PathBuf,

    /// CSI driver name reported by GetPluginInfo.
    #[arg(long, default_value = DEFAULT_DRIVER_NAME)]
    pub driver_name: String,

    /// Maximum number of volumes attached to one node (0 = no limit).
    #[arg(long, default_value_t = DEFAULT_MAX_VOLUMES_PER_NODE)]
    pub max_volumes_per_node: i64,

    /// Filesystem used when neither the StorageClass nor the capability names one.
    #[arg(long, default_value = DEFAULT_FS_TYPE, value_parser = ["ext4", "xfs"])]
    pub default_fs_type: String,

    /// Attach loop devices with direct I/O to the image. Off by default:
    /// measured on this project's machines (BENCHMARKS.md, loop I/O matrix),
    /// a buffered loop device does small random writes faster and large
    /// sequential ones slower; durability is the same (a flush on the loop
    /// device fsyncs the image). A volume can choose for itself with the
    /// mutable parameter directIO. The fence holds in both modes.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub direct_io: bool,

    /// When to advertise the fence extension capabilities (numbered 1000).
    #[arg(long, value_enum, default_value_t)]
    pub advertise_extensions: Extensions,

    /// Log format.
    #[arg(long, value_enum, default_value_t)]
    pub log_format: LogFormat,

    /// How often the controller garbage-collects fenced generations no
    /// longer held by any loop device ("10s", "2m", or plain seconds; at least 1s).
    #[arg(long = "gc-interval", default_value = DEFAULT_GC_INTERVAL, value_parser = parse_duration, help_heading = CONTROLLER_FLAGS)]
    pub gc_interval: std::time::Duration,

    /// The longest the controller keeps a volume's filesystem frozen for a
    /// point-in-time copy (snapshot, clone of a volume in use, group snapshot),
    /// its writers blocked: "10s", "500ms", "2m" or plain seconds, at least 1s.
    /// Where the state dir makes reflinks (xfs, btrfs) the freeze lasts one
    /// reflink; elsewhere (ext4) it lasts a full copy of the volume's data, and
    /// a copy that would take longer is stopped, its writers let go, and the
    /// call refused (FAILED_PRECONDITION). See `controller::quiesce`.
    #[arg(long = "max-freeze", default_value = DEFAULT_MAX_FREEZE, value_parser = parse_max_freeze, help_heading = CONTROLLER_FLAGS)]
    pub max_freeze: std::time::Duration,

    /// How long a fence keeps each device shrunk in place before it moves the
    /// device's window into the trailer, from 10ms to 1s ("250ms", "1s"). A
    /// write that passed the block layer's end check before the shrink but
    /// reaches the device's queue only after the move (its task held off a
    /// CPU that long: a pod throttled at its CPU limit waits up to a CFS
    /// period, 100 ms in Kubernetes) is reported done to the fenced node and
    /// is not in the volume. The counter fencecsi_driver_fence_late_writes_total
    /// shows when that happened: raise this then. Every fence takes this long
    /// more. Both plugins fence: the controller on detach, the node plugin its
    /// own device when a fence overtook its attach.
    #[arg(long = "fence-settle", default_value = DEFAULT_FENCE_SETTLE, value_parser = parse_fence_settle)]
    pub fence_settle: std::time::Duration,

    /// Node return: how often the node plugin looks for volumes whose attachment was
    /// fenced away from this node and force-releases them (mounts, globalmount dir, loop
    /// device). A pass also runs at start. "10s", "500ms", "2m" or plain seconds; 0 turns
    /// recovery off.
    #[arg(long = "recover-interval", default_value = "10s", value_parser = parse_duration, help_heading = NODE_FLAGS)]
    pub recover_interval: std::time::Duration,

    /// Node return: once nothing fenced is left on this node, write the
    /// fencecsi.io/node-clean annotation on its Node object (podgc lifts the
    /// quarantine only after that). Needs a cluster client: in-cluster config,
    /// or --kubeconfig. Without it the report is only logged.
    #[arg(long, help_heading = NODE_FLAGS)]
    pub report_node_clean: bool,

    /// Renew this node's heartbeat Lease (fencecsi-node-<node> in --heartbeat-namespace)
    /// this often, so podgc sees the node stop within seconds (it acts only when the
    /// node's kubelet does not answer either). Needs a cluster client, as
    /// --report-node-clean. One Lease update per node per interval. 0: no heartbeat.
    #[arg(long, default_value = "0s", value_parser = parse_duration, help_heading = NODE_FLAGS)]
    pub heartbeat_interval: std::time::Duration,

    /// Namespace of the heartbeat Lease; default: the plugin's own (POD_NAMESPACE, else
    /// the service-account namespace file, else "default").
    #[arg(long, env = "POD_NAMESPACE", help_heading = NODE_FLAGS)]
    pub heartbeat_namespace: Option<String>,

    /// Name of this node's Node object, if it differs from --node-id.
    #[arg(long, env = "NODE_NAME", help_heading = NODE_FLAGS)]
    pub node_name: Option<String>,

    /// The API server for --report-node-clean.
    #[command(flatten)]
    pub kube: fencecsi_cluster::cli::KubeArgs,

    /// Node-local state: the identity of the state dir this node last saw (node recovery
    /// refuses to act on another one). Must survive plugin restarts and must not lie in
    /// the state dir. Default: <kubelet-dir>/plugins/<driver-name> (the plugin's socket dir).
    #[arg(long, help_heading = NODE_FLAGS)]
    pub node_state_dir: Option<PathBuf>,

    /// Node recovery refuses to act unless --state-dir is a mount point. Set it when the
    /// state dir is a filesystem of its own on the host (a disk, a network mount) that may
    /// not be mounted yet. (Inside a container a hostPath is always a mount point; there
    /// the state dir's identity is what protects.)
    #[arg(long, help_heading = NODE_FLAGS)]
    pub state_dir_must_be_mount: bool,

    /// Serve /metrics (Prometheus, OpenMetrics text), /healthz and /readyz (what the
    /// Probe RPC answers) on this address: ":9811" (all interfaces), "127.0.0.1:9811" or
    /// "[::1]:9811"; port 0 picks a free port (logged). Unset: no HTTP server.
    #[arg(long)]
    pub http_endpoint: Option<HttpEndpoint>,

    /// Capacity: how many times the backend's usable space (its filesystem's size less
    /// --capacity-reserve) the provisioned volumes may add up to. Images are sparse, so a
    /// ratio above 1 promises space that is not there: once the volumes are written, the
    /// filesystem fills up and writes inside pods fail. 1 (the default) promises only what
    /// every image can get when written in full. A number, at least 1.
    #[arg(long, default_value_t = DEFAULT_OVERCOMMIT_RATIO, value_parser = parse_overcommit_ratio, help_heading = CONTROLLER_FLAGS)]
    pub overcommit_ratio: f64,

    /// Capacity: space of the state dir's filesystem never promised to volumes (metadata,
    /// the fence probe, fence markers, whatever else lives there): a share of the
    /// filesystem's size ("5%") or a size ("2GiB", "512MiB", "10G", plain bytes).
    #[arg(long, default_value_t = DEFAULT_CAPACITY_RESERVE, value_parser = parse_reserve, help_heading = CONTROLLER_FLAGS)]
    pub capacity_reserve: CapacityReserve,

    /// Where the kernel boot ID is read from (the topology value of a new state dir).
    /// Only tests change it, to fake a reboot.
    #[arg(long, default_value = crate::state_id::BOOT_ID_PATH, hide = true)]
    pub boot_id_file: PathBuf,

    // Last: a flattened group's heading carries over to the fields after it.
    /// Controller plugin leadership (several replicas, one serving the state dir): see
    /// `leadership`.
    #[command(flatten, next_help_heading = CONTROLLER_FLAGS)]
    pub election: fencecsi_cluster::cli::LeaderElectionArgs,

    /// This replica's name in the controller plugin's Lease.
    #[command(flatten, next_help_heading = CONTROLLER_FLAGS)]
    pub identity: fencecsi_cluster::cli::IdentityArgs,
}

impl Config {
    /// Parses a command line (the program's name first), refusing a flag that the
    /// chosen mode would ignore: a setting that silently does nothing is a setting the
    /// operator believes in and does not have.
    pub fn from_command_line<I, T>(args: I) -> Result<Config, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::{CommandFactory, FromArgMatches};
        let mut cmd = Config::command();
        let matches = cmd.try_get_matches_from_mut(args)?;
        let cfg = Config::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))?;
        if let Some(why) = flag_the_mode_ignores(&cmd, &matches, cfg.mode) {
            return Err(cmd.error(clap::error::ErrorKind::ArgumentConflict, why));
        }
        Ok(cfg)
    }

    /// Checks what clap cannot: the endpoint scheme and the node ID.
    pub fn validate(&self) -> Result<(), String> {
        self.socket_path()?;
        if self.mode.node() {
            match &self.node_id {
                None => return Err("--node-id is required in node and all modes".into()),
                Some(id) => crate::ids::check_token("node ID", id).map_err(|e| e.to_string())?,
            }
        }
        if self.mode.node() && self.node_state_dir().starts_with(&self.state_dir) {
            // It must tell whether the state dir is the right one, so it cannot live there.
            return Err("the node state dir must not lie inside --state-dir".into());
        }
        if self.driver_name.is_empty() || self.driver_name.len() > 63 {
            return Err("--driver-name must be 1-63 characters".into());
        }
        if self.election.enabled && !self.mode.controller() {
            return Err(
                "--leader-election is for the controller plugin (--mode controller)".into(),
            );
        }
        self.election.validate()?;
        check_overcommit_ratio(self.overcommit_ratio)
            .map_err(|e| format!("--overcommit-ratio: {e}"))?;
        self.capacity_reserve
            .check()
            .map_err(|e| format!("--capacity-reserve: {e}"))?;
        Ok(())
    }

    /// Where this node plugin keeps its own state (see `--node-state-dir`).
    pub fn node_state_dir(&self) -> PathBuf {
        self.node_state_dir
            .clone()
            .unwrap_or_else(|| self.kubelet_dir.join("plugins").join(&self.driver_name))
    }

    pub fn socket_path(&self) -> Result<PathBuf, String> {
        let path = self
            .endpoint
            .strip_prefix("unix://")
            .ok_or_else(|| format!("endpoint {:?} must start with unix://", self.endpoint))?;
        if !path.starts_with('/') {
            return Err(format!(
                "endpoint {:?} must name an absolute socket path",
                self.endpoint
            ));
        }
        Ok(PathBuf::from(path))
    }

    /// A configuration for tests and the local drill.
    pub fn local(
        mode: Mode,
        node_id: Option<&str>,
        state_dir: PathBuf,
        kubelet_dir: PathBuf,
        socket: PathBuf,
    ) -> Self {
        Config {
            endpoint: format!("unix://{}", socket.display()),
            mode,
            node_id: node_id.map(str::to_string),
            state_dir,
            kubelet_dir,
            driver_name: DEFAULT_DRIVER_NAME.to_string(),
            max_volumes_per_node: DEFAULT_MAX_VOLUMES_PER_NODE,
            default_fs_type: DEFAULT_FS_TYPE.into(),
            direct_io: false,
            advertise_extensions: Extensions::default(),
            log_format: LogFormat::default(),
            gc_interval: default_duration(DEFAULT_GC_INTERVAL),
            max_freeze: default_duration(DEFAULT_MAX_FREEZE),
            fence_settle: default_duration(DEFAULT_FENCE_SETTLE),
            // Off for tests and embedders unless they ask: a background pass would race
            // with tests that drive NodeUnpublish/NodeUnstage of fenced volumes themselves.
            recover_interval: std::time::Duration::ZERO,
            report_node_clean: false,
            heartbeat_interval: std::time::Duration::ZERO,
            heartbeat_namespace: None,
            node_name: None,
            kube: Default::default(),
            election: Default::default(),
            identity: Default::default(),
            node_state_dir: None,
            state_dir_must_be_mount: false,
            http_endpoint: None,
            overcommit_ratio: DEFAULT_OVERCOMMIT_RATIO,
            capacity_reserve: DEFAULT_CAPACITY_RESERVE,
            boot_id_file: PathBuf::from(crate::state_id::BOOT_ID_PATH),
        }
    }
}

/// A flag given on the command line whose heading names a mode other than `mode` (the
/// first in declaration order). One given through the environment is left alone: a
/// pod's environment is shared by its containers' conventions, not aimed at this one.
fn flag_the_mode_ignores(
    cmd: &clap::Command,
    matches: &clap::ArgMatches,
    mode: Mode,
) -> Option<String> {
    cmd.get_arguments().find_map(|arg| {
        let (read, reader) = match arg.get_help_heading() {
            Some(CONTROLLER_FLAGS) => (mode.controller(), "controller"),
            Some(NODE_FLAGS) => (mode.node(), "node"),
            _ => return None,
        };
        let given = matches.value_source(arg.get_id().as_str())
            == Some(clap::parser::ValueSource::CommandLine);
        (given && !read).then(|| {
            format!(
                "--{} is read by the {reader} plugin only, and this is --mode {}: drop it",
                arg.get_long().unwrap_or_else(|| arg.get_id().as_str()),
                mode.name()
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overcommit_ratio_is_a_number_of_at_least_one() {
        assert_eq!(parse_overcommit_ratio("1").unwrap(), 1.0);
        assert_eq!(parse_overcommit_ratio(" 2.5 ").unwrap(), 2.5);
        for bad in ["0.5", "0", "-1", "NaN", "inf", "two", "", "1e9"] {
            let e = parse_overcommit_ratio(bad).expect_err(bad);
            assert!(
                e.contains("ratio") || e.contains("at most"),
                "{bad}: unclear error {e}"
            );
        }
    }

    #[test]
    fn capacity_reserve_is_a_share_or_a_size() {
        use CapacityReserve::*;
        assert_eq!(parse_reserve("5%").unwrap(), Percent(5.0));
        assert_eq!(parse_reserve("0.5 %").unwrap(), Percent(0.5));
        assert_eq!(parse_reserve("0").unwrap(), Bytes(0));
        assert_eq!(parse_reserve("1048576").unwrap(), Bytes(1 << 20));
        assert_eq!(parse_reserve("2GiB").unwrap(), Bytes(2 << 30));
        assert_eq!(parse_reserve("512Mi").unwrap(), Bytes(512 << 20));
        assert_eq!(parse_reserve("10G").unwrap(), Bytes(10 << 30));
        assert_eq!(parse_reserve("3KB").unwrap(), Bytes(3 << 10));
        for bad in ["100%", "-1%", "abc", "1.5G", "5X", "", "99999999999T"] {
            assert!(parse_reserve(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(Percent(5.0).bytes_of(1000), 50);
        assert_eq!(Bytes(2000).bytes_of(1000), 1000);
    }

    #[test]
    fn fence_settle_is_a_duration_from_10ms_to_1s() {
        let base = ["fencecsi-driver", "--mode=controller"];
        let cfg = Config::try_parse_from(base).unwrap();
        assert_eq!(cfg.fence_settle, crate::fence::SETTLE);
        let cfg =
            Config::try_parse_from(base.iter().copied().chain(["--fence-settle=1s"])).unwrap();
        assert_eq!(cfg.fence_settle, std::time::Duration::from_secs(1));
        assert!(
            crate::locks::NODE_LOCK_WAIT > std::time::Duration::from_secs(1),
            "the longest settle stays under the node's lock wait"
        );
        for bad in [
            "--fence-settle=0",
            "--fence-settle=5ms",
            "--fence-settle=1500ms",
            "--fence-settle=later",
        ] {
            assert!(
                Config::try_parse_from(base.iter().copied().chain([bad])).is_err(),
                "{bad} accepted"
            );
        }
    }

    #[test]
    fn max_freeze_is_a_duration_of_at_least_a_second() {
        let base = ["fencecsi-driver", "--mode=controller"];
        let cfg = Config::try_parse_from(base).unwrap();
        assert_eq!(cfg.max_freeze, std::time::Duration::from_secs(10));
        let cfg =
            Config::try_parse_from(base.iter().copied().chain(["--max-freeze=1500ms"])).unwrap();
        assert_eq!(cfg.max_freeze, std::time::Duration::from_millis(1500));
        for bad in ["--max-freeze=500ms", "--max-freeze=0", "--max-freeze=soon"] {
            assert!(
                Config::try_parse_from(base.iter().copied().chain([bad])).is_err(),
                "{bad} accepted"
            );
        }
    }

    #[test]
    fn the_local_config_has_the_flags_defaults() {
        let flags = Config::try_parse_from(["fencecsi-driver"]).unwrap();
        let local = Config::local(
            flags.mode,
            None,
            flags.state_dir.clone(),
            flags.kubelet_dir.clone(),
            "/csi/csi.sock".into(),
        );
        assert_eq!(local.driver_name, flags.driver_name);
        assert_eq!(local.max_volumes_per_node, flags.max_volumes_per_node);
        assert_eq!(local.default_fs_type, flags.default_fs_type);
        assert_eq!(local.direct_io, flags.direct_io);
        assert_eq!(local.advertise_extensions, flags.advertise_extensions);
        assert_eq!(local.log_format, flags.log_format);
        assert_eq!(local.gc_interval, flags.gc_interval);
        assert_eq!(local.max_freeze, flags.max_freeze);
        assert_eq!(local.report_node_clean, flags.report_node_clean);
        assert_eq!(local.heartbeat_interval, flags.heartbeat_interval);
        assert_eq!(local.node_state_dir, flags.node_state_dir);
        assert_eq!(local.state_dir_must_be_mount, flags.state_dir_must_be_mount);
        assert_eq!(local.http_endpoint, flags.http_endpoint);
        assert_eq!(local.overcommit_ratio, flags.overcommit_ratio);
        assert_eq!(local.capacity_reserve, flags.capacity_reserve);
        assert_eq!(local.boot_id_file, flags.boot_id_file);
        assert_eq!(local.identity.name, flags.identity.name);
        // The namespace comes from POD_NAMESPACE for the flags, never for `local`.
        let flags_election = fencecsi_cluster::cli::LeaderElectionArgs {
            namespace: None,
            ..flags.election
        };
        assert_eq!(local.election, flags_election);
        // On purpose: no background recovery pass unless a test asks for one.
        assert_eq!(local.recover_interval, std::time::Duration::ZERO);
    }

    #[test]
    fn the_http_endpoint_takes_the_sidecars_form_and_is_off_by_default() {
        let base = ["fencecsi-driver", "--mode=controller"];
        assert_eq!(Config::try_parse_from(base).unwrap().http_endpoint, None);
        let cfg =
            Config::try_parse_from(base.iter().copied().chain(["--http-endpoint=:9811"])).unwrap();
        assert_eq!(cfg.http_endpoint, Some(HttpEndpoint::any(9811)));
        for bad in [
            "--http-endpoint=9811",
            "--http-endpoint=",
            "--http-endpoint=host:1",
        ] {
            assert!(
                Config::try_parse_from(base.iter().copied().chain([bad])).is_err(),
                "{bad} accepted"
            );
        }
    }

    #[test]
    fn a_flag_the_mode_ignores_is_refused_and_named() {
        let parse = |args: &[&str]| {
            Config::from_command_line(["fencecsi-driver"].iter().chain(args))
                .map_err(|e| e.to_string())
        };
        for (args, flag) in [
            (
                &["--mode=node", "--fence-settle=1s", "--gc-interval=5s"][..],
                "--gc-interval",
            ),
            (
                &["--mode=node", "--leader-election=true"][..],
                "--leader-election",
            ),
            (
                &["--mode=node", "--overcommit-ratio=2"][..],
                "--overcommit-ratio",
            ),
            (
                &["--mode=controller", "--recover-interval=5s"][..],
                "--recover-interval",
            ),
            (
                &["--mode=controller", "--kubelet-dir=/k"][..],
                "--kubelet-dir",
            ),
            (&["--mode=controller", "--node-id=n1"][..], "--node-id"),
        ] {
            let err = parse(args).expect_err(flag);
            assert!(
                err.contains(flag) && err.contains("drop it"),
                "{args:?}: {err}"
            );
        }
        // Positive controls: each flag in a mode that reads it, and both in `all`.
        let node = parse(&["--mode=node", "--recover-interval=5s", "--fence-settle=1s"]).unwrap();
        assert_eq!(node.recover_interval, std::time::Duration::from_secs(5));
        let ctl = parse(&["--mode=controller", "--gc-interval=5s"]).unwrap();
        assert_eq!(ctl.gc_interval, std::time::Duration::from_secs(5));
        let all = parse(&["--mode=all", "--gc-interval=5s", "--recover-interval=5s"]).unwrap();
        assert_eq!(
            (all.gc_interval, all.recover_interval),
            (ctl.gc_interval, node.recover_interval)
        );
        // Every flag of one mode carries its heading, so --help says where it belongs.
        let cmd = <Config as clap::CommandFactory>::command();
        let heading = |long: &str| {
            cmd.get_arguments()
                .find(|a| a.get_long() == Some(long))
                .and_then(|a| a.get_help_heading())
        };
        // Pinned both ways: a heading that leaks onto a later field (a flattened group's
        // carries over) would make a mode refuse a flag it reads.
        let under = |h: &str| -> Vec<&str> {
            let mut v: Vec<&str> = cmd
                .get_arguments()
                .filter(|a| a.get_help_heading() == Some(h))
                .filter_map(|a| a.get_long())
                .collect();
            v.sort_unstable();
            v
        };
        assert_eq!(
            under(CONTROLLER_FLAGS),
            [
                "capacity-reserve",
                "gc-interval",
                "identity",
                "leader-election",
                "leader-election-follow",
                "leader-election-lease-duration",
                "leader-election-lease-name",
                "leader-election-namespace",
                "leader-election-renew-deadline",
                "leader-election-retry-period",
                "leader-election-unhealthy-after",
                "max-freeze",
                "overcommit-ratio",
            ]
        );
        assert_eq!(
            under(NODE_FLAGS),
            [
                "heartbeat-interval",
                "heartbeat-namespace",
                "kubelet-dir",
                "node-id",
                "node-name",
                "node-state-dir",
                "recover-interval",
                "report-node-clean",
                "state-dir-must-be-mount",
            ]
        );
        for shared in [
            "endpoint",
            "mode",
            "state-dir",
            "driver-name",
            "max-volumes-per-node",
            "default-fs-type",
            "direct-io",
            "advertise-extensions",
            "log-format",
            "fence-settle",
            "kubeconfig",
            "http-endpoint",
            "boot-id-file",
        ] {
            assert_eq!(heading(shared), None, "--{shared} is read by both modes");
        }
    }

    #[test]
    fn the_flags_parse_and_validate() {
        let base = ["fencecsi-driver", "--mode=controller"];
        let cfg = Config::try_parse_from(base).unwrap();
        assert_eq!(cfg.overcommit_ratio, 1.0);
        assert_eq!(cfg.capacity_reserve, CapacityReserve::Percent(5.0));
        let cfg = Config::try_parse_from(
            base.iter()
                .copied()
                .chain(["--overcommit-ratio=2", "--capacity-reserve=1GiB"]),
        )
        .unwrap();
        assert_eq!(cfg.overcommit_ratio, 2.0);
        assert_eq!(cfg.capacity_reserve, CapacityReserve::Bytes(1 << 30));
        let err = Config::try_parse_from(base.iter().copied().chain(["--overcommit-ratio=0.9"]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("at least 1"), "{err}");
        let mut cfg = Config::try_parse_from(base).unwrap();
        cfg.overcommit_ratio = 0.5;
        assert!(cfg.validate().unwrap_err().contains("--overcommit-ratio"));
    }
}
