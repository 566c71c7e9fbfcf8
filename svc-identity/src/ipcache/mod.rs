//! The IP cache: IP prefix → identity, as claimed by several sources, and
//! the push of its effective view to svc-loader.
//!
//! # Claims and the effective view
//!
//! Every prefix may be claimed by several [`IpcacheSource`]s at once; the
//! *effective* entry is the claim of the highest precedence (RESERVED >
//! LOCAL_ENDPOINT > NODE > KVSTORE > KUBERNETES > CIDR). Withdrawing a claim makes
//! the next one effective. Who feeds which claims:
//!
//! - RESERVED: server-owned, fixed: `0.0.0.0/0` and `::/0` → world (2). The
//!   node's own addresses → host are published by svc-loader itself (it
//!   keeps them and a full resync leaves them alone), so they are not here.
//! - LOCAL_ENDPOINT: endpoints of this node ([`IpCache::upsert`], from
//!   svc-endpoint). Local first: the claim takes effect at once (this
//!   node's view, svc-loader), then it is published to the store
//!   (`ip/v1/<cluster>/<ip>`, bound to the node lease) by the reconcile
//!   pass. While the store answers, the call waits for that pass (so a call
//!   that returned is in the cluster); while it does not, the call returns
//!   at once and the entry is published when the store is back. The
//!   store's watch echoes them back; entries of this node in the store
//!   never become KVSTORE claims.
//! - NODE: server-owned, other nodes' underlay addresses → remote-node,
//!   from the node registry ([`IpCache::replace_node_claims`]); above
//!   KVSTORE so that no pod entry of the store shadows a node address.
//! - KVSTORE: server-owned, the store entries of OTHER nodes, kept by list +
//!   watch; every (re-)listing (after a watch error, a compaction, etcd
//!   restart) replaces the KVSTORE claims wholesale.
//! - KUBERNETES: from svc-k8s-sync; node-local, not written to the store.
//! - CIDR: for node-local CIDR identities; accepted from in-process callers
//!   only (the gRPC service refuses it).
//!
//! # Subscribers and the loader
//!
//! [`IpCache::subscribe`] hands out a snapshot of the effective view with
//! its revision and a broadcast receiver of later [`IpcacheDelta`]s (taken
//! under the same lock: nothing missed, nothing twice). A subscriber that
//! lags takes a fresh snapshot.
//!
//!
//! # Modules
//!
//! - `claims`: sources, entries and deltas, the prefix forms;
//! - `store`: keeping this node's entries in the store and the other
//!   nodes' entries in the cache (the store and publish loops);
//! - `loader_sync`: the push of the effective view to svc-loader.

mod claims;
mod loader_sync;
mod store;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ipnet::IpNet;
use rivet_common::backoff::Backoff;
use rivet_common::controller::{Controller, Controllers, Trigger};
use rivet_common::labels::ReservedIdentity;
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

use crate::backend::{IdentityBackend, IpEntry, Revision};
use crate::events::{self, IdentityMetrics, ReconciledKeys, RestoredCause, RestoredKind};
use crate::reconcile;
use crate::snapshot::{IpcacheSnapshot, SnapshotPart};

use claims::Claims;
pub use claims::{IpcacheDelta, IpcacheEntry, IpcacheSource, parse_prefix, prefix_text, store_ip};
pub use loader_sync::{LOADER_MAX_BATCH, LoaderSync, LoaderSyncOptions, LoaderSyncStatus};
use store::PublishProgress;

/// How the cache behaves.
#[derive(Debug, Clone)]
pub struct IpCacheOptions {
    /// This node's name: the `node` of its store entries (must match the
    /// backend's node).
    pub node_name: String,
    /// This node's underlay address: the host of LOCAL_ENDPOINT claims that
    /// name none, and never a tunnel endpoint.
    pub host_ip: Option<IpAddr>,
    /// How often this node's store entries are checked against the claims.
    pub resync_interval: Duration,
    /// How long entries of this node found in the store at start stay
    /// claimed without a client claiming them again.
    pub restore_grace: Duration,
    /// Retry delays of listing/watching the store.
    pub relist_backoff: Backoff,
    /// Deltas a subscriber may fall behind before it takes a fresh snapshot.
    pub channel_capacity: usize,
    /// Longest an upsert or delete of LOCAL_ENDPOINT claims waits for the
    /// pass publishing it while the store answers (it never waits while
    /// the store does not).
    pub publish_wait: Duration,
    /// Where the outage events are counted.
    pub metrics: IdentityMetrics,
}

impl IpCacheOptions {
    /// Defaults for `node_name`: resync every 5 min, restore grace 2 min.
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            host_ip: None,
            resync_interval: Duration::from_secs(300),
            restore_grace: Duration::from_secs(120),
            relist_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            channel_capacity: 4096,
            publish_wait: Duration::from_secs(2),
            metrics: IdentityMetrics::default(),
        }
    }
}

/// Why a change of the cache was refused (never the store: changes are
/// local first).
#[derive(Debug, thiserror::Error)]
pub enum IpcacheError {
    /// A bad argument, naming the field.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field (`entries[3].source`).
        field: String,
        /// What is wrong.
        reason: String,
    },
}

impl IpcacheError {
    /// The gRPC status: INVALID_ARGUMENT.
    pub fn to_status(&self) -> tonic::Status {
        match self {
            Self::Invalid { .. } => tonic::Status::invalid_argument(self.to_string()),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Every prefix with at least one claim.
    claims: BTreeMap<IpNet, Claims>,
    /// Bumped per effective change.
    revision: u64,
    /// This node's entries as the store holds them (listings, watch events,
    /// this cache's own successful writes).
    own_in_store: BTreeMap<IpNet, IpEntry>,
    /// LOCAL_ENDPOINT claims adopted from the store at start, not yet
    /// claimed again by a client.
    restored: BTreeSet<IpNet>,
    /// When the restored claims expire.
    restore_deadline: Option<Instant>,
    /// The first listing completed.
    listed: bool,
    /// Bumped by every change of the LOCAL_ENDPOINT claims.
    local_generation: u64,
    /// Entries of this node the restored snapshot says were withdrawn here
    /// while the store still held them: not adopted at the first listing.
    restored_withdrawals: BTreeSet<IpNet>,
    /// Every claim must be written again (on this process's lease): set by
    /// the first listing, cleared by the pass that did it.
    republish_pending: bool,
    /// svc-endpoint ended its replay of the LOCAL_ENDPOINT claims
    /// ([`IpCache::end_replay`]): nothing restored is kept any more, nor
    /// adopted by a first listing after it.
    replay_ended: bool,
}

impl State {
    fn effective(&self, prefix: &IpNet) -> Option<&IpcacheEntry> {
        self.claims.get(prefix).and_then(|c| c.values().next())
    }
}

/// The effective IP cache of one node; see the module docs.
pub struct IpCache {
    backend: Arc<dyn IdentityBackend>,
    opts: IpCacheOptions,
    state: Mutex<State>,
    changes: broadcast::Sender<IpcacheDelta>,
    ready: watch::Sender<bool>,
    /// Listing or watching the store failed last (cleared by a listing).
    watch_failed: AtomicBool,
    /// Served from the local snapshot since start (NODE claims included).
    from_snapshot: AtomicBool,
    /// Progress of the reconcile passes (the publish loop is their only
    /// runner, so passes never overlap).
    progress: watch::Sender<PublishProgress>,
    reconcile: Trigger,
    /// Its part of the local snapshot: changes and store revision.
    snapshot_part: SnapshotPart,
}

impl std::fmt::Debug for IpCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpCache")
            .field("backend", &self.backend.kind())
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl IpCache {
    /// A cache over `backend` holding the reserved entries; call
    /// [`run`](Self::run) to follow the store.
    pub fn new(backend: Arc<dyn IdentityBackend>, opts: IpCacheOptions) -> Arc<Self> {
        let (changes, _) = broadcast::channel(opts.channel_capacity.max(1));
        let (ready, _) = watch::channel(false);
        let mut state = State::default();
        for prefix in ["0.0.0.0/0", "::/0"] {
            let prefix: IpNet = prefix.parse().expect("a valid prefix");
            let mut entry = IpcacheEntry::new(prefix, ReservedIdentity::World.id(), IpcacheSource::Reserved);
            entry.node_name.clone_from(&opts.node_name);
            state
                .claims
                .entry(prefix)
                .or_default()
                .insert(IpcacheSource::Reserved, entry);
        }
        Arc::new(Self {
            backend,
            opts,
            state: Mutex::new(state),
            changes,
            ready,
            watch_failed: AtomicBool::new(false),
            from_snapshot: AtomicBool::new(false),
            progress: watch::channel(PublishProgress::default()).0,
            reconcile: Trigger::new(),
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

    /// What a restart needs to serve without the store: other nodes'
    /// entries, this node's claims and what the store holds of them.
    pub fn snapshot(&self) -> IpcacheSnapshot {
        let st = self.lock();
        let remote = st
            .claims
            .values()
            .filter_map(|c| c.get(&IpcacheSource::KvStore))
            .map(|e| Self::store_entry(e, &e.node_name))
            .collect();
        IpcacheSnapshot {
            store_revision: self.store_revision(),
            remote,
            local: self.desired(&st).into_values().collect(),
            published: st.own_in_store.values().cloned().collect(),
            nodes: st
                .claims
                .values()
                .filter_map(|c| c.get(&IpcacheSource::Node))
                .map(|e| (e.prefix.addr(), e.node_name.clone()))
                .collect(),
        }
    }

    /// Serves `snapshot` until the store is listed: other nodes' entries as
    /// KVSTORE claims (the first listing replaces them), this node's claims
    /// as restored LOCAL_ENDPOINT claims (kept for the restore grace unless
    /// claimed again), the view ready for svc-loader, and the store counted
    /// as unreachable until listed. Call before [`run`](Self::run).
    pub fn restore(&self, snapshot: IpcacheSnapshot) {
        let me = self.opts.node_name.clone();
        let parse = |e: &IpEntry| match parse_prefix(&e.ip) {
            Ok(p) if e.identity != 0 => Some(p),
            _ => {
                tracing::warn!(ip = %e.ip, node = %e.node, "skipping an unusable IP cache entry of the snapshot");
                None
            }
        };
        let mut st = self.lock();
        for e in snapshot.remote.iter().filter(|e| e.node != me) {
            if let Some(prefix) = parse(e) {
                let entry = Self::claim_from_store(prefix, e, IpcacheSource::KvStore);
                self.update(&mut st, prefix, |c| {
                    c.insert(IpcacheSource::KvStore, entry);
                });
            }
        }
        let mut local = BTreeSet::new();
        for e in snapshot.local.iter().filter(|e| e.node == me) {
            if let Some(prefix) = parse(e) {
                let entry = Self::claim_from_store(prefix, e, IpcacheSource::LocalEndpoint);
                self.update(&mut st, prefix, |c| {
                    c.insert(IpcacheSource::LocalEndpoint, entry);
                });
                st.restored.insert(prefix);
                local.insert(prefix);
            }
        }
        if !local.is_empty() {
            st.restore_deadline = Some(Instant::now() + self.opts.restore_grace);
            st.local_generation += 1;
        }
        // The node registry replaces them at its first listing.
        for (ip, node) in &snapshot.nodes {
            let prefix = IpNet::from(*ip);
            let mut entry = IpcacheEntry::new(prefix, ReservedIdentity::RemoteNode.id(), IpcacheSource::Node);
            entry.node_name.clone_from(node);
            self.update(&mut st, prefix, |c| {
                c.insert(IpcacheSource::Node, entry);
            });
        }
        for e in snapshot.published.iter().filter(|e| e.node == me) {
            if let Some(prefix) = parse(e) {
                if !local.contains(&prefix) {
                    st.restored_withdrawals.insert(prefix);
                }
                st.own_in_store.insert(prefix, e.clone());
            }
        }
        tracing::info!(
            remote = snapshot.remote.len(),
            local = local.len(),
            nodes = snapshot.nodes.len(),
            withdrawals = st.restored_withdrawals.len(),
            revision = snapshot.store_revision,
            "IP cache restored from the local snapshot; served until the store is listed"
        );
        drop(st);
        self.snapshot_part.set_store_revision(snapshot.store_revision);
        // Not listed yet: changes do not wait for a store that may be away.
        self.watch_failed.store(true, Ordering::Release);
        self.from_snapshot.store(true, Ordering::Release);
        self.ready.send_replace(true);
    }

    /// Starts following the store (`ipcache-watch`: list, watch, re-list)
    /// and keeping this node's entries in it (`ipcache-publish`, woken by
    /// `ipcache-lease-renewals` too) under `controllers`.
    pub fn run(self: &Arc<Self>, controllers: &Controllers) {
        let this = self.clone();
        let watch = Controller::new("ipcache-watch").backoff(self.opts.relist_backoff.clone());
        controllers.supervise(watch, move |progress| this.clone().watch_store(progress));
        let this = self.clone();
        reconcile::start(
            controllers,
            "ipcache-publish",
            ReconciledKeys::IpEntries,
            &self.opts.metrics,
            &self.reconcile,
            move || this.clone().publish_pass(),
        );
        let this = self.clone();
        reconcile::on_lease_renewed(controllers, "ipcache-lease-renewals", &self.backend, move || {
            this.republish()
        });
    }

    /// The options.
    pub fn options(&self) -> &IpCacheOptions {
        &self.opts
    }

    /// The store's kind (`etcd`, `embedded`).
    pub fn backend_kind(&self) -> &'static str {
        self.backend.kind()
    }

    /// Waits until the first listing of the store completed.
    pub async fn wait_ready(&self) {
        let mut rx = self.ready.subscribe();
        let _ = rx.wait_for(|r| *r).await;
    }

    /// Whether the view was restored from the local snapshot at start (its
    /// NODE claims are there before the node registry lists).
    pub fn restored_from_snapshot(&self) -> bool {
        self.from_snapshot.load(Ordering::Acquire)
    }

    /// Whether the first listing of the store completed.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the claims of `prefix` with `f`; when the effective entry
    /// changed, bumps the revision and broadcasts the delta (under the
    /// state lock, so subscribers see changes in order) and returns true.
    fn update(&self, st: &mut State, prefix: IpNet, f: impl FnOnce(&mut Claims)) -> bool {
        let before = st.effective(&prefix).cloned();
        let claims = st.claims.entry(prefix).or_default();
        f(claims);
        if claims.is_empty() {
            st.claims.remove(&prefix);
        }
        let after = st.effective(&prefix).cloned();
        if before == after {
            return false;
        }
        st.revision += 1;
        // No subscriber is not an error.
        let _ = self.changes.send(IpcacheDelta {
            revision: st.revision,
            prefix,
            entry: after,
            cause: rivet_common::telemetry::TraceLink::current(),
        });
        self.snapshot_part.changed();
        true
    }

    /// The store form of a claim, as published by `node`.
    fn store_entry(e: &IpcacheEntry, node: &str) -> IpEntry {
        IpEntry {
            ip: store_ip(&e.prefix),
            identity: e.identity,
            host_ip: e.host_ip.map(|h| h.to_string()),
            namespace: (!e.pod_namespace.is_empty()).then(|| e.pod_namespace.clone()),
            pod: (!e.pod_name.is_empty()).then(|| e.pod_name.clone()),
            node: node.to_string(),
            named_ports: e.named_ports.clone(),
        }
    }

    /// A store entry as a claim of `source`.
    fn claim_from_store(prefix: IpNet, e: &IpEntry, source: IpcacheSource) -> IpcacheEntry {
        let host_ip = e.host_ip.as_deref().and_then(|h| match h.parse() {
            Ok(ip) => Some(ip),
            Err(_) => {
                tracing::warn!(ip = %e.ip, host_ip = h, node = %e.node, "store entry names an unparsable host IP; ignoring it");
                None
            }
        });
        IpcacheEntry {
            prefix,
            identity: e.identity,
            host_ip,
            pod_namespace: e.namespace.clone().unwrap_or_default(),
            pod_name: e.pod.clone().unwrap_or_default(),
            source,
            node_name: e.node.clone(),
            named_ports: e.named_ports.clone(),
        }
    }

    /// Claims prefixes: every entry is a claim of its `source` (replacing
    /// that source's previous claim on the prefix), effective at once.
    /// LOCAL_ENDPOINT claims are then published to the store (see the module
    /// docs: waited for while the store answers, later when it does not).
    /// Returns how many prefixes' effective entries changed.
    ///
    /// RESERVED and KVSTORE are server-owned and refused. `node_name` is set
    /// to this node; a LOCAL_ENDPOINT claim without a host gets this node's.
    /// A claim the store already holds unchanged (a client's replay) costs
    /// no store write.
    pub async fn upsert(&self, entries: Vec<IpcacheEntry>) -> Result<u32, IpcacheError> {
        let mut entries = entries;
        for (i, e) in entries.iter_mut().enumerate() {
            if e.source.server_only() {
                return Err(IpcacheError::Invalid {
                    field: format!("entries[{i}].source"),
                    reason: format!("{} is server-owned", e.source),
                });
            }
            if e.identity == 0 {
                return Err(IpcacheError::Invalid {
                    field: format!("entries[{i}].identity"),
                    reason: "must be non-zero".into(),
                });
            }
            if e.prefix.trunc() != e.prefix {
                return Err(IpcacheError::Invalid {
                    field: format!("entries[{i}].prefix"),
                    reason: format!("{} has host bits set", e.prefix),
                });
            }
            e.node_name.clone_from(&self.opts.node_name);
            if e.source == IpcacheSource::LocalEndpoint && e.host_ip.is_none() {
                e.host_ip = self.opts.host_ip;
            }
        }
        let has_local = entries.iter().any(|e| e.source == IpcacheSource::LocalEndpoint);
        let (changed, generation) = {
            let mut st = self.lock();
            let prefixes: BTreeSet<IpNet> = entries.iter().map(|e| e.prefix).collect();
            let before: BTreeMap<IpNet, Option<IpcacheEntry>> =
                prefixes.iter().map(|p| (*p, st.effective(p).cloned())).collect();
            for e in entries {
                if e.source == IpcacheSource::LocalEndpoint {
                    st.restored.remove(&e.prefix);
                }
                let prefix = e.prefix;
                self.update(&mut st, prefix, |c| {
                    c.insert(e.source, e);
                });
            }
            if has_local {
                st.local_generation += 1;
                self.snapshot_part.changed();
            }
            let changed = before.iter().filter(|(p, b)| st.effective(p) != b.as_ref()).count();
            (changed as u32, st.local_generation)
        };
        if has_local {
            self.publish(generation).await;
        }
        Ok(changed)
    }

    /// Ends the replay of the client that makes every claim of `sources`
    /// (LOCAL_ENDPOINT: this node's svc-endpoint): the LOCAL_ENDPOINT claims
    /// restored at start that it did not claim again are withdrawn now, not
    /// when the restore grace ends, locally and from the store (waited for
    /// like [`delete`](Self::delete)), and a first listing after it adopts
    /// none (the pass withdraws them). A claim after it is a new claim.
    /// Returns how many restored claims went. Idempotent.
    pub async fn end_replay(&self, sources: &[IpcacheSource]) -> u32 {
        // Only LOCAL_ENDPOINT claims are restored (KUBERNETES ones are not
        // kept across a restart).
        if !sources.contains(&IpcacheSource::LocalEndpoint) {
            return 0;
        }
        let (withdrawn, generation) = {
            let mut st = self.lock();
            st.replay_ended = true;
            st.restore_deadline = None;
            let expired = std::mem::take(&mut st.restored);
            for prefix in &expired {
                self.update(&mut st, *prefix, |c| {
                    c.remove(&IpcacheSource::LocalEndpoint);
                });
            }
            if !expired.is_empty() {
                st.local_generation += 1;
                self.snapshot_part.changed();
            }
            (expired.len(), st.local_generation)
        };
        events::restored_released(
            &self.opts.metrics,
            RestoredKind::IpClaims,
            RestoredCause::ReplayEnded,
            withdrawn,
        );
        if withdrawn > 0 {
            self.publish(generation).await;
        }
        withdrawn as u32
    }

    /// Withdraws `source`'s claims on `prefixes`, effective at once
    /// (LOCAL_ENDPOINT: withdrawn from the store like [`upsert`](Self::upsert)
    /// publishes). Returns how many claims existed. Idempotent. RESERVED and
    /// KVSTORE are refused.
    pub async fn delete(&self, source: IpcacheSource, prefixes: &[IpNet]) -> Result<u32, IpcacheError> {
        if source.server_only() {
            return Err(IpcacheError::Invalid {
                field: "source".into(),
                reason: format!("{source} is server-owned"),
            });
        }
        let prefixes: BTreeSet<IpNet> = prefixes.iter().copied().collect();
        let (deleted, generation) = {
            let mut st = self.lock();
            let mut deleted = 0;
            for prefix in prefixes {
                if source == IpcacheSource::LocalEndpoint {
                    st.restored.remove(&prefix);
                }
                if st.claims.get(&prefix).is_some_and(|c| c.contains_key(&source)) {
                    deleted += 1;
                    self.update(&mut st, prefix, |c| {
                        c.remove(&source);
                    });
                }
            }
            if source == IpcacheSource::LocalEndpoint {
                st.local_generation += 1;
                self.snapshot_part.changed();
            }
            (deleted, st.local_generation)
        };
        if source == IpcacheSource::LocalEndpoint {
            self.publish(generation).await;
        }
        Ok(deleted)
    }

    /// Replaces the NODE claims with `addresses` (each peer node's underlay
    /// address → remote-node, named by its node), effective at once; claims
    /// of addresses no longer given are withdrawn. Returns how many
    /// prefixes' effective entries changed.
    pub fn replace_node_claims(&self, addresses: &BTreeMap<IpAddr, String>) -> usize {
        let wanted: BTreeMap<IpNet, IpcacheEntry> = addresses
            .iter()
            .map(|(ip, node)| {
                let prefix = IpNet::from(*ip);
                let mut entry = IpcacheEntry::new(prefix, ReservedIdentity::RemoteNode.id(), IpcacheSource::Node);
                entry.node_name.clone_from(node);
                (prefix, entry)
            })
            .collect();
        let mut st = self.lock();
        let gone: Vec<IpNet> = st
            .claims
            .iter()
            .filter(|(p, c)| c.contains_key(&IpcacheSource::Node) && !wanted.contains_key(p))
            .map(|(p, _)| *p)
            .collect();
        let mut changed = 0;
        for prefix in gone {
            changed += usize::from(self.update(&mut st, prefix, |c| {
                c.remove(&IpcacheSource::Node);
            }));
        }
        for (prefix, entry) in wanted {
            changed += usize::from(self.update(&mut st, prefix, |c| {
                c.insert(IpcacheSource::Node, entry);
            }));
        }
        changed
    }

    /// The addresses of this node's endpoints with the reserved `health`
    /// identity (its health endpoint), sorted.
    pub fn local_health_addresses(&self) -> Vec<IpAddr> {
        let health = ReservedIdentity::Health.id();
        self.lock()
            .claims
            .values()
            .filter_map(|c| c.get(&IpcacheSource::LocalEndpoint))
            .filter(|e| e.identity == health && e.prefix.prefix_len() == e.prefix.max_prefix_len())
            .map(|e| e.prefix.addr())
            .collect()
    }

    /// The effective entry of a prefix.
    pub fn get(&self, prefix: &IpNet) -> Option<IpcacheEntry> {
        self.lock().effective(prefix).cloned()
    }

    /// Every claim on a prefix, by precedence.
    pub fn claims(&self, prefix: &IpNet) -> Vec<IpcacheEntry> {
        self.lock()
            .claims
            .get(prefix)
            .map(|c| c.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Every effective entry, in prefix order.
    pub fn list(&self) -> Vec<IpcacheEntry> {
        Self::effective_entries(&self.lock())
    }

    fn effective_entries(st: &State) -> Vec<IpcacheEntry> {
        st.claims.values().filter_map(|c| c.values().next().cloned()).collect()
    }

    /// One page of effective entries in prefix order: those after `after`
    /// whose effective source is `source` (any when `None`), at most
    /// `limit`; and whether no entry follows.
    pub fn list_page(
        &self,
        source: Option<IpcacheSource>,
        after: Option<IpNet>,
        limit: usize,
    ) -> (Vec<IpcacheEntry>, bool) {
        use std::ops::Bound;
        let st = self.lock();
        let lower = after.map_or(Bound::Unbounded, Bound::Excluded);
        let mut matching = st
            .claims
            .range((lower, Bound::Unbounded))
            .filter_map(|(_, c)| c.values().next())
            .filter(|e| source.is_none_or(|s| e.source == s));
        let page: Vec<IpcacheEntry> = matching.by_ref().take(limit).cloned().collect();
        let complete = matching.next().is_none();
        (page, complete)
    }

    /// Effective entries.
    pub fn len(&self) -> usize {
        self.lock().claims.len()
    }

    /// Never true: the reserved entries are always there.
    pub fn is_empty(&self) -> bool {
        self.lock().claims.is_empty()
    }

    /// The revision of the effective view (one per change since start).
    pub fn revision(&self) -> u64 {
        self.lock().revision
    }

    /// A snapshot of the effective view, its revision and a receiver of the
    /// later deltas (every delta has a higher revision; none is missed).
    pub fn subscribe(&self) -> (Vec<IpcacheEntry>, u64, broadcast::Receiver<IpcacheDelta>) {
        let st = self.lock();
        let rx = self.changes.subscribe();
        (Self::effective_entries(&st), st.revision, rx)
    }
}
