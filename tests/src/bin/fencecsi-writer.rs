//! A stateful writer: appends numbered, checksummed records to a file or
//! block device, syncing each one, and prints `ok <seq>` only after the sync
//! returned success. On an error it prints `err <seq> <errno>` and keeps
//! trying (a real database would too) until killed or `--max-errors` is hit.
//!
//! With `--churn OFFSET` it also works a 64 KiB scratch area at OFFSET
//! after every record, in a cycle of four starting after record 0: a
//! pattern write, a discard, a pattern write, a write-zeroes
//! (BLKDISCARD/BLKZEROOUT on a block device, fallocate punch-hole/zero-range
//! on a file), so every kind of request is in flight when a fence lands.
//! Each discard and write-zeroes is reported as
//! `churn discard|zero ok|err <monotonic ns>`: `ok` only when the call
//! succeeded and the area, which held the pattern just before, reads back
//! as zeros through the same descriptor (so it changed what lies below).
//!
//! usage: fencecsi-writer <path> [--direct] [--max-errors N] [--interval-ms N] [--churn OFFSET]

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};

use fencecsi_fence::kernel::block_range::RangeRequest;
use fencecsi_tests::records::{record, RECORD_SIZE};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(path) = args.get(1).filter(|a| !a.starts_with("--")) else {
        eprintln!("usage: fencecsi-writer <path> [--direct] [--max-errors N] [--interval-ms N]");
        std::process::exit(2);
    };
    let flag = |name: &str| args.iter().position(|a| a == name);
    let value = |name: &str, default: u64| {
        flag(name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let direct = flag("--direct").is_some();
    let max_errors = value("--max-errors", 20);
    let interval = std::time::Duration::from_millis(value("--interval-ms", 0));
    let churn = flag("--churn").map(|_| value("--churn", 64 << 20));

    let mut opts = OpenOptions::new();
    opts.read(true)
        .write(true)
        .create(!path.starts_with("/dev/") && !is_block(path));
    if direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let file = match opts.open(path) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("fencecsi-writer: opening {path}: {e}");
            std::process::exit(1);
        }
    };
    // O_DIRECT needs an aligned buffer.
    let layout = std::alloc::Layout::from_size_align(RECORD_SIZE, 4096).unwrap();
    // SAFETY: non-zero size layout; freed never (process-lifetime buffer).
    let buf = unsafe { std::slice::from_raw_parts_mut(std::alloc::alloc(layout), RECORD_SIZE) };
    let stdout = std::io::stdout();
    let mut errors = 0;
    let mut seq: u64 = 0;
    // Whether the scratch area holds the pattern (the last churn write succeeded).
    let mut primed = false;
    loop {
        buf.copy_from_slice(&record(seq));
        let started = monotonic_ns();
        let result = file
            .write_all_at(buf, seq * RECORD_SIZE as u64)
            .and_then(|_| file.sync_data());
        let mut out = stdout.lock();
        match result {
            Ok(()) => {
                let _ = writeln!(out, "ok {seq} {} {started}", monotonic_ns());
                seq += 1;
            }
            Err(e) => {
                let _ = writeln!(out, "err {seq} {}", e.raw_os_error().unwrap_or(0));
                errors += 1;
                if errors >= max_errors {
                    let _ = out.flush();
                    std::process::exit(3);
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        let _ = out.flush();
        drop(out);
        if let Some(at) = churn {
            if let Some((kind, outcome)) = churn_once(&file, at, seq, buf, &mut primed) {
                let mut out = stdout.lock();
                let (verdict, why) = match outcome {
                    Ok(()) => ("ok", String::new()),
                    Err(why) => ("err", why),
                };
                let _ = writeln!(out, "churn {kind} {verdict} {} {why}", monotonic_ns());
                let _ = out.flush();
            }
        }
        if !interval.is_zero() {
            std::thread::sleep(interval);
        }
    }
}

/// CLOCK_MONOTONIC in ns: the same clock across processes, so the test can
/// compare an acknowledgement with the moment its fence RPC returned.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

const SCRATCH: usize = 64 << 10;

/// One step of scratch work (see the module docs). Returns the discard or
/// write-zeroes it made, and Ok when it verifiably zeroed the pattern, else
/// why not; failures are expected after a fence.
fn churn_once(
    file: &std::fs::File,
    at: u64,
    seq: u64,
    buf: &mut [u8],
    primed: &mut bool,
) -> Option<(&'static str, Result<(), String>)> {
    use std::os::fd::AsRawFd;
    let block = file
        .metadata()
        .map(|m| {
            use std::os::unix::fs::FileTypeExt;
            m.file_type().is_block_device()
        })
        .unwrap_or(false);
    let fd = file.as_raw_fd();
    let pieces = SCRATCH / buf.len();
    let step = seq % 4;
    if step % 2 == 1 {
        buf.fill((seq as u8) | 1);
        *primed = (0..pieces).all(|i| file.write_all_at(buf, at + (i * buf.len()) as u64).is_ok())
            && file.sync_data().is_ok();
        return None;
    }
    let discard = step == 2;
    let sent = if block {
        let request = if discard {
            RangeRequest::Discard
        } else {
            RangeRequest::WriteZeroes
        };
        request.send(file, at, SCRATCH as u64)
    } else {
        let mode = if discard {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE
        };
        // SAFETY: fallocate on our fd.
        match unsafe { libc::fallocate(fd, mode, at as i64, SCRATCH as i64) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    };
    let synced = file.sync_data();
    // The pattern was there, so zeros read back mean the request took
    // effect (both ioctls drop the block device's cache for the range).
    let outcome = if !*primed {
        Err("not-primed".to_string())
    } else if let Err(e) = sent {
        Err(format!("errno={}", e.raw_os_error().unwrap_or(0)))
    } else if let Err(e) = synced {
        Err(format!("sync-errno={}", e.raw_os_error().unwrap_or(0)))
    } else {
        (0..pieces).try_for_each(|i| {
            file.read_exact_at(buf, at + (i * buf.len()) as u64)
                .map_err(|e| format!("read-errno={}", e.raw_os_error().unwrap_or(0)))?;
            match buf.iter().position(|b| *b != 0) {
                None => Ok(()),
                Some(p) => Err(format!("nonzero-at={}", i * buf.len() + p)),
            }
        })
    };
    *primed = false;
    Some((if discard { "discard" } else { "zero" }, outcome))
}

fn is_block(path: &str) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path)
        .map(|m| m.file_type().is_block_device())
        .unwrap_or(false)
}
