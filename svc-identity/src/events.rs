//! svc-identity's telemetry: each named event writes its log line and
//! updates its metric in one place, so logs and metrics never disagree.
//!
//! Metrics (under the daemon's `rivet_` prefix):
//!
//! - `rivet_identity_local_allocations_total`: allocations of label sets
//!   with a known identity served while the kvstore was unreachable (their
//!   value key is written when it is back);
//! - `rivet_identity_store_pending_writes{keys}`: this node's keys not yet as
//!   desired in the store (`value_keys`, `ip_entries`), read at each scrape;
//! - `rivet_identity_reconcile_passes_total{keys, outcome}`: reconciliation
//!   passes by outcome (`succeeded`, `store_unreachable`, `store_error`);
//! - `rivet_identity_reconcile_keys_total{key, action}`: keys the passes
//!   wrote or deleted (`value`, `master`, `ip` × `created`, `updated`,
//!   `deleted`);
//! - `rivet_identity_snapshot_writes_total{outcome}`,
//!   `rivet_identity_snapshot_write_duration_seconds`,
//!   `rivet_identity_snapshot_loads_total{outcome}`: the local snapshot
//!   served while etcd is away ([`crate::snapshot`]);
//! - `rivet_identity_nodes`: the nodes of the cluster this node knows,
//!   itself included ([`crate::registry`]);
//! - `rivet_identity_node_changes_total{change}`: other nodes that
//!   `joined`, `left`, were `updated` or `restarted` (a new boot id);
//! - `rivet_identity_node_records_invalid_total{reason}`: records under
//!   `nodes/v1` skipped (`undecodable`, `name_mismatch`, `other_cluster`),
//!   and peers left out of svc-loader's set (`unroutable`);
//! - `rivet_identity_restored_released_total{kind, cause}`: state restored
//!   at start that no client claimed again, released (`ip_claims`,
//!   `value_keys`) when its client ended its replay (`replay_ended`) or
//!   when the restore grace ended (`grace_ended`).

use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family as MetricFamily;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::backend::BackendError;

/// Which of this node's keys a reconciliation pass keeps in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReconciledKeys {
    /// Value keys (and vanished master keys) of the identities held here.
    ValueKeys,
    /// This node's IP cache entries.
    IpEntries,
}

impl ReconciledKeys {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ValueKeys => "value_keys",
            Self::IpEntries => "ip_entries",
        }
    }
}

/// A kind of key a pass writes or deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreKey {
    /// `identities/v1/value/<labels>/<node>`.
    Value,
    /// `identities/v1/id/<id>` (re-created when it vanished).
    Master,
    /// `ip/v1/<cluster>/<ip>`.
    Ip,
}

impl StoreKey {
    fn as_str(self) -> &'static str {
        match self {
            Self::Value => "value",
            Self::Master => "master",
            Self::Ip => "ip",
        }
    }
}

/// What a pass did to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeyAction {
    /// Written where the store lacked it.
    Created,
    /// Written over a different value.
    Updated,
    /// Deleted.
    Deleted,
}

impl KeyAction {
    fn as_str(self) -> &'static str {
        match self {
            Self::Created => "created",
            Self::Updated => "updated",
            Self::Deleted => "deleted",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PassLabels {
    keys: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KeyLabels {
    key: &'static str,
    action: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RestoredLabels {
    kind: &'static str,
    cause: &'static str,
}

/// What restored state was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoredKind {
    /// LOCAL_ENDPOINT claims of the IP cache.
    IpClaims,
    /// This node's value keys of a previous run.
    ValueKeys,
}

/// Why restored state was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoredCause {
    /// Its client ended its replay without claiming it (EndReplay).
    ReplayEnded,
    /// `--restore-grace-seconds` ended with no claim.
    GraceEnded,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PendingLabels {
    keys: &'static str,
}

/// The metrics of svc-identity (`rivet_identity_*`); cheap to clone (every
/// clone updates the same metrics).
#[derive(Clone, Debug)]
pub struct IdentityMetrics {
    local_allocations: Counter,
    passes: MetricFamily<PassLabels, Counter>,
    keys: MetricFamily<KeyLabels, Counter>,
    snapshot_writes: MetricFamily<OutcomeLabels, Counter>,
    snapshot_write_duration: Histogram,
    snapshot_loads: MetricFamily<OutcomeLabels, Counter>,
    nodes: Gauge,
    node_changes: MetricFamily<ChangeLabels, Counter>,
    node_records_invalid: MetricFamily<ReasonLabels, Counter>,
    restored_released: MetricFamily<RestoredLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChangeLabels {
    change: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

impl Default for IdentityMetrics {
    fn default() -> Self {
        Self {
            local_allocations: Counter::default(),
            passes: MetricFamily::default(),
            keys: MetricFamily::default(),
            snapshot_writes: MetricFamily::default(),
            snapshot_write_duration: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            snapshot_loads: MetricFamily::default(),
            nodes: Gauge::default(),
            node_changes: MetricFamily::default(),
            node_records_invalid: MetricFamily::default(),
            restored_released: MetricFamily::default(),
        }
    }
}

impl IdentityMetrics {
    /// Registers every metric under `registry` (prefix it with `rivet`);
    /// `pending_writes` is read at each scrape: this node's keys not yet as
    /// desired in the store, per kind.
    pub fn register(
        &self,
        registry: &mut Registry,
        pending_writes: impl Fn() -> Vec<(ReconciledKeys, usize)> + Send + Sync + 'static,
    ) {
        let r = registry.sub_registry_with_prefix("identity");
        r.register(
            "local_allocations",
            "Allocations of label sets with a known identity served while the kvstore was unreachable",
            self.local_allocations.clone(),
        );
        r.register(
            "reconcile_passes",
            "Reconciliation passes of this node's keys with the store, by keys and outcome",
            self.passes.clone(),
        );
        r.register(
            "reconcile_keys",
            "Keys of this node the reconciliation passes wrote or deleted in the store, by key and action",
            self.keys.clone(),
        );
        r.register(
            "snapshot_writes",
            "Writes of the local snapshot served while etcd is away, by outcome",
            self.snapshot_writes.clone(),
        );
        r.register(
            "snapshot_write_duration_seconds",
            "Time to gather, encode, write and fsync the local snapshot",
            self.snapshot_write_duration.clone(),
        );
        r.register(
            "snapshot_loads",
            "Loads of the local snapshot at start, by outcome",
            self.snapshot_loads.clone(),
        );
        r.register(
            "nodes",
            "Nodes of the cluster this node knows (itself included)",
            self.nodes.clone(),
        );
        r.register(
            "node_changes",
            "Other nodes of the cluster that joined, left, were updated or restarted, as seen here",
            self.node_changes.clone(),
        );
        r.register(
            "node_records_invalid",
            "Node records of the store skipped because they are unusable, by reason",
            self.node_records_invalid.clone(),
        );
        r.register(
            "restored_released",
            "State restored at start that no client claimed again, released, by kind and cause",
            self.restored_released.clone(),
        );
        r.register_collector(Box::new(PendingWrites(Box::new(pending_writes))));
    }
}

/// `store_pending_writes{keys}`, computed at each scrape.
struct PendingWrites(Box<dyn Fn() -> Vec<(ReconciledKeys, usize)> + Send + Sync>);

impl std::fmt::Debug for PendingWrites {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingWrites")
    }
}

impl Collector for PendingWrites {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let family = MetricFamily::<PendingLabels, Gauge>::default();
        for (keys, pending) in (self.0)() {
            family
                .get_or_create(&PendingLabels { keys: keys.as_str() })
                .set(i64::try_from(pending).unwrap_or(i64::MAX));
        }
        let metric = encoder.encode_descriptor(
            "store_pending_writes",
            "This node's keys not yet as desired in the store (written or deleted when it answers), by keys",
            None,
            family.metric_type(),
        )?;
        family.encode(metric)
    }
}

/// The outcome label of a pass's result.
fn outcome(result: Result<(), &BackendError>) -> &'static str {
    match result {
        Ok(()) => "succeeded",
        Err(BackendError::Unavailable { .. }) => "store_unreachable",
        Err(_) => "store_error",
    }
}

/// The kvstore is unreachable and an identity the node knows was taken
/// locally; its value key is written by the pass after the store is back.
pub fn allocation_served_locally(m: &IdentityMetrics, id: u32, labels: &str, error: &BackendError) {
    tracing::warn!(
        id,
        labels,
        %error,
        "the kvstore is unreachable: identity taken locally, its value key is written when the store is back"
    );
    m.local_allocations.inc();
}

/// A reconciliation pass ended.
pub fn reconcile_pass_finished(m: &IdentityMetrics, keys: ReconciledKeys, result: Result<(), &BackendError>) {
    let outcome = outcome(result);
    match result {
        Ok(()) => tracing::debug!(keys = keys.as_str(), "reconciliation pass succeeded"),
        // Retried by its controller (rivet_common::controller), which logs when.
        Err(error) => tracing::warn!(
            keys = keys.as_str(),
            outcome,
            %error,
            "reconciling this node's keys with the store failed"
        ),
    }
    m.passes
        .get_or_create(&PassLabels {
            keys: keys.as_str(),
            outcome,
        })
        .inc();
}

/// A pass wrote or deleted `count` keys of one kind.
pub fn keys_reconciled(m: &IdentityMetrics, key: StoreKey, action: KeyAction, count: usize) {
    if count == 0 {
        return;
    }
    tracing::info!(
        key = key.as_str(),
        action = action.as_str(),
        count,
        "reconciliation changed this node's keys in the store"
    );
    m.keys
        .get_or_create(&KeyLabels {
            key: key.as_str(),
            action: action.as_str(),
        })
        .inc_by(count as u64);
}

/// `count` restored items nobody claimed again were released.
pub fn restored_released(m: &IdentityMetrics, kind: RestoredKind, cause: RestoredCause, count: usize) {
    if count == 0 {
        return;
    }
    let (kind, what) = match kind {
        RestoredKind::IpClaims => ("ip_claims", "IP cache entries of this node"),
        RestoredKind::ValueKeys => ("value_keys", "value keys of this node"),
    };
    let cause = match cause {
        RestoredCause::ReplayEnded => "replay_ended",
        RestoredCause::GraceEnded => "grace_ended",
    };
    tracing::info!(
        kind,
        cause,
        count,
        "releasing {what} restored at start (from the store or the local snapshot) that no client claimed again"
    );
    m.restored_released
        .get_or_create(&RestoredLabels { kind, cause })
        .inc_by(count as u64);
}

/// The snapshot was written.
pub fn snapshot_written(m: &IdentityMetrics, identities: usize, ip_entries: usize, took: Duration) {
    tracing::debug!(
        identities,
        ip_entries,
        took_us = took.as_micros() as u64,
        "local snapshot written"
    );
    m.snapshot_writes
        .get_or_create(&OutcomeLabels { outcome: "written" })
        .inc();
    m.snapshot_write_duration.observe(took.as_secs_f64());
}

/// Writing the snapshot failed (the previous one stays); its controller
/// retries unless the daemon is stopping.
pub fn snapshot_write_failed(m: &IdentityMetrics, error: &dyn std::fmt::Display) {
    tracing::warn!(%error, "writing the local snapshot failed; the previous one stays");
    m.snapshot_writes
        .get_or_create(&OutcomeLabels { outcome: "failed" })
        .inc();
}

/// The snapshot was loaded at start.
pub fn snapshot_loaded(m: &IdentityMetrics, identities: usize, ip_entries: usize, age: Option<Duration>) {
    tracing::info!(
        identities,
        ip_entries,
        age_s = age.map(|a| a.as_secs()),
        "local snapshot loaded: served until the kvstore is listed"
    );
    m.snapshot_loads
        .get_or_create(&OutcomeLabels { outcome: "loaded" })
        .inc();
}

/// No snapshot existed at start.
pub fn snapshot_missing(m: &IdentityMetrics, path: &std::path::Path) {
    tracing::info!(path = %path.display(), "no local snapshot: nothing is served before the kvstore is listed");
    m.snapshot_loads
        .get_or_create(&OutcomeLabels { outcome: "missing" })
        .inc();
}

/// A snapshot existed but cannot be used (corrupt, another version, another
/// node's or keyspace's); it is ignored and overwritten by the next write.
pub fn snapshot_unusable(m: &IdentityMetrics, reason: &dyn std::fmt::Display) {
    tracing::warn!(%reason, "the local snapshot cannot be used; nothing is served before the kvstore is listed");
    m.snapshot_loads
        .get_or_create(&OutcomeLabels { outcome: "unusable" })
        .inc();
}

/// How another node changed, as this node's registry saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeChange {
    /// A node appeared.
    Joined,
    /// A node's record went (a clean stop, an expired lease).
    Left,
    /// A node's record changed (addresses, pod CIDRs, health addresses).
    Updated,
    /// A node's record carries a new boot id (its svc-identity restarted).
    Restarted,
}

impl NodeChange {
    fn as_str(self) -> &'static str {
        match self {
            Self::Joined => "joined",
            Self::Left => "left",
            Self::Updated => "updated",
            Self::Restarted => "restarted",
        }
    }
}

/// Another node joined, left, changed or restarted; `known` nodes now
/// (this one included).
pub fn node_changed(m: &IdentityMetrics, change: NodeChange, node: &str, boot_id: &str, known: usize) {
    tracing::info!(
        node,
        change = change.as_str(),
        boot_id,
        known,
        "cluster node {}",
        change.as_str()
    );
    m.node_changes
        .get_or_create(&ChangeLabels {
            change: change.as_str(),
        })
        .inc();
    m.nodes.set(i64::try_from(known).unwrap_or(i64::MAX));
}

/// The nodes this node knows (itself included), without a change of another
/// node (the first count).
pub fn nodes_known(m: &IdentityMetrics, known: usize) {
    m.nodes.set(i64::try_from(known).unwrap_or(i64::MAX));
}

/// A record under `nodes/v1` cannot be used and was skipped.
pub fn node_record_invalid(m: &IdentityMetrics, node: &str, reason: &'static str, detail: &dyn std::fmt::Display) {
    tracing::warn!(node, reason, %detail, "skipping an unusable node record of the store");
    m.node_records_invalid.get_or_create(&ReasonLabels { reason }).inc();
}

/// A peer is left out of the set pushed to svc-loader (which would refuse
/// the whole set for it); it stays a node (remote-node).
pub fn node_unroutable(m: &IdentityMetrics, node: &str, reason: &str) {
    tracing::warn!(
        node,
        reason,
        "peer node left out of svc-loader's routes: it cannot be routed"
    );
    m.node_records_invalid
        .get_or_create(&ReasonLabels { reason: "unroutable" })
        .inc();
}
