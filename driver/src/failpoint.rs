//! Crash points for tests: `hit(name)` aborts the process on the spot when
//! `name` is listed in the `FENCECSI_FAILPOINTS` environment variable
//! (comma-separated, read once). Crash tests use it to kill the plugin
//! between two steps of an RPC deterministically, then check that a restarted
//! plugin finishes the retried call without doubling anything. Unset (as in
//! production), every `hit` is one relaxed load and a comparison.

use std::sync::OnceLock;

pub const ENV: &str = "FENCECSI_FAILPOINTS";

static ARMED: OnceLock<Vec<String>> = OnceLock::new();

fn armed() -> &'static [String] {
    ARMED.get_or_init(|| {
        std::env::var(ENV)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Aborts the process (no destructors, no socket clean-up: a crash) when
/// the failpoint `name` is armed.
pub fn hit(name: &str) {
    if armed().iter().any(|p| p == name) {
        eprintln!("fencecsi-driver: failpoint {name} hit: aborting");
        std::process::abort();
    }
}

/// Whether the failpoint `name` is armed, for failures a test simulates
/// without a crash (e.g. `fence-probe:fail`: the start-up fence probe fails).
pub fn is_armed(name: &str) -> bool {
    armed().iter().any(|p| p == name)
}
