//! The `stale-objects` duty's telemetry: each named event writes its log
//! line and updates its metric in one place. Metrics are
//! `rivet_operator_stale_*`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    call: &'static str,
    error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindErrorLabels {
    kind: String,
    error: &'static str,
}

/// The metrics of the `stale-objects` duty.
#[derive(Clone, Debug, Default)]
pub struct StaleMetrics {
    endpoints_deleted: Family<ReasonLabels, Counter>,
    endpoints_kept: Family<ReasonLabels, Counter>,
    taints_added: Family<ReasonLabels, Counter>,
    nodes_not_ready: Gauge,
    errors: Family<ErrorLabels, Counter>,
    watch_errors: Family<KindErrorLabels, Counter>,
}

impl StaleMetrics {
    /// Registers every metric under `registry` (the operator's, prefixed
    /// `rivet_operator`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("stale");
        r.register(
            "endpoints_deleted",
            "RivetEndpoints deleted because their pod is gone (pod_gone) or was re-created with another UID (pod_replaced)",
            self.endpoints_deleted.clone(),
        );
        r.register(
            "endpoints_kept",
            "Candidates of the endpoint GC kept after all: the live GET found their pod (pod_exists) or the endpoint changed before the delete (changed)",
            self.endpoints_kept.clone(),
        );
        r.register(
            "node_taints_added",
            "Not-ready taints put back on Nodes, per reason (not_ready, no_ready_condition, heartbeat_stale)",
            self.taints_added.clone(),
        );
        r.register(
            "nodes_not_ready",
            "Nodes whose RivetNode was not ready at the last taint pass",
            self.nodes_not_ready.clone(),
        );
        r.register(
            "errors",
            "Failed API calls of the duty, per call and error kind",
            self.errors.clone(),
        );
        r.register(
            "watch_errors",
            "Failed lists and watches of the duty's caches, per kind and error kind",
            self.watch_errors.clone(),
        );
    }

    /// A RivetEndpoint was deleted.
    pub(crate) fn endpoint_deleted(&self, endpoint: &str, reason: &'static str, owner_uid: Option<&str>) {
        self.endpoints_deleted.get_or_create(&ReasonLabels { reason }).inc();
        tracing::info!(endpoint, reason, owner_uid, "deleted a stale RivetEndpoint");
    }

    /// A candidate of the endpoint GC was kept.
    pub(crate) fn endpoint_kept(&self, endpoint: &str, reason: &'static str) {
        self.endpoints_kept.get_or_create(&ReasonLabels { reason }).inc();
        tracing::debug!(endpoint, reason, "kept a RivetEndpoint the caches called stale");
    }

    /// The not-ready taint was put back on `node`.
    pub(crate) fn taint_added(&self, node: &str, reason: &'static str, detail: &str) {
        self.taints_added.get_or_create(&ReasonLabels { reason }).inc();
        tracing::info!(node, reason, "put the not-ready taint back on the node: {detail}");
    }

    /// A taint pass judged `count` nodes not ready.
    pub(crate) fn nodes_not_ready(&self, count: usize) {
        self.nodes_not_ready.set(count as i64);
    }

    /// An API call failed.
    pub(crate) fn call_failed(&self, call: &'static str, error: &'static str, text: &str) {
        self.errors.get_or_create(&ErrorLabels { call, error }).inc();
        tracing::warn!(call, error, "{text}");
    }

    /// A cache's list or watch failed (the watcher retries with backoff).
    pub(crate) fn watch_failed(&self, kind: &str, e: &kube::runtime::watcher::Error) {
        let error = match e {
            kube::runtime::watcher::Error::InitialListFailed(source)
            | kube::runtime::watcher::Error::WatchStartFailed(source)
            | kube::runtime::watcher::Error::WatchFailed(source) => rivet_k8s::error_kind(source),
            kube::runtime::watcher::Error::WatchError(status) if status.code == 403 => "forbidden",
            kube::runtime::watcher::Error::WatchError(_) => "watch_error",
            kube::runtime::watcher::Error::NoResourceVersion => "other",
        };
        self.watch_errors
            .get_or_create(&KindErrorLabels {
                kind: kind.to_owned(),
                error,
            })
            .inc();
        tracing::warn!(kind, error, "watch failed (retrying with backoff): {e}");
    }
}
