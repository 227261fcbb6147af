//! What the suite made, recorded as it is made, undone in reverse: on success, on failure,
//! on panic (the [`Guard`]'s drop) and on Ctrl-C or SIGTERM ([`Teardown::on_signals`]).
//! Only recorded things are undone, so nothing the suite did not create is touched.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{cgroups, process, say};

/// One thing the suite made.
#[derive(Debug, Clone)]
pub enum Made {
    /// A daemon started as the leader of its own process group; `started` (its start
    /// time in /proc) tells it apart from a later process that reused the id.
    ProcessGroup {
        name: String,
        pgid: i32,
        started: u64,
    },
    /// A cgroup (the same relative path in every hierarchy); every process in it is
    /// killed (after a thaw) and the directories removed.
    Cgroup { rel: String },
    /// A network link in the host namespace (the bridge, a veth's host end).
    Link { name: String },
    /// Loop devices whose backing file is on the filesystem with device number `dev`
    /// (the suite's own state filesystem: fencecsi made them). Matched by device, not by
    /// path: a device attached inside a node's namespace shows a path relative to a mount
    /// that is gone once the node is.
    LoopDevicesOn { dev: u64, what: PathBuf },
    /// A filesystem the suite mounted in the host's namespace (its loop device is
    /// auto-cleared on unmount).
    Mount { path: PathBuf },
    /// A directory the suite created; removed whole.
    Dir { path: PathBuf },
}

#[derive(Default)]
struct Inner {
    made: Vec<Made>,
    /// Once the teardown has run, anything recorded later is undone at once.
    closed: bool,
}

/// The shared record; cheap to clone. The second lock is held while undoing, so that a
/// second caller (the panicking test while a signal's teardown runs) waits for it to end
/// instead of letting the process exit half-way.
#[derive(Clone, Default)]
pub struct Teardown(Arc<Mutex<Inner>>, Arc<Mutex<()>>);

impl Teardown {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `m`; if the teardown already ran (a signal came), undoes it now.
    pub fn record(&self, m: Made) {
        let closed = {
            let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if !g.closed {
                g.made.push(m.clone());
            }
            g.closed
        };
        if closed {
            undo(&m);
        }
    }

    /// Whether the teardown has started (a signal came): nothing is left to look at.
    pub fn is_closed(&self) -> bool {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).closed
    }

    /// Records a daemon just spawned as its own process group's leader.
    pub fn record_daemon(&self, name: impl Into<String>, pid: i32) {
        self.record(Made::ProcessGroup {
            name: name.into(),
            pgid: pid,
            started: process::start_time(pid).unwrap_or(0),
        });
    }

    /// Undoes everything recorded, newest first. Runs once; a later call waits for the
    /// first to finish, then does nothing.
    pub fn run(&self) {
        let _busy = self.1.lock().unwrap_or_else(|p| p.into_inner());
        let made = {
            let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if g.closed {
                return;
            }
            g.closed = true;
            std::mem::take(&mut g.made)
        };
        if made.is_empty() {
            return;
        }
        say(format!("teardown: undoing {} things", made.len()));
        // A frozen node (the hang scenario) cannot stop or die: thaw every cgroup first.
        for m in &made {
            if let Made::Cgroup { rel } = m {
                cgroups::thaw_tree(rel);
            }
        }
        for m in made.iter().rev() {
            undo(m);
        }
        say("teardown: done");
    }

    /// Runs the teardown on SIGINT or SIGTERM, then exits 130.
    pub fn on_signals(&self) {
        let td = self.clone();
        std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                use tokio::signal::unix::{signal, SignalKind};
                let (Ok(mut int), Ok(mut term)) = (
                    signal(SignalKind::interrupt()),
                    signal(SignalKind::terminate()),
                ) else {
                    return;
                };
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            });
            say("interrupted: tearing down");
            td.run();
            std::process::exit(130);
        });
    }

    /// A guard that runs the teardown when dropped (also while a panic unwinds).
    pub fn guard(&self) -> Guard {
        Guard(self.clone())
    }
}

pub struct Guard(Teardown);

impl Drop for Guard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            say("panicking: tearing down");
        }
        self.0.run();
    }
}

fn undo(m: &Made) {
    match m {
        Made::ProcessGroup {
            name,
            pgid,
            started,
        } => {
            // A leader that died (a node powered off) may have had its id reused.
            if process::start_time(*pgid) != Some(*started) {
                return;
            }
            say(format!("teardown: stopping {name} (process group {pgid})"));
            process::stop_group(*pgid, Duration::from_secs(10));
        }
        Made::Cgroup { rel } => {
            say(format!("teardown: killing what is left in cgroup {rel}"));
            if let Err(e) = cgroups::kill_and_remove(rel) {
                say(format!("teardown: cgroup {rel}: {e:#}"));
            }
        }
        Made::Link { name } => delete_link(name),
        Made::LoopDevicesOn { dev, what } => {
            if let Err(e) = detach_loop_devices_on(*dev) {
                say(format!(
                    "teardown: loop devices on {}: {e:#}",
                    what.display()
                ));
            }
        }
        Made::Mount { path } => {
            say(format!("teardown: unmounting {}", path.display()));
            if process::sh("umount", &[&path.display().to_string()]).is_err() {
                // Still busy: detach it now, the kernel frees it when the last user goes.
                let _ = process::sh("umount", &["-l", &path.display().to_string()]);
            }
        }
        Made::Dir { path } => {
            say(format!("teardown: removing {}", path.display()));
            remove_tree(path)
        }
    }
}

/// Detaches every loop device whose backing file lives on the filesystem `dev`, read
/// from the kernel (`losetup --list --json`), and only those.
pub fn detach_loop_devices_on(dev: u64) -> anyhow::Result<()> {
    let out = process::sh(
        "losetup",
        &[
            "--list",
            "--json",
            "--output",
            "NAME,MAJ:MIN,BACK-FILE,BACK-MAJ:MIN,BACK-INO",
        ],
    )?;
    if out.trim().is_empty() {
        return Ok(());
    }
    let want = format!("{}:{}", libc::major(dev), libc::minor(dev));
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let devices: Vec<&serde_json::Value> =
        v["loopdevices"].as_array().into_iter().flatten().collect();
    // losetup prints some columns as strings (padded) and numbers as numbers.
    let field = |d: &serde_json::Value, k: &str| match &d[k] {
        serde_json::Value::String(s) => s.trim().to_string(),
        serde_json::Value::Number(n) => n.to_string(),
        _ => String::new(),
    };
    let on_state: Vec<&serde_json::Value> = devices
        .iter()
        .copied()
        .filter(|d| field(d, "back-maj:min") == want)
        .collect();
    // Devices stack on the images: a gate over the image, the node's device over the
    // gate, and for a block volume the kubelet's own loop device over that. Each level's
    // backing file is the device node below, told by its inode (the path is relative to
    // a /dev it saw); the top goes first, or the one below stays held by it.
    let mut levels: Vec<Vec<&serde_json::Value>> = vec![on_state];
    loop {
        let below: Vec<(String, String)> = levels
            .last()
            .into_iter()
            .flatten()
            .filter_map(|d| node_inode(&field(d, "name")))
            .collect();
        let above: Vec<&serde_json::Value> = devices
            .iter()
            .copied()
            .filter(|d| below.contains(&(field(d, "back-maj:min"), field(d, "back-ino"))))
            .collect();
        if above.is_empty() || levels.len() > 8 {
            break;
        }
        levels.push(above);
    }
    for d in levels.iter().rev().flatten() {
        let name = field(d, "name");
        say(format!(
            "teardown: detaching {name} ({})",
            field(d, "back-file")
        ));
        if let Err(e) = process::sh("losetup", &["--detach", &name]) {
            // One marked autoclear goes by itself once the device above lets go.
            if still_attached(&name) {
                say(format!("teardown: {e:#}"));
            }
        }
    }
    Ok(())
}

fn still_attached(dev: &str) -> bool {
    let name = dev.rsplit('/').next().unwrap_or(dev);
    std::path::Path::new("/sys/block")
        .join(name)
        .join("loop/backing_file")
        .exists()
}

/// The (`maj:min` of its filesystem, inode) of a device node, as losetup names a
/// backing file.
fn node_inode(path: &str) -> Option<(String, String)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    let dev = m.dev();
    Some((
        format!("{}:{}", libc::major(dev), libc::minor(dev)),
        m.ino().to_string(),
    ))
}

/// Removes a tree; fenced generations carry the immutable flag, so a failed removal
/// clears that flag below `path` (only there) and tries once more.
fn remove_tree(path: &std::path::Path) {
    match std::fs::remove_dir_all(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(_) => {
            let _ = std::process::Command::new("chattr")
                .args(["-R", "-f", "-i"])
                .arg(path)
                .stderr(std::process::Stdio::null())
                .status();
            if let Err(e) = std::fs::remove_dir_all(path) {
                say(format!("teardown: removing {}: {e}", path.display()));
            }
        }
    }
}

/// Deletes a link the suite made (gone already when its namespace went: fine).
fn delete_link(name: &str) {
    let _ = std::process::Command::new("ip")
        .args(["link", "del", name])
        .stderr(std::process::Stdio::null())
        .status();
}
