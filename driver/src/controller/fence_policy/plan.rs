//! The fence policy of ControllerUnpublishVolume: which generations of the volume to
//! fence, how much of each, and why; and from which generation each target node is
//! then fenced. It decides from facts gathered beforehand (the record, one scan of
//! the loop devices matched to generations by inode, the targets, the request), so
//! every case is a table test without root. Making the fence is `crate::fence`;
//! carrying the plan out and recording it is `publish.rs`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::backend::meta::VolumeMeta;
use crate::fence::is_fenced_device;
use crate::ids::VolumeId;
use crate::kernel::loop_device::LoopInfo;
use crate::terms::{node_tag, parse_tag_full};

/// What the plan is made from.
pub(in crate::controller) struct UnpublishFacts<'a> {
    pub id: &'a VolumeId,
    pub record: &'a VolumeMeta,
    /// The nodes unpublished: the request's node, or every attached node.
    pub targets: &'a [String],
    pub fence_requested: bool,
    /// A node process held the volume's attachments lock past its bound: a stage
    /// stuck mid-attach may still attach what its node is attached to.
    pub stuck_stage: bool,
    /// The loop devices backed by each generation's image, from one scan.
    pub holders: &'a BTreeMap<u64, Vec<LoopInfo>>,
}

/// How much of a generation a fence takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::controller) enum Scope {
    /// Every writable device and the image itself: no node may write it any more.
    Whole,
    /// Only the writable devices not tagged for these node tags: nodes outside the
    /// unpublish are attached to the generation by right, and keep it.
    DevicesExcept(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::controller) enum Reason {
    /// The request asked for the fence.
    Requested,
    /// Not asked for, but a stage stuck mid-attach may still attach the generation.
    StuckStage,
    /// Not asked for, but the kernel shows a target still holding it writable.
    KernelHolds(Vec<PathBuf>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::controller) struct FenceStep {
    pub generation: u64,
    pub scope: Scope,
    pub reason: Reason,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub(in crate::controller) struct UnpublishPlan {
    pub fences: Vec<FenceStep>,
    /// (node, generation): the target may not have the volume back until it let go
    /// of that generation.
    pub fenced_from: Vec<(String, u64)>,
}

impl Reason {
    /// The text recorded (and shown in the volume's condition) for a fence nobody
    /// asked for; None when the request asked.
    pub fn unrequested_why(&self, targets: &[String]) -> Option<String> {
        let who = if targets.len() == 1 {
            format!("node {}", targets[0])
        } else {
            "the node".into()
        };
        match self {
            Reason::Requested => None,
            Reason::StuckStage => Some(format!(
                "fenced although the unpublish did not ask: a process of {who} held the volume's attachments lock for {:?} (a stage stuck mid-attach?), so it may still attach this generation",
                crate::locks::NODE_LOCK_WAIT
            )),
            Reason::KernelHolds(devices) => Some(format!(
                "fenced although the unpublish did not ask: the kernel shows {who} still holding it ({})",
                devices
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }
}

/// Decides the fences of one unpublish. A generation is fenced when:
/// - the request asks and a target is attached to it writable, or anything not
///   entitled holds it writable;
/// - a stage is stuck and a target is attached to it writable;
/// - the kernel shows a target holding it writable, unless it is fenced already and
///   every such device shows only the fence window.
///
/// A read-only attachment cannot write, so it alone never needs a fence. With
/// another node entitled to the generation, only the targets' and strays' devices
/// are fenced, never the generation.
pub(in crate::controller) fn plan_unpublish(f: &UnpublishFacts) -> UnpublishPlan {
    let v = f.record;
    let target_tags: Vec<String> = f.targets.iter().map(|n| node_tag(n)).collect();
    let mut plan = UnpublishPlan::default();
    for (&gen, generation) in &v.generations {
        let devices = f.holders.get(&gen).map(Vec::as_slice).unwrap_or_default();
        let attached = f.targets.iter().any(|n| {
            v.attachments
                .get(n)
                .is_some_and(|a| a.generation == gen && !a.readonly)
        });
        let others = entitled_others(v, f.targets, gen);
        let held = writable(devices, f.id, gen, &|tag| {
            target_tags.iter().any(|t| Some(t.as_str()) == tag)
                || (f.fence_requested && !others.iter().any(|o| Some(o.as_str()) == tag))
        });
        let reason = if f.fence_requested && (attached || !held.is_empty()) {
            Reason::Requested
        } else if f.stuck_stage && attached {
            Reason::StuckStage
        } else if !held.is_empty()
            && (generation.fenced_at.is_none()
                || !held.iter().all(|l| is_fenced_device(l, v.data_bytes(gen))))
        {
            Reason::KernelHolds(held.iter().map(|l| l.device.clone()).collect())
        } else {
            continue;
        };
        let scope = if others.is_empty() {
            Scope::Whole
        } else {
            Scope::DevicesExcept(others)
        };
        for node in f.targets {
            let tag = node_tag(node);
            let holds = v.attachments.get(node).is_some_and(|a| a.generation == gen)
                || !writable(devices, f.id, gen, &|t| t == Some(tag.as_str())).is_empty();
            if holds {
                plan.fenced_from.push((node.clone(), gen));
            }
        }
        plan.fences.push(FenceStep {
            generation: gen,
            scope,
            reason,
        });
    }
    plan
}

/// Node tags of the nodes outside `targets` attached to `gen`, readers included.
fn entitled_others(v: &VolumeMeta, targets: &[String], gen: u64) -> Vec<String> {
    v.attachments
        .iter()
        .filter(|(n, a)| a.generation == gen && !targets.contains(n))
        .map(|(n, _)| node_tag(n))
        .collect()
}

/// The node part of a loop tag, when the tag names this volume and generation.
pub(in crate::controller) fn tag_node<'a>(
    tag: &'a str,
    id: &VolumeId,
    gen: u64,
) -> Option<&'a str> {
    // A gate carries its device's tag behind a prefix: it is that node's
    // (a gate is listed alone only while its attach is under way).
    let tag = tag
        .strip_prefix(crate::kernel::loop_device::GATE_TAG_PREFIX)
        .unwrap_or(tag);
    parse_tag_full(tag)
        .filter(|(v, g, _)| v == id && *g == gen)
        .map(|(_, _, n)| n)
}

/// The writable devices among `devices` (backed by `gen`) whose tag's node part
/// `pick` accepts (None: not one of our tags at all).
pub(in crate::controller) fn writable(
    devices: &[LoopInfo],
    id: &VolumeId,
    gen: u64,
    pick: &dyn Fn(Option<&str>) -> bool,
) -> Vec<LoopInfo> {
    devices
        .iter()
        .filter(|l| !l.read_only && pick(tag_node(&l.tag, id, gen)))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::meta::{Attachment, Generation};
    use crate::fence::WINDOW_BYTES;
    use crate::terms::loop_tag;

    const DATA: u64 = 64 << 20;

    fn id() -> VolumeId {
        match VolumeId::parse("vol-0123456789abcdef0123456789abcdef") {
            Ok(crate::ids::Parsed::Ours(v)) => v,
            _ => unreachable!(),
        }
    }

    /// A record with generations 1..=`gens` (those in `fenced` fenced) and the
    /// attachments given as (node, generation, read-only).
    fn record(gens: u64, fenced: &[u64], attachments: &[(&str, u64, bool)]) -> VolumeMeta {
        let mut v = VolumeMeta {
            id: id().as_str().into(),
            name: "pvc".into(),
            state: crate::backend::meta::VolumeState::Ready,
            capacity_bytes: DATA,
            fs_type: "ext4".into(),
            parameters: BTreeMap::new(),
            source: None,
            created_at: 0,
            current_generation: gens,
            generations: BTreeMap::new(),
            attachments: BTreeMap::new(),
            fenced_from: BTreeMap::new(),
            mutable_parameters: BTreeMap::new(),
            version: 0,
        };
        for g in 1..=gens {
            v.generations.insert(
                g,
                Generation {
                    created_at: 0,
                    origin: None,
                    fenced_at: fenced.contains(&g).then_some(1),
                    fenced_node: None,
                    data_bytes: Some(DATA),
                    fence_reason: None,
                },
            );
        }
        for &(n, g, ro) in attachments {
            v.attachments.insert(
                n.into(),
                Attachment {
                    generation: g,
                    readonly: ro,
                    block: false,
                    published_at: 0,
                },
            );
        }
        v
    }

    /// A loop device on `gen` tagged for `node` (None: someone else's, untagged).
    fn device(n: u32, gen: u64, node: Option<&str>, read_only: bool) -> LoopInfo {
        LoopInfo {
            device: format!("/dev/loop{n}").into(),
            number: n,
            tag: node
                .map(|node| loop_tag(&id(), gen, node))
                .unwrap_or_default(),
            read_only,
            size_bytes: DATA,
            backing_dev: 0,
            backing_ino: 0,
            direct_io: false,
            autoclear: false,
            offset: 0,
            size_limit: 0,
            gate: None,
        }
    }

    /// A device that shows only the fence window (a fence already remapped it).
    fn windowed(n: u32, gen: u64, node: &str) -> LoopInfo {
        LoopInfo {
            offset: DATA,
            size_limit: WINDOW_BYTES,
            size_bytes: WINDOW_BYTES,
            ..device(n, gen, Some(node), false)
        }
    }

    struct Case {
        name: &'static str,
        record: VolumeMeta,
        targets: &'static [&'static str],
        fence: bool,
        stuck_stage: bool,
        holders: Vec<LoopInfo>,
        want: Vec<(u64, Scope, Reason)>,
        want_fenced_from: &'static [(&'static str, u64)],
    }

    fn case(name: &'static str, record: VolumeMeta, targets: &'static [&'static str]) -> Case {
        Case {
            name,
            record,
            targets,
            fence: false,
            stuck_stage: false,
            holders: vec![],
            want: vec![],
            want_fenced_from: &[],
        }
    }

    fn loop_dev(n: u32) -> PathBuf {
        format!("/dev/loop{n}").into()
    }

    #[test]
    fn plans_for_every_kind_of_unpublish() {
        let other_tag = node_tag("b");
        let cases = vec![
            Case {
                fence: true,
                want: vec![(1, Scope::Whole, Reason::Requested)],
                want_fenced_from: &[("a", 1)],
                ..case(
                    "fence asked, writer attached",
                    record(1, &[], &[("a", 1, false)]),
                    &["a"],
                )
            },
            case(
                // A CO's ordinary detach after the node unstaged: nothing to fence.
                "no fence asked, writer attached, nothing held",
                record(1, &[], &[("a", 1, false)]),
                &["a"],
            ),
            Case {
                holders: vec![device(3, 1, Some("a"), false)],
                want: vec![(1, Scope::Whole, Reason::KernelHolds(vec![loop_dev(3)]))],
                want_fenced_from: &[("a", 1)],
                ..case(
                    "no fence asked, the kernel shows the node writing",
                    record(1, &[], &[("a", 1, false)]),
                    &["a"],
                )
            },
            Case {
                holders: vec![windowed(3, 1, "a")],
                ..case(
                    "no fence asked, held only through a fence window",
                    record(1, &[1], &[("a", 1, false)]),
                    &["a"],
                )
            },
            Case {
                holders: vec![device(3, 1, Some("a"), false)],
                want: vec![(1, Scope::Whole, Reason::KernelHolds(vec![loop_dev(3)]))],
                want_fenced_from: &[("a", 1)],
                // Recorded as fenced, but a device still shows the data (a fence
                // an older driver or a crash left incomplete): fenced again.
                ..case(
                    "no fence asked, fenced already, a device still shows the data",
                    record(1, &[1], &[("a", 1, false)]),
                    &["a"],
                )
            },
            Case {
                fence: true,
                stuck_stage: true,
                want: vec![(1, Scope::Whole, Reason::Requested)],
                want_fenced_from: &[("a", 1)],
                ..case(
                    "fence asked and a stage stuck: the request's reason",
                    record(1, &[], &[("a", 1, false)]),
                    &["a"],
                )
            },
            Case {
                holders: vec![windowed(3, 1, "a")],
                want: vec![(1, Scope::Whole, Reason::KernelHolds(vec![loop_dev(3)]))],
                want_fenced_from: &[("a", 1)],
                // The record does not say fenced (a crash between the fence and the
                // record): the window alone is not trusted.
                ..case(
                    "no fence asked, windowed but not recorded as fenced",
                    record(1, &[], &[("a", 1, false)]),
                    &["a"],
                )
            },
            Case {
                fence: true,
                ..case(
                    "fence asked, reader attached, nothing held",
                    record(1, &[], &[("a", 1, true)]),
                    &["a"],
                )
            },
            Case {
                fence: true,
                holders: vec![device(3, 1, Some("a"), true)],
                ..case(
                    "fence asked, reader holds a read-only device",
                    record(1, &[], &[("a", 1, true)]),
                    &["a"],
                )
            },
            Case {
                fence: true,
                holders: vec![
                    device(3, 1, Some("a"), false),
                    device(4, 1, Some("b"), false),
                ],
                want: vec![(
                    1,
                    Scope::DevicesExcept(vec![other_tag.clone()]),
                    Reason::Requested,
                )],
                want_fenced_from: &[("a", 1)],
                ..case(
                    "fence asked, another writer attached by right",
                    record(1, &[], &[("a", 1, false), ("b", 1, false)]),
                    &["a"],
                )
            },
            Case {
                fence: true,
                want: vec![(
                    1,
                    Scope::DevicesExcept(vec![other_tag.clone()]),
                    Reason::Requested,
                )],
                want_fenced_from: &[("a", 1)],
                ..case(
                    "fence asked, another node reads the generation",
                    record(1, &[], &[("a", 1, false), ("b", 1, true)]),
                    &["a"],
                )
            },
            Case {
                stuck_stage: true,
                want: vec![(1, Scope::Whole, Reason::StuckStage)],
                want_fenced_from: &[("a", 1)],
                ..case(
                    "no fence asked, a stage stuck mid-attach",
                    record(1, &[], &[("a", 1, false)]),
                    &["a"],
                )
            },
            Case {
                stuck_stage: true,
                ..case(
                    "a stage stuck, but the node is not attached",
                    record(1, &[], &[]),
                    &["a"],
                )
            },
            Case {
                fence: true,
                holders: vec![device(5, 1, None, false)],
                want: vec![(1, Scope::Whole, Reason::Requested)],
                // Nothing ties the stray to node a: a is not fenced from it.
                ..case(
                    "fence asked, not attached, a stray (losetup) writes",
                    record(1, &[], &[]),
                    &["a"],
                )
            },
            Case {
                holders: vec![device(5, 1, None, false)],
                // Without a fence, someone else's device is not the target's.
                ..case(
                    "no fence asked, a stray writes",
                    record(1, &[], &[]),
                    &["a"],
                )
            },
            Case {
                fence: true,
                holders: vec![device(3, 1, Some("a"), false)],
                want: vec![
                    (1, Scope::Whole, Reason::Requested),
                    (2, Scope::Whole, Reason::Requested),
                ],
                want_fenced_from: &[("a", 1), ("a", 2)],
                // Published to generation 2 while a device on 1 stayed behind.
                ..case(
                    "fence asked, an older generation still held",
                    record(2, &[], &[("a", 2, false)]),
                    &["a"],
                )
            },
            Case {
                fence: true,
                want: vec![(1, Scope::Whole, Reason::Requested)],
                want_fenced_from: &[("a", 1), ("b", 1)],
                // No node named: every attached node is a target.
                ..case(
                    "fence asked for every node",
                    record(1, &[], &[("a", 1, false), ("b", 1, true)]),
                    &["a", "b"],
                )
            },
        ];
        for c in cases {
            let targets: Vec<String> = c.targets.iter().map(|s| s.to_string()).collect();
            let mut holders: BTreeMap<u64, Vec<LoopInfo>> = BTreeMap::new();
            for h in &c.holders {
                let gen = tag_generation(&h.tag).unwrap_or(1);
                holders.entry(gen).or_default().push(h.clone());
            }
            let plan = plan_unpublish(&UnpublishFacts {
                id: &id(),
                record: &c.record,
                targets: &targets,
                fence_requested: c.fence,
                stuck_stage: c.stuck_stage,
                holders: &holders,
            });
            let got: Vec<(u64, Scope, Reason)> = plan
                .fences
                .into_iter()
                .map(|s| (s.generation, s.scope, s.reason))
                .collect();
            assert_eq!(got, c.want, "{}", c.name);
            let want_from: Vec<(String, u64)> = c
                .want_fenced_from
                .iter()
                .map(|(n, g)| (n.to_string(), *g))
                .collect();
            assert_eq!(plan.fenced_from, want_from, "{}: fenced_from", c.name);
        }
    }

    fn tag_generation(tag: &str) -> Option<u64> {
        parse_tag_full(tag).map(|(_, g, _)| g)
    }

    #[test]
    fn an_unrequested_fence_says_why() {
        let a = ["a".to_string()];
        assert_eq!(Reason::Requested.unrequested_why(&a), None);
        let held = Reason::KernelHolds(vec![loop_dev(3), loop_dev(4)])
            .unrequested_why(&a)
            .unwrap();
        assert!(
            held.contains("node a still holding it (/dev/loop3, /dev/loop4)"),
            "{held}"
        );
        let stuck = Reason::StuckStage.unrequested_why(&a).unwrap();
        assert!(stuck.contains("a stage stuck mid-attach"), "{stuck}");
    }
}
