//! The embedded in-memory cluster.
//!
//! It keeps the parts of kube-apiserver's semantics that controllers depend on, following
//! the generic registry store (`staging/src/k8s.io/apiserver/pkg/registry/generic/registry/
//! store.go`) and `rest.BeforeDelete`:
//!
//! - one global, monotonically increasing resourceVersion (etcd's revision);
//! - optimistic concurrency: an update carrying a stale resourceVersion is a Conflict;
//! - create fills uid, creationTimestamp, resourceVersion, generation;
//! - status subresource: main updates keep the stored status, status updates keep the rest;
//! - finalizers hold deletion: delete sets deletionTimestamp (grace 0) and the object stays
//!   until an update removes the last finalizer, which deletes it (watchers see Modified when
//!   the deletion starts, then only Deleted: the emptying update itself is never stored);
//! - Pods delete gracefully: with a grace period > 0 the pod stays, with deletionTimestamp =
//!   now + grace, until a delete with a shorter grace (0 = force) removes it, as a kubelet
//!   would after its containers stop;
//! - delete preconditions on uid and resourceVersion;
//! - watches: every change, in order, to every watcher, from a bounded broadcast channel.
//!   A watcher that falls more than the channel's capacity behind is re-listed (it gets a
//!   fresh [`WatchEvent::Listed`]) instead of the store keeping unbounded history for it;
//!   this is what kube's watcher does on `410 Gone`.
//!
//! For tests, `EmbeddedCluster::cut_watches` makes the open watches of a kind go silent for good
//! (a connection lost without the client noticing), and `EmbeddedCluster::deny` answers Forbidden.
//!
//! Storage is one map per kind keyed by (namespace, name) holding `Arc<K>`, under a
//! per-kind `RwLock`: reads clone only the objects they return, and lists filter before
//! cloning. Pods are also indexed by `spec.nodeName`.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tokio::sync::broadcast;

use fencecsi_cluster::{
    DeleteOptions, DeleteOutcome, Error, FieldSelector, HasStatus, LabelSelector, MetadataPatch,
    Object, Result, WatchEvent,
};

/// True if `field` is a field label the API server accepts for `K`.
fn supports_field<K: Object>(field: &str) -> bool {
    field == "metadata.name" || field == "metadata.namespace" || K::FIELDS.contains(&field)
}

/// `kind/namespace/name` for messages.
fn describe<K: Object>(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        Some(ns) => format!("{} {ns}/{name}", K::KIND),
        None => format!("{} {name}", K::KIND),
    }
}

/// Tuning of the embedded cluster.
#[derive(Debug, Clone)]
pub struct EmbeddedConfig {
    /// Per-kind watch channel capacity: how many changes a watcher may fall behind before it
    /// is re-listed. Bounds the memory a slow watcher can pin.
    pub watch_buffer: usize,
    /// Per-kind number of recent changes kept to serve watches that start from a
    /// resourceVersion (the API server's watch-cache window). Older starts re-list.
    pub history: usize,
}

impl Default for EmbeddedConfig {
    fn default() -> Self {
        EmbeddedConfig {
            watch_buffer: 4096,
            history: 4096,
        }
    }
}

pub(crate) struct Embedded {
    /// Shared with every kind store (not the `Embedded` itself, which would make a cycle
    /// through the kind map and leak the whole store).
    rv: Arc<AtomicU64>,
    kinds: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
    config: EmbeddedConfig,
}

impl Embedded {
    pub(crate) fn new(config: EmbeddedConfig) -> Self {
        Embedded {
            rv: Arc::new(AtomicU64::new(1)),
            kinds: Mutex::new(HashMap::new()),
            config,
        }
    }

    /// The per-kind store, created on first use.
    pub(crate) fn store<K: Object>(&self) -> Arc<KindStore<K>> {
        let mut kinds = self.kinds.lock().expect("embedded kinds lock");
        let entry = kinds.entry(TypeId::of::<K>()).or_insert_with(|| {
            let (tx, _) = broadcast::channel(self.config.watch_buffer.max(1));
            Arc::new(KindStore::<K> {
                rv: self.rv.clone(),
                state: RwLock::new(State {
                    objects: BTreeMap::new(),
                    index: HashMap::new(),
                    history: VecDeque::new(),
                    compacted_rv: 0,
                }),
                tx,
                history_cap: self.config.history,
                denied: RwLock::new(BTreeSet::new()),
                cuts: AtomicU64::new(0),
            }) as Arc<dyn Any + Send + Sync>
        });
        entry
            .clone()
            .downcast::<KindStore<K>>()
            .expect("kind store type")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One stored change, shared by the history and every watcher (no per-watcher copies).
struct Change<K> {
    rv: u64,
    kind: ChangeKind,
    /// The previous state (Modified only), so a selector watch can turn "stopped matching"
    /// into Deleted and "started matching" into Added, as the API server does.
    old: Option<Arc<K>>,
    /// The new state; for Deleted, the final state.
    new: Arc<K>,
}

type Key = (String, String);

struct State<K> {
    /// namespace ("" for cluster-scoped) -> name -> object.
    objects: BTreeMap<String, BTreeMap<String, Arc<K>>>,
    /// Value of `K::INDEXED_FIELD` -> keys.
    index: HashMap<String, BTreeSet<Key>>,
    history: VecDeque<Arc<Change<K>>>,
    /// Changes with a resourceVersion up to this one may have been dropped from `history`.
    compacted_rv: u64,
}

pub(crate) struct KindStore<K> {
    rv: Arc<AtomicU64>,
    state: RwLock<State<K>>,
    tx: broadcast::Sender<Arc<Change<K>>>,
    history_cap: usize,
    /// Namespaces where reads and writes of single objects answer Forbidden, as an
    /// API server does for a missing RBAC grant (tests: see `EmbeddedCluster::deny`).
    denied: RwLock<BTreeSet<String>>,
    /// How many times the open watches were cut (tests: see `EmbeddedCluster::cut_watches`). A
    /// watch started when the count was lower is silent.
    cuts: AtomicU64,
}

/// A filter for list and watch: namespace, selectors, and (list only) a closure.
pub(crate) struct Matcher {
    pub(crate) namespace: Option<String>,
    pub(crate) labels: LabelSelector,
    pub(crate) fields: FieldSelector,
}

impl Matcher {
    pub(crate) fn new<K: Object>(
        namespace: Option<&str>,
        labels: Option<&str>,
        fields: Option<&str>,
    ) -> Result<Self> {
        let labels = LabelSelector::parse(labels.unwrap_or(""))?;
        let fields = FieldSelector::parse(fields.unwrap_or(""))?;
        if let Some(f) = fields.fields().find(|f| !supports_field::<K>(f)) {
            return Err(Error::Invalid(format!(
                "field label not supported for {}: {f}",
                K::KIND
            )));
        }
        let namespace = if K::NAMESPACED {
            namespace.map(str::to_string)
        } else {
            None
        };
        Ok(Matcher {
            namespace,
            labels,
            fields,
        })
    }

    fn matches<K: Object>(&self, obj: &K) -> bool {
        let m = obj.metadata();
        if let Some(ns) = &self.namespace {
            if m.namespace.as_deref() != Some(ns.as_str()) {
                return false;
            }
        }
        self.labels.matches(m.labels.as_ref()) && self.fields.matches(|f| obj.field(f))
    }
}

fn now_time() -> Time {
    // metav1.Time has second precision on the wire; keep the same in memory.
    Time(Timestamp::from_second(Timestamp::now().as_second()).expect("timestamp in range"))
}

fn parse_rv(rv: &str) -> Result<u64> {
    rv.parse::<u64>()
        .map_err(|_| Error::Invalid(format!("invalid resourceVersion {rv:?}")))
}

fn rv_of<K: Object>(obj: &K) -> u64 {
    obj.metadata()
        .resource_version
        .as_deref()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0)
}

/// DNS-1123 subdomain, the name rule of every kind used here.
fn check_name(kind: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "{kind} name {name:?} is not a valid DNS-1123 subdomain"
        )))
    }
}

fn generate_suffix() -> String {
    // The alphabet of apimachinery's name generator (no vowels, no confusable digits).
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    uuid::Uuid::new_v4().as_bytes()[..5]
        .iter()
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect()
}

fn finalizers(m: &ObjectMeta) -> &[String] {
    m.finalizers.as_deref().unwrap_or(&[])
}

/// A delete's preconditions (UID, resourceVersion), as the API server checks them.
fn check_preconditions<K: Object>(old: &K, opts: &DeleteOptions) -> Result<()> {
    let Some(pre) = &opts.preconditions else {
        return Ok(());
    };
    let om = old.metadata();
    if let Some(uid) = &pre.uid {
        if Some(uid.as_str()) != om.uid.as_deref() {
            return Err(Error::Conflict(format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                om.uid.as_deref().unwrap_or("")
            )));
        }
    }
    if let Some(rv) = &pre.resource_version {
        if parse_rv(rv)? != rv_of(old) {
            return Err(Error::Conflict(format!(
                "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                om.resource_version.as_deref().unwrap_or("")
            )));
        }
    }
    Ok(())
}

/// What a delete does to a kind with graceful deletion (Pods).
enum Grace {
    /// Starts it, or shortens the one under way, to this period (written into the object).
    Applied(i64),
    /// Not graceful: the kind has none, or the deletion under way is at grace 0.
    NotGraceful,
    /// A graceful deletion is under way and this one asks no shorter period: nothing changes.
    AlreadyUnderWay,
}

fn apply_grace<K: Object>(obj: &mut K, requested: Option<i64>) -> Grace {
    if obj.graceful_delete_period(requested).is_none() {
        return Grace::NotGraceful;
    }
    let om = obj.metadata();
    match (
        om.deletion_timestamp.clone(),
        om.deletion_grace_period_seconds,
    ) {
        (Some(ts), Some(existing)) if existing > 0 => match requested {
            // Only a shorter grace period may be given once deletion started.
            Some(p) if p < existing => {
                let when =
                    ts.0 - SignedDuration::from_secs(existing) + SignedDuration::from_secs(p);
                let m = obj.metadata_mut();
                m.deletion_timestamp = Some(Time(when));
                m.deletion_grace_period_seconds = Some(p);
                Grace::Applied(p)
            }
            _ => Grace::AlreadyUnderWay,
        },
        (Some(_), _) => Grace::NotGraceful, // already at grace 0: handled as non-graceful
        (None, _) => {
            let p = obj.graceful_delete_period(requested).unwrap_or(0);
            let when = now_time().0 + SignedDuration::from_secs(p);
            let m = obj.metadata_mut();
            m.deletion_timestamp = Some(Time(when));
            m.deletion_grace_period_seconds = Some(p);
            m.generation = m
                .generation
                .filter(|g| *g > 0)
                .map(|g| g + 1)
                .or(m.generation);
            Grace::Applied(p)
        }
    }
}

impl<K: Object> KindStore<K> {
    /// Called only under this kind's write lock, which is what keeps each kind's changes in
    /// resourceVersion order.
    fn next_rv(&self) -> u64 {
        self.rv.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn read(&self) -> RwLockReadGuard<'_, State<K>> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, State<K>> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    fn lookup(st: &State<K>, ns: &str, name: &str) -> Option<Arc<K>> {
        st.objects.get(ns).and_then(|m| m.get(name)).cloned()
    }

    fn not_found(ns: &str, name: &str) -> Error {
        Error::NotFound(format!(
            "{} not found",
            describe::<K>(Some(ns).filter(|n| !n.is_empty()), name)
        ))
    }

    /// Every watch open now delivers nothing more and never ends; later watches work.
    pub(crate) fn cut_watches(&self) {
        self.cuts.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn deny(&self, ns: &str) {
        self.denied
            .write()
            .expect("embedded deny lock")
            .insert(ns.to_string());
    }

    pub(crate) fn allow(&self, ns: &str) {
        self.denied.write().expect("embedded deny lock").remove(ns);
    }

    fn guard(&self, ns: &str) -> Result<()> {
        if self.denied.read().expect("embedded deny lock").contains(ns) {
            return Err(Error::Forbidden(format!(
                "{} in namespace {ns:?}: this caller may not touch it",
                K::KIND
            )));
        }
        Ok(())
    }

    pub(crate) fn get(&self, ns: &str, name: &str) -> Result<K> {
        self.guard(ns)?;
        let st = self.read();
        Self::lookup(&st, ns, name)
            .map(|o| (*o).clone())
            .ok_or_else(|| Self::not_found(ns, name))
    }

    /// Lists matching objects (sorted by namespace, name) and the resourceVersion to watch
    /// from. Filters run on the stored objects; only matches are cloned.
    pub(crate) fn list(&self, matcher: &Matcher, filter: &dyn Fn(&K) -> bool) -> (Vec<K>, String) {
        let st = self.read();
        let rv = self.rv.load(Ordering::SeqCst).to_string();
        let keep = |o: &Arc<K>| matcher.matches(&**o) && filter(o);
        let mut out = Vec::new();
        let indexed = K::INDEXED_FIELD.and_then(|f| matcher.fields.required_value(f));
        if let Some(value) = indexed {
            for (ns, name) in st.index.get(value).into_iter().flatten() {
                if matcher.namespace.as_ref().is_some_and(|want| want != ns) {
                    continue;
                }
                if let Some(o) = Self::lookup(&st, ns, name) {
                    if keep(&o) {
                        out.push((*o).clone());
                    }
                }
            }
        } else {
            let spaces: Box<dyn Iterator<Item = &BTreeMap<String, Arc<K>>>> =
                match &matcher.namespace {
                    Some(ns) => Box::new(st.objects.get(ns).into_iter()),
                    None => Box::new(st.objects.values()),
                };
            for space in spaces {
                out.extend(space.values().filter(|o| keep(o)).map(|o| (**o).clone()));
            }
        }
        (out, rv)
    }

    fn index_key(obj: &K) -> Option<String> {
        K::INDEXED_FIELD.map(|f| obj.field(f))
    }

    /// Stores `obj` (already carrying its new resourceVersion) and publishes the change.
    /// Must be called with the write lock held: that is what orders changes per kind.
    fn commit(&self, st: &mut State<K>, kind: ChangeKind, old: Option<Arc<K>>, obj: Arc<K>) {
        let m = obj.metadata();
        let ns = m.namespace.clone().unwrap_or_default();
        let name = m.name.clone().unwrap_or_default();
        let key = (ns.clone(), name.clone());
        if K::INDEXED_FIELD.is_some() {
            if let Some(o) = &old {
                if let Some(v) = Self::index_key(o) {
                    if let Some(set) = st.index.get_mut(&v) {
                        set.remove(&key);
                        if set.is_empty() {
                            st.index.remove(&v);
                        }
                    }
                }
            }
            if kind != ChangeKind::Deleted {
                if let Some(v) = Self::index_key(&obj) {
                    st.index.entry(v).or_default().insert(key.clone());
                }
            }
        }
        if kind == ChangeKind::Deleted {
            if let Some(space) = st.objects.get_mut(&ns) {
                space.remove(&name);
                if space.is_empty() {
                    st.objects.remove(&ns);
                }
            }
        } else {
            st.objects.entry(ns).or_default().insert(name, obj.clone());
        }
        let change = Arc::new(Change {
            rv: rv_of(&*obj),
            kind,
            old,
            new: obj,
        });
        if self.history_cap > 0 {
            st.history.push_back(change.clone());
            while st.history.len() > self.history_cap {
                if let Some(dropped) = st.history.pop_front() {
                    st.compacted_rv = dropped.rv;
                }
            }
        } else {
            st.compacted_rv = change.rv;
        }
        // No receivers is fine: nobody is watching this kind.
        let _ = self.tx.send(change);
    }

    fn remove(&self, st: &mut State<K>, last: &K) {
        // Like etcd, the Deleted event carries the last state at the deletion's revision.
        let mut gone = last.clone();
        gone.metadata_mut().resource_version = Some(self.next_rv().to_string());
        let m = gone.metadata();
        let old = Self::lookup(
            st,
            m.namespace.as_deref().unwrap_or(""),
            m.name.as_deref().unwrap_or(""),
        );
        self.commit(st, ChangeKind::Deleted, old, Arc::new(gone));
    }

    /// Writes an update of an existing object, or deletes it when the update removed the
    /// last finalizer of an object whose deletion was already final (grace 0): the API
    /// server's `ShouldDeleteDuringUpdate`.
    fn write_update(&self, st: &mut State<K>, old: Arc<K>, mut new: K) -> K {
        if new == *old {
            return new; // no-op updates are not stored and do not move resourceVersion
        }
        let om = old.metadata();
        let nm = new.metadata();
        let emptied = !finalizers(om).is_empty() && finalizers(nm).is_empty();
        if emptied && nm.deletion_timestamp.is_some() && nm.deletion_grace_period_seconds == Some(0)
        {
            self.remove(st, &old);
            return new;
        }
        new.metadata_mut().resource_version = Some(self.next_rv().to_string());
        let new = Arc::new(new);
        self.commit(st, ChangeKind::Modified, Some(old), new.clone());
        (*new).clone()
    }

    fn check_update_preconditions(old: &K, new_meta: &ObjectMeta) -> Result<()> {
        let om = old.metadata();
        let name = om.name.as_deref().unwrap_or("");
        if let Some(uid) = new_meta.uid.as_deref().filter(|u| !u.is_empty()) {
            if Some(uid) != om.uid.as_deref() {
                return Err(Error::Conflict(format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    om.uid.as_deref().unwrap_or("")
                )));
            }
        }
        // An empty resourceVersion is an unconditional update, as the API server allows.
        if let Some(rv) = new_meta
            .resource_version
            .as_deref()
            .filter(|r| !r.is_empty())
        {
            if parse_rv(rv)? != rv_of(old) {
                return Err(Error::Conflict(format!(
                    "Operation cannot be fulfilled on {}: the object has been modified; please apply your changes to the latest version and try again",
                    describe::<K>(om.namespace.as_deref(), name)
                )));
            }
        }
        Ok(())
    }

    fn check_no_new_finalizers(old: &K, new_meta: &ObjectMeta) -> Result<()> {
        let om = old.metadata();
        if om.deletion_timestamp.is_some()
            && finalizers(new_meta)
                .iter()
                .any(|f| !finalizers(om).contains(f))
        {
            return Err(Error::Invalid(format!(
                "{}: metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted",
                describe::<K>(om.namespace.as_deref(), om.name.as_deref().unwrap_or(""))
            )));
        }
        Ok(())
    }

    pub(crate) fn create(&self, ns: &str, obj: &K) -> Result<K> {
        self.guard(ns)?;
        let mut obj = obj.clone();
        let m = obj.metadata_mut();
        if m.name.as_deref().unwrap_or("").is_empty() {
            match m.generate_name.as_deref() {
                Some(prefix) if !prefix.is_empty() => {
                    m.name = Some(format!("{prefix}{}", generate_suffix()))
                }
                _ => {
                    return Err(Error::Invalid(format!(
                        "{}: metadata.name: Required value",
                        K::KIND
                    )))
                }
            }
        }
        let name = m.name.clone().unwrap_or_default();
        check_name(K::KIND, &name)?;
        if m.resource_version.as_deref().is_some_and(|r| !r.is_empty()) {
            return Err(Error::Invalid(
                "resourceVersion should not be set on objects to be created".into(),
            ));
        }
        m.namespace = if K::NAMESPACED {
            Some(ns.to_string())
        } else {
            None
        };
        m.uid = Some(uuid::Uuid::new_v4().to_string());
        m.creation_timestamp = Some(now_time());
        m.deletion_timestamp = None;
        m.deletion_grace_period_seconds = None;
        m.generation = Some(1);
        obj.prepare_for_create();

        let mut st = self.write();
        if Self::lookup(&st, ns, &name).is_some() {
            return Err(Error::AlreadyExists(format!(
                "{} already exists",
                describe::<K>(Some(ns).filter(|n| !n.is_empty()), &name)
            )));
        }
        obj.metadata_mut().resource_version = Some(self.next_rv().to_string());
        let obj = Arc::new(obj);
        self.commit(&mut st, ChangeKind::Added, None, obj.clone());
        Ok((*obj).clone())
    }

    pub(crate) fn replace(&self, ns: &str, obj: &K) -> Result<K> {
        self.guard(ns)?;
        let name = obj.metadata().name.clone().unwrap_or_default();
        let mut st = self.write();
        let old = Self::lookup(&st, ns, &name).ok_or_else(|| Self::not_found(ns, &name))?;
        self.replace_locked(&mut *st, old, obj)
    }

    /// A JSON merge patch (RFC 7386) applied to the stored object, then written as an
    /// update: a `metadata.resourceVersion` in the patch is a precondition, status
    /// changes are ignored, as the API server does on the main resource.
    pub(crate) fn patch_merge(&self, ns: &str, name: &str, patch: &serde_json::Value) -> Result<K> {
        self.guard(ns)?;
        let mut st = self.write();
        let old = Self::lookup(&st, ns, name).ok_or_else(|| Self::not_found(ns, name))?;
        let mut doc = serde_json::to_value(&*old)
            .map_err(|e| Error::Other(format!("encoding {}: {e}", K::KIND)))?;
        merge_patch(&mut doc, patch);
        let mut new: K = serde_json::from_value(doc).map_err(|e| {
            Error::Invalid(format!("{} {name}: patch does not apply: {e}", K::KIND))
        })?;
        let want_rv = patch
            .pointer("/metadata/resourceVersion")
            .and_then(|v| v.as_str())
            .map(str::to_string);
        new.metadata_mut().resource_version = want_rv;
        self.replace_locked(&mut *st, old, &new)
    }

    fn replace_locked(&self, st: &mut State<K>, old: Arc<K>, obj: &K) -> Result<K> {
        Self::check_update_preconditions(&old, obj.metadata())?;
        Self::check_no_new_finalizers(&old, obj.metadata())?;
        let mut new = obj.clone();
        let om = old.metadata();
        {
            // System fields an update cannot change.
            let nm = new.metadata_mut();
            nm.namespace = om.namespace.clone();
            nm.uid = om.uid.clone();
            nm.creation_timestamp = om.creation_timestamp.clone();
            nm.deletion_timestamp = om.deletion_timestamp.clone();
            nm.deletion_grace_period_seconds = om.deletion_grace_period_seconds;
            nm.resource_version = om.resource_version.clone();
            nm.generation = om.generation;
        }
        new.copy_status_from(&old);
        if new.spec_differs(&old) {
            new.metadata_mut().generation = Some(om.generation.unwrap_or(0) + 1);
        }
        Ok(self.write_update(st, old, new))
    }

    /// A JSON merge patch of the status subresource: only `status` of the merged object
    /// is taken; a `metadata.resourceVersion` in the patch is a precondition.
    pub(crate) fn patch_status_merge(
        &self,
        ns: &str,
        name: &str,
        patch: &serde_json::Value,
    ) -> Result<K>
    where
        K: HasStatus,
    {
        let mut st = self.write();
        let old = Self::lookup(&st, ns, name).ok_or_else(|| Self::not_found(ns, name))?;
        if let Some(rv) = patch
            .pointer("/metadata/resourceVersion")
            .and_then(|v| v.as_str())
        {
            let pre = ObjectMeta {
                resource_version: Some(rv.to_string()),
                ..Default::default()
            };
            Self::check_update_preconditions(&old, &pre)?;
        }
        let mut doc = serde_json::to_value(&*old)
            .map_err(|e| Error::Other(format!("encoding {}: {e}", K::KIND)))?;
        merge_patch(&mut doc, patch);
        let merged: K = serde_json::from_value(doc).map_err(|e| {
            Error::Invalid(format!("{} {name}: patch does not apply: {e}", K::KIND))
        })?;
        let mut new = (*old).clone();
        new.copy_status_from(&merged);
        Ok(self.write_update(&mut st, old, new))
    }

    pub(crate) fn replace_status(&self, ns: &str, obj: &K) -> Result<K>
    where
        K: HasStatus,
    {
        let name = obj.metadata().name.clone().unwrap_or_default();
        let mut st = self.write();
        let old = Self::lookup(&st, ns, &name).ok_or_else(|| Self::not_found(ns, &name))?;
        Self::check_update_preconditions(&old, obj.metadata())?;
        let mut new = (*old).clone();
        new.copy_status_from(obj);
        Ok(self.write_update(&mut st, old, new))
    }

    pub(crate) fn patch_metadata(&self, ns: &str, name: &str, patch: &MetadataPatch) -> Result<K> {
        self.guard(ns)?;
        let mut st = self.write();
        let old = Self::lookup(&st, ns, name).ok_or_else(|| Self::not_found(ns, name))?;
        if let Some(rv) = &patch.resource_version {
            let pre = ObjectMeta {
                resource_version: Some(rv.clone()),
                ..Default::default()
            };
            Self::check_update_preconditions(&old, &pre)?;
        }
        let mut new = (*old).clone();
        if !patch.apply_to(new.metadata_mut()) {
            return Ok(new);
        }
        Self::check_no_new_finalizers(&old, new.metadata())?;
        Ok(self.write_update(&mut st, old, new))
    }

    /// Delete, following `Store.Delete` + `rest.BeforeDelete` + `updateForGracefulDeletionAndFinalizers`.
    pub(crate) fn delete(
        &self,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<DeleteOutcome<K>> {
        let mut st = self.write();
        let old = Self::lookup(&st, ns, name).ok_or_else(|| Self::not_found(ns, name))?;
        check_preconditions(&*old, opts)?;
        // Negative grace periods are treated as 1s on the delete path.
        let requested = opts.grace_period_seconds.map(|g| if g < 0 { 1 } else { g });
        let pending_finalizers = !finalizers(old.metadata()).is_empty();
        let mut obj = (*old).clone();
        let graceful = match apply_grace(&mut obj, requested) {
            Grace::Applied(p) => Some(p),
            Grace::NotGraceful => None,
            Grace::AlreadyUnderWay => return Ok(DeleteOutcome::Terminating((*old).clone())),
        };

        if let Some(period) = graceful {
            // The API server stores the deletionTimestamp first (watchers see Modified),
            // then deletes at once if nothing is left to wait for.
            let written = self.write_update(&mut st, old, obj);
            if pending_finalizers || period > 0 {
                return Ok(DeleteOutcome::Terminating(written));
            }
            self.remove(&mut st, &written);
            return Ok(DeleteOutcome::Deleted);
        }

        if pending_finalizers {
            // markAsDeleting: deletionTimestamp now (or earlier if already set), grace 0.
            let now = now_time();
            let m = obj.metadata_mut();
            if m.deletion_timestamp.is_none() {
                m.generation = m
                    .generation
                    .filter(|g| *g > 0)
                    .map(|g| g + 1)
                    .or(m.generation);
            }
            if m.deletion_timestamp.as_ref().is_none_or(|t| t.0 > now.0) {
                m.deletion_timestamp = Some(now);
            }
            m.deletion_grace_period_seconds = Some(0);
            let written = self.write_update(&mut st, old, obj);
            return Ok(DeleteOutcome::Terminating(written));
        }
        self.remove(&mut st, &old);
        Ok(DeleteOutcome::Deleted)
    }

    /// A watch stream: initial list (or replay after `since`), then every change.
    pub(crate) fn watch(
        self: Arc<Self>,
        matcher: Matcher,
        since: Option<&str>,
    ) -> Result<BoxStream<'static, WatchEvent<K>>> {
        let since = since.map(parse_rv).transpose()?;
        let mut w = EmbeddedWatch {
            store: self.clone(),
            matcher,
            rx: None,
            pending: VecDeque::new(),
            cuts: self.cuts.load(Ordering::SeqCst),
        };
        {
            let st = self.read();
            match since {
                Some(rv) if rv >= st.compacted_rv => {
                    for ch in st.history.iter().filter(|c| c.rv > rv) {
                        if let Some(ev) = w.convert(ch) {
                            w.pending.push_back(ev);
                        }
                    }
                    w.rx = Some(self.tx.subscribe());
                }
                _ => w.relist_locked(&st),
            }
        }
        Ok(futures::stream::unfold(
            w,
            |mut w| async move { w.next_event().await.map(|ev| (ev, w)) },
        )
        .boxed())
    }

    /// Number of objects stored (all namespaces): cheap, for tests and benchmarks.
    pub(crate) fn len(&self) -> usize {
        self.read().objects.values().map(BTreeMap::len).sum()
    }
}

struct EmbeddedWatch<K> {
    store: Arc<KindStore<K>>,
    matcher: Matcher,
    rx: Option<broadcast::Receiver<Arc<Change<K>>>>,
    pending: VecDeque<WatchEvent<K>>,
    /// The store's cut count when this watch started.
    cuts: u64,
}

impl<K: Object> EmbeddedWatch<K> {
    /// Snapshot + fresh subscription under one read lock, so no change falls between them.
    fn relist_locked(&mut self, st: &State<K>) {
        let mut items = Vec::new();
        for space in st.objects.values() {
            items.extend(
                space
                    .values()
                    .filter(|o| self.matcher.matches(&***o))
                    .map(|o| (**o).clone()),
            );
        }
        self.pending.clear();
        self.pending.push_back(WatchEvent::Listed(items));
        self.rx = Some(self.store.tx.subscribe());
    }

    fn convert(&self, ch: &Change<K>) -> Option<WatchEvent<K>> {
        let now = self.matcher.matches(&*ch.new);
        match ch.kind {
            ChangeKind::Added => now.then(|| WatchEvent::Added((*ch.new).clone())),
            ChangeKind::Deleted => now.then(|| WatchEvent::Deleted((*ch.new).clone())),
            ChangeKind::Modified => {
                let before = ch.old.as_ref().is_some_and(|o| self.matcher.matches(&**o));
                match (before, now) {
                    (true, true) => Some(WatchEvent::Modified((*ch.new).clone())),
                    (false, true) => Some(WatchEvent::Added((*ch.new).clone())),
                    (true, false) => Some(WatchEvent::Deleted((*ch.new).clone())),
                    (false, false) => None,
                }
            }
        }
    }

    async fn next_event(&mut self) -> Option<WatchEvent<K>> {
        loop {
            if self.store.cuts.load(Ordering::SeqCst) != self.cuts {
                // Cut: like a connection the server dropped while the client still waits
                // on it, nothing more arrives, and nothing says so.
                self.rx = None;
                self.pending.clear();
                return std::future::pending().await;
            }
            if let Some(ev) = self.pending.pop_front() {
                return Some(ev);
            }
            let rx = self.rx.as_mut()?;
            match rx.recv().await {
                Ok(ch) => {
                    if self.store.cuts.load(Ordering::SeqCst) != self.cuts {
                        continue;
                    }
                    if let Some(ev) = self.convert(&ch) {
                        return Some(ev);
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::debug!(
                        kind = K::KIND,
                        skipped = n,
                        "embedded watcher lagged; re-listing"
                    );
                    let store = self.store.clone();
                    let st = store.read();
                    self.relist_locked(&st);
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

/// RFC 7386: objects merge key by key, `null` removes a key, anything else replaces.
fn merge_patch(target: &mut serde_json::Value, patch: &serde_json::Value) {
    use serde_json::Value;
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    let t = target.as_object_mut().expect("made an object above");
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}
