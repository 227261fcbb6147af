//! The scenarios, each asserting real outcomes on the running cluster.

pub mod day2;
pub mod evidence;
pub mod expansion;
pub mod failover;
pub mod install;
pub mod leader;
pub mod least_privilege;
pub mod snapshot;
pub mod writer;

/// Wall-clock time in nanoseconds since the epoch: the clock the writer's records and the
/// API server's timestamps are read against.
fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}
