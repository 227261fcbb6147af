//! The fence of a gate and the devices stacked on it: shut, drain, move.
//! `kernel::loop_gate` says why this is a proof and not a bound.

use std::path::PathBuf;

use crate::kernel::loop_device::{self, HeldDevice, LoopInfo};
use crate::kernel::loop_gate;

/// The holders `pick` selects: gated ones grouped by gate (a gate is
/// selected with every device on it when `pick` selects any of them), and
/// plain ones (attached straight to the image: by an older driver, or by
/// hand).
pub(crate) fn split_by_gate(
    found: &[LoopInfo],
    pick: &dyn Fn(&LoopInfo) -> bool,
) -> (Vec<Vec<LoopInfo>>, Vec<LoopInfo>) {
    let mut groups: Vec<Vec<LoopInfo>> = Vec::new();
    let mut plain = Vec::new();
    for lo in found {
        match &lo.gate {
            Some(g) => match groups
                .iter_mut()
                .find(|grp| grp[0].gate.as_ref() == Some(g))
            {
                Some(grp) => grp.push(lo.clone()),
                None => groups.push(vec![lo.clone()]),
            },
            None if pick(lo) => plain.push(lo.clone()),
            None => {}
        }
    }
    groups.retain(|grp| grp.iter().any(pick));
    (groups, plain)
}

/// A device and its state after a fence.
pub(crate) type DeviceAfter = (PathBuf, Result<LoopInfo, loop_device::LoopError>);

/// The fence of one gate and the devices stacked on it (see
/// `kernel::loop_gate` for why this is a proof and not a bound):
/// 1. each device above is made to use direct I/O if someone switched it
///    off (its requests then complete only once the gate completed them);
/// 2. the gate is shut in place (capacity 0, offset unchanged): every
///    request a device above runs from now on fails in the gate's
///    block-device file, whenever it passed its own end check;
/// 3. a barrier on each device above: the requests that ran before the shut
///    complete, into the data, before this returns;
/// 4. the gate's empty window moves past the data, so a request sent to the
///    gate itself (not through a device above) lands in the trailer, where
///    [`crate::late_write_at`] finds it.
///
/// No timed wait. Returns each device's state after, by device.
pub(crate) fn shut_gate(group: &[LoopInfo], data_bytes: u64, end: u64) -> Vec<DeviceAfter> {
    let gate_path = group[0].gate.clone().expect("grouped by gate");
    let backing = (group[0].backing_dev, group[0].backing_ino);
    let outcome = (|| -> Result<Vec<DeviceAfter>, loop_device::LoopError> {
        let gate = HeldDevice::open(&gate_path, backing)?;
        // The devices above, from their own status (not from the listing,
        // which sees them through the gate): a device above that is skipped
        // would not be drained. Only one unbound since counts as released.
        let held: Vec<HeldDevice> = loop_device::stacked_on(&gate_path)?
            .iter()
            .filter_map(|t| match HeldDevice::open(t, backing) {
                Err(loop_device::LoopError::NotBound(_)) => None,
                other => Some(other),
            })
            .collect::<Result<_, _>>()?;
        for top in &held {
            if !top.raw_status()?.direct_io {
                loop_device::set_direct_io_raw(top.path(), true)?;
                if !top.raw_status()?.direct_io {
                    return Err(loop_device::LoopError::NotDirect {
                        device: top.path().to_path_buf(),
                        gate: gate_path.clone(),
                    });
                }
                tracing::warn!(device = %top.path().display(), "a device on a gate was using buffered I/O: switched back to direct I/O before the fence");
            }
        }
        let now = gate.status()?;
        if now.size_limit != loop_gate::SHUT_LIMIT {
            gate.remap(now.offset, loop_gate::SHUT_LIMIT)?;
        }
        for top in &held {
            top.barrier()?;
        }
        if now.offset < data_bytes {
            gate.remap(end, loop_gate::SHUT_LIMIT)?;
        }
        let mut out: Vec<_> = held
            .iter()
            .map(|t| (t.path().to_path_buf(), t.status()))
            .collect();
        if held.is_empty() {
            out.push((gate_path.clone(), gate.status()));
        }
        Ok(out)
    })();
    outcome.unwrap_or_else(|e| vec![(gate_path, Err(e))])
}
