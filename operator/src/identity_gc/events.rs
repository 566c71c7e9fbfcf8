//! The identity GC's telemetry: each named event writes its log line and
//! updates its metric in one place.
//!
//! Metrics (under the operator's `rivet_operator` prefix):
//!
//! - `rivet_operator_identity_gc_runs_total{store, outcome}`: rounds by
//!   outcome (`succeeded`, `failed`, `not_leading`);
//! - `rivet_operator_identity_gc_identities_deleted_total{store}`;
//! - `rivet_operator_identity_gc_candidates{store}`: identities unused in
//!   the last round, to be deleted in the next if still unused and unchanged;
//! - `rivet_operator_identity_gc_pass_duration_seconds{store}`: one round;
//! - `rivet_operator_identity_gc_skipped_total{store, reason}`: candidates
//!   of the last round not deleted (`reused`, `in_use`, `gone`, `changed`).

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family as MetricFamily;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::rounds::SkipReason;
use super::{GcError, RoundReport};

/// The identity store a GC works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Store {
    /// svc-identity's `etcd` store (master and value keys).
    Etcd,
    /// svc-identity's `kubernetes` store (RivetIdentity objects).
    Kubernetes,
}

impl Store {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Etcd => "etcd",
            Self::Kubernetes => "kubernetes",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreLabels {
    store: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabels {
    store: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SkipLabels {
    store: &'static str,
    reason: &'static str,
}

fn pass_duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 18))
}

/// The identity GC's metrics; cheap to clone (clones update the same ones).
#[derive(Clone, Debug)]
pub struct IdentityGcMetrics {
    runs: MetricFamily<RunLabels, Counter>,
    deleted: MetricFamily<StoreLabels, Counter>,
    candidates: MetricFamily<StoreLabels, Gauge>,
    pass_duration: MetricFamily<StoreLabels, Histogram, fn() -> Histogram>,
    skipped: MetricFamily<SkipLabels, Counter>,
}

impl Default for IdentityGcMetrics {
    fn default() -> Self {
        Self {
            runs: MetricFamily::default(),
            deleted: MetricFamily::default(),
            candidates: MetricFamily::default(),
            pass_duration: MetricFamily::new_with_constructor(pass_duration_histogram),
            skipped: MetricFamily::default(),
        }
    }
}

impl IdentityGcMetrics {
    /// Registers the metrics under `registry` (the daemon's, prefixed
    /// `rivet`): `rivet_operator_identity_gc_*`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry
            .sub_registry_with_prefix("operator")
            .sub_registry_with_prefix("identity_gc");
        r.register("runs", "Identity GC rounds by store and outcome", self.runs.clone());
        r.register(
            "identities_deleted",
            "Identities deleted after two rounds unused",
            self.deleted.clone(),
        );
        r.register(
            "candidates",
            "Identities unused in the last round (deleted in the next if still unused and unchanged)",
            self.candidates.clone(),
        );
        r.register_with_unit(
            "pass_duration",
            "Duration of one identity GC round",
            prometheus_client::registry::Unit::Seconds,
            self.pass_duration.clone(),
        );
        r.register(
            "skipped",
            "Candidates of the last round not deleted, by reason",
            self.skipped.clone(),
        );
    }

    /// Deletions so far (tests).
    pub fn deleted(&self, store: Store) -> u64 {
        self.deleted.get_or_create(&StoreLabels { store: store.as_str() }).get()
    }

    /// Skips so far for `reason` (tests).
    pub fn skipped(&self, store: Store, reason: SkipReason) -> u64 {
        self.skipped
            .get_or_create(&SkipLabels {
                store: store.as_str(),
                reason: reason.as_str(),
            })
            .get()
    }

    /// Rounds so far with `outcome` (tests).
    pub fn runs(&self, store: Store, outcome: &'static str) -> u64 {
        self.runs
            .get_or_create(&RunLabels {
                store: store.as_str(),
                outcome,
            })
            .get()
    }
}

/// An identity unused for two rounds was deleted.
pub(crate) fn identity_deleted(metrics: &IdentityGcMetrics, store: Store, id: u32, labels: &str) {
    tracing::info!(
        store = store.as_str(),
        id,
        labels,
        "deleted an identity unused for two GC rounds"
    );
    metrics
        .deleted
        .get_or_create(&StoreLabels { store: store.as_str() })
        .inc();
}

/// A candidate of the last round was not deleted.
pub(crate) fn candidate_skipped(metrics: &IdentityGcMetrics, store: Store, id: u32, reason: SkipReason) {
    tracing::debug!(
        store = store.as_str(),
        id,
        reason = reason.as_str(),
        "identity GC candidate kept"
    );
    metrics
        .skipped
        .get_or_create(&SkipLabels {
            store: store.as_str(),
            reason: reason.as_str(),
        })
        .inc();
}

/// A round ended.
pub(crate) fn round_finished(
    metrics: &IdentityGcMetrics,
    store: Store,
    took: Duration,
    result: &Result<RoundReport, GcError>,
) {
    let outcome = match result {
        Ok(report) => {
            tracing::info!(
                store = store.as_str(),
                scanned = report.scanned,
                in_use = report.in_use,
                deleted = report.deleted,
                skipped = report.skipped,
                candidates = report.candidates,
                took_ms = took.as_millis(),
                "identity GC round done"
            );
            metrics
                .candidates
                .get_or_create(&StoreLabels { store: store.as_str() })
                .set(i64::try_from(report.candidates).unwrap_or(i64::MAX));
            "succeeded"
        }
        Err(GcError::NotLeading(e)) => {
            tracing::info!(store = store.as_str(), error = %e, "identity GC round stopped: not the leader");
            "not_leading"
        }
        Err(e) => {
            tracing::warn!(store = store.as_str(), error = %e, "identity GC round failed");
            "failed"
        }
    };
    metrics
        .runs
        .get_or_create(&RunLabels {
            store: store.as_str(),
            outcome,
        })
        .inc();
    metrics
        .pass_duration
        .get_or_create(&StoreLabels { store: store.as_str() })
        .observe(took.as_secs_f64());
}
