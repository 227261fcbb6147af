//! Leader election on a coordination.k8s.io/v1 Lease, written against the seam so the same
//! code path runs on the embedded cluster and on a real API server.
//!
//! `kube-lease-manager` is the maintained lease crate for kube 5, but it takes a
//! `kube::Client` and so cannot run on the embedded cluster; this is the client-go
//! algorithm (`tools/leaderelection`) re-done over [`crate::Api`]:
//!
//! - Mutual exclusion comes from optimistic concurrency: every acquire or renew is a
//!   replace carrying the resourceVersion just read, so of two racing candidates one gets
//!   a Conflict.
//! - Expiry is judged on the *local* clock: a candidate takes over a lease held by someone
//!   else only after it has seen the lease record unchanged for `leaseDurationSeconds`
//!   (client-go's observedTime), so clock skew between holders does not matter.
//! - A leader considers itself leader only until `renew_deadline` after it *sent* its last
//!   successful renew. Since `renew_deadline < lease_duration`, it has stopped acting as
//!   leader before any other candidate may take over.
//! - Release clears `holderIdentity`; a candidate takes a lease without holder at once.
//! - A candidate given a [`VacancyProof`] ([`LeaderElector::proving_vacancy`]) also takes
//!   over before expiry once something other than the API server shows the holder gone,
//!   on two rounds a retry period apart, the Lease unchanged in between (a holder that runs
//!   renews about every retry period). Its rounds still read the Lease, so an API server
//!   that answers late delays such a takeover by its lateness, and by up to one round's
//!   timeout for a round it left without an answer; it does not restart a lease duration.
//! - A follower ([`LeaderElectionConfig::follow`]) leads only while another Lease in the
//!   same namespace names its identity: the containers of one pod then lead together. It
//!   keeps observing its own Lease while it may not lead, so once it may, an expired Lease
//!   is taken at once; and it releases its Lease as soon as the followed one moves away.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use tokio::sync::{oneshot, watch};

use crate::api::Api;
use crate::error::{Error, Result};
use crate::Cluster;

/// Configuration of one elector. Defaults: the leader-election flags' (client-go's
/// 15 s / 10 s / 2 s, see [`crate::cli`]).
#[derive(Debug, Clone)]
pub struct LeaderElectionConfig {
    pub namespace: String,
    pub lease_name: String,
    /// Unique per candidate (e.g. pod name + random suffix).
    pub identity: String,
    /// How long others wait, after the lease last changed, before taking it over.
    pub lease_duration: Duration,
    /// How long a leader keeps leading without a successful renew. Must be < lease_duration.
    pub renew_deadline: Duration,
    /// Interval between attempts to acquire or renew.
    pub retry_period: Duration,
    /// How long the election may go without an answer from the API server before
    /// [`LeaderHandle::healthy`] turns false.
    pub unhealthy_after: Duration,
    /// Lead only while the Lease of this name (same namespace) is held by `identity`.
    pub follow: Option<String>,
}

impl LeaderElectionConfig {
    pub fn new(namespace: &str, lease_name: &str, identity: &str) -> Self {
        use crate::cli::{
            default_duration, LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD, UNHEALTHY_AFTER,
        };
        LeaderElectionConfig {
            namespace: namespace.to_string(),
            lease_name: lease_name.to_string(),
            identity: identity.to_string(),
            lease_duration: default_duration(LEASE_DURATION),
            renew_deadline: default_duration(RENEW_DEADLINE),
            retry_period: default_duration(RETRY_PERIOD),
            unhealthy_after: default_duration(UNHEALTHY_AFTER),
            follow: None,
        }
    }

    /// Lead only while the Lease `lease` is held by this identity.
    pub fn following(mut self, lease: Option<&str>) -> Self {
        self.follow = lease.map(str::to_string);
        self
    }

    pub fn with_timing(
        mut self,
        lease_duration: Duration,
        renew_deadline: Duration,
        retry_period: Duration,
    ) -> Self {
        self.lease_duration = lease_duration;
        self.renew_deadline = renew_deadline;
        self.retry_period = retry_period;
        self
    }

    pub fn unhealthy_after(mut self, limit: Duration) -> Self {
        self.unhealthy_after = limit;
        self
    }

    fn lease_duration_secs(&self) -> i32 {
        // leaseDurationSeconds is whole seconds; round up so we never promise less.
        let ms = self.lease_duration.as_millis().max(1);
        ms.div_ceil(1000).min(i32::MAX as u128) as i32
    }
}

/// Proof, from outside the API server, that the Lease holder it is given can no longer act,
/// for example because the kernel dropped a lock that holder kept for as long as it could
/// act. It must answer false whenever it cannot tell. Called off the async runtime, one
/// call at a time, and not waited for longer than the retry period.
pub type VacancyProof = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// A [`VacancyProof`] and whether a call of it is still running.
struct Vacancy {
    proof: VacancyProof,
    running: Arc<AtomicBool>,
    /// Whether a call still running when the next was due has been logged.
    stuck_logged: AtomicBool,
}

/// Marks the call of a proof returned, also when it panicked.
struct CallDone(Arc<AtomicBool>);

impl Drop for CallDone {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl std::fmt::Debug for Vacancy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vacancy")
            .field("running", &self.running.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct State {
    /// resourceVersion of the lease record last seen, and when (local clock) it was first seen.
    observed_rv: Option<String>,
    observed_at: Instant,
    /// When the last successful acquire/renew request was sent; `None` when not leading.
    renewed_at: Option<Instant>,
    /// When a round last reached the API server and got an answer it could act on
    /// (leading or not); a candidate that is refused (Forbidden, wrong namespace) or
    /// cannot connect stops advancing it.
    answered_at: Instant,
    /// The holder and resourceVersion of the Lease when that holder was first proven gone,
    /// and when; cleared by any round in which it was not.
    vacated: Option<(String, String, Instant)>,
}

/// One candidate. Use [`LeaderElector::spawn`] for the background loop, or drive it with
/// [`LeaderElector::try_acquire_or_renew`] yourself.
#[derive(Debug)]
pub struct LeaderElector {
    api: Api<Lease>,
    cfg: LeaderElectionConfig,
    state: Mutex<State>,
    vacancy: Option<Vacancy>,
}

fn micro_now() -> MicroTime {
    let now = Timestamp::now();
    MicroTime(Timestamp::from_microsecond(now.as_microsecond()).unwrap_or(now))
}

impl LeaderElector {
    pub fn new(cluster: &Cluster, cfg: LeaderElectionConfig) -> Result<Self> {
        if cfg.renew_deadline >= cfg.lease_duration {
            return Err(Error::Invalid(
                "renew_deadline must be shorter than lease_duration".into(),
            ));
        }
        if cfg.retry_period >= cfg.renew_deadline {
            return Err(Error::Invalid(
                "retry_period must be shorter than renew_deadline".into(),
            ));
        }
        if cfg.identity.is_empty() {
            return Err(Error::Invalid("identity must not be empty".into()));
        }
        // A healthy candidate gets an answer every retry period; a limit that
        // short would report it unhealthy between two rounds.
        if cfg.unhealthy_after <= cfg.retry_period * 2 {
            return Err(Error::Invalid(format!(
                "the election's unhealthy-after ({:?}) must be longer than two retry periods ({:?})",
                cfg.unhealthy_after,
                cfg.retry_period * 2
            )));
        }
        Ok(LeaderElector {
            api: cluster.api::<Lease>(Some(&cfg.namespace)),
            cfg,
            state: Mutex::new(State {
                observed_rv: None,
                observed_at: Instant::now(),
                renewed_at: None,
                answered_at: Instant::now(),
                vacated: None,
            }),
            vacancy: None,
        })
    }

    /// Takes the Lease over before it expires once `proof` shows its holder gone, twice, a
    /// retry period apart, the Lease unchanged in between (see the module docs).
    pub fn proving_vacancy(mut self, proof: VacancyProof) -> Self {
        self.vacancy = Some(Vacancy {
            proof,
            running: Arc::new(AtomicBool::new(false)),
            stuck_logged: AtomicBool::new(false),
        });
        self
    }

    pub fn identity(&self) -> &str {
        &self.cfg.identity
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// True while this candidate holds the lease and its last successful renew was sent
    /// less than `renew_deadline` ago. Time-based, so it turns false on its own when
    /// renewals stop succeeding, even if nothing calls into the elector.
    pub fn is_leader(&self) -> bool {
        self.state()
            .renewed_at
            .is_some_and(|t| t.elapsed() < self.cfg.renew_deadline)
    }

    /// How long rounds have been failing (zero right after an answered one).
    pub fn failing_for(&self) -> Duration {
        self.state().answered_at.elapsed()
    }

    /// One round: acquire the lease if it is free or expired, renew it if we hold it.
    /// Returns whether we lead after this round.
    pub async fn try_acquire_or_renew(&self) -> Result<bool> {
        let sent = Instant::now();
        let now = micro_now();
        let me = self.cfg.identity.clone();
        let Some(mut lease) = self.api.get_opt(&self.cfg.lease_name).await? else {
            if !self.followed_lease_is_mine().await? {
                return Ok(false);
            }
            return self.create_lease(me, now, sent).await;
        };

        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let i_hold = holder.as_deref() == Some(me.as_str());
        let expired = {
            let mut st = self.state();
            if st.observed_rv != lease.metadata.resource_version {
                st.observed_rv = lease.metadata.resource_version.clone();
                st.observed_at = Instant::now();
            }
            if holder.is_some() && !i_hold {
                // Someone else holds it: we are certainly not leading.
                st.renewed_at = None;
                let lease_secs = spec
                    .lease_duration_seconds
                    .unwrap_or(self.cfg.lease_duration_secs())
                    .max(1);
                Some(st.observed_at.elapsed() >= Duration::from_secs(lease_secs as u64))
            } else {
                None
            }
        };
        if let (Some(expired), Some(old)) = (expired, holder.as_deref()) {
            let rv = lease.metadata.resource_version.as_deref();
            if expired {
                tracing::info!(lease = %self.cfg.lease_name, old = %old, new = %me, "lease expired; taking over");
            } else if self.vacancy_confirmed(old, rv).await {
                tracing::info!(lease = %self.cfg.lease_name, old = %old, new = %me, "the holder is proven gone (twice, a retry period apart, the Lease unchanged): taking over before the Lease expires");
            } else {
                return Ok(false);
            }
        }

        if !self.followed_lease_is_mine().await? {
            if i_hold {
                tracing::info!(lease = %self.cfg.lease_name, followed = ?self.cfg.follow, "the followed Lease moved to another holder: stepping down and releasing");
                self.release().await?;
            }
            return Ok(false);
        }
        let mut new_spec = spec.clone();
        new_spec.holder_identity = Some(me.clone());
        new_spec.lease_duration_seconds = Some(self.cfg.lease_duration_secs());
        new_spec.renew_time = Some(now.clone());
        if !i_hold {
            new_spec.acquire_time = Some(now);
            new_spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        lease.spec = Some(new_spec);
        match self.api.replace(&lease).await {
            Ok(updated) => {
                self.record_success(&updated, sent);
                Ok(true)
            }
            // Someone else wrote first; the next round sees who.
            Err(e) if e.is_conflict() => Ok(self.is_leader()),
            Err(e) => Err(e),
        }
    }

    /// Creates the Lease, held by `me`; whether this candidate got it (another may have
    /// created it first).
    async fn create_lease(&self, me: String, now: MicroTime, sent: Instant) -> Result<bool> {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.cfg.lease_name.clone()),
                namespace: Some(self.cfg.namespace.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(me),
                lease_duration_seconds: Some(self.cfg.lease_duration_secs()),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        match self.api.create(&lease).await {
            Ok(created) => {
                self.record_success(&created, sent);
                Ok(true)
            }
            Err(e) if e.is_already_exists() || e.is_conflict() => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Whether this candidate may lead as far as the followed Lease says (always, when it
    /// follows none). A followed Lease that does not exist names no one.
    async fn followed_lease_is_mine(&self) -> Result<bool> {
        let Some(followed) = &self.cfg.follow else {
            return Ok(true);
        };
        let holder = self
            .api
            .get_opt(followed)
            .await?
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity);
        Ok(holder.as_deref() == Some(self.cfg.identity.as_str()))
    }

    /// Whether the holder `old` of the Lease at resourceVersion `rv` is proven gone now and
    /// was already a retry period ago, at the same resourceVersion. A Lease without one
    /// cannot show that it did not change, and proves nothing.
    async fn vacancy_confirmed(&self, old: &str, rv: Option<&str>) -> bool {
        let (Some(vacancy), Some(rv)) = (&self.vacancy, rv) else {
            return false;
        };
        let gone = if vacancy.running.swap(true, Ordering::AcqRel) {
            if !vacancy.stuck_logged.swap(true, Ordering::Relaxed) {
                tracing::warn!(lease = %self.cfg.lease_name, holder = %old, "the check of whether the Lease's holder is gone has not returned: taking over only on expiry while it hangs");
            }
            false // the last call has not returned: it proves nothing yet
        } else {
            let (proof, running, old) = (
                vacancy.proof.clone(),
                vacancy.running.clone(),
                old.to_string(),
            );
            let call = tokio::task::spawn_blocking(move || {
                let _done = CallDone(running);
                proof(&old)
            });
            matches!(
                tokio::time::timeout(self.cfg.retry_period, call).await,
                Ok(Ok(true))
            )
        };
        let mut st = self.state();
        match &st.vacated {
            _ if !gone => {
                st.vacated = None;
                false
            }
            Some((holder, seen, since)) if holder == old && seen == rv => {
                since.elapsed() >= self.cfg.retry_period
            }
            _ => {
                st.vacated = Some((old.to_string(), rv.to_string(), Instant::now()));
                false
            }
        }
    }

    fn record_success(&self, lease: &Lease, sent: Instant) {
        let mut st = self.state();
        st.vacated = None;
        st.observed_rv = lease.metadata.resource_version.clone();
        st.observed_at = Instant::now();
        st.renewed_at = Some(sent);
    }

    /// Steps down, then clears `holderIdentity` if we still hold the lease, so another
    /// candidate can take over at once instead of waiting for expiry.
    pub async fn release(&self) -> Result<()> {
        self.state().renewed_at = None;
        for _ in 0..5 {
            let Some(mut lease) = self.api.get_opt(&self.cfg.lease_name).await? else {
                return Ok(());
            };
            let mut spec = lease.spec.clone().unwrap_or_default();
            if spec.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
                return Ok(());
            }
            spec.holder_identity = None;
            spec.renew_time = Some(micro_now());
            lease.spec = Some(spec);
            match self.api.replace(&lease).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Error::Conflict(format!(
            "could not release lease {}",
            self.cfg.lease_name
        )))
    }

    /// Runs the election loop in a tokio task. Dropping the handle aborts the loop
    /// *without* releasing (as a crash would: others take over after expiry, or once a
    /// [`VacancyProof`] shows it gone); call
    /// [`LeaderHandle::shutdown`] to release.
    pub fn spawn(self) -> LeaderHandle {
        let elector = Arc::new(self);
        let (tx, rx) = watch::channel(false);
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        let e = elector.clone();
        let task = tokio::spawn(async move {
            let attempt_timeout = e.cfg.renew_deadline;
            loop {
                match tokio::time::timeout(attempt_timeout, e.try_acquire_or_renew()).await {
                    Ok(Ok(_)) => e.state().answered_at = Instant::now(),
                    Ok(Err(err)) => {
                        tracing::warn!(lease = %e.cfg.lease_name, error = %err, "lease acquire/renew failed")
                    }
                    Err(_) => {
                        tracing::warn!(lease = %e.cfg.lease_name, "lease acquire/renew timed out")
                    }
                }
                let leading = e.is_leader();
                if tx.send_if_modified(|v| std::mem::replace(v, leading) != leading) {
                    if leading {
                        tracing::info!(lease = %e.cfg.lease_name, namespace = %e.cfg.namespace, identity = %e.cfg.identity, "became the leader");
                    } else {
                        tracing::warn!(lease = %e.cfg.lease_name, namespace = %e.cfg.namespace, identity = %e.cfg.identity, "no longer the leader");
                    }
                }
                tokio::select! {
                    _ = &mut stop_rx => break,
                    _ = tokio::time::sleep(e.cfg.retry_period) => {}
                }
            }
            tx.send_replace(false);
            let res = e.release().await;
            if let Err(err) = &res {
                tracing::warn!(lease = %e.cfg.lease_name, error = %err, "lease release failed");
            }
            res
        });
        LeaderHandle {
            elector,
            rx,
            stop: Some(stop_tx),
            task: Some(task),
        }
    }
}

/// The running election loop of one candidate.
pub struct LeaderHandle {
    elector: Arc<LeaderElector>,
    rx: watch::Receiver<bool>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<()>>>,
}

impl LeaderHandle {
    /// Exact, time-based answer (see [`LeaderElector::is_leader`]). Check it before every
    /// action that only the leader may take.
    pub fn is_leader(&self) -> bool {
        self.elector.is_leader()
    }

    /// Whether the election can do its job: its rounds got an answer from the API
    /// server within the config's `unhealthy_after`. A candidate forbidden from its Lease (RBAC, wrong
    /// namespace) or cut off from the API server turns unhealthy, so that a
    /// liveness probe restarts it instead of it waiting forever.
    pub fn healthy(&self) -> bool {
        self.elector.failing_for() < self.elector.cfg.unhealthy_after
    }

    pub fn elector(&self) -> &LeaderElector {
        &self.elector
    }

    /// A receiver that changes when leadership is gained or lost (updated once per
    /// retry period, so it may trail [`LeaderHandle::is_leader`] by that much).
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.rx.clone()
    }

    /// Waits until this candidate leads.
    pub async fn wait_for_leadership(&mut self) {
        let _ = self.rx.wait_for(|v| *v).await;
    }

    /// Stops the loop and releases the lease (stepping down first).
    pub async fn shutdown(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task
                .await
                .map_err(|e| Error::Other(format!("election task: {e}")))?,
            None => Ok(()),
        }
    }

    /// Stops the loop without releasing, as a crashed process would. `is_leader` keeps
    /// answering from the last successful renew, so it turns false at the renew deadline.
    pub fn abort(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for LeaderHandle {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
