//! [`EtcdBackend`]: the [`IdentityBackend`] over etcd v3 (`etcd-client`).
//!
//! # Keys
//!
//! Under a configurable prefix (default `rivet/state/`), see [`Layout`]:
//!
//! - `identities/v1/id/<id>` → canonical labels (the master key, no lease);
//! - `identities/v1/value/<labels>/<node>` → the id in decimal, bound to the
//!   node's lease;
//! - `ip/v1/<cluster>/<ip>` → [`IpEntry`] as JSON, bound to the node's lease;
//! - `.heartbeat`, `nodes/v1/<cluster>/<node>`,
//!   `services/v1/<cluster>/<ns>/<name>`: written by rivet-operator (the
//!   heartbeat's RFC 3339 time; `rivet_common::cluster` records).
//!
//! Labels are used verbatim in value keys (`k8s:app=web,k8s:tier=db`).
//! They never contain `/` except in a label key's DNS prefix
//! (`k8s:app.kubernetes.io/name=x`); node names never contain `/`. So the
//! node is the part of a value key after the LAST `/`, and the value keys of
//! exactly one label set are those under `value/<labels>/` whose rest holds
//! no `/`. A longer label set can share that prefix (`k8s:example.com`, a
//! label with an empty value, and `k8s:example.com/x=y`): such "colliding"
//! keys are filtered out everywhere, and allocation takes a slower but still
//! atomic path when they exist (see [`EtcdBackend::create_identity`]).
//!
//! # Allocation (one transaction, no locks)
//!
//! `create_identity(id, labels)` is one transaction: if `id`'s master key was
//! never created (`create_revision == 0`) AND the range `value/<labels>/`
//! holds no key (etcd compares every key of a range; an empty range compares
//! as a key with revision 0, so `create_revision == 0` over it holds exactly
//! when it is empty), put the master key and this node's value key.
//! Otherwise the same transaction reads the first value key of the labels and
//! the master key, so the answer (`LabelsHeldAs`, `IdTaken`) needs no second
//! round trip.
//!
//! # Garbage collection (the operator's)
//!
//! Master keys stay after their last value key is gone; rivet-operator
//! deletes one that had no value key for two rounds, in a transaction that
//! compares its mod revision with the one seen in the first round. So that
//! reuse between the rounds fences it, [`acquire`](EtcdBackend::acquire)
//! puts the master again whenever it creates a value key (creation and
//! re-creation write the master anyway).
//!
//! # Lease
//!
//! [`EtcdBackend::connect`] grants a lease (`lease_ttl`, whole seconds) and a
//! background task keeps it alive every TTL/3 over a keepalive stream.
//! [`EtcdBackend::start`] returns at once, also while etcd is unreachable
//! (svc-identity starts and serves from its local snapshot): the task grants
//! the first lease when etcd answers and reports it like a replacement
//! (below); until then writes bound to the lease are `Unavailable`. While
//! etcd is unreachable the task keeps trying to resume the keepalive of the
//! SAME lease (etcd keeps leases across its own restarts and refreshes their
//! TTL when a leader is elected, so an etcd restart loses nothing). Only when
//! etcd reports the lease gone (a keepalive answered with TTL 0, e.g. after a
//! partition longer than the TTL) does the task grant a new lease, with
//! backoff until it succeeds, swap it in (every later write uses it) and wake
//! [`lease_renewed`](IdentityBackend::lease_renewed) waiters, who must write
//! their keys again (each waiter keeps the last replacement it heard of, so
//! one that happens between two calls is reported by the next, and every
//! waiter hears every replacement). A write refused with "requested lease
//! not found" pokes the task to check at once.
//!
//! Dropping the backend stops the keepalive and revokes nothing: a crashed
//! node's keys expire after the TTL. [`EtcdBackend::shutdown`] revokes the
//! lease (clean stop: this node's value keys and IP entries vanish at once).
//!
//! # Errors
//!
//! Every etcd failure (connection refused, timeout, no leader, lease not
//! found, ...) is [`BackendError::Unavailable`] naming the action; every
//! unary request is bounded by `request_timeout`. A stored value that cannot
//! be decoded is [`BackendError::Corrupt`] when a single-key answer depends
//! on it; listings and watches skip such entries with a warning (one bad key
//! must not stop a node from listing identities; the allocator never reuses
//! a skipped id because creation compares the master key itself).

use std::fmt;
use std::future::Future;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse,
    TxnResponse, WatchOptions,
};
use futures::StreamExt;
use futures::stream::BoxStream;
use rivet_common::backoff::Backoff;
use rivet_common::controller::{Controller, Controllers, Progress};
use tokio::sync::{Notify, watch};

use crate::backend::{
    AcquireOutcome, BackendError, CreateOutcome, IdentityBackend, IdentityEvent, IdentityRecord, IpEntry, IpEvent,
    NodeKeyEvent, NodeStore, Revision,
};

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "rivet/state/";
/// Default cluster name (IP cache keys).
pub const DEFAULT_CLUSTER: &str = "default";
/// Default lease TTL: 15 min, as Cilium's kvstore lease. A single etcd
/// member that hangs (rather than restarts, which resets leases) expires
/// every lease shorter than the hang when it continues: the nodes' records
/// and their pods' IP entries would vanish for an instant and peers would
/// replace their routes (2-4 packets of 10 million lost after a 60 s hang
/// with 15 s). The cost: a node that crashes without Kubernetes to remove
/// it stays a peer, and its identities referenced, until the lease ends.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(15 * 60);
/// Default timeout of a connection attempt.
pub const DEFAULT_DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Default timeout of one request.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Attempts of the slow, collision-aware paths before reporting contention.
const MAX_ATTEMPTS: usize = 8;
/// HTTP/2 keepalive ping interval (etcd refuses pings more often than every 5 s).
const HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// The lease id before one was granted (etcd never grants 0).
const NO_LEASE: i64 = 0;

/// Keys per request when listing a prefix: ~200 KB of IP entries, far
/// under etcd-client's 4 MiB answer limit.
const LIST_PAGE_SIZE: i64 = 1000;

/// The key layout of DESIGN.md §4 under a prefix, shared by both backends
/// (the embedded store uses the default prefix, so its keys can be copied to
/// etcd as they are).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    prefix: String,
    cluster: String,
}

impl Layout {
    /// The layout under `prefix` (a `/` is appended when missing from a
    /// non-empty prefix) for `cluster`.
    pub fn new(prefix: &str, cluster: &str) -> Self {
        let mut prefix = prefix.to_string();
        if !prefix.is_empty() && !prefix.ends_with('/') {
            prefix.push('/');
        }
        Self {
            prefix,
            cluster: cluster.to_string(),
        }
    }

    /// The prefix, ending with `/` unless empty.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The cluster name.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// `<prefix>identities/v1/id/`: every master key.
    pub fn id_prefix(&self) -> String {
        format!("{}identities/v1/id/", self.prefix)
    }

    /// `<prefix>identities/v1/id/<id>`: the master key of `id`.
    pub fn id_key(&self, id: u32) -> String {
        format!("{}identities/v1/id/{id}", self.prefix)
    }

    /// `<prefix>identities/v1/value/`: every value key.
    pub fn value_root(&self) -> String {
        format!("{}identities/v1/value/", self.prefix)
    }

    /// The label sets of `node`'s value keys among `keys` (other keys are
    /// skipped), sorted. Labels may hold `/`, node names never do: the node
    /// is the last segment.
    ///
    /// ```
    /// use svc_identity::etcd_backend::Layout;
    /// let layout = Layout::new("rivet/state/", "default");
    /// let keys = [
    ///     "rivet/state/identities/v1/value/k8s:app=web/n1",
    ///     "rivet/state/identities/v1/value/k8s:app=web/n2",
    ///     "rivet/state/identities/v1/value/k8s:a/b=c/n1",
    ///     "rivet/state/identities/v1/id/256",
    /// ];
    /// assert_eq!(layout.node_value_labels("n1", keys), ["k8s:a/b=c", "k8s:app=web"]);
    /// ```
    pub fn node_value_labels<'k>(&self, node: &str, keys: impl IntoIterator<Item = &'k str>) -> Vec<String> {
        let root = self.value_root();
        let mut labels: Vec<String> = keys
            .into_iter()
            .filter_map(|key| {
                let (labels, owner) = key.strip_prefix(&root)?.rsplit_once('/')?;
                (owner == node && !labels.is_empty()).then(|| labels.to_string())
            })
            .collect();
        labels.sort();
        labels
    }

    /// `<prefix>identities/v1/value/<labels>/`: the value keys of `labels`
    /// (and of longer label sets that start with `<labels>/`, see the module
    /// docs).
    pub fn value_prefix(&self, labels: &str) -> String {
        format!("{}identities/v1/value/{labels}/", self.prefix)
    }

    /// `<prefix>identities/v1/value/<labels>/<node>`: `node`'s value key.
    pub fn value_key(&self, labels: &str, node: &str) -> String {
        format!("{}identities/v1/value/{labels}/{node}", self.prefix)
    }

    /// `<prefix>ip/v1/<cluster>/`: every IP cache entry of the cluster.
    pub fn ip_prefix(&self) -> String {
        format!("{}ip/v1/{}/", self.prefix, self.cluster)
    }

    /// `<prefix>ip/v1/<cluster>/<ip>`.
    pub fn ip_key(&self, ip: &str) -> String {
        format!("{}ip/v1/{}/{ip}", self.prefix, self.cluster)
    }

    /// `<prefix>.heartbeat`: the time rivet-operator's leader last wrote
    /// (RFC 3339), see svc-identity's heartbeat watchdog.
    pub fn heartbeat_key(&self) -> String {
        format!("{}.heartbeat", self.prefix)
    }

    /// `<prefix>nodes/v1/<cluster>/`: every node record of the cluster
    /// (`rivet_common::cluster::NodeRecord`).
    pub fn node_prefix(&self) -> String {
        format!("{}nodes/v1/{}/", self.prefix, self.cluster)
    }

    /// `<prefix>nodes/v1/<cluster>/<node>`.
    pub fn node_key(&self, node: &str) -> String {
        format!("{}{node}", self.node_prefix())
    }

    /// The node of a node key (`None` for any other key).
    ///
    /// ```
    /// use svc_identity::etcd_backend::Layout;
    /// let layout = Layout::new("rivet/state/", "c1");
    /// assert_eq!(layout.node_of_key(&layout.node_key("n1")), Some("n1"));
    /// assert_eq!(layout.node_of_key("rivet/state/nodes/v1/c2/n1"), None);
    /// ```
    pub fn node_of_key<'k>(&self, key: &'k str) -> Option<&'k str> {
        key.strip_prefix(&self.node_prefix())
            .filter(|node| !node.is_empty() && !node.contains('/'))
    }

    /// `<prefix>services/v1/<cluster>/`: every service record of the cluster
    /// (`rivet_common::cluster::ServiceRecord`).
    pub fn service_prefix(&self) -> String {
        format!("{}services/v1/{}/", self.prefix, self.cluster)
    }

    /// `<prefix>services/v1/<cluster>/<namespace>/<name>`.
    pub fn service_key(&self, namespace: &str, name: &str) -> String {
        format!("{}{namespace}/{name}", self.service_prefix())
    }

    /// The namespace and name of a service key (`None` for any other key).
    ///
    /// ```
    /// use svc_identity::etcd_backend::Layout;
    /// let layout = Layout::new("rivet/state/", "c1");
    /// assert_eq!(layout.service_of_key(&layout.service_key("shop", "web")), Some(("shop", "web")));
    /// assert_eq!(layout.service_of_key("rivet/state/services/v1/c1/shop"), None);
    /// ```
    pub fn service_of_key<'k>(&self, key: &'k str) -> Option<(&'k str, &'k str)> {
        let (namespace, name) = key.strip_prefix(&self.service_prefix())?.split_once('/')?;
        (!namespace.is_empty() && !name.is_empty() && !name.contains('/')).then_some((namespace, name))
    }

    /// The id of a master key (canonical decimal only).
    pub fn id_of_key(&self, key: &str) -> Option<u32> {
        let text = key.strip_prefix(&self.id_prefix())?;
        let id: u32 = text.parse().ok()?;
        (id.to_string() == text).then_some(id)
    }

    /// The node of a value key of exactly `labels` (`None` for any other
    /// key, including value keys of longer label sets sharing the prefix).
    pub fn node_of_value_key<'k>(&self, labels: &str, key: &'k str) -> Option<&'k str> {
        let node = key.strip_prefix(&self.value_prefix(labels))?;
        (!node.is_empty() && !node.contains('/')).then_some(node)
    }

    /// The address or prefix of an IP cache key.
    pub fn ip_of_key<'k>(&self, key: &'k str) -> Option<&'k str> {
        key.strip_prefix(&self.ip_prefix()).filter(|ip| !ip.is_empty())
    }
}

impl Default for Layout {
    fn default() -> Self {
        Self::new(DEFAULT_PREFIX, DEFAULT_CLUSTER)
    }
}

/// Checks a node or cluster name used as a key segment.
pub(crate) fn check_name(what: &str, name: &str, action: &str) -> Result<(), BackendError> {
    if name.is_empty() || name.contains('/') {
        return Err(BackendError::Unavailable {
            action: action.to_string(),
            detail: format!(
                "invalid {what} name {name:?}: it must be non-empty and hold no '/' (a configuration error)"
            ),
        });
    }
    Ok(())
}

fn corrupt(key: &[u8], detail: impl Into<String>) -> BackendError {
    BackendError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        detail: detail.into(),
    }
}

/// A master key and its value as an identity.
pub(crate) fn decode_identity(layout: &Layout, key: &[u8], value: &[u8]) -> Result<IdentityRecord, BackendError> {
    let text = std::str::from_utf8(key).map_err(|_| corrupt(key, "the key is not UTF-8"))?;
    let id = layout
        .id_of_key(text)
        .ok_or_else(|| corrupt(key, format!("not a master key {}<id>", layout.id_prefix())))?;
    let labels = std::str::from_utf8(value).map_err(|_| corrupt(key, "the labels are not UTF-8"))?;
    Ok(IdentityRecord {
        id,
        labels: labels.to_string(),
    })
}

/// The id stored in a value key.
pub(crate) fn decode_value_id(key: &[u8], value: &[u8]) -> Result<u32, BackendError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|text| text.parse::<u32>().ok().filter(|id| id.to_string() == text))
        .ok_or_else(|| {
            corrupt(
                key,
                format!("value {:?} is not an identity number", String::from_utf8_lossy(value)),
            )
        })
}

/// An IP cache key and its JSON value as an entry.
pub(crate) fn decode_ip(layout: &Layout, key: &[u8], value: &[u8]) -> Result<IpEntry, BackendError> {
    let text = std::str::from_utf8(key).map_err(|_| corrupt(key, "the key is not UTF-8"))?;
    let ip = layout
        .ip_of_key(text)
        .ok_or_else(|| corrupt(key, format!("not an IP cache key {}<ip>", layout.ip_prefix())))?;
    let entry: IpEntry =
        serde_json::from_slice(value).map_err(|e| corrupt(key, format!("not an IP cache entry: {e}")))?;
    if entry.ip != ip {
        return Err(corrupt(key, format!("the entry names {:?}, the key {ip:?}", entry.ip)));
    }
    Ok(entry)
}

/// Logs and drops an undecodable entry of a listing or watch.
pub(crate) fn skip_corrupt<T>(what: &str, result: Result<T, BackendError>) -> Option<T> {
    match result {
        Ok(v) => Some(v),
        Err(err) => {
            tracing::warn!(error = %err, "skipping an undecodable {what} entry");
            None
        }
    }
}

/// How to reach etcd and who this node is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdOptions {
    /// Client URLs (`http://127.0.0.1:2379`).
    pub endpoints: Vec<String>,
    /// Key prefix (default `rivet/state/`).
    pub prefix: String,
    /// Cluster name of IP cache keys (default `default`).
    pub cluster: String,
    /// This node's name (the last segment of its value keys).
    pub node: String,
    /// The node lease's TTL, rounded up to whole seconds (default 15 s).
    pub lease_ttl: Duration,
    /// Timeout of one connection attempt (default 5 s).
    pub dial_timeout: Duration,
    /// Timeout of one request (default 5 s).
    pub request_timeout: Duration,
}

impl EtcdOptions {
    /// Options with the defaults for `endpoints` and `node`.
    pub fn new(endpoints: Vec<String>, node: impl Into<String>) -> Self {
        Self {
            endpoints,
            prefix: DEFAULT_PREFIX.to_string(),
            cluster: DEFAULT_CLUSTER.to_string(),
            node: node.into(),
            lease_ttl: DEFAULT_LEASE_TTL,
            dial_timeout: DEFAULT_DIAL_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    fn ttl_secs(&self) -> i64 {
        let secs = self.lease_ttl.as_secs() + u64::from(self.lease_ttl.subsec_nanos() > 0);
        i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
    }
}

/// The node lease in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LeaseState {
    id: i64,
    /// Bumped by every replacement.
    generation: u64,
}

/// What the lease keeper shares with the backend.
struct LeaseShared {
    state: watch::Sender<LeaseState>,
    /// Wakes the keeper to check the lease at once.
    poke: Notify,
}

/// The [`IdentityBackend`] over etcd; see the module docs.
pub struct EtcdBackend {
    client: Client,
    layout: Layout,
    node: String,
    endpoints: Vec<String>,
    request_timeout: Duration,
    lease: Arc<LeaseShared>,
    /// The lease keeper's controller (`etcd-lease-keeper`); dropping the
    /// backend stops it.
    keeper: Controllers,
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("endpoints", &self.endpoints)
            .field("layout", &self.layout)
            .field("node", &self.node)
            .field("lease", &*self.lease.state.borrow())
            .finish_non_exhaustive()
    }
}

/// Maps an etcd error to `Unavailable`.
fn unavailable(action: &str, err: &etcd_client::Error) -> BackendError {
    let detail = match err {
        etcd_client::Error::GRpcStatus(status) => {
            format!("etcd answered {:?}: {}", status.code(), status.message())
        }
        other => other.to_string(),
    };
    BackendError::Unavailable {
        action: action.to_string(),
        detail,
    }
}

fn is_lease_not_found(err: &etcd_client::Error) -> bool {
    matches!(err, etcd_client::Error::GRpcStatus(s) if s.code() == tonic::Code::NotFound && s.message().contains("lease not found"))
}

/// The end of the range of keys starting with `prefix` (etcd's
/// `range_end` of a prefix read).
///
/// ```
/// use svc_identity::etcd_backend::prefix_end;
/// assert_eq!(prefix_end("a/"), b"a0");
/// assert_eq!(prefix_end("a\u{7f}"), b"a\x80");
/// ```
pub fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

fn header_revision(action: &str, header: Option<&etcd_client::ResponseHeader>) -> Result<Revision, BackendError> {
    header.map(|h| h.revision()).ok_or_else(|| BackendError::Unavailable {
        action: action.to_string(),
        detail: "etcd's answer carried no header".into(),
    })
}

/// The key-values read by the `index`th operation of a transaction.
fn txn_get(resp: &TxnResponse, index: usize) -> Vec<KeyValue> {
    match resp.op_responses().into_iter().nth(index) {
        Some(TxnOpResponse::Get(mut get)) => get.take_kvs(),
        _ => Vec::new(),
    }
}

impl EtcdBackend {
    /// Connects to etcd and grants this node's lease; the controller
    /// `etcd-lease-keeper` (a child of `controllers`, stopped when the
    /// backend drops, which revokes nothing: keys expire by TTL) keeps it
    /// alive (needs a tokio runtime).
    ///
    /// # Errors
    /// `Unavailable` when etcd does not answer the lease grant within the
    /// timeouts (or when the node or cluster name is unusable in a key).
    pub async fn connect(opts: EtcdOptions, controllers: &Controllers) -> Result<Self, BackendError> {
        let action = format!("connecting to etcd at {}", opts.endpoints.join(","));
        let client = Self::client(&opts, &action).await?;
        let ttl = opts.ttl_secs();
        let mut leases = client.lease_client();
        let granted = tokio::time::timeout(opts.dial_timeout + opts.request_timeout, leases.grant(ttl, None))
            .await
            .map_err(|_| BackendError::Unavailable {
                action: action.clone(),
                detail: format!(
                    "no answer to the lease grant within {:?}",
                    opts.dial_timeout + opts.request_timeout
                ),
            })?
            .map_err(|e| unavailable(&format!("{action}: granting the node lease"), &e))?;
        tracing::info!(
            lease = granted.id(),
            ttl = granted.ttl(),
            node = %opts.node,
            endpoints = %opts.endpoints.join(","),
            "connected to etcd; node lease granted"
        );
        Ok(Self::with_lease(
            client,
            opts,
            granted.id(),
            keepalive_interval(granted.ttl()),
            controllers,
        ))
    }

    /// Like [`connect`](Self::connect), but returns at once whether etcd
    /// answers or not (a node starting during an etcd outage): the lease is
    /// granted in the background when etcd answers, with backoff, and
    /// [`lease_renewed`](IdentityBackend::lease_renewed) reports it then
    /// (writes bound to the lease are `Unavailable` until it exists). Needs
    /// a tokio runtime.
    ///
    /// # Errors
    /// Only configuration errors (a node or cluster name unusable in a key,
    /// no or invalid endpoints).
    pub async fn start(opts: EtcdOptions, controllers: &Controllers) -> Result<Self, BackendError> {
        let action = format!("connecting to etcd at {}", opts.endpoints.join(","));
        let client = Self::client(&opts, &action).await?;
        tracing::info!(
            node = %opts.node,
            endpoints = %opts.endpoints.join(","),
            "etcd client ready; the node lease is granted when etcd answers"
        );
        let interval = keepalive_interval(opts.ttl_secs());
        Ok(Self::with_lease(client, opts, NO_LEASE, interval, controllers))
    }

    /// The client for `opts` (it connects lazily: no request is made).
    async fn client(opts: &EtcdOptions, action: &str) -> Result<Client, BackendError> {
        check_name("node", &opts.node, action)?;
        check_name("cluster", &opts.cluster, action)?;
        if opts.endpoints.is_empty() {
            return Err(BackendError::Unavailable {
                action: action.to_string(),
                detail: "no etcd endpoints configured".into(),
            });
        }
        let connect = ConnectOptions::new()
            .with_connect_timeout(opts.dial_timeout)
            .with_keep_alive(
                HTTP2_KEEPALIVE_INTERVAL,
                opts.request_timeout.max(Duration::from_secs(1)),
            );
        Client::connect(&opts.endpoints, Some(connect))
            .await
            .map_err(|e| unavailable(action, &e))
    }

    /// The backend over `client` with lease `id` ([`NO_LEASE`]: granted by
    /// the keeper) kept alive every `interval` by a child of `controllers`.
    fn with_lease(client: Client, opts: EtcdOptions, id: i64, interval: Duration, controllers: &Controllers) -> Self {
        let (state, _) = watch::channel(LeaseState { id, generation: 0 });
        let lease = Arc::new(LeaseShared {
            state,
            poke: Notify::new(),
        });
        let keeper = Arc::new(LeaseKeeper {
            client: client.clone(),
            lease: lease.clone(),
            ttl: opts.ttl_secs(),
            request_timeout: opts.request_timeout,
            interval: Mutex::new(interval),
        });
        let controllers = controllers.child();
        let controller = Controller::new("etcd-lease-keeper")
            .backoff(Backoff::new(Duration::from_millis(50), Duration::from_secs(1)));
        controllers.supervise(controller, move |progress| keeper.clone().keep(progress));
        Self {
            client,
            layout: Layout::new(&opts.prefix, &opts.cluster),
            node: opts.node,
            endpoints: opts.endpoints,
            request_timeout: opts.request_timeout,
            lease,
            keeper: controllers,
        }
    }

    /// The key layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The etcd client (cheap to clone; one connection): for the heartbeat
    /// watchdog, which reads a key outside the identity store.
    pub fn etcd_client(&self) -> &Client {
        &self.client
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The lease every write of this node uses now.
    pub fn lease_id(&self) -> i64 {
        self.lease.state.borrow().id
    }

    /// Clean stop: stops the keepalive and revokes the lease, so this node's
    /// value keys and IP entries vanish at once (a failure is logged; the
    /// keys then expire by TTL). The backend must not be used afterwards.
    pub async fn shutdown(&self) {
        self.keeper.shutdown().await;
        let id = self.lease_id();
        if id == NO_LEASE {
            tracing::info!("no node lease was granted; nothing to revoke");
            return;
        }
        let mut leases = self.client.lease_client();
        match tokio::time::timeout(self.request_timeout, leases.revoke(id)).await {
            Ok(Ok(_)) => tracing::info!(lease = id, "node lease revoked"),
            Ok(Err(e)) => {
                tracing::warn!(lease = id, error = %e, "revoking the node lease failed; its keys expire by TTL")
            }
            Err(_) => tracing::warn!(lease = id, "revoking the node lease timed out; its keys expire by TTL"),
        }
    }

    /// Runs one request bounded by the request timeout; maps errors.
    async fn call<T>(
        &self,
        action: &str,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, BackendError> {
        match tokio::time::timeout(self.request_timeout, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(err)) => {
                if is_lease_not_found(&err) {
                    // The lease is gone: have the keeper replace it now.
                    self.lease.poke.notify_one();
                    return Err(BackendError::Unavailable {
                        action: action.to_string(),
                        detail: format!(
                            "the node lease {} expired; a new one is being granted ({})",
                            self.lease_id(),
                            unavailable(action, &err)
                        ),
                    });
                }
                Err(unavailable(action, &err))
            }
            Err(_) => Err(BackendError::Unavailable {
                action: action.to_string(),
                detail: format!("etcd did not answer within {:?}", self.request_timeout),
            }),
        }
    }

    async fn txn(&self, action: &str, txn: Txn) -> Result<TxnResponse, BackendError> {
        let mut kv = self.client.kv_client();
        self.call(action, kv.txn(txn)).await
    }

    async fn get(&self, action: &str, key: String, opts: GetOptions) -> Result<etcd_client::GetResponse, BackendError> {
        let mut kv = self.client.kv_client();
        self.call(action, kv.get(key, Some(opts))).await
    }

    /// Options binding a put to the node lease; `Unavailable` before the
    /// first lease was granted (a key without a lease would never expire).
    fn lease_put(&self, action: &str) -> Result<PutOptions, BackendError> {
        match self.lease_id() {
            NO_LEASE => Err(BackendError::Unavailable {
                action: action.to_string(),
                detail: "no node lease yet: etcd has not answered a lease grant since this process started".into(),
            }),
            id => Ok(PutOptions::new().with_lease(id)),
        }
    }

    /// Every value key under `labels`' prefix (including colliding ones) and
    /// the revision of the read.
    async fn value_keys(&self, action: &str, labels: &str) -> Result<(Vec<KeyValue>, Revision), BackendError> {
        let mut resp = self
            .get(
                action,
                self.layout.value_prefix(labels),
                GetOptions::new().with_prefix(),
            )
            .await?;
        let revision = header_revision(action, resp.header())?;
        Ok((resp.take_kvs(), revision))
    }

    /// The exact value keys of `labels` among `kvs` as (node, id).
    fn exact_values(&self, labels: &str, kvs: &[KeyValue]) -> Result<Vec<(String, u32)>, BackendError> {
        kvs.iter()
            .filter_map(|kv| {
                let key = std::str::from_utf8(kv.key()).ok()?;
                let node = self.layout.node_of_value_key(labels, key)?;
                Some(decode_value_id(kv.key(), kv.value()).map(|id| (node.to_string(), id)))
            })
            .collect()
    }

    /// Compares that keep a transaction to "the value keys under `labels`'
    /// prefix did not change since `revision`" (covers keys created since).
    fn unchanged_since(&self, labels: &str, revision: Revision) -> Compare {
        Compare::mod_revision(self.layout.value_prefix(labels), CompareOp::Less, revision + 1).with_prefix()
    }

    /// The create path when the labels' prefix holds only value keys of
    /// longer label sets: list, then create only if nothing under the prefix
    /// changed since the listing.
    async fn create_despite_collisions(
        &self,
        action: &str,
        id: u32,
        labels: &str,
    ) -> Result<CreateOutcome, BackendError> {
        let id_key = self.layout.id_key(id);
        for _ in 0..MAX_ATTEMPTS {
            let (kvs, revision) = self.value_keys(action, labels).await?;
            if let Some((_, held)) = self.exact_values(labels, &kvs)?.first() {
                return Ok(CreateOutcome::LabelsHeldAs(*held));
            }
            let txn = Txn::new()
                .when([
                    Compare::create_revision(id_key.clone(), CompareOp::Equal, 0),
                    self.unchanged_since(labels, revision),
                ])
                .and_then([
                    TxnOp::put(id_key.clone(), labels, None),
                    TxnOp::put(
                        self.layout.value_key(labels, &self.node),
                        id.to_string(),
                        Some(self.lease_put(action)?),
                    ),
                ])
                .or_else([TxnOp::get(id_key.clone(), None)]);
            let resp = self.txn(action, txn).await?;
            if resp.succeeded() {
                return Ok(CreateOutcome::Created);
            }
            if let Some(master) = txn_get(&resp, 0).first() {
                return Ok(if master.value() == labels.as_bytes() {
                    CreateOutcome::LabelsHeldAs(id)
                } else {
                    CreateOutcome::IdTaken
                });
            }
            // A value key under the prefix changed meanwhile: look again.
        }
        Err(contended(action))
    }
}

fn contended(action: &str) -> BackendError {
    BackendError::Unavailable {
        action: action.to_string(),
        detail: format!("the value keys of the labels kept changing over {MAX_ATTEMPTS} attempts (contention); retry"),
    }
}

fn keepalive_interval(ttl_secs: i64) -> Duration {
    (Duration::from_secs(u64::try_from(ttl_secs.max(1)).unwrap_or(1)) / 3).max(Duration::from_millis(100))
}

/// Turns a stored key and value into a record.
type Decoder<T> = fn(&Layout, &[u8], &[u8]) -> Result<T, BackendError>;

impl EtcdBackend {
    /// Every decodable entry under `prefix`, sorted, with the listing's
    /// revision; undecodable entries are skipped with a warning.
    async fn list_decoded<T: Ord>(
        &self,
        action: &'static str,
        what: &'static str,
        prefix: String,
        decode: Decoder<T>,
    ) -> Result<(Vec<T>, Revision), BackendError> {
        // Page by page at the first page's revision: one unpaged answer over
        // etcd-client's 4 MiB decoding limit (~22,000 IP entries) would make
        // every (re-)listing of a large cluster fail.
        let end = prefix_end(&prefix);
        let mut from = prefix.into_bytes();
        let mut revision = 0;
        let mut items: Vec<T> = Vec::new();
        loop {
            let options = GetOptions::new()
                .with_range(end.clone())
                .with_limit(LIST_PAGE_SIZE)
                .with_revision(revision);
            let mut kv = self.client.kv_client();
            let mut resp = self.call(action, kv.get(from.clone(), Some(options))).await?;
            if revision == 0 {
                revision = header_revision(action, resp.header())?;
            }
            let more = resp.more();
            let kvs = resp.take_kvs();
            items.extend(
                kvs.iter()
                    .filter_map(|kv| skip_corrupt(what, decode(&self.layout, kv.key(), kv.value()))),
            );
            match kvs.last() {
                Some(last) if more => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        items.sort();
        Ok((items, revision))
    }
}

#[tonic::async_trait]
impl IdentityBackend for EtcdBackend {
    fn lease_id(&self) -> i64 {
        // The inherent method: the lease in force now.
        EtcdBackend::lease_id(self)
    }

    fn kind(&self) -> &'static str {
        "etcd"
    }

    async fn list_identities(&self) -> Result<(Vec<IdentityRecord>, Revision), BackendError> {
        self.list_decoded(
            "listing identities",
            "identity",
            self.layout.id_prefix(),
            decode_identity,
        )
        .await
    }

    async fn watch_identities(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<IdentityEvent, BackendError>>, BackendError> {
        let layout = self.layout.clone();
        self.watch_prefix("identities", self.layout.id_prefix(), after, move |kind, kv| {
            match kind {
                EventType::Put => skip_corrupt("identity", decode_identity(&layout, kv.key(), kv.value()))
                    .map(IdentityEvent::Upsert),
                EventType::Delete => {
                    let id = std::str::from_utf8(kv.key()).ok().and_then(|k| layout.id_of_key(k));
                    if id.is_none() {
                        tracing::warn!(key = %String::from_utf8_lossy(kv.key()), "skipping the deletion of a foreign key under the identity prefix");
                    }
                    id.map(|id| IdentityEvent::Delete { id })
                }
            }
        })
        .await
    }

    async fn held_id(&self, labels: &str) -> Result<Option<u32>, BackendError> {
        let action = format!("looking up the identity held for {labels}");
        let mut resp = self
            .get(
                &action,
                self.layout.value_prefix(labels),
                GetOptions::new().with_prefix().with_limit(1),
            )
            .await?;
        let kvs = resp.take_kvs();
        let Some(first) = kvs.first() else {
            return Ok(None);
        };
        if std::str::from_utf8(first.key()).is_ok_and(|k| self.layout.node_of_value_key(labels, k).is_some()) {
            return decode_value_id(first.key(), first.value()).map(Some);
        }
        // The first key belongs to a longer label set: read them all.
        let (kvs, _) = self.value_keys(&action, labels).await?;
        Ok(self.exact_values(labels, &kvs)?.first().map(|(_, id)| *id))
    }

    /// One transaction in the common case (see the module docs). When the
    /// master key of `id` already names `labels` but no node holds them (a
    /// released identity awaiting GC), answers `LabelsHeldAs(id)` so the
    /// identity is reused through `acquire` rather than duplicated.
    async fn create_identity(&self, id: u32, labels: &str) -> Result<CreateOutcome, BackendError> {
        let action = format!("allocating identity {id} for {labels}");
        let id_key = self.layout.id_key(id);
        let value_prefix = self.layout.value_prefix(labels);
        let txn = Txn::new()
            .when([
                Compare::create_revision(id_key.clone(), CompareOp::Equal, 0),
                Compare::create_revision(value_prefix.clone(), CompareOp::Equal, 0).with_prefix(),
            ])
            .and_then([
                TxnOp::put(id_key.clone(), labels, None),
                TxnOp::put(
                    self.layout.value_key(labels, &self.node),
                    id.to_string(),
                    Some(self.lease_put(&action)?),
                ),
            ])
            .or_else([
                TxnOp::get(value_prefix, Some(GetOptions::new().with_prefix().with_limit(1))),
                TxnOp::get(id_key, None),
            ]);
        let resp = self.txn(&action, txn).await?;
        if resp.succeeded() {
            return Ok(CreateOutcome::Created);
        }
        let values = txn_get(&resp, 0);
        let master = txn_get(&resp, 1);
        if let Some(value) = values.first() {
            let exact =
                std::str::from_utf8(value.key()).is_ok_and(|k| self.layout.node_of_value_key(labels, k).is_some());
            if exact {
                return decode_value_id(value.key(), value.value()).map(CreateOutcome::LabelsHeldAs);
            }
            if master.is_empty() {
                // Only (perhaps) value keys of longer label sets: the slow path.
                return self.create_despite_collisions(&action, id, labels).await;
            }
            // Colliding keys listed first; exact ones may follow.
            let (kvs, _) = self.value_keys(&action, labels).await?;
            if let Some((_, held)) = self.exact_values(labels, &kvs)?.first() {
                return Ok(CreateOutcome::LabelsHeldAs(*held));
            }
        }
        match master.first() {
            Some(m) if m.value() == labels.as_bytes() => Ok(CreateOutcome::LabelsHeldAs(id)),
            Some(_) => Ok(CreateOutcome::IdTaken),
            // Neither (impossible in one transaction); decide on a fresh read.
            None => self.create_despite_collisions(&action, id, labels).await,
        }
    }

    /// One transaction when the master key names `labels`. When it is gone,
    /// re-creates it only if the id is still free AND no node holds `labels`
    /// under another id (checked atomically: the transaction requires the
    /// labels' value keys unchanged since they were read), so re-creation
    /// never gives one label set two ids.
    async fn acquire(&self, id: u32, labels: &str) -> Result<AcquireOutcome, BackendError> {
        let action = format!("acquiring identity {id} for {labels}");
        let id_key = self.layout.id_key(id);
        let value_key = self.layout.value_key(labels, &self.node);
        for _ in 0..MAX_ATTEMPTS {
            let lease = self.lease_put(&action)?;
            // A new value key also puts the master again (same labels): its
            // mod revision moves, so the operator's GC, which deletes a
            // master only if its mod revision is the one it saw unused a
            // round earlier, never deletes an identity reused in between
            // (even one released again before the second round). Rewriting
            // an existing value key (every reconcile pass) leaves the master
            // alone: no write and no watch event per pass.
            let write_value = Txn::new()
                .when([Compare::create_revision(value_key.clone(), CompareOp::Equal, 0)])
                .and_then([
                    TxnOp::put(value_key.clone(), id.to_string(), Some(lease.clone())),
                    TxnOp::put(id_key.clone(), labels, None),
                ])
                .or_else([TxnOp::put(value_key.clone(), id.to_string(), Some(lease))]);
            let txn = Txn::new()
                .when([Compare::value(id_key.clone(), CompareOp::Equal, labels)])
                .and_then([TxnOp::txn(write_value)])
                .or_else([TxnOp::get(id_key.clone(), None)]);
            let resp = self.txn(&action, txn).await?;
            if resp.succeeded() {
                return Ok(AcquireOutcome::Acquired);
            }
            if !txn_get(&resp, 0).is_empty() {
                return Ok(AcquireOutcome::Conflict);
            }
            // The master key is gone.
            let (kvs, revision) = self.value_keys(&action, labels).await?;
            if self.exact_values(labels, &kvs)?.iter().any(|(_, held)| *held != id) {
                return Ok(AcquireOutcome::Conflict);
            }
            let txn = Txn::new()
                .when([
                    Compare::create_revision(id_key.clone(), CompareOp::Equal, 0),
                    self.unchanged_since(labels, revision),
                ])
                .and_then([
                    TxnOp::put(id_key.clone(), labels, None),
                    TxnOp::put(value_key.clone(), id.to_string(), Some(self.lease_put(&action)?)),
                ])
                .or_else([TxnOp::get(id_key.clone(), None)]);
            let resp = self.txn(&action, txn).await?;
            if resp.succeeded() {
                tracing::info!(id, labels, "re-created the vanished master key of an identity in use");
                return Ok(AcquireOutcome::MasterRecreated);
            }
            match txn_get(&resp, 0).first() {
                Some(m) if m.value() != labels.as_bytes() => return Ok(AcquireOutcome::Conflict),
                // Re-created by another node (the next round acquires it), or
                // the value keys changed: try again.
                _ => {}
            }
        }
        Err(contended(&action))
    }

    async fn release(&self, labels: &str) -> Result<(), BackendError> {
        let action = format!("releasing this node's value key for {labels}");
        let mut kv = self.client.kv_client();
        self.call(&action, kv.delete(self.layout.value_key(labels, &self.node), None))
            .await?;
        Ok(())
    }

    /// One keys-only range read over every value key (all nodes'), filtered
    /// to this node's.
    async fn node_value_keys(&self) -> Result<Vec<String>, BackendError> {
        let action = format!("listing the value keys of node {}", self.node);
        let resp = self
            .get(
                &action,
                self.layout.value_root(),
                GetOptions::new().with_prefix().with_keys_only(),
            )
            .await?;
        let keys = resp.kvs().iter().filter_map(|kv| std::str::from_utf8(kv.key()).ok());
        Ok(self.layout.node_value_labels(&self.node, keys))
    }

    async fn shutdown(&self) {
        // The inherent method: stop the keepalive, revoke the lease.
        EtcdBackend::shutdown(self).await;
    }

    /// Writes the entry with `node` set to this node (the publisher).
    async fn upsert_ip(&self, entry: &IpEntry) -> Result<(), BackendError> {
        let action = format!("publishing IP cache entry {}", entry.ip);
        let mut entry = entry.clone();
        entry.node.clone_from(&self.node);
        let value = serde_json::to_vec(&entry).map_err(|e| BackendError::Corrupt {
            key: self.layout.ip_key(&entry.ip),
            detail: format!("encoding the entry: {e}"),
        })?;
        let mut kv = self.client.kv_client();
        self.call(
            &action,
            kv.put(self.layout.ip_key(&entry.ip), value, Some(self.lease_put(&action)?)),
        )
        .await?;
        Ok(())
    }

    /// Deletes the entry only if this node published it (its `node`), so a
    /// late delete never withdraws an address another node took over.
    async fn delete_ip(&self, ip: &str) -> Result<(), BackendError> {
        let action = format!("withdrawing IP cache entry {ip}");
        let key = self.layout.ip_key(ip);
        // Common case in one round trip: the entry carries this node's lease
        // (before the first lease: nothing to delete unless the key exists).
        let fast = match self.lease_id() {
            NO_LEASE => Compare::version(key.clone(), CompareOp::Equal, 0),
            lease => Compare::lease(key.clone(), CompareOp::Equal, lease),
        };
        let txn = Txn::new()
            .when([fast])
            .and_then([TxnOp::delete(key.clone(), None)])
            .or_else([TxnOp::get(key.clone(), None)]);
        let mut resp = self.txn(&action, txn).await?;
        for _ in 0..MAX_ATTEMPTS {
            if resp.succeeded() {
                return Ok(());
            }
            let Some(current) = txn_get(&resp, 0).into_iter().next() else {
                return Ok(()); // Already gone.
            };
            let ours = decode_ip(&self.layout, current.key(), current.value()).is_ok_and(|e| e.node == self.node);
            if !ours {
                return Ok(()); // Another node's entry (or undecodable): leave it.
            }
            let txn = Txn::new()
                .when([Compare::mod_revision(
                    key.clone(),
                    CompareOp::Equal,
                    current.mod_revision(),
                )])
                .and_then([TxnOp::delete(key.clone(), None)])
                .or_else([TxnOp::get(key.clone(), None)]);
            resp = self.txn(&action, txn).await?;
        }
        Err(contended(&action))
    }

    async fn list_ips(&self) -> Result<(Vec<IpEntry>, Revision), BackendError> {
        self.list_decoded("listing the IP cache", "IP cache", self.layout.ip_prefix(), decode_ip)
            .await
    }

    async fn watch_ips(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<IpEvent, BackendError>>, BackendError> {
        let layout = self.layout.clone();
        self.watch_prefix(
            "the IP cache",
            self.layout.ip_prefix(),
            after,
            move |kind, kv| match kind {
                EventType::Put => {
                    skip_corrupt("IP cache", decode_ip(&layout, kv.key(), kv.value())).map(IpEvent::Upsert)
                }
                EventType::Delete => {
                    let ip = std::str::from_utf8(kv.key()).ok().and_then(|k| layout.ip_of_key(k));
                    ip.map(|ip| IpEvent::Delete { ip: ip.to_string() })
                }
            },
        )
        .await
    }

    /// Completes on a lease replacement later than `seen` (the last one
    /// the caller heard of, 0 at first) and records it there: the next one
    /// after the call, or one that happened while the caller was busy
    /// between two calls. Each caller keeps its own `seen`, so every waiter
    /// hears every replacement. A call dropped before completing changes
    /// nothing.
    async fn lease_renewed(&self, seen: &mut u64) {
        let mut renewals = self.lease.state.subscribe();
        loop {
            let current = renewals.borrow_and_update().generation;
            if current > *seen {
                *seen = current;
                return;
            }
            if renewals.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// A node key's node and its raw value (decoded by the registry).
fn node_key_value(layout: &Layout, key: &[u8], value: &[u8]) -> Result<(String, Vec<u8>), BackendError> {
    let text = std::str::from_utf8(key).map_err(|_| corrupt(key, "the key is not UTF-8"))?;
    let node = layout
        .node_of_key(text)
        .ok_or_else(|| corrupt(key, format!("not a node key {}<node>", layout.node_prefix())))?;
    Ok((node.to_string(), value.to_vec()))
}

#[tonic::async_trait]
impl NodeStore for EtcdBackend {
    async fn put_node(&self, value: Vec<u8>) -> Result<(), BackendError> {
        let key = self.layout.node_key(&self.node);
        let action = format!("publishing this node's record {key}");
        let mut kv = self.client.kv_client();
        self.call(&action, kv.put(key.clone(), value, Some(self.lease_put(&action)?)))
            .await?;
        Ok(())
    }

    async fn list_nodes(&self) -> Result<(Vec<(String, Vec<u8>)>, Revision), BackendError> {
        self.list_decoded(
            "listing the node records",
            "node record",
            self.layout.node_prefix(),
            node_key_value,
        )
        .await
    }

    async fn watch_nodes(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<NodeKeyEvent, BackendError>>, BackendError> {
        let layout = self.layout.clone();
        self.watch_prefix("the node records", self.layout.node_prefix(), after, move |kind, kv| {
            let (node, value) = skip_corrupt("node record", node_key_value(&layout, kv.key(), kv.value()))?;
            Some(match kind {
                EventType::Put => NodeKeyEvent::Put { node, value },
                EventType::Delete => NodeKeyEvent::Delete { node },
            })
        })
        .await
    }
}

/// A watch's state between items.
struct WatchState<E, F> {
    stream: Option<etcd_client::WatchStream>,
    pending: std::collections::VecDeque<E>,
    decode: F,
    what: &'static str,
    after: Revision,
    /// The last revision delivered (for the compaction report).
    seen: Revision,
}

impl EtcdBackend {
    /// Watches `prefix` after `after`, decoding events with `decode`; the
    /// stream ends with an error on disconnect, cancellation or compaction.
    async fn watch_prefix<E, F>(
        &self,
        what: &'static str,
        prefix: String,
        after: Revision,
        decode: F,
    ) -> Result<BoxStream<'static, Result<E, BackendError>>, BackendError>
    where
        E: Send + 'static,
        F: FnMut(EventType, &KeyValue) -> Option<E> + Send + 'static,
    {
        let action = format!("watching {what} from revision {after}");
        let mut watcher = self.client.watch_client();
        let opts = WatchOptions::new().with_prefix().with_start_revision(after + 1);
        let stream = self.call(&action, watcher.watch(prefix, Some(opts))).await?;
        let state = WatchState {
            stream: Some(stream),
            pending: std::collections::VecDeque::new(),
            decode,
            what,
            after,
            seen: after,
        };
        Ok(futures::stream::unfold(state, move |mut state| {
            let action = action.clone();
            async move {
                loop {
                    if let Some(event) = state.pending.pop_front() {
                        return Some((Ok(event), state));
                    }
                    let stream = state.stream.as_mut()?;
                    let end = |detail: String| BackendError::Unavailable {
                        action: action.clone(),
                        detail,
                    };
                    let error = match stream.message().await {
                        Ok(Some(resp)) if resp.compact_revision() > 0 => BackendError::Compacted {
                            what: state.what,
                            revision: state.seen.max(state.after),
                            compacted: resp.compact_revision(),
                        },
                        Ok(Some(resp)) if resp.canceled() => {
                            end(format!("etcd canceled the watch: {}", resp.cancel_reason()))
                        }
                        Ok(Some(resp)) => {
                            for event in resp.events() {
                                let Some(kv) = event.kv() else { continue };
                                state.seen = state.seen.max(kv.mod_revision());
                                if let Some(e) = (state.decode)(event.event_type(), kv) {
                                    state.pending.push_back(e);
                                }
                            }
                            continue;
                        }
                        Ok(None) => end("etcd closed the watch stream".into()),
                        Err(e) => unavailable(&action, &e),
                    };
                    state.stream = None;
                    return Some((Err(error), state));
                }
            }
        })
        .boxed())
    }
}

/// Keeps the node lease alive; replaces it when etcd reports it gone.
struct LeaseKeeper {
    client: Client,
    lease: Arc<LeaseShared>,
    ttl: i64,
    request_timeout: Duration,
    /// The keepalive interval of the current lease.
    interval: Mutex<Duration>,
}

/// Why keeping the node lease alive stopped (its controller starts again).
#[derive(Debug, thiserror::Error)]
enum KeeperError {
    /// etcd could not be reached or the keepalive stream broke.
    #[error("keeping node lease {lease} alive: {source}")]
    Keepalive {
        /// The lease.
        lease: i64,
        /// What went wrong.
        source: LeaseCallError,
    },
    /// A new lease could not be granted.
    #[error("granting a new node lease: {0}")]
    Grant(#[source] LeaseCallError),
}

/// Why a call on the node lease failed.
#[derive(Debug, thiserror::Error)]
enum LeaseCallError {
    /// etcd did not answer within the request timeout.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// etcd answered with an error (or the stream failed).
    #[error(transparent)]
    Etcd(#[from] etcd_client::Error),
    /// etcd closed the keepalive stream.
    #[error("etcd closed the keepalive stream")]
    StreamClosed,
}

/// Why a keepalive session ended.
enum SessionEnd {
    /// etcd says the lease does not exist (expired or revoked).
    Gone,
    /// etcd could not be reached or the stream broke.
    Broken(LeaseCallError),
}

impl LeaseKeeper {
    /// Keeps the lease alive, replacing it when etcd says it is gone (or
    /// none was granted yet), until keeping it alive or granting fails.
    async fn keep(self: Arc<Self>, progress: Progress) -> Result<(), KeeperError> {
        loop {
            let id = self.lease.state.borrow().id;
            if id == NO_LEASE {
                // Started while etcd was away: the first lease, when it answers.
                self.replace(id).await?;
                continue;
            }
            let interval = *self.interval.lock().unwrap_or_else(|e| e.into_inner());
            match self.session(id, interval, &progress).await {
                SessionEnd::Gone => {
                    tracing::warn!(lease = id, "etcd reports the node lease gone; granting a new one");
                    self.replace(id).await?;
                    progress.ok();
                }
                SessionEnd::Broken(source) => return Err(KeeperError::Keepalive { lease: id, source }),
            }
        }
    }

    /// Keeps lease `id` alive until etcd says it is gone or the stream fails.
    async fn session(&self, id: i64, interval: Duration, progress: &Progress) -> SessionEnd {
        let mut leases = self.client.lease_client();
        let (mut keeper, mut stream) = match tokio::time::timeout(self.request_timeout, leases.keep_alive(id)).await {
            Err(_) => return SessionEnd::Broken(LeaseCallError::Timeout(self.request_timeout)),
            Ok(Err(etcd_client::Error::LeaseKeepAliveError(m))) if m.contains("not found") => return SessionEnd::Gone,
            Ok(Err(e)) => return SessionEnd::Broken(e.into()),
            Ok(Ok(pair)) => pair,
        };
        progress.ok();
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = self.lease.poke.notified() => {}
            }
            if let Err(e) = keeper.keep_alive().await {
                return SessionEnd::Broken(e.into());
            }
            match tokio::time::timeout(self.request_timeout, stream.message()).await {
                Err(_) => return SessionEnd::Broken(LeaseCallError::Timeout(self.request_timeout)),
                Ok(Err(e)) => return SessionEnd::Broken(e.into()),
                Ok(Ok(None)) => return SessionEnd::Broken(LeaseCallError::StreamClosed),
                Ok(Ok(Some(resp))) if resp.ttl() <= 0 => return SessionEnd::Gone,
                Ok(Ok(Some(_))) => {}
            }
        }
    }

    /// Grants a new lease, swaps it in and wakes `lease_renewed` waiters;
    /// its keepalive interval is used from then on.
    async fn replace(&self, old: i64) -> Result<(), KeeperError> {
        let mut leases = self.client.lease_client();
        let granted = match tokio::time::timeout(self.request_timeout, leases.grant(self.ttl, None)).await {
            Ok(Ok(granted)) => granted,
            Ok(Err(e)) => return Err(KeeperError::Grant(e.into())),
            Err(_) => return Err(KeeperError::Grant(LeaseCallError::Timeout(self.request_timeout))),
        };
        self.lease.state.send_modify(|state| {
            state.id = granted.id();
            state.generation += 1;
        });
        *self.interval.lock().unwrap_or_else(|e| e.into_inner()) = keepalive_interval(granted.ttl());
        tracing::info!(old, lease = granted.id(), ttl = granted.ttl(), "new node lease granted");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::SocketAddr;
    use std::time::Instant;

    use futures::stream::BoxStream;
    use rivet_common::testing::etcd::EtcdServer;
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    const TTL: Duration = Duration::from_secs(2);
    const REQUEST_TIMEOUT: Duration = Duration::from_millis(500);

    fn options(endpoint: &str, node: &str) -> EtcdOptions {
        EtcdOptions {
            lease_ttl: TTL,
            dial_timeout: Duration::from_millis(300),
            request_timeout: REQUEST_TIMEOUT,
            ..EtcdOptions::new(vec![endpoint.to_string()], node)
        }
    }

    async fn backend(etcd: &EtcdServer, node: &str) -> EtcdBackend {
        EtcdBackend::connect(options(&etcd.endpoint(), node), &Controllers::new())
            .await
            .expect("connect the backend")
    }

    async fn raw(etcd: &EtcdServer) -> Client {
        Client::connect([etcd.endpoint()], None)
            .await
            .expect("connect a raw client")
    }

    /// Value and lease of `key`.
    async fn raw_get(client: &mut Client, key: &str) -> Option<(String, i64)> {
        let resp = client.get(key, None).await.expect("raw get");
        resp.kvs()
            .first()
            .map(|kv| (String::from_utf8(kv.value().to_vec()).expect("UTF-8"), kv.lease()))
    }

    /// Every key under `prefix` → (value, lease).
    async fn raw_keys(client: &mut Client, prefix: &str) -> BTreeMap<String, (String, i64)> {
        let resp = client
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .expect("raw list");
        resp.kvs()
            .iter()
            .map(|kv| {
                (
                    kv.key_str().expect("UTF-8 key").to_string(),
                    (kv.value_str().expect("UTF-8 value").to_string(), kv.lease()),
                )
            })
            .collect()
    }

    /// Polls `check` every 50 ms until it holds; panics after `limit`.
    async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F) -> Duration
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let started = Instant::now();
        loop {
            if check().await {
                return started.elapsed();
            }
            assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn next<T: fmt::Debug>(stream: &mut BoxStream<'static, Result<T, BackendError>>) -> T {
        tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("a watch event within 5 s")
            .expect("the stream goes on")
            .expect("an event, not an error")
    }

    async fn next_err<T: fmt::Debug>(stream: &mut BoxStream<'static, Result<T, BackendError>>) -> BackendError {
        match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
            Ok(Some(Err(e))) => e,
            other => panic!("expected a watch error, got {other:?}"),
        }
    }

    fn ip_entry(ip: &str, identity: u32) -> IpEntry {
        IpEntry {
            ip: ip.to_string(),
            identity,
            host_ip: Some("192.0.2.1".into()),
            namespace: Some("default".into()),
            pod: Some(format!("pod-{identity}")),
            node: String::new(),
            named_ports: Vec::new(),
        }
    }

    fn assert_unavailable(err: &BackendError, action: &str) {
        match err {
            BackendError::Unavailable { action: a, .. } => assert!(a.contains(action), "action {a:?} lacks {action:?}"),
            other => panic!("expected Unavailable for {action}, got {other:?}"),
        }
    }

    #[test]
    fn layout_builds_and_parses_keys() {
        let layout = Layout::new("test/pfx", "c1");
        assert_eq!(layout.prefix(), "test/pfx/");
        assert_eq!(Layout::new("", "c").prefix(), "");
        assert_eq!(Layout::default().id_key(256), "rivet/state/identities/v1/id/256");
        assert_eq!(layout.id_key(300), "test/pfx/identities/v1/id/300");
        assert_eq!(layout.id_of_key("test/pfx/identities/v1/id/300"), Some(300));
        assert_eq!(layout.id_of_key("test/pfx/identities/v1/id/0300"), None);
        assert_eq!(layout.id_of_key("test/pfx/identities/v1/id/x"), None);
        assert_eq!(layout.id_of_key("test/pfx/identities/v1/id/"), None);
        let labels = "k8s:app.kubernetes.io/name=x,k8s:app=web";
        assert_eq!(
            layout.value_key(labels, "node-a"),
            "test/pfx/identities/v1/value/k8s:app.kubernetes.io/name=x,k8s:app=web/node-a"
        );
        assert_eq!(
            layout.node_of_value_key(labels, &layout.value_key(labels, "node-a")),
            Some("node-a")
        );
        // A longer label set sharing the prefix is not the labels' key.
        let short = "k8s:example.com";
        let long = "k8s:example.com/x=y";
        assert!(layout.value_key(long, "n").starts_with(&layout.value_prefix(short)));
        assert_eq!(layout.node_of_value_key(short, &layout.value_key(long, "n")), None);
        assert_eq!(layout.node_of_value_key(long, &layout.value_key(long, "n")), Some("n"));
        assert_eq!(layout.ip_key("198.18.0.0/24"), "test/pfx/ip/v1/c1/198.18.0.0/24");
        assert_eq!(
            layout.ip_of_key("test/pfx/ip/v1/c1/198.18.0.0/24"),
            Some("198.18.0.0/24")
        );
        assert_eq!(layout.ip_of_key("test/pfx/ip/v1/c2/198.18.0.1"), None);
        assert!(decode_value_id(b"k", b"300").is_ok_and(|id| id == 300));
        assert!(matches!(decode_value_id(b"k", b"x"), Err(BackendError::Corrupt { .. })));
        assert!(matches!(
            decode_ip(&layout, b"test/pfx/ip/v1/c1/198.18.0.1", br#"{"ip":"198.18.0.2"}"#),
            Err(BackendError::Corrupt { .. })
        ));
    }

    /// etcd facts the allocation transaction relies on (the tests run etcd
    /// 3.6; they held on 3.4 too).
    #[tokio::test]
    async fn etcd_range_compare_on_an_empty_range_succeeds() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let mut c = raw(&etcd).await;
        let check = |compare: Compare| Txn::new().when([compare]).and_then([]).or_else([]);
        let empty_create = || Compare::create_revision("x/value/a/", CompareOp::Equal, 0).with_prefix();
        assert!(
            c.txn(check(empty_create())).await.unwrap().succeeded(),
            "createrev == 0 over no key"
        );
        let v = || Compare::value("x/value/a/", CompareOp::Equal, "1").with_prefix();
        assert!(
            !c.txn(check(v())).await.unwrap().succeeded(),
            "a value compare over no key fails"
        );
        let rev = c
            .put("x/value/a/n1", "1", None)
            .await
            .unwrap()
            .header()
            .unwrap()
            .revision();
        assert!(
            !c.txn(check(empty_create())).await.unwrap().succeeded(),
            "createrev == 0 with a key"
        );
        let unchanged = |r: i64| Compare::mod_revision("x/value/a/", CompareOp::Less, r + 1).with_prefix();
        assert!(c.txn(check(unchanged(rev))).await.unwrap().succeeded());
        c.put("x/value/a/n2", "1", None).await.unwrap();
        assert!(
            !c.txn(check(unchanged(rev))).await.unwrap().succeeded(),
            "a new key breaks 'unchanged'"
        );
        assert!(c.txn(check(unchanged(0)).clone()).await.is_ok());
        let none = Compare::mod_revision("x/value/b/", CompareOp::Less, 1).with_prefix();
        assert!(c.txn(check(none)).await.unwrap().succeeded(), "mod < 1 over no key");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn etcd_racing_creates_end_with_one_id() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = Arc::new(backend(&etcd, "node-a").await);
        let b = Arc::new(backend(&etcd, "node-b").await);
        let mut c = raw(&etcd).await;
        for i in 0..20u32 {
            let labels = format!("k8s:app=race-{i}");
            let (ida, idb) = (1000 + 2 * i, 1001 + 2 * i);
            let (ra, rb) = tokio::join!(
                {
                    let (a, l) = (a.clone(), labels.clone());
                    tokio::spawn(async move { a.create_identity(ida, &l).await })
                },
                {
                    let (b, l) = (b.clone(), labels.clone());
                    tokio::spawn(async move { b.create_identity(idb, &l).await })
                }
            );
            let (ra, rb) = (ra.unwrap().unwrap(), rb.unwrap().unwrap());
            let (winner, loser, loser_id) = match (&ra, &rb) {
                (CreateOutcome::Created, CreateOutcome::LabelsHeldAs(id)) => {
                    assert_eq!(*id, ida);
                    (ida, &b, idb)
                }
                (CreateOutcome::LabelsHeldAs(id), CreateOutcome::Created) => {
                    assert_eq!(*id, idb);
                    (idb, &a, ida)
                }
                other => panic!("round {i}: expected one Created and one LabelsHeldAs, got {other:?}"),
            };
            assert_eq!(loser.acquire(winner, &labels).await.unwrap(), AcquireOutcome::Acquired);
            let layout = a.layout();
            assert_eq!(
                raw_get(&mut c, &layout.id_key(winner)).await.map(|v| v.0),
                Some(labels.clone())
            );
            assert_eq!(
                raw_get(&mut c, &layout.id_key(loser_id)).await,
                None,
                "the loser's id stays free"
            );
            for node in ["node-a", "node-b"] {
                let value = raw_get(&mut c, &layout.value_key(&labels, node)).await;
                assert_eq!(value.map(|v| v.0), Some(winner.to_string()), "{node}'s value key");
            }
            assert_eq!(a.held_id(&labels).await.unwrap(), Some(winner));
        }
    }

    #[tokio::test]
    async fn etcd_id_taken_and_released_identity_reuse() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = backend(&etcd, "node-a").await;
        let b = backend(&etcd, "node-b").await;
        assert_eq!(
            a.create_identity(300, "k8s:app=web").await.unwrap(),
            CreateOutcome::Created
        );
        assert_eq!(
            b.create_identity(300, "k8s:app=db").await.unwrap(),
            CreateOutcome::IdTaken
        );
        assert_eq!(
            b.create_identity(301, "k8s:app=web").await.unwrap(),
            CreateOutcome::LabelsHeldAs(300)
        );
        assert_eq!(
            b.create_identity(301, "k8s:app=db").await.unwrap(),
            CreateOutcome::Created
        );
        // Released by everyone, the master key stays (for GC): asking for the
        // same id again reuses it through acquire.
        a.release("k8s:app=web").await.unwrap();
        assert_eq!(b.held_id("k8s:app=web").await.unwrap(), None);
        assert_eq!(
            b.create_identity(300, "k8s:app=web").await.unwrap(),
            CreateOutcome::LabelsHeldAs(300)
        );
        assert_eq!(b.acquire(300, "k8s:app=web").await.unwrap(), AcquireOutcome::Acquired);
        assert_eq!(a.held_id("k8s:app=web").await.unwrap(), Some(300));
    }

    #[tokio::test]
    async fn etcd_acquire_on_matching_mismatching_and_vanished_master() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = backend(&etcd, "node-a").await;
        let b = backend(&etcd, "node-b").await;
        let mut c = raw(&etcd).await;
        let layout = a.layout().clone();
        assert_eq!(
            a.create_identity(400, "k8s:app=web").await.unwrap(),
            CreateOutcome::Created
        );
        assert_eq!(b.acquire(400, "k8s:app=web").await.unwrap(), AcquireOutcome::Acquired);
        assert_eq!(b.acquire(400, "k8s:app=db").await.unwrap(), AcquireOutcome::Conflict);
        assert_eq!(raw_get(&mut c, &layout.value_key("k8s:app=db", "node-b")).await, None);

        // The operator's GC deleted the master key while both nodes use it.
        c.delete(layout.id_key(400), None).await.unwrap();
        assert_eq!(
            b.acquire(400, "k8s:app=web").await.unwrap(),
            AcquireOutcome::MasterRecreated
        );
        let master = raw_get(&mut c, &layout.id_key(400)).await.expect("master re-created");
        assert_eq!(master, ("k8s:app=web".to_string(), 0), "master keys carry no lease");
        assert_eq!(a.acquire(400, "k8s:app=web").await.unwrap(), AcquireOutcome::Acquired);

        // Vanished and the id taken by other labels meanwhile.
        c.delete(layout.id_key(400), None).await.unwrap();
        c.put(layout.id_key(400), "k8s:app=other", None).await.unwrap();
        assert_eq!(b.acquire(400, "k8s:app=web").await.unwrap(), AcquireOutcome::Conflict);

        // Vanished while another node holds the labels under another id:
        // re-creating would bind the labels to two ids.
        assert_eq!(
            a.create_identity(410, "k8s:app=api").await.unwrap(),
            CreateOutcome::Created
        );
        c.put(layout.value_key("k8s:app=api", "node-c"), "411", None)
            .await
            .unwrap();
        c.delete(layout.id_key(410), None).await.unwrap();
        assert_eq!(a.acquire(410, "k8s:app=api").await.unwrap(), AcquireOutcome::Conflict);
        assert_eq!(raw_get(&mut c, &layout.id_key(410)).await, None);
    }

    /// Mod revision of `key`, if it exists.
    async fn raw_mod_revision(client: &mut Client, key: &str) -> Option<i64> {
        let resp = client.get(key, None).await.expect("raw get");
        resp.kvs().first().map(KeyValue::mod_revision)
    }

    #[tokio::test]
    async fn etcd_acquire_of_a_new_value_key_moves_the_master_revision() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = backend(&etcd, "node-a").await;
        let b = backend(&etcd, "node-b").await;
        let mut c = raw(&etcd).await;
        let master = a.layout().id_key(420);
        assert_eq!(
            a.create_identity(420, "k8s:app=web").await.unwrap(),
            CreateOutcome::Created
        );
        a.release("k8s:app=web").await.unwrap();
        let unused = raw_mod_revision(&mut c, &master).await.expect("the master stays");

        // Reused and released again between two GC rounds: the master's
        // mod revision says so.
        assert_eq!(b.acquire(420, "k8s:app=web").await.unwrap(), AcquireOutcome::Acquired);
        let reused = raw_mod_revision(&mut c, &master).await.expect("master");
        assert!(
            reused > unused,
            "a new value key moves the master ({unused} -> {reused})"
        );
        assert_eq!(raw_get(&mut c, &master).await.unwrap().0, "k8s:app=web");
        b.release("k8s:app=web").await.unwrap();
        assert_eq!(raw_mod_revision(&mut c, &master).await, Some(reused));

        // Rewriting an existing value key (a reconcile pass) leaves it.
        assert_eq!(b.acquire(420, "k8s:app=web").await.unwrap(), AcquireOutcome::Acquired);
        let held = raw_mod_revision(&mut c, &master).await.expect("master");
        assert_eq!(b.acquire(420, "k8s:app=web").await.unwrap(), AcquireOutcome::Acquired);
        assert_eq!(raw_mod_revision(&mut c, &master).await, Some(held));
        let value = raw_get(&mut c, &b.layout().value_key("k8s:app=web", "node-b")).await;
        assert_eq!(value, Some(("420".to_string(), b.lease_id())));

        // Another label set's acquire of the id writes nothing.
        assert_eq!(b.acquire(420, "k8s:app=db").await.unwrap(), AcquireOutcome::Conflict);
        assert_eq!(raw_mod_revision(&mut c, &master).await, Some(held));
    }

    #[tokio::test]
    async fn etcd_release_deletes_only_this_nodes_value_key() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = backend(&etcd, "node-a").await;
        let b = backend(&etcd, "node-b").await;
        let mut c = raw(&etcd).await;
        let layout = a.layout().clone();
        assert_eq!(
            a.create_identity(500, "k8s:app=web").await.unwrap(),
            CreateOutcome::Created
        );
        assert_eq!(b.acquire(500, "k8s:app=web").await.unwrap(), AcquireOutcome::Acquired);
        a.release("k8s:app=web").await.unwrap();
        a.release("k8s:app=web").await.unwrap(); // idempotent
        let keys = raw_keys(&mut c, layout.prefix()).await;
        assert_eq!(
            keys.keys().cloned().collect::<Vec<_>>(),
            [layout.id_key(500), layout.value_key("k8s:app=web", "node-b")]
        );
        assert_eq!(a.held_id("k8s:app=web").await.unwrap(), Some(500));
        b.release("k8s:app=web").await.unwrap();
        assert_eq!(a.held_id("k8s:app=web").await.unwrap(), None);
        assert!(
            raw_get(&mut c, &layout.id_key(500)).await.is_some(),
            "the master key stays for GC"
        );
    }

    #[tokio::test]
    async fn etcd_keys_and_values_follow_the_layout() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let opts = EtcdOptions {
            prefix: "test/pfx".into(),
            cluster: "c1".into(),
            ..options(&etcd.endpoint(), "node-a")
        };
        let a = EtcdBackend::connect(opts, &Controllers::new()).await.unwrap();
        assert_eq!(a.kind(), "etcd");
        let mut c = raw(&etcd).await;
        let labels = "k8s:app.kubernetes.io/name=x,k8s:app=web";
        assert_eq!(a.create_identity(600, labels).await.unwrap(), CreateOutcome::Created);
        let entry = IpEntry {
            node: "someone-else".into(),
            named_ports: Vec::new(),
            ..ip_entry("198.18.0.0/24", 600)
        };
        a.upsert_ip(&entry).await.unwrap();
        let keys = raw_keys(&mut c, "").await;
        let lease = a.lease_id();
        let expected_entry = IpEntry {
            node: "node-a".into(),
            named_ports: Vec::new(),
            ..entry
        };
        let ip_json = serde_json::to_string(&expected_entry).unwrap();
        let expected: BTreeMap<String, (String, i64)> = [
            ("test/pfx/identities/v1/id/600".to_string(), (labels.to_string(), 0)),
            (
                format!("test/pfx/identities/v1/value/{labels}/node-a"),
                ("600".to_string(), lease),
            ),
            ("test/pfx/ip/v1/c1/198.18.0.0/24".to_string(), (ip_json, lease)),
        ]
        .into();
        assert_eq!(keys, expected);
        let (ips, _) = a.list_ips().await.unwrap();
        assert_eq!(ips, [expected_entry]);
        let (ids, _) = a.list_identities().await.unwrap();
        assert_eq!(
            ids,
            [IdentityRecord {
                id: 600,
                labels: labels.into()
            }]
        );
        let ttl = c.lease_time_to_live(lease, None).await.unwrap();
        assert!(ttl.ttl() > 0 && ttl.ttl() <= 2, "lease TTL {}", ttl.ttl());
    }

    #[tokio::test]
    async fn etcd_label_sets_sharing_a_key_prefix_stay_apart() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = backend(&etcd, "node-a").await;
        let b = backend(&etcd, "node-b").await;
        let mut c = raw(&etcd).await;
        // "k8s:example.com" (empty value) is a key prefix of the other set.
        let short = "k8s:app=web,k8s:example.com";
        let long = "k8s:app=web,k8s:example.com/tier=db";
        assert_eq!(b.create_identity(700, long).await.unwrap(), CreateOutcome::Created);
        assert_eq!(a.held_id(short).await.unwrap(), None);
        assert_eq!(a.create_identity(701, short).await.unwrap(), CreateOutcome::Created);
        assert_eq!(a.held_id(short).await.unwrap(), Some(701));
        assert_eq!(a.held_id(long).await.unwrap(), Some(700));
        assert_eq!(
            b.create_identity(702, short).await.unwrap(),
            CreateOutcome::LabelsHeldAs(701)
        );
        assert_eq!(
            b.create_identity(700, short).await.unwrap(),
            CreateOutcome::LabelsHeldAs(701)
        );
        assert_eq!(
            a.create_identity(703, long).await.unwrap(),
            CreateOutcome::LabelsHeldAs(700)
        );
        // Master gone: the longer set's keys do not block re-creation.
        c.delete(a.layout().id_key(701), None).await.unwrap();
        assert_eq!(a.acquire(701, short).await.unwrap(), AcquireOutcome::MasterRecreated);
        // Releasing one set leaves the other's keys.
        a.release(short).await.unwrap();
        assert_eq!(a.held_id(short).await.unwrap(), None);
        assert_eq!(a.held_id(long).await.unwrap(), Some(700));
        // No exact key of `short` left, only the longer set's (colliding) one.
        assert_eq!(b.create_identity(700, short).await.unwrap(), CreateOutcome::IdTaken);
        assert_eq!(
            b.create_identity(701, short).await.unwrap(),
            CreateOutcome::LabelsHeldAs(701)
        );
        assert_eq!(b.create_identity(704, short).await.unwrap(), CreateOutcome::Created);
        assert_eq!(a.held_id(short).await.unwrap(), Some(704));
        assert_eq!(
            a.create_identity(705, short).await.unwrap(),
            CreateOutcome::LabelsHeldAs(704)
        );
    }

    #[tokio::test]
    async fn etcd_list_then_watch_delivers_later_changes_in_order() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = backend(&etcd, "node-a").await;
        let b = backend(&etcd, "node-b").await;
        let mut c = raw(&etcd).await;
        a.create_identity(800, "k8s:app=a").await.unwrap();
        let (ids, revision) = a.list_identities().await.unwrap();
        assert_eq!(ids.iter().map(|r| r.id).collect::<Vec<_>>(), [800]);
        let mut watch = a.watch_identities(revision).await.unwrap();
        b.create_identity(801, "k8s:app=b").await.unwrap();
        // A new value key puts the master again (the GC's fence): the same
        // record once more, which the allocator's cache ignores.
        a.acquire(801, "k8s:app=b").await.unwrap();
        a.create_identity(802, "k8s:app=c").await.unwrap();
        c.delete(a.layout().id_key(800), None).await.unwrap();
        let record = |id, labels: &str| {
            IdentityEvent::Upsert(IdentityRecord {
                id,
                labels: labels.into(),
            })
        };
        assert_eq!(next(&mut watch).await, record(801, "k8s:app=b"));
        assert_eq!(next(&mut watch).await, record(801, "k8s:app=b"));
        assert_eq!(next(&mut watch).await, record(802, "k8s:app=c"));
        assert_eq!(next(&mut watch).await, IdentityEvent::Delete { id: 800 });
        // From the beginning: the whole history.
        let mut all = a.watch_identities(0).await.unwrap();
        assert_eq!(next(&mut all).await, record(800, "k8s:app=a"));

        let (ips, revision) = b.list_ips().await.unwrap();
        assert!(ips.is_empty());
        let mut watch = b.watch_ips(revision).await.unwrap();
        a.upsert_ip(&ip_entry("198.18.0.1", 801)).await.unwrap();
        a.upsert_ip(&ip_entry("198.18.0.2", 802)).await.unwrap();
        a.delete_ip("198.18.0.1").await.unwrap();
        // b took 198.18.0.2 over: a's late delete must not withdraw it, and
        // b's delete of an address a holds does nothing either.
        b.upsert_ip(&ip_entry("198.18.0.2", 801)).await.unwrap();
        a.delete_ip("198.18.0.2").await.unwrap();
        a.upsert_ip(&ip_entry("198.18.0.3", 801)).await.unwrap();
        b.delete_ip("198.18.0.3").await.unwrap();
        b.delete_ip("198.18.0.9").await.unwrap(); // absent: fine
        let with_node = |ip: &str, id, node: &str| {
            IpEvent::Upsert(IpEntry {
                node: node.into(),
                named_ports: Vec::new(),
                ..ip_entry(ip, id)
            })
        };
        assert_eq!(next(&mut watch).await, with_node("198.18.0.1", 801, "node-a"));
        assert_eq!(next(&mut watch).await, with_node("198.18.0.2", 802, "node-a"));
        assert_eq!(
            next(&mut watch).await,
            IpEvent::Delete {
                ip: "198.18.0.1".into()
            }
        );
        assert_eq!(next(&mut watch).await, with_node("198.18.0.2", 801, "node-b"));
        assert_eq!(next(&mut watch).await, with_node("198.18.0.3", 801, "node-a"));
        let (ips, _) = a.list_ips().await.unwrap();
        let owners: Vec<_> = ips.iter().map(|e| (e.ip.as_str(), e.node.as_str())).collect();
        assert_eq!(owners, [("198.18.0.2", "node-b"), ("198.18.0.3", "node-a")]);
        // Undecodable entries are skipped by lists and watches.
        c.put(a.layout().ip_key("198.18.0.4"), "not json", None).await.unwrap();
        a.upsert_ip(&ip_entry("198.18.0.5", 801)).await.unwrap();
        assert_eq!(next(&mut watch).await, with_node("198.18.0.5", 801, "node-a"));
        assert_eq!(a.list_ips().await.unwrap().0.len(), 3);
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn etcd_listing_a_prefix_larger_than_a_page_returns_every_entry_at_one_revision() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = backend(&etcd, "node-a").await;
        let count = 2 * LIST_PAGE_SIZE as usize + 500;
        let puts = (0..count).map(|i| {
            let a = &a;
            async move {
                let ip = format!("198.18.{}.{}", i / 250, i % 250 + 1);
                a.upsert_ip(&ip_entry(&ip, 900)).await.expect("etcd takes the entry");
            }
        });
        futures::stream::iter(puts)
            .buffer_unordered(32)
            .collect::<Vec<()>>()
            .await;
        let mut c = raw(&etcd).await;
        let now = c.get("x", None).await.unwrap().header().unwrap().revision();
        let (entries, revision) = a.list_ips().await.expect("a listing over several pages succeeds");
        assert_eq!(
            entries.len(),
            count,
            "a listing must return every entry, not only the first page"
        );
        assert_eq!(revision, now, "the listing is at the revision of its first page");
        let ips: std::collections::BTreeSet<_> = entries.iter().map(|e| e.ip.clone()).collect();
        assert_eq!(ips.len(), count, "no entry listed twice across page boundaries");
    }

    #[tokio::test]
    async fn etcd_watch_from_a_compacted_revision_is_compacted() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = backend(&etcd, "node-a").await;
        let mut c = raw(&etcd).await;
        for i in 0..5 {
            a.create_identity(900 + i, &format!("k8s:app=c{i}")).await.unwrap();
            a.upsert_ip(&ip_entry(&format!("198.18.1.{i}"), 900 + i)).await.unwrap();
        }
        let (_, revision) = a.list_identities().await.unwrap();
        c.compact(revision, None).await.unwrap();
        let mut watch = a.watch_identities(revision - 3).await.unwrap();
        match next_err(&mut watch).await {
            BackendError::Compacted {
                what,
                revision: asked,
                compacted,
            } => {
                assert_eq!((what, asked, compacted), ("identities", revision - 3, revision));
            }
            other => panic!("expected Compacted, got {other:?}"),
        }
        assert!(
            tokio::time::timeout(Duration::from_secs(1), watch.next())
                .await
                .unwrap()
                .is_none()
        );
        let mut watch = a.watch_ips(1).await.unwrap();
        assert!(matches!(next_err(&mut watch).await, BackendError::Compacted { .. }));
        // From the compaction revision on, watching works.
        let mut watch = a.watch_identities(revision).await.unwrap();
        a.create_identity(999, "k8s:app=late").await.unwrap();
        assert!(matches!(next(&mut watch).await, IdentityEvent::Upsert(r) if r.id == 999));
    }

    #[tokio::test]
    async fn etcd_dead_nodes_keys_expire_with_its_lease_and_shutdown_revokes() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = backend(&etcd, "node-a").await;
        let b = backend(&etcd, "node-b").await;
        let mut c = raw(&etcd).await;
        let layout = a.layout().clone();
        a.create_identity(1100, "k8s:app=web").await.unwrap();
        b.acquire(1100, "k8s:app=web").await.unwrap();
        a.upsert_ip(&ip_entry("198.18.2.1", 1100)).await.unwrap();
        b.upsert_ip(&ip_entry("198.18.2.2", 1100)).await.unwrap();
        // Keepalives hold a's keys past the TTL.
        tokio::time::sleep(TTL + Duration::from_millis(500)).await;
        assert!(
            raw_get(&mut c, &layout.value_key("k8s:app=web", "node-a"))
                .await
                .is_some()
        );

        drop(a); // the process "dies": nothing revoked
        let a_value = layout.value_key("k8s:app=web", "node-a");
        let a_ip = layout.ip_key("198.18.2.1");
        let took = eventually("node-a's keys expire", Duration::from_secs(6), || {
            let mut c = c.clone();
            let (a_value, a_ip) = (a_value.clone(), a_ip.clone());
            async move { raw_get(&mut c, &a_value).await.is_none() && raw_get(&mut c, &a_ip).await.is_none() }
        })
        .await;
        eprintln!("a dead node's keys expired {took:?} after its drop (TTL {TTL:?})");
        assert!(took >= Duration::from_millis(900), "expired too early: {took:?}");
        let keys = raw_keys(&mut c, layout.prefix()).await;
        assert_eq!(
            keys.keys().cloned().collect::<Vec<_>>(),
            [
                layout.id_key(1100),
                layout.value_key("k8s:app=web", "node-b"),
                layout.ip_key("198.18.2.2")
            ]
        );

        let started = Instant::now();
        b.shutdown().await;
        assert_eq!(
            raw_keys(&mut c, layout.prefix()).await.len(),
            1,
            "only the master key is left"
        );
        eprintln!("shutdown revoked the lease in {:?}", started.elapsed());
    }

    #[tokio::test]
    async fn etcd_outage_is_unavailable_quickly_and_recovery_keeps_the_lease() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = Arc::new(backend(&etcd, "node-a").await);
        let layout = a.layout().clone();
        a.create_identity(1200, "k8s:app=web").await.unwrap();
        let lease = a.lease_id();
        let (_, revision) = a.list_identities().await.unwrap();
        let mut watch = a.watch_identities(revision).await.unwrap();

        let etcd = etcd.stop_async().await;
        let down = Instant::now();
        assert!(matches!(next_err(&mut watch).await, BackendError::Unavailable { .. }));
        let started = Instant::now();
        let err = a.create_identity(1201, "k8s:app=db").await.unwrap_err();
        assert_unavailable(&err, "allocating identity 1201 for k8s:app=db");
        assert_unavailable(&a.held_id("k8s:app=web").await.unwrap_err(), "looking up");
        assert_unavailable(
            &a.acquire(1200, "k8s:app=web").await.unwrap_err(),
            "acquiring identity 1200",
        );
        assert_unavailable(&a.list_identities().await.unwrap_err(), "listing identities");
        assert_unavailable(&a.watch_ips(0).await.err().unwrap(), "watching the IP cache");
        let took = started.elapsed();
        eprintln!("5 operations against a stopped etcd failed in {took:?}; first: {err}");
        assert!(took < REQUEST_TIMEOUT * 5, "{took:?}");

        // Down for longer than the TTL.
        tokio::time::sleep((TTL + Duration::from_secs(1)).saturating_sub(down.elapsed())).await;
        let renewed = tokio::spawn({
            let a = a.clone();
            async move { a.lease_renewed(&mut 0).await }
        });
        let etcd = etcd.restart_async().await.expect("etcd restarts");
        eprintln!("etcd was down {:?}", down.elapsed());
        // etcd keeps leases across restarts (and refreshes their TTL when a
        // leader is elected): no renewal, the keys are still there, and the
        // keeper resumes the keepalive before the TTL runs out again.
        tokio::time::sleep(TTL + Duration::from_millis(500)).await;
        assert!(!renewed.is_finished(), "an etcd restart must not replace the lease");
        renewed.abort();
        assert_eq!(a.lease_id(), lease);
        let mut c = raw(&etcd).await;
        let value = raw_get(&mut c, &layout.value_key("k8s:app=web", "node-a")).await;
        assert_eq!(
            value,
            Some(("1200".to_string(), lease)),
            "the value key survived with its lease"
        );
    }

    #[tokio::test]
    async fn etcd_outage_recovery_serves_requests_again() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = backend(&etcd, "node-a").await;
        a.create_identity(1300, "k8s:app=web").await.unwrap();
        let etcd = etcd.stop_async().await;
        assert!(a.held_id("k8s:app=web").await.is_err());
        let etcd = etcd.restart_async().await.expect("etcd restarts");
        let took = eventually("the backend answers again", Duration::from_secs(3), || async {
            a.held_id("k8s:app=web").await.is_ok()
        })
        .await;
        eprintln!("backend answered {took:?} after etcd's restart");
        assert_eq!(a.held_id("k8s:app=web").await.unwrap(), Some(1300));
        assert_eq!(
            a.create_identity(1301, "k8s:app=db").await.unwrap(),
            CreateOutcome::Created
        );
        let (_, revision) = a.list_identities().await.unwrap();
        let mut watch = a.watch_identities(revision).await.unwrap();
        a.create_identity(1302, "k8s:app=api").await.unwrap();
        assert!(matches!(next(&mut watch).await, IdentityEvent::Upsert(r) if r.id == 1302));
        drop(etcd);
    }

    #[tokio::test]
    async fn etcd_lost_lease_is_replaced_signalled_and_used() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let a = Arc::new(backend(&etcd, "node-a").await);
        let mut c = raw(&etcd).await;
        let layout = a.layout().clone();
        a.create_identity(1400, "k8s:app=web").await.unwrap();
        let old = a.lease_id();
        // Two waiters (the allocator's and the IP cache's passes), each
        // with the last replacement it heard of.
        let waiter = |seen: u64| {
            let a = a.clone();
            tokio::spawn(async move {
                let mut seen = seen;
                a.lease_renewed(&mut seen).await;
                seen
            })
        };
        let renewed = waiter(0);
        let other = waiter(0);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!renewed.is_finished() && !other.is_finished());
        // The lease is gone (as after a partition longer than the TTL).
        c.lease_revoke(old).await.unwrap();
        assert_eq!(raw_get(&mut c, &layout.value_key("k8s:app=web", "node-a")).await, None);
        let started = Instant::now();
        let seen = tokio::time::timeout(TTL * 2, renewed)
            .await
            .expect("lease_renewed within 2 TTLs")
            .unwrap();
        let other_seen = tokio::time::timeout(TTL * 2, other)
            .await
            .expect("every waiter hears the replacement")
            .unwrap();
        assert_eq!(seen, other_seen);
        eprintln!("a revoked lease was replaced and signalled in {:?}", started.elapsed());
        let new = a.lease_id();
        assert_ne!(new, old);
        assert_eq!(a.acquire(1400, "k8s:app=web").await.unwrap(), AcquireOutcome::Acquired);
        a.upsert_ip(&ip_entry("198.18.3.1", 1400)).await.unwrap();
        assert_eq!(
            raw_get(&mut c, &layout.value_key("k8s:app=web", "node-a")).await,
            Some(("1400".to_string(), new))
        );
        assert_eq!(
            raw_get(&mut c, &layout.ip_key("198.18.3.1")).await.map(|v| v.1),
            Some(new)
        );
        assert!(c.lease_time_to_live(new, None).await.unwrap().ttl() > 0);
        // A second loss is signalled again (a new call waits for the next one).
        let renewed = waiter(seen);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!renewed.is_finished());
        c.lease_revoke(new).await.unwrap();
        // A write with the lost lease is refused and pokes the keeper.
        let err = a.acquire(1400, "k8s:app=web").await;
        if let Err(err) = &err {
            assert_unavailable(err, "acquiring identity 1400");
        }
        let mut seen = tokio::time::timeout(TTL * 2, renewed)
            .await
            .expect("second renewal")
            .unwrap();
        let third = a.lease_id();
        assert_ne!(third, new);
        // A replacement while nobody waits (the caller busy re-writing its
        // keys) is reported by the next call, once.
        c.lease_revoke(third).await.unwrap();
        eventually("the third lease is replaced", TTL * 2, || async {
            a.lease_id() != third
        })
        .await;
        tokio::time::timeout(Duration::from_millis(100), a.lease_renewed(&mut seen))
            .await
            .expect("an unreported replacement completes at once");
        assert!(
            tokio::time::timeout(Duration::from_millis(100), a.lease_renewed(&mut seen))
                .await
                .is_err(),
            "a reported replacement is not reported again"
        );
    }

    /// A TCP proxy in front of etcd that can black-hole the network.
    struct Proxy {
        addr: SocketAddr,
        connected: watch::Sender<bool>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Proxy {
        async fn start(target: SocketAddr) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (connected, state) = watch::channel(true);
            let task = tokio::spawn(async move {
                loop {
                    let Ok((mut inbound, _)) = listener.accept().await else {
                        return;
                    };
                    let mut state = state.clone();
                    tokio::spawn(async move {
                        let up = *state.borrow();
                        if !up {
                            // Held silent, closed when the network heals.
                            wait_until(&mut state, true).await;
                            drop(inbound);
                            return;
                        }
                        let Ok(mut outbound) = TcpStream::connect(target).await else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            () = wait_until(&mut state, false) => wait_until(&mut state, true).await,
                        }
                    });
                }
            });
            Self { addr, connected, task }
        }

        fn set_connected(&self, up: bool) {
            self.connected.send_replace(up);
        }
    }

    /// Waits until the proxy's state is `up` (or the proxy is gone).
    async fn wait_until(state: &mut watch::Receiver<bool>, up: bool) {
        let _ = state.wait_for(|now| *now == up).await.map(|_| ());
    }

    impl Drop for Proxy {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    #[tokio::test]
    async fn etcd_partition_longer_than_the_ttl_replaces_the_lease() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let proxy = Proxy::start(etcd.client_addr()).await;
        let a = Arc::new(
            EtcdBackend::connect(
                options(&format!("http://{}", proxy.addr), "node-a"),
                &Controllers::new(),
            )
            .await
            .unwrap(),
        );
        let b = backend(&etcd, "node-b").await;
        let mut c = raw(&etcd).await;
        let layout = a.layout().clone();
        a.create_identity(1500, "k8s:app=web").await.unwrap();
        b.acquire(1500, "k8s:app=web").await.unwrap();
        a.upsert_ip(&ip_entry("198.18.4.1", 1500)).await.unwrap();
        let old = a.lease_id();
        let renewed = tokio::spawn({
            let a = a.clone();
            async move { a.lease_renewed(&mut 0).await }
        });

        proxy.set_connected(false);
        let cut = Instant::now();
        // A black hole: requests hang, bounded by the request timeout.
        let started = Instant::now();
        let err = a.held_id("k8s:app=web").await.unwrap_err();
        let took = started.elapsed();
        assert_unavailable(&err, "looking up the identity held for k8s:app=web");
        assert!(
            took >= REQUEST_TIMEOUT && took < REQUEST_TIMEOUT + Duration::from_secs(1),
            "{took:?}"
        );
        eprintln!("a black-holed request failed after {took:?}: {err}");
        // etcd expires the lease: a's keys vanish, b's stay.
        let a_value = layout.value_key("k8s:app=web", "node-a");
        let gone = eventually("node-a's keys expire in etcd", Duration::from_secs(6), || {
            let (mut c, key) = (c.clone(), a_value.clone());
            async move { raw_get(&mut c, &key).await.is_none() }
        })
        .await;
        eprintln!("partitioned node's lease expired {gone:?} into the partition");
        assert_eq!(raw_get(&mut c, &layout.ip_key("198.18.4.1")).await, None);
        assert!(
            raw_get(&mut c, &layout.value_key("k8s:app=web", "node-b"))
                .await
                .is_some()
        );
        assert!(!renewed.is_finished(), "no renewal while etcd is unreachable");

        proxy.set_connected(true);
        let healed = Instant::now();
        tokio::time::timeout(Duration::from_secs(5), renewed)
            .await
            .expect("lease_renewed after the partition healed")
            .unwrap();
        eprintln!(
            "lease replaced {:?} after healing a {:?} partition",
            healed.elapsed(),
            cut.elapsed()
        );
        let new = a.lease_id();
        assert_ne!(new, old);
        assert_eq!(a.acquire(1500, "k8s:app=web").await.unwrap(), AcquireOutcome::Acquired);
        a.upsert_ip(&ip_entry("198.18.4.1", 1500)).await.unwrap();
        assert_eq!(raw_get(&mut c, &a_value).await, Some(("1500".to_string(), new)));
        assert_eq!(
            raw_get(&mut c, &layout.ip_key("198.18.4.1")).await.map(|v| v.1),
            Some(new)
        );
    }

    #[tokio::test]
    async fn etcd_started_without_etcd_grants_its_lease_when_etcd_answers() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let endpoint = etcd.endpoint();
        let etcd = etcd.stop_async().await;
        let started = Instant::now();
        let a = Arc::new(
            EtcdBackend::start(options(&endpoint, "node-a"), &Controllers::new())
                .await
                .expect("starts while etcd is away"),
        );
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
        assert_eq!(a.lease_id(), NO_LEASE);
        let err = a.upsert_ip(&ip_entry("198.18.0.9", 300)).await.unwrap_err();
        assert_unavailable(&err, "publishing IP cache entry 198.18.0.9");
        assert!(err.to_string().contains("no node lease yet"), "{err}");
        let err = a.acquire(1400, "k8s:app=web").await.unwrap_err();
        assert!(err.to_string().contains("no node lease yet"), "{err}");
        assert!(matches!(a.list_ips().await, Err(BackendError::Unavailable { .. })));
        let renewed = tokio::spawn({
            let a = a.clone();
            async move { a.lease_renewed(&mut 0).await }
        });

        let etcd = etcd.restart_async().await.expect("etcd restarts");
        tokio::time::timeout(Duration::from_secs(10), renewed)
            .await
            .expect("the first lease is reported like a replacement")
            .expect("the waiter");
        let lease = a.lease_id();
        assert_ne!(lease, NO_LEASE);
        a.upsert_ip(&ip_entry("198.18.0.9", 300))
            .await
            .expect("written on the lease");
        let mut c = raw(&etcd).await;
        let key = a.layout().ip_key("198.18.0.9");
        assert_eq!(raw_get(&mut c, &key).await.map(|(_, l)| l), Some(lease));
        a.shutdown().await;
        assert_eq!(
            raw_get(&mut c, &key).await,
            None,
            "the lease granted late is revoked too"
        );
    }

    #[tokio::test]
    async fn etcd_connect_fails_fast_without_etcd_and_rejects_bad_names() {
        let etcd = EtcdServer::start_async().await.expect("etcd starts");
        let endpoint = etcd.endpoint();
        let etcd = etcd.stop_async().await;
        let started = Instant::now();
        let err = EtcdBackend::connect(options(&endpoint, "node-a"), &Controllers::new())
            .await
            .unwrap_err();
        assert_unavailable(&err, "connecting to etcd");
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
        let err = EtcdBackend::connect(options(&endpoint, "a/b"), &Controllers::new())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("invalid node name"), "{err}");
        let err = EtcdBackend::connect(options(&endpoint, ""), &Controllers::new())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("invalid node name"), "{err}");
        drop(etcd);
    }
}
