//! svc-gc's telemetry: each named event writes its log line and updates its
//! metrics in one place, so logs and metrics never disagree.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family as MetricFamily;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::pass::{PassError, PassReport, Trigger};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TriggerLabels {
    trigger: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabels {
    map: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    map: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OrphanLabels {
    result: &'static str,
}

/// The metrics of svc-gc (`rivet_gc_*`).
#[derive(Clone, Debug)]
pub struct GcMetrics {
    passes: MetricFamily<TriggerLabels, Counter>,
    pass_failures: Counter,
    pass_duration: Histogram,
    scanned: MetricFamily<MapLabels, Counter>,
    deleted: MetricFamily<ReasonLabels, Counter>,
    spared: MetricFamily<MapLabels, Counter>,
    map_errors: MetricFamily<MapLabels, Counter>,
    entries: MetricFamily<MapLabels, Gauge>,
    fill: MetricFamily<MapLabels, Gauge<f64, AtomicU64>>,
    orphan_checks: MetricFamily<OrphanLabels, Counter>,
    interval: Gauge<f64, AtomicU64>,
    delete_ratio: Gauge<f64, AtomicU64>,
}

impl Default for GcMetrics {
    fn default() -> Self {
        Self {
            passes: Default::default(),
            pass_failures: Default::default(),
            pass_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            scanned: Default::default(),
            deleted: Default::default(),
            spared: Default::default(),
            map_errors: Default::default(),
            entries: Default::default(),
            fill: Default::default(),
            orphan_checks: Default::default(),
            interval: Default::default(),
            delete_ratio: Default::default(),
        }
    }
}

impl GcMetrics {
    /// Registers every metric under `registry` (prefix it with `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("gc");
        r.register("passes", "Completed passes by trigger", self.passes.clone());
        r.register(
            "pass_failures",
            "Passes that could not open any map",
            self.pass_failures.clone(),
        );
        r.register(
            "pass_duration_seconds",
            "Duration of a pass over every map",
            self.pass_duration.clone(),
        );
        r.register(
            "entries_scanned",
            "Entries read by passes, per map",
            self.scanned.clone(),
        );
        r.register(
            "entries_deleted",
            "Entries deleted, per map and reason (expired, orphaned_endpoint, nat_without_connection, service_gone)",
            self.deleted.clone(),
        );
        r.register(
            "entries_spared_refreshed",
            "Entries found deletable but refreshed before their delete, so kept",
            self.spared.clone(),
        );
        r.register(
            "map_errors",
            "Passes that could not process a map completely",
            self.map_errors.clone(),
        );
        r.register(
            "entries",
            "Entries left after the last pass, per map",
            self.entries.clone(),
        );
        r.register(
            "map_fill_ratio",
            "Estimated share of max_entries in use, per map (map-pressure check)",
            self.fill.clone(),
        );
        r.register(
            "orphan_checks",
            "Passes by whether they could delete entries of vanished endpoints",
            self.orphan_checks.clone(),
        );
        r.register(
            "interval_seconds",
            "Current adaptive interval between scheduled passes",
            self.interval.clone(),
        );
        r.register(
            "delete_ratio",
            "Share of scanned entries the last pass deleted",
            self.delete_ratio.clone(),
        );
    }
}

/// A pass finished; `interval` is the interval it leads to.
pub fn pass_completed(m: &GcMetrics, pass: &PassReport, interval: Duration) {
    tracing::info!(
        pass = pass.number,
        trigger = pass.trigger.as_str(),
        scanned = pass.scanned,
        expired = pass.deleted.expired,
        orphaned = pass.deleted.orphaned_endpoint,
        spared_refreshed = pass.maps.iter().map(|m| m.spared_refreshed).sum::<u64>(),
        orphan_check = pass.orphan_check.as_str(),
        took_ms = pass.duration.as_millis() as u64,
        next_interval_s = interval.as_secs_f64(),
        "pass completed"
    );
    m.passes
        .get_or_create(&TriggerLabels {
            trigger: pass.trigger.as_str(),
        })
        .inc();
    m.pass_duration.observe(pass.duration.as_secs_f64());
    m.orphan_checks
        .get_or_create(&OrphanLabels {
            result: pass.orphan_check.as_str(),
        })
        .inc();
    m.interval.set(interval.as_secs_f64());
    m.delete_ratio.set(pass.delete_ratio);
    for map in &pass.maps {
        let labels = MapLabels { map: map.map.clone() };
        if let Some(error) = &map.error {
            tracing::warn!(map = %map.map, pass = pass.number, "map not processed completely: {error}");
            m.map_errors.get_or_create(&labels).inc();
        }
        m.scanned.get_or_create(&labels).inc_by(map.scanned);
        m.spared.get_or_create(&labels).inc_by(map.spared_refreshed);
        for (reason, n) in [
            ("expired", map.deleted.expired),
            ("orphaned_endpoint", map.deleted.orphaned_endpoint),
            ("nat_without_connection", map.deleted.nat_without_connection),
            ("service_gone", map.deleted.service_gone),
        ] {
            m.deleted
                .get_or_create(&ReasonLabels {
                    map: map.map.clone(),
                    reason,
                })
                .inc_by(n);
        }
        if map.error.is_none() {
            m.entries
                .get_or_create(&labels)
                .set(i64::try_from(map.remaining).unwrap_or(i64::MAX));
        }
    }
}

/// A pass could not run.
pub fn pass_failed(m: &GcMetrics, number: u64, trigger: Trigger, error: &PassError) {
    // Retried by its controller, which logs when.
    tracing::warn!(pass = number, trigger = trigger.as_str(), "pass failed: {error}");
    m.pass_failures.inc();
}

/// The map-pressure check estimated a map's fill.
pub fn map_fill(m: &GcMetrics, map: &str, estimate: u64, max_entries: u32, threshold: f64) {
    let ratio = if max_entries == 0 {
        0.0
    } else {
        estimate as f64 / f64::from(max_entries)
    };
    m.fill.get_or_create(&MapLabels { map: map.to_owned() }).set(ratio);
    if ratio >= threshold {
        tracing::info!(
            map,
            estimate,
            max_entries,
            ratio,
            threshold,
            "map pressure: starting a pass early"
        );
    } else {
        tracing::debug!(map, estimate, max_entries, ratio, "map fill");
    }
}
