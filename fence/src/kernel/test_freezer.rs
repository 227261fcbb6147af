//! A cgroup v1 freezer cgroup of a test's own: a paused node, for the processes put in it
//! (the driver's ownership takeover tests and tests/tests/freeze_crash.rs).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const FREEZER: &str = "/sys/fs/cgroup/freezer";

/// A freezer cgroup made by this test; on drop thawed, its processes (the test's own)
/// SIGKILLed, and removed.
pub struct Freezer {
    path: PathBuf,
}

impl Freezer {
    /// Whether this machine has the cgroup v1 freezer (says SKIPPED when not).
    pub fn available() -> bool {
        let there = Path::new(FREEZER).join("freezer.state").exists()
            || Path::new(FREEZER).join("tasks").exists();
        if !there {
            eprintln!("SKIPPED: needs the cgroup v1 freezer at {FREEZER}");
        }
        there
    }

    pub fn new(name: &str) -> Freezer {
        let path = Path::new(FREEZER).join(format!("fencecsi-test-{}-{name}", std::process::id()));
        std::fs::create_dir(&path).expect("making a freezer cgroup");
        Freezer { path }
    }

    /// Moves the process `pid` (all its threads) into this cgroup.
    pub fn add(&self, pid: u32) {
        std::fs::write(self.path.join("cgroup.procs"), pid.to_string()).unwrap();
    }

    pub fn freeze(&self) {
        self.set("FROZEN");
    }

    pub fn thaw(&self) {
        self.set("THAWED");
    }

    /// Writes `state` and waits until the kernel reports it (every task frozen, or none).
    fn set(&self, state: &str) {
        std::fs::write(self.path.join("freezer.state"), state).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::fs::read_to_string(self.path.join("freezer.state"))
            .unwrap()
            .trim()
            != state
        {
            assert!(
                Instant::now() < deadline,
                "the freezer never reached {state}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Freezer {
    fn drop(&mut self) {
        // Thawed, then emptied: only the test's own processes are in it, and a frozen
        // process could never be reaped. A zombie leaves its cgroup, so rmdir follows.
        let _ = std::fs::write(self.path.join("freezer.state"), "THAWED");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let procs = std::fs::read_to_string(self.path.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            if std::fs::remove_dir(&self.path).is_ok() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The signals pending for the whole process `pid` (`ShdPnd` in /proc/<pid>/status).
pub fn shared_pending(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("ShdPnd:"))
        .unwrap();
    u64::from_str_radix(line.trim(), 16).unwrap()
}

/// SIGKILL's bit in [`shared_pending`].
pub const SIGKILL_PENDING: u64 = 1 << (libc::SIGKILL - 1);
