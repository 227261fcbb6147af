//! podgc at scale on the embedded cluster (5,000 nodes, 150,000 pods by default) against a
//! naive full-list scan doing the same work; see `tests/common/scale.rs` for what is
//! measured.
//!
//! ```text
//! cargo bench -p fencecsi-podgc --bench scale
//! PODGC_BENCH_NODES=500 PODGC_BENCH_PODS_PER_NODE=30 PODGC_BENCH_ROUNDS=3 cargo bench -p fencecsi-podgc --bench scale
//! ```
//!
//! Parameters (environment, defaults in brackets): `PODGC_BENCH_NODES` [5000],
//! `PODGC_BENCH_PODS_PER_NODE` [30], `PODGC_BENCH_ROUNDS` [3], and
//! `PODGC_BENCH_SAFE_PER_NODE` [22], `PODGC_BENCH_UNSAFE_PER_NODE` [3],
//! `PODGC_BENCH_TIMEOUT` [60s] (per round).

#[path = "../tests/common/scale.rs"]
mod scale;

use std::str::FromStr;

use scale::BenchArgs;

/// `name` parsed with `parse`, or `default` when unset or empty; exits on a bad value.
fn env_or<T, E: std::fmt::Display>(
    name: &str,
    default: T,
    parse: impl Fn(&str) -> Result<T, E>,
) -> T {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => parse(v.trim()).unwrap_or_else(|e| {
            eprintln!("{name}={v:?}: {e}");
            std::process::exit(2)
        }),
        _ => default,
    }
}

fn main() {
    let d = BenchArgs::default();
    let args = BenchArgs {
        nodes: env_or("PODGC_BENCH_NODES", d.nodes, usize::from_str),
        pods_per_node: env_or(
            "PODGC_BENCH_PODS_PER_NODE",
            d.pods_per_node,
            usize::from_str,
        ),
        safe_per_node: env_or(
            "PODGC_BENCH_SAFE_PER_NODE",
            d.safe_per_node,
            usize::from_str,
        ),
        unsafe_per_node: env_or(
            "PODGC_BENCH_UNSAFE_PER_NODE",
            d.unsafe_per_node,
            usize::from_str,
        ),
        rounds: env_or("PODGC_BENCH_ROUNDS", d.rounds, usize::from_str),
        timeout: env_or(
            "PODGC_BENCH_TIMEOUT",
            d.timeout,
            fencecsi_cluster::cli::parse_duration,
        ),
        grace: d.grace,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(scale::run(args)) {
        Ok(report) => println!("{report}"),
        Err(e) => {
            eprintln!("podgc benchmark: {e:#}");
            std::process::exit(1);
        }
    }
}
