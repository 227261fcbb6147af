//! Checks the manifests in deploy/ against the code they deploy.
//!
//! - Every file in deploy/base parses into the k8s-openapi type its apiVersion/kind names,
//!   with no field the API does not know (a typo like `mountPropogation` would otherwise be
//!   dropped silently), and kustomization.yaml lists exactly the files present.
//! - RBAC: [`RBAC`] is the table of what each component calls. The fencecsi rows are read
//!   from attacher/src and podgc/src, and the test scans those sources so that a kind used in
//!   code without a row (or a row for a kind no longer used) fails. Every component's
//!   ClusterRoles/Roles must grant exactly its rows: nothing missing, nothing more.
//! - Flags: every fencecsi container's arguments are checked against the real binaries
//!   (built here, then `--help`), both by name and by letting the binary's own parser read
//!   them; sidecar flags against the sidecars' documented flags.
//! - Paths and names: the CSI socket as the driver serves it, as the sidecars and the
//!   registrar name it and as the volumes mount it; kubelet and state directories; the driver
//!   name in the CSIDriver, the StorageClasses and the code; the safe-detach annotation key.
//! - StorageClass parameters under external-provisioner's own rules (one filesystem key,
//!   only the reserved `csi.storage.k8s.io/` keys it knows), which it checks only when a
//!   PVC is provisioned.
//! - Pod hygiene (resources, probes, shutdown ordering, security contexts, images), the kind
//!   cluster config and the Dockerfile.
//!
//! Nothing here needs a cluster; `kubectl kustomize` is used when kubectl is installed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Once, OnceLock};

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, Namespace, PodSpec, ServiceAccount, Volume};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::Resource;
use serde_json::Value;

use fencecsi_cluster::well_known;

/// Namespace of everything fencecsi runs.
const NS: &str = "fencecsi";
const CONTROLLER: &str = "fencecsi-controller";
const NODE: &str = "fencecsi-node";
const FENCECSI_BINARIES: [&str; 3] = ["fencecsi-driver", "fencecsi-attacher", "fencecsi-podgc"];

// ---------------------------------------------------------------------------------------
// The RBAC table
// ---------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Scope {
    /// ClusterRole + ClusterRoleBinding.
    Cluster,
    /// Role + RoleBinding in this namespace.
    Ns(&'static str),
}
use Scope::{Cluster, Ns};

/// (component, scope, apiGroup, resource[/subresource], verbs).
///
/// fencecsi's rows come from reading the code (the seam's calls map to verbs: get/get_opt →
/// get; list/list_filtered → list; watch → list + watch; create → create; replace → update;
/// replace_status → update on <resource>/status; patch_metadata → get + patch; patch_merge →
/// patch; delete →
/// delete). LeaderElector: get, create, replace on a Lease in its namespace. EventRecorder
/// (kube-runtime's recorder on a real cluster): create of an events.k8s.io/v1 Event in the
/// regarded object's namespace, and a merge patch when a repeat extends its series.
///
/// The sidecars' rows are what they need with the flags controller.yaml gives them, from
/// their documented RBAC (client-go's LeaseLock uses get/create/update, its event recorder
/// create/update/patch of core events).
#[rustfmt::skip]
const RBAC: &[(&str, Scope, &str, &str, &[&str])] = &[
    // fencecsi-attacher — attacher/src/reconcile.rs, run.rs
    ("attacher", Cluster, "storage.k8s.io", "volumeattachments", &["get", "list", "watch", "patch"]),
    ("attacher", Cluster, "storage.k8s.io", "volumeattachments/status", &["update"]),
    ("attacher", Cluster, "", "persistentvolumes", &["get", "list", "patch"]),
    ("attacher", Cluster, "", "nodes", &["get"]),
    ("attacher", Cluster, "storage.k8s.io", "csinodes", &["get"]),
    ("attacher", Cluster, "events.k8s.io", "events", &["create", "patch"]),
    ("attacher", Ns(NS), "coordination.k8s.io", "leases", &["get", "create", "update"]),
    // fencecsi-podgc — podgc/src/controller.rs, volumes.rs
    ("podgc", Cluster, "", "nodes", &["get", "list", "watch", "patch"]),
    ("podgc", Cluster, "", "pods", &["get", "list", "watch", "delete"]),
    ("podgc", Cluster, "", "nodes/status", &["patch"]),
    ("podgc", Cluster, "", "pods/status", &["update"]),
    ("podgc", Cluster, "", "persistentvolumeclaims", &["get"]),
    ("podgc", Cluster, "", "persistentvolumes", &["get"]),
    ("podgc", Cluster, "storage.k8s.io", "volumeattachments", &["list", "watch", "delete"]),
    ("podgc", Cluster, "storage.k8s.io", "csidrivers", &["list", "watch"]),
    ("podgc", Cluster, "events.k8s.io", "events", &["create", "patch"]),
    ("podgc", Ns(NS), "coordination.k8s.io", "leases", &["get", "list", "watch", "create", "update"]),
    ("podgc", Ns(well_known::NODE_LEASE_NAMESPACE), "coordination.k8s.io", "leases", &["get", "list", "watch"]),
    // fencecsi-driver --mode controller --leader-election — driver/src/leadership.rs
    ("controller-plugin", Ns(NS), "coordination.k8s.io", "leases", &["get", "create", "update"]),
    // fencecsi-driver --mode node --report-node-clean — driver/src/node/report.rs
    ("node", Cluster, "", "nodes", &["get", "list", "watch", "patch"]),
    // ... --heartbeat-interval — driver/src/node/heartbeat.rs
    ("node", Ns(NS), "coordination.k8s.io", "leases", &["get", "create", "update"]),
    // external-provisioner v6.3 (--leader-election, --enable-capacity
    // --capacity-ownerref-level=2; Topology and VolumeAttributesClass on by default)
    ("provisioner", Cluster, "", "persistentvolumes", &["get", "list", "watch", "create", "patch", "delete"]),
    ("provisioner", Cluster, "", "persistentvolumeclaims", &["get", "list", "watch", "update"]),
    ("provisioner", Cluster, "storage.k8s.io", "storageclasses", &["get", "list", "watch"]),
    ("provisioner", Cluster, "storage.k8s.io", "csinodes", &["get", "list", "watch"]),
    ("provisioner", Cluster, "", "nodes", &["get", "list", "watch"]),
    ("provisioner", Cluster, "storage.k8s.io", "volumeattachments", &["get", "list", "watch"]),
    // v6.2+: a finalizer on the source VolumeSnapshot while provisioning from it (get, update);
    // v6.3: an informer and sweep that drop orphaned ones (list, watch, update).
    ("provisioner", Cluster, "snapshot.storage.k8s.io", "volumesnapshots", &["get", "list", "watch", "update"]),
    ("provisioner", Cluster, "snapshot.storage.k8s.io", "volumesnapshotcontents", &["get", "list"]),
    // VolumeAttributesClass (GA in v6): a PVC's VAC parameters become CreateVolume's
    // mutable_parameters (StorageV1().VolumeAttributesClasses().Get).
    ("provisioner", Cluster, "storage.k8s.io", "volumeattributesclasses", &["get"]),
    ("provisioner", Cluster, "", "events", &["create", "update", "patch"]),
    ("provisioner", Ns(NS), "coordination.k8s.io", "leases", &["get", "create", "update"]),
    ("provisioner", Ns(NS), "storage.k8s.io", "csistoragecapacities", &["list", "watch", "create", "update", "delete"]),
    ("provisioner", Ns(NS), "", "pods", &["get"]),
    ("provisioner", Ns(NS), "apps", "replicasets", &["get"]),
    // external-resizer v2.2 (--leader-election; VolumeAttributesClass on by default)
    ("resizer", Cluster, "", "persistentvolumes", &["get", "list", "watch", "patch"]),
    ("resizer", Cluster, "", "persistentvolumeclaims", &["get", "list", "watch"]),
    ("resizer", Cluster, "", "persistentvolumeclaims/status", &["patch"]),
    ("resizer", Cluster, "", "pods", &["get", "list", "watch"]),
    ("resizer", Cluster, "storage.k8s.io", "volumeattributesclasses", &["get", "list", "watch"]),
    ("resizer", Cluster, "", "events", &["create", "update", "patch"]),
    ("resizer", Ns(NS), "coordination.k8s.io", "leases", &["get", "create", "update"]),
    // csi-snapshotter v8.6 (--leader-election; no group snapshots)
    ("snapshotter", Cluster, "snapshot.storage.k8s.io", "volumesnapshotclasses", &["get", "list", "watch"]),
    ("snapshotter", Cluster, "snapshot.storage.k8s.io", "volumesnapshotcontents", &["get", "list", "watch", "update", "patch"]),
    ("snapshotter", Cluster, "snapshot.storage.k8s.io", "volumesnapshotcontents/status", &["update", "patch"]),
    ("snapshotter", Cluster, "", "events", &["create", "update", "patch"]),
    ("snapshotter", Ns(NS), "coordination.k8s.io", "leases", &["get", "create", "update"]),
    // external-health-monitor-controller v0.18 (--leader-election; node watcher off, so no
    // pods or nodes): informers on PVs, PVCs and events; its event recorder creates and
    // patches (never updates) events.
    ("health-monitor", Cluster, "", "persistentvolumes", &["list", "watch"]),
    ("health-monitor", Cluster, "", "persistentvolumeclaims", &["list", "watch"]),
    ("health-monitor", Cluster, "", "events", &["list", "watch", "create", "patch"]),
    ("health-monitor", Ns(NS), "coordination.k8s.io", "leases", &["get", "create", "update"]),
];

/// Where each component with RBAC runs: (component, workload, container).
const COMPONENTS: &[(&str, &str, &str)] = &[
    ("attacher", CONTROLLER, "fencecsi-attacher"),
    ("podgc", CONTROLLER, "fencecsi-podgc"),
    ("provisioner", CONTROLLER, "csi-provisioner"),
    ("resizer", CONTROLLER, "csi-resizer"),
    ("snapshotter", CONTROLLER, "csi-snapshotter"),
    ("health-monitor", CONTROLLER, "csi-health-monitor"),
    ("node", NODE, "fencecsi-driver"),
    ("controller-plugin", CONTROLLER, "fencecsi-driver"),
];

/// (component, source directory, [(file not counted, why)]).
type CodeDirs = &'static [(
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
)];

/// Which sources each fencecsi component's cluster calls live in (relative to the repo),
/// and which files of those directories are not part of the deployed component.
/// The driver directory is the node plugin's, but for the controller plugin's one cluster
/// client: its leader election (a single file; a file stands for itself).
const CODE: CodeDirs = &[
    ("attacher", "attacher/src", &[]),
    ("podgc", "podgc/src", &[]),
    (
        "node",
        "driver/src",
        &[("leadership.rs", "the controller plugin's leader election")],
    ),
    ("controller-plugin", "driver/src/leadership.rs", &[]),
];

// ---------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------

/// The repository checked: this one, or a copy named by FENCECSI_DEPLOY_TEST_ROOT (to see
/// these tests fail on a deliberately broken copy without touching the real tree).
fn repo_root() -> PathBuf {
    match std::env::var_os("FENCECSI_DEPLOY_TEST_ROOT") {
        Some(root) => PathBuf::from(root),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("deploy/ has a parent")
            .to_path_buf(),
    }
}

fn deploy_dir() -> PathBuf {
    repo_root().join("deploy")
}

fn base_dir() -> PathBuf {
    deploy_dir().join("base")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// All documents of a (multi-document) YAML file.
fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = read(path);
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()))
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

fn yaml_files(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .collect()
}

/// One object of deploy/base and the file it came from.
#[derive(Debug, Clone)]
struct Doc {
    file: String,
    value: Value,
}

impl Doc {
    fn api_version(&self) -> &str {
        self.value["apiVersion"].as_str().unwrap_or("")
    }
    fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or("")
    }
    fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or("")
    }
    fn namespace(&self) -> Option<&str> {
        self.value["metadata"]["namespace"].as_str()
    }
    fn label(&self, key: &str) -> Option<&str> {
        self.value["metadata"]["labels"][key].as_str()
    }
    fn is<K: Resource>(&self) -> bool {
        self.api_version() == K::API_VERSION && self.kind() == K::KIND
    }
    fn typed<K: serde::de::DeserializeOwned>(&self) -> K {
        serde_json::from_value(self.value.clone())
            .unwrap_or_else(|e| panic!("{}: {} {}: {e}", self.file, self.kind(), self.name()))
    }
}

/// Every object in deploy/base (every YAML file except kustomization.yaml).
fn base() -> &'static [Doc] {
    static DOCS: OnceLock<Vec<Doc>> = OnceLock::new();
    DOCS.get_or_init(|| {
        let dir = base_dir();
        let mut docs = Vec::new();
        for file in yaml_files(&dir) {
            if file == "kustomization.yaml" {
                continue;
            }
            for value in yaml_docs(&dir.join(&file)) {
                docs.push(Doc {
                    file: file.clone(),
                    value,
                });
            }
        }
        docs
    })
}

fn all<K: Resource + serde::de::DeserializeOwned>() -> Vec<(Doc, K)> {
    base()
        .iter()
        .filter(|d| d.is::<K>())
        .map(|d| (d.clone(), d.typed::<K>()))
        .collect()
}

fn one<K: Resource + serde::de::DeserializeOwned>(name: &str) -> K {
    let found: Vec<_> = all::<K>()
        .into_iter()
        .filter(|(d, _)| d.name() == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected exactly one {} {name} in deploy/base",
        K::KIND
    );
    found.into_iter().next().unwrap().1
}

fn controller() -> Deployment {
    one::<Deployment>(CONTROLLER)
}

fn node() -> DaemonSet {
    one::<DaemonSet>(NODE)
}

fn pod_spec_of_deployment(d: &Deployment) -> PodSpec {
    d.spec
        .template
        .spec
        .clone()
        .expect("Deployment has a pod spec")
}

fn pod_spec_of_daemonset(d: &DaemonSet) -> PodSpec {
    d.spec
        .template
        .spec
        .clone()
        .expect("DaemonSet has a pod spec")
}

/// The two pods: (workload name, pod spec).
fn pods() -> Vec<(&'static str, PodSpec)> {
    vec![
        (CONTROLLER, pod_spec_of_deployment(&controller())),
        (NODE, pod_spec_of_daemonset(&node())),
    ]
}

fn container<'a>(pod: &'a PodSpec, name: &str) -> &'a Container {
    pod.containers
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn args(c: &Container) -> Vec<String> {
    c.args.clone().unwrap_or_default()
}

/// The value of `--flag=value` (or `--flag value`) in a container's args.
fn flag(c: &Container, name: &str) -> Option<String> {
    let a = args(c);
    let long = format!("--{name}");
    for (i, arg) in a.iter().enumerate() {
        if let Some(v) = arg.strip_prefix(&format!("{long}=")) {
            return Some(v.to_string());
        }
        if *arg == long {
            return Some(
                a.get(i + 1)
                    .filter(|n| !n.starts_with('-'))
                    .cloned()
                    .unwrap_or_default(),
            );
        }
    }
    None
}

/// The fencecsi binary a container runs, if any.
fn fencecsi_binary(c: &Container) -> Option<&str> {
    let cmd = c.command.as_ref()?.first()?;
    FENCECSI_BINARIES
        .iter()
        .copied()
        .find(|b| cmd == b || cmd.ends_with(&format!("/{b}")))
}

fn driver_container(pod: &PodSpec) -> &Container {
    let found: Vec<_> = pod
        .containers
        .iter()
        .filter(|c| fencecsi_binary(c) == Some("fencecsi-driver"))
        .collect();
    assert_eq!(found.len(), 1, "a pod must run exactly one fencecsi-driver");
    found[0]
}

fn volume<'a>(pod: &'a PodSpec, name: &str) -> &'a Volume {
    pod.volumes
        .as_ref()
        .and_then(|v| v.iter().find(|v| v.name == name))
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// The volume a container mounts at `path`.
fn mounted_at<'a>(pod: &'a PodSpec, c: &Container, path: &str) -> Option<&'a Volume> {
    let m = c
        .volume_mounts
        .as_ref()?
        .iter()
        .find(|m| m.mount_path == path)?;
    Some(volume(pod, &m.name))
}

fn host_path(v: &Volume) -> Option<&str> {
    v.host_path.as_ref().map(|h| h.path.as_str())
}

fn socket_path(endpoint: &str) -> String {
    let p = endpoint.strip_prefix("unix://").unwrap_or(endpoint);
    assert!(
        p.starts_with('/'),
        "{endpoint:?} must name an absolute unix socket path"
    );
    p.to_string()
}

fn parent(path: &str) -> &str {
    Path::new(path)
        .parent()
        .and_then(|p| p.to_str())
        .expect("path has a parent")
}

fn file_name(path: &str) -> &str {
    Path::new(path)
        .file_name()
        .and_then(|p| p.to_str())
        .expect("path has a file name")
}

fn join(dir: &str, rel: &str) -> String {
    Path::new(dir).join(rel).to_string_lossy().into_owned()
}

// ---------------------------------------------------------------------------------------
// The binaries
// ---------------------------------------------------------------------------------------

/// The freshly built fencecsi binary `name`, next to this test executable (as
/// tests/src/lib.rs `driver_binary()` finds it). Builds all three once per run, so their
/// flags are those of the sources under test, not of a stale build.
fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .expect("target dir")
        .to_path_buf();
    static BUILD: Once = Once::new();
    BUILD.call_once(|| {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "--bins"]);
        for b in FENCECSI_BINARIES {
            cmd.args(["-p", b]);
        }
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let out = cmd
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
            .output()
            .expect("running cargo build");
        assert!(
            out.status.success(),
            "building the fencecsi binaries failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
    let bin = dir.join(name);
    assert!(bin.exists(), "{} was not built", bin.display());
    bin
}

struct Help {
    text: String,
    flags: BTreeSet<String>,
    envs: BTreeSet<String>,
}

fn help(name: &str) -> &'static Help {
    static HELPS: OnceLock<BTreeMap<String, Help>> = OnceLock::new();
    let helps = HELPS.get_or_init(|| {
        FENCECSI_BINARIES
            .iter()
            .map(|b| {
                let out = Command::new(binary(b))
                    .arg("--help")
                    .output()
                    .expect("running --help");
                assert!(out.status.success(), "{b} --help failed");
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                (b.to_string(), parse_help(&text))
            })
            .collect()
    });
    &helps[name]
}

/// Long flags from the option lines of clap's help (lines that start with `-`), and the
/// environment variables shown as `[env: NAME=...]`.
fn parse_help(text: &str) -> Help {
    let mut flags = BTreeSet::new();
    let mut envs = BTreeSet::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with('-') {
            for tok in t.split([' ', ',', '=', '<', '[']) {
                if let Some(f) = tok.strip_prefix("--") {
                    let f: String = f
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                        .collect();
                    if !f.is_empty() {
                        flags.insert(f);
                    }
                }
            }
        }
        let mut rest = line;
        while let Some(i) = rest.find("[env: ") {
            rest = &rest[i + 6..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            envs.insert(name);
        }
    }
    Help {
        text: text.to_string(),
        flags,
        envs,
    }
}

/// Environment variables a binary's crate reads itself (`env::var("NAME")`), beside the
/// ones clap shows in --help.
fn env_read_by_code(bin: &str) -> BTreeSet<String> {
    let dir = repo_root()
        .join(bin.trim_start_matches("fencecsi-"))
        .join("src");
    let mut names = BTreeSet::new();
    // Every binary also runs the shared command-line helpers (the default identity).
    let shared = repo_root().join("cluster/src/cli.rs");
    for f in rust_files(&dir).into_iter().chain([shared]) {
        let src = production_source(&read(&f));
        for pat in ["env::var(\"", "env::var_os(\""] {
            for piece in src.split(pat).skip(1) {
                names.insert(piece.split('"').next().unwrap_or("").to_string());
            }
        }
    }
    names
}

/// A container's args with `$(VAR)` references replaced by sample values, as the kubelet
/// would expand them.
fn expand(arg: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = arg.to_string();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

/// A container's environment with sample values for downward-API fields.
fn sample_env(c: &Container) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for e in c.env.clone().unwrap_or_default() {
        let v = match (&e.value, &e.value_from) {
            (Some(v), _) => v.clone(),
            (None, Some(from)) => match from.field_ref.as_ref().map(|f| f.field_path.as_str()) {
                Some("metadata.namespace") => NS.to_string(),
                Some("metadata.name") => "fencecsi-controller-abc12".to_string(),
                Some("spec.nodeName") => "kind-worker".to_string(),
                other => panic!(
                    "container {}: env {} from {other:?}: add a sample value",
                    c.name, e.name
                ),
            },
            (None, None) => String::new(),
        };
        env.insert(e.name.clone(), v);
    }
    env
}

// ---------------------------------------------------------------------------------------
// Parsing and kustomization
// ---------------------------------------------------------------------------------------

/// Paths present in `orig` but missing or different in `back` (the object after a round
/// trip through its k8s-openapi type: unknown fields are dropped on the way).
fn lost_fields(orig: &Value, back: &Value, path: &str, out: &mut Vec<String>) {
    match (orig, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let p = format!("{path}.{k}");
                match b.get(k) {
                    Some(w) => lost_fields(v, w, &p, out),
                    None => out.push(p),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, v) in a.iter().enumerate() {
                let p = format!("{path}[{i}]");
                match b.get(i) {
                    Some(w) => lost_fields(v, w, &p, out),
                    None => out.push(p),
                }
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path} ({a} became {b})")),
    }
}

fn round_trip<K: serde::de::DeserializeOwned + serde::Serialize>(doc: &Doc) -> Result<(), String> {
    let typed: K = serde_json::from_value(doc.value.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut lost = Vec::new();
    lost_fields(&doc.value, &back, "", &mut lost);
    if lost.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "fields the Kubernetes API does not know or would change: {lost:?}"
        ))
    }
}

/// Parses `doc` into the k8s-openapi type its apiVersion/kind names. Returns whether the
/// kind is namespaced.
fn parse_typed(doc: &Doc) -> Result<bool, String> {
    macro_rules! kinds {
        ($($ty:ty => $namespaced:expr),* $(,)?) => {
            $(if doc.is::<$ty>() {
                return round_trip::<$ty>(doc).map(|()| $namespaced);
            })*
        };
    }
    kinds! {
        Namespace => false,
        ServiceAccount => true,
        CSIDriver => false,
        StorageClass => false,
        Deployment => true,
        DaemonSet => true,
        PodDisruptionBudget => true,
        ClusterRole => false,
        ClusterRoleBinding => false,
        Role => true,
        RoleBinding => true,
        ValidatingAdmissionPolicy => false,
        ValidatingAdmissionPolicyBinding => false,
    }
    Err("no k8s-openapi type is mapped for this apiVersion/kind (add it to parse_typed)".into())
}

/// The oldest Kubernetes the manifests are for (deploy/README.md says why).
const MIN_KUBERNETES: (u32, u32) = (1, 30);

/// The release from which the API server serves each apiVersion/kind used in deploy/base.
const SERVED_SINCE: &[(&str, &str, (u32, u32))] = &[
    ("v1", "Namespace", (1, 0)),
    ("v1", "ServiceAccount", (1, 0)),
    ("apps/v1", "Deployment", (1, 9)),
    ("apps/v1", "DaemonSet", (1, 9)),
    ("policy/v1", "PodDisruptionBudget", (1, 21)),
    ("rbac.authorization.k8s.io/v1", "ClusterRole", (1, 8)),
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", (1, 8)),
    ("rbac.authorization.k8s.io/v1", "Role", (1, 8)),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", (1, 8)),
    ("storage.k8s.io/v1", "CSIDriver", (1, 18)),
    ("storage.k8s.io/v1", "StorageClass", (1, 6)),
    (
        "admissionregistration.k8s.io/v1",
        "ValidatingAdmissionPolicy",
        (1, 30),
    ),
    (
        "admissionregistration.k8s.io/v1",
        "ValidatingAdmissionPolicyBinding",
        (1, 30),
    ),
];

#[test]
fn every_object_is_served_by_the_oldest_supported_kubernetes() {
    let mut errors = Vec::new();
    for d in base() {
        match SERVED_SINCE
            .iter()
            .find(|(v, k, _)| *v == d.api_version() && *k == d.kind())
        {
            Some((_, _, since)) if *since <= MIN_KUBERNETES => {}
            Some((_, _, since)) => errors.push(format!(
                "{}: {} {} needs Kubernetes {}.{}",
                d.file,
                d.api_version(),
                d.kind(),
                since.0,
                since.1
            )),
            None => errors.push(format!(
                "{}: {} {}: not in SERVED_SINCE",
                d.file,
                d.api_version(),
                d.kind()
            )),
        }
    }
    // The preStop `sleep` handler: 1.29 (PodLifecycleSleepAction, on by default from 1.30).
    for (what, pod) in pods() {
        for c in &pod.containers {
            let sleeps = c
                .lifecycle
                .as_ref()
                .and_then(|l| l.pre_stop.as_ref())
                .is_some_and(|h| h.sleep.is_some());
            if sleeps && MIN_KUBERNETES < (1, 30) {
                errors.push(format!(
                    "{what}/{}: preStop sleep needs Kubernetes 1.30",
                    c.name
                ));
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

#[test]
fn every_base_manifest_parses_into_its_k8s_openapi_type() {
    let docs = base();
    assert!(
        docs.len() >= 20,
        "deploy/base looks empty: {} objects",
        docs.len()
    );
    let mut errors = Vec::new();
    let mut seen = BTreeSet::new();
    for d in docs {
        let what = format!("{}: {} {} {}", d.file, d.api_version(), d.kind(), d.name());
        if d.name().is_empty() {
            errors.push(format!("{what}: no metadata.name"));
        }
        match parse_typed(d) {
            Err(e) => errors.push(format!("{what}: {e}")),
            Ok(true) => {
                // Namespaced: explicit, and fencecsi's unless it is podgc's read access to
                // node heartbeats (kustomization.yaml explains why there is no `namespace:`).
                let allowed = match d.namespace() {
                    Some(NS) => true,
                    Some(ns) if ns == well_known::NODE_LEASE_NAMESPACE => {
                        (d.is::<Role>() || d.is::<RoleBinding>())
                            && d.label("app.kubernetes.io/component") == Some("podgc")
                    }
                    _ => false,
                };
                if !allowed {
                    errors.push(format!(
                        "{what}: namespace {:?} (must be {NS:?})",
                        d.namespace()
                    ));
                }
            }
            Ok(false) => {
                if d.namespace().is_some() {
                    errors.push(format!("{what}: cluster-scoped but has a namespace"));
                }
            }
        }
        if !seen.insert((
            d.kind().to_string(),
            d.namespace().map(str::to_string),
            d.name().to_string(),
        )) {
            errors.push(format!("{what}: defined twice"));
        }
        if d.label("app.kubernetes.io/name") != Some("fencecsi") {
            errors.push(format!("{what}: no app.kubernetes.io/name: fencecsi label"));
        }
    }
    assert!(errors.is_empty(), "deploy/base:\n  {}", errors.join("\n  "));
}

#[test]
fn a_typo_in_a_field_name_is_caught() {
    // The check above relies on the round trip dropping unknown fields: make sure it does.
    let mut d = base()
        .iter()
        .find(|d| d.is::<DaemonSet>())
        .expect("a DaemonSet")
        .clone();
    d.value["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPropogation"] =
        Value::String("Bidirectional".into());
    let err = parse_typed(&d).expect_err("unknown field must be reported");
    assert!(err.contains("mountPropogation"), "{err}");
}

#[test]
fn kustomization_lists_exactly_the_files_present() {
    for dir in [base_dir(), deploy_dir().join("snapshot")] {
        let k = &yaml_docs(&dir.join("kustomization.yaml"))[0];
        assert_eq!(k["kind"], "Kustomization");
        let listed: Vec<String> = k["resources"]
            .as_array()
            .expect("resources list")
            .iter()
            .map(|r| r.as_str().expect("resource is a path").to_string())
            .collect();
        let listed_set: BTreeSet<String> = listed.iter().cloned().collect();
        assert_eq!(
            listed.len(),
            listed_set.len(),
            "{}: a file is listed twice",
            dir.display()
        );
        let mut present = yaml_files(&dir);
        present.remove("kustomization.yaml");
        assert_eq!(
            listed_set,
            present,
            "{}/kustomization.yaml must list exactly the YAML files beside it",
            dir.display()
        );
        // A top-level namespace would move podgc's kube-node-lease Role into fencecsi;
        // name prefixes/suffixes would break the names these tests and the bindings use.
        for key in ["namespace", "namePrefix", "nameSuffix"] {
            assert!(
                k.get(key).is_none(),
                "{}/kustomization.yaml must not set {key}",
                dir.display()
            );
        }
    }
}

/// `kubectl kustomize` (no cluster needed) must accept the base and produce exactly the
/// objects of its files, with their namespaces unchanged.
#[test]
fn kubectl_kustomize_builds_the_base_when_kubectl_is_installed() {
    let out = match Command::new("kubectl")
        .args(["kustomize"])
        .arg(base_dir())
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            eprintln!("SKIPPED: kubectl is not installed ({e}); deploy/base was not run through kustomize");
            return;
        }
    };
    assert!(
        out.status.success(),
        "kubectl kustomize failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let built: BTreeSet<(String, String, String)> =
        serde_saphyr::from_multiple::<Value>(&String::from_utf8_lossy(&out.stdout))
            .expect("kustomize output is YAML")
            .iter()
            .map(|v| {
                (
                    v["kind"].as_str().unwrap_or("").to_string(),
                    v["metadata"]["namespace"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    v["metadata"]["name"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect();
    let ours: BTreeSet<(String, String, String)> = base()
        .iter()
        .map(|d| {
            (
                d.kind().to_string(),
                d.namespace().unwrap_or("").to_string(),
                d.name().to_string(),
            )
        })
        .collect();
    assert_eq!(built, ours);
}

// ---------------------------------------------------------------------------------------
// RBAC
// ---------------------------------------------------------------------------------------

type Grants = BTreeSet<(Scope, String, String, String)>;

fn expected_grants(component: &str) -> Grants {
    let mut g = Grants::new();
    for (c, scope, group, resource, verbs) in RBAC {
        if *c == component {
            for v in *verbs {
                g.insert((
                    *scope,
                    group.to_string(),
                    resource.to_string(),
                    v.to_string(),
                ));
            }
        }
    }
    g
}

fn rule_grants(scope: Scope, rules: &[PolicyRule], what: &str) -> Grants {
    let mut g = Grants::new();
    for r in rules {
        assert!(
            r.non_resource_urls.is_none(),
            "{what}: nonResourceURLs are not expected"
        );
        assert!(
            r.resource_names.as_ref().is_none_or(|n| n.is_empty()),
            "{what}: resourceNames are not part of the table; extend the test first"
        );
        for group in r.api_groups.clone().unwrap_or_default() {
            for res in r.resources.clone().unwrap_or_default() {
                for verb in &r.verbs {
                    assert!(
                        group != "*" && res != "*" && verb != "*",
                        "{what}: wildcards grant more than any component uses"
                    );
                    g.insert((scope, group.clone(), res.clone(), verb.clone()));
                }
            }
        }
    }
    g
}

fn static_ns(ns: &str) -> Scope {
    // Scopes in the table are 'static; map a manifest namespace onto one of them.
    let known: BTreeSet<&'static str> = RBAC
        .iter()
        .filter_map(|(_, s, ..)| match s {
            Ns(n) => Some(*n),
            Cluster => None,
        })
        .collect();
    Ns(known
        .into_iter()
        .find(|n| *n == ns)
        .unwrap_or("<a namespace not in the table>"))
}

/// What the manifests grant each component (by the app.kubernetes.io/component label).
fn granted() -> BTreeMap<String, Grants> {
    let mut out: BTreeMap<String, Grants> = BTreeMap::new();
    for (d, cr) in all::<ClusterRole>() {
        let c = d
            .label("app.kubernetes.io/component")
            .unwrap_or("<no component label>");
        let what = format!("ClusterRole {}", d.name());
        out.entry(c.to_string()).or_default().extend(rule_grants(
            Cluster,
            &cr.rules.unwrap_or_default(),
            &what,
        ));
    }
    for (d, r) in all::<Role>() {
        let c = d
            .label("app.kubernetes.io/component")
            .unwrap_or("<no component label>");
        let what = format!("Role {}/{}", d.namespace().unwrap_or(""), d.name());
        out.entry(c.to_string()).or_default().extend(rule_grants(
            static_ns(d.namespace().unwrap_or("")),
            &r.rules.unwrap_or_default(),
            &what,
        ));
    }
    out
}

fn fmt_grants(g: &Grants) -> String {
    g.iter()
        .map(|(s, group, res, verb)| {
            let scope = match s {
                Cluster => "cluster".to_string(),
                Ns(n) => format!("ns {n}"),
            };
            format!(
                "[{scope}] {}/{res} {verb}",
                if group.is_empty() { "core" } else { group }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[test]
fn every_role_grants_exactly_what_its_component_uses() {
    let granted = granted();
    let components: BTreeSet<&str> = RBAC.iter().map(|r| r.0).collect();
    let mut errors = Vec::new();
    for c in granted.keys() {
        if !components.contains(c.as_str()) {
            errors.push(format!(
                "roles labelled component {c:?}, which the RBAC table does not know"
            ));
        }
    }
    for c in &components {
        let want = expected_grants(c);
        let have = granted.get(*c).cloned().unwrap_or_default();
        let missing: Grants = want.difference(&have).cloned().collect();
        let extra: Grants = have.difference(&want).cloned().collect();
        if !missing.is_empty() {
            errors.push(format!(
                "{c}: not granted but used: {}",
                fmt_grants(&missing)
            ));
        }
        if !extra.is_empty() {
            errors.push(format!(
                "{c}: granted but not in the table (least privilege): {}",
                fmt_grants(&extra)
            ));
        }
    }
    assert!(errors.is_empty(), "RBAC:\n  {}", errors.join("\n  "));
}

#[test]
fn every_role_is_bound_to_the_service_account_its_component_runs_as() {
    let roles: BTreeMap<(String, String, String), String> = base()
        .iter()
        .filter(|d| d.is::<ClusterRole>() || d.is::<Role>())
        .map(|d| {
            (
                (
                    d.kind().to_string(),
                    d.namespace().unwrap_or("").to_string(),
                    d.name().to_string(),
                ),
                d.label("app.kubernetes.io/component")
                    .unwrap_or("")
                    .to_string(),
            )
        })
        .collect();
    let sa_of = |workload: &str| -> String {
        pods()
            .into_iter()
            .find(|(w, _)| *w == workload)
            .and_then(|(_, p)| p.service_account_name)
            .unwrap_or_else(|| panic!("{workload} names no serviceAccountName"))
    };
    let mut bound: BTreeSet<(String, String, String)> = BTreeSet::new();
    let mut check = |binding: &str,
                     ns: &str,
                     role_kind: &str,
                     role: &str,
                     subjects: &[k8s_openapi::api::rbac::v1::Subject]| {
        let role_ns = if role_kind == "Role" { ns } else { "" };
        let key = (role_kind.to_string(), role_ns.to_string(), role.to_string());
        let component = roles.get(&key).unwrap_or_else(|| {
            panic!("{binding} refers to {role_kind} {role}, which deploy/base does not define")
        });
        let (_, workload, container_name) = COMPONENTS
            .iter()
            .find(|(c, ..)| c == component)
            .unwrap_or_else(|| {
                panic!("{role_kind} {role}: component {component:?} runs nowhere (COMPONENTS)")
            });
        let (_, pod) = pods().into_iter().find(|(w, _)| w == workload).unwrap();
        container(&pod, container_name);
        let sa = sa_of(workload);
        let subjects: Vec<(String, String, String)> = subjects
            .iter()
            .map(|s| {
                (
                    s.kind.clone(),
                    s.name.clone(),
                    s.namespace.clone().unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(
            subjects,
            vec![("ServiceAccount".to_string(), sa.clone(), NS.to_string())],
            "{binding} must bind {role_kind} {role} to exactly {NS}/{sa}, the account {container_name} runs as"
        );
        bound.insert(key);
    };
    for (d, b) in all::<ClusterRoleBinding>() {
        assert_eq!(
            b.role_ref.kind,
            "ClusterRole",
            "ClusterRoleBinding {}",
            d.name()
        );
        check(
            &format!("ClusterRoleBinding {}", d.name()),
            "",
            "ClusterRole",
            &b.role_ref.name,
            &b.subjects.unwrap_or_default(),
        );
    }
    for (d, b) in all::<RoleBinding>() {
        assert_eq!(
            b.role_ref.kind,
            "Role",
            "RoleBinding {}: bind Roles only",
            d.name()
        );
        let ns = d.namespace().unwrap_or("");
        check(
            &format!("RoleBinding {ns}/{}", d.name()),
            ns,
            "Role",
            &b.role_ref.name,
            &b.subjects.unwrap_or_default(),
        );
    }
    let unbound: Vec<_> = roles.keys().filter(|k| !bound.contains(*k)).collect();
    assert!(unbound.is_empty(), "roles no binding uses: {unbound:?}");
}

/// Strips full-line comments and everything from the first `#[cfg(test)] mod` on (unit
/// tests use kinds production code does not).
fn production_source(src: &str) -> String {
    let lines: Vec<&str> = src.lines().collect();
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim() == "#[cfg(test)]" {
            let next = lines[i + 1..]
                .iter()
                .map(|l| l.trim())
                .find(|l| !l.is_empty())
                .unwrap_or("");
            if next.starts_with("mod ") || next.starts_with("pub mod ") {
                break;
            }
        }
        if line.trim_start().starts_with("//") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Kinds the source accesses through the seam: `api::<K>`, `Api<K>`, `WatchStream<K>`,
/// plus Lease for a LeaderElector and Event for an EventRecorder.
fn kinds_used(src: &str) -> BTreeSet<String> {
    let mut kinds = BTreeSet::new();
    for pat in ["api::<", "Api<", "WatchStream<"] {
        let mut from = 0;
        while let Some(i) = src[from..].find(pat) {
            let at = from + i;
            from = at + pat.len();
            let before = src[..at].chars().next_back();
            if pat != "api::<" && before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue; // e.g. `MyApi<`
            }
            let name: String = src[from..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                kinds.insert(name);
            }
        }
    }
    if src.contains("LeaderElector") {
        kinds.insert("Lease".into());
    }
    if src.contains("EventRecorder") {
        kinds.insert("Event".into());
    }
    kinds
}

/// apiGroup and resource of a kind the seam can access.
fn kind_resource(kind: &str) -> Option<(&'static str, &'static str)> {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
    use k8s_openapi::api::events::v1::Event;
    use k8s_openapi::api::storage::v1::{CSINode, VolumeAttachment};
    fn gr<K: Resource>() -> (&'static str, &'static str) {
        (K::GROUP, K::URL_PATH_SEGMENT)
    }
    Some(match kind {
        "Node" => gr::<Node>(),
        "Pod" => gr::<Pod>(),
        "PersistentVolume" => gr::<PersistentVolume>(),
        "PersistentVolumeClaim" => gr::<PersistentVolumeClaim>(),
        "VolumeAttachment" => gr::<VolumeAttachment>(),
        "CSINode" => gr::<CSINode>(),
        "CSIDriver" => gr::<CSIDriver>(),
        "StorageClass" => gr::<StorageClass>(),
        "Lease" => gr::<Lease>(),
        // The seam's events are events.k8s.io/v1 (fencecsi-cluster's EventRecorder).
        "Event" => gr::<Event>(),
        "Namespace" => gr::<Namespace>(),
        "ServiceAccount" => gr::<ServiceAccount>(),
        _ => return None,
    })
}

/// Seam calls whose verb a component's table rows must include somewhere: a cheap guard
/// for a new kind of call on a kind already covered (e.g. a first delete).
const CALL_VERBS: &[(&str, &str)] = &[
    (".watch(", "watch"),
    (".list(", "list"),
    (".list_filtered(", "list"),
    (".patch_metadata(", "patch"),
    (".patch_merge(", "patch"),
    (".patch_status_merge(", "patch"),
    (".replace_status(", "update"),
    (".delete(", "delete"),
    (".create(", "create"),
];

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    if dir.is_file() {
        return vec![dir.to_path_buf()];
    }
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

#[test]
fn the_rbac_table_covers_every_kind_the_code_uses() {
    let mut errors = Vec::new();
    for (component, dir, skipped) in CODE {
        let dir_path = repo_root().join(dir);
        let mut kinds = BTreeSet::new();
        let mut verbs = BTreeSet::new();
        for file in rust_files(&dir_path) {
            let rel = file
                .strip_prefix(&dir_path)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let src = read(&file);
            if let Some((_, why)) = skipped.iter().find(|(f, _)| *f == rel) {
                eprintln!("{component}: not counted: {dir}/{rel} ({why})");
                continue;
            }
            let src = production_source(&src);
            for k in kinds_used(&src) {
                kinds.insert((k, format!("{dir}/{rel}")));
            }
            for (call, verb) in CALL_VERBS {
                if src.contains(call) && src.contains("fencecsi_cluster") {
                    verbs.insert((verb.to_string(), format!("{dir}/{rel}")));
                }
            }
        }
        let in_table: BTreeSet<(String, String)> = RBAC
            .iter()
            .filter(|r| r.0 == *component)
            .map(|r| (r.2.to_string(), r.3.split('/').next().unwrap().to_string()))
            .collect();
        let mut in_code = BTreeSet::new();
        for (k, file) in &kinds {
            match kind_resource(k) {
                None => errors.push(format!(
                    "{component}: {file} uses kind {k}, which kind_resource() does not map: map it and add RBAC rows"
                )),
                Some((g, r)) => {
                    in_code.insert((g.to_string(), r.to_string()));
                    if !in_table.contains(&(g.to_string(), r.to_string())) {
                        errors.push(format!(
                            "{component}: {file} uses {k} ({g}/{r}) but the RBAC table (and so the ClusterRole) has no row for it"
                        ));
                    }
                }
            }
        }
        for (g, r) in in_table.difference(&in_code) {
            errors.push(format!(
                "{component}: the RBAC table grants {g}/{r}, which the code no longer uses"
            ));
        }
        let table_verbs: BTreeSet<&str> = RBAC
            .iter()
            .filter(|r| r.0 == *component)
            .flat_map(|r| r.4.iter().copied())
            .collect();
        for (verb, file) in &verbs {
            if !table_verbs.contains(verb.as_str()) {
                errors.push(format!("{component}: {file} makes a `{verb}` call, which no RBAC row of {component} grants"));
            }
        }
    }
    assert!(
        errors.is_empty(),
        "RBAC table vs code:\n  {}",
        errors.join("\n  ")
    );
}

/// In the node pod only the node plugin calls the API server (its clean report). The pod
/// mounts no token by default; the driver container alone mounts a projected one where
/// in-cluster clients look for it.
#[test]
fn only_the_node_plugin_gets_an_api_token_in_the_node_pod() {
    const TOKEN_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
    let pod = pod_spec_of_daemonset(&node());
    assert_eq!(pod.service_account_name.as_deref(), Some(NODE));
    assert_eq!(
        pod.automount_service_account_token,
        Some(false),
        "the registrar and livenessprobe need no API token"
    );
    assert_eq!(
        one::<ServiceAccount>(NODE).automount_service_account_token,
        Some(false)
    );
    let driver = driver_container(&pod);
    assert!(
        flag(driver, "report-node-clean").is_some(),
        "without --report-node-clean no node is ever reported clean, and podgc never lifts a quarantine"
    );
    let token_volumes: Vec<&Volume> = pod
        .volumes
        .iter()
        .flatten()
        .filter(|v| {
            v.projected.as_ref().is_some_and(|p| {
                p.sources
                    .iter()
                    .flatten()
                    .any(|s| s.service_account_token.is_some())
            })
        })
        .collect();
    assert_eq!(token_volumes.len(), 1, "one projected token volume");
    let tv = token_volumes[0];
    // What kube-rs's in-cluster configuration reads: token, ca.crt, namespace.
    let mut files = BTreeSet::new();
    for s in tv.projected.as_ref().unwrap().sources.iter().flatten() {
        if let Some(t) = &s.service_account_token {
            files.insert(t.path.clone());
        }
        if let Some(c) = &s.config_map {
            assert_eq!(c.name.as_str(), "kube-root-ca.crt");
            files.extend(c.items.iter().flatten().map(|i| i.path.clone()));
        }
        if let Some(d) = &s.downward_api {
            files.extend(d.items.iter().flatten().map(|i| i.path.clone()));
        }
    }
    assert_eq!(
        files,
        BTreeSet::from(["ca.crt".to_string(), "namespace".into(), "token".into()])
    );
    for c in &pod.containers {
        let mounts: Vec<_> = c
            .volume_mounts
            .iter()
            .flatten()
            .filter(|m| m.name == tv.name)
            .collect();
        if c.name == driver.name {
            assert_eq!(mounts.len(), 1, "the node plugin mounts the token");
            assert_eq!(mounts[0].mount_path, TOKEN_DIR);
            assert_eq!(mounts[0].read_only, Some(true));
        } else {
            assert!(
                mounts.is_empty(),
                "{} mounts the API token but calls no API",
                c.name
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Flags and images
// ---------------------------------------------------------------------------------------

/// The upstream sidecars: (image repository, the release the flags were read from, flags).
/// The flags are a subset of what that release's cmd/*/main.go registers (with
/// csi-lib-utils' standardflags and component-base's logging flags, e.g. `v`): the ones a
/// deployment like this one may use. The manifests may use only these, and only with that
/// release, so a version bump makes someone re-read the new release's flags (removed
/// flags and feature gates are what break on an upgrade).
#[rustfmt::skip]
const SIDECARS: &[(&str, &str, &[&str])] = &[
    // cmd/csi-provisioner/csi-provisioner.go at v6.3.0 (common flags from csi-lib-utils
    // v0.24 standardflags since v6.0).
    ("registry.k8s.io/sig-storage/csi-provisioner", "v6.3.0", &["csi-address", "feature-gates", "leader-election", "leader-election-namespace", "leader-election-lease-duration", "leader-election-renew-deadline", "leader-election-retry-period", "timeout", "v", "extra-create-metadata", "default-fstype", "worker-threads", "http-endpoint", "metrics-path", "strict-topology", "immediate-topology", "retry-interval-start", "retry-interval-max", "enable-capacity", "capacity-ownerref-level", "capacity-poll-interval", "snapshot-orphan-sweep-interval"]),
    // cmd/csi-resizer/main.go at v2.2.1.
    ("registry.k8s.io/sig-storage/csi-resizer", "v2.2.1", &["csi-address", "feature-gates", "leader-election", "leader-election-namespace", "leader-election-lease-duration", "leader-election-renew-deadline", "leader-election-retry-period", "timeout", "v", "workers", "http-endpoint", "metrics-path", "handle-volume-inuse-error", "extra-modify-metadata", "retry-interval-start", "retry-interval-max"]),
    // cmd/csi-snapshotter/main.go at v8.6.0.
    ("registry.k8s.io/sig-storage/csi-snapshotter", "v8.6.0", &["csi-address", "leader-election", "leader-election-namespace", "leader-election-lease-duration", "leader-election-renew-deadline", "leader-election-retry-period", "timeout", "v", "worker-threads", "http-endpoint", "metrics-path", "extra-create-metadata", "retry-interval-start", "retry-interval-max"]),
    // cmd/csi-external-health-monitor-controller/main.go at v0.18.0 (no --feature-gates).
    ("registry.k8s.io/sig-storage/csi-external-health-monitor-controller", "v0.18.0", &["csi-address", "leader-election", "leader-election-namespace", "leader-election-lease-duration", "leader-election-renew-deadline", "leader-election-retry-period", "timeout", "v", "worker-threads", "http-endpoint", "metrics-path", "monitor-interval", "list-volumes-interval", "volume-list-add-interval", "enable-node-watcher"]),
    // cmd/livenessprobe/main.go at v2.19.0.
    ("registry.k8s.io/sig-storage/livenessprobe", "v2.19.0", &["csi-address", "http-endpoint", "probe-timeout", "metrics-path", "v"]),
    // cmd/csi-node-driver-registrar/main.go at v2.17.0.
    ("registry.k8s.io/sig-storage/csi-node-driver-registrar", "v2.17.0", &["csi-address", "kubelet-registration-path", "http-endpoint", "plugin-registration-path", "timeout", "v"]),
];

fn image_repo_tag(image: &str) -> (&str, &str) {
    let (repo, tag) = image.rsplit_once(':').unwrap_or((image, ""));
    if repo.contains('/') || !tag.contains('/') {
        (repo, tag)
    } else {
        (image, "")
    }
}

fn fencecsi_image() -> String {
    format!("fencecsi:{}", env!("CARGO_PKG_VERSION"))
}

#[test]
fn fencecsi_containers_use_only_flags_and_env_the_binaries_accept() {
    let mut errors = Vec::new();
    for (workload, pod) in pods() {
        for c in &pod.containers {
            let Some(bin) = fencecsi_binary(c) else {
                continue;
            };
            let what = format!("{workload}/{}", c.name);
            let h = help(bin);
            if c.command.as_ref().map(Vec::len) != Some(1) {
                errors.push(format!(
                    "{what}: command must be just [{bin}], flags go in args"
                ));
            }
            let env = sample_env(c);
            for a in args(c) {
                match a.strip_prefix("--") {
                    None => errors.push(format!("{what}: argument {a:?} is not a --flag")),
                    Some(f) => {
                        let name = f.split('=').next().unwrap();
                        if !h.flags.contains(name) {
                            errors.push(format!(
                                "{what}: {bin} has no --{name} (its --help lists {:?})",
                                h.flags
                            ));
                        }
                    }
                }
            }
            for name in env.keys() {
                let referenced = args(c).iter().any(|a| a.contains(&format!("$({name})")));
                let read = h.envs.contains(name) || env_read_by_code(bin).contains(name);
                if !read && !referenced && name != "RUST_LOG" {
                    errors.push(format!(
                        "{what}: env {name} is read by nothing ({bin} reads {:?})",
                        h.envs
                    ));
                }
            }
            // Let the binary's own parser read the arguments: clap rejects an unknown flag or
            // a bad value as it meets it, before the final --help ends the run with success.
            let expanded: Vec<String> = args(c).iter().map(|a| expand(a, &env)).collect();
            let out = Command::new(binary(bin))
                .args(&expanded)
                .arg("--help")
                .env_clear()
                .envs(&env)
                .output()
                .expect("running the binary");
            if !out.status.success() {
                errors.push(format!(
                    "{what}: {bin} rejects {expanded:?}:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            // --help ends the parse before the driver refuses a flag its mode ignores.
            if bin == "fencecsi-driver" {
                let line = std::iter::once(bin.to_string()).chain(expanded.iter().cloned());
                if let Err(e) = fencecsi_driver::config::Config::from_command_line(line) {
                    errors.push(format!("{what}: {bin} refuses {expanded:?}: {e}"));
                }
            }
        }
    }
    assert!(
        errors.is_empty(),
        "fencecsi containers:\n  {}",
        errors.join("\n  ")
    );
}

#[test]
fn images_are_pinned_and_sidecars_use_documented_flags() {
    let mut errors = Vec::new();
    for (workload, pod) in pods() {
        for c in &pod.containers {
            let what = format!("{workload}/{}", c.name);
            let image = c.image.clone().unwrap_or_default();
            let (repo, tag) = image_repo_tag(&image);
            if tag.is_empty() || tag == "latest" {
                errors.push(format!(
                    "{what}: image {image:?} must be pinned to a version"
                ));
            }
            if fencecsi_binary(c).is_some() {
                if image != fencecsi_image() {
                    errors.push(format!(
                        "{what}: image {image} (expected {}, the workspace version)",
                        fencecsi_image()
                    ));
                }
                if c.image_pull_policy.as_deref() != Some("IfNotPresent") {
                    errors.push(format!("{what}: imagePullPolicy IfNotPresent (the image is loaded into kind, not pulled)"));
                }
                continue;
            }
            let Some((_, version, flags)) = SIDECARS.iter().find(|(r, ..)| *r == repo) else {
                errors.push(format!(
                    "{what}: image {image} is neither fencecsi nor a known sidecar"
                ));
                continue;
            };
            if tag != *version {
                errors.push(format!(
                    "{what}: image {image}, but SIDECARS lists the flags of {repo}:{version}: check the new release's flags (cmd/*/main.go, CHANGELOG) and update SIDECARS"
                ));
            }
            if c.command.is_some() {
                errors.push(format!("{what}: keep the sidecar image's entrypoint"));
            }
            for a in args(c) {
                let name = a
                    .trim_start_matches('-')
                    .split('=')
                    .next()
                    .unwrap()
                    .to_string();
                if !a.starts_with("--") || !flags.contains(&name.as_str()) {
                    errors.push(format!("{what}: {a:?} is not a documented flag of {repo}"));
                }
            }
        }
    }
    let pod = pod_spec_of_deployment(&controller());
    // Topology is GA and on by default in v6 (SIDECARS pins the version); the driver reports
    // topology, so it must not be switched off. Likewise VolumeAttributesClass in the
    // provisioner and resizer: it switches itself off where the API server has no v1 VAC,
    // and forcing it either way is wrong on some supported Kubernetes (deploy/README.md).
    for (name, gate) in [
        ("csi-provisioner", "Topology"),
        ("csi-provisioner", "VolumeAttributesClass"),
        ("csi-resizer", "VolumeAttributesClass"),
    ] {
        let gates = flag(container(&pod, name), "feature-gates").unwrap_or_default();
        assert!(
            !gates.split(',').any(|f| f.split('=').next() == Some(gate)),
            "{name}: leave the {gate} feature gate at its default (--feature-gates={gates})"
        );
    }
    // Election is off unless asked, in the sidecars and in fencecsi's own binaries alike.
    for name in [
        "csi-provisioner",
        "csi-resizer",
        "csi-snapshotter",
        "csi-health-monitor",
        "fencecsi-attacher",
        "fencecsi-podgc",
    ] {
        let v = flag(container(&pod, name), "leader-election");
        assert!(
            matches!(v.as_deref(), Some("") | Some("true")),
            "{name} must run --leader-election"
        );
    }
    // The Go sidecars' elections, and the Leases of fencecsi's followers of the plugin's
    // Lease, move off a failed pod within the controller's 20 s bound: a candidate sees the
    // leader's last renewal up to one poll (retry period, jittered by up to 1.2x in the
    // sidecars) late, waits the Lease out, then takes it at its next poll. (A follower also
    // waits for the plugin's Lease, which a killed leader's standby takes within seconds and
    // an expired one within 15 s plus a poll: the e2e suite measures the sum.)
    for name in [
        "csi-provisioner",
        "csi-resizer",
        "csi-snapshotter",
        "csi-health-monitor",
        "fencecsi-attacher",
        "fencecsi-podgc",
    ] {
        let secs = |f: &str| {
            let v = flag(container(&pod, name), f)
                .unwrap_or_else(|| panic!("{name}: --{f} must be set (the default is too slow)"));
            v.strip_suffix('s')
                .and_then(|n| n.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{name}: --{f}={v} is not whole seconds"))
        };
        let (lease, renew, retry) = (
            secs("leader-election-lease-duration"),
            secs("leader-election-renew-deadline"),
            secs("leader-election-retry-period"),
        );
        assert!(
            retry < renew && renew < lease,
            "{name}: the election needs retry < renew deadline < lease"
        );
        let worst = lease + 2.0 * 1.2 * retry;
        assert!(
            worst <= 20.0,
            "{name}: its election may take {worst} s to move, over the controller's 20 s bound"
        );
    }
    assert!(
        !pod.containers
            .iter()
            .any(|c| c.image.as_deref().unwrap_or("").contains("csi-attacher")),
        "fencecsi-attacher replaces external-attacher: do not run both"
    );
    assert!(
        errors.is_empty(),
        "images and sidecar flags:\n  {}",
        errors.join("\n  ")
    );
}

/// The controller pod's external-health-monitor-controller container.
const HEALTH_MONITOR: &str = "csi-health-monitor";

/// The controller capabilities the controller plugin advertises, read from the source of
/// `fn capabilities` in driver/src/controller/mod.rs (`RpcType::<Name>` entries).
fn advertised_controller_capabilities() -> BTreeSet<String> {
    let path = repo_root().join("driver/src/controller/mod.rs");
    let src = production_source(&read(&path));
    let start = src
        .find("fn capabilities(")
        .unwrap_or_else(|| panic!("{}: no fn capabilities(", path.display()));
    let body = &src[start..];
    let end = body.find("\n    }\n").unwrap_or(body.len());
    let caps: BTreeSet<String> = body[..end]
        .split("RpcType::")
        .skip(1)
        .map(|t| {
            t.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect();
    assert!(
        caps.contains("CreateDeleteVolume"),
        "{}: could not read the controller capabilities from fn capabilities ({caps:?})",
        path.display()
    );
    caps
}

/// external-health-monitor-controller turns the plugin's VOLUME_CONDITION into PVC events. It
/// exits at start unless the plugin advertises VOLUME_CONDITION and LIST_VOLUMES or
/// GET_VOLUME, so it runs exactly when the plugin advertises those.
#[test]
fn a_health_monitor_runs_exactly_when_the_plugin_reports_volume_condition() {
    let caps = advertised_controller_capabilities();
    let condition = caps.contains("VolumeCondition");
    let pod = pod_spec_of_deployment(&controller());
    let monitors: Vec<&Container> = pod
        .containers
        .iter()
        .filter(|c| {
            c.image
                .as_deref()
                .unwrap_or("")
                .contains("/csi-external-health-monitor-controller:")
        })
        .collect();
    if !condition {
        assert!(
            monitors.is_empty(),
            "the plugin no longer advertises VOLUME_CONDITION: the health monitor would exit at start; remove it (and rbac-health-monitor.yaml)"
        );
        return;
    }
    assert_eq!(
        monitors.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        vec![HEALTH_MONITOR],
        "the plugin advertises VOLUME_CONDITION: the controller pod needs one external-health-monitor-controller, named {HEALTH_MONITOR}"
    );
    assert!(
        caps.contains("ListVolumes") || caps.contains("GetVolume"),
        "the health monitor needs LIST_VOLUMES or GET_VOLUME besides VOLUME_CONDITION ({caps:?})"
    );
    let hm = monitors[0];
    // ListVolumes is what it calls when advertised; --monitor-interval paces only the
    // GetVolume path.
    if caps.contains("ListVolumes") {
        assert!(
            flag(hm, "monitor-interval").is_none(),
            "{HEALTH_MONITOR}: with LIST_VOLUMES, --monitor-interval does nothing; set --list-volumes-interval"
        );
    }
    assert!(
        flag(hm, "enable-node-watcher").is_none_or(|v| v == "false"),
        "{HEALTH_MONITOR}: the node watcher needs pods and nodes RBAC the table does not grant"
    );
}

// ---------------------------------------------------------------------------------------
// Sockets, directories, names
// ---------------------------------------------------------------------------------------

/// The driver's endpoint, every --csi-address and the volumes that carry the socket agree.
#[test]
fn socket_paths_agree_between_driver_sidecars_registrar_and_mounts() {
    let driver_default_endpoint = {
        let h = help("fencecsi-driver");
        assert!(h.flags.contains("endpoint"));
        h.text.clone()
    };
    for (workload, pod) in pods() {
        let driver = driver_container(&pod);
        let endpoint = flag(driver, "endpoint").unwrap_or_else(|| {
            panic!("{workload}: give fencecsi-driver an explicit --endpoint (its default is in:\n{driver_default_endpoint})")
        });
        let sock = socket_path(&endpoint);
        let sock_dir = parent(&sock);
        let sock_volume = mounted_at(&pod, driver, sock_dir)
            .unwrap_or_else(|| panic!("{workload}: fencecsi-driver mounts nothing at {sock_dir}"))
            .name
            .clone();
        let mut clients = 0;
        for c in &pod.containers {
            if c.name == driver.name {
                continue;
            }
            let mounts_socket_volume = c
                .volume_mounts
                .as_ref()
                .is_some_and(|ms| ms.iter().any(|m| m.name == sock_volume));
            let Some(addr) = flag(c, "csi-address") else {
                assert!(
                    !mounts_socket_volume,
                    "{workload}/{}: mounts the socket volume but names no --csi-address",
                    c.name
                );
                continue;
            };
            clients += 1;
            let a = socket_path(&addr);
            assert_eq!(
                a, sock,
                "{workload}/{}: --csi-address {addr} is not the driver's {endpoint}",
                c.name
            );
            let v = mounted_at(&pod, c, parent(&a)).unwrap_or_else(|| {
                panic!("{workload}/{}: nothing mounted at {}", c.name, parent(&a))
            });
            assert_eq!(
                v.name,
                sock_volume,
                "{workload}/{}: {} is not the driver's socket volume",
                c.name,
                parent(&a)
            );
        }
        assert!(
            clients >= 2,
            "{workload}: expected the sidecars to name the socket"
        );

        if workload == NODE {
            let kubelet = flag(driver, "kubelet-dir").expect("node driver: explicit --kubelet-dir");
            let v = volume(&pod, &sock_volume);
            let host_dir = host_path(v).expect("node socket dir is a hostPath");
            let name = fencecsi_driver::config::DEFAULT_DRIVER_NAME;
            assert_eq!(
                host_dir,
                join(&kubelet, &format!("plugins/{name}")),
                "the kubelet looks for plugin sockets in <kubelet>/plugins/<driver>"
            );
            let reg = container(&pod, "node-driver-registrar");
            assert_eq!(
                flag(reg, "kubelet-registration-path").as_deref(),
                Some(join(host_dir, file_name(&sock)).as_str()),
                "--kubelet-registration-path must be the driver's socket as the host sees it"
            );
            let reg_dir =
                mounted_at(&pod, reg, "/registration").expect("registrar mounts /registration");
            assert_eq!(
                host_path(reg_dir),
                Some(join(&kubelet, "plugins_registry").as_str())
            );
        } else {
            assert!(
                volume(&pod, &sock_volume).empty_dir.is_some(),
                "{workload}: the socket dir is a pod-local emptyDir"
            );
        }
    }
}

#[test]
fn kubelet_state_and_device_directories_are_mounted_where_the_driver_looks() {
    let kind = yaml_docs(&deploy_dir().join("kind/cluster.yaml")).remove(0);
    let kind_paths: BTreeSet<String> = kind["nodes"]
        .as_array()
        .expect("kind nodes")
        .iter()
        .flat_map(|n| n["extraMounts"].as_array().cloned().unwrap_or_default())
        .map(|m| m["containerPath"].as_str().unwrap_or("").to_string())
        .collect();
    for (workload, pod) in pods() {
        let driver = driver_container(&pod);
        let state = flag(driver, "state-dir").expect("explicit --state-dir");
        let v = mounted_at(&pod, driver, &state)
            .unwrap_or_else(|| panic!("{workload}: nothing at {state}"));
        let hp = host_path(v).expect("state dir is a hostPath: controller and nodes share it");
        assert!(
            kind_paths.contains(hp),
            "{workload}: state dir {hp} is not the path kind mounts on every node ({kind_paths:?})"
        );
        let dev = mounted_at(&pod, driver, "/dev")
            .expect("the driver needs the host's /dev (loop devices)");
        assert_eq!(host_path(dev), Some("/dev"));
        assert!(
            driver.security_context.as_ref().and_then(|s| s.privileged) == Some(true),
            "{workload}: the driver must be privileged (loop ioctls, mounts, the fence)"
        );
        if workload == NODE {
            let kubelet = flag(driver, "kubelet-dir").expect("explicit --kubelet-dir");
            let m = driver
                .volume_mounts
                .as_ref()
                .and_then(|ms| ms.iter().find(|m| m.mount_path == kubelet))
                .expect("kubelet dir mounted");
            assert_eq!(
                m.mount_propagation.as_deref(),
                Some("Bidirectional"),
                "mounts must propagate back to the kubelet"
            );
            assert_eq!(
                host_path(volume(&pod, &m.name)),
                Some(kubelet.as_str()),
                "kubelet paths are host paths: mount the kubelet dir at the same path"
            );
            assert_eq!(flag(driver, "mode").as_deref(), Some("node"));
            assert_eq!(flag(driver, "node-id").as_deref(), Some("$(NODE_NAME)"));
        } else {
            assert_eq!(flag(driver, "mode").as_deref(), Some("controller"));
        }
    }
}

#[test]
fn names_agree_with_the_code() {
    let name = fencecsi_driver::config::DEFAULT_DRIVER_NAME;
    assert_eq!(name, well_known::DRIVER_NAME);
    assert!(
        help("fencecsi-driver")
            .text
            .contains(&format!("[default: {name}]")),
        "fencecsi-driver --help does not show the default driver name {name}"
    );
    let drivers = all::<CSIDriver>();
    assert_eq!(drivers.len(), 1);
    let (_, d) = &drivers[0];
    assert_eq!(d.metadata.name.as_deref(), Some(name));
    let ann = d.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        ann.get(well_known::SAFE_DETACH_ANNOTATION)
            .map(String::as_str),
        Some("true"),
        "the CSIDriver must carry {}: \"true\"",
        well_known::SAFE_DETACH_ANNOTATION
    );
    let spec = &d.spec;
    assert_eq!(spec.attach_required, Some(true));
    // The kubelet marks an inline volume `csi.storage.k8s.io/ephemeral` only with pod info.
    assert_eq!(spec.pod_info_on_mount, Some(true));
    assert_eq!(
        spec.volume_lifecycle_modes.as_deref(),
        Some(&["Persistent".to_string(), "Ephemeral".to_string()][..])
    );
    assert_eq!(spec.fs_group_policy.as_deref(), Some("File"));

    for (workload, pod) in pods() {
        let dn = flag(driver_container(&pod), "driver-name");
        assert!(
            dn.is_none() || dn.as_deref() == Some(name),
            "{workload}: --driver-name {dn:?}"
        );
    }

    let classes = all::<StorageClass>();
    let names: BTreeSet<String> = classes.iter().map(|(d, _)| d.name().to_string()).collect();
    assert_eq!(
        names,
        BTreeSet::from(["fencecsi-ext4".to_string(), "fencecsi-xfs".to_string()])
    );
    for (doc, sc) in &classes {
        assert_eq!(sc.provisioner, name, "StorageClass {}", doc.name());
        let p = sc.parameters.clone().unwrap_or_default();
        // The provisioner passes this one in each capability's mount.fs_type (and the
        // PV's spec.csi.fsType); the driver's CreateVolume takes the filesystem from there.
        let fs = p
            .get(PROVISIONER_FSTYPE_KEY)
            .unwrap_or_else(|| panic!("StorageClass {}: no {PROVISIONER_FSTYPE_KEY}", doc.name()));
        assert!(
            fencecsi_driver::capability::FS_TYPES.contains(&fs.as_str()),
            "{PROVISIONER_FSTYPE_KEY} {fs}"
        );
        assert_eq!(doc.name(), format!("fencecsi-{fs}"));
        // The provisioner strips the csi.storage.k8s.io/ keys before CreateVolume; anything
        // else reaches the driver, which refuses parameters it does not know.
        for k in p.keys() {
            assert!(
                k.starts_with(PROVISIONER_RESERVED_PREFIX),
                "StorageClass {}: parameter {k} reaches the driver, which refuses it",
                doc.name()
            );
        }
        assert_eq!(
            sc.volume_binding_mode.as_deref(),
            Some("WaitForFirstConsumer")
        );
        assert_eq!(sc.allow_volume_expansion, Some(true));
    }

    let snap = yaml_docs(&deploy_dir().join("snapshot/volumesnapshotclass.yaml")).remove(0);
    assert_eq!(snap["kind"], "VolumeSnapshotClass");
    assert_eq!(snap["driver"], name);

    // podgc cooperates with kube-controller-manager through the out-of-service taint; the
    // node plugin must keep running on quarantined and out-of-service nodes (node return).
    let pod = pod_spec_of_deployment(&controller());
    assert!(flag(container(&pod, "fencecsi-podgc"), "out-of-service-taint").is_some());
    let ds = pod_spec_of_daemonset(&node());
    let tolerations = ds.tolerations.clone().unwrap_or_default();
    for (key, effect) in [
        (well_known::QUARANTINE_TAINT_KEY, "NoSchedule"),
        (well_known::OUT_OF_SERVICE_TAINT_KEY, "NoExecute"),
    ] {
        assert!(
            tolerations.iter().any(|t| {
                let key_ok = t.key.as_deref().is_none_or(|k| k.is_empty() || k == key);
                let op_ok = t.operator.as_deref() == Some("Exists")
                    || (t.key.as_deref() == Some(key) && t.value.is_some());
                let effect_ok = t
                    .effect
                    .as_deref()
                    .is_none_or(|e| e.is_empty() || e == effect);
                key_ok && op_ok && effect_ok && t.toleration_seconds.is_none()
            }),
            "the node DaemonSet must tolerate {key}:{effect}"
        );
    }
    assert_eq!(
        ds.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
}

// ---------------------------------------------------------------------------------------
// Pod hygiene
// ---------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------
// StorageClass parameters as external-provisioner reads them
// ---------------------------------------------------------------------------------------

/// The prefix of the parameters external-provisioner keeps for itself: it reads them and
/// strips them before CreateVolume.
const PROVISIONER_RESERVED_PREFIX: &str = "csi.storage.k8s.io/";
/// The parameter that names the filesystem to external-provisioner.
const PROVISIONER_FSTYPE_KEY: &str = "csi.storage.k8s.io/fstype";
/// The `csi.storage.k8s.io/` keys external-provisioner knows (v5.x and v6.x,
/// `removePrefixedParameters` in pkg/controller/controller.go), compared exactly. Any
/// other key with that prefix fails provisioning ("found unknown parameter key ... with
/// reserved namespace"). `secret-name`/`secret-namespace` are the older spellings of the
/// default secret, still accepted.
const PROVISIONER_RESERVED_KEYS: &[&str] = &[
    "fstype",
    "secret-name",
    "secret-namespace",
    "provisioner-secret-name",
    "provisioner-secret-namespace",
    "controller-publish-secret-name",
    "controller-publish-secret-namespace",
    "node-stage-secret-name",
    "node-stage-secret-namespace",
    "node-publish-secret-name",
    "node-publish-secret-namespace",
    "controller-expand-secret-name",
    "controller-expand-secret-namespace",
    "node-expand-secret-name",
    "node-expand-secret-namespace",
];

/// Why external-provisioner would refuse to provision from a StorageClass with these
/// parameters (empty: it accepts them). Its own rules, from `prepareProvision` and
/// `removePrefixedParameters`:
/// - the legacy key `fstype` matches in any case (`fsType`, `FSTYPE`, ...), the prefixed
///   one exactly; more than one of them is an error, even when they agree;
/// - a key with the reserved prefix must be one of [`PROVISIONER_RESERVED_KEYS`] (exactly:
///   `csi.storage.k8s.io/fsType` is an unknown key, not the filesystem).
fn external_provisioner_refusals(params: &BTreeMap<String, String>) -> Vec<String> {
    let mut refusals = Vec::new();
    let fs_keys: Vec<&String> = params
        .keys()
        .filter(|k| k.to_lowercase() == "fstype" || k.as_str() == PROVISIONER_FSTYPE_KEY)
        .collect();
    if fs_keys.len() > 1 {
        refusals.push(format!(
            "fstype specified in parameters with both \"fstype\" and \"{PROVISIONER_FSTYPE_KEY}\" keys: {fs_keys:?}"
        ));
    }
    for k in params.keys() {
        if let Some(rest) = k.strip_prefix(PROVISIONER_RESERVED_PREFIX) {
            if !PROVISIONER_RESERVED_KEYS.contains(&rest) {
                refusals.push(format!(
                    "found unknown parameter key {k:?} with reserved namespace {PROVISIONER_RESERVED_PREFIX}"
                ));
            }
        }
    }
    refusals
}

#[test]
fn storage_classes_pass_the_external_provisioners_parameter_checks() {
    let params = |kv: &[(&str, &str)]| -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    // Positive controls: the rule refuses what the provisioner refuses...
    for (what, bad) in [
        (
            "fsType and the prefixed key (issue 18)",
            params(&[("fsType", "ext4"), (PROVISIONER_FSTYPE_KEY, "ext4")]),
        ),
        (
            "the legacy key in another case",
            params(&[("FSTYPE", "xfs"), (PROVISIONER_FSTYPE_KEY, "xfs")]),
        ),
        (
            "an unknown reserved key",
            params(&[
                (PROVISIONER_FSTYPE_KEY, "ext4"),
                ("csi.storage.k8s.io/foo", "x"),
            ]),
        ),
        (
            "the prefixed key mis-cased",
            params(&[("csi.storage.k8s.io/fsType", "ext4")]),
        ),
    ] {
        assert!(
            !external_provisioner_refusals(&bad).is_empty(),
            "{what}: {bad:?} must be refused"
        );
    }
    // ...and accepts what it accepts.
    for good in [
        params(&[]),
        params(&[(PROVISIONER_FSTYPE_KEY, "xfs")]),
        params(&[("fsType", "ext4")]), // deprecated, but accepted alone
        params(&[
            (PROVISIONER_FSTYPE_KEY, "ext4"),
            ("csi.storage.k8s.io/provisioner-secret-name", "s"),
            ("csi.storage.k8s.io/secret-namespace", "ns"),
        ]),
    ] {
        assert_eq!(
            external_provisioner_refusals(&good),
            Vec::<String>::new(),
            "{good:?}"
        );
    }

    let driver = fencecsi_driver::config::DEFAULT_DRIVER_NAME;
    let classes: Vec<_> = all::<StorageClass>()
        .into_iter()
        .filter(|(_, sc)| sc.provisioner == driver)
        .collect();
    assert!(
        !classes.is_empty(),
        "no StorageClass of {driver} in deploy/base"
    );
    for (doc, sc) in &classes {
        let p = sc.parameters.clone().unwrap_or_default();
        let refusals = external_provisioner_refusals(&p);
        assert!(
            refusals.is_empty(),
            "{}: StorageClass {}: external-provisioner refuses it: {refusals:?}",
            doc.file,
            doc.name()
        );
    }
}

fn cpu_millis(q: &str) -> u64 {
    match q.strip_suffix('m') {
        Some(m) => m.parse().unwrap_or_else(|_| panic!("cpu {q}")),
        None => (q.parse::<f64>().unwrap_or_else(|_| panic!("cpu {q}")) * 1000.0) as u64,
    }
}

fn bytes(q: &str) -> u64 {
    for (suffix, mult) in [
        ("Ki", 1u64 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("k", 1000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
    ] {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().unwrap_or_else(|_| panic!("memory {q}")) * mult;
        }
    }
    q.parse().unwrap_or_else(|_| panic!("memory {q}"))
}

/// Parses durations as the fencecsi binaries do (10s, 500ms, 2m, plain seconds).
fn seconds(s: &str) -> f64 {
    fencecsi_driver::config::parse_duration(s)
        .unwrap_or_else(|e| panic!("{e}"))
        .as_secs_f64()
}

fn pre_stop_sleep(c: &Container) -> Option<i64> {
    c.lifecycle
        .as_ref()?
        .pre_stop
        .as_ref()?
        .sleep
        .as_ref()
        .map(|s| s.seconds)
}

fn port_number(c: &Container, port: &IntOrString) -> i32 {
    match port {
        IntOrString::Int(n) => *n,
        IntOrString::String(name) => c
            .ports
            .as_ref()
            .and_then(|ps| ps.iter().find(|p| p.name.as_deref() == Some(name.as_str())))
            .map(|p| p.container_port)
            .unwrap_or_else(|| panic!("{}: no port named {name}", c.name)),
    }
}

fn http_endpoint_port(c: &Container) -> Option<(String, i32)> {
    let e = flag(c, "http-endpoint")?;
    let (host, port) = e.rsplit_once(':').expect("host:port");
    Some((host.to_string(), port.parse().expect("port number")))
}

#[test]
fn every_container_has_requests_limits_and_a_tight_security_context() {
    let mut errors = Vec::new();
    for (workload, pod) in pods() {
        for c in &pod.containers {
            let what = format!("{workload}/{}", c.name);
            let r = c.resources.clone().unwrap_or_default();
            let (req, lim) = (r.requests.unwrap_or_default(), r.limits.unwrap_or_default());
            for res in ["cpu", "memory"] {
                match (req.get(res), lim.get(res)) {
                    (Some(a), Some(b)) => {
                        let (a, b) = (&a.0, &b.0);
                        let ok = if res == "cpu" {
                            cpu_millis(a) <= cpu_millis(b)
                        } else {
                            bytes(a) <= bytes(b)
                        };
                        if !ok {
                            errors.push(format!("{what}: {res} request {a} above limit {b}"));
                        }
                    }
                    _ => errors.push(format!("{what}: needs a {res} request and limit")),
                }
            }
            let sc = c.security_context.clone().unwrap_or_default();
            let privileged = sc.privileged == Some(true);
            match fencecsi_binary(c) {
                Some("fencecsi-driver") => {}
                _ if privileged => {
                    errors.push(format!("{what}: only the plugins may be privileged"))
                }
                _ => {
                    if sc.allow_privilege_escalation != Some(false) {
                        errors.push(format!("{what}: allowPrivilegeEscalation: false"));
                    }
                    let drops = sc
                        .capabilities
                        .as_ref()
                        .and_then(|c| c.drop.clone())
                        .unwrap_or_default();
                    if drops != ["ALL"]
                        || sc
                            .capabilities
                            .as_ref()
                            .and_then(|c| c.add.as_ref())
                            .is_some()
                    {
                        errors.push(format!("{what}: drop ALL capabilities, add none"));
                    }
                }
            }
            if sc.read_only_root_filesystem != Some(true) {
                errors.push(format!("{what}: readOnlyRootFilesystem: true"));
            }
            if matches!(
                fencecsi_binary(c),
                Some("fencecsi-attacher" | "fencecsi-podgc")
            ) {
                let uid = sc
                    .run_as_user
                    .or_else(|| pod.security_context.as_ref().and_then(|s| s.run_as_user));
                if sc.run_as_non_root != Some(true) || uid.is_none_or(|u| u == 0) {
                    errors.push(format!(
                        "{what}: must run as non-root (runAsNonRoot, a non-zero runAsUser)"
                    ));
                }
            }
        }
        // Containers share the pod's network: no two may listen on one port.
        let mut ports = BTreeMap::new();
        for c in &pod.containers {
            if let Some((_, p)) = http_endpoint_port(c) {
                if let Some(other) = ports.insert(p, c.name.clone()) {
                    errors.push(format!(
                        "{workload}: {} and {other} both listen on {p}",
                        c.name
                    ));
                }
            }
        }
    }
    assert!(errors.is_empty(), "containers:\n  {}", errors.join("\n  "));
}

#[test]
fn probes_hit_the_ports_the_processes_serve() {
    for (workload, pod) in pods() {
        let servers: BTreeMap<i32, &Container> = pod
            .containers
            .iter()
            .filter_map(|c| http_endpoint_port(c).map(|(host, p)| {
                assert!(
                    host.is_empty() || host == "0.0.0.0" || host == "[::]",
                    "{workload}/{}: --http-endpoint {host}:{p} is not reachable by the kubelet's probes",
                    c.name
                );
                (p, c)
            }))
            .collect();
        // Our own binaries take the sidecars' form, every interface as ":PORT", like the
        // sidecars beside them.
        for c in pod
            .containers
            .iter()
            .filter(|c| fencecsi_binary(c).is_some())
        {
            if let Some(e) = flag(c, "http-endpoint") {
                assert!(
                    e.starts_with(':'),
                    "{workload}/{}: --http-endpoint={e}, not the :PORT form",
                    c.name
                );
            }
        }
        // The plugin's liveness goes through the livenessprobe sidecar (Probe RPC).
        let driver = driver_container(&pod);
        let probe = driver
            .liveness_probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("{workload}: driver liveness probe"));
        assert_eq!(probe.path.as_deref(), Some("/healthz"));
        let port = port_number(driver, &probe.port);
        let server = servers
            .get(&port)
            .unwrap_or_else(|| panic!("{workload}: nothing serves the driver's probe port {port}"));
        assert!(
            server
                .image
                .as_deref()
                .unwrap_or("")
                .contains("/livenessprobe:"),
            "{workload}: port {port} is served by {}",
            server.name
        );

        for c in &pod.containers {
            if !matches!(
                fencecsi_binary(c),
                Some("fencecsi-attacher" | "fencecsi-podgc")
            ) {
                continue;
            }
            let (_, serves) = http_endpoint_port(c)
                .unwrap_or_else(|| panic!("{}: explicit --http-endpoint", c.name));
            let ready = c
                .readiness_probe
                .as_ref()
                .and_then(|p| p.http_get.as_ref())
                .unwrap_or_else(|| panic!("{}: readiness probe", c.name));
            // Ready means running (a standby too); alive is /healthz.
            assert_eq!(ready.path.as_deref(), Some("/readyz"), "{}", c.name);
            assert_eq!(
                port_number(c, &ready.port),
                serves,
                "{}: readiness probe port",
                c.name
            );
            if let Some(l) = c.liveness_probe.as_ref().and_then(|p| p.http_get.as_ref()) {
                assert_eq!(l.path.as_deref(), Some("/healthz"), "{}", c.name);
                assert_eq!(
                    port_number(c, &l.port),
                    serves,
                    "{}: liveness probe port",
                    c.name
                );
            }
        }
        if workload == CONTROLLER {
            let hm = container(&pod, HEALTH_MONITOR);
            let l = hm
                .liveness_probe
                .as_ref()
                .and_then(|p| p.http_get.as_ref())
                .expect("health monitor liveness");
            assert_eq!(l.path.as_deref(), Some("/healthz/leader-election"));
            assert_eq!(
                Some(port_number(hm, &l.port)),
                http_endpoint_port(hm).map(|p| p.1),
                "{HEALTH_MONITOR}: liveness probe port"
            );
        }
        if workload == NODE {
            let reg = container(&pod, "node-driver-registrar");
            let l = reg
                .liveness_probe
                .as_ref()
                .and_then(|p| p.http_get.as_ref())
                .expect("registrar liveness");
            assert_eq!(
                Some(port_number(reg, &l.port)),
                http_endpoint_port(reg).map(|p| p.1)
            );
        }
    }
}

/// A standby is always there to take over, apart from the leader where the cluster allows,
/// and a failed pod is replaced in about a minute: two replicas, never a third during a
/// rollout (one pod replaced at a time), preferred on different nodes, a disruption budget
/// that keeps one, the plugin elects (so one cut off from the API server gives the state
/// dir up by itself), and a pod on an unreachable or not-ready node is replaced after a
/// short toleration. Two plugins never serve the state dir at once: that is its ownership
/// lock's (driver/src/locks/owner_lock.rs), not the Deployment's.
#[test]
fn a_standby_controller_is_always_there_and_a_lost_one_replaced_in_about_a_minute() {
    let d = controller();
    let spec = d.spec.clone();
    assert_eq!(spec.replicas, Some(2), "a leader and a standby");
    let strategy = spec.strategy.clone().unwrap_or_default();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.unwrap_or_default();
    assert_eq!(
        rolling.max_surge,
        Some(IntOrString::Int(0)),
        "never a third pod"
    );
    assert_eq!(
        rolling.max_unavailable,
        Some(IntOrString::Int(1)),
        "one at a time"
    );
    let pod = pod_spec_of_deployment(&d);
    let apart = pod
        .affinity
        .as_ref()
        .and_then(|a| a.pod_anti_affinity.as_ref())
        .and_then(|a| {
            a.preferred_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .and_then(|p| p.first())
        .expect("the replicas prefer different nodes");
    assert_eq!(
        apart.pod_affinity_term.topology_key,
        "kubernetes.io/hostname"
    );
    assert_eq!(
        apart
            .pod_affinity_term
            .label_selector
            .as_ref()
            .and_then(|s| s.match_labels.clone()),
        spec.selector.match_labels,
        "apart from its own replicas"
    );
    let budget = one::<PodDisruptionBudget>(CONTROLLER);
    let budget = budget.spec.unwrap_or_default();
    assert_eq!(budget.max_unavailable, Some(IntOrString::Int(1)));
    assert_eq!(
        budget.selector.and_then(|s| s.match_labels),
        spec.selector.match_labels,
        "the budget covers the controller pods"
    );
    let driver = driver_container(&pod);
    assert_eq!(
        flag(driver, "leader-election").as_deref(),
        Some("true"),
        "the plugin elects, so one cut off gives the state dir up"
    );
    for key in [
        "node.kubernetes.io/unreachable",
        "node.kubernetes.io/not-ready",
    ] {
        let t = pod
            .tolerations
            .iter()
            .flatten()
            .find(|t| t.key.as_deref() == Some(key))
            .unwrap_or_else(|| panic!("a toleration for {key}"));
        assert!(
            t.toleration_seconds.is_some_and(|s| s <= 60),
            "{key}: replaced within a minute, not after the default 300 s"
        );
    }
}

/// A frozen plugin is taken over from through its kill switch, which cannot end the init of
/// a pid namespace (the plugin arms none then): the pod shares one pid namespace, whose
/// init is the sandbox's.
#[test]
fn the_controller_plugin_is_not_the_init_of_its_pid_namespace() {
    let pod = pod_spec_of_deployment(&controller());
    assert_eq!(
        pod.share_process_namespace,
        Some(true),
        "the controller pod shares its pid namespace"
    );
}

/// On termination every container gets its preStop hook, then SIGTERM, at once. The plugin
/// must outlive its clients' drain, and the grace period must cover the plugin's own.
#[test]
fn shutdown_lets_in_flight_calls_finish() {
    let d = controller();
    let pod = pod_spec_of_deployment(&d);
    let grace = pod
        .termination_grace_period_seconds
        .expect("terminationGracePeriodSeconds") as f64;
    let driver = driver_container(&pod);
    let driver_sleep =
        pre_stop_sleep(driver).expect("the controller plugin needs a preStop sleep") as f64;

    let attacher = container(&pod, "fencecsi-attacher");
    let attacher_sleep = pre_stop_sleep(attacher).expect("fencecsi-attacher preStop sleep") as f64;
    let drain = seconds(&flag(attacher, "drain-timeout").expect("explicit --drain-timeout"));
    assert!(
        driver_sleep > attacher_sleep + drain,
        "the plugin ({driver_sleep}s preStop) must still serve while the attacher drains ({attacher_sleep}s + {drain}s)"
    );
    let podgc = container(&pod, "fencecsi-podgc");
    assert!(
        pre_stop_sleep(podgc).is_some(),
        "fencecsi-podgc preStop sleep"
    );
    assert!(
        grace >= driver_sleep + 30.0,
        "grace {grace}s: plugin preStop {driver_sleep}s + 30s for its in-flight calls"
    );
    assert!(grace > attacher_sleep + drain);

    let ds = pod_spec_of_daemonset(&node());
    assert!(ds.termination_grace_period_seconds.unwrap_or(30) >= 30);
}

// ---------------------------------------------------------------------------------------
// kind and the Dockerfile
// ---------------------------------------------------------------------------------------

#[test]
fn kind_cluster_shares_one_state_directory_across_three_nodes() {
    let kind = yaml_docs(&deploy_dir().join("kind/cluster.yaml")).remove(0);
    assert_eq!(kind["kind"], "Cluster");
    assert_eq!(kind["apiVersion"], "kind.x-k8s.io/v1alpha4");
    let nodes = kind["nodes"].as_array().expect("nodes");
    let roles: Vec<&str> = nodes
        .iter()
        .map(|n| n["role"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(roles, ["control-plane", "worker", "worker"]);
    let state_dir = {
        let pod = pod_spec_of_daemonset(&node());
        flag(driver_container(&pod), "state-dir").unwrap()
    };
    let mut host_dirs = BTreeSet::new();
    for n in nodes {
        let m = n["extraMounts"]
            .as_array()
            .and_then(|ms| ms.iter().find(|m| m["containerPath"] == state_dir.as_str()))
            .unwrap_or_else(|| panic!("kind node {} does not mount {state_dir}", n["role"]));
        host_dirs.insert(m["hostPath"].as_str().expect("hostPath").to_string());
    }
    assert_eq!(
        host_dirs.len(),
        1,
        "every node must mount the same host directory: {host_dirs:?}"
    );
    assert!(
        host_dirs.iter().all(|d| d.starts_with('/')),
        "use an absolute host path"
    );
}

#[test]
fn dockerfile_builds_every_binary_the_manifests_run_with_the_tools_they_need() {
    let df = read(&deploy_dir().join("Dockerfile"));
    let froms: Vec<&str> = df.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(
        froms,
        [
            "FROM rust:1-bookworm AS builder",
            "FROM debian:bookworm-slim"
        ]
    );
    let build = df
        .lines()
        .find(|l| l.contains("cargo build"))
        .expect("a cargo build line");
    assert!(build.contains("cargo build --release --locked"), "{build}");
    let toks: Vec<&str> = build.split_whitespace().collect();
    let packages: BTreeSet<&str> = toks
        .windows(2)
        .filter(|w| w[0] == "-p")
        .map(|w| w[1])
        .collect();
    let pods = pods();
    let run_by_manifests: BTreeSet<&str> = pods
        .iter()
        .flat_map(|(_, p)| {
            p.containers
                .iter()
                .filter_map(fencecsi_binary)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(
        packages, run_by_manifests,
        "the image must build exactly the binaries the manifests run"
    );
    let copy = df
        .lines()
        .find(|l| l.starts_with("COPY --from=builder"))
        .expect("COPY --from=builder");
    for b in &run_by_manifests {
        assert!(
            copy.contains(&format!("/{b}")),
            "{b} is not copied into the runtime image"
        );
    }
    let install = df
        .lines()
        .find(|l| l.contains("apt-get install"))
        .expect("apt-get install");
    for pkg in ["e2fsprogs", "xfsprogs", "util-linux", "ca-certificates"] {
        assert!(
            install.split_whitespace().any(|t| t == pkg),
            "runtime image lacks {pkg}"
        );
    }
    // The filesystem tools the driver runs (driver/src/kernel/filesystem.rs TOOLS), by package.
    let filesystem = read(&repo_root().join("driver/src/kernel/filesystem.rs"));
    let tools_line = filesystem
        .lines()
        .find(|l| l.contains("const TOOLS"))
        .expect("filesystem.rs TOOLS");
    let list = tools_line.split('=').nth(1).expect("TOOLS value");
    for tool in list.split('"').skip(1).step_by(2) {
        let pkg = match tool {
            "mkfs.ext4" | "resize2fs" | "e2fsck" | "tune2fs" | "dumpe2fs" => "e2fsprogs",
            "mkfs.xfs" | "xfs_growfs" | "xfs_repair" | "xfs_admin" => "xfsprogs",
            "blkid" | "losetup" | "mount" | "umount" | "fsck" => "util-linux",
            other => panic!("the driver runs {other}: name its Debian package here and install it in deploy/Dockerfile"),
        };
        assert!(
            install.split_whitespace().any(|t| t == pkg),
            "{tool} needs {pkg}"
        );
    }
    let last_user = df
        .lines()
        .rfind(|l| l.starts_with("USER "))
        .expect("a USER line");
    assert!(
        !last_user.contains(" 0") && !last_user.contains("root"),
        "the image's default user is not root: {last_user}"
    );
}

// ---------------------------------------------------------------------------------------
// What the production binaries are built from
// ---------------------------------------------------------------------------------------

/// Workspace packages by name, from `cargo metadata --no-deps` (the manifests as written,
/// without resolving anything).
fn workspace_packages() -> BTreeMap<String, Value> {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(repo_root())
        .output()
        .expect("running cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata JSON");
    meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| (p["name"].as_str().expect("name").to_string(), p.clone()))
        .collect()
}

/// A package's normal dependencies (`kind` null: not dev, not build).
fn normal_deps(pkg: &Value) -> Vec<&Value> {
    pkg["dependencies"]
        .as_array()
        .expect("dependencies")
        .iter()
        .filter(|d| d["kind"].is_null())
        .collect()
}

/// The workspace crates `from` reaches through normal dependencies, itself included.
fn normally_reached(pkgs: &BTreeMap<String, Value>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![from.to_string()];
    while let Some(name) = todo.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        for dep in normal_deps(&pkgs[&name]) {
            let dep_name = dep["name"].as_str().expect("dependency name");
            if pkgs.contains_key(dep_name) {
                todo.push(dep_name.to_string());
            }
        }
    }
    seen
}

/// The embedded cluster and the kubelet/controller simulations (crate
/// fencecsi-embedded-cluster) are for tests, benchmarks and the drill. `cargo build -p` of
/// the three binaries (deploy/Dockerfile) builds their normal dependencies only, so no
/// crate they reach that way may depend on it; and the controllers depend only downward
/// (protocol, cluster seam), never on the driver, the test harness or the drill, which
/// would drag test code in.
#[test]
fn production_binaries_build_without_the_embedded_cluster() {
    const CLUSTER: &str = "fencecsi-cluster";
    const EMBEDDED: &str = "fencecsi-embedded-cluster";
    let pkgs = workspace_packages();
    let mut errors = Vec::new();

    // Positive control: the drill runs on the embedded cluster, and the walk finds it.
    assert!(
        normally_reached(&pkgs, "fencecsi-drill").contains(EMBEDDED),
        "the drill does not reach {EMBEDDED}: this test checks the wrong thing"
    );
    for bin in FENCECSI_BINARIES {
        if normally_reached(&pkgs, bin).contains(EMBEDDED) {
            errors.push(format!(
                "{bin} reaches {EMBEDDED} through normal dependencies (make it a dev-dependency)"
            ));
        }
    }

    let allowed: BTreeSet<&str> = ["fencecsi-proto", CLUSTER].into();
    for controller in ["fencecsi-attacher", "fencecsi-podgc"] {
        for dep in normal_deps(&pkgs[controller]) {
            let dep_name = dep["name"].as_str().expect("dependency name");
            if dep_name.starts_with("fencecsi-") && !allowed.contains(dep_name) {
                errors.push(format!(
                    "{controller} depends on {dep_name}: the controllers depend only on {allowed:?} (test-only crates go in [dev-dependencies])"
                ));
            }
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}
