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
//!
//! The manager's concerns, one module each: `create` and
//! `removal` (an endpoint's lifecycle), `queue` and `worker` (each endpoint's
//! requests and the task that serves them), `regeneration` (its steps),
//! `labels` (pod and namespace labels), `policies` and `cidr` (policy and
//! selector-cache changes, CIDR identities), `restore` (on start),
//! `interfaces` (endpoints whose pod went without a DEL) and `dependencies`
//! (svc-identity's watch, boot-id probes and resyncs); `error` says how
//! calls fail.

mod cidr;
mod create;
mod dependencies;
mod endpoint_watch;
mod error;
mod interfaces;
mod kubernetes;
mod labels;
mod pods;
mod policies;
mod queue;
mod regeneration;
mod removal;
mod restore;
mod service_pods;
mod worker;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ipnet::IpNet;
use rivet_common::backoff::Backoff;
use rivet_common::controller::{Controller, Controllers, Trigger};
use rivet_common::labels::Labels;
use rivet_common::state_file::StateFile;
use rivet_policy::{Policy, PolicyOrigin, PolicyRepository, SelectorCache};
use rivet_proto::ipam::v1 as ipampb;
use tokio::sync::{Notify, Semaphore, watch};

use crate::clients::{IdentityApi, IpamApi, LoaderApi, PodDirectoryApi};
use crate::endpoint::{EndpointSpec, EndpointState, EndpointStatus, MAX_ENDPOINT_ID};
use crate::events::EndpointMetrics;
use crate::state_dir::{EndpointRecord, EndpointStateDir};
use queue::Queue;
use worker::Workers;

use dependencies::Dependency;
pub use dependencies::DependencyStatus;
pub use endpoint_watch::EndpointEvent;
pub use error::{ManagerError, RegenError};
pub use kubernetes::{KubernetesReplay, PodMetadata, PodName, ReplayOutcome};
pub use labels::{DEFAULT_NAMESPACE, NAMESPACE_NAME_LABEL, NamespaceLabels, parse_namespace_label};
pub use policies::{PolicyDirStatus, PolicySources, PolicySourcesError, PolicyUpdate};
pub use restore::RestoreProgress;

/// The daemons svc-endpoint drives.
#[derive(Clone)]
pub struct Dependencies {
    /// svc-identity.
    pub identity: Arc<dyn IdentityApi>,
    /// svc-ipam.
    pub ipam: Arc<dyn IpamApi>,
    /// svc-loader.
    pub loader: Arc<dyn LoaderApi>,
    /// svc-k8s-sync's pod directory: `Some` puts the node in Kubernetes
    /// mode (pod labels and named ports from PodMetadataService only; see
    /// the `kubernetes` module).
    pub pods: Option<Arc<dyn PodDirectoryApi>>,
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
    /// The policy origins accepted; `None`: [`PolicySources::default_for`]
    /// the mode.
    pub policy_sources: Option<PolicySources>,
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
            policy_sources: None,
        }
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
    /// [`ChangeFeed`] revision of its last change (WatchEndpoints readers
    /// send the endpoints whose revision moved).
    changed: u64,
    /// The svc-identity boot id its last regeneration claimed its identity
    /// reference and IP cache entries in (`EndReplay` waits for every
    /// endpoint's claims in the current boot).
    claimed_in: Option<String>,
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
    /// Kubernetes mode: each pod's metadata from svc-k8s-sync.
    pod_metadata: BTreeMap<kubernetes::PodName, PodMetadata>,
    /// Kubernetes mode: restored endpoints svc-k8s-sync could not say
    /// whether their pod exists (checked again by `pod-check`).
    pods_unchecked: BTreeSet<u16>,
    repository: PolicyRepository,
    selectors: SelectorCache,
    cidr_identities: BTreeMap<IpNet, u32>,
    /// Other nodes' pods with named ports, by address, from svc-identity's
    /// ipcache (`ipcache-watch`): egress rules naming a port resolve
    /// against them as against local endpoints'.
    remote_named_ports: BTreeMap<IpAddr, RemoteNamedPorts>,
    /// Other nodes' pods by address, from the same ipcache watch (the
    /// service catalog's selectors take them as backends).
    remote_pods: BTreeMap<IpAddr, service_pods::RemotePod>,
    /// CIDR identities no policy wants any more whose release svc-identity
    /// has not confirmed yet.
    cidr_releases: BTreeSet<IpNet>,
    /// Tells WatchEndpoints readers that endpoints changed.
    changes: ChangeFeed,
}

/// Another node's pod as the ipcache describes it: its identity and the
/// named ports it declares.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RemoteNamedPorts {
    identity: u32,
    ports: Vec<rivet_policy::NamedPort>,
}

/// A revision counter of endpoint changes and a watch of it: every change
/// of an endpoint (state, identity, labels, realised policy, error,
/// creation, removal) takes the next revision and publishes it. Readers
/// never block the manager: they wake on the latest revision and compare
/// [`Slot::changed`] with what they sent (coalescing what they missed).
#[derive(Debug)]
struct ChangeFeed {
    revision: u64,
    published: watch::Sender<u64>,
}

impl Default for ChangeFeed {
    fn default() -> Self {
        Self {
            revision: 0,
            published: watch::channel(0).0,
        }
    }
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

    /// Records a change of endpoint `id` (also its removal) for
    /// WatchEndpoints readers.
    fn changed(&mut self, id: u16) {
        self.changes.revision += 1;
        let revision = self.changes.revision;
        if let Some(slot) = self.endpoints.get_mut(&id) {
            slot.changed = revision;
        }
        self.changes.published.send_replace(revision);
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
    /// The policy origins accepted (the options', or the mode's default).
    policy_sources: PolicySources,
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
    /// Set once `ipcache-watch` holds svc-identity's first complete
    /// snapshot (the service catalog waits for it: other nodes' pods).
    ipcache_synced: watch::Sender<bool>,
    /// One per [`Dependency`], in the order of [`Dependency::ALL`].
    dependencies: Mutex<[DependencyStatus; Dependency::ALL.len()]>,
    /// The svc-identity boot id this process ended its replay to.
    replay_ended: Mutex<Option<String>>,
    policy_dir: Mutex<PolicyDirStatus>,
    /// Wakes the CIDR identity reconciliation (`cidr-identities`).
    cidr_wake: Trigger,
    /// The next pass of `cidr-identities` allocates every prefix again
    /// (svc-identity restarted and forgot them, and the replay failed).
    cidr_reallocate: AtomicBool,
    /// CIDR passes asked for by [`EndpointManager::cidrs_reconciled`].
    cidr_requested: AtomicU64,
    /// The latest of those requests a successful pass covered.
    cidr_reconciled: watch::Sender<u64>,
    /// Every endpoint's worker, supervised by `endpoint-workers`.
    workers: Mutex<Workers>,
    /// Wakes `endpoint-workers` when a worker was added.
    workers_added: Notify,
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
        let policy_sources = options
            .policy_sources
            .unwrap_or_else(|| PolicySources::default_for(deps.pods.is_some()));
        let mut state = State {
            next_id: 1,
            ..State::default()
        };
        state.namespaces = namespaces_file
            .load()
            .map_err(|source| ManagerError::Storage {
                action: "loading namespace labels".into(),
                source,
            })?
            .unwrap_or_default();
        let documents: Vec<String> = api_policies
            .load()
            .map_err(|source| ManagerError::Storage {
                action: "loading API policies".into(),
                source,
            })?
            .unwrap_or_default();
        if !policy_sources.accepts(PolicyOrigin::Api) && !documents.is_empty() {
            tracing::warn!(
                policies = documents.len(),
                sources = %policy_sources,
                "API policies are persisted but the API is not a policy source: not applied (the file is kept)"
            );
        }
        let documents = documents
            .into_iter()
            .filter(|_| policy_sources.accepts(PolicyOrigin::Api));
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
            policy_sources,
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
            ipcache_synced: watch::channel(false).0,
            dependencies: Mutex::new(Dependency::ALL.map(|dependency| DependencyStatus {
                name: dependency.name(),
                ..Default::default()
            })),
            replay_ended: Mutex::new(None),
            policy_dir: Mutex::default(),
            cidr_wake: Trigger::new(),
            cidr_reallocate: AtomicBool::new(false),
            cidr_requested: AtomicU64::new(0),
            cidr_reconciled: watch::channel(0).0,
            workers: Mutex::default(),
            workers_added: Notify::new(),
            config_lock: tokio::sync::Mutex::new(()),
            cidr_pass: tokio::sync::Mutex::new(()),
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().expect("endpoint state lock poisoned")
    }

    /// Starts restore and the background loops as `controllers` (each
    /// restarted when it panics or ends, counted and shown in `rivet
    /// status`): `endpoint-restore` (once), `endpoint-workers` (supervises
    /// every endpoint's worker), `identity-watch`, `ipcache-watch`,
    /// `dependency-probe`,
    /// `cidr-identities` and, unless disabled, `interface-check`. Returns at
    /// once; restore progress is in [`restore_progress`](Self::restore_progress).
    pub fn start(&self, controllers: &Controllers) {
        let backoff = self.inner.options.retry_backoff.clone();
        let controller = |name| Controller::new(name).backoff(backoff.clone());
        let this = self.clone();
        controllers.reconcile(controller("endpoint-restore"), move || {
            let this = this.clone();
            async move { this.restore().await }
        });
        let this = self.clone();
        controllers.supervise(controller("endpoint-workers"), move |progress| {
            let this = this.clone();
            async move { this.supervise_workers(progress).await }
        });
        let this = self.clone();
        controllers.supervise(controller("identity-watch"), move |progress| {
            let this = this.clone();
            async move { this.watch_identities(progress).await }
        });
        let this = self.clone();
        controllers.supervise(controller("ipcache-watch"), move |progress| {
            let this = this.clone();
            async move { this.watch_ipcache(progress).await }
        });
        let this = self.clone();
        controllers.reconcile(controller("dependency-probe"), move || {
            let this = this.clone();
            async move { this.probe_dependencies().await }
        });
        let this = self.clone();
        controllers.reconcile(
            controller("cidr-identities").trigger(&self.inner.cidr_wake),
            move || {
                let this = this.clone();
                async move { this.reconcile_cidrs_pass().await }
            },
        );
        if self.kubernetes_mode() {
            let this = self.clone();
            controllers.reconcile(controller("pod-check"), move || {
                let this = this.clone();
                async move { this.recheck_pods().await }
            });
        }
        if !self.inner.options.interface_check.is_zero() {
            let this = self.clone();
            controllers.reconcile(controller("interface-check"), move || {
                let this = this.clone();
                async move { this.check_interfaces().await }
            });
        }
    }

    /// The metrics.
    pub fn metrics(&self) -> &EndpointMetrics {
        &self.inner.metrics
    }

    fn view(&self, id: u16) -> Result<EndpointView, ManagerError> {
        let state = self.state();
        let slot = state.endpoints.get(&id).ok_or(ManagerError::NotFound {
            selector: EndpointSelector::Id(id),
        })?;
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
            [] => Err(ManagerError::NotFound {
                selector: selector.clone(),
            }),
            [id] => self.view(*id),
            many => Err(ManagerError::Ambiguous { ids: many.to_vec() }),
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

    fn update_state_metrics(&self, state: &State) {
        self.inner.metrics.set_states(&state.counts());
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
        .map_err(|source| ManagerError::StorageTask {
            action: format!("persisting {what}"),
            source,
        })?
        .map_err(|source| ManagerError::Storage {
            action: format!("persisting {what}"),
            source,
        })
}

/// svc-ipam's owner of an endpoint's addresses (the CNI allocated them with it).
pub fn ipam_owner(spec: &EndpointSpec) -> ipampb::Owner {
    ipampb::Owner {
        container_id: spec.container_id.clone(),
        interface: spec.interface.clone(),
    }
}
