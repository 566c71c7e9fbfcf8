//! [`IdentityAllocator`]: label sets → identities with local reference
//! counting over an [`IdentityBackend`], a cache of every identity kept
//! current from the store, and the reconcile loop that keeps this node's
//! value keys equal to the identities it holds.
//!
//! # Local first
//!
//! The store publishes what this node uses; it is no reason to refuse local
//! work. A label set whose identity the node knows (held here, or in the
//! cache because another node holds it) is allocated while the store is
//! unreachable: the reference is taken, and the value key written by the
//! next reconcile pass. A release never waits for the store: the last
//! reference queues the deletion of the value key (done at once while the
//! store answers). Only a set with no identity anywhere needs the store
//! ([`AllocError::Unavailable`]).
//!
//! # After a restart
//!
//! This node's value keys of the previous run stay in the store (nothing
//! references them in this process yet) until the clients that held them
//! claimed again what they still use: a client that ends its replay
//! ([`IdentityAllocator::end_replay`], svc-endpoint's `EndReplay` after it
//! replayed its endpoints to the new boot id) releases at once the keys
//! whose references were all its own by the local snapshot; the others go
//! after [`AllocatorOptions::restore_grace`] (a client that never comes
//! back; no snapshot, as with the embedded store).
//!
//! With etcd, a restart during an outage starts from the local snapshot
//! ([`IdentityAllocator::restore`], [`crate::snapshot`]): the cache is
//! served and the released sets' keys deleted by the first pass once the
//! store answers; the first listing replaces the cache.
//!
//! # Reconciliation (level-triggered, one pass at a time)
//!
//! A pass writes the value key (and, if it vanished, the master key) of
//! every held identity, lists this node's value keys in the store and
//! deletes those no local reference backs: at once for sets released in
//! this process and for keys of a previous run whose clients ended their
//! replay without them, after [`AllocatorOptions::restore_grace`] for the
//! others. Passes run when the store is back after an error (the cache
//! watcher re-listed it), when the lease was replaced, after a local change
//! the store missed, periodically ([`AllocatorOptions::resync_interval`]),
//! and again with backoff after a failed pass.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::StreamExt;
use rand::Rng;
use rivet_common::backoff::Backoff;
use rivet_common::controller::{Controller, Controllers, Progress, Trigger};
use rivet_common::identity::{CLUSTER_IDENTITY_MIN, DEFAULT_MAX_CLUSTER_IDENTITY};
use rivet_common::labels::{LabelFilter, LabelSource, Labels, ReservedIdentity};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

use crate::backend::{
    AcquireOutcome, BackendError, CreateOutcome, IdOrder, IdentityBackend, IdentityEvent, IdentityRecord, Revision,
};
use crate::events::{self, IdentityMetrics, KeyAction, ReconciledKeys, RestoredCause, RestoredKind, StoreKey};
use crate::reconcile;
use crate::snapshot::{IdentitySnapshot, SnapshotPart};

/// Allocation attempts before giving up on contention.
const MAX_ATTEMPTS: usize = 64;

/// How the allocator allocates.
#[derive(Debug, Clone)]
pub struct AllocatorOptions {
    /// Smallest cluster identity (256).
    pub min_id: u32,
    /// Largest cluster identity.
    pub max_id: u32,
    /// Which labels are identity-relevant.
    pub filter: LabelFilter,
    /// How often this node's keys are reconciled with the store.
    pub resync_interval: Duration,
    /// How long after start value keys of this node that no local reference
    /// backs are kept (a previous run's, until svc-endpoint replayed).
    pub restore_grace: Duration,
    /// Where the outage events are counted.
    pub metrics: IdentityMetrics,
}

impl Default for AllocatorOptions {
    fn default() -> Self {
        Self {
            min_id: CLUSTER_IDENTITY_MIN,
            max_id: DEFAULT_MAX_CLUSTER_IDENTITY,
            filter: LabelFilter::default(),
            resync_interval: Duration::from_secs(60),
            restore_grace: Duration::from_secs(120),
            metrics: IdentityMetrics::default(),
        }
    }
}

/// What kind of identity a number is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityKind {
    /// 1..=7, never in the store.
    Reserved,
    /// From the cluster range, in the store.
    Cluster,
}

/// The result of an allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    /// The identity.
    pub id: u32,
    /// The identity-relevant labels it was allocated for.
    pub labels: Labels,
    /// Reserved or cluster.
    pub kind: IdentityKind,
    /// The cluster had no identity for these labels before this call.
    pub newly_allocated: bool,
    /// Local references after this call (0 for reserved).
    pub references: u64,
}

/// Why a label set cannot have a cluster identity.
#[derive(Debug, thiserror::Error)]
pub enum InvalidLabels {
    /// A `cidr:` label: CIDR identities are node-local.
    #[error("{label} is a CIDR label; CIDR identities are node-local (AllocateCidrIdentities)")]
    Cidr {
        /// The label.
        label: String,
    },
    /// Two different reserved labels.
    #[error("{labels} holds several reserved labels")]
    SeveralReserved {
        /// The filtered set.
        labels: Labels,
    },
    /// Nothing identity-relevant is left after filtering.
    #[error("no identity-relevant label left after filtering")]
    NoneRelevant,
}

/// Why an allocation or release failed.
#[derive(Debug, thiserror::Error)]
pub enum AllocError {
    /// Bad labels (named).
    #[error("labels: {0}")]
    InvalidLabels(#[from] InvalidLabels),
    /// The store is unreachable and no identity is known for the labels.
    #[error(
        "allocating an identity for {labels}: the kvstore is unreachable and this label set has no identity \
         known on this node yet (a new identity needs the kvstore; retry once it is back): {source}"
    )]
    Unavailable {
        /// The labels.
        labels: String,
        /// The store's error.
        source: BackendError,
    },
    /// Every id of the range is taken.
    #[error("the identity range {min}..={max} is exhausted")]
    Exhausted {
        /// Range start.
        min: u32,
        /// Range end.
        max: u32,
    },
    /// Too much contention.
    #[error("allocating an identity for {labels}: gave up after {attempts} conflicting attempts")]
    Contention {
        /// The labels.
        labels: String,
        /// Attempts made.
        attempts: usize,
    },
    /// The store answered with something unusable.
    #[error("allocating an identity for {labels}: {source}")]
    Store {
        /// The labels.
        labels: String,
        /// The store's error.
        source: BackendError,
    },
}

/// A change of the cluster's identities, for watchers, with the cache
/// revision it made.
pub type RevisedChange = (u64, IdentityChange);

/// A change of the cluster's identities, for watchers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityChange {
    /// An identity appeared.
    Upsert(IdentityRecord),
    /// An identity vanished.
    Delete(u32),
}

/// Every identity of the cluster (100,000 at scale): each label text is one
/// allocation shared by both maps.
#[derive(Debug, Default)]
struct Cache {
    by_id: BTreeMap<u32, Arc<str>>,
    by_labels: HashMap<Arc<str>, u32>,
    /// Bumped by every change; each change is broadcast with it.
    revision: u64,
}

impl Cache {
    fn records(&self) -> Vec<IdentityRecord> {
        self.by_id
            .iter()
            .map(|(id, labels)| IdentityRecord {
                id: *id,
                labels: labels.to_string(),
            })
            .collect()
    }

    fn insert(&mut self, id: u32, labels: String) -> bool {
        if self.by_id.get(&id).is_some_and(|held| **held == *labels) {
            return false;
        }
        let labels: Arc<str> = labels.into();
        if let Some(old) = self.by_id.insert(id, labels.clone())
            && self.by_labels.get(&old) == Some(&id)
        {
            self.by_labels.remove(&old);
        }
        self.by_labels.insert(labels, id);
        self.revision += 1;
        true
    }

    fn remove(&mut self, id: u32) -> bool {
        match self.by_id.remove(&id) {
            Some(labels) => {
                if self.by_labels.get(&labels) == Some(&id) {
                    self.by_labels.remove(&labels);
                }
                self.revision += 1;
                true
            }
            None => false,
        }
    }
}

#[derive(Debug, Default)]
struct LocalRef {
    id: u32,
    owners: HashSet<String>,
    anonymous: u64,
}

impl LocalRef {
    fn count(&self) -> u64 {
        self.owners.len() as u64 + self.anonymous
    }
}

/// Where an allocation that went to the store ended.
enum StoreAllocation {
    /// This node's value key is in the store.
    Published { id: u32, newly_allocated: bool },
    /// The store is unreachable but the identity is known: taken locally,
    /// the value key is written by a later pass.
    Deferred { id: u32, error: BackendError },
}

/// Label sets → identities for one node.
pub struct IdentityAllocator {
    backend: Arc<dyn IdentityBackend>,
    opts: AllocatorOptions,
    cache: RwLock<Cache>,
    /// Lock order: `local`, then `released`, then `unpublished`.
    local: Mutex<HashMap<String, LocalRef>>,
    /// Sets no longer held whose value key of this node may still be in
    /// the store: deleted at once or by the next pass. An allocation takes
    /// its set out before it writes, so a pass that deleted a key while an
    /// allocation re-took the set notices and writes it again.
    released: Mutex<HashSet<String>>,
    /// Held sets whose value key the store may lack (taken while it was
    /// unreachable): written by the next pass.
    unpublished: Mutex<HashSet<String>>,
    ready: watch::Sender<bool>,
    changes: broadcast::Sender<RevisedChange>,
    /// The last error of listing or watching the store; cleared by the
    /// next successful listing.
    store_error: Mutex<Option<String>>,
    /// The last reconcile pass's error, `None` after a pass that succeeded.
    pass_error: Mutex<Option<String>>,
    /// Wakes the reconcile controller for a pass now.
    reconcile: Trigger,
    /// One reconcile pass at a time.
    pass: tokio::sync::Mutex<()>,
    started: Instant,
    /// What is served while the store was not listed since a restore.
    restored_from: Mutex<Option<String>>,
    /// The owners of the previous run's references by label set, from the
    /// restored snapshot (`None` without one). Taken after every other lock
    /// (`replay_ended` before it).
    restored_owners: Mutex<Option<HashMap<String, BTreeSet<String>>>>,
    /// Owner prefixes of the clients that ended their replay to this process.
    replay_ended: Mutex<BTreeSet<String>>,
    /// Its part of the local snapshot: changes and store revision.
    snapshot_part: SnapshotPart,
}

impl std::fmt::Debug for IdentityAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdentityAllocator")
            .field("backend", &self.backend.kind())
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl IdentityAllocator {
    /// An allocator over `backend`; call [`run`](Self::run) to keep its
    /// cache current and its keys in place.
    pub fn new(backend: Arc<dyn IdentityBackend>, opts: AllocatorOptions) -> Arc<Self> {
        let (ready, _) = watch::channel(false);
        let (changes, _) = broadcast::channel(4096);
        Arc::new(Self {
            backend,
            opts,
            cache: RwLock::new(Cache::default()),
            local: Mutex::new(HashMap::new()),
            released: Mutex::new(HashSet::new()),
            unpublished: Mutex::new(HashSet::new()),
            ready,
            changes,
            store_error: Mutex::new(None),
            pass_error: Mutex::new(None),
            reconcile: Trigger::new(),
            pass: tokio::sync::Mutex::new(()),
            started: Instant::now(),
            restored_from: Mutex::new(None),
            restored_owners: Mutex::new(None),
            replay_ended: Mutex::new(BTreeSet::new()),
            snapshot_part: SnapshotPart::default(),
        })
    }

    /// Changes whenever what [`snapshot`](Self::snapshot) returns changed.
    pub fn state_changes(&self) -> watch::Receiver<u64> {
        self.snapshot_part.changes()
    }

    /// The store revision of the last listing (of the restored snapshot's
    /// until the store is listed); 0 before either.
    pub fn store_revision(&self) -> Revision {
        self.snapshot_part.store_revision()
    }

    /// What a restart needs to serve without the store: the cache and the
    /// sets whose value key awaits deletion.
    pub fn snapshot(&self) -> IdentitySnapshot {
        let identities = self.cache.read().expect("cache poisoned").records();
        let mut released: Vec<String> = self
            .released
            .lock()
            .expect("released poisoned")
            .iter()
            .cloned()
            .collect();
        released.sort();
        let held = self
            .local
            .lock()
            .expect("local refs poisoned")
            .iter()
            .map(|(key, r)| {
                let mut owners: Vec<String> = r.owners.iter().cloned().collect();
                if r.anonymous > 0 {
                    owners.push(String::new());
                }
                owners.sort();
                (key.clone(), owners)
            })
            .collect();
        IdentitySnapshot {
            store_revision: self.store_revision(),
            identities,
            released,
            held: Some(held),
        }
    }

    /// Serves `snapshot` until the store is listed: the cache is filled and
    /// ready, the released sets' value keys are deleted by the first pass,
    /// and the store counts as not answering (`store_error` says
    /// `origin`) until the watcher lists it. Call before [`run`](Self::run).
    pub fn restore(&self, snapshot: IdentitySnapshot, origin: &str) {
        self.replace_cache(snapshot.identities);
        self.released
            .lock()
            .expect("released poisoned")
            .extend(snapshot.released);
        *self.restored_owners.lock().expect("restored owners poisoned") = snapshot.held.map(|held| {
            held.into_iter()
                .map(|(key, owners)| (key, owners.into_iter().collect()))
                .collect()
        });
        self.snapshot_part.set_store_revision(snapshot.store_revision);
        *self.restored_from.lock().expect("restored_from poisoned") = Some(origin.to_string());
        self.ready.send_replace(true);
    }

    /// The store's kind (`etcd`, `embedded`).
    pub fn backend_kind(&self) -> &'static str {
        self.backend.kind()
    }

    /// The store's lease for this node's keys (0 without one).
    pub fn lease_id(&self) -> i64 {
        self.backend.lease_id()
    }

    /// The cache watcher's last store error, `None` while it is in sync;
    /// until the first listing after a restore, what is served says so.
    pub fn store_error(&self) -> Option<String> {
        let error = self.store_error.lock().expect("store error poisoned").clone();
        let restored = self.restored_from.lock().expect("restored_from poisoned").clone();
        match (restored, error) {
            (Some(origin), Some(error)) => Some(format!("{origin}; {error}")),
            (origin, error) => origin.or(error),
        }
    }

    fn set_store_error(&self, error: Option<String>) {
        *self.store_error.lock().expect("store error poisoned") = error;
    }

    /// Whether the store answered the cache watcher last (so a write is
    /// worth trying now rather than leaving it to the next pass).
    fn store_answers(&self) -> bool {
        self.is_ready() && self.store_error().is_none()
    }

    /// Why the last reconcile pass failed, `None` when it succeeded.
    pub fn reconcile_error(&self) -> Option<String> {
        self.pass_error.lock().expect("pass error poisoned").clone()
    }

    /// This node's value keys not yet as desired in the store: sets to
    /// write and sets to delete. 0 once a pass reconciled everything.
    pub fn pending_writes(&self) -> usize {
        self.released.lock().expect("released poisoned").len()
            + self.unpublished.lock().expect("unpublished poisoned").len()
    }

    /// Starts the cache watcher (`identity-watch`), the reconcile passes
    /// (`identity-value-keys`) and their wake-up on a replaced node lease
    /// (`identity-lease-renewals`) under `controllers`.
    pub fn run(self: &Arc<Self>, controllers: &Controllers) {
        let this = self.clone();
        let watch =
            Controller::new("identity-watch").backoff(Backoff::new(Duration::from_millis(100), Duration::from_secs(5)));
        controllers.supervise(watch, move |progress| this.clone().watch(progress));
        let this = self.clone();
        reconcile::start(
            controllers,
            "identity-value-keys",
            ReconciledKeys::ValueKeys,
            &self.opts.metrics,
            &self.reconcile,
            move || this.clone().reconcile_pass_and_record(),
        );
        let trigger = self.reconcile.clone();
        reconcile::on_lease_renewed(controllers, "identity-lease-renewals", &self.backend, move || {
            tracing::info!("lease renewed; re-creating this node's keys");
            trigger.trigger();
        });
    }

    /// Waits until the first listing of the store completed.
    pub async fn wait_ready(&self) {
        let mut rx = self.ready.subscribe();
        let _ = rx.wait_for(|r| *r).await;
    }

    /// Whether the first listing completed.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Filters `labels` to the identity-relevant ones and checks them.
    pub fn identity_labels(&self, labels: &Labels) -> Result<Labels, AllocError> {
        let filtered = self.opts.filter.filter(labels);
        if let Some(l) = filtered.iter().find(|l| l.source() == LabelSource::Cidr) {
            return Err(InvalidLabels::Cidr { label: l.to_string() }.into());
        }
        let reserved = filtered.iter().filter(|l| l.source() == LabelSource::Reserved).count();
        if reserved > 1 {
            return Err(InvalidLabels::SeveralReserved { labels: filtered }.into());
        }
        if filtered.is_empty() {
            return Err(InvalidLabels::NoneRelevant.into());
        }
        Ok(filtered)
    }

    /// Allocates (or finds) the identity of `labels` and takes a local
    /// reference; with `owner` the reference is idempotent per owner.
    pub async fn allocate(&self, labels: &Labels, owner: Option<&str>) -> Result<Allocated, AllocError> {
        let labels = self.identity_labels(labels)?;
        if let Some(r) = ReservedIdentity::from_labels(&labels) {
            return Ok(Allocated {
                id: r.id(),
                labels: r.labels(),
                kind: IdentityKind::Reserved,
                newly_allocated: false,
                references: 0,
            });
        }
        let key = labels.to_string();
        // Held locally: no store round trip (and works while it is down).
        if let Some(references) = self.reference_local(&key, owner) {
            let id = self.local.lock().expect("local refs poisoned")[&key].id;
            return Ok(Allocated {
                id,
                labels,
                kind: IdentityKind::Cluster,
                newly_allocated: false,
                references,
            });
        }
        // Taken out before the store is written: a pass deleting the value
        // key meanwhile writes it again (see `delete_released`).
        if self.released.lock().expect("released poisoned").remove(&key) {
            self.snapshot_part.changed();
        }
        let (id, newly_allocated) = match self.allocate_in_store(&key).await? {
            StoreAllocation::Published { id, newly_allocated } => (id, newly_allocated),
            StoreAllocation::Deferred { id, error } => {
                self.unpublished
                    .lock()
                    .expect("unpublished poisoned")
                    .insert(key.clone());
                events::allocation_served_locally(&self.opts.metrics, id, &key, &error);
                (id, false)
            }
        };
        let references = {
            let mut local = self.local.lock().expect("local refs poisoned");
            let entry = local.entry(key.clone()).or_insert_with(|| LocalRef {
                id,
                ..LocalRef::default()
            });
            match owner {
                Some(o) => {
                    entry.owners.insert(o.to_string());
                }
                None => entry.anonymous += 1,
            }
            entry.count()
        };
        // The snapshot's owners changed.
        self.snapshot_part.changed();
        self.apply_upsert(IdentityRecord {
            id,
            labels: key.clone(),
        });
        if newly_allocated {
            tracing::info!(id, labels = %key, "identity allocated");
        }
        Ok(Allocated {
            id,
            labels,
            kind: IdentityKind::Cluster,
            newly_allocated,
            references,
        })
    }

    fn reference_local(&self, key: &str, owner: Option<&str>) -> Option<u64> {
        let mut local = self.local.lock().expect("local refs poisoned");
        let entry = local.get_mut(key)?;
        let new_owner = match owner {
            Some(o) => entry.owners.insert(o.to_string()),
            None => {
                entry.anonymous += 1;
                entry.anonymous == 1
            }
        };
        let count = entry.count();
        drop(local);
        if new_owner {
            self.snapshot_part.changed();
        }
        Some(count)
    }

    async fn allocate_in_store(&self, key: &str) -> Result<StoreAllocation, AllocError> {
        // Only an unreachable store is worth a retry; a refusal says why.
        let unavailable = |source| match source {
            BackendError::Unavailable { .. } => AllocError::Unavailable {
                labels: key.to_string(),
                source,
            },
            source => AllocError::Store {
                labels: key.to_string(),
                source,
            },
        };
        // Known in the cluster: take a reference on it (locally when the
        // store does not answer). Unknown to the cache: go straight to the
        // creating transaction, which fails with the holder's id when
        // another node holds the labels (one round trip).
        let known = self.cache.read().expect("cache poisoned").by_labels.get(key).copied();
        if let Some(id) = known {
            if !self.store_answers() {
                let error = BackendError::Unavailable {
                    action: format!("acquiring identity {id} for {key}"),
                    detail: self
                        .store_error()
                        .unwrap_or_else(|| "the store was never listed".into()),
                };
                return Ok(StoreAllocation::Deferred { id, error });
            }
            match self.backend.acquire(id, key).await {
                Ok(AcquireOutcome::Acquired | AcquireOutcome::MasterRecreated) => {
                    return Ok(StoreAllocation::Published {
                        id,
                        newly_allocated: false,
                    });
                }
                Ok(AcquireOutcome::Conflict) => {}
                Err(error @ BackendError::Unavailable { .. }) => return Ok(StoreAllocation::Deferred { id, error }),
                Err(e) => {
                    return Err(AllocError::Store {
                        labels: key.to_string(),
                        source: e,
                    });
                }
            }
        }
        let mut backoff = Backoff::new(Duration::from_millis(5), Duration::from_millis(200));
        let mut tried = HashSet::new();
        let probing = self.backend.id_order() == IdOrder::LabelHash;
        let mut attempts = 0;
        while attempts < MAX_ATTEMPTS {
            let id = self.free_id(key, &tried)?;
            tried.insert(id);
            match self.backend.create_identity(id, key).await.map_err(unavailable)? {
                CreateOutcome::Created => {
                    return Ok(StoreAllocation::Published {
                        id,
                        newly_allocated: true,
                    });
                }
                CreateOutcome::LabelsHeldAs(existing) => {
                    match self.backend.acquire(existing, key).await.map_err(unavailable)? {
                        AcquireOutcome::Acquired | AcquireOutcome::MasterRecreated => {
                            return Ok(StoreAllocation::Published {
                                id: existing,
                                newly_allocated: false,
                            });
                        }
                        AcquireOutcome::Conflict => {}
                    }
                }
                // Probing in label-hash order, a taken id is the next step
                // of the walk, not contention: on at once (the walk ends at
                // a free id or with `Exhausted`).
                CreateOutcome::IdTaken if probing => continue,
                CreateOutcome::IdTaken => {}
            }
            attempts += 1;
            tokio::time::sleep(backoff.next_delay()).await;
        }
        Err(AllocError::Contention {
            labels: key.to_string(),
            attempts: MAX_ATTEMPTS,
        })
    }

    /// The first id of the range, in the backend's [`IdOrder`] for `key`,
    /// that the cache does not know as taken and was not tried.
    fn free_id(&self, key: &str, tried: &HashSet<u32>) -> Result<u32, AllocError> {
        let cache = self.cache.read().expect("cache poisoned");
        let (min, max) = (self.opts.min_id, self.opts.max_id);
        let size = (max - min + 1) as usize;
        if cache.by_id.range(min..=max).count() + tried.len() >= size {
            return Err(AllocError::Exhausted { min, max });
        }
        // The watch may have brought this set's own id since the caller
        // looked it up: offer that id (its create answers `LabelsHeldAs`),
        // or the walk below would skip it as taken and give the set a
        // second identity (two nodes racing on one set in CRD mode did).
        if let Some(&id) = cache.by_labels.get(key)
            && !tried.contains(&id)
        {
            return Ok(id);
        }
        let start = match self.backend.id_order() {
            // A random start spreads concurrent nodes over the range.
            IdOrder::Random => rand::rng().random_range(min..=max),
            // The same start on every node (see `IdOrder::LabelHash`).
            IdOrder::LabelHash => label_hash_id(key, min, max),
        };
        (start..=max)
            .chain(min..start)
            .find(|id| !cache.by_id.contains_key(id) && !tried.contains(id))
            .ok_or(AllocError::Exhausted { min, max })
    }

    /// Drops a local reference on `id` (one anonymous one, or `owner`'s).
    /// The last one deletes this node's value key: now while the store
    /// answers, else by the pass after it is back. Returns the references
    /// left, or `None` when the node held none.
    pub async fn release(&self, id: u32, owner: Option<&str>) -> Option<u64> {
        if ReservedIdentity::from_id(id).is_some() {
            return None;
        }
        let (key, left) = {
            let mut local = self.local.lock().expect("local refs poisoned");
            let (key, entry) = local.iter_mut().find(|(_, r)| r.id == id)?;
            let dropped = match owner {
                Some(o) => entry.owners.remove(o),
                None if entry.anonymous > 0 => {
                    entry.anonymous -= 1;
                    true
                }
                None => false,
            };
            if !dropped {
                return Some(entry.count());
            }
            // The snapshot's owners changed.
            self.snapshot_part.changed();
            let (key, left) = (key.clone(), entry.count());
            if left == 0 {
                local.remove(&key);
                self.released.lock().expect("released poisoned").insert(key.clone());
                self.unpublished.lock().expect("unpublished poisoned").remove(&key);
            }
            (key, left)
        };
        if left == 0 {
            self.snapshot_part.changed();
            if !self.store_answers() {
                tracing::info!(id, labels = %key, "last local reference released; the kvstore is unreachable, its value key is deleted when it is back");
            } else if let Err(e) = self.delete_released(&key).await {
                tracing::warn!(id, labels = %key, error = %e, "deleting the released value key failed; the next pass retries");
                self.reconcile.trigger();
            } else {
                tracing::info!(id, labels = %key, "last local reference released");
            }
        }
        Some(left)
    }

    /// Deletes this node's value key of a released set, unless the set was
    /// allocated again meanwhile; an allocation racing the delete (it took
    /// the set out of `released` first) gets its key written again. Returns
    /// whether it deleted the key.
    async fn delete_released(&self, key: &str) -> Result<bool, BackendError> {
        {
            let local = self.local.lock().expect("local refs poisoned");
            let released = self.released.lock().expect("released poisoned");
            if local.contains_key(key) || !released.contains(key) {
                return Ok(false);
            }
        }
        self.backend.release(key).await?;
        let retaken = !self.released.lock().expect("released poisoned").remove(key);
        self.snapshot_part.changed();
        if retaken {
            let held = self.local.lock().expect("local refs poisoned").get(key).map(|r| r.id);
            if let Some(id) = held {
                self.unpublished
                    .lock()
                    .expect("unpublished poisoned")
                    .insert(key.to_string());
                self.backend.acquire(id, key).await?;
                self.unpublished.lock().expect("unpublished poisoned").remove(key);
            }
        }
        Ok(!retaken)
    }

    /// Whether this node holds `key` under `id`.
    fn holds(&self, key: &str, id: u32) -> bool {
        self.local
            .lock()
            .expect("local refs poisoned")
            .get(key)
            .is_some_and(|r| r.id == id)
    }

    /// Ends the replay of the client whose owners all start with
    /// `owner_prefix` (non-empty): this node's value keys of the previous run
    /// that no reference backs now and whose references were all that
    /// client's by the restored snapshot are deleted by a pass started now
    /// (see the module docs); so are keys the snapshot does not know when
    /// every owner it recorded was that client's. Returns how many label
    /// sets of the snapshot this releases. Idempotent; a later claim is an
    /// ordinary allocation.
    pub fn end_replay(&self, owner_prefix: &str) -> usize {
        self.replay_ended
            .lock()
            .expect("replay ends poisoned")
            .insert(owner_prefix.to_string());
        let restored: Vec<String> = self
            .restored_owners
            .lock()
            .expect("restored owners poisoned")
            .as_ref()
            .map(|r| r.keys().cloned().collect())
            .unwrap_or_default();
        let local = self.local.lock().expect("local refs poisoned");
        let released = restored
            .iter()
            .filter(|k| !local.contains_key(*k) && self.replay_released(k))
            .count();
        drop(local);
        self.reconcile.trigger();
        released
    }

    /// Whether the clients that ended their replay held every reference the
    /// previous run had on `key` (by the restored snapshot; a key it does
    /// not know counts as theirs when every owner it recorded was theirs).
    fn replay_released(&self, key: &str) -> bool {
        let ended = self.replay_ended.lock().expect("replay ends poisoned");
        if ended.is_empty() {
            return false;
        }
        // Anonymous references (`""`) belong to no client that can end.
        let theirs = |owner: &String| ended.iter().any(|p| owner.starts_with(p.as_str()));
        let restored = self.restored_owners.lock().expect("restored owners poisoned");
        let Some(restored) = restored.as_ref() else {
            return false;
        };
        match restored.get(key) {
            Some(owners) => owners.iter().all(theirs),
            None => restored.values().flatten().all(theirs),
        }
    }

    /// Drops every reference `owner` holds; returns the ids released.
    pub async fn release_owner(&self, owner: &str) -> Vec<u32> {
        let ids: Vec<u32> = self
            .local
            .lock()
            .expect("local refs poisoned")
            .values()
            .filter(|r| r.owners.contains(owner))
            .map(|r| r.id)
            .collect();
        for id in &ids {
            self.release(*id, Some(owner)).await;
        }
        ids
    }

    /// The labels of an identity (reserved or cluster), from the cache.
    pub fn get(&self, id: u32) -> Option<(Labels, IdentityKind)> {
        if let Some(r) = ReservedIdentity::from_id(id) {
            return Some((r.labels(), IdentityKind::Reserved));
        }
        let labels = self.cache.read().expect("cache poisoned").by_id.get(&id)?.clone();
        Some((labels.parse().ok()?, IdentityKind::Cluster))
    }

    /// The identity of a label set without referencing it.
    pub fn lookup(&self, labels: &Labels) -> Result<Option<u32>, AllocError> {
        let labels = self.identity_labels(labels)?;
        if let Some(r) = ReservedIdentity::from_labels(&labels) {
            return Ok(Some(r.id()));
        }
        Ok(self
            .cache
            .read()
            .expect("cache poisoned")
            .by_labels
            .get(labels.to_string().as_str())
            .copied())
    }

    /// Local references on an identity.
    pub fn references(&self, id: u32) -> u64 {
        self.local
            .lock()
            .expect("local refs poisoned")
            .values()
            .find(|r| r.id == id)
            .map_or(0, LocalRef::count)
    }

    /// The owners holding local references on an identity, sorted
    /// (anonymous references have none).
    pub fn owners(&self, id: u32) -> Vec<String> {
        let mut owners: Vec<String> = self
            .local
            .lock()
            .expect("local refs poisoned")
            .values()
            .filter(|r| r.id == id)
            .flat_map(|r| r.owners.iter().cloned())
            .collect();
        owners.sort();
        owners
    }

    /// Every cluster identity the cache holds.
    pub fn list(&self) -> Vec<IdentityRecord> {
        self.list_at().0
    }

    /// Every cluster identity the cache holds, and the cache revision that is.
    pub fn list_at(&self) -> (Vec<IdentityRecord>, u64) {
        let cache = self.cache.read().expect("cache poisoned");
        (cache.records(), cache.revision)
    }

    /// A snapshot of every identity at a cache revision, plus a receiver of
    /// the later changes (each with the revision it made). Changes are sent
    /// under the cache's write lock and this subscribes under its read lock,
    /// so the receiver starts exactly after the snapshot.
    pub fn subscribe(&self) -> (Vec<IdentityRecord>, u64, broadcast::Receiver<RevisedChange>) {
        let cache = self.cache.read().expect("cache poisoned");
        let rx = self.changes.subscribe();
        (cache.records(), cache.revision, rx)
    }

    /// Keeps the cache equal to the store: list, watch, re-list on error.
    /// Lists the store into the cache and follows its watch until the
    /// stream fails or ends (its controller then lists again, with backoff).
    async fn watch(self: Arc<Self>, progress: Progress) -> Result<(), BackendError> {
        let result = self.list_and_watch(&progress).await;
        if let Err(e) = &result {
            self.set_store_error(Some(e.to_string()));
        }
        result
    }

    async fn list_and_watch(&self, progress: &Progress) -> Result<(), BackendError> {
        let (records, revision) = self.backend.list_identities().await?;
        let recovered = self.store_error().is_some();
        self.snapshot_part.set_store_revision(revision);
        self.replace_cache(records);
        self.restored_from.lock().expect("restored_from poisoned").take();
        self.set_store_error(None);
        self.ready.send_replace(true);
        progress.ok();
        if recovered {
            tracing::info!("the identity store answers again; reconciling this node's value keys");
            self.reconcile.trigger();
        }
        let mut stream = self.backend.watch_identities(revision).await?;
        while let Some(event) = stream.next().await {
            match event? {
                IdentityEvent::Upsert(r) => self.apply_upsert(r),
                IdentityEvent::Delete { id } => self.apply_delete(id),
            }
        }
        Ok(())
    }

    fn apply_upsert(&self, r: IdentityRecord) {
        let mut cache = self.cache.write().expect("cache poisoned");
        if cache.insert(r.id, r.labels.clone()) {
            let _ = self.changes.send((cache.revision, IdentityChange::Upsert(r)));
            drop(cache);
            self.snapshot_part.changed();
        }
    }

    fn apply_delete(&self, id: u32) {
        let mut cache = self.cache.write().expect("cache poisoned");
        if cache.remove(id) {
            let _ = self.changes.send((cache.revision, IdentityChange::Delete(id)));
            drop(cache);
            self.snapshot_part.changed();
        }
    }

    fn replace_cache(&self, records: Vec<IdentityRecord>) {
        let fresh: BTreeMap<u32, String> = records.into_iter().map(|r| (r.id, r.labels)).collect();
        let gone: Vec<u32> = {
            let cache = self.cache.read().expect("cache poisoned");
            cache
                .by_id
                .keys()
                .filter(|id| !fresh.contains_key(id))
                .copied()
                .collect()
        };
        for id in gone {
            self.apply_delete(id);
        }
        for (id, labels) in fresh {
            self.apply_upsert(IdentityRecord { id, labels });
        }
    }

    /// A pass, its error kept for [`reconcile_error`](Self::reconcile_error);
    /// the next one in a resync interval.
    async fn reconcile_pass_and_record(self: Arc<Self>) -> Result<Duration, BackendError> {
        // Every pass writes every held key: nothing to learn from the wake.
        let result = self.reconcile_once().await;
        *self.pass_error.lock().expect("pass error poisoned") = result
            .as_ref()
            .err()
            .map(|e| format!("reconciling this node's value keys: {e}"));
        result.map(|()| self.opts.resync_interval)
    }

    /// One pass (never two at once): every held identity has its value key
    /// (and master key), and this node's value keys that nothing holds are
    /// deleted (see the module docs). Idempotent; the first store error is
    /// returned after the rest was tried.
    pub async fn reconcile_once(&self) -> Result<(), BackendError> {
        let _pass = self.pass.lock().await;
        let mut counts = PassCounts::default();
        let result = self.reconcile_pass(&mut counts).await;
        let m = &self.opts.metrics;
        events::keys_reconciled(m, StoreKey::Value, KeyAction::Created, counts.value_created);
        events::keys_reconciled(m, StoreKey::Master, KeyAction::Created, counts.master_created);
        events::keys_reconciled(m, StoreKey::Value, KeyAction::Deleted, counts.value_deleted);
        result
    }

    /// The body of [`reconcile_once`](Self::reconcile_once), counting what it
    /// changed in `counts` (also when it fails midway).
    async fn reconcile_pass(&self, counts: &mut PassCounts) -> Result<(), BackendError> {
        let mut first_error = None;
        // Taken while the store was away: their keys are written now.
        let pending: HashSet<String> = self.unpublished.lock().expect("unpublished poisoned").clone();
        let held: Vec<(String, u32)> = self
            .local
            .lock()
            .expect("local refs poisoned")
            .iter()
            .map(|(k, r)| (k.clone(), r.id))
            .collect();
        for (key, id) in held {
            if !self.holds(&key, id) {
                continue; // Released since: nothing to write.
            }
            match self.backend.acquire(id, &key).await {
                Ok(AcquireOutcome::Acquired) => counts.value_created += usize::from(pending.contains(&key)),
                Ok(AcquireOutcome::MasterRecreated) => {
                    tracing::warn!(id, labels = %key, "master key had vanished; re-created with the same id");
                    counts.master_created += 1;
                    counts.value_created += usize::from(pending.contains(&key));
                }
                Ok(AcquireOutcome::Conflict) => tracing::error!(
                    id,
                    labels = %key,
                    "identity now names other labels in the store; local endpoints keep the old id until re-allocated"
                ),
                // Unreachable: the rest would wait as long; the next pass
                // (when the store is back) does it.
                Err(e @ BackendError::Unavailable { .. }) => return Err(e),
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            }
            self.unpublished.lock().expect("unpublished poisoned").remove(&key);
            // Released while its key was written (the release's delete may
            // have come first): the key goes with the stale ones below.
            let local = self.local.lock().expect("local refs poisoned");
            if !local.contains_key(&key) {
                self.released.lock().expect("released poisoned").insert(key.clone());
            }
        }
        let listed = match self.backend.node_value_keys().await {
            Ok(listed) => listed,
            Err(e) => return Err(first_error.unwrap_or(e)),
        };
        let grace_over = self.started.elapsed() >= self.opts.restore_grace;
        let (stale, released_changed) = {
            let local = self.local.lock().expect("local refs poisoned");
            let mut released = self.released.lock().expect("released poisoned");
            let before = released.clone();
            let listed: HashSet<&String> = listed.iter().collect();
            // Released sets whose key is gone already need nothing more.
            released.retain(|k| listed.contains(k));
            // A previous run's key goes when its clients ended their replay
            // without it, else when the grace ends.
            let stale: Vec<(String, Option<RestoredCause>)> = listed
                .into_iter()
                .filter(|k| !local.contains_key(*k))
                .filter_map(|k| {
                    if released.contains(k) {
                        Some((k.clone(), None))
                    } else if self.replay_released(k) {
                        Some((k.clone(), Some(RestoredCause::ReplayEnded)))
                    } else {
                        grace_over.then(|| (k.clone(), Some(RestoredCause::GraceEnded)))
                    }
                })
                .collect();
            released.extend(stale.iter().map(|(k, _)| k.clone()));
            (stale, *released != before)
        };
        if released_changed {
            self.snapshot_part.changed();
        }
        let (mut by_replay, mut by_grace) = (0, 0);
        for (key, cause) in stale {
            match self.delete_released(&key).await {
                Ok(deleted) => {
                    counts.value_deleted += usize::from(deleted);
                    match cause {
                        Some(RestoredCause::ReplayEnded) => by_replay += usize::from(deleted),
                        Some(RestoredCause::GraceEnded) => by_grace += usize::from(deleted),
                        None => {}
                    }
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let m = &self.opts.metrics;
        events::restored_released(m, RestoredKind::ValueKeys, RestoredCause::ReplayEnded, by_replay);
        events::restored_released(m, RestoredKind::ValueKeys, RestoredCause::GraceEnded, by_grace);
        first_error.map_or(Ok(()), Err)
    }
}

/// The id `labels` starts at with [`IdOrder::LabelHash`]: the first 8
/// bytes of their SHA-256 modulo the range (stable across nodes and versions).
fn label_hash_id(labels: &str, min: u32, max: u32) -> u32 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(labels.as_bytes());
    let hash = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
    min + (hash % (u64::from(max - min) + 1)) as u32
}

/// What one reconcile pass changed in the store.
#[derive(Debug, Default)]
struct PassCounts {
    /// Value keys of sets taken while the store was away, written.
    value_created: usize,
    /// Vanished master keys re-created.
    master_created: usize,
    /// Value keys of this node nothing holds, deleted.
    value_deleted: usize,
}

#[cfg(test)]
mod tests {
    use tokio::sync::Notify;

    use super::*;
    use crate::embedded_backend::EmbeddedBackend;

    fn labels(s: &str) -> Labels {
        s.parse().expect("valid labels")
    }

    /// An allocator over an embedded store, running under the returned
    /// controllers (dropping them stops it).
    async fn allocator(dir: &std::path::Path, max_id: u32) -> (Arc<IdentityAllocator>, Controllers) {
        let backend = EmbeddedBackend::open(dir.join("store.json"), "node-1").expect("embedded store opens");
        let a = IdentityAllocator::new(
            Arc::new(backend),
            AllocatorOptions {
                max_id,
                ..AllocatorOptions::default()
            },
        );
        let controllers = Controllers::new();
        a.run(&controllers);
        a.wait_ready().await;
        (a, controllers)
    }

    #[tokio::test]
    async fn references_are_counted_and_owners_are_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _controllers) = allocator(dir.path(), DEFAULT_MAX_CLUSTER_IDENTITY).await;
        let web = labels("k8s:app=web");
        let first = a.allocate(&web, None).await.unwrap();
        assert!(first.newly_allocated);
        assert!(first.id >= CLUSTER_IDENTITY_MIN);
        let second = a.allocate(&web, None).await.unwrap();
        assert_eq!(second.id, first.id, "the same label set is one identity");
        assert!(!second.newly_allocated);
        a.allocate(&web, Some("endpoint/1")).await.unwrap();
        let again = a.allocate(&web, Some("endpoint/1")).await.unwrap();
        assert_eq!(
            again.references, 3,
            "an owner holds one reference however often it asks"
        );
        a.allocate(&web, Some("endpoint/2")).await.unwrap();
        assert_eq!(
            a.owners(first.id),
            ["endpoint/1", "endpoint/2"],
            "owners are listed (anonymous references have none)"
        );
        assert_eq!(a.release(first.id, Some("endpoint/2")).await, Some(3));
        assert_eq!(a.release(first.id, None).await, Some(2));
        assert_eq!(a.release(first.id, Some("endpoint/1")).await, Some(1));
        assert_eq!(
            a.release(first.id, Some("endpoint/1")).await,
            Some(1),
            "releasing twice is a no-op"
        );
        assert_eq!(
            a.release(first.id, None).await,
            Some(0),
            "the last release drops the node's reference"
        );
        assert_eq!(a.references(first.id), 0);
        assert_eq!(
            a.lookup(&web).unwrap(),
            Some(first.id),
            "the master key stays for the operator's GC"
        );
        let back = a.allocate(&web, None).await.unwrap();
        assert_eq!(
            back.id, first.id,
            "a released set gets its id back while the master key exists"
        );
    }

    #[tokio::test]
    async fn reserved_filtered_and_invalid_labels() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _controllers) = allocator(dir.path(), DEFAULT_MAX_CLUSTER_IDENTITY).await;
        let host = a.allocate(&labels("reserved:host"), None).await.unwrap();
        assert_eq!(
            (host.id, host.kind),
            (1, IdentityKind::Reserved),
            "reserved identities skip the store"
        );
        assert!(a.list().is_empty(), "a reserved identity is never stored");
        let x = a
            .allocate(&labels("k8s:app=web,k8s:pod-template-hash=abc"), None)
            .await
            .unwrap();
        let y = a
            .allocate(&labels("k8s:app=web,k8s:pod-template-hash=def"), None)
            .await
            .unwrap();
        assert_eq!(x.id, y.id, "high-cardinality labels are not identity-relevant");
        assert_eq!(x.labels.to_string(), "k8s:app=web");
        assert!(matches!(
            a.allocate(&labels("cidr:198.18.0.0/24"), None).await,
            Err(AllocError::InvalidLabels(InvalidLabels::Cidr { .. }))
        ));
        assert!(matches!(
            a.allocate(&labels("reserved:host,reserved:world"), None).await,
            Err(AllocError::InvalidLabels(InvalidLabels::SeveralReserved { .. }))
        ));
    }

    #[tokio::test]
    async fn exhaustion_is_reported_with_the_range() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _controllers) = allocator(dir.path(), CLUSTER_IDENTITY_MIN + 2).await;
        let mut ids = BTreeMap::new();
        for i in 0..3 {
            let got = a.allocate(&labels(&format!("k8s:app=a{i}")), None).await.unwrap();
            assert!(ids.insert(got.id, i).is_none(), "no id is handed out twice");
        }
        let err = a.allocate(&labels("k8s:app=one-too-many"), None).await.unwrap_err();
        assert!(matches!(err, AllocError::Exhausted { min: 256, max: 258 }), "{err}");
    }

    #[tokio::test]
    async fn identities_survive_a_restart_of_the_embedded_store() {
        let dir = tempfile::tempdir().unwrap();
        let id = {
            let (a, _controllers) = allocator(dir.path(), DEFAULT_MAX_CLUSTER_IDENTITY).await;
            a.allocate(&labels("k8s:app=db"), None).await.unwrap().id
        };
        let (a, _controllers) = allocator(dir.path(), DEFAULT_MAX_CLUSTER_IDENTITY).await;
        assert_eq!(
            a.lookup(&labels("k8s:app=db")).unwrap(),
            Some(id),
            "the cache is rebuilt from the store"
        );
        assert_eq!(a.allocate(&labels("k8s:app=db"), None).await.unwrap().id, id);
    }

    /// The embedded store, with `acquire` of one label set held until the
    /// test lets it go (a pass slow on that set).
    struct GatedAcquire {
        inner: EmbeddedBackend,
        labels: String,
        reached: Notify,
        go: Notify,
    }

    #[tonic::async_trait]
    impl IdentityBackend for GatedAcquire {
        fn kind(&self) -> &'static str {
            self.inner.kind()
        }
        async fn list_identities(&self) -> Result<(Vec<IdentityRecord>, crate::backend::Revision), BackendError> {
            self.inner.list_identities().await
        }
        async fn watch_identities(
            &self,
            after: crate::backend::Revision,
        ) -> Result<futures::stream::BoxStream<'static, Result<IdentityEvent, BackendError>>, BackendError> {
            self.inner.watch_identities(after).await
        }
        async fn held_id(&self, labels: &str) -> Result<Option<u32>, BackendError> {
            self.inner.held_id(labels).await
        }
        async fn create_identity(&self, id: u32, labels: &str) -> Result<CreateOutcome, BackendError> {
            self.inner.create_identity(id, labels).await
        }
        async fn acquire(&self, id: u32, labels: &str) -> Result<AcquireOutcome, BackendError> {
            if labels == self.labels {
                self.reached.notify_one();
                self.go.notified().await;
            }
            self.inner.acquire(id, labels).await
        }
        async fn release(&self, labels: &str) -> Result<(), BackendError> {
            self.inner.release(labels).await
        }
        async fn node_value_keys(&self) -> Result<Vec<String>, BackendError> {
            self.inner.node_value_keys().await
        }
        async fn upsert_ip(&self, entry: &crate::backend::IpEntry) -> Result<(), BackendError> {
            self.inner.upsert_ip(entry).await
        }
        async fn delete_ip(&self, ip: &str) -> Result<(), BackendError> {
            self.inner.delete_ip(ip).await
        }
        async fn list_ips(&self) -> Result<(Vec<crate::backend::IpEntry>, crate::backend::Revision), BackendError> {
            self.inner.list_ips().await
        }
        async fn watch_ips(
            &self,
            after: crate::backend::Revision,
        ) -> Result<futures::stream::BoxStream<'static, Result<crate::backend::IpEvent, BackendError>>, BackendError>
        {
            self.inner.watch_ips(after).await
        }
        async fn lease_renewed(&self, seen: &mut u64) {
            self.inner.lease_renewed(seen).await;
        }
    }

    #[tokio::test]
    async fn a_set_released_while_a_pass_writes_its_key_loses_the_key_in_that_pass() {
        let dir = tempfile::tempdir().unwrap();
        let web = labels("k8s:app=web");
        let backend = Arc::new(GatedAcquire {
            inner: EmbeddedBackend::open(dir.path().join("store.json"), "node-1").unwrap(),
            labels: web.to_string(),
            reached: Notify::new(),
            go: Notify::new(),
        });
        let a = IdentityAllocator::new(backend.clone(), AllocatorOptions::default());
        let controllers = Controllers::new();
        a.run(&controllers);
        a.wait_ready().await;
        let id = a.allocate(&web, Some("endpoint/1")).await.unwrap().id;
        // A pass took the set as held and is writing its value key...
        let pass = tokio::spawn({
            let a = a.clone();
            async move { a.reconcile_once().await }
        });
        backend.reached.notified().await;
        // ...when its last reference goes (the key is deleted at once).
        assert_eq!(a.release(id, Some("endpoint/1")).await, Some(0));
        assert_eq!(backend.node_value_keys().await.unwrap(), Vec::<String>::new());
        backend.go.notify_one();
        pass.await.unwrap().expect("the pass succeeds");
        assert_eq!(
            backend.node_value_keys().await.unwrap(),
            Vec::<String>::new(),
            "the pass must not leave the released set's value key behind (it would stay for the restore grace)"
        );
    }

    /// A store that, like the Kubernetes API, creates by id only: it cannot
    /// refuse a second id for a label set. Its watch never yields, so each
    /// allocator's cache knows only what it allocated itself (the widest
    /// race window).
    struct CreateByIdOnly {
        objects: Mutex<BTreeMap<u32, String>>,
        order: IdOrder,
    }

    #[tonic::async_trait]
    impl IdentityBackend for CreateByIdOnly {
        fn kind(&self) -> &'static str {
            "create-by-id-only"
        }
        fn id_order(&self) -> IdOrder {
            self.order
        }
        async fn list_identities(&self) -> Result<(Vec<IdentityRecord>, crate::backend::Revision), BackendError> {
            Ok((Vec::new(), 0))
        }
        async fn watch_identities(
            &self,
            _after: crate::backend::Revision,
        ) -> Result<futures::stream::BoxStream<'static, Result<IdentityEvent, BackendError>>, BackendError> {
            Ok(futures::stream::pending().boxed())
        }
        async fn held_id(&self, _labels: &str) -> Result<Option<u32>, BackendError> {
            Ok(None)
        }
        async fn create_identity(&self, id: u32, labels: &str) -> Result<CreateOutcome, BackendError> {
            let mut objects = self.objects.lock().unwrap();
            Ok(match objects.get(&id) {
                None => {
                    objects.insert(id, labels.to_string());
                    CreateOutcome::Created
                }
                Some(held) if held == labels => CreateOutcome::LabelsHeldAs(id),
                Some(_) => CreateOutcome::IdTaken,
            })
        }
        async fn acquire(&self, id: u32, labels: &str) -> Result<AcquireOutcome, BackendError> {
            Ok(match self.objects.lock().unwrap().get(&id) {
                Some(held) if held == labels => AcquireOutcome::Acquired,
                _ => AcquireOutcome::Conflict,
            })
        }
        async fn release(&self, _labels: &str) -> Result<(), BackendError> {
            Ok(())
        }
        async fn node_value_keys(&self) -> Result<Vec<String>, BackendError> {
            Ok(Vec::new())
        }
        async fn upsert_ip(&self, _entry: &crate::backend::IpEntry) -> Result<(), BackendError> {
            Ok(())
        }
        async fn delete_ip(&self, _ip: &str) -> Result<(), BackendError> {
            Ok(())
        }
        async fn list_ips(&self) -> Result<(Vec<crate::backend::IpEntry>, crate::backend::Revision), BackendError> {
            Ok((Vec::new(), 0))
        }
        async fn watch_ips(
            &self,
            _after: crate::backend::Revision,
        ) -> Result<futures::stream::BoxStream<'static, Result<crate::backend::IpEvent, BackendError>>, BackendError>
        {
            Ok(futures::stream::pending().boxed())
        }
        async fn lease_renewed(&self, _seen: &mut u64) {
            std::future::pending::<()>().await;
        }
    }

    /// Two nodes allocating the same sets on a create-by-id store: the ids
    /// each node gets per set, and how many objects the store holds.
    async fn two_nodes_on_a_create_by_id_store(order: IdOrder) -> (Vec<(u32, u32)>, usize) {
        let store = Arc::new(CreateByIdOnly {
            objects: Mutex::default(),
            order,
        });
        // A small range: some sets share their first id (about 20 of 200).
        let options = || AllocatorOptions {
            max_id: CLUSTER_IDENTITY_MIN + 999,
            ..AllocatorOptions::default()
        };
        let a = IdentityAllocator::new(store.clone(), options());
        let b = IdentityAllocator::new(store.clone(), options());
        let mut ids = Vec::new();
        for i in 0..200 {
            let set = labels(&format!("k8s:app=a{i}"));
            let on_a = a.allocate(&set, None).await.unwrap().id;
            let on_b = b.allocate(&set, None).await.unwrap().id;
            ids.push((on_a, on_b));
        }
        let objects = store.objects.lock().unwrap().len();
        (ids, objects)
    }

    #[tokio::test]
    async fn label_hash_order_gives_one_id_per_set_on_a_store_that_creates_by_id_only() {
        let (ids, objects) = two_nodes_on_a_create_by_id_store(IdOrder::LabelHash).await;
        for (set, (on_a, on_b)) in ids.iter().enumerate() {
            assert_eq!(on_a, on_b, "set {set}: both nodes must get one id");
        }
        assert_eq!(objects, 200, "one object per set");
        // Random order is what etcd's label-checking create needs; on this
        // store it would split the sets (the failure LabelHash prevents).
        let (ids, objects) = two_nodes_on_a_create_by_id_store(IdOrder::Random).await;
        assert!(ids.iter().any(|(a, b)| a != b), "random ids split sets here");
        assert!(objects > 200);
    }

    #[tokio::test]
    async fn a_set_the_cache_learnt_after_the_lookup_is_offered_its_own_id() {
        let store = Arc::new(CreateByIdOnly {
            objects: Mutex::default(),
            order: IdOrder::LabelHash,
        });
        let allocator = IdentityAllocator::new(store, AllocatorOptions::default());
        let key = labels("k8s:app=web").to_string();
        let own = label_hash_id(&key, CLUSTER_IDENTITY_MIN, AllocatorOptions::default().max_id);
        // Another node created the set at its first id; the watch brings it
        // between allocate's lookup by labels and the walk.
        allocator.cache.write().unwrap().insert(own, key.clone());
        assert_eq!(
            allocator.free_id(&key, &HashSet::new()).unwrap(),
            own,
            "a set's own id must not be skipped as taken (the set would get a second identity)"
        );
        assert_ne!(
            allocator.free_id(&key, &HashSet::from([own])).unwrap(),
            own,
            "a tried id is not offered again"
        );
    }

    #[test]
    fn label_hash_ids_are_stable_and_in_the_range() {
        assert_eq!(
            label_hash_id("k8s:app=web", 256, 65535),
            label_hash_id("k8s:app=web", 256, 65535)
        );
        for i in 0..1000 {
            let id = label_hash_id(&format!("k8s:app=a{i}"), 256, 300);
            assert!((256..=300).contains(&id), "{id}");
        }
        assert_eq!(label_hash_id("k8s:app=web", 256, 256), 256);
    }
}
