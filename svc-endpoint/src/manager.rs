//! The endpoint manager: endpoints and their state machine, one
//! regeneration queue per endpoint, the policy repository and selector cache,
//! namespace labels, and the replay of desired state when a dependency
//! restarts (DESIGN.md §1, §5).
//!
//! Concurrency: all bookkeeping lives behind one `std` mutex that is never
//! held across an await. Each endpoint has one worker task, the only one
//! that regenerates or removes it: a regeneration request bumps the
//! endpoint's requested generation and wakes the worker, which regenerates
//! once for every request made so far (coalescing) with one permit of a
//! node-wide semaphore (bounding parallelism). A removal closes the queue:
//! no regeneration starts any more, a running one stops at its next step,
//! and the worker retries the removal with backoff until the endpoint is
//! gone, whether or not a caller still waits (deletes converge by
//! themselves). The permit is taken before the endpoint's lock, so a
//! removal never waits behind other endpoints' regenerations.
//!
//! A change of the selector cache (identities, CIDR identities, named
//! ports) re-requests the endpoints selected by a policy whose resolution it
//! can change, including one whose running regeneration resolved already:
//! that regeneration realises a stale policy, and the coalesced request
//! makes one more.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::Ordering;
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
use crate::queue::{Queue, RemovalFailure, RemovalReason};
use crate::state_dir::{EndpointRecord, EndpointStateDir};
use rivet_policy::{
    NamedPort, Policy, PolicyChange, PolicyError, PolicyKey, PolicyOrigin, PolicyRepository, Resolution,
    ResolvedPolicy, SelectorCache, StoredPolicy, Subject,
};

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
    /// Policies whose rules' peers add up to more identities than this are
    /// resolved on a blocking thread instead of the async thread.
    pub blocking_resolution_above: usize,
    /// How often svc-loader is asked which endpoints lost their host
    /// interface (a runtime that never calls DEL must not leak them); zero:
    /// only at restore and when a regeneration finds it gone.
    pub interface_check: Duration,
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
            interface_check: Duration::from_secs(10),
            blocking_resolution_above: 4096,
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
    pub(crate) fn new(step: RegenerationStep, status: Status) -> Self {
        Self { step, status }
    }

    /// A regeneration stopped at `step` (or a wait for one ended) because
    /// its endpoint is being removed (ABORTED).
    pub(crate) fn aborted(step: RegenerationStep) -> Self {
        Self::new(step, Status::aborted("endpoint removed"))
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

/// What the `--policy-dir` watcher did (see [`crate::policy_dir`]).
#[derive(Debug, Clone, Default)]
pub struct PolicyDirStatus {
    /// The directory; `None` without a watcher.
    pub dir: Option<std::path::PathBuf>,
    /// Scans completed.
    pub scans: u64,
    /// Files rejected, summed over the scans.
    pub files_rejected: u64,
    /// The last scan's problems, empty when it applied every file.
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
    /// A synchronous create found no identity for a new label set: svc-identity
    /// stayed unavailable (its kvstore unreachable) for the whole deadline.
    #[error("endpoint {id}: no identity for its label set within the deadline ({attempts} attempts over {waited:?}; svc-identity needs the kvstore for a label set it has not seen): {}{}", source.status.message(), if *undone { " (undone)" } else { "" })]
    IdentityUnavailable {
        /// The endpoint.
        id: u16,
        /// Allocation attempts made.
        attempts: u32,
        /// Time spent.
        waited: Duration,
        /// Whether everything done for it was removed.
        undone: bool,
        /// svc-identity's last answer.
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
    /// Removing an endpoint failed (or did not finish within the call's
    /// deadline); it stays `disconnecting`, svc-endpoint keeps retrying in
    /// the background (and then releases its addresses, which the caller
    /// keeps), and the call can be repeated.
    #[error("endpoint {id}: removal failed at {step}: {}; retrying in the background", status.message())]
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
            ManagerError::IdentityUnavailable { .. } => Status::unavailable(message),
            ManagerError::Deadline { .. } => Status::deadline_exceeded(message),
            ManagerError::Removal { .. } => Status::unavailable(message),
            ManagerError::Policy(PolicyError::OriginConflict { .. }) => Status::failed_precondition(message),
            ManagerError::Policy(_) => Status::invalid_argument(message),
            ManagerError::Storage(_) => Status::internal(message),
            ManagerError::Unavailable(_) => Status::unavailable(message),
        }
    }
}

#[derive(Debug)]
struct Slot {
    spec: EndpointSpec,
    status: EndpointStatus,
    queue: Arc<Queue>,
    /// What the state dir holds (to skip identical rewrites).
    persisted: Option<EndpointRecord>,
    /// The identity labels a running regeneration resolved the policy for
    /// (a selector change after that needs one more regeneration).
    resolving: Option<Labels>,
}

impl Slot {
    /// The identity labels its policy is (being) resolved for: those of a
    /// running regeneration that resolved already, else those of the
    /// realised policy; `None` before the first resolution.
    fn policy_labels(&self) -> Option<&Labels> {
        match (&self.resolving, self.status.identity) {
            (Some(labels), _) => Some(labels),
            (None, 0) => None,
            (None, _) => Some(&self.status.identity_labels),
        }
    }
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
    /// CIDR identities no policy wants any more whose release svc-identity
    /// has not confirmed yet.
    cidr_releases: BTreeSet<IpNet>,
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

    /// The endpoints whose host interface svc-loader says is lost (gone, or
    /// its ifindex names another interface), with the reason.
    fn lost_interfaces(&self, held: &[ldpb::EndpointInterface]) -> Vec<(u16, RemovalReason)> {
        held.iter()
            .filter_map(|held| {
                let id = u16::try_from(held.endpoint_id).ok()?;
                let slot = self.endpoints.get(&id)?;
                if slot.spec.host_ifindex != held.host_ifindex || slot.queue.is_closed() {
                    return None;
                }
                interface_lost(held, &slot.spec).map(|reason| (id, reason))
            })
            .collect()
    }

    /// The ready endpoints whose host interface the listing of an older
    /// svc-loader does not name (it may be gone; its ListEndpoints does not
    /// say for certain).
    fn unnamed_interfaces(&self, listed: &ldpb::ListEndpointsResponse) -> Vec<u16> {
        listed
            .endpoints
            .iter()
            .filter(|held| held.host_ifname.is_empty())
            .filter_map(|held| {
                let id = u16::try_from(held.endpoint_id).ok()?;
                let slot = self.endpoints.get(&id)?;
                (slot.spec.host_ifindex == held.host_ifindex && slot.status.state == EndpointState::Ready).then_some(id)
            })
            .collect()
    }

    /// Sets the named ports of each of `identities` and `addresses` in the
    /// selector cache to the union of those of the endpoints holding it, in
    /// one pass over the endpoints (endpoints of one identity share one peer
    /// entry in other endpoints' policies; egress ipBlocks naming a port
    /// resolve per address). Returns whether the ports of an address
    /// changed: the CIDR identities of the host prefixes they need
    /// ([`State::desired_cidrs`]) may have changed too.
    fn refresh_named_ports(
        &mut self,
        identities: impl IntoIterator<Item = u32>,
        addresses: impl IntoIterator<Item = IpAddr>,
    ) -> bool {
        let mut by_identity: BTreeMap<u32, Vec<NamedPort>> = identities
            .into_iter()
            .filter(|identity| *identity != 0)
            .map(|identity| (identity, Vec::new()))
            .collect();
        let mut by_address: BTreeMap<IpAddr, Vec<NamedPort>> =
            addresses.into_iter().map(|address| (address, Vec::new())).collect();
        for slot in self.endpoints.values() {
            let ports = &slot.spec.named_ports;
            if let Some(held) = by_identity.get_mut(&slot.status.identity) {
                held.extend_from_slice(ports);
            }
            for address in &slot.spec.addresses {
                if let Some(held) = by_address.get_mut(&address.address) {
                    held.extend_from_slice(ports);
                }
            }
        }
        for (identity, ports) in by_identity {
            self.selectors.set_named_ports(identity, ports);
        }
        let mut changed = false;
        for (address, ports) in by_address {
            changed |= self.selectors.set_address_named_ports(address, ports);
        }
        changed
    }

    /// Every prefix that needs a CIDR identity: the policies' ipBlock
    /// prefixes and the host prefixes of the endpoints their egress ipBlocks
    /// resolve a named port for.
    fn desired_cidrs(&self) -> BTreeSet<IpNet> {
        let mut desired = self.repository.cidrs();
        desired.extend(self.repository.named_port_hosts(&self.selectors));
        desired
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
    policy_dir: Mutex<PolicyDirStatus>,
    /// Wakes the CIDR identity reconciliation.
    cidr_wake: Notify,
    /// Serialises changes of persisted configuration: policies (repository
    /// + API policies file) and namespace labels.
    config_lock: tokio::sync::Mutex<()>,
    /// Held by a CIDR identity reconciliation pass: one at a time.
    cidr_pass: tokio::sync::Mutex<()>,
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
            policy_dir: Mutex::default(),
            cidr_wake: Notify::new(),
            config_lock: tokio::sync::Mutex::new(()),
            cidr_pass: tokio::sync::Mutex::new(()),
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
        let this = self.clone();
        tokio::spawn(async move { this.check_interfaces_forever().await });
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
                if existing.queue.is_closed() {
                    return Err(ManagerError::Precondition(format!(
                        "endpoint {} of container {} is being deleted; retry",
                        existing.spec.id, spec.container_id
                    )));
                }
                let outcome = existing.queue.outcome();
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
                let queue = Queue::new(!new.sync, false);
                state.endpoints.insert(
                    id,
                    Slot {
                        spec,
                        status: EndpointStatus::new(EndpointState::WaitingForIdentity, "created"),
                        queue: queue.clone(),
                        persisted: None,
                        resolving: None,
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
        // A label set svc-identity has not seen needs its kvstore: while that
        // is away, allocation answers UNAVAILABLE and is retried within the
        // call's deadline (a label set it already has works locally).
        let mut generation = generation;
        let mut backoff = self.inner.options.retry_backoff.clone();
        let mut unavailable: Option<(u32, RegenError)> = None;
        loop {
            let remaining = deadline.saturating_sub(started.elapsed());
            let source = match tokio::time::timeout(remaining, queue.wait(generation)).await {
                Ok(Ok(())) => {
                    queue.retry.store(true, Ordering::SeqCst);
                    return Ok((self.view(id)?, created));
                }
                Ok(Err(source)) => source,
                Err(_) if !created => return Err(ManagerError::Deadline { id, undone: false }),
                Err(_) => {
                    // Undone once the running regeneration stopped (the
                    // worker removes the endpoint after it).
                    queue.request_removal(RemovalReason::CreateFailed);
                    return Err(match unavailable {
                        Some((attempts, source)) => ManagerError::IdentityUnavailable {
                            id,
                            attempts,
                            waited: started.elapsed(),
                            undone: true,
                            source,
                        },
                        None => ManagerError::Deadline { id, undone: true },
                    });
                }
            };
            if !created {
                return Err(ManagerError::Regeneration {
                    id,
                    undone: false,
                    source,
                });
            }
            let identity_unavailable =
                source.step == RegenerationStep::Identity && source.status.code() == Code::Unavailable;
            let delay = backoff.next_delay();
            if identity_unavailable && started.elapsed() + delay < deadline {
                let attempts = unavailable.as_ref().map_or(0, |(n, _)| *n) + 1;
                tracing::info!(endpoint = id, attempts, error = %source, "no identity yet (svc-identity unavailable); retrying within the deadline");
                unavailable = Some((attempts, source));
                tokio::time::sleep(delay).await;
                generation = queue.request("identity allocation retried");
                continue;
            }
            let undone = self.undo_failed_create(id, &source).await;
            return Err(match unavailable {
                Some((attempts, _)) if identity_unavailable => ManagerError::IdentityUnavailable {
                    id,
                    attempts: attempts + 1,
                    waited: started.elapsed(),
                    undone,
                    source,
                },
                _ => ManagerError::Regeneration { id, undone, source },
            });
        }
    }

    /// Removes the endpoint of a failed synchronous create; whether it is
    /// gone (otherwise the worker keeps trying in the background).
    async fn undo_failed_create(&self, id: u16, failure: &RegenError) -> bool {
        match self.remove_and_wait(id, RemovalReason::CreateFailed, None).await {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(endpoint = id, failure = %failure, error = %e, "undoing a failed create failed; the endpoint stays disconnecting and is retried");
                false
            }
        }
    }

    // ------------------------------------------------------------ delete --

    /// Removes the selected endpoints (datapath, identity reference, ipcache
    /// entries, state dir). Does not release addresses: the caller does,
    /// once this returned. Returns the ids removed; an empty list when
    /// nothing matched. On failure, or when `deadline` passes first, the
    /// endpoint stays `disconnecting`, its worker retries until it is gone
    /// and then releases its addresses too (the caller keeps them).
    pub async fn delete(&self, selector: &EndpointSelector, deadline: Duration) -> Result<Vec<u16>, ManagerError> {
        let started = Instant::now();
        // Only the local state dir scan: never waits for another daemon.
        let _ = self.inner.scanned.subscribe().wait_for(|s| *s).await;
        let ids = self.state().find(selector);
        let mut deleted = Vec::new();
        for id in ids {
            let remaining = deadline.saturating_sub(started.elapsed());
            self.remove_and_wait(id, RemovalReason::Deleted, Some(remaining))
                .await?;
            deleted.push(id);
        }
        Ok(deleted)
    }

    /// Requests the endpoint's removal from its worker and waits for that
    /// attempt (at most `deadline`). A caller told about a failure keeps the
    /// endpoint's addresses, so the worker releases them once it succeeds.
    async fn remove_and_wait(
        &self,
        id: u16,
        reason: RemovalReason,
        deadline: Option<Duration>,
    ) -> Result<(), ManagerError> {
        let Some((queue, attempt)) = self.request_removal(id, reason) else {
            return Ok(());
        };
        // Also when the call is cancelled (its client gave up first).
        let mut keeps = CallerKeepsAddresses {
            manager: self,
            id,
            queue: &queue,
            armed: true,
        };
        let waited = match deadline {
            Some(deadline) => tokio::time::timeout(deadline, queue.wait_removal(attempt)).await,
            None => Ok(queue.wait_removal(attempt).await),
        };
        let failure = match waited {
            Ok(Ok(())) => {
                keeps.armed = false;
                return Ok(());
            }
            Ok(Err(failure)) => failure,
            Err(_) => {
                // Either it is gone now, or its addresses will be released
                // when it is.
                keeps.armed = false;
                if !self.caller_keeps_addresses(id, &queue) {
                    return Ok(());
                }
                RemovalFailure {
                    step: "waiting",
                    status: Status::unavailable(
                        "the removal did not finish within the call's deadline (a regeneration or a dependency is slow)",
                    ),
                }
            }
        };
        Err(ManagerError::Removal {
            id,
            step: failure.step,
            status: failure.status,
        })
    }

    /// Asks the worker to release the addresses of endpoint `id` once it is
    /// gone, because a caller of its removal keeps them (it was not told the
    /// removal succeeded); whether the endpoint is still there (false: it is
    /// gone already, the removal succeeded). Decided under the state lock,
    /// where the worker forgets the endpoint.
    fn caller_keeps_addresses(&self, id: u16, queue: &Queue) -> bool {
        let state = self.state();
        let present = state.endpoints.contains_key(&id);
        if present {
            queue.release_addresses_when_gone();
        }
        present
    }

    /// Marks the endpoint `disconnecting` and asks its worker for a removal
    /// attempt; the queue and the attempt to wait for (`None`: no such
    /// endpoint).
    fn request_removal(&self, id: u16, reason: RemovalReason) -> Option<(Arc<Queue>, u64)> {
        let mut state = self.state();
        let slot = state.endpoints.get_mut(&id)?;
        slot.status
            .transition(id, EndpointState::Disconnecting, reason.as_str());
        let queue = slot.queue.clone();
        self.update_state_metrics(&state);
        let attempt = queue.request_removal(reason);
        Some((queue, attempt))
    }

    /// One removal attempt: everything of the endpoint, and its addresses
    /// when `release_addresses`. Each step tolerates "already gone".
    async fn remove_once(&self, spec: &EndpointSpec, release_addresses: bool) -> Result<(), RemovalFailure> {
        self.release_everything(spec)
            .await
            .map_err(|(step, status)| RemovalFailure { step, status })?;
        if release_addresses && spec.addresses.iter().any(|a| !a.ipam_pool.is_empty()) {
            let released = self
                .inner
                .deps
                .ipam
                .release(ipampb::ReleaseRequest {
                    owner: Some(ipam_owner(spec)),
                })
                .await
                .map_err(|status| RemovalFailure {
                    step: "addresses",
                    status,
                })?;
            let addresses: Vec<&str> = released.released.iter().map(|a| a.address.as_str()).collect();
            tracing::info!(
                endpoint = spec.id,
                ?addresses,
                "released the addresses of a removed endpoint"
            );
        }
        Ok(())
    }

    /// The worker's removal: attempts with backoff until the endpoint is
    /// gone; a new removal request cuts the wait short.
    async fn remove_until_gone(&self, id: u16, queue: &Queue) {
        let mut backoff = self.inner.options.retry_backoff.clone();
        let mut failures = 0u32;
        loop {
            let (attempt, release_addresses) = queue.removal_target();
            let Some(spec) = self.state().endpoints.get(&id).map(|s| s.spec.clone()) else {
                queue.finish_removal(attempt, Ok(true));
                return;
            };
            let result = {
                let _serialised = queue.lock.lock().await;
                self.remove_once(&spec, release_addresses).await
            };
            match result {
                Ok(()) => {
                    if self.forget(id, queue, release_addresses) {
                        queue.finish_removal(attempt, Ok(true));
                        return;
                    }
                    // A caller gave up meanwhile: once more, with the addresses.
                    queue.finish_removal(attempt, Ok(false));
                }
                Err(failure) => {
                    failures += 1;
                    {
                        let mut state = self.state();
                        if let Some(slot) = state.endpoints.get_mut(&id) {
                            slot.status.last_error = Some(RegenerationFailure {
                                step: RegenerationStep::Datapath,
                                message: format!("removal failed at {}: {}", failure.step, failure.status.message()),
                                at: SystemTime::now(),
                            });
                        }
                    }
                    events::removal_failed(&self.inner.metrics, id, failure.step, &failure.status, failures);
                    queue.finish_removal(attempt, Err(failure));
                    tokio::select! {
                        () = tokio::time::sleep(backoff.next_delay()) => {}
                        () = queue.wake.notified() => {}
                    }
                }
            }
        }
    }

    /// Forgets a removed endpoint, unless its addresses must be released
    /// and this attempt did not (a caller gave up after it started).
    fn forget(&self, id: u16, queue: &Queue, released_addresses: bool) -> bool {
        let mut state = self.state();
        let removal = queue.outcome().removal;
        if removal.release_addresses && !released_addresses {
            return false;
        }
        let Some(mut slot) = state.endpoints.remove(&id) else {
            return true;
        };
        let reason = removal.reason.unwrap_or(RemovalReason::Deleted);
        slot.status.transition(id, EndpointState::Disconnected, reason.as_str());
        // Peers stop resolving its named ports.
        self.named_ports_changed(
            &mut state,
            [slot.status.identity],
            slot.spec.addresses.iter().map(|a| a.address),
            "named ports changed",
        );
        // The pod's remembered labels go with its last endpoint (a reused
        // name must not inherit them), unless a failed create is undone:
        // the runtime retries that pod.
        let pod = (slot.spec.pod_namespace.clone(), slot.spec.pod_name.clone());
        if reason != RemovalReason::CreateFailed
            && !pod.1.is_empty()
            && !state.endpoints.values().any(|s| s.spec.is_pod(&pod.0, &pod.1))
        {
            state.pod_labels.remove(&pod);
        }
        self.update_state_metrics(&state);
        drop(state);
        let spec = &slot.spec;
        let addresses: Vec<String> = spec.addresses.iter().map(|a| a.address.to_string()).collect();
        if removal.attempted > 0 {
            events::removal_converged(
                &self.inner.metrics,
                id,
                reason.as_str(),
                removal.attempted,
                released_addresses,
            );
        }
        match reason {
            RemovalReason::Deleted => events::endpoint_deleted(id, reason.as_str()),
            _ => events::endpoint_dropped(
                &self.inner.metrics,
                id,
                reason.as_str(),
                &format!(
                    "{} ({}) addresses {addresses:?}{}",
                    spec.host_interface,
                    spec.container_id,
                    if released_addresses { " released" } else { "" },
                ),
            ),
        }
        true
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
                if slot.spec.labels == labels || slot.queue.is_closed() {
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
            if slot.spec.pod_namespace == namespace && !slot.queue.is_closed() {
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

    /// Records a completed scan of the policy dir and the files it rejected
    /// (file, reason).
    pub fn policy_dir_scanned(&self, dir: &std::path::Path, rejected: &[(std::path::PathBuf, String)]) {
        events::policy_dir_scanned(&self.inner.metrics, dir, rejected);
        let mut status = self.inner.policy_dir.lock().expect("policy dir lock poisoned");
        status.dir = Some(dir.to_path_buf());
        status.scans += 1;
        status.files_rejected += rejected.len() as u64;
        status.last_error = rejected
            .iter()
            .map(|(file, reason)| format!("{}: {reason}", file.display()))
            .collect::<Vec<_>>()
            .join("; ");
    }

    /// What the policy dir watcher did.
    pub fn policy_dir_status(&self) -> PolicyDirStatus {
        self.inner.policy_dir.lock().expect("policy dir lock poisoned").clone()
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
                .filter(|s| !s.queue.is_closed() && s.policy_labels().is_some_and(|l| change.affects(l)))
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
    ///
    /// One pass at a time (a policy change and the background retry both
    /// run it), each reading the desired prefixes when it starts and again
    /// after svc-identity answered: a prefix whose policy went meanwhile is
    /// never inserted but released, so the latest desired state wins.
    /// Releases that failed are kept and retried by the next pass.
    async fn reconcile_cidrs(&self, reallocate: bool) -> Result<(), Status> {
        let _pass = self.inner.cidr_pass.lock().await;
        let missing: Vec<IpNet> = {
            let state = self.state();
            state
                .desired_cidrs()
                .into_iter()
                .filter(|p| reallocate || !state.cidr_identities.contains_key(p))
                .collect()
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
            let desired = state.desired_cidrs();
            for identity in response.identities {
                let Ok(prefix) = identity.prefix.parse::<IpNet>() else {
                    tracing::warn!(prefix = identity.prefix, "svc-identity returned an unparseable prefix");
                    continue;
                };
                if desired.contains(&prefix) {
                    state.cidr_identities.insert(prefix, identity.id);
                    state.selectors.set_cidr_identity(prefix, identity.id);
                } else {
                    // Its policy went while svc-identity allocated it.
                    state.cidr_releases.insert(prefix);
                }
            }
            self.queue_changed_policies(&mut state, "CIDR identities allocated");
        }
        let releases: Vec<IpNet> = {
            let mut state = self.state();
            let desired = state.desired_cidrs();
            let extra: Vec<IpNet> = state
                .cidr_identities
                .keys()
                .filter(|p| !desired.contains(p))
                .copied()
                .collect();
            for prefix in &extra {
                state.cidr_identities.remove(prefix);
                state.selectors.remove_cidr_identity(prefix);
                state.cidr_releases.insert(*prefix);
            }
            self.queue_changed_policies(&mut state, "CIDR identities released");
            // Desired again before its release went out: it stays allocated.
            state.cidr_releases.retain(|p| !desired.contains(p));
            state.cidr_releases.iter().copied().collect()
        };
        if !releases.is_empty() {
            self.inner
                .deps
                .identity
                .release_cidrs(idpb::ReleaseCidrIdentitiesRequest {
                    prefixes: releases.iter().map(ToString::to_string).collect(),
                    owner: CIDR_OWNER.into(),
                })
                .await?;
            let mut state = self.state();
            for prefix in &releases {
                state.cidr_releases.remove(prefix);
            }
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

    /// After the selector cache changed: queues a regeneration of every
    /// endpoint a policy whose resolution the change can alter selects
    /// (nothing is resolved here). An endpoint counts with the labels its
    /// running regeneration resolved for, else with those of its realised
    /// policy: a change that arrives during a regeneration always leads to
    /// one more (coalesced) regeneration. Endpoints that have not resolved
    /// yet will see the change anyway.
    fn queue_changed_policies(&self, state: &mut State, reason: &str) -> usize {
        let changes = state.selectors.take_changes();
        let affected = state.repository.affected_by(&changes);
        if affected.is_empty() {
            return 0;
        }
        let mut queued = 0;
        for slot in state.endpoints.values() {
            if slot.queue.is_closed() {
                continue;
            }
            let Some(labels) = slot.policy_labels() else {
                continue;
            };
            if affected.iter().any(|policy| policy.selects(labels)) {
                slot.queue.request(reason);
                queued += 1;
            }
        }
        if queued > 0 {
            tracing::debug!(
                endpoints = queued,
                policies = affected.len(),
                reason,
                "policy of endpoints changed"
            );
        }
        queued
    }

    /// After endpoints holding `identities` or `addresses` came, went or
    /// changed: their named ports in the selector cache, the CIDR identities
    /// of the host prefixes those need (in the background), and a
    /// regeneration of the endpoints whose policies they can change.
    fn named_ports_changed(
        &self,
        state: &mut State,
        identities: impl IntoIterator<Item = u32>,
        addresses: impl IntoIterator<Item = IpAddr>,
        reason: &str,
    ) {
        if state.refresh_named_ports(identities, addresses) {
            self.inner.cidr_wake.notify_one();
        }
        self.queue_changed_policies(state, reason);
    }

    // ------------------------------------------------------- regeneration --

    fn spawn_worker(&self, id: u16, queue: Arc<Queue>) {
        let this = self.clone();
        tokio::spawn(async move { this.run_worker(id, queue).await });
    }

    /// The endpoint's worker: regenerates while requests come, removes the
    /// endpoint once asked to and exits when it is gone.
    async fn run_worker(&self, id: u16, queue: Arc<Queue>) {
        let mut backoff = self.inner.options.retry_backoff.clone();
        loop {
            if queue.is_closed() {
                self.remove_until_gone(id, &queue).await;
                return;
            }
            let Some(target) = queue.take_pending() else {
                queue.wake.notified().await;
                continue;
            };
            // The permit first, without the endpoint's lock: a removal never
            // waits behind other endpoints' regenerations.
            let _permit = tokio::select! {
                permit = self.inner.permits.acquire() => permit.expect("semaphore never closed"),
                () = queue.closed() => {
                    queue.finish(target.generation, Err(RegenError::aborted(RegenerationStep::Identity)));
                    continue;
                }
            };
            let result = {
                let _serialised = queue.lock.lock().await;
                let span = tracing::info_span!(parent: &target.requester, "regenerate", endpoint = id, reason = %target.reason);
                self.regenerate(id, &target.reason, &queue).instrument(span).await
            };
            drop(_permit);
            let failure = result.as_ref().err().cloned();
            queue.finish(target.generation, result);
            let Some(e) = failure else {
                backoff.reset();
                continue;
            };
            if queue.is_closed() || !queue.retry.load(Ordering::SeqCst) {
                continue;
            }
            if e.step == RegenerationStep::Datapath && e.status.code() == Code::NotFound {
                // svc-loader says the host interface is gone: the pod went
                // without a DEL. (Another interface at its ifindex is found
                // by the periodic check and at restore.)
                self.drop_endpoint(id, RemovalReason::InterfaceGone);
                continue;
            }
            // Retried after a backoff; a new request or a removal cuts it short.
            tokio::select! {
                () = tokio::time::sleep(backoff.next_delay()) => {
                    queue.request("retry after failure");
                }
                () = queue.wake.notified() => {}
            }
        }
    }

    /// Moves an endpoint that is not being removed to `to`.
    fn set_state(&self, id: u16, to: EndpointState, reason: &str) {
        let mut state = self.state();
        let Some(slot) = state.endpoints.get_mut(&id) else {
            return;
        };
        if slot.queue.is_closed() {
            return;
        }
        slot.status.transition(id, to, reason);
        self.update_state_metrics(&state);
    }

    /// One regeneration: identity → policy → datapath → ipcache → state dir.
    /// Stops before the next step once the endpoint is being removed
    /// (ABORTED; the removal that follows undoes what was done).
    async fn regenerate(&self, id: u16, reason: &str, queue: &Queue) -> Result<(), RegenError> {
        let started = Instant::now();
        let (spec, request_labels, previous_identity, restoring) = {
            let state = self.state();
            let Some(slot) = state.endpoints.get(&id) else {
                return Ok(());
            };
            if queue.is_closed() {
                return Err(RegenError::aborted(RegenerationStep::Identity));
            }
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
        let result = self
            .run_steps(&spec, request_labels, previous_identity, reason, queue)
            .await;
        let (e, failed) = {
            let mut state = self.state();
            let Some(slot) = state.endpoints.get_mut(&id) else {
                return result.map(|_| ());
            };
            slot.resolving = None;
            if queue.is_closed() {
                // Being removed: no state change, nothing kept for debugging.
                return result.map(|_| ());
            }
            match result {
                Ok((identity, identity_labels, resolved, revision, record)) => {
                    let took = started.elapsed();
                    let addresses: Vec<IpAddr> = slot.spec.addresses.iter().map(|a| a.address).collect();
                    let previous = std::mem::replace(&mut slot.status.identity, identity);
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
                    self.named_ports_changed(&mut state, [previous, identity], addresses, "named ports changed");
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
        queue: &Queue,
    ) -> Result<(u32, Labels, ResolvedPolicy, u64, Option<EndpointRecord>), RegenError> {
        let deps = &self.inner.deps;
        let id = spec.id;
        let open = |step| {
            if queue.is_closed() {
                Err(RegenError::aborted(step))
            } else {
                Ok(())
            }
        };
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
        // 2. policy: its inputs under the lock, the resolution without it
        let (prepared, revision) = {
            let mut state = self.state();
            let prepared = state.repository.prepare(&identity_labels, &state.selectors);
            if let Some(slot) = state.endpoints.get_mut(&id) {
                slot.resolving = Some(identity_labels.clone());
            }
            (prepared, state.repository.revision())
        };
        let resolved = self
            .resolve_policy(id, prepared, identity_labels.clone(), spec.named_ports.clone())
            .await?;
        // 3. datapath
        open(RegenerationStep::Datapath)?;
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
        open(RegenerationStep::Ipcache)?;
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
        open(RegenerationStep::StateDir)?;
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

    /// Resolves prepared policy inputs: on the async thread when small, on a
    /// blocking thread when large (thousands of peer identities), so a big
    /// policy never stalls the runtime. No lock is held either way.
    async fn resolve_policy(
        &self,
        id: u16,
        prepared: Resolution,
        labels: Labels,
        named_ports: Vec<NamedPort>,
    ) -> Result<ResolvedPolicy, RegenError> {
        let started = Instant::now();
        let blocking = prepared.weight() > self.inner.options.blocking_resolution_above;
        let resolve = move || {
            prepared.resolve(&Subject {
                labels: &labels,
                named_ports: &named_ports,
            })
        };
        let resolved = if blocking {
            tokio::task::spawn_blocking(resolve).await.map_err(|e| {
                RegenError::new(
                    RegenerationStep::Policy,
                    Status::internal(format!("resolving the policy of endpoint {id}: {e}")),
                )
            })?
        } else {
            resolve()
        };
        events::policy_resolved(
            &self.inner.metrics,
            id,
            resolved.entries.len(),
            started.elapsed(),
            blocking,
        );
        Ok(resolved)
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
                // Its worker removes it at once if asked; regenerations wait
                // until restore released it below.
                let queue = Queue::new(true, true);
                self.spawn_worker(id, queue.clone());
                queues.push((id, queue.clone()));
                state.next_id = state.next_id.max(id.wrapping_add(1)).max(1);
                state.endpoints.insert(
                    id,
                    Slot {
                        spec: record.spec.clone(),
                        status,
                        queue,
                        persisted: Some(record),
                        resolving: None,
                    },
                );
            }
            // Peers' named ports before any regeneration: an endpoint
            // restored before the peers whose ports its rules name would
            // otherwise lose those entries until they regenerated.
            let identities: Vec<u32> = state.endpoints.values().map(|s| s.status.identity).collect();
            let addresses: Vec<IpAddr> = state
                .endpoints
                .values()
                .flat_map(|s| s.spec.addresses.iter().map(|a| a.address))
                .collect();
            self.named_ports_changed(&mut state, identities, addresses, "named ports restored");
            self.update_state_metrics(&state);
        }
        self.inner.scanned.send_replace(true);
        self.inner.restore.lock().expect("restore lock poisoned").found = found;

        // The datapath's view: which restored endpoints lost their interface,
        // which ids it holds that no endpoint owns.
        let listed = self
            .retry_until_ok("svc-loader ListEndpoints", || self.inner.deps.loader.list())
            .await;
        let mut dropped = {
            let mut state = self.state();
            for held in &listed.endpoints {
                let Ok(id) = u16::try_from(held.endpoint_id) else {
                    continue;
                };
                if state
                    .endpoints
                    .get(&id)
                    .is_none_or(|slot| slot.spec.host_ifindex != held.host_ifindex)
                {
                    // Not ours (or moved): cleaned after restore; never reuse the id before.
                    state.reserved_ids.insert(id);
                }
            }
            for id in &listed.orphan_policy_endpoint_ids {
                if let Ok(id) = u16::try_from(*id) {
                    state.reserved_ids.insert(id);
                }
            }
            let held: Vec<_> = listed.endpoints.iter().map(listed_interface).collect();
            state.lost_interfaces(&held)
        };
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
                let generation = queue.request("restored");
                queue.release_hold();
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
                    dropped.push((id, RemovalReason::InterfaceGone));
                }
                Err(e) if e.step == RegenerationStep::Datapath && e.status.code() == Code::FailedPrecondition => {
                    dropped.push((id, RemovalReason::InterfaceReplaced));
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
            if let Err(e) = self.remove_and_wait(*id, *reason, None).await {
                tracing::error!(endpoint = id, error = %e, "dropping a dead endpoint failed; retrying in the background");
            }
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
        let Some((queue, spec)) = self
            .state()
            .endpoints
            .get(&id)
            .map(|s| (s.queue.clone(), s.spec.clone()))
        else {
            return Ok(());
        };
        for address in spec.addresses.iter().filter(|a| !a.ipam_pool.is_empty()) {
            let request = ipampb::RestoreRequest {
                owner: Some(ipam_owner(&spec)),
                pool: address.ipam_pool.clone(),
                address: address.address.to_string(),
            };
            // Each call holds the endpoint's lock, as a removal attempt does:
            // a concurrent DeleteEndpoint then completes either before (the
            // queue is closed and nothing is re-reserved) or after the call
            // (and the CNI releases the addresses only once its delete
            // returned). Without it a resync after a svc-ipam restart could
            // re-reserve the addresses of a pod the CNI had just deleted and
            // released: a leak. Never held across the retries' waits, so a
            // delete does not wait for svc-ipam to come back.
            self.retry_while_unavailable(|| async {
                let _serialised = queue.lock.lock().await;
                if queue.is_closed() {
                    return Ok(());
                }
                self.inner.deps.ipam.restore(request.clone()).await.map(drop)
            })
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

    /// Removes an endpoint whose pod is gone without a DEL (its interface
    /// is gone) and releases its addresses; its worker does it.
    fn drop_endpoint(&self, id: u16, reason: RemovalReason) {
        self.request_removal(id, reason);
    }

    /// Every `interface_check`, once restore is done: endpoints whose host
    /// interface disappeared while they ran (the pod's netns went without a
    /// DEL, e.g. a runtime leaking a sandbox) are dropped and their
    /// addresses released, as at restore. svc-loader answers from one link
    /// dump (ListEndpointInterfaces), not per-interface tc queries.
    async fn check_interfaces_forever(&self) {
        let period = self.inner.options.interface_check;
        if period.is_zero() {
            return;
        }
        self.restored().await;
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let loader = &self.inner.deps.loader;
            let (held, unnamed) = match loader.interfaces().await {
                Ok(listed) => (listed.endpoints, Vec::new()),
                // An svc-loader older than this daemon: its full listing.
                Err(e) if e.code() == Code::Unimplemented => match loader.list().await {
                    Ok(listed) => (
                        listed.endpoints.iter().map(listed_interface).collect(),
                        self.state().unnamed_interfaces(&listed),
                    ),
                    Err(e) => {
                        tracing::debug!(error = %e, "listing the datapath for lost interfaces failed; next time");
                        continue;
                    }
                },
                Err(e) => {
                    tracing::debug!(error = %e, "listing the endpoints' interfaces failed; next time");
                    continue;
                }
            };
            let lost = self.state().lost_interfaces(&held);
            for (id, reason) in lost {
                self.drop_endpoint(id, reason);
            }
            // An older svc-loader could not name the interface: a
            // regeneration asks it for certain (ApplyEndpoint answers
            // NOT_FOUND for a gone interface, and the worker drops the
            // endpoint then).
            let state = self.state();
            for id in unnamed {
                if let Some(slot) = state.endpoints.get(&id) {
                    slot.queue.request("interface check");
                }
            }
        }
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
        for slot in state.endpoints.values().filter(|s| !s.queue.is_closed()) {
            slot.queue.request(reason);
        }
    }
}

/// Why svc-loader's view of an endpoint says its pod is gone: the host
/// interface is gone, or its ifindex names another interface now.
fn interface_lost(held: &ldpb::EndpointInterface, spec: &EndpointSpec) -> Option<RemovalReason> {
    if held.gone {
        return Some(RemovalReason::InterfaceGone);
    }
    let renamed = !held.host_ifname.is_empty() && held.host_ifname != spec.host_interface;
    renamed.then_some(RemovalReason::InterfaceReplaced)
}

/// An endpoint of svc-loader's full listing as its interface listing
/// would say it: gone when a hook says so.
fn listed_interface(held: &ldpb::Endpoint) -> ldpb::EndpointInterface {
    ldpb::EndpointInterface {
        endpoint_id: held.endpoint_id,
        host_ifindex: held.host_ifindex,
        host_ifname: held.host_ifname.clone(),
        gone: held.from_container == ldpb::AttachState::InterfaceGone as i32
            || held.to_container == ldpb::AttachState::InterfaceGone as i32,
    }
}

/// While armed, a caller waiting for a removal has not been told it
/// succeeded: on drop (an error, or the call cancelled by its client) the
/// worker is asked to release the endpoint's addresses once it is gone,
/// because such a caller keeps them (rivet-cni does; see
/// [`EndpointManager::caller_keeps_addresses`]). (A removal that completes
/// in the instant its caller goes away still leaves the addresses to the
/// caller.)
struct CallerKeepsAddresses<'a> {
    manager: &'a EndpointManager,
    id: u16,
    queue: &'a Queue,
    armed: bool,
}

impl Drop for CallerKeepsAddresses<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.manager.caller_keeps_addresses(self.id, self.queue);
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
