//! svc-loader's telemetry: each named event writes its log line and updates
//! its metric together.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabels {
    map: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteChangeLabels {
    change: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    method: &'static str,
    kind: &'static str,
}

/// The metrics of svc-loader.
#[derive(Clone, Debug)]
pub struct LoaderMetrics {
    applies: Family<ResultLabels, Counter>,
    apply_duration: Histogram,
    removals: Counter,
    request_errors: Family<ErrorLabels, Counter>,
    ct_migrated_entries: Family<MapLabels, Counter>,
    peer_route_changes: Family<RouteChangeLabels, Counter>,
    peer_nodes: Gauge,
    peer_routes_restored: Counter,
    peer_route_resync_errors: Family<KindLabels, Counter>,
    lb_service_changes: Family<ChangeLabels, Counter>,
    lb_change_duration: Histogram,
    lb_restored_services: Counter,
    lb_restore_orphans: Counter,
    socket_lb_links: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChangeLabels {
    change: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

impl Default for LoaderMetrics {
    fn default() -> Self {
        Self {
            applies: Family::default(),
            apply_duration: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            removals: Counter::default(),
            request_errors: Family::default(),
            ct_migrated_entries: Family::default(),
            peer_route_changes: Family::default(),
            peer_nodes: Gauge::default(),
            peer_routes_restored: Counter::default(),
            peer_route_resync_errors: Family::default(),
            lb_service_changes: Family::default(),
            lb_change_duration: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            lb_restored_services: Counter::default(),
            lb_restore_orphans: Counter::default(),
            socket_lb_links: Gauge::default(),
        }
    }
}

impl LoaderMetrics {
    /// Registers every metric (prefix the registry with `rivet`).
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("loader");
        r.register(
            "endpoint_applies",
            "ApplyEndpoint calls by result (changed, unchanged)",
            self.applies.clone(),
        );
        r.register(
            "endpoint_apply_duration_seconds",
            "Time to realise an endpoint (checks, map writes, attach)",
            self.apply_duration.clone(),
        );
        r.register(
            "endpoint_removals",
            "Endpoints removed from the datapath",
            self.removals.clone(),
        );
        r.register(
            "request_errors",
            "Failed requests by method and gRPC code",
            self.request_errors.clone(),
        );
        r.register(
            "ct_migrated_entries",
            "Conntrack entries copied from a map of the first ct_entry layout into the current one, by map",
            self.ct_migrated_entries.clone(),
        );
        r.register(
            "peer_route_changes",
            "Routes to peer nodes' pod CIDRs by change (added, removed) across ReplaceNodes calls",
            self.peer_route_changes.clone(),
        );
        r.register(
            "peer_nodes",
            "Peer nodes held (the last ReplaceNodes)",
            self.peer_nodes.clone(),
        );
        r.register(
            "peer_routes_restored",
            "Routes to peer nodes' pod CIDRs put back by a resync (removed with a device that went down, or deleted by someone)",
            self.peer_routes_restored.clone(),
        );
        r.register(
            "peer_route_resync_errors",
            "Failed resyncs of the routes to peer nodes by kind (list, add, delete)",
            self.peer_route_resync_errors.clone(),
        );
        r.register(
            "lb_service_changes",
            "Load-balancer services by change (upserted, unchanged, deleted, absent) across UpsertService, DeleteService and ReplaceServices",
            self.lb_service_changes.clone(),
        );
        r.register(
            "lb_change_duration_seconds",
            "Time to realise an UpsertService or a whole ReplaceServices in the service maps",
            self.lb_change_duration.clone(),
        );
        r.register(
            "lb_restored_services",
            "Services whose index the loader rebuilt from the pinned maps at start",
            self.lb_restored_services.clone(),
        );
        r.register(
            "lb_restore_orphan_entries",
            "Service map entries no service referenced at start (left by a crash between two writes), removed",
            self.lb_restore_orphans.clone(),
        );
        r.register(
            "socket_lb_links",
            "Cgroup programs of socket-level load balancing attached (0: off)",
            self.socket_lb_links.clone(),
        );
    }
}

/// An endpoint was applied.
pub fn endpoint_applied(
    m: &LoaderMetrics,
    endpoint_id: u32,
    identity: u32,
    revision: u64,
    changed: bool,
    took: Duration,
) {
    if changed {
        tracing::info!(
            endpoint_id,
            identity,
            revision,
            took_ms = took.as_secs_f64() * 1e3,
            "endpoint applied"
        );
    } else {
        tracing::debug!(endpoint_id, revision, "endpoint already as requested");
    }
    let result = if changed { "changed" } else { "unchanged" };
    m.applies.get_or_create(&ResultLabels { result }).inc();
    m.apply_duration.observe(took.as_secs_f64());
}

/// An endpoint was removed.
pub fn endpoint_removed(m: &LoaderMetrics, endpoint_id: Option<u32>, ifindex: Option<u32>) {
    tracing::info!(endpoint_id = ?endpoint_id, ifindex = ?ifindex, "endpoint removed");
    m.removals.inc();
}

/// A request failed.
pub fn request_failed(m: &LoaderMetrics, method: &'static str, status: &tonic::Status) {
    let kind = rivet_common::grpc::code_label(status.code());
    tracing::warn!(method, kind, "request failed: {}", status.message());
    m.request_errors.get_or_create(&ErrorLabels { method, kind }).inc();
}

/// A conntrack map of the first `ct_entry` layout was migrated at start.
pub fn ct_migrated(m: &LoaderMetrics, migrated: &crate::datapath::CtMigrated) {
    tracing::info!(
        map = migrated.map,
        copied = migrated.copied,
        kept_newer = migrated.kept_newer,
        resumed = migrated.resumed,
        "conntrack map migrated to the current entry layout"
    );
    m.ct_migrated_entries
        .get_or_create(&MapLabels { map: migrated.map })
        .inc_by(migrated.copied);
}

/// Socket-level load balancing is attached to its cgroup (at start).
pub fn socket_lb_enabled(m: &LoaderMetrics, report: &crate::datapath::SocketLbReport) {
    tracing::info!(
        cgroup = %report.cgroup.display(),
        cgroup_id = report.cgroup_id,
        attached = report.attached.len(),
        adopted = report.adopted.len(),
        moved = report.moved.len(),
        "socket load balancing attached"
    );
    let links = report.attached.len() + report.adopted.len() + report.moved.len();
    m.socket_lb_links.set(links as i64);
}

/// Socket-level load balancing is off (no `--socket-lb-cgroup`); `removed`
/// links of an earlier start were detached.
pub fn socket_lb_disabled(m: &LoaderMetrics, removed: usize) {
    if removed > 0 {
        tracing::info!(removed, "socket load balancing detached (no --socket-lb-cgroup)");
    }
    m.socket_lb_links.set(0);
}

/// The set of peer nodes was replaced (`ReplaceNodes`).
pub fn peer_routes_replaced(m: &LoaderMetrics, mode: &str, peers: usize, changes: &crate::routing::RouteChanges) {
    if changes.added + changes.removed > 0 {
        tracing::info!(
            mode,
            peers,
            added = changes.added,
            removed = changes.removed,
            unchanged = changes.unchanged,
            deferred = changes.deferred,
            "peer routes replaced"
        );
    } else {
        tracing::debug!(
            mode,
            peers,
            unchanged = changes.unchanged,
            "peer routes already as requested"
        );
    }
    m.peer_route_changes
        .get_or_create(&RouteChangeLabels { change: "added" })
        .inc_by(u64::from(changes.added));
    m.peer_route_changes
        .get_or_create(&RouteChangeLabels { change: "removed" })
        .inc_by(u64::from(changes.removed));
    m.peer_nodes.set(peers as i64);
}

/// A resync pass realised the held peers' routes again; logs only when it
/// changed something.
pub fn peer_routes_resynced(m: &LoaderMetrics, mode: &str, changes: &crate::routing::RouteChanges) {
    if changes.added + changes.removed > 0 {
        tracing::info!(
            mode,
            restored = changes.added,
            removed = changes.removed,
            unchanged = changes.unchanged,
            deferred = changes.deferred,
            "peer routes restored"
        );
    } else if changes.deferred > 0 {
        tracing::debug!(
            mode,
            deferred = changes.deferred,
            "peer routes wait for their device to come up"
        );
    }
    m.peer_routes_restored.inc_by(u64::from(changes.added));
    m.peer_route_changes
        .get_or_create(&RouteChangeLabels { change: "removed" })
        .inc_by(u64::from(changes.removed));
}

/// A resync pass of the peers' routes failed.
pub fn peer_routes_resync_failed(m: &LoaderMetrics, mode: &str, error: &crate::routing::RoutingError) {
    let kind = error.kind();
    tracing::warn!(mode, kind, "resyncing the routes to peer nodes failed: {error}");
    m.peer_route_resync_errors.get_or_create(&KindLabels { kind }).inc();
}

fn lb_change(m: &LoaderMetrics, change: &'static str, n: u64) {
    m.lb_service_changes.get_or_create(&ChangeLabels { change }).inc_by(n);
}

/// A service was upserted (`UpsertService`).
pub fn service_upserted(m: &LoaderMetrics, service_id: u32, backends: usize, changed: bool, took: Duration) {
    if changed {
        tracing::info!(
            service_id,
            backends,
            took_ms = took.as_secs_f64() * 1e3,
            "service upserted"
        );
    } else {
        tracing::debug!(service_id, "service already as requested");
    }
    lb_change(m, if changed { "upserted" } else { "unchanged" }, 1);
    m.lb_change_duration.observe(took.as_secs_f64());
}

/// A service was deleted (`DeleteService`).
pub fn service_deleted(m: &LoaderMetrics, service_id: u32, existed: bool) {
    if existed {
        tracing::info!(service_id, "service deleted");
    } else {
        tracing::debug!(service_id, "service to delete was not there");
    }
    lb_change(m, if existed { "deleted" } else { "absent" }, 1);
}

/// The whole set of services was replaced (`ReplaceServices`).
pub fn services_replaced(m: &LoaderMetrics, services: usize, report: &crate::lb::ReplaceReport, took: Duration) {
    tracing::info!(
        services,
        upserted = report.upserted,
        deleted = report.deleted,
        unchanged = report.unchanged,
        took_ms = took.as_secs_f64() * 1e3,
        "services replaced"
    );
    lb_change(m, "upserted", u64::from(report.upserted));
    lb_change(m, "deleted", u64::from(report.deleted));
    lb_change(m, "unchanged", u64::from(report.unchanged));
    m.lb_change_duration.observe(took.as_secs_f64());
}

/// The service index was rebuilt from the pinned maps at start.
pub fn services_restored(m: &LoaderMetrics, report: &crate::lb::RestoreReport) {
    tracing::info!(
        services = report.services,
        incomplete = report.incomplete,
        orphans_removed = report.orphans_removed,
        services_converted = report.converted,
        "service index restored from the maps"
    );
    m.lb_restored_services.inc_by(report.services as u64);
    m.lb_restore_orphans.inc_by(report.orphans_removed as u64);
}

/// The loader's last event: what it left on the node as it stopped
/// ([`crate::uninstall`]). Log only: no scrape follows the process's exit.
pub fn shutdown(outcome: &crate::uninstall::Shutdown) {
    match outcome {
        crate::uninstall::Shutdown::Kept { pod_interfaces } => tracing::info!(
            pods = pod_interfaces.len(),
            interfaces = ?pod_interfaces,
            "pods still use the datapath: kept (pins, filters, routes)"
        ),
        crate::uninstall::Shutdown::Removed(removed) => tracing::info!(
            filters = removed.filters.len(),
            routes = removed.routes,
            tunnel_device = removed.tunnel_device,
            socket_lb_links = removed.socket_lb_links,
            pin_dir = ?removed.pin_dir,
            "no pod uses the datapath: removed it from the node"
        ),
    }
}
