//! The `cluster-pool` duty (issue 15 §2 operator side, §6 RivetNodes):
//! every Node gets a RivetNode, every RivetNode one pod CIDR per configured
//! family, and a RivetNode whose Node is gone is deleted after a grace,
//! which releases its CIDRs.
//!
//! The allocation state lives in the API objects only. Each term starts its
//! own watchers, whose first list is a quorum read, and rebuilds the
//! [`allocator::Allocator`] from it (every CIDR any RivetNode holds, in or
//! out of the cluster CIDRs, also those pending deletion) before it
//! allocates anything; a CIDR written in this term but not yet seen back by
//! the watch counts as taken. Every write checks [`Term::ensure`] first and
//! carries the object's `resourceVersion` as a precondition, so a write
//! based on a stale view fails (409) and is planned again from the next
//! view. Together: no block is ever given to two nodes, also across a
//! failover in the middle of a write.
//!
//! Writes: `spec.podCidrs` by server-side apply (field manager
//! [`FIELD_MANAGER`]); condition `PodCIDRsAllocated` by status server-side
//! apply (the conditions are a map keyed by type, so svc-k8s-sync's `Ready`
//! is not touched); annotation [`NODE_DELETED_AT_ANNOTATION`] by a merge
//! patch. A RivetNode whose `spec.podCidrs` another field manager owns (a
//! node with its own `--pool` flags) keeps its CIDRs: the operator never
//! moves nor extends them.

pub mod allocator;
mod telemetry;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event, ListSemantic};
use kube::{Client, Resource as _, ResourceExt as _};
use prometheus_client::registry::Registry;
use rivet_common::controller::{Action, Controller, Controllers, Trigger};
use rivet_k8s::{CONDITION_POD_CIDRS_ALLOCATED, NodeCondition, RivetNode};
use serde_json::json;

use crate::term::{Duty, NotLeading, Term};
use allocator::{Allocator, Exhausted, Family, PoolConfig, PoolConfigError};
pub use telemetry::PoolMetrics;

/// The field manager of the operator's writes.
pub const FIELD_MANAGER: &str = "rivet-operator";

/// RivetNode annotation: when the operator first saw its Node gone
/// (RFC 3339). In the object, so the grace survives a failover.
pub const NODE_DELETED_AT_ANNOTATION: &str = "rivet.io/node-deleted-at";

/// Condition reason: every configured family has a pod CIDR.
pub const REASON_ALLOCATED: &str = "PodCIDRsAllocated";
/// Condition reason: no free block of a family.
pub const REASON_EXHAUSTED: &str = "ClusterPoolExhausted";
/// Condition reason: a pod CIDR overlaps an older RivetNode's.
pub const REASON_CONFLICT: &str = "PodCIDRConflict";
/// Condition reason: another field manager (the node's own pool) owns the
/// pod CIDRs; the operator allocates nothing for it.
pub const REASON_NODE_MANAGED: &str = "NodeManagedPodCIDRs";

/// At most this many API writes of one pass run at once.
const WRITE_CONCURRENCY: usize = 32;
/// Everything is re-planned this often even without an event.
const RESYNC: Duration = Duration::from_secs(300);
/// A pass that lost a race (409) runs again this soon.
const RETRY_STALE: Duration = Duration::from_millis(100);

/// The duty's flags (flattened into `rivet-operator`'s).
#[derive(Debug, Clone, clap::Args)]
pub struct ClusterPoolArgs {
    /// IPv4 cluster CIDRs the nodes' pod CIDRs are cut from (repeat or
    /// comma-separate; allocated in this order). None: IPv4 pod CIDRs are
    /// not allocated.
    #[arg(long, env = "RIVET_CLUSTER_POOL_IPV4_CIDR", value_delimiter = ',')]
    pub cluster_pool_ipv4_cidr: Vec<IpNet>,

    /// Prefix length of each node's IPv4 pod CIDR (at most 16 bits longer
    /// than the cluster CIDR's).
    #[arg(long, env = "RIVET_CLUSTER_POOL_IPV4_MASK_SIZE", default_value_t = 24)]
    pub cluster_pool_ipv4_mask_size: u8,

    /// IPv6 cluster CIDRs (repeat or comma-separate). None: IPv6 pod CIDRs
    /// are not allocated.
    #[arg(long, env = "RIVET_CLUSTER_POOL_IPV6_CIDR", value_delimiter = ',')]
    pub cluster_pool_ipv6_cidr: Vec<IpNet>,

    /// Prefix length of each node's IPv6 pod CIDR (the seed's 120; at most
    /// 16 bits longer than the cluster CIDR's).
    #[arg(long, env = "RIVET_CLUSTER_POOL_IPV6_MASK_SIZE", default_value_t = 120)]
    pub cluster_pool_ipv6_mask_size: u8,

    /// Seconds a deleted Node's RivetNode (and so its pod CIDRs) is kept
    /// before it is deleted: a Node that re-registers within it keeps its
    /// CIDRs, and pods of a gone node are garbage-collected (PodGC, ~40 s)
    /// before their addresses go to another node.
    #[arg(long, env = "RIVET_NODE_CIDR_RELEASE_GRACE", default_value_t = 300)]
    pub node_cidr_release_grace: u64,
}

impl ClusterPoolArgs {
    /// The validated pool.
    ///
    /// # Errors
    /// See [`PoolConfig::new`].
    pub fn pool(&self) -> Result<PoolConfig, PoolConfigError> {
        PoolConfig::new(
            &self.cluster_pool_ipv4_cidr,
            self.cluster_pool_ipv4_mask_size,
            &self.cluster_pool_ipv6_cidr,
            self.cluster_pool_ipv6_mask_size,
        )
    }

    /// `--node-cidr-release-grace`.
    pub fn grace(&self) -> Duration {
        Duration::from_secs(self.node_cidr_release_grace)
    }
}

/// Why a pass of the duty failed (it is retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The term ended or passed its renew deadline: nothing was written.
    #[error(transparent)]
    NotLeading(#[from] NotLeading),
    /// An API call failed.
    #[error("{verb} {resource}: {source}")]
    Api {
        /// `create`, `apply`, `apply-status`, `annotate`, `delete`.
        verb: &'static str,
        /// `rivetnodes/<name>`.
        resource: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
}

impl PoolError {
    fn api(verb: &'static str, node: &str, source: kube::Error) -> Self {
        Self::Api {
            verb,
            resource: format!("rivetnodes/{node}"),
            source,
        }
    }

    fn status_code(&self) -> Option<u16> {
        match self {
            Self::Api {
                source: kube::Error::Api(status),
                ..
            } => Some(status.code),
            _ => None,
        }
    }

    /// A metric label: `conflict` (stale view), `not_found`, `forbidden`,
    /// `invalid`, `unavailable`, `not_leading`, `other`.
    fn kind_label(&self) -> &'static str {
        match (self, self.status_code()) {
            (Self::NotLeading(_), _) => "not_leading",
            (_, Some(409)) => "conflict",
            (_, Some(404)) => "not_found",
            (_, Some(403)) => "forbidden",
            (_, Some(422)) => "invalid",
            (_, Some(500..=599) | None) => "unavailable",
            (_, Some(_)) => "other",
        }
    }

    /// The API server answered and refused: the write did not happen. Any
    /// other failure (a timeout, a dropped connection) may have written.
    fn refused(&self) -> bool {
        matches!(self, Self::NotLeading(_)) || matches!(self.status_code(), Some(400..=499))
    }
}

/// The `cluster-pool` duty. Each term gets its own watchers and state.
#[derive(Clone)]
pub struct ClusterPool {
    client: Client,
    config: PoolConfig,
    grace: Duration,
    metrics: PoolMetrics,
}

impl std::fmt::Debug for ClusterPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterPool")
            .field("config", &self.config)
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

impl ClusterPool {
    /// The duty over `client` with the validated `config`, releasing a gone
    /// Node's CIDRs after `grace`.
    pub fn new(client: Client, config: PoolConfig, grace: Duration, metrics: PoolMetrics) -> Self {
        Self {
            client,
            config,
            grace,
            metrics,
        }
    }

    /// The duty from its flags, its metrics registered in `registry`.
    ///
    /// # Errors
    /// Invalid pool flags.
    pub fn from_args(client: Client, args: &ClusterPoolArgs, registry: &mut Registry) -> Result<Self, PoolConfigError> {
        Ok(Self::new(
            client,
            args.pool()?,
            args.grace(),
            PoolMetrics::registered(registry),
        ))
    }

    /// Starts the duty for `term` and returns a handle on its state (tests
    /// and the bench wait on it).
    pub fn start_term(&self, term: &Term, controllers: &Controllers) -> PoolHandle {
        let shared = Arc::new(Shared {
            state: Mutex::new(PoolState::new(&self.config)),
            trigger: Trigger::new(),
            changed: tokio::sync::watch::Sender::new(0),
        });
        let rivet_api: Api<RivetNode> = Api::all(self.client.clone());
        let node_api: Api<Node> = Api::all(self.client.clone());
        // A quorum read: the term's view starts from the current objects,
        // never from a cache that may predate the last leader's writes.
        let config = watcher::Config::default().list_semantic(ListSemantic::MostRecent);

        let watch = |name, resource: &'static str| Watch {
            controller: name,
            resource,
            config: config.clone(),
            shared: shared.clone(),
            metrics: self.metrics.clone(),
        };
        watch("cluster-pool-rivetnodes", "rivetnodes").start(controllers, rivet_api, PoolState::rivet_event);
        watch("cluster-pool-nodes", "nodes").start(controllers, node_api, |state, event, _| state.node_event(event));
        let pass = Arc::new(Pass {
            duty: self.clone(),
            term: term.clone(),
            shared: shared.clone(),
        });
        controllers.reconcile(Controller::new("cluster-pool").trigger(&shared.trigger), move || {
            let pass = pass.clone();
            async move { pass.run().await }
        });
        PoolHandle { shared }
    }
}

/// One of a term's watchers: feeds the term's state and wakes its pass.
struct Watch {
    controller: &'static str,
    resource: &'static str,
    config: watcher::Config,
    shared: Arc<Shared>,
    metrics: PoolMetrics,
}

impl Watch {
    fn start<K>(self, controllers: &Controllers, api: Api<K>, apply: fn(&mut PoolState, Event<K>, &PoolMetrics))
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    {
        controllers.supervise(Controller::new(self.controller), move |progress| {
            let (api, config, shared, metrics) = (
                api.clone(),
                self.config.clone(),
                self.shared.clone(),
                self.metrics.clone(),
            );
            let resource = self.resource;
            async move {
                let mut events = watcher::watcher(api, config).default_backoff().boxed();
                while let Some(event) = events.next().await {
                    match event {
                        Ok(event) => {
                            apply(&mut shared.lock(), event, &metrics);
                            shared.changed();
                            progress.ok();
                        }
                        // The watcher retries with backoff; the view stays.
                        Err(e) => metrics.api_failed("watch", "watch", &format!("watching {resource}: {e}")),
                    }
                }
                Ok::<(), std::convert::Infallible>(())
            }
        });
    }
}

impl Duty for ClusterPool {
    fn name(&self) -> &'static str {
        "cluster-pool"
    }

    fn start(&self, term: &Term, controllers: &Controllers) {
        self.start_term(term, controllers);
    }
}

/// A view of one term's pool (for tests and the bench).
#[derive(Clone)]
pub struct PoolHandle {
    shared: Arc<Shared>,
}

impl PoolHandle {
    /// Waits until `done` holds for the term's view: re-checked after every
    /// watch event and pass.
    pub async fn wait_until(&self, mut done: impl FnMut(&PoolView) -> bool) {
        self.wait_state(|state| done(&state.view())).await;
    }

    /// Waits until at least `nodes` RivetNodes, as the term's watch shows
    /// them, hold a pod CIDR of every configured family: the signal the
    /// bench times 1000 nodes joining by (no polling, no copy of the view).
    pub async fn wait_all_allocated(&self, nodes: usize) {
        self.wait_state(|state| {
            let families = state.config.families();
            let allocated = state
                .rivet
                .values()
                .filter(|v| {
                    families
                        .iter()
                        .all(|f| v.cidrs.iter().any(|c| Family::of(c) == f.family))
                })
                .count();
            state.rivet_synced && allocated >= nodes
        })
        .await;
    }

    /// The term's view now.
    pub fn view(&self) -> PoolView {
        self.shared.lock().view()
    }

    async fn wait_state(&self, mut done: impl FnMut(&PoolState) -> bool) {
        let mut changed = self.shared.changed.subscribe();
        loop {
            if done(&self.shared.lock()) {
                return;
            }
            if changed.changed().await.is_err() {
                return;
            }
        }
    }
}

/// What a term's watch shows: the pod CIDRs of every RivetNode.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolView {
    /// Both watches completed their first list.
    pub synced: bool,
    /// RivetNode name → its `spec.podCidrs`.
    pub pod_cidrs: BTreeMap<String, Vec<IpNet>>,
    /// Blocks allocated per family.
    pub usage: BTreeMap<Family, (u64, u64)>,
}

struct Shared {
    state: Mutex<PoolState>,
    trigger: Trigger,
    changed: tokio::sync::watch::Sender<u64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn changed(&self) {
        self.trigger.trigger();
        self.changed.send_modify(|n| *n += 1);
    }
}

/// (creationTimestamp, name): the older node wins a conflict and gets the
/// lower block.
type CreationKey = (Option<Timestamp>, String);

/// A RivetNode as the pool needs it.
#[derive(Debug, Clone)]
struct RivetView {
    uid: String,
    resource_version: String,
    created: CreationKey,
    cidrs: Vec<IpNet>,
    /// `spec.podCidrs` is owned by another field manager.
    node_managed: Option<String>,
    deleted_at: Option<Result<Timestamp, String>>,
    deleting: bool,
    condition: Option<NodeCondition>,
}

impl RivetView {
    fn new(node: &RivetNode) -> Self {
        let meta = node.meta();
        let name = node.name_any();
        let node_managed = meta.managed_fields.iter().flatten().find_map(|entry| {
            let owns = entry.subresource.as_deref().unwrap_or("").is_empty()
                && entry
                    .fields_v1
                    .as_ref()
                    .is_some_and(|f| f.0.pointer("/f:spec/f:podCidrs").is_some());
            let manager = entry.manager.as_deref().unwrap_or("");
            (owns && manager != FIELD_MANAGER).then(|| manager.to_string())
        });
        Self {
            uid: meta.uid.clone().unwrap_or_default(),
            resource_version: meta.resource_version.clone().unwrap_or_default(),
            created: (meta.creation_timestamp.as_ref().map(|t| t.0), name),
            // A CIDR that does not parse holds nothing; svc-ipam refuses it.
            cidrs: node.spec.pod_cidrs.iter().filter_map(|c| c.parse().ok()).collect(),
            node_managed,
            deleted_at: node
                .annotations()
                .get(NODE_DELETED_AT_ANNOTATION)
                .map(|v| v.parse::<Timestamp>().map_err(|_| v.clone())),
            deleting: meta.deletion_timestamp.is_some(),
            condition: node
                .status
                .iter()
                .flat_map(|s| &s.conditions)
                .find(|c| c.type_ == CONDITION_POD_CIDRS_ALLOCATED)
                .cloned(),
        }
    }
}

/// CIDRs of one RivetNode this term wrote or tried to write and has not
/// seen back in the watch yet: taken all the same.
#[derive(Debug, Clone, Default)]
struct Pending {
    uid: String,
    /// Written (the API server accepted them): the watch will show them.
    written: Vec<IpNet>,
    /// In flight, or their write ended without an answer (it may have
    /// been written): applied again by the next plan of the node.
    unknown: Vec<IpNet>,
}

impl Pending {
    fn all(&self) -> impl Iterator<Item = &IpNet> {
        self.written.iter().chain(&self.unknown)
    }

    /// Drops what `view` holds; `true` when nothing is left.
    fn seen(&mut self, view: &RivetView) -> bool {
        self.written.retain(|c| !view.cidrs.contains(c));
        self.unknown.retain(|c| !view.cidrs.contains(c));
        self.written.is_empty() && self.unknown.is_empty()
    }
}

/// One term's view of the API objects and its allocator.
struct PoolState {
    config: PoolConfig,
    allocator: Allocator,
    nodes: HashSet<String>,
    nodes_synced: bool,
    nodes_listing: Option<HashSet<String>>,
    rivet: BTreeMap<String, RivetView>,
    rivet_synced: bool,
    rivet_listing: Option<BTreeMap<String, RivetView>>,
    pending: HashMap<String, Pending>,
    /// Names to plan in the next pass.
    dirty: BTreeSet<String>,
    /// Nodes waiting for a block: planned again when one frees up.
    waiting: BTreeSet<String>,
    /// Nodes last reported in conflict.
    conflicted: BTreeSet<String>,
    last_resync: Option<Instant>,
}

impl PoolState {
    fn new(config: &PoolConfig) -> Self {
        Self {
            config: config.clone(),
            allocator: Allocator::new(config),
            nodes: HashSet::new(),
            nodes_synced: false,
            nodes_listing: None,
            rivet: BTreeMap::new(),
            rivet_synced: false,
            rivet_listing: None,
            pending: HashMap::new(),
            dirty: BTreeSet::new(),
            waiting: BTreeSet::new(),
            conflicted: BTreeSet::new(),
            last_resync: None,
        }
    }

    fn view(&self) -> PoolView {
        PoolView {
            synced: self.nodes_synced && self.rivet_synced,
            pod_cidrs: self.rivet.iter().map(|(n, v)| (n.clone(), v.cidrs.clone())).collect(),
            usage: self
                .config
                .families()
                .iter()
                .map(|f| (f.family, self.allocator.usage(f.family)))
                .collect(),
        }
    }

    fn node_event(&mut self, event: Event<Node>) {
        match event {
            Event::Init => self.nodes_listing = Some(HashSet::new()),
            Event::InitApply(node) => {
                self.nodes_listing.get_or_insert_default().insert(node.name_any());
            }
            Event::InitDone => {
                let listed = self.nodes_listing.take().unwrap_or_default();
                self.dirty.extend(listed.symmetric_difference(&self.nodes).cloned());
                if !self.nodes_synced {
                    self.dirty.extend(listed.iter().cloned());
                }
                self.nodes = listed;
                self.nodes_synced = true;
            }
            Event::Apply(node) => {
                let name = node.name_any();
                if self.nodes.insert(name.clone()) {
                    self.dirty.insert(name);
                }
            }
            Event::Delete(node) => {
                let name = node.name_any();
                self.nodes.remove(&name);
                self.dirty.insert(name);
            }
        }
    }

    fn rivet_event(&mut self, event: Event<RivetNode>, metrics: &PoolMetrics) {
        match event {
            Event::Init => self.rivet_listing = Some(BTreeMap::new()),
            Event::InitApply(node) => {
                self.rivet_listing
                    .get_or_insert_default()
                    .insert(node.name_any(), RivetView::new(&node));
            }
            Event::InitDone => {
                // A fresh list: rebuild the allocator from it.
                let listed = self.rivet_listing.take().unwrap_or_default();
                self.allocator = Allocator::new(&self.config);
                // The list may predate a write accepted since it was sent:
                // pending CIDRs stay until seen or their object is gone.
                self.pending
                    .retain(|name, p| listed.get(name).is_some_and(|v| v.uid == p.uid && !p.seen(v)));
                for (name, view) in &listed {
                    self.allocator.set_held(name, held(view, self.pending.get(name)));
                }
                for gone in self.rivet.keys().filter(|n| !listed.contains_key(*n)) {
                    // Deleted while the watch was down: released now.
                    let cidrs = &self.rivet[gone].cidrs;
                    metrics.released(gone, cidrs);
                }
                self.dirty.extend(self.rivet.keys().cloned());
                self.dirty.extend(listed.keys().cloned());
                self.rivet = listed;
                self.rivet_synced = true;
            }
            Event::Apply(node) => {
                let name = node.name_any();
                let view = RivetView::new(&node);
                if let Some(p) = self.pending.get_mut(&name)
                    && (p.uid != view.uid || p.seen(&view))
                {
                    self.pending.remove(&name);
                }
                let before = self.allocator.held(&name).to_vec();
                let now = held(&view, self.pending.get(&name));
                let freed: Vec<IpNet> = before.into_iter().filter(|c| !now.contains(c)).collect();
                self.allocator.set_held(&name, now);
                self.freed(&freed);
                self.rivet.insert(name.clone(), view);
                self.dirty.insert(name);
            }
            Event::Delete(node) => {
                let name = node.name_any();
                self.pending.remove(&name);
                self.rivet.remove(&name);
                self.waiting.remove(&name);
                self.conflicted.remove(&name);
                let freed = self.allocator.release(&name);
                metrics.released(&name, &freed);
                self.freed(&freed);
                self.dirty.insert(name);
            }
        }
    }

    /// The API server accepted `written` for `name`: taken until the watch
    /// shows them.
    fn accepted(&mut self, name: &str, written: &[IpNet]) {
        if let Some(p) = self.pending.get_mut(name) {
            let (accepted, still): (Vec<IpNet>, Vec<IpNet>) = p.unknown.drain(..).partition(|c| written.contains(c));
            p.unknown = still;
            p.written.extend(accepted);
        }
    }

    /// The write of `reserved` for `name` was never sent or was refused:
    /// those blocks are free again (older unanswered ones stay taken).
    fn unreserve(&mut self, name: &str, reserved: &[IpNet]) {
        if let Some(p) = self.pending.get_mut(name) {
            p.unknown.retain(|c| !reserved.contains(c));
            if p.written.is_empty() && p.unknown.is_empty() {
                self.pending.remove(name);
            }
        }
        let held = self.rivet.get(name).map(|v| held(v, self.pending.get(name)));
        self.allocator.set_held(name, held.unwrap_or_default());
    }

    /// `freed` is no longer held by its holder: nodes waiting for a block,
    /// and nodes that overlapped it, are planned again.
    fn freed(&mut self, freed: &[IpNet]) {
        if freed.is_empty() {
            return;
        }
        self.dirty.extend(self.waiting.iter().cloned());
        for net in freed {
            let holders: Vec<String> = self.allocator.holders_of(net).into_iter().map(String::from).collect();
            self.dirty.extend(holders);
        }
    }
}

/// What `view` holds plus what this term wrote to it and has not seen back.
fn held(view: &RivetView, pending: Option<&Pending>) -> Vec<IpNet> {
    let mut cidrs = view.cidrs.clone();
    for c in pending.iter().flat_map(|p| p.all()) {
        if !cidrs.contains(c) {
            cidrs.push(*c);
        }
    }
    cidrs
}

/// The writes one node needs, in order, each fenced on the
/// resourceVersion the previous one returned.
#[derive(Debug, Default)]
struct Plan {
    name: String,
    uid: String,
    resource_version: String,
    create: bool,
    mark_gone: bool,
    unmark_gone: bool,
    delete: bool,
    /// The full `spec.podCidrs` to apply (held + new), and the new ones.
    apply_cidrs: Option<(Vec<IpNet>, Vec<IpNet>)>,
    /// How far the write of `apply_cidrs` got.
    cidrs: CidrWrite,
    condition: Option<NodeCondition>,
}

/// How far a plan's pod CIDR write got: what its reserved blocks become.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum CidrWrite {
    /// Not sent (an earlier write of the plan failed): nothing written.
    #[default]
    NotSent,
    /// Sent without an accepting answer.
    Sent,
    /// Accepted by the API server.
    Written,
}

/// How one planned node's writes ended.
enum Outcome {
    Done,
    /// Lost a race (409/404): the next view plans it again.
    Stale,
    Failed(PoolError),
}

struct Pass {
    duty: ClusterPool,
    term: Term,
    shared: Arc<Shared>,
}

impl Pass {
    async fn run(&self) -> Result<Action, PoolError> {
        self.term.ensure()?;
        let (plans, next) = {
            let mut state = self.shared.lock();
            if !(state.nodes_synced && state.rivet_synced) {
                return Ok(Action::await_change());
            }
            self.plan(&mut state)
        };
        let outcomes: Vec<(String, Outcome)> = futures::stream::iter(plans)
            .map(|plan| async move {
                let name = plan.name.clone();
                (name, self.execute(plan).await)
            })
            .buffer_unordered(WRITE_CONCURRENCY)
            .collect()
            .await;
        let mut first_error = None;
        let mut stale = false;
        {
            let mut state = self.shared.lock();
            for (name, outcome) in outcomes {
                match outcome {
                    Outcome::Done => {}
                    Outcome::Stale => {
                        stale = true;
                        state.dirty.insert(name);
                    }
                    Outcome::Failed(e) => {
                        state.dirty.insert(name);
                        first_error.get_or_insert(e);
                    }
                }
            }
            for family in self.duty.config.families() {
                let (allocated, available) = state.allocator.usage(family.family);
                self.duty.metrics.usage(family.family, allocated, available);
            }
        }
        self.shared.changed.send_modify(|n| *n += 1);
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(Action::requeue(if stale { RETRY_STALE } else { next }))
    }

    /// Plans the dirty nodes (reserving new blocks in the allocator) and
    /// returns the plans and when to run again.
    fn plan(&self, state: &mut PoolState) -> (Vec<Plan>, Duration) {
        let now = Timestamp::now();
        let grace = self.duty.grace;
        if state.last_resync.is_none_or(|t| t.elapsed() >= RESYNC) {
            state.last_resync = Some(Instant::now());
            let all: Vec<String> = state.rivet.keys().chain(state.nodes.iter()).cloned().collect();
            state.dirty.extend(all);
        }
        // Nodes whose grace ran out, and when the next one does.
        let mut next = RESYNC;
        let mut expired = Vec::new();
        for (name, view) in &state.rivet {
            if let Some(Ok(at)) = &view.deleted_at {
                let left = grace_left(*at, now, grace);
                if left.is_zero() {
                    expired.push(name.clone());
                } else {
                    next = next.min(left);
                }
            }
        }
        state.dirty.extend(expired);
        let dirty = std::mem::take(&mut state.dirty);
        // Older nodes first: they get the lower blocks, and the newest
        // ones find the pool exhausted.
        let mut names: Vec<(Option<CreationKey>, String)> = dirty
            .into_iter()
            .map(|name| (state.rivet.get(&name).map(|v| v.created.clone()), name))
            .collect();
        names.sort();
        let mut plans = Vec::new();
        for (_, name) in names {
            if let Some(plan) = self.plan_node(state, &name, now, grace, &mut next) {
                plans.push(plan);
            }
        }
        (plans, next)
    }

    fn plan_node(
        &self,
        state: &mut PoolState,
        name: &str,
        now: Timestamp,
        grace: Duration,
        next: &mut Duration,
    ) -> Option<Plan> {
        let node_exists = state.nodes.contains(name);
        let Some(view) = state.rivet.get(name).cloned() else {
            return node_exists.then(|| Plan {
                name: name.to_string(),
                create: true,
                ..Plan::default()
            });
        };
        let mut plan = Plan {
            name: name.to_string(),
            uid: view.uid.clone(),
            resource_version: view.resource_version.clone(),
            ..Plan::default()
        };
        if view.deleting {
            return None;
        }
        if !node_exists {
            state.waiting.remove(name);
            match &view.deleted_at {
                Some(Ok(at)) if grace_left(*at, now, grace).is_zero() => plan.delete = true,
                Some(Ok(at)) => *next = (*next).min(grace_left(*at, now, grace)),
                // Missing or unreadable: the grace starts now.
                _ => plan.mark_gone = true,
            }
            return Some(plan);
        }
        plan.unmark_gone = view.deleted_at.is_some();
        if self.duty.config.families().is_empty() {
            return plan.unmark_gone.then_some(plan);
        }
        let metrics = &self.duty.metrics;
        // Respected, never moved: a conflict is reported, not rewritten.
        let conflict = state
            .allocator
            .overlaps(name)
            .into_iter()
            .find(|(other, _, _)| state.rivet.get(other).is_some_and(|o| o.created < view.created));
        let mut new = Vec::new();
        let mut exhausted: Option<Exhausted> = None;
        if view.node_managed.is_none() {
            for family in state.allocator.missing(name) {
                match state.allocator.allocate(name, family) {
                    Ok(block) => new.push(block),
                    Err(e) => {
                        exhausted.get_or_insert(e);
                    }
                }
            }
        }
        let unanswered = state.pending.get(name).is_some_and(|p| !p.unknown.is_empty());
        if !new.is_empty() || unanswered {
            // Taken from now on, also while the write is in flight.
            let pending = state.pending.entry(name.to_string()).or_insert_with(|| Pending {
                uid: view.uid.clone(),
                ..Pending::default()
            });
            pending.unknown.extend(&new);
            plan.apply_cidrs = Some((held(&view, Some(pending)), new.clone()));
        }
        let cidrs_text = |cidrs: &[IpNet]| cidrs.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        let (status, reason, message) = if let Some((other, mine, theirs)) = &conflict {
            let message = format!(
                "pod CIDR {mine} overlaps {theirs} of RivetNode {other}, which is older; the operator does not rewrite either: change one by hand"
            );
            if state.conflicted.insert(name.to_string()) {
                metrics.conflict(name, &message);
            }
            ("False", REASON_CONFLICT, message)
        } else if let Some(e) = &exhausted {
            if state.waiting.insert(name.to_string()) {
                metrics.exhausted(name, e.family, &e.to_string());
            }
            (
                "False",
                REASON_EXHAUSTED,
                format!("{e}; the node gets one when a node's CIDRs are released"),
            )
        } else if let Some(manager) = &view.node_managed {
            let missing = state.allocator.missing(name);
            let message = format!(
                "spec.podCidrs is owned by field manager {manager} (the node's own pool): the operator allocates nothing for this node"
            );
            let status = if missing.is_empty() { "True" } else { "False" };
            (status, REASON_NODE_MANAGED, message)
        } else {
            let all = held(&view, state.pending.get(name));
            ("True", REASON_ALLOCATED, format!("pod CIDRs {}", cidrs_text(&all)))
        };
        if conflict.is_none() {
            state.conflicted.remove(name);
        }
        if exhausted.is_none() {
            state.waiting.remove(name);
        }
        let current = view.condition.as_ref();
        let unchanged = current.is_some_and(|c| {
            c.status == status && c.reason.as_deref() == Some(reason) && c.message.as_deref() == Some(&message)
        });
        if !unchanged {
            let transition = match current {
                Some(c) if c.status == status => c.last_transition_time.clone(),
                _ => Some(now.to_string()),
            };
            plan.condition = Some(NodeCondition {
                type_: CONDITION_POD_CIDRS_ALLOCATED.into(),
                status: status.into(),
                reason: Some(reason.into()),
                message: Some(message),
                last_transition_time: transition,
                last_heartbeat_time: None,
            });
        }
        let writes = plan.unmark_gone || plan.apply_cidrs.is_some() || plan.condition.is_some();
        writes.then_some(plan)
    }

    /// Runs one node's writes in order; each checks the term first.
    async fn execute(&self, mut plan: Plan) -> Outcome {
        let result = self.write(&mut plan).await;
        if let Some((all, new)) = &plan.apply_cidrs {
            let mut state = self.shared.lock();
            let refused = result.as_ref().is_err_and(PoolError::refused);
            match plan.cidrs {
                CidrWrite::Written => state.accepted(&plan.name, all),
                CidrWrite::NotSent => state.unreserve(&plan.name, new),
                CidrWrite::Sent if refused => state.unreserve(&plan.name, new),
                // No answer: it may have been written; applied again next time.
                CidrWrite::Sent => {}
            }
        }
        let Err(e) = result else {
            return Outcome::Done;
        };
        let verb = match &e {
            PoolError::Api { verb, .. } => *verb,
            PoolError::NotLeading(_) => "write",
        };
        self.duty.metrics.api_failed(verb, e.kind_label(), &e.to_string());
        match e.status_code() {
            Some(404 | 409) => Outcome::Stale,
            _ => Outcome::Failed(e),
        }
    }

    async fn write(&self, plan: &mut Plan) -> Result<(), PoolError> {
        let client = &self.duty.client;
        let api: Api<RivetNode> = Api::all(client.clone());
        let name = plan.name.clone();
        let metrics = &self.duty.metrics;
        if plan.create {
            let resource = ApiResource::erase::<RivetNode>(&());
            let dynamic: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
            let mut object = DynamicObject::new(&name, &resource);
            // An empty spec: the operator owns no field of it until it
            // applies pod CIDRs.
            object.data = json!({ "spec": {} });
            let params = PostParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PostParams::default()
            };
            self.term.ensure()?;
            match dynamic.create(&params, &object).await {
                Ok(_) => metrics.created(&name),
                // svc-k8s-sync (or a previous term) created it first.
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => return Err(PoolError::api("create", &name, e)),
            }
            return Ok(());
        }
        if plan.delete {
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    resource_version: Some(plan.resource_version.clone()),
                    uid: Some(plan.uid.clone()),
                }),
                ..DeleteParams::default()
            };
            self.term.ensure()?;
            api.delete(&name, &params)
                .await
                .map_err(|e| PoolError::api("delete", &name, e))?;
            metrics.deleted(&name);
            return Ok(());
        }
        if plan.mark_gone || plan.unmark_gone {
            let value = plan.mark_gone.then(|| Timestamp::now().to_string());
            let patch = json!({
                "metadata": {
                    "resourceVersion": plan.resource_version,
                    "annotations": { NODE_DELETED_AT_ANNOTATION: value },
                }
            });
            let params = PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PatchParams::default()
            };
            self.term.ensure()?;
            let updated = api
                .patch(&name, &params, &Patch::Merge(patch))
                .await
                .map_err(|e| PoolError::api("annotate", &name, e))?;
            plan.resource_version = updated.resource_version().unwrap_or_default();
            if plan.mark_gone {
                metrics.node_gone(&name, self.duty.grace.as_secs());
            } else {
                metrics.node_back(&name);
            }
        }
        if let Some((all, new)) = &plan.apply_cidrs {
            let object = json!({
                "apiVersion": RivetNode::api_version(&()), "kind": RivetNode::kind(&()),
                "metadata": { "name": name, "resourceVersion": plan.resource_version },
                "spec": { "podCidrs": all.iter().map(ToString::to_string).collect::<Vec<_>>() },
            });
            // Force: the operator is the only applier of a cluster-pool
            // node's podCidrs (planned only when no other manager owns them).
            let params = PatchParams::apply(FIELD_MANAGER).force();
            self.term.ensure()?;
            plan.cidrs = CidrWrite::Sent;
            api.patch(&name, &params, &Patch::Apply(object))
                .await
                .map_err(|e| PoolError::api("apply", &name, e))?;
            plan.cidrs = CidrWrite::Written;
            for cidr in new {
                metrics.allocated(&name, cidr);
            }
        }
        if let Some(condition) = &plan.condition {
            let status = json!({
                "apiVersion": RivetNode::api_version(&()), "kind": RivetNode::kind(&()),
                "metadata": { "name": name },
                "status": { "conditions": [condition] },
            });
            let params = PatchParams::apply(FIELD_MANAGER).force();
            self.term.ensure()?;
            api.patch_status(&name, &params, &Patch::Apply(status))
                .await
                .map_err(|e| PoolError::api("apply-status", &name, e))?;
        }
        Ok(())
    }
}

/// How much of the grace that started at `at` is left at `now`.
fn grace_left(at: Timestamp, now: Timestamp, grace: Duration) -> Duration {
    let elapsed = now.duration_since(at);
    let elapsed = Duration::try_from(elapsed).unwrap_or(Duration::ZERO);
    grace.saturating_sub(elapsed)
}
