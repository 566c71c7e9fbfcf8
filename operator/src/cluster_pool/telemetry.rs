//! The cluster pool's events: each writes its log line and updates its
//! metrics in one place. Metrics are `rivet_operator_*`.

use ipnet::IpNet;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family as MetricFamily;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::allocator::Family;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FamilyLabels {
    family: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    verb: &'static str,
    error: &'static str,
}

/// The metrics of the `cluster-pool` duty.
#[derive(Clone, Debug, Default)]
pub struct PoolMetrics {
    allocated: MetricFamily<FamilyLabels, Gauge>,
    available: MetricFamily<FamilyLabels, Gauge>,
    allocations: MetricFamily<FamilyLabels, Counter>,
    releases: MetricFamily<FamilyLabels, Counter>,
    exhaustions: MetricFamily<FamilyLabels, Counter>,
    conflicts: Counter,
    created: Counter,
    deleted: Counter,
    api_errors: MetricFamily<ErrorLabels, Counter>,
}

impl PoolMetrics {
    /// New metrics, registered in `registry` (see [`PoolMetrics::register`]).
    pub fn registered(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        metrics.register(registry);
        metrics
    }

    /// Registers every metric under `registry` (the daemon's, prefixed
    /// `rivet`): `rivet_operator_pod_cidrs_*`, `rivet_operator_rivetnodes_*`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("operator");
        r.register(
            "pod_cidrs_allocated",
            "Blocks of the cluster pool held by a RivetNode, per family",
            self.allocated.clone(),
        );
        r.register(
            "pod_cidrs_available",
            "Free blocks of the cluster pool, per family",
            self.available.clone(),
        );
        r.register(
            "pod_cidr_allocations",
            "Pod CIDRs written to a RivetNode's spec, per family",
            self.allocations.clone(),
        );
        r.register(
            "pod_cidr_releases",
            "Pod CIDRs freed by a RivetNode's deletion, per family",
            self.releases.clone(),
        );
        r.register(
            "pod_cidr_exhaustions",
            "RivetNodes that found the cluster pool exhausted (condition ClusterPoolExhausted), per family",
            self.exhaustions.clone(),
        );
        r.register(
            "pod_cidr_conflicts",
            "RivetNodes found holding a pod CIDR that overlaps an older RivetNode's (condition PodCIDRConflict)",
            self.conflicts.clone(),
        );
        r.register(
            "rivetnodes_created",
            "RivetNodes created for a Node that had none",
            self.created.clone(),
        );
        r.register(
            "rivetnodes_deleted",
            "RivetNodes deleted after their Node was gone for the release grace",
            self.deleted.clone(),
        );
        r.register(
            "cluster_pool_api_errors",
            "Failed API calls of the cluster pool, per verb and error kind (conflict = a stale view, retried)",
            self.api_errors.clone(),
        );
    }

    /// The pool's usage after a pass.
    pub(crate) fn usage(&self, family: Family, allocated: u64, available: u64) {
        let labels = FamilyLabels {
            family: family.as_str(),
        };
        self.allocated.get_or_create(&labels).set(allocated as i64);
        self.available.get_or_create(&labels).set(available as i64);
    }

    /// `cidr` was written to `node`'s spec.
    pub(crate) fn allocated(&self, node: &str, cidr: &IpNet) {
        let family = Family::of(cidr).as_str();
        self.allocations.get_or_create(&FamilyLabels { family }).inc();
        tracing::info!(node, %cidr, family, "pod CIDR allocated");
    }

    /// `node`'s RivetNode is gone: its CIDRs are free.
    pub(crate) fn released(&self, node: &str, cidrs: &[IpNet]) {
        for cidr in cidrs {
            let family = Family::of(cidr).as_str();
            self.releases.get_or_create(&FamilyLabels { family }).inc();
            tracing::info!(node, %cidr, family, "pod CIDR released");
        }
    }

    /// `node` found no free block of `family`.
    pub(crate) fn exhausted(&self, node: &str, family: Family, why: &str) {
        self.exhaustions
            .get_or_create(&FamilyLabels {
                family: family.as_str(),
            })
            .inc();
        tracing::warn!(node, family = family.as_str(), "cluster pool exhausted: {why}");
    }

    /// `node` holds a CIDR that overlaps an older RivetNode's.
    pub(crate) fn conflict(&self, node: &str, why: &str) {
        self.conflicts.inc();
        tracing::warn!(node, "pod CIDR conflict: {why}");
    }

    /// A RivetNode was created for Node `node`.
    pub(crate) fn created(&self, node: &str) {
        self.created.inc();
        tracing::info!(node, "RivetNode created for its Node");
    }

    /// `node`'s Node is gone: the release grace starts.
    pub(crate) fn node_gone(&self, node: &str, grace_seconds: u64) {
        tracing::info!(
            node,
            grace_seconds,
            "Node gone: its RivetNode is deleted and its pod CIDRs released after the grace"
        );
    }

    /// `node`'s Node came back within the grace.
    pub(crate) fn node_back(&self, node: &str) {
        tracing::info!(node, "Node back within the release grace: its pod CIDRs stay");
    }

    /// `node`'s RivetNode was deleted after the grace.
    pub(crate) fn deleted(&self, node: &str) {
        self.deleted.inc();
        tracing::info!(node, "RivetNode deleted: its Node was gone for the release grace");
    }

    /// An API call failed.
    pub(crate) fn api_failed(&self, verb: &'static str, error: &'static str, text: &str) {
        self.api_errors.get_or_create(&ErrorLabels { verb, error }).inc();
        if error == "conflict" {
            tracing::debug!(verb, error, "cluster pool: {text} (a stale view; read again)");
        } else {
            tracing::warn!(verb, error, "cluster pool: {text}");
        }
    }
}
