//! Bounded waits: every wait in the suite names what it waits for and gives up with that
//! name and the last thing it saw.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};

/// Polls `probe` every `every` until it returns `Some`, for at most `limit`.
/// `probe` errors are kept as the last observation and retried (the API server or a node
/// may be coming up); the error after `limit` names `what` and that observation.
pub fn until<T>(
    what: &str,
    limit: Duration,
    every: Duration,
    mut probe: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    let mut last = String::from("nothing observed yet");
    loop {
        match probe() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = format!("{e:#}"),
        }
        if start.elapsed() >= limit {
            bail!("timed out after {limit:?} waiting for {what} (last error: {last})");
        }
        std::thread::sleep(every);
    }
}

/// Like [`until`], but the probe explains each miss, so the timeout says what was seen.
pub fn until_explained<T>(
    what: &str,
    limit: Duration,
    every: Duration,
    mut probe: impl FnMut() -> Result<Result<T, String>>,
) -> Result<T> {
    let start = Instant::now();
    loop {
        let last = match probe() {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(seen)) => seen,
            Err(e) => format!("error: {e:#}"),
        };
        if start.elapsed() >= limit {
            bail!("timed out after {limit:?} waiting for {what}; last seen: {last}");
        }
        std::thread::sleep(every);
    }
}
