//! `rivet status`: every daemon socket — reachable, boot id, version — what
//! svc-identity reports about its store, identities and IP cache, and what
//! svc-endpoint reports about restore, endpoints, policy and its links to the
//! other daemons, what svc-k8s-sync reports about its watches, the node's
//! readiness and the daemons it feeds, svc-health's one-line summary of the
//! connectivity to the peer nodes; every daemon's controllers (its supervised background
//! loops: state, restarts, last success, last error); and the node's health
//! with every problem in full, which is also the exit status
//! ([`NodeHealth::exit_code`]). A daemon with a controller failing for
//! longer than it may is degraded.

use std::time::Duration;

use rivet_proto::daemon::v1 as daemon_pb;
use rivet_proto::daemon::v1::{GetInfoRequest, daemon_client::DaemonClient};
use rivet_proto::endpoint::v1 as endpoint_pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use rivet_proto::health::v1 as health_pb;
use rivet_proto::health::v1::health_service_client::HealthServiceClient;
use rivet_proto::identity::v1 as identity_pb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;
use rivet_proto::k8s::v1 as k8s_pb;
use rivet_proto::k8s::v1::kubernetes_sync_service_client::KubernetesSyncServiceClient;
use serde::Serialize;

use crate::endpoint::state_name;
use crate::table::Table;
use crate::{Context, DAEMONS, age, connect, duration, now_unix_nanos, truncate};

/// Daemons whose `GetStatus` is shown.
const ENDPOINT_DAEMON: &str = "svc-endpoint";
const IDENTITY_DAEMON: &str = "svc-identity";
const K8S_SYNC_DAEMON: &str = "svc-k8s-sync";
const HEALTH_DAEMON: &str = crate::health::DAEMON;

/// Characters of a boot id shown for a dependency.
const SHORT_BOOT_ID: usize = 8;

/// Widest LAST ERROR cell of a dependency (the full text is under
/// "problems" when it matters for the node's health).
const ERROR_WIDTH: usize = 60;

/// How healthy a daemon, or the node, is. Ordered: the node is as bad as
/// its worst daemon.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum NodeHealth {
    /// Answers, and reports no problem (or has no socket: not running).
    Healthy,
    /// Answers, but reports a problem it serves around: the kvstore is
    /// unreachable or this node's changes are not yet published to it.
    Degraded,
    /// Its socket exists but it does not answer, or its status cannot be read.
    Unhealthy,
}

impl NodeHealth {
    /// `healthy`, `degraded`, `unhealthy`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Healthy => "healthy",
            Self::Degraded => "degraded",
            Self::Unhealthy => "unhealthy",
        }
    }

    /// The exit status of `rivet status`: 0 healthy, 1 unhealthy (also any
    /// error of the command itself), 3 degraded (2 is a usage error).
    pub fn exit_code(self) -> u8 {
        match self {
            Self::Healthy => 0,
            Self::Unhealthy => 1,
            Self::Degraded => 3,
        }
    }
}

/// One daemon's status.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DaemonStatus {
    /// Daemon name.
    pub daemon: String,
    /// Socket path.
    pub socket: String,
    /// `running`, `not running` (no socket) or `unreachable` (socket does not answer).
    pub state: String,
    /// Boot id of the answering process.
    pub boot_id: Option<String>,
    /// Its version.
    pub version: Option<String>,
    /// Node it serves.
    pub node_name: Option<String>,
    /// Its pid.
    pub pid: Option<u32>,
    /// Why it is unreachable, or why its detailed status could not be read.
    pub error: Option<String>,
    /// `healthy` (also when not running), `degraded` or `unhealthy`.
    pub health: NodeHealth,
    /// Why it is not healthy, each in full.
    pub problems: Vec<String>,
    /// Its controllers (supervised background loops), when it answered.
    pub controllers: Vec<ControllerView>,
    /// svc-endpoint's detailed status, when it answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint_status: Option<EndpointStatus>,
    /// svc-identity's detailed status, when it answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity_status: Option<IdentityStatus>,
    /// svc-k8s-sync's detailed status, when it answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub k8s_sync_status: Option<K8sSyncStatus>,
    /// svc-health's connectivity matrix, when it answered. Unreachable peers
    /// do not change this node's health: they are the peers' problem or the
    /// network's, and `rivet health` says which.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_status: Option<crate::health::HealthView>,
}

/// One supervised background loop of a daemon (`rivet_common::controller`).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ControllerView {
    /// Its name.
    pub name: String,
    /// `running`, `failing`, `done`, `stopped` (or `unknown`).
    pub state: String,
    /// Times its loop was started again after a panic or an end.
    pub restarts: u64,
    /// Failures since its last success.
    pub consecutive_failures: u64,
    /// Its last failure (kept after a recovery).
    pub last_error: String,
    /// Milliseconds since its last success; `None` before the first.
    pub last_success_age_ms: Option<u64>,
    /// Milliseconds since it started failing; `None` unless failing.
    pub failing_for_ms: Option<u64>,
    /// Failing for longer than it may: its daemon is degraded.
    pub degraded: bool,
}

impl From<&daemon_pb::ControllerStatus> for ControllerView {
    fn from(c: &daemon_pb::ControllerStatus) -> Self {
        Self {
            name: c.name.clone(),
            state: match daemon_pb::ControllerState::try_from(c.state) {
                Ok(daemon_pb::ControllerState::Running) => "running",
                Ok(daemon_pb::ControllerState::Failing) => "failing",
                Ok(daemon_pb::ControllerState::Done) => "done",
                Ok(daemon_pb::ControllerState::Stopped) => "stopped",
                _ => "unknown",
            }
            .into(),
            restarts: c.restarts,
            consecutive_failures: c.consecutive_failures,
            last_error: c.last_error.clone(),
            last_success_age_ms: c.last_success_age_ms,
            failing_for_ms: c.failing_for_ms,
            degraded: c.degraded,
        }
    }
}

/// The controllers of every daemon that answered, one row each.
fn controllers_section(all: &[DaemonStatus]) -> String {
    let millis = |ms: u64| duration(ms.saturating_mul(1_000_000));
    let mut t = Table::new([
        "DAEMON",
        "CONTROLLER",
        "STATE",
        "RESTARTS",
        "LAST SUCCESS",
        "LAST ERROR",
    ]);
    let mut rows = 0;
    for s in all {
        for c in &s.controllers {
            rows += 1;
            let mut state = c.state.clone();
            if let Some(failing) = c.failing_for_ms {
                state.push_str(&format!(" {}", millis(failing)));
            }
            t.row([
                s.daemon.clone(),
                c.name.clone(),
                state,
                c.restarts.to_string(),
                c.last_success_age_ms
                    .map_or_else(|| "never".into(), |ms| format!("{} ago", millis(ms))),
                if c.last_error.is_empty() {
                    "-".into()
                } else {
                    truncate(&one_line(&c.last_error), ERROR_WIDTH)
                },
            ]);
        }
    }
    if rows == 0 {
        return String::new();
    }
    section("controllers", &t.render())
}

/// What svc-identity reports in `GetStatus`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct IdentityStatus {
    /// `etcd` or `embedded`.
    pub store: String,
    /// The store is listed and watched without error.
    pub store_connected: bool,
    /// The etcd lease of this node's keys (0 when embedded).
    pub lease_id: i64,
    /// The store's last error.
    pub store_error: String,
    /// This node's changes not yet published to the store.
    pub store_pending_writes: u32,
    /// Cluster identities in the cache.
    pub cluster_identities: u32,
    /// Identities referenced on this node.
    pub local_identities: u32,
    /// Node-local CIDR identities.
    pub cidr_identities: u32,
    /// Effective IP cache entries.
    pub ipcache_entries: u32,
    /// The IP cache push to svc-loader is connected.
    pub loader_connected: bool,
    /// Last full push to svc-loader, Unix nanoseconds (0: never).
    pub loader_last_full_sync_unix_nanos: i64,
    /// Entries not pushed yet.
    pub loader_pending: u32,
    /// The push's last error.
    pub loader_error: String,
    /// rivet-operator's kvstore heartbeat, when the store has one (etcd).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvstore_heartbeat: Option<HeartbeatView>,
}

/// rivet-operator's kvstore heartbeat as svc-identity observes it.
/// Reported only: svc-identity serves from its cache either way, so it
/// does not make the node degraded.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct HeartbeatView {
    /// `fresh`, `stale` or `missing`.
    pub state: String,
    /// Fresh, or missing for less than the stale threshold.
    pub healthy: bool,
    /// Since svc-identity observed the last write, milliseconds.
    pub observed_age_ms: Option<u64>,
    /// No write for this long makes it stale, milliseconds.
    pub stale_threshold_ms: u64,
}

impl HeartbeatView {
    /// The view of `r`; `None` when the store has no heartbeat (or the
    /// daemon predates it).
    fn from_proto(r: &identity_pb::KvstoreHeartbeat) -> Option<Self> {
        use identity_pb::KvstoreHeartbeatState as State;
        let state = match State::try_from(r.state) {
            Ok(State::Fresh) => "fresh",
            Ok(State::Stale) => "stale",
            Ok(State::Missing) => "missing",
            _ => return None,
        };
        Some(Self {
            state: state.into(),
            healthy: r.healthy,
            observed_age_ms: r.observed_age_ms,
            stale_threshold_ms: r.stale_threshold_ms,
        })
    }

    /// The `heartbeat` line of the svc-identity section.
    fn line(&self) -> String {
        let millis = |ms: u64| duration(ms.saturating_mul(1_000_000));
        let threshold = millis(self.stale_threshold_ms);
        let age = self.observed_age_ms.map_or_else(|| "-".into(), millis);
        let unhealthy = "kvstore UNHEALTHY, serving from the cache";
        match (self.state.as_str(), self.healthy) {
            ("fresh", _) => format!("fresh (last write observed {age} ago, stale after {threshold})"),
            ("missing", true) => format!("none from rivet-operator yet (unhealthy after {threshold})"),
            ("missing", false) => {
                format!("MISSING ({unhealthy}): no heartbeat from rivet-operator for {threshold}")
            }
            _ => format!("STALE ({unhealthy}): last write observed {age} ago, stale after {threshold}"),
        }
    }
}

impl From<&identity_pb::GetStatusResponse> for IdentityStatus {
    fn from(r: &identity_pb::GetStatusResponse) -> Self {
        let store = r.store.clone().unwrap_or_default();
        let loader = r.loader.clone().unwrap_or_default();
        Self {
            store: match identity_pb::StoreBackend::try_from(store.backend) {
                Ok(identity_pb::StoreBackend::Etcd) => "etcd",
                Ok(identity_pb::StoreBackend::Embedded) => "embedded",
                Ok(identity_pb::StoreBackend::Kubernetes) => "kubernetes",
                _ => "unknown",
            }
            .into(),
            store_connected: store.connected,
            lease_id: store.lease_id,
            store_error: store.last_error,
            store_pending_writes: store.pending_writes,
            cluster_identities: r.cluster_identities,
            local_identities: r.local_identities,
            cidr_identities: r.cidr_identities,
            ipcache_entries: r.ipcache_entries,
            loader_connected: loader.connected,
            loader_last_full_sync_unix_nanos: loader.last_full_sync_unix_nanos,
            loader_pending: loader.pending,
            loader_error: loader.last_error,
            kvstore_heartbeat: r.kvstore_heartbeat.as_ref().and_then(HeartbeatView::from_proto),
        }
    }
}

/// `text` on one line.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl IdentityStatus {
    /// What keeps svc-identity from being healthy, in full: the kvstore
    /// unreachable (it serves from local state and publishes later).
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if !self.store_connected {
            let error = if self.store_error.is_empty() {
                "not listed yet".to_string()
            } else {
                one_line(&self.store_error)
            };
            problems.push(format!(
                "kvstore ({}) unreachable, serving from local state ({} changes of this node not yet published): {error}",
                self.store, self.store_pending_writes
            ));
        }
        problems
    }
}

/// The svc-identity section of `rivet status`.
fn identity_section(s: &IdentityStatus, now: i64) -> String {
    let short = |e: &str| truncate(&one_line(e), ERROR_WIDTH);
    let mut store = s.store.clone();
    if s.lease_id != 0 {
        store.push_str(&format!(", lease {:x}", s.lease_id));
    }
    if !s.store_connected {
        // In full: it is the reason the node is degraded.
        store.push_str(&format!(", NOT in sync (DEGRADED): {}", one_line(&s.store_error)));
    }
    if s.store_pending_writes > 0 {
        store.push_str(&format!(", {} changes not yet published", s.store_pending_writes));
    }
    let loader = if s.loader_connected {
        let synced = if s.loader_last_full_sync_unix_nanos == 0 {
            "never fully synced".to_string()
        } else {
            format!("full sync {} ago", age(now, s.loader_last_full_sync_unix_nanos))
        };
        format!("pushed to svc-loader ({synced}, {} pending)", s.loader_pending)
    } else if s.loader_error.is_empty() {
        "svc-loader not connected".to_string()
    } else {
        format!("svc-loader not connected: {}", short(&s.loader_error))
    };
    let mut lines = vec![("store", store)];
    if let Some(heartbeat) = &s.kvstore_heartbeat {
        lines.push(("heartbeat", heartbeat.line()));
    }
    lines.extend([
        (
            "identities",
            format!(
                "{} cluster ({} used on this node), {} CIDR",
                s.cluster_identities, s.local_identities, s.cidr_identities
            ),
        ),
        ("ipcache", format!("{} entries, {loader}", s.ipcache_entries)),
    ]);
    let body = crate::fields(lines);
    section(IDENTITY_DAEMON, &body)
}

/// `body` indented under `\n<daemon>:`.
fn section(daemon: &str, body: &str) -> String {
    let mut out = format!("\n{daemon}:\n");
    for line in body.lines() {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// One kind svc-k8s-sync watches.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct WatchedKindView {
    /// `Pod`, `NetworkPolicy`, ...
    pub kind: String,
    /// Its initial list completed since its watch last (re)started.
    pub synced: bool,
    /// Objects in its cache.
    pub objects: u64,
    /// Watch restarts (re-lists) since start.
    pub relists: u64,
    /// Its last watch error; empty when healthy.
    pub last_error: String,
}

/// A daemon svc-k8s-sync feeds (svc-endpoint).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct FedDaemonView {
    /// The daemon.
    pub name: String,
    /// Whether svc-k8s-sync is connected to it.
    pub connected: bool,
    /// Its boot id as svc-k8s-sync last saw it.
    pub seen_boot_id: String,
    /// Completed replays of the whole desired state.
    pub replays: u64,
    /// Last replay, Unix nanoseconds; 0 never.
    pub last_replay_unix_nanos: i64,
    /// Its last error.
    pub last_error: String,
}

/// What svc-k8s-sync reports in `GetStatus`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct K8sSyncStatus {
    /// The node it watches pods of.
    pub node_name: String,
    /// Every watched kind completed its initial list.
    pub caches_synced: bool,
    /// The initial sync took longer than its timeout (watches go on).
    pub cache_sync_timed_out: bool,
    /// The node is marked ready (RivetNode, Node annotations, taint removed).
    pub node_ready: bool,
    /// Its watches.
    pub kinds: Vec<WatchedKindView>,
    /// The daemons it feeds.
    pub fed: Vec<FedDaemonView>,
    /// RivetEndpoint objects written since start.
    pub endpoint_objects_applied: u64,
    /// RivetEndpoint objects deleted since start.
    pub endpoint_objects_deleted: u64,
}

impl From<&k8s_pb::GetStatusResponse> for K8sSyncStatus {
    fn from(r: &k8s_pb::GetStatusResponse) -> Self {
        Self {
            node_name: r.node_name.clone(),
            caches_synced: r.caches_synced,
            cache_sync_timed_out: r.cache_sync_timed_out,
            node_ready: r.node_ready,
            kinds: r
                .kinds
                .iter()
                .map(|k| WatchedKindView {
                    kind: k.kind.clone(),
                    synced: k.synced,
                    objects: k.objects,
                    relists: k.relists,
                    last_error: k.last_error.clone(),
                })
                .collect(),
            fed: r
                .fed
                .iter()
                .map(|f| FedDaemonView {
                    name: f.name.clone(),
                    connected: f.connected,
                    seen_boot_id: f.seen_boot_id.clone(),
                    replays: f.replays,
                    last_replay_unix_nanos: f.last_replay_unix_nanos,
                    last_error: f.last_error.clone(),
                })
                .collect(),
            endpoint_objects_applied: r.endpoint_objects_applied,
            endpoint_objects_deleted: r.endpoint_objects_deleted,
        }
    }
}

impl K8sSyncStatus {
    /// What keeps svc-k8s-sync from being healthy, in full: a watch failing
    /// (its cache is stale), the initial sync timed out, a fed daemon not
    /// reached. A node not ready only because another daemon is down is
    /// that daemon's problem, not this one's.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.cache_sync_timed_out && !self.caches_synced {
            let waiting: Vec<&str> = self
                .kinds
                .iter()
                .filter(|k| !k.synced)
                .map(|k| k.kind.as_str())
                .collect();
            problems.push(format!(
                "caches not synced after the timeout (waiting for {}): nothing is fed from the API yet",
                waiting.join(", ")
            ));
        }
        for k in self.kinds.iter().filter(|k| !k.last_error.is_empty()) {
            problems.push(format!(
                "watch of {} failing ({} re-lists): {}",
                k.kind,
                k.relists,
                one_line(&k.last_error)
            ));
        }
        for f in self.fed.iter().filter(|f| !f.connected && !f.last_error.is_empty()) {
            problems.push(format!("{} not fed: {}", f.name, one_line(&f.last_error)));
        }
        problems
    }
}

/// The svc-k8s-sync section of `rivet status`.
fn k8s_sync_section(s: &K8sSyncStatus, now: i64) -> String {
    let short = |e: &str| truncate(&one_line(e), ERROR_WIDTH);
    let caches = if s.caches_synced {
        "synced".to_string()
    } else if s.cache_sync_timed_out {
        "NOT synced (initial sync timed out, DEGRADED)".to_string()
    } else {
        "syncing".to_string()
    };
    let mut body = crate::fields([
        (
            "node",
            format!("{}, {}", s.node_name, if s.node_ready { "ready" } else { "NOT ready" }),
        ),
        ("caches", caches),
        (
            "endpoints",
            format!(
                "{} RivetEndpoint writes, {} deletes",
                s.endpoint_objects_applied, s.endpoint_objects_deleted
            ),
        ),
    ]);
    if !s.kinds.is_empty() {
        let mut t = Table::new(["KIND", "SYNCED", "OBJECTS", "RE-LISTS", "LAST ERROR"]);
        for k in &s.kinds {
            t.row([
                k.kind.clone(),
                if k.synced { "yes" } else { "no" }.into(),
                k.objects.to_string(),
                k.relists.to_string(),
                if k.last_error.is_empty() {
                    "-".into()
                } else {
                    short(&k.last_error)
                },
            ]);
        }
        body.push_str(&t.render());
    }
    if !s.fed.is_empty() {
        let mut t = Table::new([
            "FEEDS",
            "CONNECTED",
            "SEEN BOOT ID",
            "REPLAYS",
            "LAST REPLAY",
            "LAST ERROR",
        ]);
        for f in &s.fed {
            t.row([
                f.name.clone(),
                if f.connected { "yes" } else { "no" }.into(),
                if f.seen_boot_id.is_empty() {
                    "-".into()
                } else {
                    f.seen_boot_id.chars().take(SHORT_BOOT_ID).collect()
                },
                f.replays.to_string(),
                if f.last_replay_unix_nanos == 0 {
                    "never".into()
                } else {
                    format!("{} ago", age(now, f.last_replay_unix_nanos))
                },
                if f.last_error.is_empty() {
                    "-".into()
                } else {
                    short(&f.last_error)
                },
            ]);
        }
        body.push_str(&t.render());
    }
    section(K8S_SYNC_DAEMON, &body)
}

/// svc-endpoint's restore progress.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct RestoreView {
    /// `running`, `complete` or `unknown`.
    pub phase: String,
    /// State dirs found at start.
    pub found: u32,
    /// Regenerated and ready.
    pub restored: u32,
    /// Dropped because the interface or pod is gone.
    pub dropped: u32,
    /// Failed to restore.
    pub failed: u32,
    /// Start, Unix nanoseconds.
    pub started_unix_nanos: i64,
    /// End, Unix nanoseconds; 0 while running.
    pub finished_unix_nanos: i64,
}

/// How many endpoints are in one state.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct StateCountView {
    /// State name.
    pub state: String,
    /// Endpoints in it.
    pub count: u32,
}

/// svc-endpoint's link to a daemon it drives.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct DependencyView {
    /// The daemon.
    pub name: String,
    /// Whether svc-endpoint is connected to it.
    pub connected: bool,
    /// Its boot id as svc-endpoint last saw it.
    pub seen_boot_id: String,
    /// Last completed replay of desired state, Unix nanoseconds; 0 never.
    pub last_resync_unix_nanos: i64,
    /// Its last error.
    pub last_error: String,
}

/// What svc-endpoint reports in `GetStatus`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct EndpointStatus {
    /// Restore progress.
    pub restore: RestoreView,
    /// Endpoints by state.
    pub endpoints_by_state: Vec<StateCountView>,
    /// Current policy repository revision.
    pub policy_revision: u64,
    /// Policies stored.
    pub policies: u32,
    /// Links to the daemons it drives.
    pub dependencies: Vec<DependencyView>,
    /// The policy origins it accepts (`api`, `directory`, `kubernetes`).
    pub policy_sources: Vec<String>,
    /// Pod labels come from svc-k8s-sync (`--k8s-sync-socket`).
    pub kubernetes_mode: bool,
    /// Endpoints on the init identity waiting for their pod's labels.
    pub labels_pending: u32,
}

impl From<&endpoint_pb::GetStatusResponse> for EndpointStatus {
    fn from(r: &endpoint_pb::GetStatusResponse) -> Self {
        let restore = r.restore.unwrap_or_default();
        Self {
            restore: RestoreView {
                phase: match endpoint_pb::RestorePhase::try_from(restore.phase) {
                    Ok(endpoint_pb::RestorePhase::Running) => "running",
                    Ok(endpoint_pb::RestorePhase::Complete) => "complete",
                    _ => "unknown",
                }
                .into(),
                found: restore.found,
                restored: restore.restored,
                dropped: restore.dropped,
                failed: restore.failed,
                started_unix_nanos: restore.started_unix_nanos,
                finished_unix_nanos: restore.finished_unix_nanos,
            },
            endpoints_by_state: r
                .endpoints_by_state
                .iter()
                .map(|c| StateCountView {
                    state: state_name(c.state).into(),
                    count: c.count,
                })
                .collect(),
            policy_revision: r.policy_revision,
            policies: r.policies,
            dependencies: r
                .dependencies
                .iter()
                .map(|d| DependencyView {
                    name: d.name.clone(),
                    connected: d.connected,
                    seen_boot_id: d.seen_boot_id.clone(),
                    last_resync_unix_nanos: d.last_resync_unix_nanos,
                    last_error: d.last_error.clone(),
                })
                .collect(),
            policy_sources: r
                .policy_sources
                .iter()
                .map(|o| match endpoint_pb::PolicyOrigin::try_from(*o) {
                    Ok(endpoint_pb::PolicyOrigin::Api) => "api",
                    Ok(endpoint_pb::PolicyOrigin::Directory) => "directory",
                    Ok(endpoint_pb::PolicyOrigin::Kubernetes) => "kubernetes",
                    _ => "unknown",
                })
                .map(String::from)
                .collect(),
            kubernetes_mode: r.kubernetes_mode,
            labels_pending: r.labels_pending,
        }
    }
}

/// The svc-endpoint section of `rivet status`, indented under its name.
fn endpoint_section(s: &EndpointStatus, now: i64) -> String {
    let r = &s.restore;
    let counts = format!(
        "{} found, {} restored, {} dropped, {} failed",
        r.found, r.restored, r.dropped, r.failed
    );
    let restore = match r.phase.as_str() {
        "running" => format!("running for {}: {counts}", age(now, r.started_unix_nanos)),
        "complete" if r.started_unix_nanos > 0 && r.finished_unix_nanos >= r.started_unix_nanos => {
            let took = (r.finished_unix_nanos - r.started_unix_nanos).unsigned_abs();
            format!("complete in {}: {counts}", duration(took))
        }
        phase => format!("{phase}: {counts}"),
    };
    let by_state: Vec<String> = s
        .endpoints_by_state
        .iter()
        .filter(|c| c.count > 0)
        .map(|c| format!("{} {}", c.count, c.state))
        .collect();
    let mut fields = vec![
        ("restore", restore),
        (
            "endpoints",
            if by_state.is_empty() {
                "none".into()
            } else {
                by_state.join(", ")
            },
        ),
        (
            "policy",
            format!(
                "revision {}, {} {}{}",
                s.policy_revision,
                s.policies,
                if s.policies == 1 { "policy" } else { "policies" },
                if s.policy_sources.is_empty() {
                    String::new()
                } else {
                    format!(" (sources: {})", s.policy_sources.join(", "))
                }
            ),
        ),
    ];
    if s.kubernetes_mode {
        fields.push((
            "kubernetes",
            format!(
                "pod labels from svc-k8s-sync; {} {} waiting for labels (init identity)",
                s.labels_pending,
                if s.labels_pending == 1 { "endpoint" } else { "endpoints" }
            ),
        ));
    }
    let mut body = crate::fields(fields);
    if !s.dependencies.is_empty() {
        let mut t = Table::new(["DEPENDENCY", "CONNECTED", "SEEN BOOT ID", "LAST RESYNC", "LAST ERROR"]);
        for d in &s.dependencies {
            t.row([
                d.name.clone(),
                if d.connected { "yes" } else { "no" }.into(),
                if d.seen_boot_id.is_empty() {
                    "-".into()
                } else {
                    d.seen_boot_id.chars().take(SHORT_BOOT_ID).collect()
                },
                if d.last_resync_unix_nanos == 0 {
                    "never".into()
                } else {
                    format!("{} ago", age(now, d.last_resync_unix_nanos))
                },
                if d.last_error.is_empty() {
                    "-".into()
                } else {
                    truncate(
                        &d.last_error.split_whitespace().collect::<Vec<_>>().join(" "),
                        ERROR_WIDTH,
                    )
                },
            ]);
        }
        body.push_str(&t.render());
    }
    section(ENDPOINT_DAEMON, &body)
}

/// The node's health: its worst daemon's.
pub fn node_health(all: &[DaemonStatus]) -> NodeHealth {
    all.iter().map(|s| s.health).max().unwrap_or(NodeHealth::Healthy)
}

/// The closing lines: the node's health and every problem in full.
fn health_section(all: &[DaemonStatus]) -> String {
    let health = node_health(all);
    let mut out = format!("\nnode health: {}\n", health.as_str().to_uppercase());
    for s in all {
        for problem in &s.problems {
            out.push_str(&format!("  {} {}: {problem}\n", s.daemon, s.health.as_str()));
        }
    }
    out
}

/// Probes every daemon and prints what they report; returns the node's
/// health (the exit status, see [`NodeHealth::exit_code`]). A socket that
/// exists but does not answer is unhealthy, a missing one only means "not
/// running".
pub async fn run(ctx: &Context) -> anyhow::Result<NodeHealth> {
    let mut all = Vec::new();
    for daemon in DAEMONS {
        all.push(probe(ctx, daemon).await);
    }
    ctx.print(&all, || {
        let mut t = Table::new(["DAEMON", "STATE", "HEALTH", "VERSION", "PID", "BOOT ID", "SOCKET"]);
        for s in &all {
            t.row([
                s.daemon.clone(),
                match &s.error {
                    Some(e) => format!("{} ({})", s.state, truncate(&one_line(e), ERROR_WIDTH)),
                    None => s.state.clone(),
                },
                if s.state == "not running" {
                    "-".into()
                } else {
                    s.health.as_str().into()
                },
                s.version.clone().unwrap_or_else(|| "-".into()),
                s.pid.map_or("-".into(), |p| p.to_string()),
                s.boot_id.clone().unwrap_or_else(|| "-".into()),
                s.socket.clone(),
            ]);
        }
        let mut out = t.render();
        let now = now_unix_nanos();
        for s in &all {
            if let Some(identity) = &s.identity_status {
                out.push_str(&identity_section(identity, now));
            }
            if let Some(endpoint) = &s.endpoint_status {
                out.push_str(&endpoint_section(endpoint, now));
            }
            if let Some(sync) = &s.k8s_sync_status {
                out.push_str(&k8s_sync_section(sync, now));
            }
            if let Some(health) = &s.health_status {
                out.push_str(&section(HEALTH_DAEMON, &format!("{}\n", health.summary_line())));
            }
        }
        out.push_str(&controllers_section(&all));
        out.push_str(&health_section(&all));
        out
    });
    Ok(node_health(&all))
}

async fn probe(ctx: &Context, daemon: &str) -> DaemonStatus {
    let path = ctx.socket(daemon);
    let mut status = DaemonStatus {
        daemon: daemon.to_string(),
        socket: path.display().to_string(),
        state: "not running".into(),
        boot_id: None,
        version: None,
        node_name: None,
        pid: None,
        error: None,
        health: NodeHealth::Healthy,
        problems: Vec::new(),
        controllers: Vec::new(),
        endpoint_status: None,
        identity_status: None,
        k8s_sync_status: None,
        health_status: None,
    };
    if !path.exists() {
        return status;
    }
    // A socket file exists: the daemon should answer quickly.
    let info = async {
        let channel = connect(&path, ctx.timeout.min(Duration::from_secs(2)))
            .await
            .map_err(|e| e.to_string())?;
        DaemonClient::new(channel.clone())
            .get_info(GetInfoRequest {})
            .await
            .map(|r| (r.into_inner(), channel))
            .map_err(|s| s.message().to_string())
    }
    .await;
    match info {
        Ok((info, channel)) => {
            let status_error = |s: tonic::Status| Some(format!("GetStatus: {:?}: {}", s.code(), s.message()));
            if daemon == ENDPOINT_DAEMON {
                match EndpointServiceClient::new(channel)
                    .get_status(endpoint_pb::GetStatusRequest {})
                    .await
                {
                    Ok(r) => status.endpoint_status = Some((&r.into_inner()).into()),
                    Err(s) => status.error = status_error(s),
                }
            } else if daemon == IDENTITY_DAEMON {
                match IdentityServiceClient::new(channel)
                    .get_status(identity_pb::GetStatusRequest {})
                    .await
                {
                    Ok(r) => {
                        let identity = IdentityStatus::from(&r.into_inner());
                        status.problems = identity.problems();
                        if !status.problems.is_empty() {
                            status.health = NodeHealth::Degraded;
                        }
                        status.identity_status = Some(identity);
                    }
                    Err(s) => status.error = status_error(s),
                }
            } else if daemon == HEALTH_DAEMON {
                match HealthServiceClient::new(channel)
                    .get_health(health_pb::GetHealthRequest::default())
                    .await
                {
                    Ok(r) => status.health_status = Some(crate::health::HealthView::from(&r.into_inner())),
                    Err(s) => status.error = status_error(s),
                }
            } else if daemon == K8S_SYNC_DAEMON {
                match KubernetesSyncServiceClient::new(channel)
                    .get_status(k8s_pb::GetStatusRequest {})
                    .await
                {
                    Ok(r) => {
                        let sync = K8sSyncStatus::from(&r.into_inner());
                        status.problems = sync.problems();
                        if !status.problems.is_empty() {
                            status.health = NodeHealth::Degraded;
                        }
                        status.k8s_sync_status = Some(sync);
                    }
                    Err(s) => status.error = status_error(s),
                }
            }
            status.controllers = info.controllers.iter().map(ControllerView::from).collect();
            if !info.degraded.is_empty() {
                status.health = status.health.max(NodeHealth::Degraded);
                status.problems.push(info.degraded.clone());
            }
            if let Some(error) = &status.error {
                status.health = NodeHealth::Unhealthy;
                status.problems.push(format!("its status cannot be read: {error}"));
            }
            status.state = "running".into();
            status.boot_id = Some(info.boot_id);
            status.version = Some(info.version);
            status.node_name = Some(info.node_name);
            status.pid = Some(info.pid);
        }
        Err(e) => {
            status.state = "unreachable".into();
            status.health = NodeHealth::Unhealthy;
            status
                .problems
                .push(format!("does not answer on {}: {e}", status.socket));
            status.error = Some(e);
        }
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    fn status() -> endpoint_pb::GetStatusResponse {
        endpoint_pb::GetStatusResponse {
            restore: Some(endpoint_pb::RestoreStatus {
                phase: endpoint_pb::RestorePhase::Complete as i32,
                found: 12,
                restored: 10,
                dropped: 1,
                failed: 1,
                started_unix_nanos: 100 * S,
                finished_unix_nanos: 100 * S + 1_250_000_000,
            }),
            endpoints_by_state: vec![
                endpoint_pb::StateCount {
                    state: endpoint_pb::EndpointState::Regenerating as i32,
                    count: 1,
                },
                endpoint_pb::StateCount {
                    state: endpoint_pb::EndpointState::Ready as i32,
                    count: 10,
                },
                endpoint_pb::StateCount {
                    state: endpoint_pb::EndpointState::Restoring as i32,
                    count: 0,
                },
            ],
            policy_revision: 42,
            policies: 7,
            dependencies: vec![
                endpoint_pb::Dependency {
                    name: "svc-identity".into(),
                    connected: true,
                    seen_boot_id: "3f2a9c1d-0000-4000-8000-000000000000".into(),
                    last_resync_unix_nanos: 400 * S,
                    last_error: String::new(),
                },
                endpoint_pb::Dependency {
                    name: "svc-loader".into(),
                    connected: false,
                    seen_boot_id: String::new(),
                    last_resync_unix_nanos: 0,
                    last_error: "connection refused".into(),
                },
            ],
            boot_id: "b".into(),
            policy_dir: None,
            policy_sources: vec![
                endpoint_pb::PolicyOrigin::Api as i32,
                endpoint_pb::PolicyOrigin::Directory as i32,
            ],
            ..Default::default()
        }
    }

    #[test]
    fn endpoint_section_is_short() {
        let view = EndpointStatus::from(&status());
        assert_eq!(
            endpoint_section(&view, 700 * S),
            "\nsvc-endpoint:\n\
             \x20 restore    complete in 1.2s: 12 found, 10 restored, 1 dropped, 1 failed\n\
             \x20 endpoints  1 regenerating, 10 ready\n\
             \x20 policy     revision 42, 7 policies (sources: api, directory)\n\
             \x20 DEPENDENCY    CONNECTED  SEEN BOOT ID  LAST RESYNC  LAST ERROR\n\
             \x20 svc-identity  yes        3f2a9c1d      5m0s ago     -\n\
             \x20 svc-loader    no         -             never        connection refused\n"
        );
    }

    #[test]
    fn identity_section_names_the_store_the_counts_and_the_push() {
        let mut r = identity_pb::GetStatusResponse {
            store: Some(identity_pb::StoreStatus {
                backend: identity_pb::StoreBackend::Etcd as i32,
                connected: true,
                last_error: String::new(),
                lease_id: 0x694d_9a1b_2c3d_4e5f,
                revision: 0,
                pending_writes: 0,
            }),
            cluster_identities: 12,
            local_identities: 3,
            cidr_identities: 2,
            ipcache_entries: 40,
            loader: Some(identity_pb::LoaderSyncStatus {
                connected: true,
                loader_boot_id: "l".into(),
                last_full_sync_unix_nanos: 690 * S,
                pending: 0,
                last_error: String::new(),
            }),
            boot_id: "b".into(),
            kvstore_heartbeat: None,
        };
        assert_eq!(
            identity_section(&IdentityStatus::from(&r), 700 * S),
            "\nsvc-identity:\n\
             \x20 store       etcd, lease 694d9a1b2c3d4e5f\n\
             \x20 identities  12 cluster (3 used on this node), 2 CIDR\n\
             \x20 ipcache     40 entries, pushed to svc-loader (full sync 10s ago, 0 pending)\n"
        );
        assert!(IdentityStatus::from(&r).problems().is_empty(), "a healthy store");
        let error = "listing identities: the store is unreachable: etcd answered Unavailable: tcp connect error: \
                     Connection refused (os error 111)";
        r.store = Some(identity_pb::StoreStatus {
            backend: identity_pb::StoreBackend::Etcd as i32,
            connected: false,
            last_error: error.into(),
            pending_writes: 3,
            ..Default::default()
        });
        r.loader = None;
        let view = IdentityStatus::from(&r);
        let text = identity_section(&view, 700 * S);
        assert!(
            text.contains(&format!(
                "store       etcd, NOT in sync (DEGRADED): {error}, 3 changes not yet published\n"
            )),
            "the whole reason, not cut: {text}"
        );
        assert!(text.contains("40 entries, svc-loader not connected\n"), "{text}");
        assert_eq!(
            view.problems(),
            [format!(
                "kvstore (etcd) unreachable, serving from local state (3 changes of this node not yet published): {error}"
            )]
        );
    }

    #[test]
    fn identity_section_shows_the_kvstore_heartbeat_without_degrading_the_node() {
        let heartbeat = |state: identity_pb::KvstoreHeartbeatState, healthy, age: Option<u64>| {
            let r = identity_pb::GetStatusResponse {
                store: Some(identity_pb::StoreStatus {
                    backend: identity_pb::StoreBackend::Etcd as i32,
                    connected: true,
                    ..Default::default()
                }),
                kvstore_heartbeat: Some(identity_pb::KvstoreHeartbeat {
                    state: state as i32,
                    healthy,
                    last_written_unix_nanos: 0,
                    observed_age_ms: age,
                    stale_threshold_ms: 120_000,
                }),
                ..Default::default()
            };
            let view = IdentityStatus::from(&r);
            assert!(
                view.problems().is_empty(),
                "reported, not a problem of the node: {view:?}"
            );
            let text = identity_section(&view, 700 * S);
            text.lines()
                .find_map(|l| l.trim_start().strip_prefix("heartbeat").map(|l| l.trim().to_string()))
                .unwrap_or_else(|| panic!("no heartbeat line: {text}"))
        };
        use identity_pb::KvstoreHeartbeatState as State;
        assert_eq!(
            heartbeat(State::Fresh, true, Some(12_000)),
            "fresh (last write observed 12.0s ago, stale after 2m0s)"
        );
        assert_eq!(
            heartbeat(State::Stale, false, Some(185_000)),
            "STALE (kvstore UNHEALTHY, serving from the cache): last write observed 3m5s ago, stale after 2m0s"
        );
        assert_eq!(
            heartbeat(State::Missing, true, None),
            "none from rivet-operator yet (unhealthy after 2m0s)"
        );
        assert_eq!(
            heartbeat(State::Missing, false, None),
            "MISSING (kvstore UNHEALTHY, serving from the cache): no heartbeat from rivet-operator for 2m0s"
        );
        // Not applicable (embedded, kubernetes): no line.
        let r = identity_pb::GetStatusResponse {
            kvstore_heartbeat: Some(identity_pb::KvstoreHeartbeat {
                state: State::NotApplicable as i32,
                healthy: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(!identity_section(&IdentityStatus::from(&r), 700 * S).contains("heartbeat"));
    }

    fn daemon(name: &str, health: NodeHealth, problems: &[&str]) -> DaemonStatus {
        DaemonStatus {
            daemon: name.into(),
            socket: format!("/run/{name}.sock"),
            state: "running".into(),
            boot_id: None,
            version: None,
            node_name: None,
            pid: None,
            error: None,
            health,
            problems: problems.iter().map(|p| (*p).to_string()).collect(),
            controllers: Vec::new(),
            endpoint_status: None,
            identity_status: None,
            k8s_sync_status: None,
            health_status: None,
        }
    }

    #[test]
    fn the_node_is_as_healthy_as_its_worst_daemon_and_says_why() {
        let healthy = [daemon("svc-ipam", NodeHealth::Healthy, &[])];
        assert_eq!(node_health(&healthy), NodeHealth::Healthy);
        assert_eq!(NodeHealth::Healthy.exit_code(), 0);
        assert_eq!(health_section(&healthy), "\nnode health: HEALTHY\n");

        let degraded = [
            daemon("svc-ipam", NodeHealth::Healthy, &[]),
            daemon("svc-identity", NodeHealth::Degraded, &["kvstore (etcd) unreachable: x"]),
        ];
        assert_eq!(node_health(&degraded), NodeHealth::Degraded);
        assert_eq!(NodeHealth::Degraded.exit_code(), 3);
        assert_eq!(
            health_section(&degraded),
            "\nnode health: DEGRADED\n  svc-identity degraded: kvstore (etcd) unreachable: x\n"
        );

        let mut unhealthy = degraded.to_vec();
        unhealthy.push(daemon("svc-loader", NodeHealth::Unhealthy, &["does not answer"]));
        assert_eq!(node_health(&unhealthy), NodeHealth::Unhealthy);
        assert_eq!(NodeHealth::Unhealthy.exit_code(), 1);
        assert!(health_section(&unhealthy).contains("svc-loader unhealthy: does not answer\n"));
        let json = serde_json::to_value(&unhealthy[1]).unwrap();
        assert_eq!(json["health"], "degraded");
        assert_eq!(json["problems"][0], "kvstore (etcd) unreachable: x");
    }

    #[test]
    fn controllers_are_listed_per_daemon_with_their_failures() {
        let mut identity = daemon("svc-identity", NodeHealth::Degraded, &[]);
        identity.controllers = vec![
            ControllerView::from(&daemon_pb::ControllerStatus {
                name: "identity-watch".into(),
                state: daemon_pb::ControllerState::Failing as i32,
                restarts: 3,
                consecutive_failures: 3,
                last_error: "watching identities: etcd answered Unavailable".into(),
                last_success_age_ms: Some(95_000),
                failing_for_ms: Some(40_000),
                degraded: true,
            }),
            ControllerView::from(&daemon_pb::ControllerStatus {
                name: "snapshot-writer".into(),
                state: daemon_pb::ControllerState::Running as i32,
                last_success_age_ms: Some(1_500),
                ..Default::default()
            }),
        ];
        let mut ipam = daemon("svc-ipam", NodeHealth::Healthy, &[]);
        ipam.controllers = vec![ControllerView::from(&daemon_pb::ControllerStatus {
            name: "state-writer".into(),
            state: daemon_pb::ControllerState::Running as i32,
            ..Default::default()
        })];
        assert_eq!(
            controllers_section(&[ipam, identity.clone()]),
            "\ncontrollers:\n\
             \x20 DAEMON        CONTROLLER       STATE          RESTARTS  LAST SUCCESS  LAST ERROR\n\
             \x20 svc-ipam      state-writer     running        0         never         -\n\
             \x20 svc-identity  identity-watch   failing 40.0s  3         1m35s ago     watching identities: etcd answered Unavailable\n\
             \x20 svc-identity  snapshot-writer  running        0         1.5s ago      -\n"
        );
        assert_eq!(controllers_section(&[daemon("svc-gc", NodeHealth::Healthy, &[])]), "");
        let json = serde_json::to_value(&identity).unwrap();
        assert_eq!(json["controllers"][0]["name"], "identity-watch");
        assert_eq!(json["controllers"][0]["degraded"], true);
        assert_eq!(json["controllers"][1]["failing_for_ms"], serde_json::Value::Null);
    }

    #[test]
    fn endpoint_section_while_restoring() {
        let mut r = status();
        r.restore = Some(endpoint_pb::RestoreStatus {
            phase: endpoint_pb::RestorePhase::Running as i32,
            found: 3,
            started_unix_nanos: 697 * S,
            ..Default::default()
        });
        r.endpoints_by_state.clear();
        r.policies = 1;
        r.dependencies.clear();
        let text = endpoint_section(&EndpointStatus::from(&r), 700 * S);
        assert!(text.contains("restore    running for 3s: 3 found, 0 restored, 0 dropped, 0 failed\n"));
        assert!(text.contains("endpoints  none\n"));
        assert!(text.ends_with("policy     revision 42, 1 policy (sources: api, directory)\n"));
    }

    #[test]
    fn endpoint_section_names_kubernetes_mode_and_the_pods_waiting_for_labels() {
        let mut r = status();
        r.kubernetes_mode = true;
        r.labels_pending = 2;
        r.policy_sources.push(endpoint_pb::PolicyOrigin::Kubernetes as i32);
        r.dependencies.clear();
        let view = EndpointStatus::from(&r);
        let text = endpoint_section(&view, 700 * S);
        assert!(
            text.contains("policy      revision 42, 7 policies (sources: api, directory, kubernetes)\n"),
            "{text}"
        );
        assert!(
            text.ends_with(
                "kubernetes  pod labels from svc-k8s-sync; 2 endpoints waiting for labels (init identity)\n"
            ),
            "{text}"
        );
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["kubernetes_mode"], true);
        assert_eq!(json["labels_pending"], 2);
        assert_eq!(json["policy_sources"][2], "kubernetes");
    }

    fn k8s_sync_status() -> k8s_pb::GetStatusResponse {
        let kind = |kind: &str, objects: u64| k8s_pb::WatchedKind {
            kind: kind.into(),
            synced: true,
            objects,
            relists: 1,
            last_error: String::new(),
        };
        k8s_pb::GetStatusResponse {
            node_name: "node-a".into(),
            kinds: vec![kind("Pod", 12), kind("Namespace", 4)],
            caches_synced: true,
            cache_sync_timed_out: false,
            node_ready: true,
            fed: vec![k8s_pb::FedDaemon {
                name: "svc-endpoint".into(),
                connected: true,
                seen_boot_id: "9c1d3f2a-0000-4000-8000-000000000000".into(),
                replays: 2,
                last_replay_unix_nanos: 690 * S,
                last_error: String::new(),
            }],
            endpoint_objects_applied: 30,
            endpoint_objects_deleted: 2,
            boot_id: "b".into(),
        }
    }

    #[test]
    fn k8s_sync_section_shows_the_watches_the_node_and_the_feed() {
        let view = K8sSyncStatus::from(&k8s_sync_status());
        assert_eq!(
            k8s_sync_section(&view, 700 * S),
            "\nsvc-k8s-sync:\n\
             \x20 node       node-a, ready\n\
             \x20 caches     synced\n\
             \x20 endpoints  30 RivetEndpoint writes, 2 deletes\n\
             \x20 KIND       SYNCED  OBJECTS  RE-LISTS  LAST ERROR\n\
             \x20 Pod        yes     12       1         -\n\
             \x20 Namespace  yes     4        1         -\n\
             \x20 FEEDS         CONNECTED  SEEN BOOT ID  REPLAYS  LAST REPLAY  LAST ERROR\n\
             \x20 svc-endpoint  yes        9c1d3f2a      2        10s ago      -\n"
        );
        assert!(
            view.problems().is_empty(),
            "synced, every watch healthy, svc-endpoint fed"
        );
        let json = serde_json::to_value(&view).unwrap();
        assert_eq!(json["kinds"][0]["objects"], 12);
        assert_eq!(json["fed"][0]["replays"], 2);
    }

    #[test]
    fn k8s_sync_is_degraded_by_a_failing_watch_a_timed_out_sync_or_an_unfed_daemon() {
        let forbidden = "listing pods: the API server refused (403): pods is forbidden: User \
                         \"system:serviceaccount:kube-system:svc-k8s-sync\" cannot list resource \"pods\"";
        let mut r = k8s_sync_status();
        r.caches_synced = false;
        r.cache_sync_timed_out = true;
        r.node_ready = false;
        r.kinds[0].synced = false;
        r.kinds[0].relists = 4;
        r.kinds[0].last_error = forbidden.into();
        r.fed[0].connected = false;
        r.fed[0].last_error = "connection refused".into();
        let view = K8sSyncStatus::from(&r);
        assert_eq!(
            view.problems(),
            [
                "caches not synced after the timeout (waiting for Pod): nothing is fed from the API yet".to_string(),
                format!("watch of Pod failing (4 re-lists): {forbidden}"),
                "svc-endpoint not fed: connection refused".to_string(),
            ]
        );
        let text = k8s_sync_section(&view, 700 * S);
        assert!(text.contains("node       node-a, NOT ready\n"), "{text}");
        assert!(
            text.contains("caches     NOT synced (initial sync timed out, DEGRADED)\n"),
            "{text}"
        );

        // Still syncing within the timeout is not a problem yet.
        r.cache_sync_timed_out = false;
        r.kinds[0].last_error.clear();
        r.fed[0].last_error.clear();
        let view = K8sSyncStatus::from(&r);
        assert!(view.problems().is_empty(), "{:?}", view.problems());
        assert!(k8s_sync_section(&view, 700 * S).contains("caches     syncing\n"));
    }
}
