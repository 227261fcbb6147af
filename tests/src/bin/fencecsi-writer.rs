//! A stateful writer: appends numbered, checksummed records to a file or
//! block device, syncing each one, and prints `ok <seq>` only after the sync
//! returned success. On an error it prints `err <seq> <errno>` and keeps
//! trying (a real database would too) until killed or `--max-errors` is hit.
//!
//! usage: fencecsi-writer <path> [--direct] [--max-errors N] [--interval-ms N]

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};

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
    loop {
        buf.copy_from_slice(&record(seq));
        let result = file
            .write_all_at(buf, seq * RECORD_SIZE as u64)
            .and_then(|_| file.sync_data());
        let mut out = stdout.lock();
        match result {
            Ok(()) => {
                let _ = writeln!(out, "ok {seq}");
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
        if !interval.is_zero() {
            std::thread::sleep(interval);
        }
    }
}

fn is_block(path: &str) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path)
        .map(|m| m.file_type().is_block_device())
        .unwrap_or(false)
}
