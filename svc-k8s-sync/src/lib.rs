//! svc-k8s-sync: Rivet's view of the Kubernetes API server on one node
//! (DESIGN.md §9). Unprivileged; it talks to the API server with its own
//! ServiceAccount (deploy/rbac/) and to the node's daemons over their
//! sockets.
//!
//! - [`caches`] and [`watch`]: kube-runtime watchers with reflector stores
//!   and backoff, one supervised controller per kind (this node's Pods,
//!   Namespaces, NetworkPolicies, RivetNetworkPolicies, Nodes, Services,
//!   EndpointSlices);
//! - [`desired`]: what svc-endpoint should know, computed from the caches
//!   with no I/O, and the difference from what it was told;
//! - [`feed`]: the level-triggered feed of svc-endpoint (single calls for
//!   changes, a full ReplayKubernetes after start, a re-list or a new
//!   svc-endpoint `boot_id`);
//! - [`endpoint_objects`]: a `RivetEndpoint` per pod from svc-endpoint's
//!   WatchEndpoints (server-side apply of the status; deleted with the
//!   endpoint);
//! - [`node`]: marking the node ready (RivetNode, Node annotations, the
//!   not-ready taint);
//! - [`pod_cidrs`]: cluster-pool IPAM, the node's pod CIDRs from its
//!   RivetNode to svc-ipam (`--ipam-mode cluster-pool`);
//! - [`service`]: `PodDirectory.LookupPod` (restore asks whether a pod
//!   still exists) and `KubernetesSyncService.GetStatus`;
//! - [`error`]: API failures typed, a 403 naming the verb and resource;
//! - [`events`]: logs and metrics.
//!
//! Start-up: nothing is fed, deleted or marked ready until every watched
//! kind completed its initial list; a sync that takes longer than the
//! timeout is reported (status, log, metric), not fatal.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rivet_common::controller::{Action, Controller, Controllers, Trigger};

pub mod caches;
pub mod desired;
pub mod endpoint_objects;
pub mod error;
pub mod events;
pub mod feed;
pub mod node;
pub mod pod_cidrs;
pub mod service;
pub mod watch;

use crate::events::SyncMetrics;
use crate::watch::WatchStatus;

/// The daemon's name: its socket is `<socket-dir>/svc-k8s-sync.sock`.
pub const DAEMON_NAME: &str = "svc-k8s-sync";

/// Capabilities svc-k8s-sync keeps: none. It only makes network calls to
/// the API server and connects to the other daemons' sockets.
pub const CAPABILITIES: &[rivet_common::privileges::Capability] = &[];

/// The API group of Rivet's custom resources.
pub const RIVET_API_GROUP: &str = "rivet.io";
/// Their apiVersion.
pub const RIVET_API_VERSION: &str = "rivet.io/v1";

/// The field manager of svc-k8s-sync's server-side applies.
pub const FIELD_MANAGER: &str = "svc-k8s-sync";

/// Methods that only read: members of the reader group may call them.
pub const READ_ONLY_METHODS: rivet_common::access::ReadOnlyMethods = &[
    (rivet_proto::k8s::v1::pod_directory_server::SERVICE_NAME, &["LookupPod"]),
    (
        rivet_proto::k8s::v1::kubernetes_sync_service_server::SERVICE_NAME,
        &["GetStatus"],
    ),
];

/// What the daemon did that GetStatus reports beside the caches and the
/// feed.
#[derive(Debug, Default)]
pub struct SyncState {
    cache_sync_timed_out: AtomicBool,
    node_ready: AtomicBool,
    endpoint_objects_applied: AtomicU64,
    endpoint_objects_deleted: AtomicU64,
    /// Cluster-pool IPAM: why svc-ipam does not serve the RivetNode's pod
    /// CIDRs yet; `None` once it does, and always in node-pool mode.
    pod_cidrs_pending: Mutex<Option<String>>,
}

impl SyncState {
    /// The initial cache sync took longer than allowed.
    pub fn cache_sync_timed_out(&self) -> bool {
        self.cache_sync_timed_out.load(Ordering::Relaxed)
    }

    /// The node is marked ready.
    pub fn node_ready(&self) -> bool {
        self.node_ready.load(Ordering::Relaxed)
    }

    /// Records whether the node is marked ready.
    pub fn set_node_ready(&self, ready: bool) {
        self.node_ready.store(ready, Ordering::Relaxed);
    }

    /// RivetEndpoint objects applied since start.
    pub fn endpoint_objects_applied(&self) -> u64 {
        self.endpoint_objects_applied.load(Ordering::Relaxed)
    }

    /// RivetEndpoint objects deleted since start.
    pub fn endpoint_objects_deleted(&self) -> u64 {
        self.endpoint_objects_deleted.load(Ordering::Relaxed)
    }

    /// Counts one RivetEndpoint applied.
    pub fn endpoint_object_applied(&self) {
        self.endpoint_objects_applied.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one RivetEndpoint deleted.
    pub fn endpoint_object_deleted(&self) {
        self.endpoint_objects_deleted.fetch_add(1, Ordering::Relaxed);
    }

    /// Why the pod CIDRs are not applied yet (readiness waits while this
    /// is `Some`).
    pub fn pod_cidrs_pending(&self) -> Option<String> {
        self.pod_cidrs_pending.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records whether (and why not) the pod CIDRs are applied; `true`
    /// when that changed.
    pub fn set_pod_cidrs_pending(&self, pending: Option<String>) -> bool {
        let mut current = self.pod_cidrs_pending.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *current, pending.clone()) != pending
    }
}

/// Watches the initial cache sync as controller `cache-sync`: reports when
/// every kind completed its list, or, once, that `timeout` passed first
/// (status, log, metric; the watches go on and the sync is still reported
/// when it completes). `trigger` must fire on cache events.
pub fn watch_cache_sync(
    controllers: &Controllers,
    trigger: &Trigger,
    status: Arc<WatchStatus>,
    state: Arc<SyncState>,
    metrics: SyncMetrics,
    timeout: Duration,
) {
    let started = Instant::now();
    controllers.reconcile(Controller::new("cache-sync").trigger(trigger), move || {
        let (status, state, metrics) = (status.clone(), state.clone(), metrics.clone());
        async move {
            let elapsed = started.elapsed();
            if status.all_synced() {
                metrics.caches_synced(elapsed);
                return Ok::<_, std::convert::Infallible>(Action::done());
            }
            if elapsed >= timeout {
                if !state.cache_sync_timed_out.swap(true, Ordering::Relaxed) {
                    metrics.cache_sync_timed_out(elapsed, &status.unsynced());
                }
                return Ok(Action::await_change());
            }
            Ok(Action::requeue(timeout - elapsed))
        }
    });
}

#[cfg(test)]
mod read_only_methods_tests {
    #[test]
    fn read_only_methods_are_rpcs_of_their_services() {
        assert_eq!(
            rivet_common::access::unknown_methods(super::DAEMON_NAME, super::READ_ONLY_METHODS),
            Vec::<String>::new()
        );
    }
}
