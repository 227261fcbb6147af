//! Smoke test of the scale benchmark (`benches/scale.rs`) on a small cluster: the shared
//! code in `common/scale.rs` keeps compiling and podgc and the naive baseline do the same
//! work.

#[path = "common/scale.rs"]
mod scale;

use std::time::Duration;

use scale::{run, BenchArgs};

#[tokio::test]
async fn small_bench_runs() {
    let r = run(BenchArgs {
        nodes: 20,
        pods_per_node: 10,
        safe_per_node: 6,
        unsafe_per_node: 2,
        rounds: 2,
        timeout: Duration::from_secs(20),
        grace: Duration::from_secs(2),
    })
    .await
    .unwrap();
    assert_eq!(r.pods, 200);
    for round in r.podgc.iter().chain(&r.naive) {
        assert_eq!(round.pods_deleted, 8, "{round:?}");
        assert_eq!(round.pods_left, 2, "{round:?}");
        assert_eq!(round.vas_deleted, 6, "{round:?}");
    }
}
