//! svc-k8s-sync's telemetry: each named event writes its log line and
//! updates its metrics in one place, so logs and metrics never disagree.
//! Metrics are `rivet_k8s_sync_*`.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    kind: &'static str,
    error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    call: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallErrorLabels {
    call: &'static str,
    error: &'static str,
}

/// The metrics of svc-k8s-sync.
#[derive(Clone, Debug, Default)]
pub struct SyncMetrics {
    objects: Family<KindLabels, Gauge>,
    relists: Family<KindLabels, Counter>,
    watch_errors: Family<ErrorLabels, Counter>,
    cache_sync_seconds: Gauge<f64, AtomicU64>,
    cache_sync_timeouts: Counter,
    calls: Family<CallLabels, Counter>,
    call_errors: Family<CallErrorLabels, Counter>,
    replays: Counter,
    node_ready: Gauge,
    pod_cidrs_applied: Gauge,
    pod_cidrs_not_applied: Family<ReasonLabels, Counter>,
    invalid_traceparents: Counter,
}

impl SyncMetrics {
    /// Registers every metric under `registry` (prefix it with `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("k8s_sync");
        r.register("objects", "Objects in the watch cache, per kind", self.objects.clone());
        r.register(
            "relists",
            "Watch restarts that listed the kind again",
            self.relists.clone(),
        );
        r.register(
            "watch_errors",
            "Watch and list failures, per kind and error (forbidden, not_found, unavailable, ...)",
            self.watch_errors.clone(),
        );
        r.register(
            "cache_sync_seconds",
            "Time from start until every watched kind completed its initial list",
            self.cache_sync_seconds.clone(),
        );
        r.register(
            "cache_sync_timeouts",
            "Starts whose cache sync took longer than --cache-sync-timeout-seconds",
            self.cache_sync_timeouts.clone(),
        );
        r.register(
            "calls",
            "Calls made: svc-endpoint feed calls and API writes, per call",
            self.calls.clone(),
        );
        r.register(
            "call_errors",
            "Failed calls, per call and error kind",
            self.call_errors.clone(),
        );
        r.register(
            "replays",
            "Level-triggered replays of the whole state to svc-endpoint",
            self.replays.clone(),
        );
        r.register("node_ready", "1 once the node is marked ready", self.node_ready.clone());
        r.register(
            "pod_cidrs_applied",
            "Cluster-pool IPAM: 1 while svc-ipam serves the RivetNode's spec.podCidrs",
            self.pod_cidrs_applied.clone(),
        );
        r.register(
            "pod_cidrs_not_applied",
            "Cluster-pool IPAM: changes to not applied, per reason (WaitingForPodCIDRs, PoolChangeStrandsAllocations, ...)",
            self.pod_cidrs_not_applied.clone(),
        );
        r.register(
            "invalid_traceparents",
            "Endpoints whose traceparent was not a valid W3C context (their RivetEndpoint write got a trace of its own)",
            self.invalid_traceparents.clone(),
        );
    }

    /// An endpoint's traceparent was not a valid context; its write is traced
    /// without a parent.
    pub fn invalid_traceparent(&self, namespace: &str, pod: &str, traceparent: &str) {
        self.invalid_traceparents.inc();
        tracing::debug!(
            namespace,
            pod,
            traceparent,
            "endpoint traceparent is not a valid W3C context"
        );
    }

    /// svc-ipam serves the RivetNode's pod CIDRs now.
    pub fn pod_cidrs_applied(&self, node: &str, cidrs: &[String]) {
        self.pod_cidrs_applied.set(1);
        tracing::info!(node, cidrs = %cidrs.join(","), "pod CIDRs applied: svc-ipam serves the RivetNode's spec.podCidrs");
    }

    /// The RivetNode's pod CIDRs are not (or no longer) applied, for `reason`.
    pub fn pod_cidrs_not_applied(&self, node: &str, reason: &str, message: &str) {
        self.pod_cidrs_applied.set(0);
        self.pod_cidrs_not_applied
            .get_or_create(&ReasonLabels { reason: reason.into() })
            .inc();
        tracing::warn!(node, reason, "pod CIDRs not applied: {message}");
    }

    /// A kind completed a list with `objects` objects.
    pub fn listed(&self, kind: &'static str, objects: u64, first: bool) {
        self.objects.get_or_create(&KindLabels { kind }).set(objects as i64);
        if first {
            tracing::info!(kind, objects, "watch cache synced");
        } else {
            tracing::info!(kind, objects, "watch cache re-listed");
        }
    }

    /// A kind's watch started over with a fresh list.
    pub fn relisted(&self, kind: &'static str) {
        self.relists.get_or_create(&KindLabels { kind }).inc();
        tracing::info!(kind, "watch restarted with a new list");
    }

    /// A kind's list or watch failed (the watcher retries with backoff).
    pub fn watch_failed(&self, kind: &'static str, error: &'static str, text: &str) {
        self.watch_errors.get_or_create(&ErrorLabels { kind, error }).inc();
        tracing::warn!(kind, error, "watch failed (retrying with backoff): {text}");
    }

    /// Every kind completed its initial list.
    pub fn caches_synced(&self, after: Duration) {
        self.cache_sync_seconds.set(after.as_secs_f64());
        tracing::info!(after_ms = after.as_millis() as u64, "every watch cache synced");
    }

    /// The cache sync took longer than allowed (reported, not fatal).
    pub fn cache_sync_timed_out(&self, after: Duration, pending: &[&'static str]) {
        self.cache_sync_timeouts.inc();
        tracing::error!(
            after_s = after.as_secs_f64(),
            pending = ?pending,
            "watch caches not synced in time; nothing is fed, deleted or marked ready until they are (watches go on)"
        );
    }

    /// A call (feed or API write) succeeded.
    pub fn call_ok(&self, call: &'static str) {
        self.calls.get_or_create(&CallLabels { call }).inc();
    }

    /// A call failed; `error` is its kind.
    pub fn call_failed(&self, call: &'static str, error: &'static str, text: &str) {
        self.calls.get_or_create(&CallLabels { call }).inc();
        self.call_errors.get_or_create(&CallErrorLabels { call, error }).inc();
        tracing::warn!(call, error, "{text}");
    }

    /// A full replay reached svc-endpoint.
    pub fn replayed(&self, boot_id: &str, why: &str, response: &rivet_proto::endpoint::v1::ReplayKubernetesResponse) {
        self.replays.inc();
        tracing::info!(
            svc_endpoint_boot_id = boot_id,
            why,
            pods = response.pods,
            namespaces = response.namespaces,
            policies = response.policies,
            pods_forgotten = response.pods_forgotten,
            namespaces_forgotten = response.namespaces_forgotten,
            policies_removed = response.policies_removed,
            service_objects = response.service_objects,
            service_objects_removed = response.service_objects_removed,
            affected_endpoints = response.affected_endpoints,
            rejected = response.rejected.len(),
            "replayed the Kubernetes state to svc-endpoint"
        );
        for item in &response.rejected {
            tracing::warn!(
                item = item.item,
                "svc-endpoint rejected a replayed item: {}",
                item.error
            );
        }
    }

    /// A daemon of the node is not ready: the RivetNode says so (logged when
    /// the node was ready, at debug level while it stays not ready).
    pub fn node_not_ready(&self, node: &str, was_ready: bool, why: &str) {
        self.node_ready.set(0);
        if was_ready {
            tracing::warn!(node, "node no longer ready: {why}");
        } else {
            tracing::debug!(node, "node not ready yet: {why}");
        }
    }

    /// The node was marked ready.
    pub fn node_marked_ready(&self, node: &str, taint_removed: bool) {
        self.node_ready.set(1);
        tracing::info!(
            node,
            taint_removed,
            "node marked ready (RivetNode status, Node annotations)"
        );
    }
}
