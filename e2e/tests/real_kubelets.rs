//! The shipped deployment on real kubelets: `kubectl apply -k deploy/base` (unchanged) on a
//! v1.32 control plane and three namespaced nodes with containerd, then a StatefulSet
//! failing over through a real partition. Skipped (loudly) without its inputs; see
//! `fencecsi_e2e::inputs` and DEVELOPERS.md.

use std::time::Duration;

use anyhow::{Context, Result};
use fencecsi_e2e::cluster::{self, Cluster};
use fencecsi_e2e::scenarios::day2::{self, Operation};
use fencecsi_e2e::scenarios::failover::{self, Fault};
use fencecsi_e2e::scenarios::writer::{self, Writer};
use fencecsi_e2e::scenarios::{expansion, install, leader, least_privilege, snapshot};
use fencecsi_e2e::teardown::Teardown;
use fencecsi_e2e::{inputs, say};

#[test]
fn shipped_deployment_fails_over_through_a_real_partition() {
    let inputs = match inputs::from_env() {
        Ok(i) => i,
        Err(why) => {
            fencecsi_e2e::skipped(&format!(
                "\n==== SKIPPED: fencecsi-e2e real_kubelets ====\n{why}\nSet {} and {} (and see DEVELOPERS.md) to run the shipped deployment on real kubelets.\n=============================================\n",
                inputs::K8S_BIN,
                inputs::IMAGES
            ));
            return;
        }
    };
    let td = Teardown::new();
    td.on_signals();
    let guard = td.guard();
    let result = run(&inputs, &td);
    if let Err(e) = &result {
        say(format!("FAILED: {e:#}"));
    }
    drop(guard);
    result.unwrap();
}

fn run(inputs: &inputs::Inputs, td: &Teardown) -> Result<()> {
    let mut c = cluster::bring_up(inputs, td)?;
    let outcome = scenarios(&mut c, td);
    // Logs of a failed run are kept; FENCECSI_E2E_KEEP_LOGS=1 keeps them always.
    let keep = outcome.is_err() || std::env::var("FENCECSI_E2E_KEEP_LOGS").is_ok_and(|v| v == "1");
    if keep && !td.is_closed() {
        c.save_logs();
    }
    outcome
}

/// The faults to run, in order: `FENCECSI_E2E_FAULTS`, a comma-separated list of
/// `partition`, `power-off` and `hang` (the writer's node fails, the leading controller runs
/// elsewhere) and `controller-partition`, `controller-power-off` and `controller-hang` (the
/// writer is moved onto the leading controller's node, which fails, and a second writer's
/// node, with no controller pod, fails a few seconds later, while the controller fails
/// over); repeat one to measure it several times. Each: the fault, and whether it hits the leader's node.
fn faults() -> Result<Vec<(Fault, bool)>> {
    let spec = std::env::var("FENCECSI_E2E_FAULTS").unwrap_or_else(|_| DEFAULT_FAULTS.into());
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let (name, on_leader) = match s.strip_prefix("controller-") {
                Some(rest) => (rest, true),
                None => (s, false),
            };
            let fault = match name {
                "partition" => Fault::Partition,
                "power-off" => Fault::PowerOff,
                "hang" => Fault::Hang,
                _ => anyhow::bail!(
                    "FENCECSI_E2E_FAULTS: unknown fault {s:?} (partition, power-off, hang, each also as controller-<fault>)"
                ),
            };
            Ok((fault, on_leader))
        })
        .collect()
}

const DEFAULT_FAULTS: &str =
    "partition,hang,power-off,controller-partition,controller-hang,controller-power-off";

fn scenarios(c: &mut Cluster, td: &Teardown) -> Result<()> {
    let faults = faults()?;
    c.apply_deploy_base()?;
    install::wait_installed(c)?;
    least_privilege::node_plugin_keeps_to_its_own_node(c)?;
    expansion::claim_grows_online(c)?;
    let controller = install::controller_node(c)?;
    let prefer = c
        .nodes
        .iter()
        .map(|n| n.spec.name.clone())
        .find(|n| *n != controller)
        .context("no node without the controller")?;
    say(format!(
        "writer: StatefulSet on fencecsi-ext4, off the controller's node {controller}"
    ));
    c.kubectl.apply_text(&writer::manifest(
        Writer::FIRST,
        "fencecsi-ext4",
        &[&controller],
        &prefer,
    ))?;
    let t = std::time::Instant::now();
    writer::wait_writing(c, Writer::FIRST, 1, Duration::from_secs(180))?;
    say(format!(
        "provisioning: claim bound, volume attached and the writer writing {:.1} s after apply",
        t.elapsed().as_secs_f64()
    ));
    match std::env::var_os(snapshot::MANIFESTS) {
        Some(dir) => {
            snapshot::install(c, std::path::Path::new(&dir))?;
            snapshot::restores_what_was_acknowledged(c)?;
        }
        None => say(format!(
            "snapshot: not run ({} names no directory with the snapshot CRDs and snapshot-controller)",
            snapshot::MANIFESTS
        )),
    }
    if std::env::var("FENCECSI_E2E_DAY2")
        .map(|v| v != "0")
        .unwrap_or(true)
    {
        for op in Operation::ALL {
            day2::undisturbed(c, op, td)?;
        }
    }
    let figures = fail_over_each(c, &faults, td)?;
    let secs: Vec<String> = figures
        .iter()
        .map(|f| {
            let leader = f
                .fault_to_new_leader_s
                .zip(f.fault_to_controller_s)
                .map(|(p, all)| format!(" (plugin's Lease {p:.1}, every election {all:.1})"))
                .unwrap_or_default();
            format!(
                "{} ({}) {:.1}{leader}",
                f.fault, f.writer, f.fault_to_running_s
            )
        })
        .collect();
    say(format!(
        "fault → writer Running on another node, seconds: {}",
        secs.join(", ")
    ));
    // A last look: every node is still Ready.
    let names: Vec<String> = c.nodes.iter().map(|n| n.spec.name.clone()).collect();
    c.wait_nodes_ready(&names, Duration::from_secs(60))?;
    Ok(())
}

/// Each fault in turn, with the writers it takes placed first; every writer's figures.
fn fail_over_each(
    c: &mut Cluster,
    faults: &[(Fault, bool)],
    td: &Teardown,
) -> Result<Vec<failover::Figures>> {
    let mut figures = Vec::new();
    for (i, (fault, on_leader)) in faults.iter().enumerate() {
        let place = if *on_leader {
            "the leading controller's node"
        } else {
            "the writer's node, not the leading controller's"
        };
        say(format!(
            "failover {}/{}: {} of {place}",
            i + 1,
            faults.len(),
            fault.name()
        ));
        let writers = if *on_leader {
            leader::place_writer_on_leader(c, "fencecsi-ext4")?;
            leader::place_second_writer(c, "fencecsi-ext4")?;
            vec![Writer::FIRST, Writer::SECOND]
        } else {
            if writer::wait_writing(c, Writer::FIRST, 1, Duration::from_secs(180))?.1
                == install::controller_node(c)?
            {
                leader::place_writer_off_leader(c, "fencecsi-ext4")?;
            }
            vec![Writer::FIRST]
        };
        for f in failover::fail_over_and_return(c, *fault, &writers, td)? {
            say(format!("figures: {}", f.json()));
            fencecsi_e2e::record_result(c, "results.jsonl", &f.json().to_string())?;
            figures.push(f);
        }
    }
    Ok(figures)
}
