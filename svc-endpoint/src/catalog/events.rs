//! The service catalog's telemetry: each named event writes its log line
//! and updates its metric together (`rivet_endpoint_service_*`).

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family as MetricFamily;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::Origin;
use super::document::ObjectKey;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChangeLabels {
    /// "Service" or "EndpointSlice".
    kind: &'static str,
    /// "api" or "kubernetes".
    origin: &'static str,
    /// "applied" or "deleted".
    change: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    /// "replace", "upsert" or "delete".
    call: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    /// "loader_unreachable", "refused", "storage".
    kind: &'static str,
}

/// The catalog's metrics.
#[derive(Clone, Debug)]
pub struct CatalogMetrics {
    services: Gauge,
    loader_services: Gauge,
    object_changes: MetricFamily<ChangeLabels, Counter>,
    loader_calls: MetricFamily<CallLabels, Counter>,
    errors: MetricFamily<ErrorLabels, Counter>,
    loader_polls: Counter,
    push_seconds: Histogram,
}

impl Default for CatalogMetrics {
    fn default() -> Self {
        Self {
            services: Gauge::default(),
            loader_services: Gauge::default(),
            object_changes: MetricFamily::default(),
            loader_calls: MetricFamily::default(),
            errors: MetricFamily::default(),
            loader_polls: Counter::default(),
            push_seconds: Histogram::new(exponential_buckets(0.0001, 4.0, 10)),
        }
    }
}

impl CatalogMetrics {
    /// Registers every metric under `registry` (prefix it with `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("endpoint_service");
        r.register("services", "Services stored", self.services.clone());
        r.register(
            "loader_services",
            "Loader services (one per Service port and family) svc-loader holds as last pushed",
            self.loader_services.clone(),
        );
        r.register(
            "object_changes",
            "Service and EndpointSlice objects applied or deleted, by kind, origin and change",
            self.object_changes.clone(),
        );
        r.register(
            "loader_calls",
            "Calls to svc-loader's LoadBalancerService that changed something, by call",
            self.loader_calls.clone(),
        );
        r.register("errors", "Service catalog errors by kind", self.errors.clone());
        r.register(
            "loader_polls",
            "GetInfo calls to svc-loader for its boot id (made only when no push answered for --dependency-poll-ms)",
            self.loader_polls.clone(),
        );
        r.register(
            "push_duration_seconds",
            "Time of one push pass that changed svc-loader's services",
            self.push_seconds.clone(),
        );
    }

    /// Calls of one kind so far (tests).
    pub fn loader_calls(&self, call: &'static str) -> u64 {
        self.loader_calls.get_or_create(&CallLabels { call }).get()
    }

    /// GetInfo polls of svc-loader's boot id so far.
    pub fn loader_polls(&self) -> u64 {
        self.loader_polls.get()
    }

    pub(super) fn set_services(&self, services: usize) {
        self.services.set(i64::try_from(services).unwrap_or(i64::MAX));
    }
}

/// An object was stored (`changed` false: identical to what was held).
pub(super) fn object_applied(
    m: &CatalogMetrics,
    key: &ObjectKey,
    origin: Origin,
    changed: bool,
    cluster_ips: &[String],
) {
    if !changed {
        tracing::debug!(object = %key, origin = origin.as_str(), "service object unchanged");
        return;
    }
    tracing::info!(object = %key, origin = origin.as_str(), cluster_ips = ?cluster_ips, "service object applied");
    m.object_changes
        .get_or_create(&ChangeLabels {
            kind: key.kind.as_str(),
            origin: origin.as_str(),
            change: "applied",
        })
        .inc();
}

/// An object was deleted.
pub(super) fn object_deleted(m: &CatalogMetrics, key: &ObjectKey, origin: Origin, reason: &str) {
    tracing::info!(object = %key, origin = origin.as_str(), reason, "service object deleted");
    m.object_changes
        .get_or_create(&ChangeLabels {
            kind: key.kind.as_str(),
            origin: origin.as_str(),
            change: "deleted",
        })
        .inc();
}

/// A stored object no longer reads at start; it is left out (the file stays).
pub(super) fn object_unreadable(m: &CatalogMetrics, file: &std::path::Path, error: &str) {
    tracing::error!(file = %file.display(), error, "a stored service object does not read; left out (the file is kept)");
    m.errors.get_or_create(&ErrorLabels { kind: "storage" }).inc();
}

/// A push pass changed svc-loader's services.
pub(super) fn loader_pushed(
    m: &CatalogMetrics,
    replaced: bool,
    upserted: usize,
    deleted: usize,
    held: usize,
    boot_id: &str,
    took: Duration,
) {
    m.loader_services.set(i64::try_from(held).unwrap_or(i64::MAX));
    if !replaced && upserted == 0 && deleted == 0 {
        return;
    }
    if replaced {
        tracing::info!(
            services = held,
            boot_id,
            took_us = took.as_micros() as u64,
            "services replayed into svc-loader"
        );
        m.loader_calls.get_or_create(&CallLabels { call: "replace" }).inc();
    } else {
        tracing::debug!(
            upserted,
            deleted,
            took_us = took.as_micros() as u64,
            "services pushed to svc-loader"
        );
    }
    m.loader_calls
        .get_or_create(&CallLabels { call: "upsert" })
        .inc_by(upserted as u64);
    m.loader_calls
        .get_or_create(&CallLabels { call: "delete" })
        .inc_by(deleted as u64);
    m.push_seconds.observe(took.as_secs_f64());
}

/// The catalog was idle for `loader_poll`: svc-loader's boot id is asked
/// for (GetInfo).
pub(super) fn loader_polled(m: &CatalogMetrics) {
    tracing::trace!("no svc-loader answer for a poll interval; asking its boot id");
    m.loader_polls.inc();
}

/// svc-loader refused one service (logged when the reason changes).
pub(super) fn loader_refused(m: &CatalogMetrics, service_id: u32, message: &str) {
    tracing::warn!(
        service_id,
        "svc-loader refused a service; retrying on every pass: {message}"
    );
    m.errors.get_or_create(&ErrorLabels { kind: "refused" }).inc();
}

/// A push pass failed as a whole (svc-loader unreachable or restarted under it).
pub(super) fn push_failed(m: &CatalogMetrics, message: &str) {
    tracing::debug!("pushing services to svc-loader failed: {message}");
    m.errors
        .get_or_create(&ErrorLabels {
            kind: "loader_unreachable",
        })
        .inc();
}
