//! Command-line configuration of the plugin.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};

pub const DEFAULT_DRIVER_NAME: &str = "loop.fencecsi.io";

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
}

/// When the fence extensions (UNPUBLISH_FENCE, FORCE_UNPUBLISH) are advertised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Extensions {
    /// Only to callers that send the `x-fencecsi-extensions` request header
    /// (fencecsi's attacher does): standard COs, sidecars and conformance
    /// suites that reject unknown capability values see a standard driver.
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

pub use fencecsi_cluster::cli::{parse_duration, LogFormat};

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
    #[arg(long, env = "NODE_ID")]
    pub node_id: Option<String>,

    /// Where volume images and their metadata live. Controller and node plugins
    /// must see the same directory (and the same kernel) for the fence to hold.
    #[arg(long, default_value = "/var/lib/fencecsi")]
    pub state_dir: PathBuf,

    /// The kubelet root. Staging and target paths must lie below it.
    #[arg(long, default_value = "/var/lib/kubelet")]
    pub kubelet_dir: PathBuf,

    /// CSI driver name reported by GetPluginInfo.
    #[arg(long, default_value = DEFAULT_DRIVER_NAME)]
    pub driver_name: String,

    /// Maximum number of volumes attached to one node (0 = no limit).
    #[arg(long, default_value_t = 64)]
    pub max_volumes_per_node: i64,

    /// Filesystem used when neither the StorageClass nor the capability names one.
    #[arg(long, default_value = "ext4", value_parser = ["ext4", "xfs"])]
    pub default_fs_type: String,

    /// Attach loop devices with direct I/O to the image. Off by default:
    /// measured on this project's machines, a buffered loop device does
    /// random 4 KiB writes 2-3x faster, and durability is the same (a flush
    /// on the loop device fsyncs the image). The fence holds in both modes.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub direct_io: bool,

    /// When to advertise the fence extension capabilities (numbered 1000).
    #[arg(long, value_enum, default_value = "negotiated")]
    pub advertise_extensions: Extensions,

    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// How often the controller garbage-collects fenced generations no
    /// longer held by any loop device ("10s", "2m", or plain seconds; at least 1s).
    #[arg(long = "gc-interval", alias = "gc-interval-secs", default_value = "10s", value_parser = parse_duration)]
    pub gc_interval: std::time::Duration,

    /// Node return: how often the node plugin looks for volumes whose attachment was
    /// fenced away from this node and force-releases them (mounts, globalmount dir, loop
    /// device). A pass also runs at start. "10s", "500ms", "2m" or plain seconds; 0 turns
    /// recovery off.
    #[arg(long = "recover-interval", default_value = "10s", value_parser = parse_duration)]
    pub recover_interval: std::time::Duration,

    /// Node return: once nothing fenced is left on this node, write the
    /// fencecsi.io/node-clean annotation on its Node object (podgc lifts the
    /// quarantine only after that). Needs a cluster client: in-cluster config,
    /// or --kubeconfig. Without it the report is only logged.
    #[arg(long)]
    pub report_node_clean: bool,

    /// Name of this node's Node object, if it differs from --node-id.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,

    /// Kubeconfig for --report-node-clean (default: in-cluster config, then ~/.kube/config).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<std::path::PathBuf>,

    /// Node-local state: the identity of the state dir this node last saw (node recovery
    /// refuses to act on another one). Must survive plugin restarts and must not lie in
    /// the state dir. Default: <kubelet-dir>/plugins/<driver-name> (the plugin's socket dir).
    #[arg(long)]
    pub node_state_dir: Option<PathBuf>,

    /// Node recovery refuses to act unless --state-dir is a mount point. Set it when the
    /// state dir is a filesystem of its own on the host (a disk, a network mount) that may
    /// not be mounted yet. (Inside a container a hostPath is always a mount point; there
    /// the state dir's identity is what protects.)
    #[arg(long)]
    pub state_dir_must_be_mount: bool,

    /// Serve Prometheus metrics (`GET /metrics`, OpenMetrics text) on this address, e.g.
    /// "0.0.0.0:9811"; port 0 picks a free port (logged). Unset: no HTTP server.
    #[arg(long)]
    pub http_endpoint: Option<std::net::SocketAddr>,

    /// Where the kernel boot ID is read from (the topology value of a new state dir).
    /// Only tests change it, to fake a reboot.
    #[arg(long, default_value = crate::state_id::BOOT_ID_PATH, hide = true)]
    pub boot_id_file: PathBuf,
}

impl Config {
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
            max_volumes_per_node: 64,
            default_fs_type: "ext4".into(),
            direct_io: false,
            advertise_extensions: Extensions::Negotiated,
            log_format: LogFormat::Text,
            gc_interval: std::time::Duration::from_secs(10),
            // Off for tests and embedders unless they ask: a background pass would race
            // with tests that drive NodeUnpublish/NodeUnstage of fenced volumes themselves.
            recover_interval: std::time::Duration::ZERO,
            report_node_clean: false,
            node_name: None,
            kubeconfig: None,
            node_state_dir: None,
            state_dir_must_be_mount: false,
            http_endpoint: None,
            boot_id_file: PathBuf::from(crate::state_id::BOOT_ID_PATH),
        }
    }
}
