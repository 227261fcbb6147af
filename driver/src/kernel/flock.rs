//! Advisory `flock`s whose waits have a bound (std's `File::lock` family waits
//! for good).

use std::fs::File;
use std::time::Duration;

/// Takes an advisory `flock` on `file` (shared or exclusive), waiting at most
/// `bound`; the file, locked. A lock still held by someone else then is
/// `ErrorKind::TimedOut`.
///
/// The wait is a real blocking `flock` (so the kernel lists the waiter in
/// /proc/locks) on a thread of its own: past the bound that thread is left
/// waiting, and when it gets the lock it finds nobody to hand it to and lets
/// go at once. So a holder that never lets go costs one parked thread per
/// timed-out wait, never a call that hangs.
pub fn flock_within(file: File, exclusive: bool, bound: Duration) -> std::io::Result<File> {
    let tried = if exclusive {
        file.try_lock()
    } else {
        file.try_lock_shared()
    };
    match tried {
        Ok(()) => return Ok(file),
        Err(std::fs::TryLockError::Error(e)) => return Err(e),
        Err(std::fs::TryLockError::WouldBlock) if bound.is_zero() => return Err(timed_out(bound)),
        Err(std::fs::TryLockError::WouldBlock) => {}
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("flock-wait".into())
        .spawn(move || {
            let locked = if exclusive {
                file.lock()
            } else {
                file.lock_shared()
            };
            // Nobody waits any more: the file (and its lock) drops here.
            let _ = tx.send(locked.map(|()| file));
        })?;
    match rx.recv_timeout(bound) {
        Ok(locked) => locked,
        Err(_) => Err(timed_out(bound)),
    }
}

fn timed_out(bound: Duration) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("held by another process for {bound:?}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

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
        // Control: a waiter gets the lock once it is released, and the
        // waiter left behind above lets go of it at once.
        let waiter = std::thread::spawn({
            let path = path.clone();
            move || flock_within(File::open(&path).unwrap(), true, Duration::from_secs(10))
        });
        drop(held);
        let again = waiter.join().unwrap().expect("the lock once released");
        drop(again);
        flock_within(File::open(&path).unwrap(), true, Duration::from_secs(10)).unwrap();
    }
}
