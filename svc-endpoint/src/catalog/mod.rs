//! The service catalog (issue 17 §2): where a node's Services live.
//!
//! svc-endpoint keeps the desired Service and EndpointSlice objects
//! durably in `<state-dir>/services/` ([`store`]), gives each Service its
//! cluster IPs (from `--service-cidr`, one CIDR per family), node ports
//! (30000-32767) and a durable service id per (port name, family)
//! ([`allocate`]), resolves each port and family to its backends
//! ([`backends`]) and pushes the complete result to svc-loader's
//! LoadBalancerService (the `push` module): ReplaceServices at start and whenever
//! the loader's boot id changes, UpsertService / DeleteService for what
//! changed in between, so unchanged services are never touched.
//!
//! Objects come from the API (`rivet service apply`, origin API) or from
//! svc-k8s-sync (origin KUBERNETES, also through its replay); a key
//! belongs to the origin that created it. Allocations: an API Service
//! without clusterIP gets one from the CIDR of each family its
//! ipFamilyPolicy asks for (kept when the Service is applied again without
//! one); a requested clusterIP must be in a `--service-cidr` and not
//! another Service's. A KUBERNETES Service carries the API server's
//! clusterIPs as they are (one without any is stored and gets no loader
//! service). Not for: the gRPC surface (`crate::catalog_api`).

pub mod allocate;
pub mod backends;
pub mod document;
pub mod events;
mod push;
pub mod store;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ipnet::IpNet;
use rivet_common::backoff::Backoff;
use rivet_common::controller::{Controller, Controllers, Trigger};
use rivet_common::state_file::StateFileError;
use rivet_proto::endpoint::v1 as pb;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tonic::{Code, Status};

use crate::clients::LoadBalancerApi;
use allocate::{ClusterIpPool, ServiceCidrError};
use backends::{PodInfo, Resolution, ResolvedService};
use document::{
    ClusterIps, DocumentError, Family, FamilyPolicy, ObjectKey, ObjectKind, ServiceDef, ServiceObject, SliceDef,
};
pub use events::CatalogMetrics;
use store::{ObjectRecord, ObjectStore};

/// Who applied an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// `rivet service apply` and other direct clients.
    Api,
    /// svc-k8s-sync.
    Kubernetes,
}

impl Origin {
    /// `api` or `kubernetes`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::Kubernetes => "kubernetes",
        }
    }

    /// The proto's value.
    pub fn to_proto(self) -> pb::ServiceOrigin {
        match self {
            Self::Api => pb::ServiceOrigin::Api,
            Self::Kubernetes => pb::ServiceOrigin::Kubernetes,
        }
    }
}

/// Where the catalog gets the cluster's pods (for Services with a
/// selector): svc-endpoint's endpoint manager.
pub trait PodSource: Send + Sync + 'static {
    /// Every pod of the cluster this node knows (its endpoints, other
    /// nodes' pods from the ipcache); `None` until that is complete after
    /// a start (restore scanned, ipcache and identities listed), so that a
    /// restart never pushes a backend set with pods missing.
    fn pods(&self) -> Option<Vec<PodInfo>>;
    /// Changes whenever [`pods`](Self::pods) may have changed.
    fn changes(&self) -> watch::Receiver<u64>;
    /// The value [`changes`](Self::changes) holds now: equal revisions
    /// mean equal pods, so a caller that kept the pods of one need not
    /// build them again.
    fn revision(&self) -> u64 {
        *self.changes().borrow()
    }
}

/// How the catalog behaves.
#[derive(Debug, Clone)]
pub struct CatalogOptions {
    /// `<state-dir>`: objects go to `services/` under it.
    pub state_dir: PathBuf,
    /// `--service-cidr`: at most one per family.
    pub service_cidrs: Vec<IpNet>,
    /// This node's name (EndpointSlice `nodeName`s equal to it are local).
    pub node_name: String,
    /// How often svc-loader's boot id is checked (a new one gets the whole set).
    pub loader_poll: Duration,
    /// Delay between retries of a failed push.
    pub retry_backoff: Backoff,
}

impl CatalogOptions {
    /// Defaults with the given state dir and CIDRs.
    pub fn new(state_dir: impl Into<PathBuf>, service_cidrs: Vec<IpNet>, node_name: impl Into<String>) -> Self {
        Self {
            state_dir: state_dir.into(),
            service_cidrs,
            node_name: node_name.into(),
            loader_poll: Duration::from_secs(1),
            retry_backoff: Backoff::new(Duration::from_millis(200), Duration::from_secs(10)),
        }
    }
}

/// Why a catalog call failed.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// The document is invalid (the error names the field).
    #[error("{0}")]
    Invalid(#[from] DocumentError),
    /// The key belongs to another origin.
    #[error("{key} belongs to origin {held_by}, not {origin}", held_by = .held_by.as_str(), origin = .origin.as_str())]
    OriginConflict {
        /// The object.
        key: ObjectKey,
        /// Its origin.
        held_by: Origin,
        /// The caller's.
        origin: Origin,
    },
    /// No clusterIP can be given.
    #[error("{key}: no cluster IP of family {}: {reason}", family.as_str())]
    NoClusterIp {
        /// The Service.
        key: ObjectKey,
        /// The family.
        family: Family,
        /// Why (no CIDR, CIDR full).
        reason: String,
    },
    /// The requested clusterIP is another Service's.
    #[error("{key}: cluster IP {address} belongs to Service {holder}")]
    ClusterIpTaken {
        /// The Service.
        key: ObjectKey,
        /// The address.
        address: IpAddr,
        /// `ns/name` of its holder.
        holder: String,
    },
    /// No such Service.
    #[error("no Service {namespace}/{name}")]
    NotFound {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// With `wait`: svc-loader did not take the result in time (the object
    /// stays applied).
    #[error("{key} is stored, but svc-loader did not hold the result within {deadline:?}")]
    NotRealisedInTime {
        /// The object.
        key: ObjectKey,
        /// The call's deadline.
        deadline: Duration,
    },
    /// With `wait`: svc-loader refused one of the Service's loader services
    /// (the object stays applied; retried on every pass).
    #[error("{key} is stored, but svc-loader refused service id {service_id}: {message}")]
    RefusedByLoader {
        /// The object.
        key: ObjectKey,
        /// The loader service.
        service_id: u32,
        /// svc-loader's message.
        message: String,
    },
    /// Every service id is taken.
    #[error("no free service id")]
    NoServiceId,
    /// The state dir could not be written.
    #[error("{action}: {source}")]
    Storage {
        /// What was being done.
        action: String,
        /// Why.
        #[source]
        source: StateFileError,
    },
    /// Removing a stored object failed.
    #[error("{action}: {source}")]
    Remove {
        /// What was being done.
        action: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The blocking write task died.
    #[error("{action}: {source}")]
    StorageTask {
        /// What was being done.
        action: String,
        /// Why.
        #[source]
        source: tokio::task::JoinError,
    },
}

impl CatalogError {
    /// The gRPC code and `ErrorReason` this error is answered with; `None`
    /// for svc-endpoint's own failures (answered INTERNAL).
    pub fn reason(&self) -> Option<(Code, pb::ErrorReason)> {
        use pb::ErrorReason as R;
        Some(match self {
            CatalogError::Invalid(_) => (Code::InvalidArgument, R::ServiceInvalid),
            CatalogError::OriginConflict { .. } => (Code::FailedPrecondition, R::ServiceOriginConflict),
            CatalogError::NoClusterIp { .. } => (Code::ResourceExhausted, R::ClusterIpUnavailable),
            CatalogError::ClusterIpTaken { .. } => (Code::AlreadyExists, R::ClusterIpUnavailable),
            CatalogError::NotFound { .. } => (Code::NotFound, R::ServiceNotFound),
            CatalogError::NotRealisedInTime { .. } => (Code::DeadlineExceeded, R::NotRealisedInTime),
            CatalogError::RefusedByLoader { .. } => (Code::FailedPrecondition, R::ServiceRefusedByLoader),
            CatalogError::NoServiceId
            | CatalogError::Storage { .. }
            | CatalogError::Remove { .. }
            | CatalogError::StorageTask { .. } => return None,
        })
    }
}

impl From<CatalogError> for Status {
    fn from(e: CatalogError) -> Self {
        let message = e.to_string();
        match e.reason() {
            Some((code, reason)) => rivet_common::grpc::status_with_reason(code, message, reason),
            None => Status::internal(message),
        }
    }
}

/// A stored Service with its allocations.
#[derive(Debug, Clone, PartialEq)]
struct StoredService {
    def: ServiceDef,
    origin: Origin,
    ids: BTreeMap<(String, Family), u32>,
}

impl StoredService {
    fn cluster_ips(&self) -> &[IpAddr] {
        match &self.def.cluster_ips {
            ClusterIps::Given(ips) => ips,
            _ => &[],
        }
    }

    fn record(&self) -> ObjectRecord {
        ObjectRecord {
            origin: self.origin,
            object: serde_json::to_value(&self.def.object).expect("a Service serialises"),
            service_ids: ObjectRecord::id_records(&self.ids),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct StoredSlice {
    def: SliceDef,
    origin: Origin,
}

impl StoredSlice {
    fn record(&self) -> ObjectRecord {
        ObjectRecord {
            origin: self.origin,
            object: serde_json::to_value(&self.def.object).expect("an EndpointSlice serialises"),
            service_ids: Vec::new(),
        }
    }
}

type Name = (String, String);

/// What the catalog holds.
#[derive(Debug, Default)]
struct State {
    services: BTreeMap<Name, StoredService>,
    slices: BTreeMap<Name, StoredSlice>,
    /// (namespace, service name) → its slices' names.
    slices_of: BTreeMap<Name, BTreeSet<String>>,
    /// Bumped by every stored change.
    generation: u64,
    /// Each Service's loader services as last resolved by `service-push`.
    resolved: BTreeMap<Name, Vec<rivet_proto::loader::v1::LbService>>,
    /// The pods `resolved` was computed with (other pods: resolve all again).
    resolved_pods: Option<Vec<PodInfo>>,
    /// The [`PodSource::revision`] `resolved_pods` were built at, once
    /// complete: while it holds, a pass builds no pods.
    resolved_revision: Option<u64>,
    /// Services whose objects changed since they were resolved.
    dirty: BTreeSet<Name>,
}

impl State {
    fn insert_slice(&mut self, slice: StoredSlice) {
        let name = (slice.def.namespace.clone(), slice.def.name.clone());
        self.remove_slice(&name);
        self.dirty
            .insert((slice.def.namespace.clone(), slice.def.service.clone()));
        self.slices_of
            .entry((slice.def.namespace.clone(), slice.def.service.clone()))
            .or_default()
            .insert(slice.def.name.clone());
        self.slices.insert(name, slice);
    }

    fn remove_slice(&mut self, name: &Name) -> Option<StoredSlice> {
        let old = self.slices.remove(name)?;
        let owner = (old.def.namespace.clone(), old.def.service.clone());
        self.dirty.insert(owner.clone());
        if let Some(set) = self.slices_of.get_mut(&owner) {
            set.remove(&old.def.name);
            if set.is_empty() {
                self.slices_of.remove(&owner);
            }
        }
        Some(old)
    }

    fn slices_for(&self, service: &ServiceDef) -> Vec<(&SliceDef, Origin)> {
        self.slices_of
            .get(&(service.namespace.clone(), service.name.clone()))
            .into_iter()
            .flatten()
            .filter_map(|name| self.slices.get(&(service.namespace.clone(), name.clone())))
            .map(|s| (&s.def, s.origin))
            .collect()
    }

    fn origin_of(&self, key: &ObjectKey) -> Option<Origin> {
        let name = (key.namespace.clone(), key.name.clone());
        match key.kind {
            ObjectKind::Service => self.services.get(&name).map(|s| s.origin),
            ObjectKind::EndpointSlice => self.slices.get(&name).map(|s| s.origin),
        }
    }

    /// Whether some Service takes its backends from pods.
    fn needs_pods(&self) -> bool {
        self.services.values().any(|s| {
            s.origin == Origin::Api
                && !s.def.selector.is_empty()
                && !self.slices_for(&s.def).iter().any(|(_, o)| *o == Origin::Api)
        })
    }
}

/// What an apply did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The object.
    pub key: ObjectKey,
    /// false when an identical object was stored.
    pub changed: bool,
    /// A Service's cluster IPs as stored.
    pub cluster_ips: Vec<IpAddr>,
}

/// What a Kubernetes replay of service objects did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceReplay {
    /// Objects applied (changed or not).
    pub applied: usize,
    /// KUBERNETES objects removed because the replay did not name them.
    pub removed: usize,
    /// Documents refused.
    pub rejected: Vec<RefusedDocument>,
}

/// A replayed document the catalog refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedDocument {
    /// Which item of the replay (`item 3`).
    pub item: String,
    /// The object it names, when its kind and name read.
    pub key: Option<ObjectKey>,
    /// Why, typed (`SERVICE_INVALID`, `CLUSTER_IP_UNAVAILABLE`, ...).
    pub reason: pb::ErrorReason,
    /// Why, for the operator.
    pub message: String,
}

struct Inner {
    options: CatalogOptions,
    pool: ClusterIpPool,
    store: ObjectStore,
    loader: Arc<dyn LoadBalancerApi>,
    pods: Arc<dyn PodSource>,
    metrics: CatalogMetrics,
    state: Mutex<State>,
    /// Serialises stored changes (the file write and the table update).
    writes: tokio::sync::Mutex<()>,
    push: Mutex<push::Pushed>,
    /// Wakes `service-push`.
    push_wake: Trigger,
    /// The latest generation a push pass realised.
    realised: watch::Sender<u64>,
}

/// The service catalog. Cheap to clone.
#[derive(Clone)]
pub struct ServiceCatalog {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ServiceCatalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceCatalog")
            .field("store", &self.inner.store.dir())
            .finish_non_exhaustive()
    }
}

impl ServiceCatalog {
    /// A catalog over the objects stored in `<state-dir>/services/` (an
    /// object that no longer reads is logged and left out). Call
    /// [`start`](Self::start) to push to svc-loader.
    pub fn new(
        options: CatalogOptions,
        loader: Arc<dyn LoadBalancerApi>,
        pods: Arc<dyn PodSource>,
        metrics: CatalogMetrics,
    ) -> Result<Self, ServiceCidrError> {
        let pool = ClusterIpPool::new(options.service_cidrs.clone())?;
        let store = ObjectStore::new(options.state_dir.join("services"));
        // Realised starts at 0: a wait needs one pass of this process.
        let mut state = State {
            generation: 1,
            ..State::default()
        };
        let (records, failed) = store.load_all();
        for (file, error) in failed {
            events::object_unreadable(&metrics, &file, &error);
        }
        for record in records {
            let text = record.object.to_string();
            match ServiceObject::parse(&text) {
                Ok(ServiceObject::Service(def)) => {
                    let name = (def.namespace.clone(), def.name.clone());
                    let ids = record.ids();
                    state.services.insert(
                        name,
                        StoredService {
                            def: *def,
                            origin: record.origin,
                            ids,
                        },
                    );
                }
                Ok(ServiceObject::EndpointSlice(def)) => state.insert_slice(StoredSlice {
                    def: *def,
                    origin: record.origin,
                }),
                Err(e) => events::object_unreadable(&metrics, store.dir(), &e.to_string()),
            }
        }
        metrics.set_services(state.services.len());
        tracing::info!(
            services = state.services.len(),
            endpoint_slices = state.slices.len(),
            service_cidrs = ?pool.cidrs(),
            "service catalog restored"
        );
        Ok(Self {
            inner: Arc::new(Inner {
                options,
                pool,
                store,
                loader,
                pods,
                metrics,
                state: Mutex::new(state),
                writes: tokio::sync::Mutex::new(()),
                push: Mutex::default(),
                push_wake: Trigger::new(),
                realised: watch::channel(0).0,
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().expect("service catalog lock poisoned")
    }

    /// Starts `service-push` (the push to svc-loader, every `loader_poll`
    /// and on every change) and `service-inputs` (wakes it when pods change).
    pub fn start(&self, controllers: &Controllers) {
        let backoff = self.inner.options.retry_backoff.clone();
        let this = self.clone();
        controllers.reconcile(
            Controller::new("service-push")
                .backoff(backoff.clone())
                .trigger(&self.inner.push_wake),
            move || {
                let this = this.clone();
                async move { this.push_pass().await }
            },
        );
        let this = self.clone();
        controllers.supervise(Controller::new("service-inputs").backoff(backoff), move |progress| {
            let this = this.clone();
            async move { this.watch_inputs(progress).await }
        });
    }

    /// The metrics.
    pub fn metrics(&self) -> &CatalogMetrics {
        &self.inner.metrics
    }

    /// The service CIDRs.
    pub fn service_cidrs(&self) -> &[IpNet] {
        self.inner.pool.cidrs()
    }

    /// Validates and stores one object, then realises it (with `wait`,
    /// returns once svc-loader holds the result, within `deadline`).
    pub async fn apply(
        &self,
        document: &str,
        origin: Origin,
        wait: bool,
        deadline: Duration,
    ) -> Result<Applied, CatalogError> {
        let object = ServiceObject::parse(document)?;
        let key = object.key();
        let (applied, generation) = {
            let _writes = self.inner.writes.lock().await;
            if let Some(held_by) = self.state().origin_of(&key)
                && held_by != origin
            {
                return Err(CatalogError::OriginConflict { key, held_by, origin });
            }
            match object {
                ServiceObject::Service(def) => {
                    let stored = self.allocate(*def, origin)?;
                    let name = (stored.def.namespace.clone(), stored.def.name.clone());
                    // The stored form decides (a restored object parses
                    // into the same record, not always into the same def).
                    let changed = self.state().services.get(&name).map(StoredService::record) != Some(stored.record());
                    if changed {
                        self.persist(&key, stored.record()).await?;
                    }
                    let cluster_ips = stored.cluster_ips().to_vec();
                    let mut state = self.state();
                    if changed {
                        state.dirty.insert(name.clone());
                        state.services.insert(name, stored);
                        state.generation += 1;
                        self.inner.metrics.set_services(state.services.len());
                    }
                    (
                        Applied {
                            key,
                            changed,
                            cluster_ips,
                        },
                        state.generation,
                    )
                }
                ServiceObject::EndpointSlice(def) => {
                    let stored = StoredSlice { def: *def, origin };
                    let name = (stored.def.namespace.clone(), stored.def.name.clone());
                    let changed = self.state().slices.get(&name).map(StoredSlice::record) != Some(stored.record());
                    if changed {
                        self.persist(&key, stored.record()).await?;
                    }
                    let mut state = self.state();
                    if changed {
                        state.insert_slice(stored);
                        state.generation += 1;
                    }
                    let applied = Applied {
                        key,
                        changed,
                        cluster_ips: Vec::new(),
                    };
                    (applied, state.generation)
                }
            }
        };
        let ips: Vec<String> = applied.cluster_ips.iter().map(ToString::to_string).collect();
        events::object_applied(&self.inner.metrics, &applied.key, origin, applied.changed, &ips);
        self.inner.push_wake.trigger();
        if wait {
            self.wait_realised(&applied.key, generation, deadline).await?;
        }
        Ok(applied)
    }

    /// Removes one object and realises the change; whether it existed.
    /// Deleting a Service of origin API also deletes the API's
    /// EndpointSlices labelled for it (`kubernetes.io/service-name`), as
    /// Kubernetes' garbage collector does through their ownerReferences;
    /// for KUBERNETES Services the API server does that and the feed
    /// relays it.
    pub async fn delete(
        &self,
        key: &ObjectKey,
        origin: Origin,
        wait: bool,
        deadline: Duration,
    ) -> Result<bool, CatalogError> {
        let (generation, owned) = {
            let _writes = self.inner.writes.lock().await;
            match self.state().origin_of(key) {
                None => return Ok(false),
                Some(held_by) if held_by != origin => {
                    return Err(CatalogError::OriginConflict {
                        key: key.clone(),
                        held_by,
                        origin,
                    });
                }
                Some(_) => {}
            }
            let name = (key.namespace.clone(), key.name.clone());
            let owned: Vec<ObjectKey> = match (key.kind, origin) {
                (ObjectKind::Service, Origin::Api) => {
                    let state = self.state();
                    state
                        .slices_of
                        .get(&name)
                        .into_iter()
                        .flatten()
                        .filter_map(|slice| state.slices.get(&(key.namespace.clone(), slice.clone())))
                        .filter(|s| s.origin == Origin::Api)
                        .map(|s| s.def.key())
                        .collect()
                }
                _ => Vec::new(),
            };
            // The slices first: a failure leaves the Service, still deletable.
            for slice in &owned {
                self.unpersist(slice).await?;
                self.state()
                    .remove_slice(&(slice.namespace.clone(), slice.name.clone()));
            }
            self.unpersist(key).await?;
            let mut state = self.state();
            match key.kind {
                ObjectKind::Service => {
                    state.services.remove(&name);
                    state.dirty.insert(name);
                    self.inner.metrics.set_services(state.services.len());
                }
                ObjectKind::EndpointSlice => {
                    state.remove_slice(&name);
                }
            }
            state.generation += 1;
            (state.generation, owned)
        };
        events::object_deleted(&self.inner.metrics, key, origin, "deleted");
        for slice in &owned {
            events::object_deleted(&self.inner.metrics, slice, origin, "its Service was deleted");
        }
        self.inner.push_wake.trigger();
        if wait {
            self.wait_realised(key, generation, deadline).await?;
        }
        Ok(true)
    }

    /// A Kubernetes replay: every document is applied (origin KUBERNETES)
    /// or refused with its reason, and the KUBERNETES objects that no
    /// document names are removed whatever was refused. A refused document
    /// that still names its object (kind and name read) keeps the one held,
    /// as a refused apply does; one that names nothing holds nothing back.
    /// Stale Services go before the documents apply (a new Service may take
    /// a stale one's clusterIP or node port), stale EndpointSlices after
    /// (a replaced slice's backends never all vanish at once).
    pub async fn replay_kubernetes(&self, documents: Vec<(String, String)>) -> Result<ServiceReplay, CatalogError> {
        let mut outcome = ServiceReplay::default();
        let keys: Vec<Option<ObjectKey>> = documents.iter().map(|(_, d)| ServiceObject::key_of(d)).collect();
        let named: BTreeSet<&ObjectKey> = keys.iter().flatten().collect();
        let (stale_services, stale_slices): (Vec<ObjectKey>, Vec<ObjectKey>) = {
            let state = self.state();
            let services = state
                .services
                .values()
                .filter(|s| s.origin == Origin::Kubernetes)
                .map(|s| s.def.key());
            let slices = state
                .slices
                .values()
                .filter(|s| s.origin == Origin::Kubernetes)
                .map(|s| s.def.key());
            services
                .chain(slices)
                .filter(|k| !named.contains(k))
                .partition(|k| k.kind == ObjectKind::Service)
        };
        for key in &stale_services {
            if self.delete(key, Origin::Kubernetes, false, Duration::ZERO).await? {
                outcome.removed += 1;
            }
        }
        for ((item, document), key) in documents.into_iter().zip(keys) {
            match self.apply(&document, Origin::Kubernetes, false, Duration::ZERO).await {
                Ok(_) => outcome.applied += 1,
                Err(e) => match e.reason() {
                    Some((_, reason)) => outcome.rejected.push(RefusedDocument {
                        item,
                        key,
                        reason,
                        message: e.to_string(),
                    }),
                    None => return Err(e),
                },
            }
        }
        for key in &stale_slices {
            if self.delete(key, Origin::Kubernetes, false, Duration::ZERO).await? {
                outcome.removed += 1;
            }
        }
        Ok(outcome)
    }

    /// Every Service (of `namespace`, or all) as resolved now.
    pub fn list(&self, namespace: &str) -> Vec<pb::ServiceView> {
        let pods = self.pods_now();
        let state = self.state();
        let pushed = self.pushed();
        state
            .services
            .values()
            .filter(|s| namespace.is_empty() || s.def.namespace == namespace)
            .map(|s| self.view(&state, &pushed, s, &pods))
            .collect()
    }

    /// One Service and its stored documents (the Service, then its
    /// EndpointSlices), as JSON.
    pub fn get(&self, namespace: &str, name: &str) -> Result<(pb::ServiceView, Vec<String>), CatalogError> {
        let pods = self.pods_now();
        let state = self.state();
        let pushed = self.pushed();
        let service = state
            .services
            .get(&(namespace.to_string(), name.to_string()))
            .ok_or_else(|| CatalogError::NotFound {
                namespace: namespace.into(),
                name: name.into(),
            })?;
        let mut documents = vec![service.record().object.to_string()];
        documents.extend(
            state
                .slices_for(&service.def)
                .iter()
                .map(|(s, _)| serde_json::to_string(&s.object).expect("an EndpointSlice serialises")),
        );
        Ok((self.view(&state, &pushed, service, &pods), documents))
    }

    /// The cluster's pods now; empty until they are known.
    fn pods_now(&self) -> Vec<PodInfo> {
        self.inner
            .pods
            .pods()
            .map(|p| self.with_node_name(p))
            .unwrap_or_default()
    }

    fn with_node_name(&self, mut pods: Vec<PodInfo>) -> Vec<PodInfo> {
        for pod in pods.iter_mut().filter(|p| p.local && p.node_name.is_empty()) {
            pod.node_name = self.inner.options.node_name.clone();
        }
        pods
    }

    fn resolve(&self, state: &State, service: &StoredService, pods: &[PodInfo]) -> Resolution {
        let local: BTreeSet<IpAddr> = pods
            .iter()
            .filter(|p| p.local)
            .flat_map(|p| p.addresses.iter().copied())
            .collect();
        backends::resolve(
            &ResolvedService {
                def: &service.def,
                origin: service.origin,
                ids: &service.ids,
            },
            &state.slices_for(&service.def),
            pods,
            &self.inner.options.node_name,
            &local,
        )
    }

    fn view(&self, state: &State, pushed: &push::Pushed, s: &StoredService, pods: &[PodInfo]) -> pb::ServiceView {
        let def = &s.def;
        let resolution = self.resolve(state, s, pods);
        pb::ServiceView {
            namespace: def.namespace.clone(),
            name: def.name.clone(),
            r#type: def.service_type.as_str().into(),
            cluster_ips: match &def.cluster_ips {
                ClusterIps::Headless => vec!["None".into()],
                ClusterIps::Given(ips) => ips.iter().map(ToString::to_string).collect(),
                ClusterIps::Allocate => Vec::new(),
            },
            ports: def
                .ports
                .iter()
                .map(|p| pb::ServicePortView {
                    name: p.name.clone(),
                    protocol: p.protocol.as_str().into(),
                    port: p.port.into(),
                    node_port: p.node_port.map_or(0, u32::from),
                    target_port: p.target.to_string(),
                })
                .collect(),
            session_affinity: if def.affinity_timeout_seconds == 0 {
                "None".into()
            } else {
                "ClientIP".into()
            },
            affinity_timeout_seconds: def.affinity_timeout_seconds,
            external_traffic_policy: def.external_traffic_policy.as_str().into(),
            selector: def.selector.clone().into_iter().collect(),
            origin: s.origin.to_proto() as i32,
            backends: resolution.backends,
            load_balancer: resolution
                .entries
                .iter()
                .map(|e| pb::LoadBalancerEntry {
                    service_port: e.port_name.clone(),
                    family: e.family.as_str().into(),
                    service_id: e.service.service_id,
                    realised: pushed.holds(&e.service),
                })
                .collect(),
        }
    }

    /// The Service `def` as stored by `origin`: cluster IPs, node ports and
    /// ids resolved (kept from the stored one where the document leaves
    /// them out), the object updated to say so.
    fn allocate(&self, mut def: ServiceDef, origin: Origin) -> Result<StoredService, CatalogError> {
        let state = self.state();
        let key = def.key();
        let name = (def.namespace.clone(), def.name.clone());
        let existing = state.services.get(&name);
        let others = || state.services.iter().filter(|(n, _)| **n != name).map(|(_, s)| s);

        // Cluster IPs.
        let held: BTreeMap<IpAddr, String> = others()
            .flat_map(|s| {
                s.cluster_ips()
                    .iter()
                    .map(|ip| (*ip, format!("{}/{}", s.def.namespace, s.def.name)))
            })
            .collect();
        match def.cluster_ips.clone() {
            ClusterIps::Headless => {}
            ClusterIps::Given(ips) => {
                for (i, ip) in ips.iter().enumerate() {
                    if origin == Origin::Api && !self.inner.pool.contains(*ip) {
                        let path = if ips.len() == 1 {
                            "spec.clusterIP".to_string()
                        } else {
                            format!("spec.clusterIPs[{i}]")
                        };
                        return Err(DocumentError {
                            path,
                            reason: format!(
                                "{ip} is not in a --service-cidr of this node ({})",
                                cidr_list(self.inner.pool.cidrs())
                            ),
                        }
                        .into());
                    }
                    if let Some(holder) = held.get(ip) {
                        return Err(CatalogError::ClusterIpTaken {
                            key,
                            address: *ip,
                            holder: holder.clone(),
                        });
                    }
                }
            }
            ClusterIps::Allocate if origin == Origin::Kubernetes => {}
            ClusterIps::Allocate => {
                let families = self.families(&def)?;
                let kept: Vec<IpAddr> = existing
                    .map(|e| e.cluster_ips().to_vec())
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|ip| families.contains(&Family::of(*ip)))
                    .collect();
                let mut taken: BTreeSet<IpAddr> = held.keys().copied().collect();
                let mut ips = Vec::new();
                for family in families {
                    let ip = match kept.iter().copied().find(|ip| Family::of(*ip) == family) {
                        Some(ip) => ip,
                        None => self
                            .inner
                            .pool
                            .allocate(family, &taken)
                            .ok_or_else(|| CatalogError::NoClusterIp {
                                key: key.clone(),
                                family,
                                reason: format!("--service-cidr {} is full", cidr_list(self.inner.pool.cidrs())),
                            })?,
                    };
                    taken.insert(ip);
                    ips.push(ip);
                }
                def.cluster_ips = ClusterIps::Given(ips);
            }
        }
        if let ClusterIps::Given(ips) = &def.cluster_ips
            && let Some(spec) = def.object.spec.as_mut()
        {
            spec.cluster_ip = ips.first().map(ToString::to_string);
            spec.cluster_ips = Some(ips.iter().map(ToString::to_string).collect());
            spec.ip_families = Some(ips.iter().map(|ip| Family::of(*ip).as_str().to_string()).collect());
            def.ip_families = ips.iter().map(|ip| Family::of(*ip)).collect();
        }

        // Node ports: unique per protocol across Services.
        if def.service_type.has_node_ports() {
            let mut taken: BTreeMap<(u16, rivet_policy::Protocol), String> = others()
                .flat_map(|s| {
                    s.def.ports.iter().filter_map(move |p| {
                        p.node_port
                            .map(|n| ((n, p.protocol), format!("{}/{}", s.def.namespace, s.def.name)))
                    })
                })
                .collect();
            for (i, port) in def.ports.iter().enumerate() {
                if let Some(n) = port.node_port {
                    if let Some(holder) = taken.get(&(n, port.protocol)) {
                        return Err(DocumentError {
                            path: format!("spec.ports[{i}].nodePort"),
                            reason: format!("{n}/{} belongs to Service {holder}", port.protocol),
                        }
                        .into());
                    }
                    taken.insert((n, port.protocol), String::new());
                }
            }
            for i in 0..def.ports.len() {
                if def.ports[i].node_port.is_some() {
                    continue;
                }
                let protocol = def.ports[i].protocol;
                let kept = existing
                    .and_then(|e| {
                        e.def
                            .ports
                            .iter()
                            .find(|p| p.name == def.ports[i].name && p.protocol == protocol)
                    })
                    .and_then(|p| p.node_port)
                    .filter(|n| !taken.contains_key(&(*n, protocol)));
                let free: BTreeSet<u16> = taken.keys().filter(|(_, p)| *p == protocol).map(|(n, _)| *n).collect();
                let n = kept
                    .or_else(|| allocate::allocate_node_port(&free))
                    .ok_or_else(|| DocumentError {
                        path: format!("spec.ports[{i}].nodePort"),
                        reason: "every node port of 30000-32767 is taken".into(),
                    })?;
                taken.insert((n, protocol), String::new());
                def.ports[i].node_port = Some(n);
                if let Some(p) = def
                    .object
                    .spec
                    .as_mut()
                    .and_then(|s| s.ports.as_mut())
                    .and_then(|p| p.get_mut(i))
                {
                    p.node_port = Some(i32::from(n));
                }
            }
        }

        // Service ids: kept per (port name, family), new ones the lowest free.
        let families: Vec<Family> = match &def.cluster_ips {
            ClusterIps::Given(ips) => ips.iter().map(|ip| Family::of(*ip)).collect(),
            _ => Vec::new(),
        };
        let mut taken_ids: BTreeSet<u32> = others().flat_map(|s| s.ids.values().copied()).collect();
        let mut ids = BTreeMap::new();
        for port in &def.ports {
            for family in &families {
                let slot = (port.name.clone(), *family);
                let id = match existing.and_then(|e| e.ids.get(&slot)).copied() {
                    Some(id) if !taken_ids.contains(&id) => id,
                    _ => allocate::allocate_service_id(&taken_ids).ok_or(CatalogError::NoServiceId)?,
                };
                taken_ids.insert(id);
                ids.insert(slot, id);
            }
        }
        Ok(StoredService { def, origin, ids })
    }

    /// The families a Service without clusterIP gets.
    fn families(&self, def: &ServiceDef) -> Result<Vec<Family>, CatalogError> {
        let pool = self.inner.pool.families();
        let missing = |family: Family| CatalogError::NoClusterIp {
            key: def.key(),
            family,
            reason: if pool.is_empty() {
                "svc-endpoint has no --service-cidr".to_string()
            } else {
                format!(
                    "no --service-cidr of that family ({})",
                    cidr_list(self.inner.pool.cidrs())
                )
            },
        };
        let wanted: Vec<Family> = match def.family_policy {
            FamilyPolicy::SingleStack => {
                let family = def
                    .ip_families
                    .first()
                    .copied()
                    .or_else(|| pool.first().copied())
                    .unwrap_or(Family::IPv4);
                if !pool.contains(&family) {
                    return Err(missing(family));
                }
                vec![family]
            }
            FamilyPolicy::PreferDualStack => {
                let mut wanted: Vec<Family> = if def.ip_families.is_empty() {
                    pool.clone()
                } else {
                    def.ip_families.clone()
                };
                // The first family is required, the second one if available.
                if let Some(first) = wanted.first().copied()
                    && !pool.contains(&first)
                {
                    return Err(missing(first));
                }
                wanted.retain(|f| pool.contains(f));
                if wanted.is_empty() {
                    return Err(missing(Family::IPv4));
                }
                wanted
            }
            FamilyPolicy::RequireDualStack => {
                let mut wanted = def.ip_families.clone();
                for family in [Family::IPv4, Family::IPv6] {
                    if !wanted.contains(&family) {
                        wanted.push(family);
                    }
                }
                if let Some(family) = wanted.iter().copied().find(|f| !pool.contains(f)) {
                    return Err(missing(family));
                }
                wanted
            }
        };
        Ok(wanted)
    }

    async fn persist(&self, key: &ObjectKey, record: ObjectRecord) -> Result<(), CatalogError> {
        let store = self.inner.store.clone();
        let owned = key.clone();
        let action = format!("storing {key} in {}", store.dir().display());
        tokio::task::spawn_blocking(move || store.store(&owned, &record))
            .await
            .map_err(|source| CatalogError::StorageTask {
                action: action.clone(),
                source,
            })?
            .map_err(|source| CatalogError::Storage { action, source })
    }

    async fn unpersist(&self, key: &ObjectKey) -> Result<(), CatalogError> {
        let store = self.inner.store.clone();
        let owned = key.clone();
        let action = format!("removing {key} from {}", store.dir().display());
        tokio::task::spawn_blocking(move || store.remove(&owned))
            .await
            .map_err(|source| CatalogError::StorageTask {
                action: action.clone(),
                source,
            })?
            .map_err(|source| CatalogError::Remove { action, source })
    }
}

/// `198.19.128.0/20, 2001:2:0:ff::/112`, or `none`.
fn cidr_list(cidrs: &[IpNet]) -> String {
    if cidrs.is_empty() {
        return "none".into();
    }
    cidrs.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}
