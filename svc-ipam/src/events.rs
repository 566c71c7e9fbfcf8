//! svc-ipam's telemetry: each named event writes its log line and updates its
//! metric in one place, so logs and metrics never disagree.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family as MetricFamily;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use ipnet::IpNet;

use crate::allocator::{AllocError, Allocation, Inconsistency, RangeUsage};
use crate::pool::PoolSet;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
    family: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolChangeLabels {
    pool: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    method: &'static str,
    kind: &'static str,
}

/// The metrics of svc-ipam.
#[derive(Clone, Debug)]
pub struct IpamMetrics {
    allocated: MetricFamily<PoolLabels, Gauge>,
    available: MetricFamily<PoolLabels, Gauge>,
    allocations: MetricFamily<PoolLabels, Counter>,
    releases: MetricFamily<PoolLabels, Counter>,
    inconsistencies: MetricFamily<KindLabels, Counter>,
    request_errors: MetricFamily<ErrorLabels, Counter>,
    pool_changes: MetricFamily<PoolChangeLabels, Counter>,
    state_write: Histogram,
}

impl Default for IpamMetrics {
    fn default() -> Self {
        Self {
            allocated: Default::default(),
            available: Default::default(),
            allocations: Default::default(),
            releases: Default::default(),
            inconsistencies: Default::default(),
            request_errors: Default::default(),
            pool_changes: Default::default(),
            state_write: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
        }
    }
}

impl IpamMetrics {
    /// Registers every metric under `registry` (prefix it with `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("ipam");
        r.register(
            "addresses_allocated",
            "Allocated addresses per pool and family",
            self.allocated.clone(),
        );
        r.register(
            "addresses_available",
            "Addresses that can still be handed out per pool and family",
            self.available.clone(),
        );
        r.register("allocations", "Addresses newly allocated", self.allocations.clone());
        r.register("releases", "Addresses released", self.releases.clone());
        r.register(
            "state_inconsistencies",
            "Problems found in the state file at start, by kind",
            self.inconsistencies.clone(),
        );
        r.register(
            "request_errors",
            "Failed requests by method and kind",
            self.request_errors.clone(),
        );
        r.register(
            "pool_changes",
            "SetPool calls that changed a pool (result applied) or were refused (result: strands_allocations, fixed_by_flag, invalid)",
            self.pool_changes.clone(),
        );
        r.register(
            "state_write_duration_seconds",
            "Time to write and fsync the state file",
            self.state_write.clone(),
        );
    }

    /// Refreshes the usage gauges of every pool.
    pub fn set_usage(&self, pools: &PoolSet, usage: &[RangeUsage]) {
        let mut totals: std::collections::BTreeMap<(String, &'static str), (u128, u128)> = Default::default();
        for u in usage {
            let r = &pools.ranges()[u.range];
            let t = totals.entry((r.pool.clone(), r.family().as_str())).or_default();
            t.0 += u.allocated;
            t.1 += u.size - u.allocated;
        }
        for ((pool, family), (allocated, available)) in totals {
            let labels = PoolLabels { pool, family };
            self.allocated.get_or_create(&labels).set(clamp(allocated));
            self.available.get_or_create(&labels).set(clamp(available));
        }
    }
}

fn clamp(n: u128) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn labels(a: &Allocation) -> PoolLabels {
    PoolLabels {
        pool: a.pool.clone(),
        family: a.family().as_str(),
    }
}

/// An address was handed to an owner.
pub fn address_allocated(m: &IpamMetrics, a: &Allocation) {
    tracing::info!(pool = %a.pool, family = %a.family(), address = %a.address, owner = %a.owner, "address allocated");
    m.allocations.get_or_create(&labels(a)).inc();
}

/// An address was released.
pub fn address_released(m: &IpamMetrics, a: &Allocation) {
    tracing::info!(pool = %a.pool, family = %a.family(), address = %a.address, owner = %a.owner, "address released");
    m.releases.get_or_create(&labels(a)).inc();
}

/// Loaded state had a problem; it was resolved as described.
pub fn state_inconsistency(m: &IpamMetrics, i: &Inconsistency) {
    tracing::warn!(kind = i.kind(), "state inconsistency: {i}");
    m.inconsistencies.get_or_create(&KindLabels { kind: i.kind() }).inc();
}

/// A request failed.
pub fn request_failed(m: &IpamMetrics, method: &'static str, kind: &'static str, message: &str) {
    tracing::warn!(method, kind, "request failed: {message}");
    m.request_errors.get_or_create(&ErrorLabels { method, kind }).inc();
}

/// SetPool replaced the ranges of `pool` (durable); the usage gauges
/// start over from `pools` (a family the pool lost has none left).
pub fn pool_changed(
    m: &IpamMetrics,
    pool: &str,
    before: &[IpNet],
    after: &[IpNet],
    (pools, usage): (&PoolSet, &[RangeUsage]),
) {
    tracing::info!(pool, before = ?before, after = ?after, "pool set");
    m.allocated.clear();
    m.available.clear();
    m.set_usage(pools, usage);
    m.pool_changes
        .get_or_create(&PoolChangeLabels {
            pool: pool.into(),
            result: "applied",
        })
        .inc();
}

/// SetPool was refused; the pool is unchanged.
pub fn pool_change_refused(m: &IpamMetrics, pool: &str, why: &AllocError) {
    let result = match why {
        AllocError::PoolChangeStrandsAllocations { .. } => "strands_allocations",
        AllocError::PoolFixedByFlag { .. } => "fixed_by_flag",
        _ => "invalid",
    };
    tracing::warn!(pool, result, "pool change refused: {why}");
    m.pool_changes
        .get_or_create(&PoolChangeLabels {
            pool: pool.into(),
            result,
        })
        .inc();
}

/// The state file was written.
pub fn state_written(m: &IpamMetrics, allocations: usize, took: Duration) {
    tracing::debug!(allocations, took_us = took.as_micros() as u64, "state written");
    m.state_write.observe(took.as_secs_f64());
}
