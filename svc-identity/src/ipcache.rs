//! The IP cache: IP prefix → identity, as claimed by several sources, and
//! the push of its effective view to svc-loader.
//!
//! # Claims and the effective view
//!
//! Every prefix may be claimed by several [`IpcacheSource`]s at once; the
//! *effective* entry is the claim of the highest precedence (RESERVED >
//! LOCAL_ENDPOINT > KVSTORE > KUBERNETES > CIDR). Withdrawing a claim makes
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
//! - KVSTORE: server-owned, the store entries of OTHER nodes, kept by list +
//!   watch; every (re-)listing (after a watch error, a compaction, etcd
//!   restart) replaces the KVSTORE claims wholesale.
//! - KUBERNETES: from svc-k8s-sync; node-local, not written to the store.
//! - CIDR: for node-local CIDR identities; accepted from in-process callers
//!   only (the gRPC service refuses it).
//!
//! # Keeping this node's entries in the store
//!
//! The store is level-triggered against the LOCAL_ENDPOINT claims: a
//! reconcile pass (the only writer of this node's entries, one pass at a
//! time) writes every claim the store lacks (or holds differently) and
//! withdraws this node's store entries that no claim backs. It runs after
//! a change of the claims, after every listing (so when the store is back
//! after an outage), when an entry this node claims vanished from the store
//! (the lease expired, another node's late delete), periodically
//! ([`IpCacheOptions::resync_interval`]), with backoff after a failed pass,
//! and, re-publishing every claim, when the backend reports a replaced
//! lease ([`IdentityBackend::lease_renewed`]).
//! When two nodes both claim one address (an IP moved between nodes and the
//! old node has not withdrawn it yet) each keeps its own claim locally; the
//! store holds the last writer's.
//!
//! After a restart, this node's entries found in the store at the first
//! listing with no claim yet are adopted as LOCAL_ENDPOINT claims for
//! [`IpCacheOptions::restore_grace`] (svc-endpoint replays its endpoints
//! when it sees the new boot id); those not claimed again by then are
//! withdrawn, locally and from the store. So a restart of svc-identity
//! neither blinks remote nodes' view of this node's pods nor leaks entries.
//!
//! # Subscribers and the loader
//!
//! [`IpCache::subscribe`] hands out a snapshot of the effective view with
//! its revision and a broadcast receiver of later [`IpcacheDelta`]s (taken
//! under the same lock: nothing missed, nothing twice). A subscriber that
//! lags takes a fresh snapshot.
//!
//! [`LoaderSync`] pushes the effective view to svc-loader: a full
//! `ReplaceIpcache` on connect and whenever the loader's boot id changes
//! (noticed on every response and by a `GetInfo` probe while idle), then
//! coalesced `UpsertIpcache`/`DeleteIpcache` batches. It waits for the first
//! listing of the store, or a view restored from the local snapshot
//! ([`IpCache::restore`], [`crate::snapshot`]), before its first full sync:
//! replacing the loader's ipcache with a view lacking the other nodes'
//! entries would cut the traffic to them, while waiting only delays changes.
//!
//! After a restart this node's store entries may still be bound to the
//! previous process's lease (a crash leaves it to its TTL): the first pass
//! after the first listing writes every claim again, on this process's
//! lease, so the old lease expiring takes nothing that is still claimed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use ipnet::IpNet;
use rivet_common::backoff::Backoff;
use rivet_common::grpc::{BootIdWatch, ClientOptions, DaemonChannel, connect_unix};
use rivet_common::labels::ReservedIdentity;
use rivet_proto::daemon::v1::{GetInfoRequest, daemon_client::DaemonClient};
use rivet_proto::identity::v1 as pb;
use rivet_proto::loader::v1 as loader_pb;
use rivet_proto::loader::v1::loader_service_client::LoaderServiceClient;
use tokio::sync::{Notify, broadcast, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::backend::{BackendError, IdentityBackend, IpEntry, IpEvent, Revision};
use crate::events::{self, IdentityMetrics, KeyAction, ReconciledKeys, StoreKey};
use crate::reconcile;
use crate::snapshot::{IpcacheSnapshot, SnapshotPart};

/// Most entries svc-loader takes in one ipcache call.
pub const LOADER_MAX_BATCH: usize = 4096;

/// Store writes in flight at once for one batch.
const STORE_CONCURRENCY: usize = 16;

/// Who claims a prefix. The order is the precedence: a smaller variant wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpcacheSource {
    /// `0.0.0.0/0`, `::/0` → world. Server-owned.
    Reserved,
    /// An endpoint of this node; published to the store.
    LocalEndpoint,
    /// Another node's entry learned from the store. Server-owned.
    KvStore,
    /// From the Kubernetes API (svc-k8s-sync); node-local.
    Kubernetes,
    /// A node-local CIDR identity; in-process callers only.
    Cidr,
}

impl IpcacheSource {
    /// Every source, by precedence.
    pub const ALL: [IpcacheSource; 5] = [
        Self::Reserved,
        Self::LocalEndpoint,
        Self::KvStore,
        Self::Kubernetes,
        Self::Cidr,
    ];

    /// From the protobuf enum; `None` for UNSPECIFIED and unknown values.
    pub fn from_proto(value: i32) -> Option<Self> {
        match pb::IpcacheSource::try_from(value).ok()? {
            pb::IpcacheSource::Unspecified => None,
            pb::IpcacheSource::Reserved => Some(Self::Reserved),
            pb::IpcacheSource::LocalEndpoint => Some(Self::LocalEndpoint),
            pb::IpcacheSource::Kvstore => Some(Self::KvStore),
            pb::IpcacheSource::Kubernetes => Some(Self::Kubernetes),
            pb::IpcacheSource::Cidr => Some(Self::Cidr),
        }
    }

    /// The protobuf enum.
    pub fn to_proto(self) -> pb::IpcacheSource {
        match self {
            Self::Reserved => pb::IpcacheSource::Reserved,
            Self::LocalEndpoint => pb::IpcacheSource::LocalEndpoint,
            Self::KvStore => pb::IpcacheSource::Kvstore,
            Self::Kubernetes => pb::IpcacheSource::Kubernetes,
            Self::Cidr => pb::IpcacheSource::Cidr,
        }
    }

    /// The protobuf name (`LOCAL_ENDPOINT`), for messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Reserved => "RESERVED",
            Self::LocalEndpoint => "LOCAL_ENDPOINT",
            Self::KvStore => "KVSTORE",
            Self::Kubernetes => "KUBERNETES",
            Self::Cidr => "CIDR",
        }
    }

    /// Only the server itself may claim with it (never a caller, not even
    /// in-process).
    fn server_only(self) -> bool {
        matches!(self, Self::Reserved | Self::KvStore)
    }
}

impl std::fmt::Display for IpcacheSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One claim on a prefix; the effective entry of a prefix is its claim of
/// the highest precedence.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IpcacheEntry {
    /// The prefix (host bits zero).
    pub prefix: IpNet,
    /// Its identity (non-zero).
    pub identity: u32,
    /// The node hosting the address (its underlay address), if any.
    pub host_ip: Option<IpAddr>,
    /// Pod namespace, for inspection; may be empty.
    pub pod_namespace: String,
    /// Pod name, for inspection; may be empty.
    pub pod_name: String,
    /// Who claims it.
    pub source: IpcacheSource,
    /// The node that published it (set by the cache for local claims).
    pub node_name: String,
}

impl IpcacheEntry {
    /// A claim with no host or pod.
    pub fn new(prefix: IpNet, identity: u32, source: IpcacheSource) -> Self {
        Self {
            prefix,
            identity,
            host_ip: None,
            pod_namespace: String::new(),
            pod_name: String::new(),
            source,
            node_name: String::new(),
        }
    }

    /// The protobuf message.
    pub fn to_proto(&self) -> pb::IpcacheEntry {
        pb::IpcacheEntry {
            prefix: prefix_text(&self.prefix),
            identity: self.identity,
            host_ip: self.host_ip.map(|h| h.to_string()).unwrap_or_default(),
            pod_namespace: self.pod_namespace.clone(),
            pod_name: self.pod_name.clone(),
            source: self.source.to_proto() as i32,
            node_name: self.node_name.clone(),
        }
    }
}

/// One change of the effective view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcacheDelta {
    /// The cache revision after this change (one per change, per process).
    pub revision: u64,
    /// The prefix that changed.
    pub prefix: IpNet,
    /// Its new effective entry; `None` when no claim is left.
    pub entry: Option<IpcacheEntry>,
}

/// A prefix as the API prints it: always `address/length`.
///
/// ```
/// let p = "198.18.0.5".parse::<std::net::IpAddr>().unwrap().into();
/// assert_eq!(svc_identity::ipcache::prefix_text(&p), "198.18.0.5/32");
/// ```
pub fn prefix_text(prefix: &IpNet) -> String {
    format!("{}/{}", prefix.addr(), prefix.prefix_len())
}

/// A prefix as the store keys it: a bare address for a host prefix
/// (`198.18.0.2`), `address/length` otherwise (backend.rs).
pub fn store_ip(prefix: &IpNet) -> String {
    if prefix.prefix_len() == prefix.max_prefix_len() {
        prefix.addr().to_string()
    } else {
        prefix_text(prefix)
    }
}

/// Parses `address/length` or a bare address (a host prefix); host bits
/// must be zero.
///
/// ```
/// use svc_identity::ipcache::parse_prefix;
/// assert_eq!(parse_prefix("2001:2::/64").unwrap().to_string(), "2001:2::/64");
/// assert_eq!(parse_prefix("198.18.0.5").unwrap().to_string(), "198.18.0.5/32");
/// assert!(parse_prefix("198.18.0.5/24").unwrap_err().contains("host bits"));
/// ```
pub fn parse_prefix(text: &str) -> Result<IpNet, String> {
    if text.contains('/') {
        let net: IpNet = text
            .parse()
            .map_err(|_| format!("{text:?} is not an address/length prefix"))?;
        if net.trunc() != net {
            return Err(format!(
                "{text} has host bits set beyond /{} (the prefix is {})",
                net.prefix_len(),
                net.trunc()
            ));
        }
        Ok(net)
    } else {
        let addr: IpAddr = text
            .parse()
            .map_err(|_| format!("{text:?} is not an IP address or prefix"))?;
        Ok(IpNet::from(addr))
    }
}

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

/// How far the reconcile passes got.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PublishProgress {
    /// The generation of the LOCAL_ENDPOINT claims the last pass started from.
    attempted: u64,
    /// Why that pass could not reconcile everything, `None` when it did.
    error: Option<String>,
}

type Claims = BTreeMap<IpcacheSource, IpcacheEntry>;

/// An entry to write to the store, and what the write is to it (`None`:
/// written again unchanged).
type StoreWrite = (IpNet, IpEntry, Option<KeyAction>);

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
    /// Progress of the reconcile passes (the publish loop is their only
    /// runner, so passes never overlap).
    progress: watch::Sender<PublishProgress>,
    reconcile: Notify,
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
            progress: watch::channel(PublishProgress::default()).0,
            reconcile: Notify::new(),
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
            withdrawals = st.restored_withdrawals.len(),
            revision = snapshot.store_revision,
            "IP cache restored from the local snapshot; served until the store is listed"
        );
        drop(st);
        self.snapshot_part.set_store_revision(snapshot.store_revision);
        // Not listed yet: changes do not wait for a store that may be away.
        self.watch_failed.store(true, Ordering::Release);
        self.ready.send_replace(true);
    }

    /// Starts following the store (list, watch, re-list) and keeping this
    /// node's entries in it. The tasks run until aborted.
    pub fn run(self: &Arc<Self>) -> Vec<JoinHandle<()>> {
        vec![
            tokio::spawn(self.clone().store_loop()),
            tokio::spawn(self.clone().publish_loop()),
        ]
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

    /// Whether the store is known to be unreachable: the last pass or the
    /// last listing/watch failed.
    fn store_unreachable(&self) -> bool {
        self.watch_failed.load(Ordering::Acquire) || self.progress.borrow().error.is_some()
    }

    /// Has the claims of `generation` published: unless the store is known
    /// to be unreachable, starts a pass and waits for it (at most
    /// [`IpCacheOptions::publish_wait`]); else leaves them to the pass that
    /// runs when it is back.
    async fn publish(&self, generation: u64) {
        if self.store_unreachable() {
            return;
        }
        let mut rx = self.progress.subscribe();
        self.reconcile.notify_one();
        let _ = tokio::time::timeout(self.opts.publish_wait, rx.wait_for(|p| p.attempted >= generation)).await;
    }

    /// Why the last publishing pass failed, `None` when it succeeded.
    pub fn publish_error(&self) -> Option<String> {
        self.progress.borrow().error.clone()
    }

    /// This node's entries not yet as desired in the store: claims to
    /// publish and entries to withdraw (0 once reconciled).
    pub fn pending_writes(&self) -> usize {
        let st = self.lock();
        let desired = self.desired(&st);
        let writes = desired
            .iter()
            .filter(|(p, e)| st.own_in_store.get(p) != Some(e))
            .count();
        let withdrawals = st.own_in_store.keys().filter(|p| !desired.contains_key(p)).count();
        writes + withdrawals
    }

    /// The store entries the LOCAL_ENDPOINT claims want.
    fn desired(&self, st: &State) -> BTreeMap<IpNet, IpEntry> {
        st.claims
            .iter()
            .filter_map(|(p, c)| {
                c.get(&IpcacheSource::LocalEndpoint)
                    .map(|e| (*p, Self::store_entry(e, &self.opts.node_name)))
            })
            .collect()
    }

    /// Writes store entries (some concurrently), each with what the write
    /// is to the store (created, updated, or `None`: rewritten unchanged);
    /// what succeeded is recorded as held by the store and counted, the
    /// first failure is returned.
    async fn write_store(&self, writes: Vec<StoreWrite>) -> Result<(), BackendError> {
        let results: Vec<Result<StoreWrite, BackendError>> = futures::stream::iter(writes)
            .map(|(p, e, action)| async move { self.backend.upsert_ip(&e).await.map(|()| (p, e, action)) })
            .buffer_unordered(STORE_CONCURRENCY)
            .collect()
            .await;
        let (mut created, mut updated) = (0, 0);
        let mut first_error = None;
        {
            let mut st = self.lock();
            for r in results {
                match r {
                    Ok((p, e, action)) => {
                        st.own_in_store.insert(p, e);
                        match action {
                            Some(KeyAction::Created) => created += 1,
                            Some(_) => updated += 1,
                            None => {}
                        }
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        let m = &self.opts.metrics;
        events::keys_reconciled(m, StoreKey::Ip, KeyAction::Created, created);
        events::keys_reconciled(m, StoreKey::Ip, KeyAction::Updated, updated);
        if created + updated > 0 {
            self.snapshot_part.changed();
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Deletes this node's store entries, like [`write_store`](Self::write_store).
    async fn withdraw_store(&self, prefixes: Vec<IpNet>) -> Result<(), BackendError> {
        let results: Vec<Result<IpNet, BackendError>> = futures::stream::iter(prefixes)
            .map(|p| async move { self.backend.delete_ip(&store_ip(&p)).await.map(|()| p) })
            .buffer_unordered(STORE_CONCURRENCY)
            .collect()
            .await;
        let mut deleted = 0;
        let mut first_error = None;
        {
            let mut st = self.lock();
            for r in results {
                match r {
                    Ok(p) => {
                        st.own_in_store.remove(&p);
                        st.restored_withdrawals.remove(&p);
                        deleted += 1;
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        events::keys_reconciled(&self.opts.metrics, StoreKey::Ip, KeyAction::Deleted, deleted);
        if deleted > 0 {
            self.snapshot_part.changed();
        }
        first_error.map_or(Ok(()), Err)
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

    /// Keeps the KVSTORE claims equal to the other nodes' store entries:
    /// list, watch from the listing's revision, re-list on any error.
    async fn store_loop(self: Arc<Self>) {
        let mut backoff = self.opts.relist_backoff.clone();
        loop {
            match self.backend.list_ips().await {
                Ok((entries, revision)) => {
                    self.snapshot_part.set_store_revision(revision);
                    self.apply_listing(entries);
                    self.watch_failed.store(false, Ordering::Release);
                    match self.backend.watch_ips(revision).await {
                        Ok(mut stream) => {
                            let started = Instant::now();
                            let mut events = 0u64;
                            loop {
                                match stream.next().await {
                                    Some(Ok(event)) => {
                                        events += 1;
                                        self.apply_event(event);
                                    }
                                    Some(Err(e)) => {
                                        tracing::warn!(error = %e, "IP cache watch failed; re-listing");
                                        break;
                                    }
                                    None => {
                                        tracing::warn!("IP cache watch ended; re-listing");
                                        break;
                                    }
                                }
                            }
                            // A watch that worked for a while starts over fast.
                            if events > 0 || started.elapsed() > Duration::from_secs(10) {
                                backoff.reset();
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "watching the IP cache"),
                    }
                    self.watch_failed.store(true, Ordering::Release);
                }
                Err(e) => {
                    self.watch_failed.store(true, Ordering::Release);
                    tracing::warn!(error = %e, "listing the IP cache");
                }
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    fn apply_listing(&self, entries: Vec<IpEntry>) {
        let me = &self.opts.node_name;
        let mut others: BTreeMap<IpNet, IpcacheEntry> = BTreeMap::new();
        let mut own: BTreeMap<IpNet, IpEntry> = BTreeMap::new();
        for e in entries {
            let prefix = match parse_prefix(&e.ip) {
                Ok(p) => p,
                Err(reason) => {
                    tracing::warn!(ip = %e.ip, node = %e.node, %reason, "skipping an unusable IP cache entry of the store");
                    continue;
                }
            };
            if e.identity == 0 {
                tracing::warn!(ip = %e.ip, node = %e.node, "skipping a store entry with identity 0");
                continue;
            }
            if &e.node == me {
                own.insert(prefix, e);
            } else {
                others.insert(prefix, Self::claim_from_store(prefix, &e, IpcacheSource::KvStore));
            }
        }
        let mut st = self.lock();
        let stale: Vec<IpNet> = st
            .claims
            .iter()
            .filter(|(p, c)| c.contains_key(&IpcacheSource::KvStore) && !others.contains_key(p))
            .map(|(p, _)| *p)
            .collect();
        for prefix in stale {
            self.update(&mut st, prefix, |c| {
                c.remove(&IpcacheSource::KvStore);
            });
        }
        let remote = others.len();
        for (prefix, entry) in others {
            self.update(&mut st, prefix, |c| {
                c.insert(IpcacheSource::KvStore, entry);
            });
        }
        let mut adopted = 0;
        if !st.listed {
            st.listed = true;
            // This process's lease may not be the one the store's entries
            // are bound to (a restart): the first pass writes every claim.
            st.republish_pending = true;
            let withdrawn = std::mem::take(&mut st.restored_withdrawals);
            for (prefix, e) in &own {
                let claimed = st
                    .claims
                    .get(prefix)
                    .is_some_and(|c| c.contains_key(&IpcacheSource::LocalEndpoint));
                // Withdrawn here before the restart: the pass withdraws it.
                if !claimed && !withdrawn.contains(prefix) {
                    let entry = Self::claim_from_store(*prefix, e, IpcacheSource::LocalEndpoint);
                    self.update(&mut st, *prefix, |c| {
                        c.insert(IpcacheSource::LocalEndpoint, entry);
                    });
                    st.restored.insert(*prefix);
                    adopted += 1;
                }
            }
            if adopted > 0 {
                st.restore_deadline = Some(Instant::now() + self.opts.restore_grace);
            }
        }
        tracing::info!(
            remote,
            own = own.len(),
            adopted,
            revision = st.revision,
            "IP cache listed from the store"
        );
        st.own_in_store = own;
        drop(st);
        self.snapshot_part.changed();
        self.ready.send_replace(true);
        self.reconcile.notify_one();
    }

    fn apply_event(&self, event: IpEvent) {
        let me = &self.opts.node_name;
        let mut st = self.lock();
        match event {
            IpEvent::Upsert(e) => {
                let Ok(prefix) = parse_prefix(&e.ip) else {
                    tracing::warn!(ip = %e.ip, node = %e.node, "skipping an unusable IP cache event");
                    return;
                };
                if &e.node == me {
                    st.own_in_store.insert(prefix, e);
                    // The key holds this node's entry now, no other node's.
                    self.update(&mut st, prefix, |c| {
                        c.remove(&IpcacheSource::KvStore);
                    });
                } else {
                    st.own_in_store.remove(&prefix);
                    if st
                        .claims
                        .get(&prefix)
                        .is_some_and(|c| c.contains_key(&IpcacheSource::LocalEndpoint))
                    {
                        tracing::warn!(
                            prefix = %prefix,
                            node = %e.node,
                            "another node published an address an endpoint of this node claims; the local claim stays effective here"
                        );
                    }
                    let entry = Self::claim_from_store(prefix, &e, IpcacheSource::KvStore);
                    self.update(&mut st, prefix, |c| {
                        c.insert(IpcacheSource::KvStore, entry);
                    });
                }
            }
            IpEvent::Delete { ip } => {
                let Ok(prefix) = parse_prefix(&ip) else {
                    return;
                };
                st.own_in_store.remove(&prefix);
                self.update(&mut st, prefix, |c| {
                    c.remove(&IpcacheSource::KvStore);
                });
                if st
                    .claims
                    .get(&prefix)
                    .is_some_and(|c| c.contains_key(&IpcacheSource::LocalEndpoint))
                {
                    // The store lost an entry this node claims (lease
                    // expired, another node's delete): publish it again.
                    self.reconcile.notify_one();
                }
            }
        }
        drop(st);
        self.snapshot_part.changed();
    }

    /// Keeps this node's store entries equal to its LOCAL_ENDPOINT claims.
    async fn publish_loop(self: Arc<Self>) {
        let this = &*self;
        // Woken with whether every claim is to be written again.
        let woken = || async move {
            let deadline = this.lock().restore_deadline;
            tokio::select! {
                () = this.backend.lease_renewed() => {
                    tracing::info!("node lease replaced; publishing this node's IP cache entries again");
                    true
                }
                () = this.reconcile.notified() => false,
                () = sleep_until_opt(deadline) => {
                    this.expire_restored();
                    false
                }
            }
        };
        let pass = |republish| this.reconcile_once(republish);
        let (metrics, resync) = (&self.opts.metrics, self.opts.resync_interval);
        reconcile::run_passes(ReconciledKeys::IpEntries, metrics, resync, woken, pass).await;
    }

    /// Drops the restored claims nobody claimed again.
    fn expire_restored(&self) {
        let mut st = self.lock();
        st.restore_deadline = None;
        st.local_generation += 1;
        let expired = std::mem::take(&mut st.restored);
        for prefix in &expired {
            self.update(&mut st, *prefix, |c| {
                c.remove(&IpcacheSource::LocalEndpoint);
            });
        }
        if !expired.is_empty() {
            tracing::info!(
                count = expired.len(),
                "withdrawing entries of this node restored at start (from the store or the local snapshot) that no endpoint claimed again"
            );
        }
    }

    /// One pass: every LOCAL_ENDPOINT claim is in the store (all written
    /// again with `republish`), and this node's store entries no claim backs
    /// are withdrawn (once the store was listed). Only the publish loop runs
    /// it, so passes never overlap; its outcome is recorded in `progress`.
    async fn reconcile_once(&self, republish: bool) -> Result<(), BackendError> {
        let (writes, withdraw, generation, republished) = {
            let st = self.lock();
            let republish = republish || st.republish_pending;
            let desired = self.desired(&st);
            let withdraw: Vec<IpNet> = if st.listed {
                st.own_in_store
                    .keys()
                    .filter(|p| !desired.contains_key(p))
                    .copied()
                    .collect()
            } else {
                Vec::new()
            };
            let writes: Vec<StoreWrite> = desired
                .into_iter()
                .filter_map(|(p, e)| {
                    let action = match st.own_in_store.get(&p) {
                        None => Some(KeyAction::Created),
                        Some(held) if *held != e => Some(KeyAction::Updated),
                        Some(_) => None,
                    };
                    (republish || action.is_some()).then_some((p, e, action))
                })
                .collect();
            (writes, withdraw, st.local_generation, republish)
        };
        if !writes.is_empty() || !withdraw.is_empty() {
            tracing::info!(
                publish = writes.len(),
                withdraw = withdraw.len(),
                "syncing this node's IP cache entries to the store"
            );
        }
        let written = self.write_store(writes).await;
        let withdrawn = self.withdraw_store(withdraw).await;
        let result = written.and(withdrawn);
        if republished && result.is_ok() {
            self.lock().republish_pending = false;
        }
        self.progress.send_replace(PublishProgress {
            attempted: generation,
            error: result
                .as_ref()
                .err()
                .map(|e| format!("publishing this node's IP cache entries: {e}")),
        });
        result
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

// ------------------------------------------------------------- loader sync --

/// How [`LoaderSync`] reaches svc-loader.
#[derive(Debug, Clone)]
pub struct LoaderSyncOptions {
    /// svc-loader's socket.
    pub socket: PathBuf,
    /// Connect and per-call timeouts.
    pub client: ClientOptions,
    /// Delays between failed sessions.
    pub retry: Backoff,
    /// How often an idle session asks the loader who it is, to notice a
    /// restart (and resync) when no change is pushed.
    pub probe_interval: Duration,
    /// Entries per call (at most [`LOADER_MAX_BATCH`]).
    pub batch_size: usize,
}

impl LoaderSyncOptions {
    /// Defaults for `socket`: probe every second, batches of 4096.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            client: ClientOptions::default(),
            retry: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            probe_interval: Duration::from_secs(1),
            batch_size: LOADER_MAX_BATCH,
        }
    }
}

/// The state of the push to svc-loader (`GetStatus`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoaderSyncStatus {
    /// A session is up (the last call succeeded).
    pub connected: bool,
    /// svc-loader's boot id at the last full sync.
    pub loader_boot_id: String,
    /// When the last full sync completed.
    pub last_full_sync: Option<SystemTime>,
    /// Full syncs done since start.
    pub full_syncs: u64,
    /// Changes of the effective view not yet pushed (every entry before the
    /// first full sync).
    pub pending: u32,
    /// The latest error; empty once a session is up again.
    pub last_error: String,
}

impl LoaderSyncStatus {
    /// The protobuf message.
    pub fn to_proto(&self) -> pb::LoaderSyncStatus {
        pb::LoaderSyncStatus {
            connected: self.connected,
            loader_boot_id: self.loader_boot_id.clone(),
            last_full_sync_unix_nanos: self
                .last_full_sync
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
            pending: self.pending,
            last_error: self.last_error.clone(),
        }
    }
}

/// Why a session with the loader ended.
#[derive(Debug, thiserror::Error)]
enum SyncError {
    #[error("{0}")]
    Connect(#[from] rivet_common::grpc::ConnectError),
    #[error("{action}: svc-loader answered {code:?}: {message}")]
    Call {
        action: &'static str,
        code: tonic::Code,
        message: String,
    },
}

fn call_error(action: &'static str) -> impl FnOnce(tonic::Status) -> SyncError {
    move |s| SyncError::Call {
        action,
        code: s.code(),
        message: s.message().to_string(),
    }
}

/// Pushes an [`IpCache`]'s effective view to svc-loader; see the module docs.
pub struct LoaderSync {
    ipcache: Arc<IpCache>,
    opts: LoaderSyncOptions,
    status: Mutex<LoaderSyncStatus>,
    /// The cache revision the loader holds.
    pushed: watch::Sender<u64>,
}

impl std::fmt::Debug for LoaderSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoaderSync")
            .field("opts", &self.opts)
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

impl LoaderSync {
    /// A sync of `ipcache` to the loader at `opts.socket`; call
    /// [`run`](Self::run).
    pub fn new(ipcache: Arc<IpCache>, opts: LoaderSyncOptions) -> Arc<Self> {
        let (pushed, _) = watch::channel(0);
        Arc::new(Self {
            ipcache,
            opts,
            status: Mutex::new(LoaderSyncStatus::default()),
            pushed,
        })
    }

    /// Starts pushing; runs until aborted.
    pub fn run(self: &Arc<Self>) -> JoinHandle<()> {
        tokio::spawn(self.clone().sync_loop())
    }

    fn lock(&self) -> MutexGuard<'_, LoaderSyncStatus> {
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state of the push.
    pub fn status(&self) -> LoaderSyncStatus {
        let mut status = self.lock().clone();
        status.pending = if status.full_syncs == 0 {
            self.ipcache.len() as u32
        } else {
            self.ipcache.revision().saturating_sub(*self.pushed.borrow()) as u32
        };
        status
    }

    /// The cache revision the loader holds.
    pub fn pushed_revision(&self) -> u64 {
        *self.pushed.borrow()
    }

    /// Waits until the loader holds the cache at `revision` or later
    /// (e.g. [`IpCache::revision`] after a change), or `timeout` passes;
    /// returns whether it does.
    pub async fn wait_pushed(&self, revision: u64, timeout: Duration) -> bool {
        let mut rx = self.pushed.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|r| *r >= revision))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// The loader's form of an effective entry: identity, and the host as
    /// tunnel endpoint for another node's IPv4 host (the loader's underlay
    /// is IPv4 only).
    pub fn loader_entry(&self, e: &IpcacheEntry) -> loader_pb::IpcacheEntry {
        let tunnel = match (e.source, e.host_ip) {
            (IpcacheSource::KvStore | IpcacheSource::Kubernetes, Some(IpAddr::V4(host)))
                if self.ipcache.opts.host_ip != Some(IpAddr::V4(host)) && !host.is_unspecified() =>
            {
                host.octets().to_vec()
            }
            _ => Vec::new(),
        };
        loader_pb::IpcacheEntry {
            prefix: Some(loader_prefix(&e.prefix)),
            identity: e.identity,
            tunnel_endpoint: tunnel,
        }
    }

    async fn sync_loop(self: Arc<Self>) {
        self.ipcache.wait_ready().await;
        let mut backoff = self.opts.retry.clone();
        loop {
            let error = match self.session(&mut backoff).await {
                Ok(()) => return,
                Err(e) => e,
            };
            let delay = backoff.next_delay();
            tracing::warn!(error = %error, ?delay, "pushing the ipcache to svc-loader; retrying");
            {
                let mut status = self.lock();
                status.connected = false;
                status.last_error = error.to_string();
            }
            tokio::time::sleep(delay).await;
        }
    }

    /// Connect, full sync, then deltas until something fails. `Ok` only
    /// when the cache is gone.
    async fn session(&self, backoff: &mut Backoff) -> Result<(), SyncError> {
        let channel = connect_unix(&self.opts.socket, &self.opts.client).await?;
        let mut loader = LoaderServiceClient::new(channel.clone());
        let mut daemon = DaemonClient::new(channel);
        let restarted = Arc::new(AtomicBool::new(false));
        let flag = restarted.clone();
        let boot = BootIdWatch::new("svc-loader", move |_| flag.store(true, Ordering::SeqCst));
        let mut deltas = self.full_sync(&mut loader, &boot, &restarted).await?;
        backoff.reset();
        let mut probe = tokio::time::interval(self.opts.probe_interval);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        probe.tick().await;
        loop {
            if restarted.load(Ordering::SeqCst) {
                deltas = self.full_sync(&mut loader, &boot, &restarted).await?;
                continue;
            }
            tokio::select! {
                first = deltas.recv() => {
                    let mut batch: BTreeMap<IpNet, Option<IpcacheEntry>> = BTreeMap::new();
                    let mut revision = 0;
                    let mut lagged = false;
                    let mut next = first;
                    loop {
                        match next {
                            Ok(d) => {
                                revision = d.revision;
                                batch.insert(d.prefix, d.entry);
                            }
                            Err(broadcast::error::RecvError::Lagged(n)) => {
                                tracing::info!(missed = n, "the loader push fell behind the ipcache; full resync");
                                lagged = true;
                                break;
                            }
                            Err(broadcast::error::RecvError::Closed) => return Ok(()),
                        }
                        next = match deltas.try_recv() {
                            Ok(d) => Ok(d),
                            Err(broadcast::error::TryRecvError::Empty) => break,
                            Err(broadcast::error::TryRecvError::Lagged(n)) => Err(broadcast::error::RecvError::Lagged(n)),
                            Err(broadcast::error::TryRecvError::Closed) => Err(broadcast::error::RecvError::Closed),
                        };
                    }
                    if lagged {
                        deltas = self.full_sync(&mut loader, &boot, &restarted).await?;
                        continue;
                    }
                    self.push(&mut loader, &boot, batch).await?;
                    self.pushed.send_replace(revision);
                }
                _ = probe.tick() => {
                    let info = daemon
                        .get_info(GetInfoRequest {})
                        .await
                        .map_err(call_error("asking svc-loader who it is"))?
                        .into_inner();
                    boot.observe_message(&info);
                }
            }
        }
    }

    /// Replaces the loader's ipcache with the effective view; returns the
    /// receiver of the deltas after it.
    async fn full_sync(
        &self,
        loader: &mut LoaderServiceClient<DaemonChannel>,
        boot: &BootIdWatch,
        restarted: &AtomicBool,
    ) -> Result<broadcast::Receiver<IpcacheDelta>, SyncError> {
        let started = Instant::now();
        let (snapshot, revision, deltas) = self.ipcache.subscribe();
        let entries: Vec<loader_pb::IpcacheEntry> = snapshot.iter().map(|e| self.loader_entry(e)).collect();
        let chunks: Vec<loader_pb::ReplaceIpcacheRequest> = entries
            .chunks(self.batch_size())
            .map(|c| loader_pb::ReplaceIpcacheRequest { entries: c.to_vec() })
            .collect();
        let response = loader
            .replace_ipcache(tokio_stream::iter(chunks))
            .await
            .map_err(call_error("replacing svc-loader's ipcache"))?
            .into_inner();
        // Whatever restart this response reveals, this sync covered it.
        boot.observe_message(&response);
        restarted.store(false, Ordering::SeqCst);
        {
            let mut status = self.lock();
            status.connected = true;
            status.loader_boot_id.clone_from(&response.boot_id);
            status.last_full_sync = Some(SystemTime::now());
            status.full_syncs += 1;
            status.last_error.clear();
        }
        self.pushed.send_replace(revision);
        tracing::info!(
            entries = entries.len(),
            upserted = response.upserted,
            unchanged = response.unchanged,
            deleted = response.deleted,
            loader_boot_id = %response.boot_id,
            revision,
            elapsed = ?started.elapsed(),
            "ipcache fully synced to svc-loader"
        );
        Ok(deltas)
    }

    /// Pushes coalesced changes: upserts, then deletes, in batches.
    async fn push(
        &self,
        loader: &mut LoaderServiceClient<DaemonChannel>,
        boot: &BootIdWatch,
        batch: BTreeMap<IpNet, Option<IpcacheEntry>>,
    ) -> Result<(), SyncError> {
        let mut upserts = Vec::new();
        let mut deletes = Vec::new();
        for (prefix, entry) in batch {
            match entry {
                Some(e) => upserts.push(self.loader_entry(&e)),
                None => deletes.push(loader_prefix(&prefix)),
            }
        }
        let (upserted, deleted) = (upserts.len(), deletes.len());
        for chunk in upserts.chunks(self.batch_size()) {
            let r = loader
                .upsert_ipcache(loader_pb::UpsertIpcacheRequest {
                    entries: chunk.to_vec(),
                })
                .await
                .map_err(call_error("upserting svc-loader's ipcache entries"))?
                .into_inner();
            boot.observe_message(&r);
        }
        for chunk in deletes.chunks(self.batch_size()) {
            let r = loader
                .delete_ipcache(loader_pb::DeleteIpcacheRequest {
                    prefixes: chunk.to_vec(),
                })
                .await
                .map_err(call_error("deleting svc-loader's ipcache entries"))?
                .into_inner();
            boot.observe_message(&r);
        }
        tracing::debug!(upserted, deleted, "ipcache changes pushed to svc-loader");
        Ok(())
    }

    fn batch_size(&self) -> usize {
        self.opts.batch_size.clamp(1, LOADER_MAX_BATCH)
    }
}

/// A prefix in the loader's form.
pub fn loader_prefix(prefix: &IpNet) -> loader_pb::IpPrefix {
    loader_pb::IpPrefix {
        address: match prefix.addr() {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        },
        prefix_length: u32::from(prefix.prefix_len()),
    }
}

#[cfg(test)]
mod tests {

    use rivet_common::testing::etcd::EtcdServer;
    use svc_loader::testing::LoaderNode;

    use super::*;
    use crate::embedded_backend::EmbeddedBackend;
    use crate::etcd_backend::{EtcdBackend, EtcdOptions};

    const WAIT: Duration = Duration::from_secs(10);

    fn net(text: &str) -> IpNet {
        parse_prefix(text).unwrap()
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn pod(prefix: &str, identity: u32, source: IpcacheSource, host: Option<&str>) -> IpcacheEntry {
        IpcacheEntry {
            host_ip: host.map(ip),
            pod_namespace: "default".into(),
            pod_name: format!("pod-{identity}"),
            ..IpcacheEntry::new(net(prefix), identity, source)
        }
    }

    /// Polls `f` until it yields, failing with `what` after [`WAIT`].
    async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn etcd_node(etcd: &EtcdServer, name: &str, host: &str) -> Arc<IpCache> {
        let backend = EtcdBackend::connect(EtcdOptions::new(vec![etcd.endpoint()], name))
            .await
            .expect("connecting to the test etcd");
        let opts = IpCacheOptions {
            host_ip: Some(ip(host)),
            ..IpCacheOptions::new(name)
        };
        let cache = IpCache::new(Arc::new(backend), opts);
        cache.run();
        tokio::time::timeout(WAIT, cache.wait_ready())
            .await
            .expect("the first listing completes");
        cache
    }

    /// What a subscriber reconstructs from a snapshot and its deltas.
    struct View {
        entries: BTreeMap<IpNet, IpcacheEntry>,
        rx: broadcast::Receiver<IpcacheDelta>,
        revision: u64,
    }

    impl View {
        fn of(cache: &IpCache) -> Self {
            let (snapshot, revision, rx) = cache.subscribe();
            Self {
                entries: snapshot.into_iter().map(|e| (e.prefix, e)).collect(),
                rx,
                revision,
            }
        }

        /// Applies deltas until `pred` holds.
        async fn until(&mut self, what: &str, pred: impl Fn(&BTreeMap<IpNet, IpcacheEntry>) -> bool) {
            let deadline = Instant::now() + WAIT;
            while !pred(&self.entries) {
                let delta = tokio::time::timeout_at(deadline, self.rx.recv())
                    .await
                    .unwrap_or_else(|_| panic!("timed out waiting in the watch stream until {what}"))
                    .expect("no lag in this test");
                assert!(delta.revision > self.revision, "revisions increase");
                self.revision = delta.revision;
                match delta.entry {
                    Some(e) => self.entries.insert(delta.prefix, e),
                    None => self.entries.remove(&delta.prefix),
                };
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_entry_published_on_one_node_reaches_the_other_and_claims_follow_precedence() {
        let etcd = EtcdServer::start().expect("starting etcd");
        let a = etcd_node(&etcd, "node-a", "10.0.0.1").await;
        let b = etcd_node(&etcd, "node-b", "10.0.0.2").await;
        let x = net("198.18.1.5/32");
        let mut b_view = View::of(&b);

        // A's endpoint → B sees it as KVSTORE, in its view and its stream.
        a.upsert(vec![pod("198.18.1.5", 300, IpcacheSource::LocalEndpoint, None)])
            .await
            .unwrap();
        assert_eq!(
            a.get(&x).unwrap().host_ip,
            Some(ip("10.0.0.1")),
            "a local claim gets the node's host"
        );
        let seen = eventually("B has A's entry", || b.get(&x)).await;
        assert_eq!(
            (seen.source, seen.identity, seen.node_name.as_str(), seen.host_ip),
            (IpcacheSource::KvStore, 300, "node-a", Some(ip("10.0.0.1")))
        );
        assert_eq!(
            (seen.pod_namespace.as_str(), seen.pod_name.as_str()),
            ("default", "pod-300")
        );
        b_view
            .until("A's entry is streamed to B", |v| v.get(&x) == Some(&seen))
            .await;
        assert!(
            a.claims(&x).iter().all(|c| c.source == IpcacheSource::LocalEndpoint),
            "A's own entry, echoed by the store, is no KVSTORE claim on A: {:?}",
            a.claims(&x)
        );

        // KUBERNETES ranks below KVSTORE: claimed, not effective.
        assert_eq!(
            b.upsert(vec![pod(
                "198.18.1.5",
                400,
                IpcacheSource::Kubernetes,
                Some("10.0.0.9")
            )])
            .await
            .unwrap(),
            0
        );
        assert_eq!(b.get(&x).unwrap().source, IpcacheSource::KvStore);
        assert_eq!(b.claims(&x).len(), 2);

        // LOCAL_ENDPOINT ranks above KVSTORE.
        assert_eq!(
            b.upsert(vec![pod("198.18.1.5", 301, IpcacheSource::LocalEndpoint, None)])
                .await
                .unwrap(),
            1
        );
        let local = b.get(&x).unwrap();
        assert_eq!((local.source, local.identity), (IpcacheSource::LocalEndpoint, 301));
        // B's write took the store key; A keeps its own claim effective.
        eventually("A hears of B's claim as KVSTORE", || {
            a.claims(&x)
                .iter()
                .any(|c| c.source == IpcacheSource::KvStore && c.identity == 301)
                .then_some(())
        })
        .await;
        assert_eq!(a.get(&x).unwrap().identity, 300);
        b_view
            .until("B's local claim is streamed", |v| {
                v.get(&x).map(|e| e.identity) == Some(301)
            })
            .await;

        // B withdraws: the store key goes, A still claims it and publishes
        // it again, so B falls back to A's entry.
        assert_eq!(b.delete(IpcacheSource::LocalEndpoint, &[x]).await.unwrap(), 1);
        let back = eventually("A re-published its entry", || {
            b.get(&x)
                .filter(|e| e.source == IpcacheSource::KvStore && e.identity == 300)
        })
        .await;
        assert_eq!(back.node_name, "node-a");

        // A withdraws: B falls back to its KUBERNETES claim, then nothing.
        assert_eq!(a.delete(IpcacheSource::LocalEndpoint, &[x]).await.unwrap(), 1);
        assert_eq!(a.get(&x), None);
        eventually("B falls back to KUBERNETES", || {
            b.get(&x)
                .filter(|e| e.source == IpcacheSource::Kubernetes && e.identity == 400)
        })
        .await;
        assert_eq!(b.delete(IpcacheSource::Kubernetes, &[x]).await.unwrap(), 1);
        assert_eq!(b.get(&x), None);
        b_view.until("the removal is streamed", |v| !v.contains_key(&x)).await;
        assert_eq!(
            b_view.entries.values().cloned().collect::<Vec<_>>(),
            b.list(),
            "the streamed view equals the cache"
        );
        assert_eq!(
            b.delete(IpcacheSource::Kubernetes, &[x]).await.unwrap(),
            0,
            "idempotent"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn entries_of_a_previous_run_stay_for_the_grace_then_only_reclaimed_ones_remain() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.json");
        {
            let backend = Arc::new(EmbeddedBackend::open(&path, "n1").unwrap());
            let cache = IpCache::new(backend, IpCacheOptions::new("n1"));
            let tasks = cache.run();
            cache
                .upsert(vec![
                    pod("198.18.2.1", 300, IpcacheSource::LocalEndpoint, None),
                    pod("198.18.2.2", 301, IpcacheSource::LocalEndpoint, None),
                ])
                .await
                .unwrap();
            for t in tasks {
                t.abort();
                let _ = t.await;
            }
        }
        let backend = Arc::new(EmbeddedBackend::open(&path, "n1").unwrap());
        let opts = IpCacheOptions {
            restore_grace: Duration::from_millis(300),
            ..IpCacheOptions::new("n1")
        };
        let cache = IpCache::new(backend.clone(), opts);
        cache.run();
        cache.wait_ready().await;
        let (kept, dropped) = (net("198.18.2.1"), net("198.18.2.2"));
        assert_eq!(cache.get(&kept).map(|e| e.identity), Some(300), "restored at start");
        assert_eq!(
            cache.get(&dropped).map(|e| e.source),
            Some(IpcacheSource::LocalEndpoint)
        );
        // The endpoint replays one of them.
        cache
            .upsert(vec![pod("198.18.2.1", 300, IpcacheSource::LocalEndpoint, None)])
            .await
            .unwrap();
        eventually("the unclaimed entry expires", || {
            cache.get(&dropped).is_none().then_some(())
        })
        .await;
        assert!(cache.get(&kept).is_some(), "a re-claimed entry stays");
        let deadline = Instant::now() + WAIT;
        loop {
            let (entries, _) = backend.list_ips().await.unwrap();
            let ips: Vec<&str> = entries.iter().map(|e| e.ip.as_str()).collect();
            if ips == ["198.18.2.1"] {
                break;
            }
            assert!(Instant::now() < deadline, "store still holds {ips:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn loader_bin() -> PathBuf {
        rivet_common::testing::workspace_binary("svc-loader")
    }

    async fn loader_ipcache(
        client: &mut LoaderServiceClient<DaemonChannel>,
    ) -> BTreeMap<(Vec<u8>, u32), (u32, Vec<u8>)> {
        let r = client
            .list_ipcache(loader_pb::ListIpcacheRequest {
                page_size: 10000,
                start_after: None,
            })
            .await
            .expect("listing the loader's ipcache")
            .into_inner();
        assert!(r.complete);
        r.entries
            .into_iter()
            .map(|e| {
                let p = e.prefix.unwrap();
                ((p.address, p.prefix_length), (e.identity, e.tunnel_endpoint))
            })
            .collect()
    }

    fn key(prefix: &str) -> (Vec<u8>, u32) {
        let p = loader_prefix(&net(prefix));
        (p.address, p.prefix_length)
    }

    async fn loader_until(
        client: &mut LoaderServiceClient<DaemonChannel>,
        what: &str,
        pred: impl Fn(&BTreeMap<(Vec<u8>, u32), (u32, Vec<u8>)>) -> bool,
    ) {
        let deadline = Instant::now() + WAIT;
        loop {
            let entries = loader_ipcache(client).await;
            if pred(&entries) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting until {what}; the loader holds {entries:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_loader_gets_the_view_and_a_full_resync_after_its_restart() {
        let bin = loader_bin();
        let mut node = LoaderNode::start(&bin, &[], &[]).await.expect("starting svc-loader");
        let dir = tempfile::tempdir().unwrap();
        let backend = Arc::new(EmbeddedBackend::open(dir.path().join("store.json"), "n1").unwrap());
        let opts = IpCacheOptions {
            host_ip: Some(ip("10.1.0.1")),
            ..IpCacheOptions::new("n1")
        };
        let cache = IpCache::new(backend, opts);
        cache.run();
        let sync = LoaderSync::new(
            cache.clone(),
            LoaderSyncOptions {
                probe_interval: Duration::from_millis(100),
                retry: Backoff::new(Duration::from_millis(50), Duration::from_millis(500)),
                ..LoaderSyncOptions::new(node.loader.socket())
            },
        );
        sync.run();
        let mut client = node.client().await;

        cache
            .upsert(vec![
                pod("198.18.5.2", 300, IpcacheSource::LocalEndpoint, None),
                pod("198.18.6.0/24", 301, IpcacheSource::Kubernetes, Some("10.1.0.2")),
            ])
            .await
            .unwrap();
        loader_until(&mut client, "the entries reach the loader", |e| {
            e.get(&key("198.18.5.2")) == Some(&(300, Vec::new()))
                && e.get(&key("198.18.6.0/24")) == Some(&(301, vec![10, 1, 0, 2]))
                && e.get(&key("0.0.0.0/0")) == Some(&(2, Vec::new()))
                && e.get(&key("::/0")) == Some(&(2, Vec::new()))
        })
        .await;
        assert!(sync.wait_pushed(cache.revision(), WAIT).await);
        let before = sync.status();
        assert!(before.connected, "{before:?}");
        assert_eq!(before.loader_boot_id, node.loader.info().boot_id);
        assert_eq!((before.pending, before.last_error.as_str()), (0, ""));

        // Lost behind the cache's back, then the loader restarts.
        let gone = client
            .delete_ipcache(loader_pb::DeleteIpcacheRequest {
                prefixes: vec![loader_prefix(&net("198.18.5.2"))],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(gone.deleted, 1);
        node.loader.kill9();
        node.loader.restart().await.expect("restarting svc-loader");
        let mut client = node.client().await;
        loader_until(&mut client, "the full resync restores the entry", |e| {
            e.get(&key("198.18.5.2")) == Some(&(300, Vec::new()))
        })
        .await;
        let after = eventually("the status shows the new loader", || {
            let s = sync.status();
            (s.loader_boot_id == node.loader.info().boot_id).then_some(s)
        })
        .await;
        assert_ne!(after.loader_boot_id, before.loader_boot_id);
        assert!(after.full_syncs > before.full_syncs, "{after:?}");
        assert!(after.last_full_sync > before.last_full_sync);
        assert!(after.connected);

        // Withdrawn claims leave the loader.
        cache
            .delete(IpcacheSource::LocalEndpoint, &[net("198.18.5.2")])
            .await
            .unwrap();
        cache
            .delete(IpcacheSource::Kubernetes, &[net("198.18.6.0/24")])
            .await
            .unwrap();
        loader_until(&mut client, "the withdrawn entries leave the loader", |e| {
            !e.contains_key(&key("198.18.5.2")) && !e.contains_key(&key("198.18.6.0/24"))
        })
        .await;
        assert!(sync.wait_pushed(cache.revision(), WAIT).await);
        assert_eq!(sync.status().pending, 0);
    }
}
