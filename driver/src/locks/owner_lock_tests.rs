//! The ownership lock and its takeover, on real processes: a holder in another process
//! (this test binary run again as `holder`), frozen in a cgroup v1 freezer.

use super::*;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

use fencecsi_fence::kernel::test_freezer::{shared_pending, Freezer, SIGKILL_PENDING};

const HOLDER_DIR: &str = "FENCECSI_TEST_HOLDER_DIR";
const HOLDER_ARM: &str = "FENCECSI_TEST_HOLDER_ARM";
const FREEZER: &str = "/sys/fs/cgroup/freezer";

/// The Lease identity every holder process leads under.
const HOLDER_IDENTITY: &str = "controller-holder";

fn refuse() -> Claim {
    Claim::default()
}

fn take_over() -> Claim {
    Claim {
        arm: false,
        take_over: true,
        identity: None,
    }
}

#[test]
fn a_second_owner_is_refused_and_the_first_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let first = OwnerLock::acquire(dir.path(), refuse()).unwrap();
    assert_eq!(first.generation, 1);
    let err = OwnerLock::acquire(dir.path(), refuse())
        .err()
        .expect("refused");
    assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
    let named = format!(
        "owned by another running controller plugin (pid {})",
        std::process::id()
    );
    assert!(err.to_string().contains(&named), "{err}");
    assert_eq!(
        owner_of(dir.path()).unwrap().unwrap().pid,
        std::process::id()
    );
    drop(first);
    assert_eq!(owner_of(dir.path()).unwrap(), None, "free once dropped");
    let second = OwnerLock::acquire(dir.path(), refuse()).unwrap();
    assert_eq!(second.generation, 2, "every owner makes a new generation");
    assert!(
        !generation_path(&dir.path().join(OWNER_DIR), 1).exists(),
        "superseded removed"
    );
}

/// An owner without a switch cannot be proven gone: a takeover is refused, and the
/// owner keeps its generation.
#[test]
fn an_owner_without_a_switch_is_not_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let first = OwnerLock::acquire(dir.path(), refuse()).unwrap();
    let err = OwnerLock::acquire(dir.path(), take_over())
        .err()
        .expect("refused");
    assert!(err.to_string().contains("armed no kill switch"), "{err}");
    assert_eq!(owner_of(dir.path()).unwrap().unwrap().switch, "");
    drop(first);
}

/// An older driver's `controller.lock`, held, keeps a newer one out.
#[test]
fn a_held_legacy_lock_is_honoured() {
    let dir = tempfile::tempdir().unwrap();
    let legacy = File::create(dir.path().join(LEGACY_LOCK)).unwrap();
    legacy.lock().unwrap();
    let err = OwnerLock::acquire(dir.path(), take_over())
        .err()
        .expect("refused");
    assert!(err.to_string().contains("older fencecsi-driver"), "{err}");
    // Unlocked, not only closed: a holder process another test forks meanwhile keeps a
    // copy of every open file until it execs, and with it this lock.
    legacy.unlock().unwrap();
    drop(legacy);
    OwnerLock::acquire(dir.path(), refuse()).expect("free with the legacy lock let go");
}

/// Not a test on its own: the holder process the tests below start (this binary again).
/// It owns the state dir named by `HOLDER_DIR`, starts a tool in its process group, and
/// then acts: a line appended to `ticks` every 5 ms, for good.
#[test]
#[ignore = "run by the takeover tests as their holder process"]
fn holder() {
    let Some(dir) = std::env::var_os(HOLDER_DIR) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let claim = Claim {
        arm: std::env::var_os(HOLDER_ARM).is_some(),
        take_over: false,
        identity: Some(HOLDER_IDENTITY.into()),
    };
    let _owner = OwnerLock::acquire(&dir, claim).expect("the holder owns the state dir");
    // Never waited for: it must die with this process, through the switch or the test's killpg.
    #[allow(clippy::zombie_processes)]
    let tool = Command::new("sleep").arg("600").spawn().unwrap();
    std::fs::write(dir.join("tool.pid"), tool.id().to_string()).unwrap();
    let mut ticks = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("ticks"))
        .unwrap();
    loop {
        ticks.write_all(b"tick\n").unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A holder process and its process group, killed on drop.
struct HolderProcess {
    child: Child,
    dir: PathBuf,
}

impl HolderProcess {
    fn start(dir: &Path, arm: bool) -> HolderProcess {
        Self::start_with(Command::new(std::env::current_exe().unwrap()), dir, arm)
    }

    /// The holder as pid 1 of a pid namespace of its own (as a container's only process).
    fn start_as_namespace_init(dir: &Path) -> HolderProcess {
        let mut cmd = Command::new("unshare");
        cmd.args(["--pid", "--fork", "--kill-child"])
            .arg(std::env::current_exe().unwrap());
        Self::start_with(cmd, dir, true)
    }

    fn start_with(mut cmd: Command, dir: &Path, arm: bool) -> HolderProcess {
        cmd.args(["--exact", "locks::owner_lock::tests::holder", "--ignored"])
            .env(HOLDER_DIR, dir)
            .stdout(Stdio::null())
            // Its own group, as the driver in its container: the switch then kills the group.
            .process_group(0);
        if arm {
            cmd.env(HOLDER_ARM, "1");
        }
        let mut h = HolderProcess {
            child: cmd.spawn().unwrap(),
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while h.ticks() < 3 {
            assert!(h.child.try_wait().unwrap().is_none(), "the holder exited");
            assert!(Instant::now() < deadline, "the holder never acted");
            std::thread::sleep(Duration::from_millis(10));
        }
        h
    }

    fn ticks(&self) -> usize {
        std::fs::read_to_string(self.dir.join("ticks"))
            .map(|t| t.lines().count())
            .unwrap_or(0)
    }

    fn tool_pid(&self) -> i32 {
        std::fs::read_to_string(self.dir.join("tool.pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    /// The signal that ended it, waiting at most 30 s.
    fn ended_by(&mut self) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.signal();
            }
            assert!(Instant::now() < deadline, "the holder never ended");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for HolderProcess {
    fn drop(&mut self) {
        // A frozen process would never be reaped: thaw its test freezer first.
        thaw_test_freezer_of(self.child.id());
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }
}

/// Thaws the freezer cgroup of this test's that `pid` is in, if any.
fn thaw_test_freezer_of(pid: u32) {
    let Ok(groups) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return;
    };
    let Some(path) = groups
        .lines()
        .find_map(|l| l.split_once(":freezer:").map(|(_, p)| p.to_string()))
    else {
        return;
    };
    if path.contains("fencecsi-test-") {
        let state = Path::new(FREEZER)
            .join(path.trim_start_matches('/'))
            .join("freezer.state");
        let _ = std::fs::write(state, "THAWED");
    }
}

/// Whether a process is gone (or a zombie, whose parent has not reaped it yet).
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// The case the switch exists for: the owner is frozen (a paused node) and can neither act
/// nor let go. A successor refuses without a takeover (the control), and with one fires the
/// owner's switch: the kernel records SIGKILL pending on the frozen process, the successor
/// owns the state dir after `TAKEOVER_WAIT`, and once thawed the former owner dies without
/// acting again, its tool with it. The second holder is the positive control for "dies
/// without acting": without a switch it is refused a takeover and acts again once thawed.
#[test]
fn a_frozen_owner_is_killed_through_its_switch_and_taken_over() {
    fencecsi_fence::require_root!();
    if !Freezer::available() {
        return;
    }
    let freezer = Freezer::new("takeover");
    let dir = tempfile::tempdir().unwrap();
    let mut holder = HolderProcess::start(dir.path(), true);
    let tool = holder.tool_pid();
    freezer.add(holder.child.id());
    freezer.add(tool as u32);
    freezer.freeze();
    let frozen_at = holder.ticks();

    let refused = OwnerLock::acquire(dir.path(), refuse())
        .err()
        .expect("refused");
    assert_eq!(refused.kind(), io::ErrorKind::WouldBlock, "{refused}");
    assert_eq!(
        shared_pending(holder.child.id()) & SIGKILL_PENDING,
        0,
        "no kill before a takeover"
    );

    let owner = OwnerLock::acquire(dir.path(), take_over()).expect("taken over");
    assert_eq!(owner.predecessor, Predecessor::KilledButHolding);
    assert_eq!(owner.generation, 2);
    assert_ne!(
        shared_pending(holder.child.id()) & SIGKILL_PENDING,
        0,
        "the kernel holds SIGKILL pending for the frozen owner"
    );
    assert_eq!(
        owner_of(dir.path()).unwrap().unwrap().pid,
        std::process::id()
    );

    freezer.thaw();
    assert_eq!(holder.ended_by(), Some(libc::SIGKILL), "killed, not exited");
    assert_eq!(
        holder.ticks(),
        frozen_at,
        "the former owner acted after it thawed"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gone(tool) {
        assert!(Instant::now() < deadline, "the owner's tool outlived it");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(owner);

    // Positive control: the same, with an owner that armed no switch.
    let control_dir = tempfile::tempdir().unwrap();
    let control = HolderProcess::start(control_dir.path(), false);
    freezer.add(control.child.id());
    freezer.add(control.tool_pid() as u32);
    freezer.freeze();
    let frozen_at = control.ticks();
    let err = OwnerLock::acquire(control_dir.path(), take_over())
        .err()
        .expect("no takeover without a switch");
    assert!(err.to_string().contains("armed no kill switch"), "{err}");
    freezer.thaw();
    let deadline = Instant::now() + Duration::from_secs(30);
    while control.ticks() <= frozen_at {
        assert!(
            Instant::now() < deadline,
            "the unkilled owner never acted again"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// An owner that is pid 1 of its pid namespace (a container's only process) would ignore
/// the switch's SIGKILL, so it arms none: a takeover is refused, rather than made beside
/// an owner that would run again after a thaw.
#[test]
fn an_owner_that_is_its_namespaces_init_arms_no_switch() {
    fencecsi_fence::require_root!();
    let dir = tempfile::tempdir().unwrap();
    let holder = HolderProcess::start_as_namespace_init(dir.path());
    let named = owner_of(dir.path()).unwrap().expect("held");
    assert_eq!(named.pid, 1, "the holder is its namespace's init");
    assert_eq!(named.switch, "", "and armed no switch");
    let err = OwnerLock::acquire(dir.path(), take_over())
        .err()
        .expect("no takeover");
    assert!(err.to_string().contains("armed no kill switch"), "{err}");
    let before = holder.ticks();
    let deadline = Instant::now() + Duration::from_secs(30);
    while holder.ticks() <= before {
        assert!(Instant::now() < deadline, "the holder stopped acting");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// An owner that runs (say, a leader that kept its lock past its Lease): the switch kills it
/// and the kernel drops its lock with it, so the successor takes a state dir nobody holds.
#[test]
fn a_running_owner_is_killed_and_its_lock_goes_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut holder = HolderProcess::start(dir.path(), true);
    let owner = OwnerLock::acquire(dir.path(), take_over()).expect("taken over");
    assert_eq!(owner.predecessor, Predecessor::Gone);
    assert_eq!(holder.ended_by(), Some(libc::SIGKILL));
    let switches: Vec<_> = std::fs::read_dir(dir.path().join(OWNER_DIR))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".switch"))
        .collect();
    assert!(
        switches.is_empty(),
        "the former owner's switch is removed: {switches:?}"
    );
}

/// What a standby asks before it takes the Lease early: has its holder let go of the state
/// dir? The kernel answers: no while the holder runs, and no while it is frozen (a frozen
/// holder keeps its lock: the hang a Lease's expiry and the kill switch are for); yes once
/// it is killed, its lock gone with it, or has let go. Never for another name, nor for an
/// owner that named none.
#[test]
fn the_lock_says_when_a_lease_holder_let_go() {
    fencecsi_fence::require_root!();
    let dir = tempfile::tempdir().unwrap();
    assert!(
        !vacated_by(dir.path(), HOLDER_IDENTITY).unwrap(),
        "no generation yet"
    );
    let mut holder = HolderProcess::start(dir.path(), true);
    assert_eq!(
        owner_of(dir.path()).unwrap().unwrap().identity,
        HOLDER_IDENTITY
    );
    assert!(!vacated_by(dir.path(), HOLDER_IDENTITY).unwrap(), "running");
    if Freezer::available() {
        let freezer = Freezer::new("vacated");
        freezer.add(holder.child.id());
        freezer.add(holder.tool_pid() as u32);
        freezer.freeze();
        assert!(!vacated_by(dir.path(), HOLDER_IDENTITY).unwrap(), "frozen");
        freezer.thaw();
    }
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(holder.child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
    assert_eq!(holder.ended_by(), Some(libc::SIGKILL));
    assert!(vacated_by(dir.path(), HOLDER_IDENTITY).unwrap(), "killed");
    assert!(
        !vacated_by(dir.path(), "another-controller").unwrap(),
        "another name"
    );
    assert!(!vacated_by(dir.path(), "").unwrap(), "no name");

    // In this process: let go gracefully; and an owner that named no identity.
    let named = Claim {
        identity: Some("in-process".into()),
        ..Claim::default()
    };
    let owner = OwnerLock::acquire(dir.path(), named).unwrap();
    assert!(!vacated_by(dir.path(), "in-process").unwrap(), "owned");
    assert!(
        !vacated_by(dir.path(), HOLDER_IDENTITY).unwrap(),
        "superseded"
    );
    drop(owner);
    assert!(vacated_by(dir.path(), "in-process").unwrap(), "let go");
    drop(OwnerLock::acquire(dir.path(), refuse()).unwrap());
    assert!(!vacated_by(dir.path(), "in-process").unwrap(), "names none");
}
