//! `fencecsi-drill`: the local failover drill. See the crate docs and the README.

use std::time::Duration;

use clap::Parser;
use fencecsi_drill::{Options, Progress};

/// fencecsi's local failover drill: an embedded cluster, the real driver, attacher and
/// podgc on real loop devices; node A shuts down while its writers keep writing. Needs root.
#[derive(Debug, Parser)]
#[command(name = "fencecsi-drill", version, about)]
struct Cli {
    /// Number of nodes (2 to 16).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(2..=16))]
    nodes: u16,
    /// Number of volumes (PVC + StatefulSet pod each) on node A (1 to 64).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    volumes: u16,
    /// Filesystem of the volumes.
    #[arg(long, default_value = "ext4", value_parser = ["ext4", "xfs"])]
    fs: String,
    /// Machine-readable result on stdout (progress goes to stderr).
    #[arg(long)]
    json: bool,
    /// Timeout of each waited-for step, in seconds (at least 1).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    step_timeout: u64,
    /// Records every writer must have acknowledged before node A shuts down.
    #[arg(long, default_value_t = 20)]
    min_records: u64,
    /// Node lifecycle grace (node-monitor-grace-period) in seconds (0.1 to 3600).
    #[arg(long, default_value_t = 2.0, value_parser = seconds, conflicts_with = "production")]
    monitor_grace: f64,
    /// podgc's shutdown grace in seconds (0.1 to 3600).
    #[arg(long, default_value_t = 1.0, value_parser = seconds, conflicts_with = "production")]
    podgc_grace: f64,
    /// Also run a pod whose PV's driver has no safe-detach annotation (it must stay).
    #[arg(long)]
    unsafe_pod: bool,
    /// Production timing instead of the short one: kubelet lease renewal 10 s, node
    /// monitor grace 40 s, NotReady toleration 300 s, attach-detach verification 60 s,
    /// podgc's defaults (lease grace 15 s, shutdown grace 30 s). Not with
    /// --monitor-grace or --podgc-grace. A run takes about two minutes.
    #[arg(long)]
    production: bool,
}

/// A duration in seconds that the drill can wait for.
fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if !(0.1..=3600.0).contains(&v) {
        return Err(format!("{v} s is outside 0.1..3600"));
    }
    Ok(v)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("writer") {
        std::process::exit(fencecsi_drill::writer::main(&args[2..]));
    }
    let cli = Cli::parse();
    // The drill prints its own progress; library logs only on errors (RUST_LOG for more).
    fencecsi_cluster::cli::init_logging(fencecsi_cluster::cli::LogFormat::Text, "error");
    let exe = std::env::current_exe().expect("current exe");
    let mut opts = Options::new(exe);
    opts.nodes = cli.nodes as usize;
    opts.volumes = cli.volumes as usize;
    opts.fs = cli.fs.clone();
    opts.step_timeout = Duration::from_secs(cli.step_timeout);
    opts.min_records = cli.min_records;
    opts.node_monitor_grace = Duration::from_secs_f64(cli.monitor_grace);
    opts.podgc_shutdown_grace = Duration::from_secs_f64(cli.podgc_grace);
    opts.unsafe_pod = cli.unsafe_pod;
    if cli.production {
        opts = opts.production();
    }
    // The failover step waits at least until podgc may act: on the Lease
    // going stale, or on NotReady plus podgc's grace, whichever comes first.
    // A timeout no longer than that can never succeed, so it is refused
    // before anything starts.
    let earliest = opts
        .podgc_lease_grace
        .min(opts.node_monitor_grace + opts.podgc_shutdown_grace);
    if opts.step_timeout <= earliest {
        use clap::CommandFactory;
        Cli::command()
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                format!(
                    "--step-timeout {:?} is not longer than the {earliest:?} podgc waits at least before it acts",
                    opts.step_timeout
                ),
            )
            .exit();
    }
    opts.progress = if cli.json {
        Progress::stderr()
    } else {
        Progress::stdout()
    };
    let progress = opts.progress.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = rt.block_on(fencecsi_drill::run(opts, async {
        fencecsi_driver::server::shutdown_signal().await;
        eprintln!("signal received: stopping the drill and cleaning up");
    }));
    rt.shutdown_timeout(Duration::from_secs(2));
    match result {
        Ok(report) => {
            if cli.json {
                progress.raw("");
                report.print(&progress);
                println!("{}", serde_json::to_string_pretty(&report).unwrap());
            } else {
                report.print(&progress);
            }
            std::process::exit(if report.ok { 0 } else { 1 });
        }
        Err(e) => {
            eprintln!("fencecsi-drill: {e:#}");
            std::process::exit(if format!("{e}") == "interrupted" {
                130
            } else {
                2
            });
        }
    }
}
