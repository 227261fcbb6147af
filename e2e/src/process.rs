//! Running commands and long-lived daemons. Daemons get their own process group, so the
//! terminal's Ctrl-C reaches only the test (whose handler tears down in order) and a
//! daemon is stopped with everything it forked.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Runs `cmd` to completion; its stdout, or an error with its stderr.
pub fn run(cmd: &mut Command) -> Result<String> {
    let shown = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {shown}"))?;
    if !out.status.success() {
        bail!(
            "{shown} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Shorthand: `run(Command::new(prog).args(args))`.
pub fn sh(prog: &str, args: &[&str]) -> Result<String> {
    run(Command::new(prog).args(args))
}

/// Starts `cmd` as the leader of a new process group, output appended to `log`.
/// Returns the child; its pid is the group's id.
pub fn spawn_daemon(cmd: &mut Command, log: &Path) -> Result<Child> {
    use std::os::unix::process::CommandExt;
    let f = File::options()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening log {}", log.display()))?;
    let f2 = f.try_clone()?;
    let shown = format!("{cmd:?}");
    cmd.stdin(Stdio::null())
        .stdout(f)
        .stderr(f2)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {shown}"))
}

/// SIGTERM to process group `pgid`, then SIGKILL after `grace` if any member is left.
pub fn stop_group(pgid: i32, grace: Duration) {
    // SAFETY: kill(2) with a negative pid signals the group; no memory is touched.
    unsafe { libc::kill(-pgid, libc::SIGTERM) };
    let start = Instant::now();
    while start.elapsed() < grace && group_alive(pgid) {
        reap_any();
        std::thread::sleep(Duration::from_millis(100));
    }
    if group_alive(pgid) {
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
    reap_any();
}

fn group_alive(pgid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(-pgid, 0) == 0 }
}

/// Reaps exited children so that a killed daemon does not linger as a zombie (a zombie
/// still counts as a member of its group).
pub fn reap_any() {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with WNOHANG on any child; status is a local.
        let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if r <= 0 {
            break;
        }
    }
}

/// A process's start time (clock ticks after boot, /proc/<pid>/stat field 22).
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count from its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(19)?.parse().ok()
}
