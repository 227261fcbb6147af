//! A flock wait has a bound: past it the call fails with TimedOut and leaves no
//! waiter behind in the kernel (/proc/locks), and a wait within it gets the lock.

use std::fs::File;
use std::time::{Duration, Instant};

use fencecsi_driver::kernel::flock::flock_within;
use fencecsi_tests::flock_waiter_on;

#[test]
fn a_file_lock_wait_ends_at_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lock");
    let held = flock_within(File::create(&path).unwrap(), true, Duration::ZERO).unwrap();
    let start = Instant::now();
    let err = flock_within(
        File::open(&path).unwrap(),
        false,
        Duration::from_millis(100),
    )
    .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    assert!(start.elapsed() >= Duration::from_millis(100));
    // The waiter thread is gone, not parked in flock (the kernel would
    // list it in /proc/locks as a waiter on the file).
    assert!(
        !flock_waiter_on(&path),
        "a timed-out wait left a waiter on the lock"
    );
    // Control: a waiter gets the lock once it is released, and the
    // waiter left behind above lets go of it at once.
    let waiter = std::thread::spawn({
        let path = path.clone();
        move || flock_within(File::open(&path).unwrap(), true, Duration::from_secs(10))
    });
    // Control for the check above: a wait still under way is listed.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !flock_waiter_on(&path) {
        assert!(Instant::now() < deadline, "a waiting flock is never listed");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(held);
    let again = waiter.join().unwrap().expect("the lock once released");
    drop(again);
    flock_within(File::open(&path).unwrap(), true, Duration::from_secs(10)).unwrap();
}
