//! Loop I/O matrix: write throughput into an ext4 filesystem on a loop
//! device, buffered or direct I/O to the image, each through a gate (as
//! nodes attach: `loop_gate`) and straight onto the image (before gates),
//! against the same I/O on a plain file of the backing filesystem.
//!
//! This VM's disk is noisy (the same workload varies 2x between runs), so every
//! round measures the plain file and then each configuration, workload by
//! workload, and the ratio is taken within the round; the table gives the
//! median ratio and its range over the rounds.
//!
//! cargo bench -p fencecsi-tests --bench loopio   (needs root)
//! FENCECSI_BENCH_ROUNDS (default 5)

use std::path::{Path, PathBuf};
use std::process::Command;

use fencecsi_driver::kernel::loop_device::{self, AttachOptions};
use fencecsi_driver::kernel::loop_gate;
use fencecsi_tests::bench::{rand_write, seq_write};
use fencecsi_tests::Env;

/// One loop configuration: a device with ext4 mounted on it. Dropping it
/// unmounts and detaches, also on a panic.
struct Volume {
    label: String,
    device: PathBuf,
    mnt: PathBuf,
}

impl Volume {
    fn new(dir: &Path, block_size: u32, direct_io: bool, gated: bool) -> Volume {
        let label = format!(
            "{} B blocks, {}, {}",
            block_size,
            if direct_io { "direct I/O" } else { "buffered" },
            if gated { "gated" } else { "no gate" }
        );
        let name = format!(
            "lbs{block_size}-{}-{}",
            if direct_io { "dio" } else { "buf" },
            if gated { "gated" } else { "plain" }
        );
        let img = dir.join(format!("{name}.img"));
        std::fs::File::create(&img)
            .unwrap()
            .set_len(4 << 30)
            .unwrap();
        let opts = AttachOptions {
            direct_io,
            tag: format!("fcsi-bench-{name}"),
            logical_block_size: block_size,
            ..Default::default()
        };
        let info = if gated {
            loop_gate::attach_gated(&img, &opts).unwrap()
        } else {
            loop_device::attach(&img, &opts).unwrap()
        };
        assert_eq!(
            info.direct_io, direct_io,
            "{label}: the kernel refused the mode"
        );
        let mnt = dir.join(&name);
        std::fs::create_dir_all(&mnt).unwrap();
        let vol = Volume {
            label,
            device: info.device,
            mnt,
        };
        // The driver's own mkfs (same options as a volume's first stage).
        fencecsi_driver::kernel::filesystem::mkfs(&vol.device, "ext4").unwrap();
        let ok = Command::new("mount")
            .arg(&vol.device)
            .arg(&vol.mnt)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mounting {}", vol.device.display());
        vol
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        let _ = fencecsi_driver::kernel::mounts::unmount(&self.mnt);
        let _ = loop_device::detach(&self.device);
    }
}

const WORKLOADS: [&str; 4] = [
    "sequential 1 MiB O_DIRECT, 1 GiB + fdatasync (MiB/s)",
    "random 4 KiB O_DIRECT overwrite, 1 writer (QD1) (IOPS)",
    "random 4 KiB O_DIRECT overwrite, 4 writers (IOPS)",
    "random 4 KiB O_DIRECT overwrite, 16 writers (IOPS)",
];

fn run(dir: &Path, workload: usize, seed: u64) -> f64 {
    let (span, count) = (256u64 << 20, 20_000u64);
    let f = dir.join("bench-file");
    let v = match workload {
        0 => seq_write(&f, 1 << 30),
        1 => rand_write(&f, span, count, 1, seed),
        2 => rand_write(&f, span, count * 2, 4, seed),
        _ => rand_write(&f, span, count * 4, 16, seed),
    };
    std::fs::remove_file(&f).unwrap();
    v
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    if !fencecsi_tests::can_run_kernel_tests() {
        eprintln!("SKIPPED: the loop I/O benchmark needs root and loop devices");
        return;
    }
    let rounds: usize = std::env::var("FENCECSI_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let env = Env::new();
    let plain = env.path().join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    // The driver's configurations (512 B blocks, both modes), each as nodes
    // attach it now (through a gate) and as before gates (straight onto the
    // image). FENCECSI_BENCH_LBS4096=1 adds 4096 B blocks (no gain measured).
    let mut configs = vec![(512, false), (512, true)];
    if std::env::var("FENCECSI_BENCH_LBS4096").as_deref() == Ok("1") {
        configs.extend([(4096, false), (4096, true)]);
    }
    let volumes: Vec<Volume> = configs
        .into_iter()
        .flat_map(|(bs, dio)| [(bs, dio, false), (bs, dio, true)])
        .map(|(bs, dio, gated)| Volume::new(env.path(), bs, dio, gated))
        .collect();
    // ratios[workload][volume] over rounds; plain[workload] over rounds.
    let mut ratios = vec![vec![Vec::new(); volumes.len()]; WORKLOADS.len()];
    let mut absolute = vec![vec![Vec::new(); volumes.len() + 1]; WORKLOADS.len()];
    for round in 0..rounds {
        eprintln!("round {}/{rounds}", round + 1);
        for w in 0..WORKLOADS.len() {
            let seed = 7 + round as u64;
            let base = run(&plain, w, seed);
            absolute[w][0].push(base);
            for (i, v) in volumes.iter().enumerate() {
                let x = run(&v.mnt, w, seed);
                absolute[w][i + 1].push(x);
                ratios[w][i].push(x / base);
            }
        }
    }
    println!("## Loop I/O matrix: ext4 volume on a loop device vs a plain file of the backing filesystem ({rounds} rounds)\n");
    print!("| workload | plain file |");
    for v in &volumes {
        print!(" {} |", v.label);
    }
    println!();
    println!("|---|---:|{}", "---:|".repeat(volumes.len()));
    for (w, name) in WORKLOADS.iter().enumerate() {
        print!("| {name} | {:.0} |", median(&mut absolute[w][0]));
        for i in 0..volumes.len() {
            let abs = median(&mut absolute[w][i + 1]);
            let r = &mut ratios[w][i];
            let m = median(r);
            let (lo, hi) = (r[0], r[r.len() - 1]);
            print!(
                " {abs:.0} = **{:.0}%** ({:.0}–{:.0}%) |",
                m * 100.0,
                lo * 100.0,
                hi * 100.0
            );
        }
        println!();
    }
    drop(volumes);
    env.assert_clean();
}
