//! Kubernetes' own storage suite on real kubelets: `kubectl apply -k deploy/base`
//! (unchanged) and `deploy/snapshot` on the three-node cluster of `real_kubelets`, then
//! `e2e.test` (v1.32, "External Storage") with each driver definition of
//! `e2e/testdriver/`. Every selected spec must pass. Skipped (loudly) without its inputs;
//! see `fencecsi_e2e::upstream` and DEVELOPERS.md.

use std::path::PathBuf;

use anyhow::{ensure, Result};
use fencecsi_e2e::cluster;
use fencecsi_e2e::scenarios::{install, snapshot};
use fencecsi_e2e::teardown::Teardown;
use fencecsi_e2e::{inputs, node_access, say, upstream};

#[test]
fn upstream_external_storage_suite_passes_on_the_shipped_deployment() {
    let (inputs, suite, manifests) = match wanted_inputs() {
        Ok(i) => i,
        Err(why) => {
            fencecsi_e2e::skipped(&format!(
                "\n==== SKIPPED: fencecsi-e2e upstream_storage ====\n{why}\nSet {}, {}, {} and {} (see DEVELOPERS.md) to run Kubernetes' External Storage suite.\n=============================================\n",
                inputs::K8S_BIN,
                inputs::IMAGES,
                upstream::SUITE_BINARY,
                snapshot::MANIFESTS,
            ));
            return;
        }
    };
    let td = Teardown::new();
    td.on_signals();
    let guard = td.guard();
    let result = run(&inputs, &suite, &manifests, &td);
    if let Err(e) = &result {
        say(format!("FAILED: {e:#}"));
    }
    drop(guard);
    result.unwrap();
}

fn wanted_inputs() -> Result<(inputs::Inputs, PathBuf, PathBuf), String> {
    let inputs = inputs::from_env()?;
    if !std::path::Path::new(node_access::SSHD).is_file() {
        return Err(format!(
            "{} is missing (openssh-server; scripts/setup.sh installs it when {} is set)",
            node_access::SSHD,
            upstream::SUITE_BINARY
        ));
    }
    let suite = std::env::var_os(upstream::SUITE_BINARY)
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .ok_or_else(|| format!("{} names no e2e.test binary", upstream::SUITE_BINARY))?;
    let manifests = std::env::var_os(snapshot::MANIFESTS)
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .ok_or_else(|| {
            format!(
                "{} names no directory with the snapshot CRDs and snapshot-controller",
                snapshot::MANIFESTS
            )
        })?;
    Ok((inputs, suite, manifests))
}

fn run(
    inputs: &inputs::Inputs,
    suite: &std::path::Path,
    manifests: &std::path::Path,
    td: &Teardown,
) -> Result<()> {
    let definitions = upstream::definitions(&inputs.repo)?;
    let c = cluster::bring_up(inputs, td)?;
    upstream::check_test_images(&c.archives)?;
    c.apply_deploy_base()?;
    install::wait_installed(&c)?;
    snapshot::install(&c, manifests)?;
    let access = node_access::open(&c, td)?;
    let outcomes = run_definitions(&c, suite, &definitions, &access, td);
    // Logs of a failed run are kept; FENCECSI_E2E_KEEP_LOGS=1 keeps them always.
    let keep = !outcomes
        .as_ref()
        .is_ok_and(|o| o.iter().all(|o| o.failed.is_empty()))
        || std::env::var("FENCECSI_E2E_KEEP_LOGS").is_ok_and(|v| v == "1");
    if keep && !td.is_closed() {
        c.save_logs();
    }
    let outcomes = outcomes?;
    let failed: Vec<String> = outcomes
        .iter()
        .flat_map(|o| {
            o.failed
                .iter()
                .map(move |f| format!("{}: {f}", o.definition))
        })
        .collect();
    ensure!(
        failed.is_empty(),
        "{} upstream specs failed:\n  {}",
        failed.len(),
        failed.join("\n  ")
    );
    Ok(())
}

fn run_definitions(
    c: &cluster::Cluster,
    suite: &std::path::Path,
    definitions: &[upstream::Definition],
    access: &node_access::Access,
    td: &Teardown,
) -> Result<Vec<upstream::Outcome>> {
    let mut outcomes = Vec::new();
    for def in definitions {
        let o = upstream::run(c, suite, def, Some(access), td)?;
        say(format!("upstream {}: {}", def.name, o.json()));
        fencecsi_e2e::record_result(c, "upstream-results.jsonl", &o.json())?;
        outcomes.push(o);
    }
    Ok(outcomes)
}
