//! The fence of a device attached straight onto the image (an older
//! driver's, or an admin's): shrink in place, settle, move into the trailer.
//! A bound, not a proof (see [`SETTLE`]).

use std::time::{Duration, Instant};

use crate::kernel::loop_device::{self, HeldDevice, LoopInfo};
use crate::window::{is_fenced_device, WINDOW_BYTES};

/// How long plain holders (no gate) stay shrunk in place before their
/// windows move into the trailer; gated holders need none. A request that passed the block layer's end-of-device check with
/// the old size runs with whatever window the device has when it gets into
/// the queue: it may be waiting for the queue a remap froze, or for a CPU
/// (a pod at its CPU limit waits for the next CFS period, 100 ms in
/// Kubernetes). If it reaches the queue during the settle it lands in the
/// data, where it was meant to, before the fence returns. Later than that it
/// lands in the trailer and still reports success: a write acknowledged to
/// node A that node B never sees (tests/tests/fence_inflight.rs shows both).
/// Nothing bounds how long a task can be kept off a CPU, so this is a bound
/// chosen, not a proof; [`crate::late_write_at`] finds what outlasted it.
/// The controller's `--fence-settle` sets it; this is its default.
pub const SETTLE: Duration = Duration::from_millis(250);
/// Barriers during the settle: each drains the late requests that got into
/// the queue since the last one (the move's own freeze drains the rest).
const SETTLE_BARRIERS: u32 = 5;

/// One pass over the holders: the ones already fenced get a barrier, the
/// others are shrunk in place, settled for `settle` and moved into the
/// trailer at `end` (see [`SETTLE`](crate::SETTLE)). Each new holder is held open from its
/// shrink to its move (`HeldDevice`), so a device released meanwhile cannot
/// come back as another volume's and be remapped in its place. Returns each
/// holder's result, in order, how many were new, and the time settled
/// (none when no holder was shrunk).
pub(crate) fn remap_pass(
    found: &[LoopInfo],
    data_bytes: u64,
    end: u64,
    settle: Duration,
) -> (
    Vec<Result<LoopInfo, loop_device::LoopError>>,
    usize,
    Duration,
) {
    let mut held: Vec<Option<HeldDevice>> = Vec::with_capacity(found.len());
    let mut results = Vec::with_capacity(found.len());
    let mut new = 0;
    for lo in found {
        if is_fenced_device(lo, data_bytes) {
            // Already fenced (a retry): the remap is a barrier, on the device
            // only while it still backs this image.
            results.push(
                HeldDevice::open(&lo.device, (lo.backing_dev, lo.backing_ino))
                    .and_then(|h| h.remap(lo.offset, lo.size_limit)),
            );
            held.push(None);
            continue;
        }
        new += 1;
        match HeldDevice::open(&lo.device, (lo.backing_dev, lo.backing_ino)) {
            Ok(h) => {
                results.push(shrink_in_place(&h));
                held.push(Some(h));
            }
            Err(e) => {
                results.push(Err(e));
                held.push(None);
            }
        }
    }
    let shrunk: Vec<usize> = (0..found.len())
        .filter(|&i| held[i].is_some() && results[i].is_ok())
        .collect();
    let device = |i: usize| held[i].as_ref().expect("only held devices are in `shrunk`");
    // A zero settle is the fence as it was before the settle: one barrier.
    let (barriers, pause) = if shrunk.is_empty() {
        (0, Duration::ZERO)
    } else if settle.is_zero() {
        (1, Duration::ZERO)
    } else {
        (SETTLE_BARRIERS, settle / SETTLE_BARRIERS)
    };
    let settle_start = Instant::now();
    for _ in 0..barriers {
        std::thread::sleep(pause);
        for &i in &shrunk {
            if let Ok(now) = &results[i] {
                results[i] = device(i).remap(now.offset, now.size_limit);
            }
        }
    }
    for &i in &shrunk {
        if results[i].is_ok() {
            results[i] = device(i).remap(end, WINDOW_BYTES);
        }
    }
    let settled = if pause.is_zero() {
        Duration::ZERO
    } else {
        settle_start.elapsed()
    };
    (results, new, settled)
}

/// Shrinks a device to one sector at its current offset: from here the end
/// check refuses every new request of more than a sector, and the requests
/// already past it land in the data if they reach the queue before the
/// window moves (see [`SETTLE`](crate::SETTLE)).
fn shrink_in_place(device: &HeldDevice) -> Result<LoopInfo, loop_device::LoopError> {
    let now = device.status()?;
    device.remap(now.offset, WINDOW_BYTES)
}
