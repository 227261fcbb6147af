//! Advisory `flock`s whose waits have a bound (std's `File::lock` family waits
//! for good).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Takes an advisory `flock` on `file` (shared or exclusive), waiting at most
/// `bound`; the file, locked. A lock still held by someone else then is
/// `ErrorKind::TimedOut`.
///
/// The wait is a real blocking `flock` (so the kernel lists the waiter in
/// /proc/locks) on a thread of its own. Past the bound that thread is
/// interrupted (a signal with a handler that does nothing, so the `flock`
/// fails with EINTR) and ends: a holder that never lets go costs neither a
/// call that hangs nor a thread left behind.
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
    let signal = interrupt_signal()?;
    let abandoned = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let waiter = std::thread::Builder::new()
        .name("flock-wait".into())
        .spawn({
            let abandoned = abandoned.clone();
            move || {
                // The interrupt must reach this thread whatever mask it inherited.
                // SAFETY: a valid, initialised signal set for this thread's mask.
                unsafe {
                    let mut set: libc::sigset_t = std::mem::zeroed();
                    libc::sigemptyset(&mut set);
                    libc::sigaddset(&mut set, signal);
                    libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
                }
                let _ = tx.send(wait_for_lock(file, exclusive, &abandoned));
            }
        })?;
    let result = match rx.recv_timeout(bound) {
        Ok(locked) => locked,
        Err(_) => {
            abandoned.store(true, Ordering::SeqCst);
            // Repeated: a signal that came before the thread was in `flock`
            // interrupted nothing. The thread checks `abandoned` before each wait.
            let give_up = Instant::now() + INTERRUPT_BOUND;
            loop {
                // SAFETY: the thread is not joined yet, so its pthread_t is valid.
                unsafe { libc::pthread_kill(waiter.as_pthread_t(), signal) };
                match rx.recv_timeout(Duration::from_millis(5)) {
                    // It got the lock just now: as good as within the bound.
                    Ok(Ok(file)) => break Ok(file),
                    Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => {
                        break Err(timed_out(bound))
                    }
                    Err(RecvTimeoutError::Timeout) if Instant::now() >= give_up => {
                        // A wait the signal does not end (a filesystem whose
                        // flock cannot be interrupted): left parked, as a last
                        // resort, rather than this call hanging.
                        tracing::warn!(?bound, "a timed-out flock wait did not end when interrupted: its thread is left waiting");
                        return Err(timed_out(bound));
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                }
            }
        }
    };
    let _ = waiter.join();
    result
}

/// The blocking wait of [`flock_within`]'s thread: `flock` until it is taken,
/// fails, or is interrupted after the caller gave up.
fn wait_for_lock(file: File, exclusive: bool, abandoned: &AtomicBool) -> std::io::Result<File> {
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    };
    loop {
        if abandoned.load(Ordering::SeqCst) {
            return Err(std::io::Error::from_raw_os_error(libc::EINTR));
        }
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(file);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// The real-time signal that interrupts an abandoned wait, its do-nothing
/// handler installed once (without SA_RESTART, so `flock` returns EINTR).
fn interrupt_signal() -> std::io::Result<libc::c_int> {
    static INSTALLED: OnceLock<Result<libc::c_int, i32>> = OnceLock::new();
    extern "C" fn interrupt(_: libc::c_int) {}
    let installed = INSTALLED.get_or_init(|| {
        // Past the ones glibc keeps for itself (SIGRTMIN() already skips them).
        let signal = libc::SIGRTMIN() + 4;
        // SAFETY: a zeroed sigaction with a handler that touches nothing.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = interrupt as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
            }
        }
        Ok(signal)
    });
    installed.map_err(std::io::Error::from_raw_os_error)
}

/// How long a timed-out wait is interrupted, again and again, before its
/// thread is left to itself.
const INTERRUPT_BOUND: Duration = Duration::from_secs(1);

fn timed_out(bound: Duration) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("held by another process for {bound:?}"),
    )
}
