//! Small helpers for the benchmark targets: percentiles, direct-I/O write
//! loads, peak RSS.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

/// p-th percentile (0..=100) of durations, in milliseconds.
pub fn pct_ms(samples: &[Duration], p: f64) -> f64 {
    let mut v: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[idx.min(v.len() - 1)]
}

/// Peak resident set size of this process (VmHWM), in MiB.
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| {
                    l.strip_prefix("VmHWM:")
                        .map(|v| v.trim().trim_end_matches(" kB").trim().parse::<f64>().ok())
                })
                .flatten()
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

fn aligned(len: usize) -> &'static mut [u8] {
    let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
    // SAFETY: non-zero layout; the buffer lives for the process (benchmarks only).
    let buf = unsafe { std::slice::from_raw_parts_mut(std::alloc::alloc(layout), len) };
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    buf
}

/// Sequential O_DIRECT writes of `total` bytes in 1 MiB blocks, then
/// fdatasync. Returns MiB/s.
pub fn seq_write(path: &Path, total: u64) -> f64 {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap();
    let buf = aligned(1 << 20);
    let t = Instant::now();
    let mut off = 0;
    while off < total {
        f.write_all_at(buf, off).unwrap();
        off += buf.len() as u64;
    }
    f.sync_data().unwrap();
    (total as f64 / (1 << 20) as f64) / t.elapsed().as_secs_f64()
}

/// Random 4 KiB O_DIRECT overwrites within the first `span` bytes of a file
/// that is first written in full (so both sides measure the I/O path, not
/// block allocation or unwritten-extent conversion), by `threads` writers
/// with `count` writes in all, then fdatasync. Returns IOPS.
pub fn rand_write(path: &Path, span: u64, count: u64, threads: u64, seed: u64) -> f64 {
    seq_write(path, span);
    let f = std::sync::Arc::new(
        std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .unwrap(),
    );
    let blocks = span / 4096;
    let t = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|i| {
            let f = f.clone();
            std::thread::spawn(move || {
                let buf = aligned(4096);
                let mut rng = crate::rig::Rng::new(seed * 1000 + i);
                for _ in 0..count / threads {
                    f.write_all_at(buf, (rng.next_u64() % blocks) * 4096)
                        .unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    f.sync_data().unwrap();
    count as f64 / t.elapsed().as_secs_f64()
}
