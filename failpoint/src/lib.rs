//! Failpoints: places where a test crashes, stalls, pauses or fails the
//! plugin on purpose. They exist only with the `failpoints` cargo feature,
//! which is off by default and which only the test crates turn on: an
//! environment variable must not be able to abort a production daemon or fake
//! a failed fence probe. Without the feature (as the production binaries are
//! built) [`hit`], [`stall`] and [`pause`] are empty and [`is_armed`] is false,
//! so the call sites stay as they are and cost nothing, nothing reads
//! `FENCECSI_FAILPOINTS`, and the test-only API (`ENV`, `arm_pause`, `Paused`,
//! `STALLED_THREAD`) does not exist. tests/tests/failpoints.rs checks the
//! built binary.
//!
//! With the feature:
//!
//! Crash points: `hit(name)` aborts the process on the spot when `name` is
//! listed in the `FENCECSI_FAILPOINTS` environment variable (comma-separated,
//! read once). Crash tests use it to kill the plugin between two steps of an
//! RPC deterministically, then check that a restarted plugin finishes the
//! retried call without doubling anything. `is_armed(name)` reads the same
//! list, for failures a test simulates without a crash.
//!
//! Stall points (`stall(name)`), armed the same way, hold the calling thread
//! for good and name it `STALLED_THREAD`, so that a test that runs the real
//! binary finds the thread in `/proc/<pid>/task/*/comm` and SIGKILLs the
//! process at that step (a crash where something is held that an abort at a
//! `hit` would not show, such as a filesystem frozen during a copy).
//!
//! Pause points (`pause(name, key)`) hold a call at one step while a test in
//! the same process interleaves another (race tests); only `arm_pause` from
//! that process arms one.

#[cfg(feature = "failpoints")]
pub use armed::{hit, is_armed, stall, ENV, STALLED_THREAD};
#[cfg(feature = "failpoints")]
pub use pausing::{arm as arm_pause, pause, Paused};

#[cfg(not(feature = "failpoints"))]
pub use disarmed::{hit, is_armed, pause, stall};

/// Built without the `failpoints` feature: every point does nothing.
#[cfg(not(feature = "failpoints"))]
mod disarmed {
    #[inline(always)]
    pub fn hit(_name: &str) {}

    #[inline(always)]
    pub fn stall(_name: &str) {}

    #[inline(always)]
    pub fn is_armed(_name: &str) -> bool {
        false
    }

    #[inline(always)]
    pub fn pause(_name: &str, _key: &str) {}
}

/// Crash and stall points, and `is_armed`: armed by `FENCECSI_FAILPOINTS`.
#[cfg(feature = "failpoints")]
mod armed {
    use std::sync::OnceLock;

    pub const ENV: &str = "FENCECSI_FAILPOINTS";

    static ARMED: OnceLock<Vec<String>> = OnceLock::new();

    fn armed() -> &'static [String] {
        ARMED.get_or_init(|| {
            std::env::var(ENV)
                .map(|v| {
                    v.split(',')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default()
        })
    }

    /// Aborts the process (no destructors, no socket clean-up: a crash) when
    /// the failpoint `name` is armed.
    pub fn hit(name: &str) {
        if is_armed(name) {
            eprintln!("fencecsi-driver: failpoint {name} hit: aborting");
            std::process::abort();
        }
    }

    /// The name (`comm`) a thread held at a stall point takes.
    pub const STALLED_THREAD: &str = "fp-stalled";

    /// Holds the calling thread for good (see the module docs) when the stall
    /// point `name` is armed; returns at once otherwise.
    pub fn stall(name: &str) {
        if !is_armed(name) {
            return;
        }
        let comm = std::ffi::CString::new(STALLED_THREAD).expect("no NUL in the name");
        // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
        unsafe { libc::prctl(libc::PR_SET_NAME, comm.as_ptr(), 0, 0, 0) };
        eprintln!("fencecsi-driver: stall point {name} reached: this thread waits to be killed");
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }

    /// Whether the failpoint `name` is armed, for failures a test simulates
    /// without a crash (e.g. `fence-probe:fail`: the start-up fence probe fails).
    pub fn is_armed(name: &str) -> bool {
        armed().iter().any(|p| p == name)
    }
}

/// Pause points for race tests: `pause(name, key)` blocks the calling thread
/// while a test holds a [`Paused`] armed for the same name and key (in this
/// process: the test serves the plugin in-process). The key (say, a staging
/// path) keeps a test from pausing another test's call. Nothing armed,
/// `pause` is one relaxed load.
#[cfg(feature = "failpoints")]
mod pausing {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::{Duration, Instant};

    static ARMED: AtomicUsize = AtomicUsize::new(0);
    static POINTS: Mutex<Vec<Arc<Point>>> = Mutex::new(Vec::new());

    struct Point {
        name: String,
        key: String,
        /// (reached, released)
        state: Mutex<(bool, bool)>,
        cv: Condvar,
    }

    fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        m.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn pause(name: &str, key: &str) {
        if ARMED.load(Ordering::Relaxed) == 0 {
            return;
        }
        let point = lock(&POINTS)
            .iter()
            .find(|p| p.name == name && p.key == key)
            .cloned();
        let Some(p) = point else { return };
        let mut s = lock(&p.state);
        if s.0 {
            return; // pauses the first caller only
        }
        s.0 = true;
        p.cv.notify_all();
        eprintln!("fencecsi-driver: pause point {name} reached ({key})");
        while !s.1 {
            s = p.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// An armed pause point; released (and disarmed) when dropped, so a
    /// failing test never leaves a call blocked.
    pub struct Paused(Arc<Point>);

    pub fn arm(name: &str, key: &str) -> Paused {
        let p = Arc::new(Point {
            name: name.into(),
            key: key.into(),
            state: Mutex::new((false, false)),
            cv: Condvar::new(),
        });
        lock(&POINTS).push(p.clone());
        ARMED.fetch_add(1, Ordering::Relaxed);
        Paused(p)
    }

    impl Paused {
        /// Blocks until a call has reached the point (true) or `timeout` passed.
        pub fn wait_reached(&self, timeout: Duration) -> bool {
            let deadline = Instant::now() + timeout;
            let mut s = lock(&self.0.state);
            while !s.0 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return false;
                }
                s = self
                    .0
                    .cv
                    .wait_timeout(s, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            true
        }

        /// Lets the paused call (or a later one) go on.
        pub fn release(&self) {
            lock(&self.0.state).1 = true;
            self.0.cv.notify_all();
        }
    }

    impl Drop for Paused {
        fn drop(&mut self) {
            self.release();
            lock(&POINTS).retain(|p| !Arc::ptr_eq(p, &self.0));
            ARMED.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
