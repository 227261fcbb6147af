//! A de-duplicating work queue with per-key exponential backoff, after client-go's
//! `workqueue` (a rate-limiting, delaying queue):
//!
//! - a key is queued at most once (`dirty`);
//! - a key being processed (`processing`) is never handed to a second worker: adding it
//!   meanwhile marks it dirty, and `done` queues it again;
//! - `add_after` keeps one timer per key (the earliest); a single task moves due keys in;
//! - `add_rate_limited` counts consecutive failures per key and delays by the backoff;
//!   `forget` resets the count after a success;
//! - `add_waiting_for_plugin` does the same for a failure that was the plugin's absence,
//!   and `plugin_back` queues every such key at once with its count reset: the backoff
//!   it grew measured the outage, not the object. A key is released so once per outage
//!   (`plugin_away` starts the next): one that fails so again while the plugin answers
//!   Probe keeps its backoff.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::config::Backoff;

#[derive(Default)]
struct Inner {
    queue: VecDeque<String>,
    dirty: HashSet<String>,
    processing: HashSet<String>,
    /// Delayed adds: (due, seq, key), and each key's entry.
    waiting: BTreeSet<(Instant, u64, String)>,
    waiting_at: HashMap<String, (Instant, u64)>,
    failures: HashMap<String, u32>,
    /// Keys whose last failure was the plugin's absence.
    for_plugin: HashSet<String>,
    /// Keys `plugin_back` released since the plugin was last seen away.
    released: HashSet<String>,
    seq: u64,
    shutting_down: bool,
}

pub(crate) struct WorkQueue {
    inner: Mutex<Inner>,
    ready: Notify,
    delays: Notify,
    plugin_wait: Notify,
    backoff: Backoff,
    depth: Option<Gauge>,
}

impl WorkQueue {
    pub(crate) fn new(backoff: Backoff, depth: Option<Gauge>) -> Self {
        WorkQueue {
            inner: Mutex::new(Inner::default()),
            ready: Notify::new(),
            delays: Notify::new(),
            plugin_wait: Notify::new(),
            backoff,
            depth,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish_depth(&self, st: &Inner) {
        if let Some(g) = &self.depth {
            g.set(st.queue.len() as i64);
        }
    }

    /// Queues `key` now (no-op if already queued; deferred if being processed).
    pub(crate) fn add(&self, key: &str) {
        let mut st = self.lock();
        if self.add_locked(&mut st, key) {
            drop(st);
            self.ready.notify_one();
        }
    }

    fn add_locked(&self, st: &mut Inner, key: &str) -> bool {
        if st.shutting_down || st.dirty.contains(key) {
            return false;
        }
        st.dirty.insert(key.to_string());
        if st.processing.contains(key) {
            return false;
        }
        st.queue.push_back(key.to_string());
        self.publish_depth(st);
        true
    }

    /// Queues `key` after `delay` (the earliest of several pending delays wins).
    pub(crate) fn add_after(&self, key: &str, delay: Duration) {
        if delay.is_zero() {
            return self.add(key);
        }
        let due = Instant::now() + delay;
        let mut st = self.lock();
        if st.shutting_down {
            return;
        }
        if let Some(&(at, seq)) = st.waiting_at.get(key) {
            if at <= due {
                return;
            }
            st.waiting.remove(&(at, seq, key.to_string()));
        }
        st.seq += 1;
        let seq = st.seq;
        st.waiting.insert((due, seq, key.to_string()));
        st.waiting_at.insert(key.to_string(), (due, seq));
        drop(st);
        self.delays.notify_one();
    }

    /// Records a failure of `key` and queues it after its backoff; returns the delay.
    pub(crate) fn add_rate_limited(&self, key: &str) -> Duration {
        let failures = {
            let mut st = self.lock();
            let n = st.failures.entry(key.to_string()).or_insert(0);
            *n = n.saturating_add(1);
            *n
        };
        let delay = self.backoff.delay(failures);
        self.add_after(key, delay);
        delay
    }

    /// [`Self::add_rate_limited`] for a failure that was the plugin's absence: `key`
    /// also waits for [`Self::plugin_back`].
    pub(crate) fn add_waiting_for_plugin(&self, key: &str) -> Duration {
        let delay = self.add_rate_limited(key);
        self.lock().for_plugin.insert(key.to_string());
        self.plugin_wait.notify_one();
        delay
    }

    /// Whether a key waits for the plugin.
    #[cfg(test)]
    pub(crate) fn waits_for_plugin(&self) -> bool {
        !self.lock().for_plugin.is_empty()
    }

    /// Returns once a key waits for the plugin, or the queue shuts down (false).
    pub(crate) async fn until_waiting_for_plugin(&self) -> bool {
        loop {
            let notified = self.plugin_wait.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.lock();
                if st.shutting_down {
                    return false;
                }
                if !st.for_plugin.is_empty() {
                    return true;
                }
            }
            notified.await;
        }
    }

    /// The plugin was seen away (a probe failed): keys released before may be released
    /// again when it answers.
    pub(crate) fn plugin_away(&self) {
        self.lock().released.clear();
    }

    /// The plugin answers: every key waiting for it is queued now, its failure count
    /// reset, unless it was released since the plugin was last seen away (then it keeps
    /// its backoff: what fails it is not the plugin's absence). Returns the keys queued.
    pub(crate) fn plugin_back(&self) -> Vec<String> {
        let mut st = self.lock();
        let waiting: Vec<String> = st.for_plugin.drain().collect();
        let keys: Vec<String> = waiting
            .into_iter()
            .filter(|k| !st.released.contains(k))
            .collect();
        let mut woke = false;
        for key in &keys {
            st.released.insert(key.clone());
            st.failures.remove(key);
            if let Some((at, seq)) = st.waiting_at.remove(key) {
                st.waiting.remove(&(at, seq, key.clone()));
            }
            woke |= self.add_locked(&mut st, key);
        }
        drop(st);
        if woke {
            self.ready.notify_waiters();
            self.ready.notify_one();
        }
        keys
    }

    /// Consecutive failures recorded for `key`.
    #[cfg(test)]
    pub(crate) fn failures(&self, key: &str) -> u32 {
        self.lock().failures.get(key).copied().unwrap_or(0)
    }

    /// Resets `key`'s backoff (after a success).
    pub(crate) fn forget(&self, key: &str) {
        let mut st = self.lock();
        st.failures.remove(key);
        st.for_plugin.remove(key);
        st.released.remove(key);
    }

    /// The next key to process, or `None` once the queue is shut down (keys still queued
    /// are not handed out: shutting down stops taking work).
    pub(crate) async fn get(&self) -> Option<String> {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.lock();
                if st.shutting_down {
                    return None;
                }
                if let Some(key) = st.queue.pop_front() {
                    st.dirty.remove(&key);
                    st.processing.insert(key.clone());
                    self.publish_depth(&st);
                    let more = !st.queue.is_empty();
                    drop(st);
                    if more {
                        // Pass the baton: another worker may be waiting.
                        self.ready.notify_one();
                    }
                    return Some(key);
                }
            }
            notified.await;
        }
    }

    /// Marks `key` processed; queues it again if it was added meanwhile.
    pub(crate) fn done(&self, key: &str) {
        let mut st = self.lock();
        st.processing.remove(key);
        if st.dirty.contains(key) && !st.shutting_down {
            st.queue.push_back(key.to_string());
            self.publish_depth(&st);
            drop(st);
            self.ready.notify_one();
        }
    }

    /// Stops handing out work; wakes every waiting worker.
    pub(crate) fn shut_down(&self) {
        self.lock().shutting_down = true;
        self.ready.notify_waiters();
        self.delays.notify_waiters();
        self.plugin_wait.notify_waiters();
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().queue.len()
    }

    /// Moves delayed keys in when they are due. Runs until shut down.
    pub(crate) async fn run_delays(&self) {
        loop {
            let notified = self.delays.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let next = {
                let mut st = self.lock();
                if st.shutting_down {
                    return;
                }
                let now = Instant::now();
                let mut woke = false;
                while let Some(first) = st.waiting.first().cloned() {
                    if first.0 > now {
                        break;
                    }
                    st.waiting.remove(&first);
                    st.waiting_at.remove(&first.2);
                    woke |= self.add_locked(&mut st, &first.2);
                }
                if woke {
                    self.ready.notify_waiters();
                    self.ready.notify_one();
                }
                st.waiting.first().map(|w| w.0)
            };
            match next {
                Some(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at) => {}
                        _ = &mut notified => {}
                    }
                }
                None => notified.await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn q() -> Arc<WorkQueue> {
        Arc::new(WorkQueue::new(
            Backoff {
                initial: Duration::from_millis(10),
                max: Duration::from_millis(40),
            },
            None,
        ))
    }

    #[tokio::test]
    async fn deduplicates_and_never_hands_out_a_key_in_process() {
        let q = q();
        q.add("a");
        q.add("a");
        q.add("b");
        assert_eq!(q.len(), 2);
        let a = q.get().await.unwrap();
        assert_eq!(a, "a");
        q.add("a"); // while processing: deferred, not queued
        assert_eq!(q.len(), 1);
        assert_eq!(q.get().await.unwrap(), "b");
        assert_eq!(q.len(), 0);
        q.done("b");
        q.done("a"); // re-queued now
        assert_eq!(q.get().await.unwrap(), "a");
        q.done("a");
        assert_eq!(q.len(), 0);
    }

    #[tokio::test]
    async fn delayed_and_rate_limited_adds() {
        let q = q();
        let before = Instant::now();
        assert_eq!(q.add_rate_limited("x"), Duration::from_millis(10));
        let after = Instant::now();
        assert_eq!(q.add_rate_limited("x"), Duration::from_millis(20));
        assert_eq!(q.add_rate_limited("x"), Duration::from_millis(40));
        assert_eq!(q.add_rate_limited("x"), Duration::from_millis(40));
        assert_eq!(q.failures("x"), 4);
        // The earliest pending delay won: the time the queue recorded for "x" is the first
        // add's (10 ms after it), not a later, longer one's (at least 20 ms after `after`).
        // Read before the delays run, so however late this runs, "x" is still waiting.
        let (due, _) = q.lock().waiting_at["x"];
        assert!(
            due >= before + Duration::from_millis(10) && due <= after + Duration::from_millis(10),
            "x due {:?} after the first add",
            due - before
        );
        let runner = {
            let q = q.clone();
            tokio::spawn(async move { q.run_delays().await })
        };
        assert_eq!(q.get().await.unwrap(), "x");
        q.done("x");
        q.forget("x");
        assert_eq!(q.failures("x"), 0);
        q.add_after("y", Duration::from_millis(30));
        assert_eq!(q.len(), 0);
        assert_eq!(q.get().await.unwrap(), "y");
        q.shut_down();
        assert_eq!(q.get().await, None);
        runner.await.unwrap();
    }

    #[tokio::test]
    async fn shut_down_wakes_waiting_workers() {
        let q = q();
        let w = {
            let q = q.clone();
            tokio::spawn(async move { q.get().await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        q.shut_down();
        assert_eq!(w.await.unwrap(), None);
        q.add("late");
        assert_eq!(q.len(), 0);
    }

    #[tokio::test]
    async fn keys_waiting_for_the_plugin_are_queued_at_once_when_it_is_back() {
        let hour = Duration::from_secs(3600);
        let q = Arc::new(WorkQueue::new(
            Backoff {
                initial: hour,
                max: hour,
            },
            None,
        ));
        let waiter = {
            let q = q.clone();
            tokio::spawn(async move { q.until_waiting_for_plugin().await })
        };
        assert_eq!(q.add_waiting_for_plugin("gone"), hour);
        assert!(waiter.await.unwrap(), "woken by the first key");
        q.add_waiting_for_plugin("gone");
        // Control: a failure of another kind keeps its backoff.
        q.add_rate_limited("other");
        assert!(q.waits_for_plugin());
        assert_eq!(q.len(), 0);
        assert_eq!(q.plugin_back(), vec!["gone".to_string()]);
        assert_eq!(q.len(), 1, "queued now, not in an hour");
        assert_eq!(q.failures("gone"), 0);
        assert!(!q.lock().waiting_at.contains_key("gone"));
        assert!(q.lock().waiting_at.contains_key("other"));
        assert_eq!(q.failures("other"), 1);
        assert!(!q.waits_for_plugin());
        assert_eq!(q.get().await.unwrap(), "gone");
        q.done("gone");
        // Failing so again while the plugin answers: released once per outage only.
        q.add_waiting_for_plugin("gone");
        assert!(
            q.plugin_back().is_empty(),
            "released already in this outage"
        );
        assert!(!q.waits_for_plugin());
        assert!(
            q.lock().waiting_at.contains_key("gone"),
            "keeps its backoff"
        );
        assert_eq!(q.len(), 0);
        q.plugin_away();
        q.add_waiting_for_plugin("gone");
        assert_eq!(q.plugin_back(), vec!["gone".to_string()], "a new outage");
        // A success clears the wait too.
        q.add_waiting_for_plugin("done");
        q.forget("done");
        assert!(!q.waits_for_plugin());
        q.shut_down();
        assert!(!q.until_waiting_for_plugin().await);
    }
}
