//! The writer processes the drill started: registered by PID so that an interrupted run
//! can kill every one of them (and wait until they let go of their files) before the
//! mounts and loop devices are torn down.

use std::collections::HashSet;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Clone, Default)]
pub struct Procs(Arc<Mutex<HashSet<i32>>>);

impl Procs {
    fn add(&self, pid: i32) {
        self.0.lock().unwrap().insert(pid);
    }
    fn remove(&self, pid: i32) {
        self.0.lock().unwrap().remove(&pid);
    }
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// SIGKILLs every registered process and waits (≤ 5 s) until each has exited (a zombie
    /// has released its files already).
    pub fn kill_all_and_wait(&self) -> usize {
        let pids: Vec<i32> = self.0.lock().unwrap().drain().collect();
        for &pid in &pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for &pid in &pids {
            while alive(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        pids.len()
    }
}

fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => {
            // state is the field after the ")" of the command name.
            let state = s
                .rsplit_once(')')
                .map(|(_, r)| r.trim_start())
                .unwrap_or("");
            !(state.starts_with('Z') || state.starts_with('X'))
        }
        Err(_) => false,
    }
}

/// One running writer ("container").
pub struct Container {
    pub pid: i32,
    child: tokio::process::Child,
    /// Last acknowledged (fsync'ed) record; -1: none yet.
    pub acked: Arc<AtomicI64>,
    /// Records that failed (`err` lines).
    pub errors: Arc<AtomicU64>,
    /// Sequence number it resumed at.
    pub started_at_seq: Arc<AtomicI64>,
    reader: tokio::task::JoinHandle<()>,
    procs: Procs,
}

impl Container {
    pub fn spawn(
        procs: &Procs,
        exe: &std::path::Path,
        file: &std::path::Path,
        interval_ms: u64,
    ) -> std::io::Result<Container> {
        let mut child = tokio::process::Command::new(exe)
            .arg("writer")
            .arg(file)
            .arg("--interval-ms")
            .arg(interval_ms.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().unwrap_or(0) as i32;
        procs.add(pid);
        let acked = Arc::new(AtomicI64::new(-1));
        let errors = Arc::new(AtomicU64::new(0));
        let started_at_seq = Arc::new(AtomicI64::new(-1));
        let out = child.stdout.take().expect("piped stdout");
        let (a, e, s) = (acked.clone(), errors.clone(), started_at_seq.clone());
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(out).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let mut it = line.split_whitespace();
                match (it.next(), it.next().and_then(|v| v.parse::<i64>().ok())) {
                    (Some("ok"), Some(n)) => a.store(n, Ordering::SeqCst),
                    (Some("err"), Some(_)) => {
                        e.fetch_add(1, Ordering::SeqCst);
                    }
                    (Some("start"), Some(n)) => s.store(n, Ordering::SeqCst),
                    _ => {}
                }
            }
        });
        Ok(Container {
            pid,
            child,
            acked,
            errors,
            started_at_seq,
            reader,
            procs: procs.clone(),
        })
    }

    /// Kills the process (as a reboot or the container runtime would), waits for it, and
    /// reads the rest of its output so `acked` is final.
    pub async fn kill(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
        self.procs.remove(self.pid);
        let _ = tokio::time::timeout(Duration::from_secs(2), &mut self.reader).await;
    }
}
