//! The endpoint manager: endpoints and their state machine, one
//! regeneration queue per endpoint, the policy repository and selector cache,
//! namespace labels, and the replay of desired state when a dependency
//! restarts (DESIGN.md §1, §5).
//!
//! Concurrency: all bookkeeping lives behind one `std` mutex that is never
//! held across an await. Each endpoint has a worker task; a regeneration
//! request bumps the endpoint's requested generation and wakes the worker,
//! which regenerates once for every request made so far (coalescing) while
//! holding the endpoint's regeneration lock (serialising) and one permit of
//! a node-wide semaphore (bounding parallelism).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use ipnet::IpNet;
use rivet_common::backoff::Backoff;
use rivet_common::labels::{Label, LabelSource, Labels};
use rivet_common::state_file::StateFile;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::loader::v1 as ldpb;
use tokio::sync::{Notify, Semaphore, watch};
use tonic::{Code, Status};
use tracing::Instrument;

use crate::clients::{IdentityApi, IpamApi, LoaderApi};
use crate::endpoint::{
    EndpointSpec, EndpointState, EndpointStatus, IDENTITY_OWNER_PREFIX, MAX_ENDPOINT_ID, RegenerationFailure,
    RegenerationStep, identity_owner,
};
use crate::events::{self, EndpointMetrics};
use crate::policy::{
    Policy, PolicyChange, PolicyError, PolicyKey, PolicyOrigin, PolicyRepository, ResolvedPolicy, SelectorCache,
    StoredPolicy, Subject,
};
use crate::state_dir::{EndpointRecord, EndpointStateDir};

/// The namespace of endpoints created without one.
pub const DEFAULT_NAMESPACE: &str = "default";

/// The namespace label Kubernetes sets on every namespace; added here too so
/// `namespaceSelector` can name a namespace.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// How long restore waits for the identity snapshot and CIDR identities.
const RESTORE_INPUTS_WAIT: Duration = Duration::from_secs(30);

/// Owner of the CIDR identities allocated for policies.
const CIDR_OWNER: &str = "svc-endpoint/policy";

/// The daemons svc-endpoint drives.
#[derive(Clone)]
pub struct Dependencies {
    /// svc-identity.
    pub identity: Arc<dyn IdentityApi>,
    /// svc-ipam.
    pub ipam: Arc<dyn IpamApi>,
    /// svc-loader.
    pub loader: Arc<dyn LoaderApi>,
}

/// How the manager behaves.
#[derive(Debug, Clone)]
pub struct ManagerOptions {
    /// `<state-dir>`: endpoints go to `endpoints/`, API policies and
    /// namespace labels to files beside it.
    pub state_dir: std::path::PathBuf,
    /// Regenerations running at once on the node.
    pub regeneration_concurrency: usize,
    /// Traffic from the node (host identity) to its pods passes whatever
    /// the policy (kubelet probes).
    pub allow_from_host: bool,
    /// How often the dependencies' boot ids are checked.
    pub dependency_poll: Duration,
    /// Delay between retries of a failed background regeneration.
    pub retry_backoff: Backoff,
}

impl ManagerOptions {
    /// Defaults with the given state dir.
    pub fn new(state_dir: impl Into<std::path::PathBuf>) -> Self {
        Self {
            state_dir: state_dir.into(),
            regeneration_concurrency: 16,
            allow_from_host: true,
            dependency_poll: Duration::from_secs(2),
            retry_backoff: Backoff::new(Duration::from_millis(500), Duration::from_secs(30)),
        }
    }
}

/// A failed regeneration: the step and the dependency's status.
#[derive(Debug, Clone, thiserror::Error)]
#[error("step {}: {}", step.as_str(), status.message())]
pub struct RegenError {
    /// Where it failed.
    pub step: RegenerationStep,
    /// What the dependency (or the local step) said.
    pub status: Status,
}

impl RegenError {
    fn new(step: RegenerationStep, status: Status) -> Self {
        Self { step, status }
    }
}

/// The parameters of a new endpoint (validated by the caller).
#[derive(Debug, Clone)]
pub struct NewEndpoint {
    /// Everything but the id and creation time.
    pub spec: EndpointSpec,
    /// Wait for the first regeneration (and undo everything if it fails).
    pub sync: bool,
}

/// Which endpoints a call is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointSelector {
    /// By id.
    Id(u16),
    /// By container id and interface.
    Container {
        /// Sandbox id.
        container_id: String,
        /// Interface in the container.
        interface: String,
    },
    /// Every endpoint of a pod.
    Pod {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// By one of its addresses.
    Address(IpAddr),
}

/// A snapshot of one endpoint.
#[derive(Debug, Clone)]
pub struct EndpointView {
    /// What it was created with.
    pub spec: EndpointSpec,
    /// Its state now.
    pub status: EndpointStatus,
}

/// Restore progress.
#[derive(Debug, Clone, Default)]
pub struct RestoreProgress {
    /// Whether restore finished.
    pub complete: bool,
    /// State dirs found.
    pub found: u32,
    /// Regenerated and ready.
    pub restored: u32,
    /// Dropped (interface gone) and cleaned up.
    pub dropped: u32,
    /// Failed (kept, retried in the background).
    pub failed: u32,
    /// Start.
    pub started: Option<SystemTime>,
    /// End.
    pub finished: Option<SystemTime>,
}

/// svc-endpoint's view of a dependency.
#[derive(Debug, Clone, Default)]
pub struct DependencyStatus {
    /// "svc-identity", ...
    pub name: &'static str,
    /// Answered the last probe.
    pub connected: bool,
    /// Its boot id as last seen.
    pub seen_boot_id: String,
    /// Last replay of desired state after a new boot id.
    pub last_resync: Option<SystemTime>,
    /// Last probe or replay error.
    pub last_error: String,
}

/// A namespace with labels.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NamespaceLabels {
    /// Label key → value (no source).
    pub labels: BTreeMap<String, String>,
    /// Last change.
    pub updated: Option<SystemTime>,
}

/// The outcome of a policy change.
#[derive(Debug, Clone)]
pub struct PolicyUpdate {
    /// What changed.
    pub change: PolicyChange,
    /// Endpoints whose policy the change affects.
    pub affected: usize,
    /// With `wait`: endpoints that realised the change.
    pub realised: usize,
}

/// Why a manager call failed.
#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    /// A field is invalid.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field.
        field: String,
        /// Why.
        reason: String,
    },
    /// Nothing matches the reference.
    #[error("{0}")]
    NotFound(String),
    /// An address belongs to another endpoint.
    #[error("address {address} is owned by endpoint {owner}")]
    AddressInUse {
        /// The address.
        address: IpAddr,
        /// The endpoint holding it.
        owner: u16,
    },
    /// The state does not allow the call.
    #[error("{0}")]
    Precondition(String),
    /// Every endpoint id is taken.
    #[error("no free endpoint id (1..={MAX_ENDPOINT_ID} all in use)")]
    NoFreeId,
    /// A regeneration failed; for a synchronous create everything was undone.
    #[error("endpoint {id}: regeneration failed at {}: {}{}", source.step.as_str(), source.status.message(), if *undone { " (undone)" } else { "" })]
    Regeneration {
        /// The endpoint.
        id: u16,
        /// Whether everything done for it was removed.
        undone: bool,
        /// The failure.
        source: RegenError,
    },
    /// The deadline passed before the regeneration completed.
    #[error("endpoint {id}: regeneration did not complete within the deadline{}", if *undone { " (undone)" } else { "; it continues" })]
    Deadline {
        /// The endpoint.
        id: u16,
        /// Whether the endpoint is being undone.
        undone: bool,
    },
    /// Removing an endpoint failed; it stays `disconnecting` and the call
    /// can be retried.
    #[error("endpoint {id}: removal failed at {step}: {status}")]
    Removal {
        /// The endpoint.
        id: u16,
        /// What was being removed.
        step: &'static str,
        /// Why.
        status: Status,
    },
    /// A policy was rejected.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A local file could not be written.
    #[error("{0}")]
    Storage(String),
    /// A dependency is not ready; retrying later can succeed.
    #[error("{0}")]
    Unavailable(String),
}

impl From<ManagerError> for Status {
    fn from(e: ManagerError) -> Self {
        let message = e.to_string();
        match &e {
            ManagerError::Invalid { .. } => Status::invalid_argument(message),
            ManagerError::NotFound(_) => Status::not_found(message),
            ManagerError::AddressInUse { .. } => Status::already_exists(message),
            ManagerError::Precondition(_) => Status::failed_precondition(message),
            ManagerError::NoFreeId => Status::resource_exhausted(message),
            ManagerError::Regeneration { source, .. } => match source.status.code() {
                // Keep the dependency's code when it means something to the caller.
                code @ (Code::Unavailable
                | Code::DeadlineExceeded
                | Code::ResourceExhausted
                | Code::NotFound
                | Code::AlreadyExists
                | Code::FailedPrecondition
                | Code::PermissionDenied
                | Code::InvalidArgument) => Status::new(code, message),
                _ => Status::internal(message),
            },
            ManagerError::Deadline { .. } => Status::deadline_exceeded(message),
            ManagerError::Removal { .. } => Status::unavailable(message),
            ManagerError::Policy(PolicyError::OriginConflict { .. }) => Status::failed_precondition(message),
            ManagerError::Policy(_) => Status::invalid_argument(message),
            ManagerError::Storage(_) => Status::internal(message),
            ManagerError::Unavailable(_) => Status::unavailable(message),
        }
    }
}

/// Per-endpoint regeneration bookkeeping, shared with its worker.
#[derive(Debug)]
struct Queue {
    /// Held for the whole of a regeneration or a removal.
    lock: tokio::sync::Mutex<()>,
    /// requested / realised generations and the last failure.
    outcome: watch::Sender<Outcome>,
    wake: Notify,
    /// Set when the endpoint is being removed: the worker exits.
    closed: AtomicBool,
    /// Retry failed regenerations in the background (false for a
    /// synchronous create until its first regeneration succeeded).
    retry: AtomicBool,
}

#[derive(Debug, Clone)]
struct Outcome {
    requested: u64,
    realised: u64,
    /// The generation a failed attempt was for, and why.
    failed: Option<(u64, RegenError)>,
    reason: String,
    /// The span of the latest request: the regeneration is its child, so a
    /// pod creation is one trace across the daemons.
    requester: tracing::Span,
}

impl Queue {
    fn new(retry: bool) -> Arc<Self> {
        Arc::new(Self {
            lock: tokio::sync::Mutex::new(()),
            outcome: watch::channel(Outcome {
                requested: 0,
                realised: 0,
                failed: None,
                reason: String::new(),
                requester: tracing::Span::none(),
            })
            .0,
            wake: Notify::new(),
            closed: AtomicBool::new(false),
            retry: AtomicBool::new(retry),
        })
    }

    /// Requests a regeneration; returns the generation to wait for.
    fn request(&self, reason: &str) -> u64 {
        let mut generation = 0;
        self.outcome.send_modify(|o| {
            o.requested += 1;
            o.reason = reason.to_string();
            o.requester = tracing::Span::current();
            generation = o.requested;
        });
        self.wake.notify_one();
        generation
    }

    /// Waits until `generation` is realised, an attempt covering it failed,
    /// or the endpoint is being removed (ABORTED: its worker exits without
    /// regenerating again, so nothing else would end the wait).
    async fn wait(&self, generation: u64) -> Result<(), RegenError> {
        let removed = || RegenError::new(RegenerationStep::Identity, Status::aborted("endpoint removed"));
        let mut rx = self.outcome.subscribe();
        let outcome = rx
            .wait_for(|o| {
                o.realised >= generation
                    || o.failed.as_ref().is_some_and(|(g, _)| *g >= generation)
                    || self.closed.load(Ordering::SeqCst)
            })
            .await
            .map_err(|_| removed())?
            .clone();
        if outcome.realised >= generation {
            return Ok(());
        }
        match outcome.failed {
            Some((g, e)) if g >= generation => Err(e),
            _ => Err(removed()),
        }
    }

    /// Marks the endpoint as being removed: its worker exits and every
    /// waiter returns (a removal can overtake a request the worker has not
    /// taken yet, e.g. one made by restore).
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.wake.notify_one();
        // Wakes the waiters; they see `closed`.
        self.outcome.send_modify(|_| {});
    }
}

#[derive(Debug)]
struct Slot {
    spec: EndpointSpec,
    status: EndpointStatus,
    queue: Arc<Queue>,
    /// What the state dir holds (to skip identical rewrites).
    persisted: Option<EndpointRecord>,
}

#[derive(Debug, Default)]
struct State {
    endpoints: BTreeMap<u16, Slot>,
    /// Ids held by leftovers (unreadable state dirs, datapath entries not yet
    /// cleaned): never handed out.
    reserved_ids: BTreeSet<u16>,
    next_id: u16,
    namespaces: BTreeMap<String, NamespaceLabels>,
    /// Labels remembered for pods without an endpoint yet.
    pod_labels: BTreeMap<(String, String), Labels>,
    repository: PolicyRepository,
    selectors: SelectorCache,
    cidr_identities: BTreeMap<IpNet, u32>,
}

impl State {
    fn allocate_id(&mut self) -> Option<u16> {
        let start = self.next_id.max(1);
        let mut id = start;
        loop {
            if !self.endpoints.contains_key(&id) && !self.reserved_ids.contains(&id) {
                self.next_id = if id == MAX_ENDPOINT_ID { 1 } else { id + 1 };
                return Some(id);
            }
            id = if id == MAX_ENDPOINT_ID { 1 } else { id + 1 };
            if id == start {
                return None;
            }
        }
    }

    fn find(&self, selector: &EndpointSelector) -> Vec<u16> {
        self.endpoints
            .iter()
            .filter(|(_, slot)| match selector {
                EndpointSelector::Id(id) => slot.spec.id == *id,
                EndpointSelector::Container {
                    container_id,
                    interface,
                } => {
                    slot.spec.container_id == *container_id
                        && (interface.is_empty() || slot.spec.interface == *interface)
                }
                EndpointSelector::Pod { namespace, name } => slot.spec.is_pod(namespace, name),
                EndpointSelector::Address(address) => slot.spec.has_address(*address),
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// The full label set an endpoint's identity is allocated for.
    fn identity_request_labels(&self, spec: &EndpointSpec) -> Result<Labels, Status> {
        let namespace = self.namespaces.get(&spec.pod_namespace);
        let mut ns_labels: BTreeMap<&str, &str> = namespace
            .map(|n| n.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect())
            .unwrap_or_default();
        ns_labels.insert(NAMESPACE_NAME_LABEL, &spec.pod_namespace);
        spec.labels
            .with_namespace(&spec.pod_namespace, ns_labels)
            .map_err(|e| Status::invalid_argument(format!("labels of namespace {}: {e}", spec.pod_namespace)))
    }

    fn resolve(&self, identity_labels: &Labels, spec: &EndpointSpec) -> ResolvedPolicy {
        self.repository.resolve(
            &Subject {
                labels: identity_labels,
                named_ports: &spec.named_ports,
            },
            &self.selectors,
        )
    }

    fn counts(&self) -> Vec<(EndpointState, usize)> {
        let mut counts = BTreeMap::<EndpointState, usize>::new();
        for slot in self.endpoints.values() {
            *counts.entry(slot.status.state).or_default() += 1;
        }
        counts.into_iter().collect()
    }
}

struct Inner {
    options: ManagerOptions,
    deps: Dependencies,
    state_dir: EndpointStateDir,
    api_policies: StateFile<Vec<String>>,
    namespaces_file: StateFile<BTreeMap<String, NamespaceLabels>>,
    state: Mutex<State>,
    permits: Semaphore,
    metrics: EndpointMetrics,
    restore: Mutex<RestoreProgress>,
    /// Set once restore put the endpoints of the state dir in the table;
    /// deletes wait for it (one before would find nothing and the endpoint
    /// would come back from disk).
    scanned: watch::Sender<bool>,
    /// Set once restore knows which ids are taken; creates wait for it.
    ids_known: watch::Sender<bool>,
    restore_done: watch::Sender<bool>,
    /// Set once the selector cache holds svc-identity's first complete
    /// snapshot: resolving policy before that would leave out peers.
    identities_synced: watch::Sender<bool>,
    dependencies: Mutex<[DependencyStatus; 3]>,
    /// Wakes the CIDR identity reconciliation.
    cidr_wake: Notify,
    /// Serialises changes of persisted configuration: policies (repository
    /// + API policies file) and namespace labels.
    config_lock: tokio::sync::Mutex<()>,
}

/// The endpoint manager. Cheap to clone.
#[derive(Clone)]
pub struct EndpointManager {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EndpointManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointManager")
            .field("state_dir", &self.inner.options.state_dir)
            .finish_non_exhaustive()
    }
}

const IDENTITY: usize = 0;
const IPAM: usize = 1;
const LOADER: usize = 2;

impl EndpointManager {
    /// A manager over `deps`. Loads the persisted API policies and namespace
    /// labels; call [`start`](Self::start) to restore endpoints and run the
    /// background tasks.
    pub fn new(options: ManagerOptions, deps: Dependencies, metrics: EndpointMetrics) -> Result<Self, ManagerError> {
        let state_dir = EndpointStateDir::new(options.state_dir.join("endpoints"));
        let api_policies = StateFile::new(options.state_dir.join("policies.json"), "rivet.endpoint.policies", 1);
        let namespaces_file = StateFile::new(
            options.state_dir.join("namespaces.json"),
            "rivet.endpoint.namespaces",
            1,
        );
        let mut state = State {
            next_id: 1,
            ..State::default()
        };
        state.namespaces = namespaces_file
            .load()
            .map_err(|e| ManagerError::Storage(format!("loading namespace labels: {e}")))?
            .unwrap_or_default();
        let documents: Vec<String> = api_policies
            .load()
            .map_err(|e| ManagerError::Storage(format!("loading API policies: {e}")))?
            .unwrap_or_default();
        for document in documents {
            match Policy::parse(&document) {
                Ok(policy) => {
                    state.repository.upsert(policy, PolicyOrigin::Api)?;
                }
                Err(e) => tracing::error!(error = %e, "a persisted API policy no longer parses; dropped"),
            }
        }
        let concurrency = options.regeneration_concurrency.max(1);
        let inner = Inner {
            options,
            deps,
            state_dir,
            api_policies,
            namespaces_file,
            state: Mutex::new(state),
            permits: Semaphore::new(concurrency),
            metrics,
            restore: Mutex::new(RestoreProgress::default()),
            scanned: watch::channel(false).0,
            ids_known: watch::channel(false).0,
            restore_done: watch::channel(false).0,
            identities_synced: watch::channel(false).0,
            dependencies: Mutex::new([
                DependencyStatus {
                    name: "svc-identity",
                    ..Default::default()
                },
                DependencyStatus {
                    name: "svc-ipam",
                    ..Default::default()
                },
                DependencyStatus {
                    name: "svc-loader",
                    ..Default::default()
                },
            ]),
            cidr_wake: Notify::new(),
            config_lock: tokio::sync::Mutex::new(()),
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().expect("endpoint state lock poisoned")
    }

    /// Restores endpoints from the state dir and starts the background
    /// tasks (identity watch, dependency probes, CIDR identities). Returns
    /// at once; restore progress is in [`restore_progress`](Self::restore_progress).
    pub fn start(&self) {
        let this = self.clone();
        tokio::spawn(async move { this.restore().await });
        let this = self.clone();
        tokio::spawn(async move { this.watch_identities().await });
        let this = self.clone();
        tokio::spawn(async move { this.probe_dependencies().await });
        let this = self.clone();
        tokio::spawn(async move { this.reconcile_cidrs_forever().await });
        self.inner.cidr_wake.notify_one();
    }

    /// The metrics.
    pub fn metrics(&self) -> &EndpointMetrics {
        &self.inner.metrics
    }

    // ------------------------------------------------------------ create --

    /// Creates an endpoint. With `sync` it returns once the first
    /// regeneration completed, and undoes everything if it fails or
    /// `deadline` passes. Returns the endpoint and whether it was created
    /// (false for an idempotent repeat).
    pub async fn create(&self, new: NewEndpoint, deadline: Duration) -> Result<(EndpointView, bool), ManagerError> {
        let started = Instant::now();
        // Ids held by the datapath or old state dirs are known only once
        // restore has read them.
        let mut known = self.inner.ids_known.subscribe();
        if tokio::time::timeout(deadline, known.wait_for(|k| *k)).await.is_err() {
            return Err(ManagerError::Unavailable(
                "svc-endpoint is still restoring (svc-loader not reachable yet); retry".into(),
            ));
        }
        let mut synced = self.inner.identities_synced.subscribe();
        let remaining = deadline.saturating_sub(started.elapsed());
        if tokio::time::timeout(remaining, synced.wait_for(|s| *s)).await.is_err() {
            return Err(ManagerError::Unavailable(
                "svc-identity has not delivered its identities yet (is it running?); retry".into(),
            ));
        }
        let mut spec = new.spec;
        let (id, queue, generation, created) = {
            let mut state = self.state();
            if let Some(existing) = state
                .endpoints
                .values()
                .find(|s| s.spec.container_id == spec.container_id && s.spec.interface == spec.interface)
            {
                if !existing.spec.same_request(&spec) {
                    return Err(ManagerError::Precondition(format!(
                        "container {} interface {} is endpoint {} with different parameters; delete it first",
                        spec.container_id, spec.interface, existing.spec.id
                    )));
                }
                if existing.status.state == EndpointState::Disconnecting {
                    return Err(ManagerError::Precondition(format!(
                        "endpoint {} of container {} is being deleted; retry",
                        existing.spec.id, spec.container_id
                    )));
                }
                let outcome = existing.queue.outcome.borrow().clone();
                (
                    existing.spec.id,
                    existing.queue.clone(),
                    outcome.requested.max(1),
                    false,
                )
            } else {
                for address in &spec.addresses {
                    if let Some(owner) = state.endpoints.values().find(|s| s.spec.has_address(address.address)) {
                        return Err(ManagerError::AddressInUse {
                            address: address.address,
                            owner: owner.spec.id,
                        });
                    }
                }
                let id = state.allocate_id().ok_or(ManagerError::NoFreeId)?;
                spec.id = id;
                spec.created = SystemTime::now();
                if !spec.pod_name.is_empty()
                    && let Some(remembered) = state
                        .pod_labels
                        .get(&(spec.pod_namespace.clone(), spec.pod_name.clone()))
                        .cloned()
                {
                    for label in remembered.iter() {
                        if spec.labels.get_from(label.source(), label.key()).is_none() {
                            let _ = spec.labels.insert(label.clone());
                        }
                    }
                }
                let pod = if spec.pod_name.is_empty() {
                    String::new()
                } else {
                    format!("{}/{}", spec.pod_namespace, spec.pod_name)
                };
                events::endpoint_created(id, &spec.container_id, &spec.interface, &pod);
                let queue = Queue::new(!new.sync);
                state.endpoints.insert(
                    id,
                    Slot {
                        spec,
                        status: EndpointStatus::new(EndpointState::WaitingForIdentity, "created"),
                        queue: queue.clone(),
                        persisted: None,
                    },
                );
                self.spawn_worker(id, queue.clone());
                let generation = queue.request("created");
                self.update_state_metrics(&state);
                (id, queue, generation, true)
            }
        };
        if !new.sync {
            return Ok((self.view(id)?, created));
        }
        let remaining = deadline.saturating_sub(started.elapsed());
        match tokio::time::timeout(remaining, queue.wait(generation)).await {
            Ok(Ok(())) => {
                queue.retry.store(true, Ordering::SeqCst);
                Ok((self.view(id)?, created))
            }
            Ok(Err(source)) if created => {
                let undone = self.undo_failed_create(id, &source).await;
                Err(ManagerError::Regeneration { id, undone, source })
            }
            Ok(Err(source)) => Err(ManagerError::Regeneration {
                id,
                undone: false,
                source,
            }),
            Err(_) if created => {
                // Undo once the running regeneration has finished (the
                // removal takes the endpoint's regeneration lock).
                let this = self.clone();
                tokio::spawn(async move {
                    let failure =
                        RegenError::new(RegenerationStep::Identity, Status::deadline_exceeded("create deadline"));
                    this.undo_failed_create(id, &failure).await;
                });
                Err(ManagerError::Deadline { id, undone: true })
            }
            Err(_) => Err(ManagerError::Deadline { id, undone: false }),
        }
    }

    async fn undo_failed_create(&self, id: u16, failure: &RegenError) -> bool {
        match self.remove_endpoint(id, "create failed").await {
            Ok(()) => {
                events::endpoint_dropped(&self.inner.metrics, id, "create_failed", &failure.to_string());
                true
            }
            Err(e) => {
                tracing::error!(endpoint = id, error = %e, "undoing a failed create failed; the endpoint stays disconnecting");
                // Retry in the background until it is gone.
                let this = self.clone();
                tokio::spawn(async move {
                    let mut backoff = this.inner.options.retry_backoff.clone();
                    while let Err(e) = this.remove_endpoint(id, "create failed (retry)").await {
                        tracing::warn!(endpoint = id, error = %e, "retrying removal");
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                });
                false
            }
        }
    }

    // ------------------------------------------------------------ delete --

    /// Removes the selected endpoints (datapath, identity reference, ipcache
    /// entries, state dir). Does not release addresses. Returns the ids
    /// removed; an empty list when nothing matched.
    pub async fn delete(&self, selector: &EndpointSelector) -> Result<Vec<u16>, ManagerError> {
        // Only the local state dir scan: never waits for another daemon.
        let _ = self.inner.scanned.subscribe().wait_for(|s| *s).await;
        let ids = {
            let mut state = self.state();
            if let EndpointSelector::Pod { namespace, name } = selector {
                state.pod_labels.remove(&(namespace.clone(), name.clone()));
            }
            state.find(selector)
        };
        let mut deleted = Vec::new();
        for id in ids {
            self.remove_endpoint(id, "deleted").await?;
            events::endpoint_deleted(id, "DeleteEndpoint");
            deleted.push(id);
        }
        Ok(deleted)
    }

    /// Takes an endpoint out of everything and forgets it. On failure it
    /// stays `disconnecting` (no worker) and the call can be repeated.
    async fn remove_endpoint(&self, id: u16, reason: &str) -> Result<(), ManagerError> {
        let (queue, spec) = {
            let mut state = self.state();
            let Some(slot) = state.endpoints.get_mut(&id) else {
                return Ok(());
            };
            slot.status.transition(id, EndpointState::Disconnecting, reason);
            slot.queue.close();
            (slot.queue.clone(), slot.spec.clone())
        };
        let _serialised = queue.lock.lock().await;
        self.release_everything(&spec).await.map_err(|(step, status)| {
            let mut state = self.state();
            if let Some(slot) = state.endpoints.get_mut(&id) {
                slot.status.last_error = Some(RegenerationFailure {
                    step: RegenerationStep::Datapath,
                    message: format!("removal failed at {step}: {}", status.message()),
                    at: SystemTime::now(),
                });
            }
            ManagerError::Removal { id, step, status }
        })?;
        let mut state = self.state();
        if let Some(mut slot) = state.endpoints.remove(&id) {
            slot.status.transition(id, EndpointState::Disconnected, reason);
        }
        self.update_state_metrics(&state);
        Ok(())
    }

    /// Datapath entry and attachments, ipcache entries, identity references,
    /// state dir. Each step tolerates "already gone".
    async fn release_everything(&self, spec: &EndpointSpec) -> Result<(), (&'static str, Status)> {
        let deps = &self.inner.deps;
        deps.loader
            .remove(ldpb::RemoveEndpointRequest {
                endpoint_id: u32::from(spec.id),
                host_ifindex: spec.host_ifindex,
            })
            .await
            .or_else(ignore_not_found)
            .map_err(|s| ("datapath", s))?;
        if !spec.addresses.is_empty() {
            deps.identity
                .delete_ip(idpb::DeleteIpRequest {
                    prefixes: spec.addresses.iter().map(|a| a.address.to_string()).collect(),
                    source: idpb::IpcacheSource::LocalEndpoint.into(),
                })
                .await
                .map_err(|s| ("ipcache", s))?;
        }
        deps.identity
            .release(idpb::ReleaseIdentityRequest {
                id: 0,
                owner: spec.identity_owner(),
            })
            .await
            .map_err(|s| ("identity", s))?;
        let state_dir = self.inner.state_dir.clone();
        let id = spec.id;
        tokio::task::spawn_blocking(move || state_dir.remove(id))
            .await
            .map_err(|e| ("state-dir", Status::internal(e.to_string())))?
            .map_err(|e| ("state-dir", Status::internal(e.to_string())))?;
        Ok(())
    }

    // ------------------------------------------------------------ labels --

    /// Replaces the pod labels of the selected endpoints (a pod selector
    /// with no endpoint remembers them for its create). Returns the
    /// endpoints after the change and how many were re-identified.
    pub async fn update_labels(
        &self,
        selector: &EndpointSelector,
        labels: Labels,
        wait: bool,
        deadline: Duration,
    ) -> Result<(Vec<EndpointView>, usize), ManagerError> {
        let waits = {
            let mut state = self.state();
            let ids = state.find(selector);
            if ids.is_empty() {
                match selector {
                    EndpointSelector::Pod { namespace, name } => {
                        state.pod_labels.insert((namespace.clone(), name.clone()), labels);
                        return Ok((Vec::new(), 0));
                    }
                    _ => return Err(ManagerError::NotFound(format!("no endpoint matches {selector:?}"))),
                }
            }
            if let EndpointSelector::Pod { namespace, name } = selector {
                state
                    .pod_labels
                    .insert((namespace.clone(), name.clone()), labels.clone());
            }
            let mut waits = Vec::new();
            for id in ids {
                let slot = state.endpoints.get_mut(&id).expect("found above");
                if slot.spec.labels == labels {
                    continue;
                }
                slot.spec.labels = labels.clone();
                slot.status
                    .transition(id, EndpointState::WaitingToRegenerate, "labels changed");
                waits.push((
                    id,
                    slot.queue.clone(),
                    slot.status.identity,
                    slot.queue.request("labels changed"),
                ));
            }
            waits
        };
        let mut ids: Vec<u16> = waits.iter().map(|(id, ..)| *id).collect();
        if wait {
            self.wait_all(
                &waits
                    .iter()
                    .map(|(id, q, _, g)| (*id, q.clone(), *g))
                    .collect::<Vec<_>>(),
                deadline,
            )
            .await?;
        }
        let mut reidentified = 0;
        let state = self.state();
        for (id, _, before, _) in &waits {
            if let Some(slot) = state.endpoints.get(id)
                && slot.status.identity != *before
            {
                reidentified += 1;
            }
        }
        if ids.is_empty() {
            ids = state.find(selector);
        }
        let views = ids
            .iter()
            .filter_map(|id| state.endpoints.get(id))
            .map(|s| EndpointView {
                spec: s.spec.clone(),
                status: s.status.clone(),
            })
            .collect();
        Ok((views, reidentified))
    }

    /// Waits for every (endpoint, generation); the first failure or the
    /// deadline ends the wait. Returns how many realised.
    async fn wait_all(&self, waits: &[(u16, Arc<Queue>, u64)], deadline: Duration) -> Result<usize, ManagerError> {
        let all = futures::future::join_all(waits.iter().map(|(id, q, g)| async move { (*id, q.wait(*g).await) }));
        match tokio::time::timeout(deadline, all).await {
            Ok(results) => {
                let mut realised = 0;
                for (id, result) in results {
                    match result {
                        Ok(()) => realised += 1,
                        // A removed endpoint needs nothing realised.
                        Err(e) if e.status.code() == Code::Aborted => {}
                        Err(source) => {
                            return Err(ManagerError::Regeneration {
                                id,
                                undone: false,
                                source,
                            });
                        }
                    }
                }
                Ok(realised)
            }
            Err(_) => Err(ManagerError::Deadline {
                id: waits.first().map_or(0, |(id, ..)| *id),
                undone: false,
            }),
        }
    }

    /// Replaces a namespace's labels; its endpoints are re-identified (not
    /// waited for). Returns whether anything changed and how many endpoints
    /// were queued.
    pub async fn set_namespace_labels(
        &self,
        namespace: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<(bool, usize), ManagerError> {
        let _config = self.inner.config_lock.lock().await;
        let mut next = {
            let state = self.state();
            let current = state.namespaces.get(namespace).map(|n| &n.labels);
            if current == Some(&labels) || (current.is_none() && labels.is_empty()) {
                return Ok((false, 0));
            }
            state.namespaces.clone()
        };
        if labels.is_empty() {
            next.remove(namespace);
        } else {
            next.insert(
                namespace.to_string(),
                NamespaceLabels {
                    labels,
                    updated: Some(SystemTime::now()),
                },
            );
        }
        // Durable before it takes effect; written off the runtime's threads
        // and without the state lock (an fsync stalls every regeneration).
        store(&self.inner.namespaces_file, next.clone(), "namespace labels").await?;
        let mut state = self.state();
        state.namespaces = next;
        let mut affected = 0;
        for slot in state.endpoints.values_mut() {
            if slot.spec.pod_namespace == namespace && slot.status.state != EndpointState::Disconnecting {
                slot.queue.request("namespace labels changed");
                affected += 1;
            }
        }
        Ok((true, affected))
    }

    /// Namespaces with labels or endpoints: (name, labels, endpoints).
    pub fn namespaces(&self) -> Vec<(String, NamespaceLabels, usize)> {
        let state = self.state();
        let mut out: BTreeMap<String, (NamespaceLabels, usize)> = state
            .namespaces
            .iter()
            .map(|(name, labels)| (name.clone(), (labels.clone(), 0)))
            .collect();
        for slot in state.endpoints.values() {
            out.entry(slot.spec.pod_namespace.clone()).or_default().1 += 1;
        }
        out.into_iter().map(|(name, (labels, n))| (name, labels, n)).collect()
    }

    // -------------------------------------------------------------- reads --

    fn view(&self, id: u16) -> Result<EndpointView, ManagerError> {
        let state = self.state();
        let slot = state
            .endpoints
            .get(&id)
            .ok_or_else(|| ManagerError::NotFound(format!("endpoint {id} is gone")))?;
        Ok(EndpointView {
            spec: slot.spec.clone(),
            status: slot.status.clone(),
        })
    }

    /// One endpoint. A pod selector matching several is a precondition
    /// error.
    pub fn get(&self, selector: &EndpointSelector) -> Result<EndpointView, ManagerError> {
        let ids = self.state().find(selector);
        match ids.as_slice() {
            [] => Err(ManagerError::NotFound(format!("no endpoint matches {selector:?}"))),
            [id] => self.view(*id),
            many => Err(ManagerError::Precondition(format!(
                "{} endpoints match ({many:?}); use the id",
                many.len()
            ))),
        }
    }

    /// Every endpoint, by id.
    pub fn list(&self) -> Vec<EndpointView> {
        self.state()
            .endpoints
            .values()
            .map(|s| EndpointView {
                spec: s.spec.clone(),
                status: s.status.clone(),
            })
            .collect()
    }

    /// Endpoint counts by state.
    pub fn counts(&self) -> Vec<(EndpointState, usize)> {
        self.state().counts()
    }

    /// Restore progress.
    pub fn restore_progress(&self) -> RestoreProgress {
        self.inner.restore.lock().expect("restore lock poisoned").clone()
    }

    /// Waits until restore finished.
    pub async fn restored(&self) {
        let mut rx = self.inner.restore_done.subscribe();
        let _ = rx.wait_for(|done| *done).await;
    }

    /// The dependencies as last probed.
    pub fn dependencies(&self) -> Vec<DependencyStatus> {
        self.inner
            .dependencies
            .lock()
            .expect("dependency lock poisoned")
            .to_vec()
    }

    /// Repository revision and policy count.
    pub fn policy_summary(&self) -> (u64, usize) {
        let state = self.state();
        (state.repository.revision(), state.repository.len())
    }

    /// Policies, ordered by key.
    pub fn policies(&self) -> (Vec<StoredPolicy>, u64) {
        let state = self.state();
        (state.repository.iter().cloned().collect(), state.repository.revision())
    }

    /// One policy and the endpoints it selects now.
    pub fn policy(&self, key: &PolicyKey) -> Option<(StoredPolicy, Vec<u16>)> {
        let state = self.state();
        let stored = state.repository.get(key)?.clone();
        let selected = state
            .endpoints
            .values()
            .filter(|s| s.status.identity != 0 && stored.policy.selects(&s.status.identity_labels))
            .map(|s| s.spec.id)
            .collect();
        Some((stored, selected))
    }

    fn update_state_metrics(&self, state: &State) {
        self.inner.metrics.set_states(&state.counts());
    }

    // ----------------------------------------------------------- policies --

    /// Stores a policy and regenerates the endpoints it selects (before or
    /// after); with `wait` returns once they realised it.
    pub async fn upsert_policy(
        &self,
        policy: Policy,
        origin: PolicyOrigin,
        wait: bool,
        deadline: Duration,
    ) -> Result<PolicyUpdate, ManagerError> {
        let _config = self.inner.config_lock.lock().await;
        let change = {
            let mut state = self.state();
            // Check the origin before touching anything.
            let mut trial = state.repository.get(policy.key()).cloned();
            if let Some(stored) = trial.take()
                && stored.origin != origin
            {
                return Err(PolicyError::OriginConflict {
                    key: policy.key().clone(),
                    held_by: stored.origin,
                }
                .into());
            }
            state.repository.upsert(policy, origin)?
        };
        self.policy_changed(change, origin, wait, deadline).await
    }

    /// Removes a policy; `Ok(None)` when it did not exist.
    pub async fn delete_policy(
        &self,
        key: &PolicyKey,
        origin: PolicyOrigin,
        wait: bool,
        deadline: Duration,
    ) -> Result<Option<PolicyUpdate>, ManagerError> {
        let _config = self.inner.config_lock.lock().await;
        let change = self.state().repository.delete(key, origin)?;
        match change {
            None => Ok(None),
            Some(change) => self.policy_changed(change, origin, wait, deadline).await.map(Some),
        }
    }

    async fn policy_changed(
        &self,
        change: PolicyChange,
        origin: PolicyOrigin,
        wait: bool,
        deadline: Duration,
    ) -> Result<PolicyUpdate, ManagerError> {
        if !change.changed {
            return Ok(PolicyUpdate {
                change,
                affected: 0,
                realised: 0,
            });
        }
        if origin == PolicyOrigin::Api {
            let documents: Vec<String> = {
                let state = self.state();
                state
                    .repository
                    .iter()
                    .filter(|p| p.origin == PolicyOrigin::Api)
                    .map(|p| p.policy.document().to_string())
                    .collect()
            };
            store(&self.inner.api_policies, documents, "API policies").await?;
        }
        // CIDR identities first, so the regenerations see them.
        if let Err(e) = self.reconcile_cidrs(false).await {
            tracing::warn!(error = %e, "CIDR identities for policies not allocated yet; retrying in the background");
            self.inner.cidr_wake.notify_one();
        }
        let waits: Vec<(u16, Arc<Queue>, u64)> = {
            let mut state = self.state();
            self.inner
                .metrics
                .set_policy(state.repository.revision(), state.repository.len());
            let reason = format!("policy {} changed", change.key);
            state
                .endpoints
                .values_mut()
                .filter(|s| {
                    s.status.identity != 0
                        && s.status.state != EndpointState::Disconnecting
                        && change.affects(&s.status.identity_labels)
                })
                .map(|s| (s.spec.id, s.queue.clone(), s.queue.request(&reason)))
                .collect()
        };
        tracing::info!(policy = %change.key, revision = change.revision, affected = waits.len(), "policy changed");
        let affected = waits.len();
        let realised = if wait {
            self.wait_all(&waits, deadline).await?
        } else {
            0
        };
        Ok(PolicyUpdate {
            change,
            affected,
            realised,
        })
    }

    /// Makes the CIDR identities match the repository's prefixes. With
    /// `reallocate` every prefix is allocated again (svc-identity restarted
    /// and forgot them).
    async fn reconcile_cidrs(&self, reallocate: bool) -> Result<(), Status> {
        let (missing, extra) = {
            let state = self.state();
            let desired = state.repository.cidrs();
            let missing: Vec<IpNet> = desired
                .iter()
                .filter(|p| reallocate || !state.cidr_identities.contains_key(p))
                .copied()
                .collect();
            let extra: Vec<IpNet> = state
                .cidr_identities
                .keys()
                .filter(|p| !desired.contains(p))
                .copied()
                .collect();
            (missing, extra)
        };
        if !missing.is_empty() {
            let response = self
                .inner
                .deps
                .identity
                .allocate_cidrs(idpb::AllocateCidrIdentitiesRequest {
                    prefixes: missing.iter().map(ToString::to_string).collect(),
                    owner: CIDR_OWNER.into(),
                })
                .await?;
            let mut state = self.state();
            for identity in response.identities {
                let Ok(prefix) = identity.prefix.parse::<IpNet>() else {
                    tracing::warn!(prefix = identity.prefix, "svc-identity returned an unparseable prefix");
                    continue;
                };
                state.cidr_identities.insert(prefix, identity.id);
                state.selectors.set_cidr_identity(prefix, identity.id);
            }
            self.queue_changed_policies(&mut state, "CIDR identities allocated");
        }
        if !extra.is_empty() {
            {
                let mut state = self.state();
                for prefix in &extra {
                    state.cidr_identities.remove(prefix);
                    state.selectors.remove_cidr_identity(prefix);
                }
                self.queue_changed_policies(&mut state, "CIDR identities released");
            }
            self.inner
                .deps
                .identity
                .release_cidrs(idpb::ReleaseCidrIdentitiesRequest {
                    prefixes: extra.iter().map(ToString::to_string).collect(),
                    owner: CIDR_OWNER.into(),
                })
                .await?;
        }
        Ok(())
    }

    async fn reconcile_cidrs_forever(&self) {
        let mut backoff = self.inner.options.retry_backoff.clone();
        loop {
            self.inner.cidr_wake.notified().await;
            loop {
                match self.reconcile_cidrs(false).await {
                    Ok(()) => {
                        backoff.reset();
                        break;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "CIDR identity reconciliation failed; retrying");
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                }
            }
        }
    }

    /// Queues a regeneration of every endpoint whose resolved policy differs
    /// from the one its datapath holds (after the selector cache changed).
    fn queue_changed_policies(&self, state: &mut State, reason: &str) -> usize {
        let mut queued = Vec::new();
        for (id, slot) in &state.endpoints {
            if slot.status.identity == 0
                || !matches!(
                    slot.status.state,
                    EndpointState::Ready | EndpointState::WaitingToRegenerate
                )
            {
                continue;
            }
            let resolved = state.resolve(&slot.status.identity_labels, &slot.spec);
            if slot.status.realised_policy.as_ref() != Some(&resolved) {
                queued.push(*id);
            }
        }
        for id in &queued {
            if let Some(slot) = state.endpoints.get(id) {
                slot.queue.request(reason);
            }
        }
        if !queued.is_empty() {
            tracing::debug!(endpoints = queued.len(), reason, "policy of endpoints changed");
        }
        queued.len()
    }

    // ------------------------------------------------------- regeneration --

    fn spawn_worker(&self, id: u16, queue: Arc<Queue>) {
        let this = self.clone();
        tokio::spawn(async move {
            let mut backoff = this.inner.options.retry_backoff.clone();
            loop {
                let pending = {
                    let o = queue.outcome.borrow();
                    o.requested > o.realised && o.failed.as_ref().is_none_or(|(g, _)| *g < o.requested)
                };
                if !pending {
                    queue.wake.notified().await;
                }
                if queue.closed.load(Ordering::SeqCst) {
                    return;
                }
                // Taken, not cloned: a span kept in the queue would never
                // close (and never be exported).
                let (mut target, mut reason, mut requester) = (0, String::new(), tracing::Span::none());
                queue.outcome.send_modify(|o| {
                    target = o.requested;
                    reason = o.reason.clone();
                    requester = std::mem::replace(&mut o.requester, tracing::Span::none());
                });
                if target <= queue.outcome.borrow().realised {
                    continue;
                }
                let result = {
                    let _serialised = queue.lock.lock().await;
                    if queue.closed.load(Ordering::SeqCst) {
                        return;
                    }
                    let _permit = this.inner.permits.acquire().await.expect("semaphore never closed");
                    let span = tracing::info_span!(parent: &requester, "regenerate", endpoint = id, reason = %reason);
                    this.regenerate(id, &reason).instrument(span).await
                };
                match result {
                    Ok(()) => {
                        backoff.reset();
                        queue.outcome.send_modify(|o| {
                            o.realised = o.realised.max(target);
                            if o.failed.as_ref().is_some_and(|(g, _)| *g <= target) {
                                o.failed = None;
                            }
                        });
                    }
                    Err(e) => {
                        queue.outcome.send_modify(|o| o.failed = Some((target, e.clone())));
                        if queue.retry.load(Ordering::SeqCst) && !queue.closed.load(Ordering::SeqCst) {
                            let delay = backoff.next_delay();
                            let queue = queue.clone();
                            tokio::spawn(async move {
                                tokio::time::sleep(delay).await;
                                if !queue.closed.load(Ordering::SeqCst) {
                                    queue.request("retry after failure");
                                }
                            });
                        }
                    }
                }
            }
        });
    }

    fn set_state(&self, id: u16, to: EndpointState, reason: &str) -> Option<EndpointSpec> {
        let mut state = self.state();
        let slot = state.endpoints.get_mut(&id)?;
        slot.status.transition(id, to, reason);
        let spec = slot.spec.clone();
        self.update_state_metrics(&state);
        Some(spec)
    }

    /// One regeneration: identity → policy → datapath → ipcache → state dir.
    async fn regenerate(&self, id: u16, reason: &str) -> Result<(), RegenError> {
        let started = Instant::now();
        let (spec, request_labels, previous_identity, restoring) = {
            let state = self.state();
            let Some(slot) = state.endpoints.get(&id) else {
                return Ok(());
            };
            let labels = state
                .identity_request_labels(&slot.spec)
                .map_err(|s| RegenError::new(RegenerationStep::Identity, s))?;
            (
                slot.spec.clone(),
                labels,
                slot.status.identity,
                slot.status.state == EndpointState::Restoring,
            )
        };
        let regenerating = if previous_identity == 0 && !restoring {
            EndpointState::WaitingForIdentity
        } else {
            EndpointState::Regenerating
        };
        self.set_state(id, regenerating, reason);
        let result = self.run_steps(&spec, request_labels, previous_identity, reason).await;
        let (e, failed) = {
            let mut state = self.state();
            let Some(slot) = state.endpoints.get_mut(&id) else {
                return result.map(|_| ());
            };
            match result {
                Ok((identity, identity_labels, resolved, revision, record)) => {
                    let took = started.elapsed();
                    slot.status.identity = identity;
                    slot.status.identity_labels = identity_labels;
                    slot.status.realised_policy = Some(resolved);
                    slot.status.policy_revision = revision;
                    slot.status.last_regeneration = Some((SystemTime::now(), took));
                    slot.status.regenerations += 1;
                    slot.status.last_error = None;
                    if let Some(record) = record {
                        slot.persisted = Some(record);
                    }
                    slot.status.transition(id, EndpointState::Ready, reason);
                    events::regeneration_completed(&self.inner.metrics, id, identity, revision, reason, took);
                    let named: Vec<_> = slot.spec.named_ports.clone();
                    if !named.is_empty() {
                        let mut union: BTreeSet<_> = named.into_iter().collect();
                        for other in state.endpoints.values() {
                            if other.status.identity == identity {
                                union.extend(other.spec.named_ports.iter().cloned());
                            }
                        }
                        state.selectors.set_named_ports(identity, union.into_iter().collect());
                    }
                    self.update_state_metrics(&state);
                    return Ok(());
                }
                Err(e) => {
                    slot.status.last_error = Some(RegenerationFailure {
                        step: e.step,
                        message: e.status.message().to_string(),
                        at: SystemTime::now(),
                    });
                    let next = if restoring {
                        EndpointState::Restoring
                    } else {
                        EndpointState::WaitingToRegenerate
                    };
                    slot.status
                        .transition(id, next, &format!("regeneration failed at {}", e.step.as_str()));
                    events::regeneration_failed(&self.inner.metrics, id, e.step, e.status.code(), e.status.message());
                    let failed = EndpointRecord {
                        spec: slot.spec.clone(),
                        identity: slot.status.identity,
                        identity_labels: slot.status.identity_labels.clone(),
                        policy_revision: slot.status.policy_revision,
                        written: SystemTime::now(),
                    };
                    // The next successful regeneration must write the record even
                    // if it is unchanged: that write is what removes the
                    // `_next_fail` kept below (otherwise it stays beside a ready
                    // endpoint, e.g. after a regeneration failed while
                    // svc-loader was down and the resync succeeded).
                    slot.persisted = None;
                    (e, failed)
                }
            }
        };
        // Kept for debugging; a create that is undone removes it.
        let state_dir = self.inner.state_dir.clone();
        match tokio::task::spawn_blocking(move || state_dir.write_failed(&failed)).await {
            Ok(Ok(())) => {}
            Ok(Err(write)) => tracing::warn!(endpoint = id, error = %write, "could not keep the failed state"),
            Err(join) => tracing::warn!(endpoint = id, error = %join, "could not keep the failed state"),
        }
        Err(e)
    }

    #[allow(clippy::type_complexity)]
    async fn run_steps(
        &self,
        spec: &EndpointSpec,
        request_labels: Labels,
        previous_identity: u32,
        reason: &str,
    ) -> Result<(u32, Labels, ResolvedPolicy, u64, Option<EndpointRecord>), RegenError> {
        let deps = &self.inner.deps;
        let id = spec.id;
        // 1. identity
        let allocated = deps
            .identity
            .allocate(idpb::AllocateIdentityRequest {
                labels: request_labels.iter().map(ToString::to_string).collect(),
                owner: spec.identity_owner(),
            })
            .await
            .map_err(|s| RegenError::new(RegenerationStep::Identity, s))?;
        let identity = allocated.identity.ok_or_else(|| {
            RegenError::new(
                RegenerationStep::Identity,
                Status::internal("no identity in the response"),
            )
        })?;
        let identity_labels = Labels::parse(&identity.labels).map_err(|e| {
            RegenError::new(
                RegenerationStep::Identity,
                Status::internal(format!("svc-identity returned invalid labels: {e}")),
            )
        })?;
        if previous_identity == 0 {
            self.set_state(id, EndpointState::Regenerating, reason);
        }
        // 2. policy
        let (resolved, revision) = {
            let state = self.state();
            (state.resolve(&identity_labels, spec), state.repository.revision())
        };
        // 3. datapath
        let applied = deps
            .loader
            .apply(ldpb::ApplyEndpointRequest {
                endpoint_id: u32::from(id),
                host_ifindex: spec.host_ifindex,
                addresses: spec
                    .addresses
                    .iter()
                    .map(|a| match a.address {
                        IpAddr::V4(v4) => v4.octets().to_vec(),
                        IpAddr::V6(v6) => v6.octets().to_vec(),
                    })
                    .collect(),
                mac: spec.mac.to_vec(),
                identity: identity.id,
                policy: Some(resolved.to_proto(revision, self.inner.options.allow_from_host)),
            })
            .await
            .map_err(|s| RegenError::new(RegenerationStep::Datapath, s))?;
        if let Some(held) = applied.endpoint
            && !held.host_ifname.is_empty()
            && held.host_ifname != spec.host_interface
        {
            return Err(RegenError::new(
                RegenerationStep::Datapath,
                Status::failed_precondition(format!(
                    "ifindex {} is now {}, not the endpoint's {}",
                    spec.host_ifindex, held.host_ifname, spec.host_interface
                )),
            ));
        }
        // 4. ipcache
        deps.identity
            .upsert_ip(idpb::UpsertIpRequest {
                entries: spec
                    .addresses
                    .iter()
                    .map(|a| idpb::IpcacheEntry {
                        prefix: a.address.to_string(),
                        identity: identity.id,
                        host_ip: String::new(),
                        pod_namespace: spec.pod_namespace.clone(),
                        pod_name: spec.pod_name.clone(),
                        source: idpb::IpcacheSource::LocalEndpoint.into(),
                        node_name: String::new(),
                    })
                    .collect(),
            })
            .await
            .map_err(|s| RegenError::new(RegenerationStep::Ipcache, s))?;
        // 5. state dir (skipped when it already holds exactly this)
        let record = EndpointRecord {
            spec: spec.clone(),
            identity: identity.id,
            identity_labels: identity_labels.clone(),
            policy_revision: revision,
            written: SystemTime::now(),
        };
        let unchanged = {
            let state = self.state();
            state
                .endpoints
                .get(&id)
                .and_then(|s| s.persisted.as_ref())
                .is_some_and(|p| {
                    p.spec == record.spec
                        && p.identity == record.identity
                        && p.identity_labels == record.identity_labels
                })
        };
        let written = if unchanged {
            None
        } else {
            let state_dir = self.inner.state_dir.clone();
            let to_write = record.clone();
            tokio::task::spawn_blocking(move || state_dir.write(&to_write))
                .await
                .map_err(|e| RegenError::new(RegenerationStep::StateDir, Status::internal(e.to_string())))?
                .map_err(|e| RegenError::new(RegenerationStep::StateDir, Status::internal(e.to_string())))?;
            Some(record)
        };
        // The old identity is released only once nothing uses it.
        if previous_identity != 0
            && previous_identity != identity.id
            && let Err(e) = deps
                .identity
                .release(idpb::ReleaseIdentityRequest {
                    id: previous_identity,
                    owner: spec.identity_owner(),
                })
                .await
        {
            tracing::warn!(endpoint = id, identity = previous_identity, error = %e, "releasing the previous identity failed; a resync will");
        }
        Ok((identity.id, identity_labels, resolved, revision, written))
    }

    // ------------------------------------------------------------ restore --

    /// Restore on start (the seed's restoreOldEndpoints): state dirs →
    /// endpoints; drop those whose interface is gone; re-reserve addresses;
    /// regenerate all; remove datapath entries and identity references no
    /// endpoint owns.
    async fn restore(&self) {
        let started = Instant::now();
        {
            let mut progress = self.inner.restore.lock().expect("restore lock poisoned");
            progress.started = Some(SystemTime::now());
        }
        let state_dir = self.inner.state_dir.clone();
        let scan = match tokio::task::spawn_blocking(move || state_dir.scan()).await {
            Ok(Ok(scan)) => scan,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "reading the endpoint state dir failed; starting without restored endpoints");
                Default::default()
            }
            Err(e) => {
                tracing::error!(error = %e, "reading the endpoint state dir panicked");
                Default::default()
            }
        };
        let found = u32::try_from(scan.records.len()).unwrap_or(u32::MAX);
        tracing::info!(found, unreadable = scan.unreadable.len(), "restoring endpoints");
        let mut queues = Vec::new();
        {
            let mut state = self.state();
            for (id, reason) in &scan.unreadable {
                tracing::error!(
                    endpoint = id,
                    reason,
                    "endpoint state unreadable; its id stays reserved"
                );
                state.reserved_ids.insert(*id);
            }
            for (id, (record, source)) in scan.records {
                let mut status = EndpointStatus::new(EndpointState::Restoring, &format!("restored from {source:?}"));
                status.identity = record.identity;
                status.identity_labels = record.identity_labels.clone();
                let queue = Queue::new(true);
                queues.push((id, queue.clone()));
                state.next_id = state.next_id.max(id.wrapping_add(1)).max(1);
                state.endpoints.insert(
                    id,
                    Slot {
                        spec: record.spec.clone(),
                        status,
                        queue,
                        persisted: Some(record),
                    },
                );
            }
            self.update_state_metrics(&state);
        }
        self.inner.scanned.send_replace(true);
        self.inner.restore.lock().expect("restore lock poisoned").found = found;

        // The datapath's view: which restored endpoints lost their interface,
        // which ids it holds that no endpoint owns.
        let listed = self
            .retry_until_ok("svc-loader ListEndpoints", || self.inner.deps.loader.list())
            .await;
        let mut dropped: Vec<(u16, &'static str)> = Vec::new();
        {
            let mut state = self.state();
            for held in &listed.endpoints {
                let Ok(id) = u16::try_from(held.endpoint_id) else {
                    continue;
                };
                match state.endpoints.get(&id) {
                    Some(slot) if slot.spec.host_ifindex == held.host_ifindex => {
                        let gone = held.from_container == ldpb::AttachState::InterfaceGone as i32
                            || held.to_container == ldpb::AttachState::InterfaceGone as i32;
                        let renamed = !held.host_ifname.is_empty() && held.host_ifname != slot.spec.host_interface;
                        if gone || renamed {
                            dropped.push((id, "interface_gone"));
                        }
                    }
                    // Not ours (or moved): cleaned after restore; never reuse the id before.
                    _ => {
                        state.reserved_ids.insert(id);
                    }
                }
            }
            for id in &listed.orphan_policy_endpoint_ids {
                if let Ok(id) = u16::try_from(*id) {
                    state.reserved_ids.insert(id);
                }
            }
        }
        self.inner.ids_known.send_replace(true);

        // Restored endpoints keep their datapath; regenerating them against
        // an empty selector cache (or without the CIDR identities) would
        // briefly deny allowed peers.
        self.wait_for_policy_inputs(RESTORE_INPUTS_WAIT).await;

        // Re-reserve addresses and regenerate everything in parallel (the
        // regeneration semaphore bounds the datapath work).
        let pending: Vec<(u16, Arc<Queue>)> = queues
            .into_iter()
            .filter(|(id, _)| !dropped.iter().any(|(d, _)| d == id))
            .collect();
        let results: Vec<(u16, Result<(), RegenError>)> = futures::stream::iter(pending)
            .map(|(id, queue)| async move {
                if let Err(e) = self.restore_addresses(id).await {
                    tracing::error!(endpoint = id, error = %e, "re-reserving the endpoint's addresses failed");
                }
                self.spawn_worker(id, queue.clone());
                let generation = queue.request("restored");
                (id, queue.wait(generation).await)
            })
            .buffer_unordered(64)
            .collect()
            .await;
        let (mut restored, mut failed) = (0u32, 0u32);
        for (id, result) in results {
            match result {
                Ok(()) => restored += 1,
                Err(e) if e.step == RegenerationStep::Datapath && e.status.code() == Code::NotFound => {
                    dropped.push((id, "interface_gone"));
                }
                Err(e) if e.step == RegenerationStep::Datapath && e.status.code() == Code::FailedPrecondition => {
                    dropped.push((id, "interface_replaced"));
                }
                // Deleted (DeleteEndpoint) while restore waited: the delete
                // cleaned it; neither restored nor a failure.
                Err(e) if e.status.code() == Code::Aborted => {
                    tracing::info!(endpoint = id, "endpoint deleted during restore");
                }
                Err(e) => {
                    failed += 1;
                    tracing::error!(endpoint = id, error = %e, "restoring the endpoint failed; retrying in the background");
                }
            }
        }
        for (id, reason) in &dropped {
            self.drop_endpoint(*id, reason).await;
        }
        self.cleanup_leftovers().await;

        let took = started.elapsed();
        let dropped_count = u32::try_from(dropped.len()).unwrap_or(u32::MAX);
        {
            let mut progress = self.inner.restore.lock().expect("restore lock poisoned");
            progress.restored = restored;
            progress.dropped = dropped_count;
            progress.failed = failed;
            progress.finished = Some(SystemTime::now());
            progress.complete = true;
        }
        events::restore_finished(&self.inner.metrics, found, restored, dropped_count, failed, took);
        self.inner.restore_done.send_replace(true);
    }

    /// Waits (at most `limit`) for svc-identity's first identity snapshot
    /// and for the CIDR identities of the repository's policies.
    async fn wait_for_policy_inputs(&self, limit: Duration) {
        let started = Instant::now();
        let mut synced = self.inner.identities_synced.subscribe();
        if tokio::time::timeout(limit, synced.wait_for(|s| *s)).await.is_err() {
            tracing::warn!(waited = ?limit, "no identity snapshot from svc-identity yet; policies may lack peers until it arrives");
            return;
        }
        let mut backoff = self.inner.options.retry_backoff.clone();
        while let Err(e) = self.reconcile_cidrs(false).await {
            if started.elapsed() >= limit {
                tracing::warn!(error = %e, "CIDR identities not allocated yet; retrying in the background");
                self.inner.cidr_wake.notify_one();
                return;
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    async fn retry_until_ok<T, F, Fut>(&self, what: &str, call: F) -> T
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let mut backoff = self.inner.options.retry_backoff.clone();
        let mut attempts = 0u32;
        loop {
            match call().await {
                Ok(value) => return value,
                Err(e) => {
                    attempts += 1;
                    if attempts == 1 || attempts.is_multiple_of(10) {
                        tracing::warn!(call = what, attempts, error = %e, "waiting for a dependency");
                    }
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        }
    }

    /// svc-ipam Restore for every address the endpoint got from svc-ipam.
    async fn restore_addresses(&self, id: u16) -> Result<(), Status> {
        let Some(queue) = self.state().endpoints.get(&id).map(|s| s.queue.clone()) else {
            return Ok(());
        };
        // Held while re-reserving, as a removal holds it: a concurrent
        // DeleteEndpoint then completes either before (the endpoint is gone
        // below and nothing is re-reserved) or after the Restore calls (and
        // the CNI releases the addresses only once its delete returned).
        // Without it a resync after a svc-ipam restart could re-reserve the
        // addresses of a pod the CNI had just deleted and released: a leak.
        let _serialised = queue.lock.lock().await;
        let Some(spec) = self.state().endpoints.get(&id).map(|s| s.spec.clone()) else {
            return Ok(());
        };
        for address in spec.addresses.iter().filter(|a| !a.ipam_pool.is_empty()) {
            let request = ipampb::RestoreRequest {
                owner: Some(ipam_owner(&spec)),
                pool: address.ipam_pool.clone(),
                address: address.address.to_string(),
            };
            self.retry_while_unavailable(|| self.inner.deps.ipam.restore(request.clone()))
                .await?;
        }
        Ok(())
    }

    /// Retries while the dependency is unreachable; other errors return.
    async fn retry_while_unavailable<T, F, Fut>(&self, call: F) -> Result<T, Status>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, Status>>,
    {
        let mut backoff = self.inner.options.retry_backoff.clone();
        let give_up = Instant::now() + Duration::from_secs(60);
        loop {
            match call().await {
                Err(e) if e.code() == Code::Unavailable && Instant::now() < give_up => {
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                other => return other,
            }
        }
    }

    /// Removes an endpoint found dead at restore and releases its addresses.
    async fn drop_endpoint(&self, id: u16, reason: &'static str) {
        let Some(spec) = self.state().endpoints.get(&id).map(|s| s.spec.clone()) else {
            return;
        };
        if let Err(e) = self.remove_endpoint(id, reason).await {
            tracing::error!(endpoint = id, error = %e, "dropping a dead endpoint failed; it stays disconnecting");
            return;
        }
        if spec.addresses.iter().any(|a| !a.ipam_pool.is_empty())
            && let Err(e) = self
                .retry_while_unavailable(|| {
                    self.inner.deps.ipam.release(ipampb::ReleaseRequest {
                        owner: Some(ipam_owner(&spec)),
                    })
                })
                .await
        {
            tracing::error!(endpoint = id, error = %e, "releasing a dead endpoint's addresses failed");
        }
        let addresses: Vec<String> = spec.addresses.iter().map(|a| a.address.to_string()).collect();
        events::endpoint_dropped(
            &self.inner.metrics,
            id,
            reason,
            &format!(
                "{} ({}) addresses {addresses:?} released",
                spec.host_interface, spec.container_id
            ),
        );
    }

    /// Datapath entries, attachments and identity references that no
    /// endpoint owns.
    async fn cleanup_leftovers(&self) {
        let deps = &self.inner.deps;
        match deps.loader.list().await {
            Ok(listed) => {
                let owned: BTreeMap<u16, u32> = self
                    .state()
                    .endpoints
                    .values()
                    .map(|s| (s.spec.id, s.spec.host_ifindex))
                    .collect();
                let mut removals = Vec::new();
                for held in &listed.endpoints {
                    let id = u16::try_from(held.endpoint_id).ok();
                    if id.and_then(|id| owned.get(&id)) != Some(&held.host_ifindex) {
                        removals.push((held.endpoint_id, held.host_ifindex, "endpoint entry"));
                    }
                }
                for orphan in &listed.orphan_attachments {
                    removals.push((0, orphan.host_ifindex, "attachment"));
                }
                for id in &listed.orphan_policy_endpoint_ids {
                    if !u16::try_from(*id).is_ok_and(|id| owned.contains_key(&id)) {
                        removals.push((*id, 0, "policy entries"));
                    }
                }
                for (endpoint_id, host_ifindex, what) in removals {
                    match deps
                        .loader
                        .remove(ldpb::RemoveEndpointRequest {
                            endpoint_id,
                            host_ifindex,
                        })
                        .await
                    {
                        Ok(_) => {
                            tracing::info!(
                                endpoint_id,
                                host_ifindex,
                                what,
                                "removed a datapath leftover no endpoint owns"
                            );
                            if let Ok(id) = u16::try_from(endpoint_id) {
                                self.state().reserved_ids.remove(&id);
                            }
                        }
                        Err(e) => {
                            tracing::warn!(endpoint_id, host_ifindex, what, error = %e, "removing a datapath leftover failed")
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing the datapath for leftovers failed"),
        }
        match deps
            .identity
            .list(idpb::ListIdentitiesRequest {
                local_only: true,
                include_owners: true,
                ..Default::default()
            })
            .await
        {
            Ok(listed) => {
                let owners: BTreeSet<String> = self.state().endpoints.keys().map(|id| identity_owner(*id)).collect();
                let stale: BTreeSet<String> = listed
                    .identities
                    .iter()
                    .flat_map(|i| i.owners.iter())
                    .filter(|o| o.starts_with(IDENTITY_OWNER_PREFIX) && !owners.contains(*o))
                    .cloned()
                    .collect();
                for owner in stale {
                    match deps
                        .identity
                        .release(idpb::ReleaseIdentityRequest {
                            id: 0,
                            owner: owner.clone(),
                        })
                        .await
                    {
                        Ok(_) => tracing::info!(owner, "released identity references of a gone endpoint"),
                        Err(e) => tracing::warn!(owner, error = %e, "releasing stale identity references failed"),
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "listing identity owners for leftovers failed"),
        }
    }

    // ------------------------------------------------------ dependencies --

    /// Keeps the selector cache current from svc-identity's identity stream.
    async fn watch_identities(&self) {
        let mut backoff = self.inner.options.retry_backoff.clone();
        loop {
            let mut stream = match self.inner.deps.identity.watch().await {
                Ok(stream) => stream,
                Err(e) => {
                    tracing::debug!(error = %e, "identity watch not established; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                }
            };
            let mut snapshot: Vec<(u32, Labels)> = Vec::new();
            while let Some(message) = stream.next().await {
                let message = match message {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::info!(error = %e, "identity watch ended; re-establishing");
                        break;
                    }
                };
                backoff.reset();
                let parsed = message
                    .added
                    .iter()
                    .filter_map(|i| match Labels::parse(&i.labels) {
                        Ok(labels) => Some((i.id, labels)),
                        Err(e) => {
                            tracing::warn!(identity = i.id, error = %e, "ignoring an identity with invalid labels");
                            None
                        }
                    })
                    .collect::<Vec<_>>();
                if message.snapshot {
                    snapshot.extend(parsed);
                    if !message.snapshot_complete {
                        continue;
                    }
                    let mut state = self.state();
                    state.selectors.replace_identities(std::mem::take(&mut snapshot));
                    self.queue_changed_policies(&mut state, "identities resynced");
                    drop(state);
                    self.inner.identities_synced.send_replace(true);
                    continue;
                }
                let mut state = self.state();
                let mut changed = false;
                for (id, labels) in parsed {
                    changed |= state.selectors.upsert_identity(id, labels);
                }
                for id in &message.removed {
                    changed |= state.selectors.remove_identity(*id);
                }
                if changed {
                    self.queue_changed_policies(&mut state, "identities changed");
                }
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    /// Probes each dependency's boot id; a new one replays everything it
    /// should hold (level-triggered resync, DESIGN.md §1).
    async fn probe_dependencies(&self) {
        let mut interval = tokio::time::interval(self.inner.options.dependency_poll);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let deps = &self.inner.deps;
            let (identity, ipam, loader) =
                futures::join!(deps.identity.boot_id(), deps.ipam.boot_id(), deps.loader.boot_id());
            for (index, result) in [(IDENTITY, identity), (IPAM, ipam), (LOADER, loader)] {
                let restarted = {
                    let mut all = self.inner.dependencies.lock().expect("dependency lock poisoned");
                    let dep = &mut all[index];
                    match result {
                        Ok(boot_id) => {
                            dep.connected = true;
                            dep.last_error.clear();
                            let restarted = !dep.seen_boot_id.is_empty() && dep.seen_boot_id != boot_id;
                            dep.seen_boot_id = boot_id;
                            restarted
                        }
                        Err(e) => {
                            dep.connected = false;
                            dep.last_error = e.message().to_string();
                            false
                        }
                    }
                };
                if restarted {
                    self.resync(index).await;
                }
            }
        }
    }

    /// Replays desired state into a restarted dependency.
    async fn resync(&self, index: usize) {
        let name = ["svc-identity", "svc-ipam", "svc-loader"][index];
        let ids: Vec<u16> = self.state().endpoints.keys().copied().collect();
        let mut error = String::new();
        match index {
            IDENTITY => {
                // Node-local CIDR identities and every endpoint's reference
                // and ipcache entry live in svc-identity's memory.
                if let Err(e) = self.reconcile_cidrs(true).await {
                    error = format!("CIDR identities: {}", e.message());
                    self.inner.cidr_wake.notify_one();
                }
                self.request_all("svc-identity restarted");
            }
            LOADER => self.request_all("svc-loader restarted"),
            _ => {
                for id in &ids {
                    if let Err(e) = self.restore_addresses(*id).await {
                        error = format!("endpoint {id}: {}", e.message());
                    }
                }
            }
        }
        events::dependency_resynced(&self.inner.metrics, name, ids.len());
        let mut all = self.inner.dependencies.lock().expect("dependency lock poisoned");
        all[index].last_resync = Some(SystemTime::now());
        if !error.is_empty() {
            all[index].last_error = error;
        }
    }

    fn request_all(&self, reason: &str) {
        let state = self.state();
        for slot in state.endpoints.values() {
            if slot.status.state != EndpointState::Disconnecting {
                slot.queue.request(reason);
            }
        }
    }
}

/// Writes a state file on the blocking pool.
async fn store<T>(file: &StateFile<T>, value: T, what: &str) -> Result<(), ManagerError>
where
    T: serde::Serialize + serde::de::DeserializeOwned + Clone + Send + 'static,
{
    let file = file.clone();
    tokio::task::spawn_blocking(move || file.store(&value))
        .await
        .map_err(|e| ManagerError::Storage(format!("persisting {what}: {e}")))?
        .map_err(|e| ManagerError::Storage(format!("persisting {what}: {e}")))
}

/// svc-ipam's owner of an endpoint's addresses (the CNI allocated them with it).
pub fn ipam_owner(spec: &EndpointSpec) -> ipampb::Owner {
    ipampb::Owner {
        container_id: spec.container_id.clone(),
        interface: spec.interface.clone(),
    }
}

fn ignore_not_found<T: Default>(status: Status) -> Result<T, Status> {
    if status.code() == Code::NotFound {
        Ok(T::default())
    } else {
        Err(status)
    }
}

/// Parses a `k8s:key=value` namespace label.
pub fn parse_namespace_label(text: &str) -> Result<(String, String), String> {
    let label: Label = text.parse().map_err(|e| format!("{text:?}: {e}"))?;
    if label.source() != LabelSource::K8s {
        return Err(format!("{text:?}: namespace labels must have source k8s"));
    }
    Ok((label.key().to_string(), label.value().to_string()))
}
