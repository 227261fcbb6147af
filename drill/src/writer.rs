//! The drill's "container": a stateful writer that appends numbered, checksummed records
//! (`fencecsi_tests::records`) to one file, `fdatasync`s each, and prints `ok <seq>` only
//! after the sync succeeded. On start it resumes after the last intact record already in
//! the file (as a database replays its log). On an error it prints `err <seq> <errno>` and
//! keeps trying, as a real database would, until it is killed.
//!
//! Run as the hidden subcommand `fencecsi-drill writer <path> [--interval-ms N]`.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::FileExt;

use fencecsi_tests::records::{check, record, RECORD_SIZE};

/// Number of intact records at the start of `data` (0, 1, 2, ... without a gap).
pub fn intact_prefix(data: &[u8]) -> u64 {
    let mut n = 0u64;
    while let Some(b) = data.get(n as usize * RECORD_SIZE..(n as usize + 1) * RECORD_SIZE) {
        if !check(b, n) {
            break;
        }
        n += 1;
    }
    n
}

/// The writer's main loop; never returns unless the file cannot be opened.
pub fn main(args: &[String]) -> i32 {
    let Some(path) = args.first() else {
        eprintln!("usage: fencecsi-drill writer <path> [--interval-ms N]");
        return 2;
    };
    let interval = args
        .iter()
        .position(|a| a == "--interval-ms")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(10u64);
    let file = match OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("fencecsi-drill writer: opening {path}: {e}");
            return 1;
        }
    };
    let existing = std::fs::read(path).unwrap_or_default();
    let mut seq = intact_prefix(&existing);
    let stdout = std::io::stdout();
    let _ = writeln!(stdout.lock(), "start {seq}");
    loop {
        let result = file
            .write_all_at(&record(seq), seq * RECORD_SIZE as u64)
            .and_then(|_| file.sync_data());
        let mut out = stdout.lock();
        match result {
            Ok(()) => {
                let _ = writeln!(out, "ok {seq}");
                seq += 1;
            }
            Err(e) => {
                let _ = writeln!(out, "err {seq} {}", e.raw_os_error().unwrap_or(0));
                drop(out);
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        let _ = std::io::stdout().flush();
        std::thread::sleep(std::time::Duration::from_millis(interval));
    }
}
