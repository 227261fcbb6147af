//! The run loop: find the plugin, (optionally) win the lease, then run a session — the
//! watch, the resync, the workers — until shutdown or lost leadership.

use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use fencecsi_cluster::http::HttpServer;
use fencecsi_cluster::k8s_openapi::api::storage::v1::VolumeAttachment;
use fencecsi_cluster::kube::runtime::reflector::store::Writer;
use fencecsi_cluster::kube::runtime::reflector::{self, ObjectRef};
use fencecsi_cluster::{
    well_known, Cluster, EventRecorder, LeaderElector, LeaderHandle, WatchEvent, WatchParams,
};
use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::{lease_name_for, Config, FencePolicy};
use crate::csi::{Capabilities, Csi};
use crate::metrics::Metrics;
use crate::queue::WorkQueue;
use crate::reconcile::{should_enqueue, Ctx};
use crate::{http, Error, Phase, Status};

/// Events' reporting controller.
pub const REPORTING_CONTROLLER: &str = "fencecsi.io/attacher";

/// The longest pause between two attempts to reach the plugin at start.
const STARTUP_RETRY_MAX: Duration = Duration::from_secs(5);

struct Session {
    queue: Arc<WorkQueue>,
    workers: JoinSet<()>,
    background: JoinSet<()>,
}

impl Session {
    fn start(ctx: &Arc<Ctx>) -> Session {
        // What the cache holds is from an earlier session until this one lists.
        ctx.listed
            .store(false, std::sync::atomic::Ordering::Release);
        let queue = Arc::new(WorkQueue::new(
            ctx.cfg.backoff,
            Some(ctx.metrics.queue_depth_gauge()),
        ));
        let mut background = JoinSet::new();
        {
            let q = queue.clone();
            background.spawn(async move { q.run_delays().await });
        }
        background.spawn(watch_loop(ctx.clone(), queue.clone()));
        {
            let csi = ctx.csi.clone();
            background.spawn(crate::plugin_wait::retry_when_plugin_answers(
                queue.clone(),
                ctx.metrics.clone(),
                crate::plugin_wait::PROBE_INTERVAL,
                move || {
                    let csi = csi.clone();
                    async move { csi.ready().await }
                },
            ));
        }
        background.spawn(resync_loop(ctx.clone(), queue.clone()));
        let mut workers = JoinSet::new();
        for _ in 0..ctx.cfg.workers.max(1) {
            workers.spawn(worker(ctx.clone(), queue.clone()));
        }
        Session {
            queue,
            workers,
            background,
        }
    }

    /// Stops taking work and lets in-flight passes finish (bounded by `grace`).
    async fn stop(mut self, grace: Duration) {
        self.queue.shut_down();
        self.background.shutdown().await;
        let drain = async { while self.workers.join_next().await.is_some() {} };
        if tokio::time::timeout(grace, drain).await.is_err() {
            tracing::warn!(
                ?grace,
                "in-flight operations did not finish in time; abandoning them"
            );
            self.workers.shutdown().await;
        }
    }

    /// Stops at once, dropping in-flight passes (their objects are retried by whoever
    /// acts next: every step is idempotent).
    async fn abort(mut self) {
        self.queue.shut_down();
        self.background.shutdown().await;
        self.workers.shutdown().await;
    }
}

async fn worker(ctx: Arc<Ctx>, queue: Arc<WorkQueue>) {
    while let Some(key) = queue.get().await {
        match ctx.reconcile(&key).await {
            Ok(()) => queue.forget(&key),
            Err(e) => {
                // Also retried as soon as the plugin answers again (`plugin_wait`).
                let plugin_absent = e.plugin_absent();
                let delay = if plugin_absent {
                    queue.add_waiting_for_plugin(&key)
                } else {
                    queue.add_rate_limited(&key)
                };
                tracing::warn!(va = %key, error = %e, retry_in = ?delay, plugin_absent, "will retry");
            }
        }
        queue.done(&key);
    }
}

async fn watch_loop(ctx: Arc<Ctx>, queue: Arc<WorkQueue>) {
    // The seam's watch streams re-list internally and do not end; should one end anyway,
    // start a new one (it begins with a full list, so nothing is missed).
    let mut failures = 0;
    loop {
        match ctx.vas.watch(&WatchParams::default()) {
            Ok(stream) => {
                failures = 0;
                let mut cache = ctx.cache_writer.lock().await;
                consume_watch(&ctx, &queue, &mut cache, stream).await;
                tracing::warn!("the VolumeAttachment watch ended; watching again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => {
                failures += 1;
                let d = ctx.cfg.backoff.delay(failures).min(STARTUP_RETRY_MAX);
                tracing::warn!(error = %e, retry_in = ?d, "watching VolumeAttachments failed");
                tokio::time::sleep(d).await;
            }
        }
    }
}

async fn consume_watch(
    ctx: &Ctx,
    queue: &WorkQueue,
    cache: &mut Writer<VolumeAttachment>,
    mut stream: fencecsi_cluster::WatchStream<VolumeAttachment>,
) {
    use fencecsi_cluster::kube::runtime::watcher::Event;
    while let Some(ev) = stream.next().await {
        match ev {
            WatchEvent::Listed(items) => {
                // A (re-)list replaces the store at once, as the reflector expects.
                cache.apply_watcher_event(&Event::Init);
                let mut names = Vec::new();
                for va in items.into_iter().filter(|va| ctx.is_ours(va)) {
                    names.push(va.metadata.name.clone().unwrap_or_default());
                    cache.apply_watcher_event(&Event::InitApply(va));
                }
                cache.apply_watcher_event(&Event::InitDone);
                ctx.listed.store(true, std::sync::atomic::Ordering::Release);
                tracing::debug!(count = names.len(), "VolumeAttachments listed");
                for n in names {
                    queue.add(&n);
                }
            }
            WatchEvent::Added(va) | WatchEvent::Modified(va) => {
                if !ctx.is_ours(&va) {
                    continue;
                }
                let name = va.metadata.name.clone().unwrap_or_default();
                let old = ctx.cache.get(&ObjectRef::new(&name));
                let enqueue = should_enqueue(old.as_deref(), &va, &ctx.finalizer);
                cache.apply_watcher_event(&Event::Apply(va));
                if enqueue {
                    queue.add(&name);
                }
            }
            WatchEvent::Deleted(va) => {
                let name = va.metadata.name.clone().unwrap_or_default();
                cache.apply_watcher_event(&Event::Delete(va));
                queue.forget(&name);
            }
        }
    }
}

async fn resync_loop(ctx: Arc<Ctx>, queue: Arc<WorkQueue>) {
    let period = ctx.cfg.resync.max(Duration::from_millis(10));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let names: Vec<String> = ctx
            .cache
            .state()
            .iter()
            .filter_map(|va| va.metadata.name.clone())
            .collect();
        tracing::debug!(count = names.len(), "resync");
        for n in &names {
            queue.add(n);
        }
        ctx.sweep_pv_finalizers().await;
        for n in ctx.check_published().await {
            queue.add(&n);
        }
        match ctx.csi.capabilities().await {
            Ok(caps) => {
                let mut cur = ctx.caps.write().unwrap_or_else(|e| e.into_inner());
                if *cur != caps {
                    tracing::info!(old = ?*cur, new = ?caps, "plugin capabilities changed");
                    *cur = caps;
                }
            }
            Err(e) => tracing::debug!(error = %e, "refreshing plugin capabilities failed"),
        }
    }
}

/// Mirrors the election's health into the status (what /healthz reports) for as long
/// as the election runs.
fn watch_election_health(
    handle: std::sync::Weak<LeaderHandle>,
    status: watch::Sender<Status>,
    period: Duration,
) {
    tokio::spawn(async move {
        while let Some(h) = handle.upgrade() {
            let failing = !h.healthy();
            drop(h);
            status.send_if_modified(|s| {
                std::mem::replace(&mut s.election_failing, failing) != failing
            });
            if failing {
                tracing::error!("leader election gets no answer from the API server (forbidden, or unreachable): reporting unhealthy");
            }
            // Re-checked often enough to notice a short test limit too.
            tokio::time::sleep(period).await;
        }
    });
}

/// Leadership as seen by this instance.
struct Leadership {
    handle: Option<Arc<LeaderHandle>>,
    poll: Duration,
}

impl Leadership {
    /// Joins the election when one is configured (and reports its health), or leads alone.
    fn start(
        cluster: &Cluster,
        cfg: &Config,
        driver: &str,
        status: &watch::Sender<Status>,
    ) -> Result<Leadership, Error> {
        let Some(le) = cfg
            .leader_election
            .config(&lease_name_for(driver), &cfg.identity)
        else {
            return Ok(Leadership {
                handle: None,
                poll: Duration::from_millis(100),
            });
        };
        let elector = LeaderElector::new(cluster, le.clone())?;
        tracing::info!(namespace = %le.namespace, lease = %le.lease_name, identity = %cfg.identity, "leader election on");
        let check_period =
            (le.unhealthy_after / 4).clamp(Duration::from_millis(100), Duration::from_secs(2));
        let handle = Arc::new(elector.spawn());
        watch_election_health(Arc::downgrade(&handle), status.clone(), check_period);
        Ok(Leadership {
            handle: Some(handle),
            poll: (le.retry_period / 4)
                .clamp(Duration::from_millis(10), Duration::from_millis(100)),
        })
    }

    fn is_leader(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_leader())
    }

    async fn acquired(&self) {
        let Some(h) = &self.handle else { return };
        let mut rx = h.subscribe();
        loop {
            if h.is_leader() {
                return;
            }
            tokio::select! {
                r = rx.changed() => {
                    if r.is_err() {
                        tokio::time::sleep(self.poll).await;
                    }
                }
                _ = tokio::time::sleep(self.poll * 4) => {}
            }
        }
    }

    async fn lost(&self) {
        if self.handle.is_none() {
            return std::future::pending().await;
        }
        while self.is_leader() {
            tokio::time::sleep(self.poll).await;
        }
    }
}

pub(crate) async fn run(
    cluster: Cluster,
    cfg: Config,
    metrics: Arc<Metrics>,
    status: watch::Sender<Status>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), Error> {
    validate(&cfg)?;
    tokio::pin!(shutdown);
    status.send_modify(|s| {
        s.phase = Phase::Starting;
        s.identity = cfg.identity.clone();
    });
    let http = start_http(&cfg, &metrics, &status).await?;
    let csi = Csi::new(&cfg.csi_socket, cfg.timeout);
    let (driver, caps) = tokio::select! {
        _ = &mut shutdown => return finish(status, http).await,
        found = find_plugin(&csi, &cfg) => found,
    };
    report_plugin(&cfg, &driver, caps, &status);
    let leadership = Arc::new(Leadership::start(&cluster, &cfg, &driver, &status)?);
    let ctx = context(&cluster, &cfg, &metrics, &leadership, driver, csi, caps);
    serve_while_leading(&ctx, &leadership, &metrics, &status, &mut shutdown).await;
    status.send_modify(|s| s.phase = Phase::Stopping);
    metrics.set_active(false);
    drop(ctx);
    release_lease(leadership).await;
    finish(status, http).await
}

/// The HTTP endpoint (metrics, health), when one is asked for.
async fn start_http(
    cfg: &Config,
    metrics: &Arc<Metrics>,
    status: &watch::Sender<Status>,
) -> Result<Option<HttpServer>, Error> {
    let Some(endpoint) = &cfg.http_endpoint else {
        return Ok(None);
    };
    let report = Arc::new(http::Report {
        metrics: metrics.clone(),
        status: status.subscribe(),
    });
    let server = fencecsi_cluster::http::start(endpoint, report)
        .await
        .map_err(|source| Error::Http {
            endpoint: *endpoint,
            source,
        })?;
    status.send_modify(|s| s.http_addr = Some(server.local_addr()));
    Ok(Some(server))
}

/// Waits until the plugin answers with its name and capabilities, retrying with a
/// bounded backoff.
async fn find_plugin(csi: &Csi, cfg: &Config) -> (String, Capabilities) {
    let mut failures = 0;
    loop {
        let attempt = async {
            let name = csi.plugin_name().await?;
            let caps = csi.capabilities().await?;
            Ok::<(String, Capabilities), tonic::Status>((name, caps))
        };
        match attempt.await {
            Ok(found) => return found,
            Err(e) => {
                failures += 1;
                let d = cfg.backoff.delay(failures).min(STARTUP_RETRY_MAX);
                tracing::warn!(socket = %cfg.csi_socket.display(), code = ?e.code(), error = %e.message(), retry_in = ?d, "waiting for the CSI plugin");
                tokio::time::sleep(d).await;
            }
        }
    }
}

/// Logs what the plugin offers (and what that means for the fence) and records it.
fn report_plugin(cfg: &Config, driver: &str, caps: Capabilities, status: &watch::Sender<Status>) {
    tracing::info!(driver = %driver, publish_unpublish = caps.publish_unpublish, unpublish_fence = caps.unpublish_fence, fence = %cfg.fence, "CSI plugin found");
    if cfg.fence == FencePolicy::Always && !caps.unpublish_fence {
        tracing::warn!("--fence=always, but the plugin does not advertise UNPUBLISH_FENCE: detaches will not be fenced");
    }
    if !caps.publish_unpublish {
        tracing::warn!("the plugin has no PUBLISH_UNPUBLISH_VOLUME: VolumeAttachments are marked attached and detached without CSI calls");
    }
    status.send_modify(|s| {
        s.driver = Some(driver.to_string());
        s.capabilities = Some(caps);
    });
}

fn context(
    cluster: &Cluster,
    cfg: &Config,
    metrics: &Arc<Metrics>,
    leadership: &Arc<Leadership>,
    driver: String,
    csi: Csi,
    caps: Capabilities,
) -> Arc<Ctx> {
    let may_act: Arc<dyn Fn() -> bool + Send + Sync> = {
        let l = leadership.clone();
        Arc::new(move || l.is_leader())
    };
    let (cache, cache_writer) = reflector::store();
    Arc::new(Ctx {
        finalizer: well_known::attacher_finalizer(&driver),
        driver,
        csi,
        caps: RwLock::new(caps),
        metrics: metrics.clone(),
        events: Arc::new(EventRecorder::new(
            cluster,
            REPORTING_CONTROLLER,
            &cfg.identity,
        )),
        vas: cluster.api(None),
        pvs: cluster.api(None),
        nodes: cluster.api(None),
        csinodes: cluster.api(None),
        cache,
        cache_writer: tokio::sync::Mutex::new(cache_writer),
        listed: Default::default(),
        may_act,
        cfg: cfg.clone(),
    })
}

/// Works while leading (always, without an election), stands by otherwise, until
/// `shutdown`: then finishes in-flight operations within the grace.
async fn serve_while_leading(
    ctx: &Arc<Ctx>,
    leadership: &Leadership,
    metrics: &Metrics,
    status: &watch::Sender<Status>,
    shutdown: &mut std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
) {
    let cfg = &ctx.cfg;
    loop {
        if leadership.handle.is_some() {
            status.send_modify(|s| s.phase = Phase::Standby);
            tokio::select! {
                _ = &mut *shutdown => return,
                _ = leadership.acquired() => {}
            }
            tracing::info!(identity = %cfg.identity, "leading: starting work");
        }
        status.send_modify(|s| s.phase = Phase::Active);
        metrics.set_active(true);
        let session = Session::start(ctx);
        let stop = tokio::select! {
            _ = &mut *shutdown => true,
            _ = leadership.lost() => false,
        };
        if stop {
            status.send_modify(|s| s.phase = Phase::Stopping);
            tracing::info!(grace = ?cfg.shutdown_grace, "shutting down: finishing in-flight operations");
            session.stop(cfg.shutdown_grace).await;
            metrics.set_active(false);
            return;
        }
        tracing::warn!("lost leadership: stopping work at once");
        session.abort().await;
        metrics.set_active(false);
    }
}

/// Gives the Lease up at exit, so a standby takes over at once instead of after its
/// duration.
async fn release_lease(leadership: Arc<Leadership>) {
    let leadership = Arc::try_unwrap(leadership).ok();
    if let Some(handle) = leadership.and_then(|l| l.handle) {
        match Arc::try_unwrap(handle) {
            Ok(h) => match h.shutdown().await {
                Ok(()) => tracing::info!("lease released"),
                Err(e) => tracing::warn!(error = %e, "releasing the lease failed"),
            },
            Err(_) => tracing::warn!("lease still shared at exit; not released"),
        }
    }
}

async fn finish(status: watch::Sender<Status>, http: Option<HttpServer>) -> Result<(), Error> {
    if let Some(h) = http {
        h.stop().await;
    }
    status.send_modify(|s| s.phase = Phase::Stopped);
    tracing::info!("stopped");
    Ok(())
}

fn validate(cfg: &Config) -> Result<(), Error> {
    let bad = |m: &str| Err(Error::Config(m.to_string()));
    if cfg.workers == 0 {
        return bad("workers must be at least 1");
    }
    if cfg.timeout.is_zero() {
        return bad("timeout must be positive");
    }
    if cfg.resync.is_zero() {
        return bad("resync must be positive");
    }
    if cfg.backoff.initial.is_zero() || cfg.backoff.max < cfg.backoff.initial {
        return bad("backoff: initial must be positive and not above max");
    }
    if cfg.identity.is_empty() {
        return bad("identity must not be empty");
    }
    cfg.leader_election.validate().map_err(Error::Config)?;
    Ok(())
}
