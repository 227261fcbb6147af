//! Running commands and long-lived daemons. Daemons get their own process group, so the
//! terminal's Ctrl-C reaches only the test (whose handler tears down in order) and a
//! daemon is stopped with everything it forked.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The longest a command run by [`run`] may take (an image import of a few hundred MB,
/// `kubectl apply` against a slow API server); past it the command is killed.
const COMMAND_BOUND: Duration = Duration::from_secs(600);

/// Runs `cmd` to completion, at most [`COMMAND_BOUND`]; its stdout, or an error with its
/// stderr.
pub fn run(cmd: &mut Command) -> Result<String> {
    let shown = format!("{cmd:?}");
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {shown}"))?;
    let out = wait_bounded(child, COMMAND_BOUND).with_context(|| format!("running {shown}"))?;
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

/// Waits for `child` (its output read as it comes), killing it past `bound`.
fn wait_bounded(mut child: Child, bound: Duration) -> Result<std::process::Output> {
    use std::io::Read;
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stdout.read_to_end(&mut v);
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = stderr.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + bound;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("still running after {bound:?}: killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok(std::process::Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    })
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
        reap_group(pgid);
        std::thread::sleep(Duration::from_millis(100));
    }
    if group_alive(pgid) {
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
    reap_group(pgid);
}

fn group_alive(pgid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(-pgid, 0) == 0 }
}

/// Reaps the exited children in process group `pgid`, so that a killed daemon does not
/// linger as a zombie (a zombie still counts as a member of its group). Only that group:
/// another thread's child (a `Command::output` under way) is left to its own wait.
pub fn reap_group(pgid: i32) {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with WNOHANG on the children in one group; status is a local.
        let r = unsafe { libc::waitpid(-pgid, &mut status, libc::WNOHANG) };
        if r <= 0 {
            break;
        }
    }
}

/// Reaps `pid` if it is an exited child of this process (else nothing happens).
pub fn reap(pid: i32) {
    let mut status = 0;
    // SAFETY: waitpid with WNOHANG on one pid; status is a local.
    unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
}

/// A process's start time (clock ticks after boot, /proc/<pid>/stat field 22).
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count from its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(19)?.parse().ok()
}
