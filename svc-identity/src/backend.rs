//! The store behind identities and the IP cache, as a small trait with two
//! implementations: etcd (a cluster) and an embedded crash-safe file (one
//! node, the default). Both follow the etcd layout of DESIGN.md §4 under a
//! configurable prefix (default `rivet/state/`):
//!
//! - `identities/v1/id/<id>` → canonical labels (the master key);
//! - `identities/v1/value/<labels>/<node>` → id (one per node using it, bound
//!   to the node's lease);
//! - `ip/v1/<cluster>/<ip>` → [`IpEntry`] as JSON, bound to the node's lease.
//!
//! Allocation never takes a lock: a new identity is one transaction that
//! creates the master key only if the id is free AND no node holds a value
//! key for the labels (so two nodes racing on one label set end with one id,
//! and an id is never bound to two label sets).

use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

/// A store revision (etcd's; the embedded store counts its own).
pub type Revision = i64;

/// One identity as stored: its number and canonical labels
/// (`Labels` printed, sorted, comma-separated).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct IdentityRecord {
    /// The number (256..=max).
    pub id: u32,
    /// Canonical label set.
    pub labels: String,
}

/// A change of the master keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityEvent {
    /// An identity appeared (or its master key was re-created).
    Upsert(IdentityRecord),
    /// A master key was deleted.
    Delete {
        /// Its number.
        id: u32,
    },
}

/// The outcome of [`IdentityBackend::create_identity`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateOutcome {
    /// The master key and this node's value key were created.
    Created,
    /// Another node already holds the labels under this id: use it
    /// (this node's value key was NOT written; call `acquire`).
    LabelsHeldAs(u32),
    /// The id is taken by another label set: try another id.
    IdTaken,
}

/// The outcome of [`IdentityBackend::acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcquireOutcome {
    /// This node's value key for (labels, id) exists now.
    Acquired,
    /// The master key of `id` is gone (garbage-collected); it was re-created
    /// with the same id because the id was free, and the value key written.
    MasterRecreated,
    /// The master key of `id` names other labels, or is gone and the id was
    /// taken meanwhile: allocate anew.
    Conflict,
}

/// One IP cache entry in the store.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct IpEntry {
    /// The address or prefix, canonical text (`198.18.0.2`, `198.18.0.0/24`).
    pub ip: String,
    /// Its identity.
    pub identity: u32,
    /// The node hosting it (its underlay address), if any.
    pub host_ip: Option<String>,
    /// Pod namespace, for inspection.
    pub namespace: Option<String>,
    /// Pod name, for inspection.
    pub pod: Option<String>,
    /// The node that published it.
    pub node: String,
    /// The named container ports of the pod at this address (egress rules
    /// naming a port resolve against them on every node). Absent when empty:
    /// older readers ignore it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub named_ports: Vec<IpNamedPort>,
}

/// A named container port of the pod at an [`IpEntry`]'s address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct IpNamedPort {
    /// The port's name (an IANA service name).
    pub name: String,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    /// The port number (1..65535).
    pub port: u16,
}

/// A change of the IP cache in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpEvent {
    /// An entry appeared or changed.
    Upsert(IpEntry),
    /// An entry was deleted.
    Delete {
        /// Its address or prefix.
        ip: String,
    },
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The store cannot be reached (etcd down, partition): retry.
    #[error("{action}: the store is unreachable: {detail}")]
    Unavailable {
        /// What was being done.
        action: String,
        /// Why.
        detail: String,
    },
    /// A watch started from a revision the store compacted away: re-list.
    #[error("watching {what} from revision {revision}: compacted (store is at {compacted}); re-list")]
    Compacted {
        /// What was watched.
        what: &'static str,
        /// The revision asked for.
        revision: Revision,
        /// The compaction revision.
        compacted: Revision,
    },
    /// Stored data could not be decoded.
    #[error("{key}: stored value is invalid: {detail}")]
    Corrupt {
        /// The key.
        key: String,
        /// What is wrong.
        detail: String,
    },
    /// The store refused the request (the Kubernetes API: RBAC, validation):
    /// retrying does not help, the configuration must change.
    #[error("{action}: the API server refused `{verb}` on {resource} ({code}): {message}{}", refusal_hint(*.code))]
    Refused {
        /// What was being done.
        action: String,
        /// The API verb (`create`, `get`, `list`, `watch`).
        verb: &'static str,
        /// The resource (`rivetidentities.rivet.io`).
        resource: &'static str,
        /// The HTTP status (403: not allowed by RBAC).
        code: u16,
        /// The API server's message.
        message: String,
    },
    /// Local I/O of the embedded store failed.
    #[error("{action}: {source}")]
    Local {
        /// What was being done.
        action: String,
        /// The error.
        source: rivet_common::state_file::StateFileError,
    },
}

fn refusal_hint(code: u16) -> &'static str {
    match code {
        401 | 403 => " (svc-identity's ServiceAccount needs the permissions of deploy/rbac/svc-identity.yaml)",
        _ => "",
    }
}

/// In which order the allocator tries ids for a label set no node has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdOrder {
    /// From a random id on: concurrent nodes spread over the range. For
    /// stores whose create checks the label set too (etcd, embedded).
    Random,
    /// From an id derived from a hash of the labels on, the same on every
    /// node: two nodes creating one set race for the same id, and the
    /// store's create-if-absent lets one win. For stores that can only
    /// create by id (Kubernetes).
    LabelHash,
}

/// The store of identities and IP cache entries for one node.
///
/// Every method is safe to retry. Value keys and IP entries written by this
/// node are bound to its lease (etcd) and vanish when the node is gone.
#[tonic::async_trait]
pub trait IdentityBackend: Send + Sync + 'static {
    /// `"etcd"`, `"embedded"` or `"kubernetes"`, for status.
    fn kind(&self) -> &'static str;

    /// How the allocator picks ids for a new label set.
    fn id_order(&self) -> IdOrder {
        IdOrder::Random
    }

    /// The lease this node's keys are bound to, for status (0 without one).
    fn lease_id(&self) -> i64 {
        0
    }

    /// Every identity (master keys) and the revision of the listing.
    async fn list_identities(&self) -> Result<(Vec<IdentityRecord>, Revision), BackendError>;

    /// Master key changes after `after` (exclusive). The stream ends or
    /// errs on disconnect or compaction: re-list and watch again.
    async fn watch_identities(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<IdentityEvent, BackendError>>, BackendError>;

    /// The id any node holds `labels` under (a value key), if one does.
    async fn held_id(&self, labels: &str) -> Result<Option<u32>, BackendError>;

    /// One transaction: if master key `id` is absent AND no value key exists
    /// for `labels`, create the master key (`id` → labels) and this node's
    /// value key. Otherwise report why not.
    async fn create_identity(&self, id: u32, labels: &str) -> Result<CreateOutcome, BackendError>;

    /// Writes this node's value key for (`labels`, `id`) if the master key of
    /// `id` names `labels`; re-creates a vanished master key with the same id
    /// when it is free.
    async fn acquire(&self, id: u32, labels: &str) -> Result<AcquireOutcome, BackendError>;

    /// Deletes this node's value key for `labels` (the master key stays, for
    /// the operator's GC). Idempotent.
    async fn release(&self, labels: &str) -> Result<(), BackendError>;

    /// The label sets of every value key of this node, sorted (what the
    /// allocator's reconcile pass compares with the sets it holds).
    async fn node_value_keys(&self) -> Result<Vec<String>, BackendError>;

    /// Publishes this node's IP cache entry (bound to the node's lease).
    async fn upsert_ip(&self, entry: &IpEntry) -> Result<(), BackendError>;

    /// Withdraws this node's IP cache entry. Idempotent.
    async fn delete_ip(&self, ip: &str) -> Result<(), BackendError>;

    /// Every IP cache entry of the cluster and the revision of the listing.
    async fn list_ips(&self) -> Result<(Vec<IpEntry>, Revision), BackendError>;

    /// IP cache changes after `after` (exclusive); ends or errs like
    /// [`watch_identities`](Self::watch_identities).
    async fn watch_ips(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<IpEvent, BackendError>>, BackendError>;

    /// Clean stop: the etcd store revokes the node lease, so this node's
    /// value keys and IP entries vanish at once (not after the TTL); the
    /// embedded store finishes its queued writes. The backend must not be
    /// used afterwards.
    async fn shutdown(&self) {}

    /// Completes when this node's lease was lost and replaced (etcd restart,
    /// long partition) later than `seen`, the last replacement the caller
    /// heard of (0 at first; updated): every value key and IP entry still in
    /// use must be written again. Each caller keeps its own `seen`, so every
    /// caller hears every replacement. The embedded store never completes it.
    async fn lease_renewed(&self, seen: &mut u64);
}

/// A change of a node record key (`nodes/v1/<cluster>/<node>`), undecoded:
/// the registry decodes and counts bad records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeKeyEvent {
    /// The node's key was written.
    Put {
        /// The node (the key's last segment).
        node: String,
        /// The stored value (JSON of a `rivet_common::cluster::NodeRecord`).
        value: Vec<u8>,
    },
    /// The node's key was deleted (a clean stop, an expired lease, the
    /// operator's mirror).
    Delete {
        /// The node.
        node: String,
    },
}

/// The node records of the cluster in the store: the etcd store's
/// `nodes/v1` keys, the Kubernetes store's RivetNodes
/// ([`crate::kubernetes_cluster::ClusterObjects`]); the embedded store is
/// one node and has none.
#[tonic::async_trait]
pub trait NodeStore: Send + Sync + 'static {
    /// Whether the registry writes this node's record ([`put_node`](Self::put_node)). `false`:
    /// other writers own it (the RivetNode: svc-k8s-sync its addresses,
    /// rivet-operator its pod CIDRs), and the registry takes this node's
    /// addresses and pod CIDRs from the record it lists instead.
    fn publishes_own_record(&self) -> bool {
        true
    }

    /// Writes this node's record (JSON) under its key, bound to the node
    /// lease (the lease of its value keys and IP entries).
    async fn put_node(&self, value: Vec<u8>) -> Result<(), BackendError>;

    /// Every node key of the cluster as (node, value), with the listing's
    /// revision.
    async fn list_nodes(&self) -> Result<(Vec<(String, Vec<u8>)>, Revision), BackendError>;

    /// Node key changes after `after` (exclusive); ends or errs like
    /// [`IdentityBackend::watch_identities`].
    async fn watch_nodes(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<NodeKeyEvent, BackendError>>, BackendError>;
}
