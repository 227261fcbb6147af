//! Controller plugin leadership: several replicas, one serving the state dir.
//!
//! The state dir has one owner at a time (`locks::OwnerLock`), and a controller whose node
//! is cut off still holds it: without more, nothing fails over until that node comes
//! back. With `--leader-election` a controller plugin serves the state dir only while it
//! holds a coordination.k8s.io Lease (`cluster::leader`, the client-go algorithm):
//!
//! - a standby serves the Identity service and ControllerGetCapabilities (its sidecars
//!   need them to start and to stay live), and forwards every other controller call to
//!   the leader, which serves its standbys on a socket in the state dir
//!   ([`crate::locks::leader_socket`]; see
//!   `standby`: each sidecar elects on its own, so the one that leads may sit beside a
//!   standby); it opens the state dir only once it leads;
//! - a leader that has not renewed its Lease for `--leader-election-renew-deadline` exits
//!   (`LOST_LEADERSHIP_EXIT`) once it has thawed what its running copies froze (at most
//!   2 s; no freeze starts after): the kernel then drops the ownership lock with the
//!   process, whatever calls were running (every operation is crash-safe). It needs no
//!   API server to do so, which it may not reach. The renew deadline is shorter than the
//!   lease duration, so it is gone before a standby may take an expired Lease over;
//! - a new leader that still finds the state dir owned (a former leader frozen on a paused
//!   node cannot exit) fires the owner's kill switch: the kernel queues SIGKILL to it
//!   wherever it runs on this kernel, and it dies before it runs again. The new leader
//!   takes the state dir once that owner exited or, frozen, after `locks::TAKEOVER_WAIT`
//!   (see `locks::owner_lock`). Only the driver's own process arms a switch; an owner
//!   without one (served in-process) is waited for while this replica leads. Before each
//!   try it asks the Lease again, so that one which still believes it leads after a
//!   standby took the Lease (below) does not kill the new holder;
//! - a standby does not wait for the Lease to expire when the kernel shows that its
//!   holder let go of the state dir: the newest ownership generation names the holder (its
//!   Lease identity) and its lock is free (`locks::vacated_by`). The kernel drops that lock
//!   only with the owner's last thread or its graceful stop, so a holder that exited, was
//!   killed or lost power is taken over from at once, and one cut off from the API server
//!   as soon as it has given up. Seen twice, a retry period apart, the Lease unchanged
//!   (`cluster::leader`), so that a holder restarted under the same name, which renews
//!   and locks a new generation at once, is not taken for gone. An API server that answers
//!   late delays this by its lateness (and a round it left unanswered by that round's
//!   timeout), not by a lease duration counted from when the standby saw the Lease last.
//!
//! So the controller fails over in about `--leader-election-lease-duration` (15 s by
//! default) after its node is cut off or frozen, about two retry periods after a leader
//! that exited or was killed, plus the standby's start-up pass; a frozen node adds at most
//! `TAKEOVER_WAIT` to that.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fencecsi_cluster::{Cluster, LeaderElectionConfig, LeaderElector, LeaderHandle};

use crate::config::Config;
use crate::controller::Controller;
use crate::locks::Claim;
use crate::socket::ServeError;

/// The exit code of a leader that lost its Lease.
pub const LOST_LEADERSHIP_EXIT: i32 = 3;

/// The controller plugin's Lease unless `--leader-election-lease-name` names another.
pub const LEASE_NAME: &str = "fencecsi-controller-plugin";

/// The election of this controller plugin (`--leader-election` and the flags beside it).
fn election_config(cfg: &Config) -> Result<LeaderElectionConfig, ServeError> {
    let identity = cfg.identity.resolve("fencecsi-driver");
    cfg.election
        .config(LEASE_NAME, &identity)
        .ok_or_else(|| ServeError::Config("leader election is off".into()))
}

/// What the plugin does when it stops leading; the default exits the process.
pub type OnLostLeadership = Box<dyn FnOnce() + Send>;

/// Stands by until this replica leads and has opened the state dir: serves the standby
/// services on the plugin's socket meanwhile, and stops them once the state dir is open
/// (the socket is served again right after, by the whole plugin). A former leader that
/// still holds the state dir is killed through its switch and taken over from (see the
/// module docs); one without a switch is waited for while this replica leads, with the
/// standby answers; if it stops leading meanwhile, it stands by again.
/// `cluster`: the API server (else `cfg.kube`'s); `kill_switch`: arm this process's (see
/// `ServeHooks::kill_switch`).
pub async fn lead(
    cfg: &Config,
    cluster: Option<Cluster>,
    kill_switch: bool,
) -> Result<(LeaderHandle, Arc<Controller>), ServeError> {
    let cluster = match cluster {
        Some(c) => c,
        None => cfg.kube.connect().await.map_err(|e| {
            ServeError::Config(format!("--leader-election needs an API server: {e}"))
        })?,
    };
    let election = election_config(cfg)?;
    let state_dir = cfg.state_dir.clone();
    let elector = LeaderElector::new(&cluster, election.clone())
        .map_err(|e| ServeError::Config(format!("leader election: {e}")))?
        .proving_vacancy(Arc::new(move |holder: &str| {
            crate::locks::vacated_by(&state_dir, holder).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "could not read the state dir's ownership: the Lease's holder is waited for");
                false
            })
        }));
    let mut handle = elector.spawn();
    let socket = cfg.socket_path().map_err(ServeError::Config)?;
    tracing::info!(lease = %election.lease_name, namespace = %election.namespace, identity = %election.identity, "standing by: the state dir is served once this replica leads");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = crate::standby::serve(cfg, &socket, stopped)?;
    let controller = loop {
        handle.wait_for_leadership().await;
        tracing::info!(identity = %election.identity, "leading: opening the state dir");
        if let Some(c) = open_while_leading(cfg, &handle, kill_switch).await? {
            break c;
        }
        tracing::warn!("stopped leading before the state dir could be opened: standing by again");
    };
    stop_standby(stop, server).await?;
    Ok((handle, controller))
}

/// How long the standby server may take to stop once this replica leads. Its forwarded
/// calls end at once (`standby::serve`); this bounds the rest of its graceful stop.
const STANDBY_DRAIN: Duration = Duration::from_secs(2);

/// Stops the standby server, finishing its calls within [`STANDBY_DRAIN`].
async fn stop_standby(
    stop: tokio::sync::oneshot::Sender<()>,
    mut server: tokio::task::JoinHandle<Result<(), ServeError>>,
) -> Result<(), ServeError> {
    let _ = stop.send(());
    match tokio::time::timeout(STANDBY_DRAIN, &mut server).await {
        Ok(done) => done.map_err(|e| ServeError::Config(format!("standby server: {e}")))?,
        Err(_) => {
            server.abort();
            tracing::warn!(bound = ?STANDBY_DRAIN, "calls the standby still forwarded to the former leader were cut off as this replica took over; their clients retry");
            Ok(())
        }
    }
}

/// Opens the state dir while this replica leads, waiting for a former leader's
/// ownership lock; None once it no longer leads.
async fn open_while_leading(
    cfg: &Config,
    handle: &LeaderHandle,
    kill_switch: bool,
) -> Result<Option<Arc<Controller>>, ServeError> {
    let start = Instant::now();
    let mut next_log = start;
    let claim = Claim {
        arm: kill_switch,
        take_over: true,
        identity: Some(handle.elector().identity().to_string()),
    };
    while handle.is_leader() {
        // The Lease asked again right before a former owner may be killed: a replica that
        // still believes it leads (within its renew deadline) after a standby took the Lease
        // on the kernel's word must not kill the new holder.
        match handle.elector().try_acquire_or_renew().await {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                tracing::warn!(error = %e, "could not confirm the Lease before taking the state dir; trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        }
        let c = cfg.clone();
        let claim = claim.clone();
        let opened = tokio::task::spawn_blocking(move || Controller::open_claiming(c, claim))
            .await
            .map_err(|e| ServeError::Config(format!("opening controller state: {e}")))?;
        match opened {
            Ok(c) => return Ok(Some(c)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                // Once, then every lease duration: a former leader without a kill
                // switch keeps the lock until it exits.
                if Instant::now() >= next_log {
                    tracing::warn!(error = %e, waited_s = start.elapsed().as_secs(), "leading, but a former leader still owns the state dir; waiting for it");
                    next_log += cfg.election.lease_duration;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(source) => {
                return Err(ServeError::Io {
                    what: "opening controller state".into(),
                    source,
                })
            }
        }
    }
    Ok(None)
}

/// The Lease of a leading plugin, watched while it serves (see [`watch_leadership`]).
pub struct Leading {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Leading {
    /// After a graceful stop (the state dir let go): releases the Lease, so a standby
    /// takes over at once rather than after the lease duration.
    pub async fn step_down(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// Watches the Lease while the plugin serves: when this replica stops leading (no
/// renewal for the renew deadline, judged on the local clock), `lost` runs: by default
/// the process exits (see the module docs). Looked at four times a retry period, at
/// most every 250 ms, so the exit follows the deadline by that much, plus the thaw of
/// its copies' freezes ([`THAW_AS_IT_GIVES_UP`]), at most.
pub fn watch_leadership(
    handle: LeaderHandle,
    retry_period: Duration,
    controller: Arc<Controller>,
    lost: Option<OnLostLeadership>,
) -> Leading {
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let every = (retry_period / 4).min(Duration::from_millis(250));
    let task = tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = &mut stopped => {
                    if let Err(e) = handle.shutdown().await {
                        tracing::warn!(error = %e, "could not release the leader Lease; a standby takes over once it expires, or once it sees the state dir let go");
                    }
                    return;
                }
                _ = tokio::time::sleep(every) => {}
            }
            if !handle.is_leader() {
                tracing::error!("leadership lost (the Lease was not renewed within the renew deadline): giving up the state dir");
                give_up_freezes(controller.clone()).await;
                match lost {
                    Some(f) => f(),
                    None => std::process::exit(LOST_LEADERSHIP_EXIT),
                }
                return;
            }
        }
    });
    Leading { stop, task }
}

/// How long a leader giving up waits for its copies' filesystems to thaw. Short:
/// the renew deadline has passed, and a standby may lead once the lease
/// duration has.
const THAW_AS_IT_GIVES_UP: Duration = Duration::from_secs(2);

/// Thaws what this process's copies froze before it gives up the state dir: the
/// process exits with its copies abandoned, and their volumes' writers would
/// otherwise stay frozen until a successor starts and thaws them.
async fn give_up_freezes(controller: Arc<Controller>) {
    let thaw = tokio::task::spawn_blocking(move || controller.give_up_freezes());
    match tokio::time::timeout(THAW_AS_IT_GIVES_UP, thaw).await {
        Ok(Ok(0)) => {}
        Ok(Ok(n)) => {
            tracing::warn!(
                filesystems = n,
                "thawed what this controller's copies froze before giving up"
            )
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "thawing this controller's freezes failed; the next controller thaws them at its start")
        }
        Err(_) => {
            tracing::error!(bound = ?THAW_AS_IT_GIVES_UP, "thawing this controller's freezes did not finish in time; giving up anyway (the next controller thaws them at its start)")
        }
    }
}
