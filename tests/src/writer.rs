//! The record writer as a child process: starts `fencecsi-writer`, reads its
//! `ok <seq> <monotonic ns>` / `err <seq> <errno>` lines on a thread, and
//! keeps what it acknowledged, with when; and, with `--churn`, its
//! `churn <discard|zero> <ok|err> <monotonic ns>` lines.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use crate::monotonic_ns;

/// Acknowledged records (seq, CLOCK_MONOTONIC ns) and errors, as the writer reports them.
#[derive(Default)]
pub struct WriterLog {
    acks: Mutex<Vec<(u64, u64)>>,
    /// (seq, CLOCK_MONOTONIC ns when its write began), for acknowledged records.
    starts: Mutex<Vec<(u64, u64)>>,
    errors: Mutex<Vec<(u64, i32, u64)>>,
    churn: Mutex<Vec<Churn>>,
}

/// One discard or write-zeroes of the writer's scratch area.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Churn {
    /// "discard" or "zero".
    pub kind: String,
    /// The call succeeded and the area it was given read back as zeros
    /// after holding the writer's pattern.
    pub ok: bool,
    /// CLOCK_MONOTONIC ns, taken by the writer after the read-back.
    pub at: u64,
    /// Why not ok (the writer's words), empty when ok.
    pub why: String,
}

/// Everything a stopped writer reported.
pub struct WriterReport {
    /// Acknowledged records: (seq, CLOCK_MONOTONIC ns).
    pub acks: Vec<(u64, u64)>,
    /// The same records: (seq, CLOCK_MONOTONIC ns when the write began).
    pub starts: Vec<(u64, u64)>,
    pub errors: usize,
    /// The records that failed at least once (a failed record is retried, same bytes).
    pub failed: std::collections::BTreeSet<u64>,
    pub churn: Vec<Churn>,
}

pub struct Writer {
    child: std::process::Child,
    log: Arc<WriterLog>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    /// Runs `exe` (the fencecsi-writer binary: `env!("CARGO_BIN_EXE_fencecsi-writer")`
    /// in a test) on `path`, with O_DIRECT when `direct`, plus `extra` arguments.
    pub fn start(exe: &Path, path: &Path, direct: bool, extra: &[&str]) -> Writer {
        let mut cmd = Command::new(exe);
        cmd.arg(path)
            .args(["--max-errors", "100000"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if direct {
            cmd.arg("--direct");
        }
        let mut child = cmd.spawn().expect("spawning the writer");
        let out = child.stdout.take().unwrap();
        let log = Arc::new(WriterLog::default());
        let l = log.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let mut parts = line.split_whitespace();
                let kind = parts.next();
                let seq = parts.next().and_then(|s| s.parse::<u64>().ok());
                let third = parts.next().and_then(|s| s.parse::<i64>().ok());
                if kind == Some("churn") {
                    let mut f = line.split_whitespace().skip(1);
                    if let (Some(k), Some(v), Some(at)) = (
                        f.next(),
                        f.next(),
                        f.next().and_then(|t| t.parse::<u64>().ok()),
                    ) {
                        l.churn.lock().unwrap().push(Churn {
                            kind: k.to_string(),
                            ok: v == "ok",
                            at,
                            why: f.collect::<Vec<_>>().join(" "),
                        });
                    }
                    continue;
                }
                match (kind, seq) {
                    (Some("ok"), Some(seq)) => {
                        l.acks
                            .lock()
                            .unwrap()
                            .push((seq, third.unwrap_or(0) as u64));
                        if let Some(start) = parts.next().and_then(|s| s.parse::<u64>().ok()) {
                            l.starts.lock().unwrap().push((seq, start));
                        }
                    }
                    (Some("err"), Some(seq)) => l.errors.lock().unwrap().push((
                        seq,
                        third.unwrap_or(0) as i32,
                        monotonic_ns(),
                    )),
                    _ => {}
                }
            }
        });
        Writer {
            child,
            log,
            reader: Some(reader),
        }
    }

    /// The writer process's pid (to look at it in /proc).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn acked(&self) -> u64 {
        self.log.acks.lock().unwrap().len() as u64
    }

    /// Acknowledged records whose write began after `t` (CLOCK_MONOTONIC ns), by the
    /// writer's own stamps: what it wrote after `t`, however late its lines are read.
    pub fn acked_started_after(&self, t: u64) -> usize {
        self.log
            .starts
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, start)| *start > t)
            .count()
    }

    pub fn errors_since(&self, t: u64) -> usize {
        self.log
            .errors
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.2 >= t)
            .count()
    }

    /// Kills the writer; returns its acknowledgements (seq, CLOCK_MONOTONIC ns) and its error count.
    pub fn stop(self) -> (Vec<(u64, u64)>, usize) {
        let r = self.finish();
        (r.acks, r.errors)
    }

    /// Kills the writer; returns all it reported (every line it printed is read first).
    pub fn finish(mut self) -> WriterReport {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        // One lock at a time: a struct literal keeps every guard it makes until its end.
        let errors = self.log.errors.lock().unwrap().clone();
        WriterReport {
            acks: self.log.acks.lock().unwrap().clone(),
            starts: self.log.starts.lock().unwrap().clone(),
            errors: errors.len(),
            failed: errors.iter().map(|e| e.0).collect(),
            churn: self.log.churn.lock().unwrap().clone(),
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
