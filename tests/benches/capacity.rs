//! Capacity check benchmark: the accounting every CreateVolume, clone and
//! expansion runs before it takes space (`backend::capacity::assess`: every
//! record in memory, one `stat` of every generation and snapshot image) at
//! 100, 1,000 and 10,000 volumes. The baseline in the same run, at the same
//! count, is the one record write the same call makes anyway
//! (`MetaStore::put_volume`: write, fsync, rename, fsync of the directory).
//!
//! cargo bench -p fencecsi-tests --bench capacity
//! FENCECSI_BENCH_VOLUMES (default "100,1000,10000"), FENCECSI_BENCH_ROUNDS (default 20)

use std::collections::BTreeMap;
use std::time::Instant;

use fencecsi_driver::backend::capacity::{self, Policy};
use fencecsi_driver::backend::image::ImageBackend;
use fencecsi_driver::backend::meta::{Generation, MetaStore, VolumeMeta, VolumeState};
use fencecsi_driver::backend::Backend;
use fencecsi_driver::config::{CapacityReserve, Config, Mode};
use fencecsi_driver::ids::VolumeId;
use fencecsi_tests::bench::pct_ms;

const VOLUME_BYTES: u64 = 1 << 30;

fn record(id: &VolumeId, i: usize) -> VolumeMeta {
    VolumeMeta {
        id: id.to_string(),
        name: format!("pvc-{i}"),
        state: VolumeState::Ready,
        capacity_bytes: VOLUME_BYTES,
        fs_type: "ext4".into(),
        parameters: BTreeMap::new(),
        source: None,
        created_at: 0,
        current_generation: 1,
        generations: BTreeMap::from([(
            1,
            Generation {
                created_at: 0,
                origin: None,
                fenced_at: None,
                fenced_node: None,
                data_bytes: Some(VOLUME_BYTES),
                fence_reason: None,
            },
        )]),
        attachments: BTreeMap::new(),
        fenced_from: BTreeMap::new(),
        mutable_parameters: BTreeMap::new(),
        version: 0,
    }
}

fn main() {
    let counts: Vec<usize> = std::env::var("FENCECSI_BENCH_VOLUMES")
        .unwrap_or_else(|_| "100,1000,10000".into())
        .split(',')
        .map(|n| n.trim().parse().expect("FENCECSI_BENCH_VOLUMES: counts"))
        .collect();
    let rounds: usize = std::env::var("FENCECSI_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(20);
    let scratch = tempfile::tempdir_in("/var/tmp").expect("a scratch dir under /var/tmp");
    let mut cfg = Config::local(
        Mode::Controller,
        None,
        scratch.path().join("unused"),
        scratch.path().join("unused"),
        scratch.path().join("unused.sock"),
    );
    // Over-committed, so sparse 1 GiB images of 10,000 volumes are allowed.
    cfg.overcommit_ratio = 1e6;
    cfg.capacity_reserve = CapacityReserve::Bytes(0);
    let policy = Policy::of(&cfg);
    println!(
        "| volumes | assess p50 ms | p95 ms | record write p50 ms | p95 ms | assess / write |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for n in counts {
        let state = tempfile::tempdir_in(scratch.path()).unwrap();
        let backend = ImageBackend::new(state.path()).unwrap();
        let store = MetaStore::open(state.path()).unwrap();
        let made = Instant::now();
        let mut ids = Vec::with_capacity(n);
        for i in 0..n {
            let id = VolumeId::generate();
            backend.create(&id, 1, VOLUME_BYTES).unwrap();
            store.put_volume(&record(&id, i)).unwrap();
            ids.push(id);
        }
        eprintln!(
            "capacity bench: {n} volumes made in {:.1} s",
            made.elapsed().as_secs_f64()
        );
        let mut assess = Vec::with_capacity(rounds);
        let mut write = Vec::with_capacity(rounds);
        for r in 0..rounds {
            let t = Instant::now();
            let a = capacity::assess(&policy, &backend, &store).unwrap();
            assess.push(t.elapsed());
            assert_eq!(a.committed, n as u64 * (VOLUME_BYTES + (1 << 20)));
            let id = &ids[r % n];
            let mut v = store.volume(id).unwrap();
            v.name = format!("pvc-rewritten-{r}");
            let t = Instant::now();
            store.put_volume(&v).unwrap();
            write.push(t.elapsed());
        }
        let (a50, w50) = (pct_ms(&assess, 50.0), pct_ms(&write, 50.0));
        println!(
            "| {n} | {a50:.2} | {:.2} | {w50:.2} | {:.2} | {:.2}x |",
            pct_ms(&assess, 95.0),
            pct_ms(&write, 95.0),
            a50 / w50
        );
    }
}
