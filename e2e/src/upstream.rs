//! Kubernetes' own storage suite ("External Storage" in `e2e.test`) against the shipped
//! deployment: the driver definitions in `e2e/testdriver/` claim what the driver can do,
//! and the upstream suite decides what that means. What is left out, and why, is
//! [`SKIPS`] (docs/conformance.md says the same).

use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::cluster::Cluster;
use crate::node_access::Access;
use crate::teardown::Teardown;
use crate::{images, process, say};

/// The `e2e.test` binary of the Kubernetes tree (v1.32), built locally.
pub const SUITE_BINARY: &str = "FENCECSI_E2E_UPSTREAM_SUITE";
/// Optional: a comma-separated subset of the definitions (`ext4`, `xfs`).
pub const DEFINITIONS: &str = "FENCECSI_E2E_UPSTREAM_DEFINITIONS";
/// Optional: the `ginkgo` CLI of the same tree, to run the specs in parallel
/// (`FENCECSI_E2E_UPSTREAM_PROCS` processes, default 3); without it they run one by one.
pub const GINKGO: &str = "FENCECSI_E2E_UPSTREAM_GINKGO";
pub const PROCS: &str = "FENCECSI_E2E_UPSTREAM_PROCS";
/// Optional: which passes to run (`parallel`, `disruptive`; default both, see [`Pass`]).
pub const PASSES: &str = "FENCECSI_E2E_UPSTREAM_PASSES";
/// Optional: a narrower `--ginkgo.focus` (a regular expression), for development.
pub const FOCUS: &str = "FENCECSI_E2E_UPSTREAM_FOCUS";

/// The images the selected specs run, at the references the v1.32 suite names
/// (`test/utils/image/manifest.go`); they must be among the archives.
pub const TEST_IMAGES: [&str; 6] = [
    "registry.k8s.io/e2e-test-images/busybox:1.36.1-1",
    "registry.k8s.io/e2e-test-images/agnhost:2.53",
    "registry.k8s.io/e2e-test-images/nginx:1.14-4",
    "registry.k8s.io/e2e-test-images/jessie-dnsutils:1.7",
    // The "any volume data source" spec deploys these from the suite's own manifests.
    "registry.k8s.io/sig-storage/hello-populator:v1.0.1",
    "registry.k8s.io/sig-storage/volume-data-source-validator:v1.0.0",
];

/// Specs left out of the selection, each with its reason.
pub const SKIPS: [(&str, &str); 5] = [
    (r"\[Feature:Windows\]", "the nodes run Linux"),
    (
        r"\[Feature:SELinux\]",
        "the nodes have no SELinux (Debian's kernel boots without it)",
    ),
    (
        r"VolumeAttributesClass",
        "a beta API that v1.32 serves only behind a feature gate; the driver has no ModifyVolume",
    ),
    (
        r"\[Feature:volumegroupsnapshot\]",
        "deploy/base does not enable group snapshots in csi-snapshotter",
    ),
    (
        r"Verify if offline PVC expansion works",
        "version skew: the v1.32 suite reads only the claim's first condition, and the pinned \
         csi-resizer v2.2.1 keeps `Resizing` first and adds `FileSystemResizePending` \
         second (seen on this cluster: conditions `Resizing FileSystemResizePending`, \
         allocatedResourceStatuses `NodeResizePending`); the expansion itself completes (on \
         the same cluster an ext4 claim grown 256Mi -> 512Mi while unused had a 475 MB \
         filesystem in its next pod, and the conditions were cleared)",
    ),
];

/// One driver definition file and the name it is reported under.
#[derive(Debug, Clone)]
pub struct Definition {
    pub name: String,
    pub file: PathBuf,
}

/// What one run of the suite reported.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub definition: String,
    pub passed: usize,
    pub failed: Vec<String>,
    pub skipped: usize,
    pub seconds: f64,
}

impl Outcome {
    pub fn json(&self) -> String {
        serde_json::json!({
            "definition": self.definition,
            "passed": self.passed,
            "failed": self.failed.len(),
            "skipped": self.skipped,
            "seconds": (self.seconds * 10.0).round() / 10.0,
            "failures": self.failed,
        })
        .to_string()
    }
}

/// The definitions to run: `FENCECSI_E2E_UPSTREAM_DEFINITIONS`, or both.
pub fn definitions(repo: &Path) -> Result<Vec<Definition>> {
    let spec = std::env::var(DEFINITIONS).unwrap_or_else(|_| "ext4,xfs".into());
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|name| {
            let file = repo.join("e2e/testdriver").join(format!("{name}.yaml"));
            if !file.is_file() {
                bail!("{DEFINITIONS}: no definition {}", file.display());
            }
            Ok(Definition {
                name: name.to_string(),
                file,
            })
        })
        .collect()
}

/// Fails, naming them, if any test image is not among the archives.
pub fn check_test_images(archives: &[PathBuf]) -> Result<()> {
    let mut have = Vec::new();
    for a in archives {
        have.extend(
            images::archive_refs(a)?
                .iter()
                .map(|r| images::normalize(r)),
        );
    }
    let missing: Vec<&str> = TEST_IMAGES
        .iter()
        .copied()
        .filter(|t| !have.contains(&images::normalize(t)))
        .collect();
    if !missing.is_empty() {
        bail!(
            "the upstream suite's test images are not among the archives: {missing:?} (DEVELOPERS.md, \"The test images\", says how to make them)"
        );
    }
    Ok(())
}

/// ext4's online grow of a mounted filesystem (`EXT4_IOC_RESIZE_FS`) needs
/// CAP_SYS_RESOURCE, and a node cannot hold more than the machine's bounding set.
const EXT4_ONLINE_GROW: &str = r"\(default fs\).*(should resize volume when PVC is edited while pod is using it|should support expansion of pvcs created for ephemeral pvcs)";

/// The specs that wait for a restarted kubelet's first heartbeat although nothing in its
/// node's status changed.
const HEARTBEAT_AFTER_RESTART: &str =
    r"Should test that pv written before kubelet restart is readable after restart";

/// Specs this machine and this cluster cannot run for `def`, each with the reason:
/// - On a machine whose capability bounding set lacks CAP_SYS_RESOURCE (some sandboxes
///   drop it), the driver answers an ext4 online grow with FAILED_PRECONDITION and grows
///   the filesystem at the next stage instead, so the two specs that wait for the grow
///   while the pod runs cannot pass there.
/// - A v1.32 kubelet before v1.32.3 (the code freeze this suite is built from among
///   them) posts no node status after a restart until the status changes: it skips the
///   periodic report while its last-report time is zero. The quick-restart specs wait a
///   minute for that heartbeat and fail, whatever the driver does.
pub fn local_skips(def: &Definition, kubelet_version: &str) -> Vec<(&'static str, String)> {
    let mut skips = Vec::new();
    if def.name == "ext4" && !bounding_set_has(CAP_SYS_RESOURCE) {
        skips.push((
            EXT4_ONLINE_GROW,
            "this machine's capability bounding set lacks CAP_SYS_RESOURCE, which ext4's \
             online grow needs; the driver grows the filesystem at the next stage instead"
                .to_string(),
        ));
    }
    if kubelet_lacks_first_report(kubelet_version) {
        skips.push((
            HEARTBEAT_AFTER_RESTART,
            format!(
                "kubelet {kubelet_version} sends no heartbeat after a restart until its node's \
                 status changes (kubernetes#130001: #128640 made it, its revert #130348 \
                 undid it after the code freeze, in v1.32 from v1.32.3); with the fix \
                 applied to this kubelet the specs pass (docs/conformance.md)"
            ),
        ));
    }
    skips
}

/// The kubelets' version as the first Node reports it (all nodes run one binary).
fn kubelet_version(c: &Cluster) -> Result<String> {
    let v = c.kubectl.run(&[
        "get",
        "nodes",
        "-o",
        "jsonpath={.items[0].status.nodeInfo.kubeletVersion}",
    ])?;
    ensure!(!v.trim().is_empty(), "no Node reports a kubelet version");
    Ok(v.trim().to_string())
}

/// Whether `version` (the Node's `kubeletVersion`) is a v1.32 kubelet whose
/// `isUpdateStatusPeriodExperid` answers false while no status was reported yet: the
/// pre-releases and v1.32.0 to v1.32.2 (the revert reached release-1.32 as #130356,
/// merged after v1.32.2 was out).
fn kubelet_lacks_first_report(version: &str) -> bool {
    let Some(rest) = version.strip_prefix("v1.32.") else {
        return false;
    };
    let patch: String = rest.chars().take_while(char::is_ascii_digit).collect();
    patch.parse::<u32>().is_ok_and(|p| p <= 2)
}

const CAP_SYS_RESOURCE: u32 = 24;

fn bounding_set_has(cap: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s
                .lines()
                .find_map(|l| l.strip_prefix("CapBnd:"))?
                .trim()
                .to_string();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << cap) != 0)
}

/// A definition runs in two passes: every spec but the kubelet-restart ones, in
/// parallel; then those (`[Disruptive]`, when there is a way into the nodes), one at a
/// time and alone, since a kubelet stopped under another spec fails that spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Parallel,
    Disruptive,
}

const DISRUPTIVE: &str = r"\[Disruptive\]";

impl Pass {
    pub fn name(self) -> &'static str {
        match self {
            Pass::Parallel => "parallel",
            Pass::Disruptive => "disruptive",
        }
    }

    /// The `--ginkgo.focus` expression: the External Storage specs, narrowed by
    /// [`FOCUS`] when it is set (the suite's name leads every spec's text).
    fn focus(self) -> String {
        match std::env::var(FOCUS) {
            Ok(narrower) => format!("External.Storage.*({narrower})"),
            Err(_) => "External.Storage".into(),
        }
    }

    /// The `--ginkgo.label-filter`: the kubelet-restart pass takes the specs labelled
    /// Disruptive (the label stands at the end of their text, the tag before their words,
    /// so a focus could not select them in every order).
    fn label_filter(self) -> Option<&'static str> {
        match self {
            Pass::Parallel => None,
            Pass::Disruptive => Some("Disruptive"),
        }
    }

    /// The `--ginkgo.skip` expression: every [`SKIPS`] entry and the `local` ones (see
    /// [`local_skips`]); the parallel pass also leaves the kubelet-restart specs to the
    /// other.
    pub fn skip(self, local: &[(&str, String)]) -> String {
        let mut res: Vec<&str> = SKIPS.iter().map(|(re, _)| *re).collect();
        res.extend(local.iter().map(|(re, _)| *re));
        if self == Pass::Parallel {
            res.push(DISRUPTIVE);
        }
        res.join("|")
    }

    /// The ginkgo CLI and its process count, for the parallel pass when it is given.
    fn parallel_runner(self) -> Option<(std::ffi::OsString, String)> {
        match self {
            Pass::Parallel => std::env::var_os(GINKGO)
                .map(|g| (g, std::env::var(PROCS).unwrap_or_else(|_| "3".into()))),
            Pass::Disruptive => None,
        }
    }
}

/// The passes to run: `FENCECSI_E2E_UPSTREAM_PASSES`, or both.
fn wanted_passes() -> Result<Vec<Pass>> {
    let spec = std::env::var(PASSES).unwrap_or_else(|_| "parallel,disruptive".into());
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| match s {
            "parallel" => Ok(Pass::Parallel),
            "disruptive" => Ok(Pass::Disruptive),
            other => bail!("{PASSES}: unknown pass {other:?} (parallel, disruptive)"),
        })
        .collect()
}

/// Runs the suite for one definition against the running cluster, in its passes (the
/// second only with `access`). Logs and reports go to `target/e2e/<run>-upstream-<name>/`
/// (kept after the teardown); each finished spec is said as it finishes.
pub fn run(
    c: &Cluster,
    suite: &Path,
    def: &Definition,
    access: Option<&Access>,
    td: &Teardown,
) -> Result<Outcome> {
    let local = local_skips(def, &kubelet_version(c)?);
    for (re, why) in &local {
        say(format!(
            "upstream {}: left out on this cluster: {re}: {why}",
            def.name
        ));
    }
    if access.is_none() {
        say(format!(
            "upstream {}: no way into the nodes: the kubelet-restart specs are left out",
            def.name
        ));
    }
    let passes: Vec<Pass> = wanted_passes()?
        .into_iter()
        .filter(|p| *p == Pass::Parallel || access.is_some())
        .collect();
    let mut total = Outcome {
        definition: def.name.clone(),
        ..Outcome::default()
    };
    for pass in passes {
        let o = run_pass(c, suite, def, &local, access, pass, td)?;
        say(format!(
            "upstream {} {}: {}",
            def.name,
            pass.name(),
            o.json()
        ));
        total.passed += o.passed;
        total.skipped += o.skipped;
        total.failed.extend(o.failed);
        total.seconds += o.seconds;
    }
    // A focus that selects nothing would otherwise read as a pass.
    ensure!(
        total.passed + total.failed.len() > 0,
        "upstream {}: no spec ran (check {FOCUS} and {PASSES})",
        def.name
    );
    Ok(total)
}

fn run_pass(
    c: &Cluster,
    suite: &Path,
    def: &Definition,
    local: &[(&str, String)],
    access: Option<&Access>,
    pass: Pass,
    td: &Teardown,
) -> Result<Outcome> {
    let dir = c
        .run_dir
        .with_file_name(format!(
            "{}-upstream-{}",
            c.run_dir.file_name().unwrap_or_default().to_string_lossy(),
            def.name
        ))
        .join(pass.name());
    std::fs::create_dir_all(&dir)?;
    let log = dir.join("e2e.log");
    let report = report_file(&dir);
    let mut cmd = suite_command(c, suite, def, local, access, pass, &dir);
    say(format!(
        "upstream {}: {cmd:?} (log {})",
        def.name,
        log.display()
    ));
    let started = Instant::now();
    let mut child = process::spawn_daemon(&mut cmd, &log)?;
    td.record_daemon(
        format!("e2e.test {} {}", def.name, pass.name()),
        child.id() as i32,
    );
    let done = Arc::new(AtomicBool::new(false));
    let follower = follow(&log, &def.name, done.clone());
    let status = wait_bounded(&mut child, SUITE_BOUND);
    done.store(true, Ordering::SeqCst);
    let _ = follower.join();
    let status = status?;
    let mut outcome = read_report(&report)
        .with_context(|| format!("e2e.test exited with {status}; see {}", log.display()))?;
    outcome.definition = def.name.clone();
    outcome.seconds = started.elapsed().as_secs_f64();
    Ok(outcome)
}

/// Ginkgo's JSON report of the pass whose files go to `dir`.
fn report_file(dir: &Path) -> PathBuf {
    dir.join("report.json")
}

/// A pass's bound (the upstream default is one hour).
const SUITE_BOUND: Duration = Duration::from_secs(4 * 3600);

/// `ginkgo --procs=N ... e2e.test -- <suite flags>` for the parallel pass when the CLI
/// is given, otherwise `e2e.test --ginkgo.<flag> ... <suite flags>` (one spec at a time).
fn suite_command(
    c: &Cluster,
    suite: &Path,
    def: &Definition,
    local: &[(&str, String)],
    access: Option<&Access>,
    pass: Pass,
    dir: &Path,
) -> Command {
    let mut ginkgo_flags = vec![
        format!("focus={}", pass.focus()),
        format!("skip={}", pass.skip(local)),
        "no-color".to_string(),
        "v".to_string(),
        format!("timeout={}s", SUITE_BOUND.as_secs()),
        format!("json-report={}", report_file(dir).display()),
    ];
    ginkgo_flags.extend(pass.label_filter().map(|l| format!("label-filter={l}")));
    let suite_flags = [
        format!(
            "--kubeconfig={}",
            c.control_plane.admin_kubeconfig.display()
        ),
        "--provider=skeleton".to_string(),
        format!("--storage.testdriver={}", def.file.display()),
        format!("--report-dir={}", dir.display()),
    ];
    let mut cmd = match pass.parallel_runner() {
        Some((ginkgo, procs)) => {
            let mut cmd = Command::new(ginkgo);
            cmd.arg(format!("--procs={procs}"))
                .args(ginkgo_flags.iter().map(|f| format!("--{f}")))
                .arg(suite)
                .arg("--");
            cmd
        }
        None => {
            let mut cmd = Command::new(suite);
            cmd.args(ginkgo_flags.iter().map(|f| format!("--ginkgo.{f}")));
            cmd
        }
    };
    cmd.current_dir(dir).args(suite_flags);
    if let Some(a) = access {
        cmd.env("KUBE_SSH_KEY_PATH", &a.key)
            .env("KUBE_SSH_USER", &a.user);
    }
    cmd
}

fn wait_bounded(
    child: &mut std::process::Child,
    bound: Duration,
) -> Result<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        if start.elapsed() > bound {
            process::stop_group(child.id() as i32, Duration::from_secs(10));
            let _ = child.wait();
            bail!("e2e.test still running after {bound:?}: stopped");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Follows the log as it grows and says each finished spec: ginkgo's verbose output
/// ends a spec with `• [...]` (or `• [FAILED] ...`), followed by the spec's text when
/// specs run in parallel, by a separator when they run one at a time.
fn follow(log: &Path, name: &str, done: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let log = log.to_path_buf();
    let name = name.to_string();
    std::thread::spawn(move || {
        let Ok(mut f) = std::fs::File::open(&log) else {
            return;
        };
        let mut pos = 0u64;
        let mut carry = String::new();
        let mut heading: Option<String> = None;
        let mut current = String::new();
        let mut finished = 0usize;
        loop {
            let last = done.load(Ordering::SeqCst);
            let _ = f.seek(SeekFrom::Start(pos));
            let mut r = BufReader::new(&f);
            let mut line = String::new();
            while r.read_line(&mut line).unwrap_or(0) > 0 {
                pos += line.len() as u64;
                if !line.ends_with('\n') {
                    carry.push_str(&line);
                    line.clear();
                    continue;
                }
                let full = std::mem::take(&mut carry) + line.trim_end();
                line.clear();
                // Run one at a time, ginkgo names the spec as it starts and only
                // separates it after the result; in parallel it names it after.
                if full.starts_with("External Storage") && heading.is_none() {
                    current = full.trim().to_string();
                }
                match heading.take() {
                    Some(h) if !full.trim().is_empty() => {
                        finished += 1;
                        let spec = if full.starts_with("---") {
                            current.as_str()
                        } else {
                            full.trim()
                        };
                        say(format!("upstream {name} #{finished} {h} {spec}"));
                    }
                    Some(h) => heading = Some(h),
                    None if full.starts_with("• [") || full.starts_with("•  [") => {
                        heading = Some(full.trim_start_matches('•').trim().to_string())
                    }
                    None => {}
                }
            }
            if last {
                return;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    })
}

/// Reads ginkgo's JSON report: the specs that ran (those the focus and skip left out
/// are listed too, as skipped without a single attempt, and are not counted).
pub fn read_report(path: &Path) -> Result<Outcome> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the suite's report {}", path.display()))?;
    let v: Value = serde_json::from_str(&text)?;
    let mut o = Outcome::default();
    for suite in v.as_array().into_iter().flatten() {
        for spec in suite["SpecReports"].as_array().into_iter().flatten() {
            if spec["LeafNodeType"] != "It" {
                continue;
            }
            match spec["State"].as_str().unwrap_or("") {
                "passed" => o.passed += 1,
                "skipped" if spec["NumAttempts"].as_u64().unwrap_or(0) > 0 => o.skipped += 1,
                "skipped" | "pending" => {}
                _ => o.failed.push(spec_text(spec)),
            }
        }
    }
    Ok(o)
}

fn spec_text(spec: &Value) -> String {
    let mut parts: Vec<String> = spec["ContainerHierarchyTexts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str().map(String::from))
        .collect();
    parts.push(spec["LeafNodeText"].as_str().unwrap_or("").to_string());
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_affected_kubelets_lose_the_restart_specs() {
        for affected in ["v1.32.0-beta.0", "v1.32.0-rc.1", "v1.32.0", "v1.32.2"] {
            assert!(kubelet_lacks_first_report(affected), "{affected}");
        }
        for fixed_or_unknown in ["v1.32.3", "v1.32.10", "v1.33.0", "v1.31.4", "v1.3.2", ""] {
            assert!(
                !kubelet_lacks_first_report(fixed_or_unknown),
                "{fixed_or_unknown}"
            );
        }
    }

    #[test]
    fn the_parallel_pass_leaves_the_disruptive_specs_to_the_other() {
        let local = [("local-one", String::from("why"))];
        let parallel = Pass::Parallel.skip(&local);
        let disruptive = Pass::Disruptive.skip(&local);
        assert!(parallel.contains(DISRUPTIVE) && parallel.contains("local-one"));
        assert!(!disruptive.contains(DISRUPTIVE) && disruptive.contains("local-one"));
        assert_eq!(Pass::Disruptive.label_filter(), Some("Disruptive"));
        assert_eq!(Pass::Parallel.label_filter(), None);
    }
}
