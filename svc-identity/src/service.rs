//! `rivet.identity.v1.IdentityService` over the [`IdentityAllocator`].

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use rivet_common::grpc::{BootId, prefix_field, status_with_reason};
use rivet_common::labels::Labels;
use rivet_proto::identity::v1 as pb;
use tokio::sync::broadcast;
use tonic::{Request, Response, Status};

use crate::allocator::{AllocError, IdentityAllocator, IdentityChange, IdentityKind};
use crate::backend::BackendError;
use crate::backend::IdentityRecord;
use crate::cidr::{CidrError, CidrIdentities};
use crate::heartbeat::{HeartbeatReport, HeartbeatWatchdog};
use crate::ipcache::{IpCache, IpcacheSource, LoaderSync, prefix_text};

/// Identities per snapshot message (keeps messages far below 4 MiB).
const SNAPSHOT_CHUNK: usize = 1000;

/// Implements `rivet.identity.v1.IdentityService`.
#[derive(Debug, Clone)]
pub struct IdentityService {
    allocator: Arc<IdentityAllocator>,
    cidrs: Arc<CidrIdentities>,
    ipcache: Option<(Arc<IpCache>, Arc<LoaderSync>)>,
    heartbeat: Option<HeartbeatWatchdog>,
    boot_id: BootId,
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchIdentitiesResponse, Status>> + Send>>;

impl IdentityService {
    /// A service over `allocator`.
    pub fn new(allocator: Arc<IdentityAllocator>, cidrs: Arc<CidrIdentities>, boot_id: BootId) -> Self {
        Self {
            allocator,
            cidrs,
            ipcache: None,
            heartbeat: None,
            boot_id,
        }
    }

    /// Reports the IP cache and its push to svc-loader in GetStatus.
    pub fn with_ipcache(mut self, ipcache: Arc<IpCache>, loader: Arc<LoaderSync>) -> Self {
        self.ipcache = Some((ipcache, loader));
        self
    }

    /// Reports the kvstore heartbeat in GetStatus (etcd store; without it
    /// the heartbeat is not applicable).
    pub fn with_heartbeat(mut self, heartbeat: HeartbeatWatchdog) -> Self {
        self.heartbeat = Some(heartbeat);
        self
    }

    /// The tonic server.
    pub fn into_server(self) -> pb::identity_service_server::IdentityServiceServer<Self> {
        pb::identity_service_server::IdentityServiceServer::new(self)
    }

    fn identity(&self, id: u32, labels: &Labels, kind: IdentityKind) -> pb::Identity {
        pb::Identity {
            id,
            labels: labels.iter().map(ToString::to_string).collect(),
            kind: kind_proto(kind) as i32,
            local_references: self.allocator.references(id) as u32,
            owners: Vec::new(),
        }
    }
}

fn kind_proto(kind: IdentityKind) -> pb::IdentityKind {
    match kind {
        IdentityKind::Reserved => pb::IdentityKind::Reserved,
        IdentityKind::Cluster => pb::IdentityKind::Cluster,
    }
}

/// Validates an AllocateIdentity request: the labels and the optional owner.
pub fn validate_allocate(r: &pb::AllocateIdentityRequest) -> Result<(Labels, Option<&str>), Status> {
    Ok((parse_labels(&r.labels)?, owner(&r.owner)?))
}

/// Validates a ReleaseIdentity request: an id (0: every identity of the
/// owner, which is then required) and the optional owner.
pub fn validate_release(r: &pb::ReleaseIdentityRequest) -> Result<(u32, Option<&str>), Status> {
    match (r.id, owner(&r.owner)?) {
        (0, None) => Err(Status::invalid_argument("id or owner: one is required")),
        (id, owner) => Ok((id, owner)),
    }
}

/// Validates a LookupIdentity request's labels.
pub fn validate_lookup(r: &pb::LookupIdentityRequest) -> Result<Labels, Status> {
    parse_labels(&r.labels)
}

/// Validates the owner (required) and prefixes of an
/// AllocateCidrIdentities or ReleaseCidrIdentities request.
pub fn validate_cidr_request<'a>(
    owner_text: &'a str,
    raw: &[rivet_proto::net::IpPrefix],
) -> Result<(&'a str, Vec<ipnet::IpNet>), Status> {
    let owner = owner(owner_text)?.ok_or_else(|| Status::invalid_argument("owner: required"))?;
    Ok((owner, prefixes(raw)?))
}

/// Longest owner prefix an EndReplay request may name.
const MAX_OWNER_PREFIX: usize = 64;

/// Validates an EndReplay request's fields (the boot id is compared by the
/// handler): the owner prefix (`None`: the client holds no references)
/// and the IP cache sources, each client-owned and named once.
pub fn validate_end_replay(r: &pb::EndReplayRequest) -> Result<(Option<&str>, Vec<IpcacheSource>), Status> {
    if r.boot_id.is_empty() {
        return Err(Status::invalid_argument("boot_id: required"));
    }
    if r.boot_id.len() > 128 || r.boot_id.chars().any(char::is_control) {
        return Err(Status::invalid_argument("boot_id: at most 128 printable characters"));
    }
    let prefix = r.owner_prefix.as_str();
    if !prefix.is_empty()
        && (prefix.len() < 2
            || prefix.len() > MAX_OWNER_PREFIX
            || !prefix.ends_with('/')
            || prefix.chars().any(|c| c.is_control() || c.is_whitespace()))
    {
        return Err(Status::invalid_argument(format!(
            "owner_prefix: 2 to {MAX_OWNER_PREFIX} printable characters without spaces, ending with '/' (e.g. \"endpoint/\")"
        )));
    }
    let mut sources = Vec::new();
    for (i, raw) in r.ip_sources.iter().enumerate() {
        let field = format!("ip_sources[{i}]");
        let source = match IpcacheSource::from_proto(*raw) {
            Some(s @ (IpcacheSource::LocalEndpoint | IpcacheSource::Kubernetes)) => s,
            Some(s) => {
                return Err(Status::invalid_argument(format!(
                    "{field}: {s} is server-owned; clients claim with LOCAL_ENDPOINT or KUBERNETES"
                )));
            }
            None => return Err(Status::invalid_argument(format!("{field}: unknown source {raw}"))),
        };
        if sources.contains(&source) {
            return Err(Status::invalid_argument(format!("{field}: {source} named twice")));
        }
        sources.push(source);
    }
    Ok(((!prefix.is_empty()).then_some(prefix), sources))
}

fn parse_labels(raw: &[String]) -> Result<Labels, Status> {
    Labels::parse(raw).map_err(|e| Status::invalid_argument(format!("labels: {e}")))
}

fn owner(raw: &str) -> Result<Option<&str>, Status> {
    if raw.len() > 253 || raw.chars().any(char::is_control) {
        return Err(Status::invalid_argument("owner: at most 253 printable characters"));
    }
    Ok((!raw.is_empty()).then_some(raw))
}

fn status(e: AllocError) -> Status {
    let message = e.to_string();
    match e {
        AllocError::InvalidLabels(_) => Status::invalid_argument(message),
        AllocError::Unavailable { .. } => {
            status_with_reason(tonic::Code::Unavailable, message, pb::ErrorReason::KvstoreUnreachable)
        }
        AllocError::Exhausted { .. } => status_with_reason(
            tonic::Code::ResourceExhausted,
            message,
            pb::ErrorReason::IdentitiesExhausted,
        ),
        AllocError::Contention { .. } => {
            status_with_reason(tonic::Code::Aborted, message, pb::ErrorReason::AllocationContention)
        }
        AllocError::Store {
            source: BackendError::Refused { code: 401 | 403, .. },
            ..
        } => Status::permission_denied(message),
        AllocError::Store { .. } => Status::internal(message),
    }
}

fn prefixes(raw: &[rivet_proto::net::IpPrefix]) -> Result<Vec<ipnet::IpNet>, Status> {
    raw.iter()
        .enumerate()
        .map(|(i, p)| prefix_field(&format!("prefixes[{i}]"), Some(p)))
        .collect()
}

/// A CIDR identity as an `Identity` (`cidr:<prefix>`).
fn cidr_identity(prefix: &ipnet::IpNet, id: u32, local_references: u32) -> pb::Identity {
    pb::Identity {
        id,
        labels: vec![format!("cidr:{}", prefix_text(prefix))],
        kind: pb::IdentityKind::Cidr as i32,
        local_references,
        owners: Vec::new(),
    }
}

fn cidr_proto(prefix: &ipnet::IpNet, id: u32) -> pb::CidrIdentity {
    pb::CidrIdentity {
        prefix: Some(rivet_proto::net::prefix_to_proto(*prefix)),
        id,
    }
}

fn not_found(message: String) -> Status {
    status_with_reason(tonic::Code::NotFound, message, pb::ErrorReason::IdentityNotFound)
}

fn cidr_status(e: CidrError) -> Status {
    match e {
        CidrError::Exhausted => status_with_reason(
            tonic::Code::ResourceExhausted,
            e.to_string(),
            pb::ErrorReason::CidrIdentitiesExhausted,
        ),
        CidrError::Ipcache(ref i) => {
            let mut s = i.to_status();
            if s.code() == tonic::Code::InvalidArgument {
                s = Status::internal(e.to_string());
            }
            s
        }
    }
}

fn record_proto(r: &IdentityRecord) -> pb::Identity {
    pb::Identity {
        id: r.id,
        labels: r
            .labels
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
        kind: pb::IdentityKind::Cluster as i32,
        local_references: 0,
        owners: Vec::new(),
    }
}

#[tonic::async_trait]
impl pb::identity_service_server::IdentityService for IdentityService {
    #[tracing::instrument(
        name = "identity.allocate",
        skip_all,
        fields(rivet.identity.id, rivet.identity.labels, rivet.identity.newly_allocated)
    )]
    async fn allocate_identity(
        &self,
        request: Request<pb::AllocateIdentityRequest>,
    ) -> Result<Response<pb::AllocateIdentityResponse>, Status> {
        let r = request.into_inner();
        let (labels, owner) = validate_allocate(&r)?;
        let a = self.allocator.allocate(&labels, owner).await.map_err(status)?;
        let identity = self.identity(a.id, &a.labels, a.kind);
        let span = tracing::Span::current();
        span.record("rivet.identity.id", a.id);
        span.record("rivet.identity.labels", identity.labels.join(",").as_str());
        span.record("rivet.identity.newly_allocated", a.newly_allocated);
        Ok(Response::new(pb::AllocateIdentityResponse {
            identity: Some(identity),
            newly_allocated: a.newly_allocated,
            boot_id: self.boot_id.to_string(),
        }))
    }

    #[tracing::instrument(name = "identity.release", skip_all)]
    async fn release_identity(
        &self,
        request: Request<pb::ReleaseIdentityRequest>,
    ) -> Result<Response<pb::ReleaseIdentityResponse>, Status> {
        let r = request.into_inner();
        // validate_release refuses (0, None).
        let released = match validate_release(&r)? {
            (0, Some(owner)) => {
                let mut out = Vec::new();
                for id in self.allocator.release_owner(owner).await {
                    out.push(pb::ReleasedReference {
                        id,
                        remaining_local_references: self.allocator.references(id) as u32,
                    });
                }
                out
            }
            (id, owner) => {
                let before = self.allocator.references(id);
                match self.allocator.release(id, owner).await {
                    Some(left) if left < before => vec![pb::ReleasedReference {
                        id,
                        remaining_local_references: left as u32,
                    }],
                    _ => Vec::new(),
                }
            }
        };
        Ok(Response::new(pb::ReleaseIdentityResponse {
            released,
            boot_id: self.boot_id.to_string(),
        }))
    }

    async fn get_identity(
        &self,
        request: Request<pb::GetIdentityRequest>,
    ) -> Result<Response<pb::GetIdentityResponse>, Status> {
        let id = request.get_ref().id;
        if let Some(prefix) = self.cidrs.get(id) {
            return Ok(Response::new(pb::GetIdentityResponse {
                identity: Some(cidr_identity(&prefix, id, 0)),
                boot_id: self.boot_id.to_string(),
            }));
        }
        let (labels, kind) = self
            .allocator
            .get(id)
            .ok_or_else(|| not_found(format!("identity {id} is not known")))?;
        let mut identity = self.identity(id, &labels, kind);
        if request.get_ref().include_owners {
            identity.owners = self.allocator.owners(id);
        }
        Ok(Response::new(pb::GetIdentityResponse {
            identity: Some(identity),
            boot_id: self.boot_id.to_string(),
        }))
    }

    async fn lookup_identity(
        &self,
        request: Request<pb::LookupIdentityRequest>,
    ) -> Result<Response<pb::LookupIdentityResponse>, Status> {
        let labels = validate_lookup(request.get_ref())?;
        let id = self
            .allocator
            .lookup(&labels)
            .map_err(status)?
            .ok_or_else(|| not_found(format!("no identity for {labels}")))?;
        let (labels, kind) = self
            .allocator
            .get(id)
            .ok_or_else(|| not_found(format!("identity {id}")))?;
        Ok(Response::new(pb::LookupIdentityResponse {
            identity: Some(self.identity(id, &labels, kind)),
            boot_id: self.boot_id.to_string(),
        }))
    }

    async fn list_identities(
        &self,
        request: Request<pb::ListIdentitiesRequest>,
    ) -> Result<Response<pb::ListIdentitiesResponse>, Status> {
        let r = request.into_inner();
        let kind = pb::IdentityKind::try_from(r.kind).unwrap_or(pb::IdentityKind::Unspecified);
        let mut out = Vec::new();
        if matches!(kind, pb::IdentityKind::Unspecified | pb::IdentityKind::Reserved) && !r.local_only {
            for reserved in rivet_common::labels::ReservedIdentity::ALL {
                out.push(self.identity(reserved.id(), &reserved.labels(), IdentityKind::Reserved));
            }
        }
        let (records, revision) = self.allocator.list_at();
        if matches!(kind, pb::IdentityKind::Unspecified | pb::IdentityKind::Cluster) {
            for record in records {
                let mut identity = record_proto(&record);
                identity.local_references = self.allocator.references(record.id) as u32;
                if r.include_owners {
                    // Clients reconcile their references against these
                    // (svc-endpoint releases `endpoint/<id>` owners it no
                    // longer has).
                    identity.owners = self.allocator.owners(record.id);
                }
                if !r.local_only || identity.local_references > 0 {
                    out.push(identity);
                }
            }
        }
        if matches!(kind, pb::IdentityKind::Unspecified | pb::IdentityKind::Cidr) {
            // Node-local, referenced by this node's policies only.
            for (prefix, id, owners) in self.cidrs.list() {
                out.push(cidr_identity(&prefix, id, owners as u32));
            }
        }
        Ok(Response::new(pb::ListIdentitiesResponse {
            identities: out,
            revision,
            boot_id: self.boot_id.to_string(),
        }))
    }

    type WatchIdentitiesStream = WatchStream;

    async fn watch_identities(
        &self,
        _request: Request<pb::WatchIdentitiesRequest>,
    ) -> Result<Response<Self::WatchIdentitiesStream>, Status> {
        if !self.allocator.is_ready() {
            return Err(status_with_reason(
                tonic::Code::Unavailable,
                "the identity store has not been listed yet; retry",
                pb::ErrorReason::StoreNotListed,
            ));
        }
        let (snapshot, revision, changes) = self.allocator.subscribe();
        let boot_id = self.boot_id.to_string();
        let watch = IdentityWatch {
            pending: snapshot_messages(&boot_id, snapshot, revision).into(),
            allocator: self.allocator.clone(),
            boot_id,
            changes,
        };
        // Driven by the response (no task of its own): it ends when the
        // client goes away.
        let stream = futures::stream::unfold(watch, |mut watch| async move {
            let message = watch.next().await?;
            Some((Ok(message), watch))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn allocate_cidr_identities(
        &self,
        request: Request<pb::AllocateCidrIdentitiesRequest>,
    ) -> Result<Response<pb::AllocateCidrIdentitiesResponse>, Status> {
        let r = request.into_inner();
        let (owner, prefixes) = validate_cidr_request(&r.owner, &r.prefixes)?;
        let got = self.cidrs.allocate(&prefixes, owner).await.map_err(cidr_status)?;
        Ok(Response::new(pb::AllocateCidrIdentitiesResponse {
            identities: got.iter().map(|(p, id)| cidr_proto(p, *id)).collect(),
            boot_id: self.boot_id.to_string(),
        }))
    }

    async fn release_cidr_identities(
        &self,
        request: Request<pb::ReleaseCidrIdentitiesRequest>,
    ) -> Result<Response<pb::ReleaseCidrIdentitiesResponse>, Status> {
        let r = request.into_inner();
        let (owner, prefixes) = validate_cidr_request(&r.owner, &r.prefixes)?;
        let removed = self.cidrs.release(&prefixes, owner).await.map_err(cidr_status)?;
        Ok(Response::new(pb::ReleaseCidrIdentitiesResponse {
            removed: removed.iter().map(|(p, id)| cidr_proto(p, *id)).collect(),
            boot_id: self.boot_id.to_string(),
        }))
    }

    #[tracing::instrument(name = "identity.end_replay", skip_all, fields(rivet.owner_prefix))]
    async fn end_replay(
        &self,
        request: Request<pb::EndReplayRequest>,
    ) -> Result<Response<pb::EndReplayResponse>, Status> {
        let r = request.into_inner();
        let (owner_prefix, sources) = validate_end_replay(&r)?;
        if r.boot_id != self.boot_id.as_str() {
            return Err(status_with_reason(
                tonic::Code::FailedPrecondition,
                format!(
                    "ending a replay to svc-identity boot {}: this is boot {}; replay to this one",
                    r.boot_id, self.boot_id
                ),
                pb::ErrorReason::BootIdMismatch,
            ));
        }
        tracing::Span::current().record("rivet.owner_prefix", owner_prefix.unwrap_or_default());
        let released_identities = owner_prefix.map_or(0, |p| self.allocator.end_replay(p));
        let withdrawn_ip_claims = match &self.ipcache {
            Some((ipcache, _)) => ipcache.end_replay(&sources).await,
            None => 0,
        };
        tracing::info!(
            owner_prefix = owner_prefix.unwrap_or_default(),
            ?sources,
            released_identities,
            withdrawn_ip_claims,
            "a client ended its replay"
        );
        Ok(Response::new(pb::EndReplayResponse {
            withdrawn_ip_claims,
            released_identities: released_identities as u32,
            boot_id: self.boot_id.to_string(),
        }))
    }

    async fn get_status(
        &self,
        _request: Request<pb::GetStatusRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let backend = match self.allocator.backend_kind() {
            "etcd" => pb::StoreBackend::Etcd,
            "kubernetes" => pb::StoreBackend::Kubernetes,
            _ => pb::StoreBackend::Embedded,
        };
        let list = self.allocator.list();
        let local = list.iter().filter(|r| self.allocator.references(r.id) > 0).count();
        Ok(Response::new(pb::GetStatusResponse {
            store: Some({
                // In sync: listed and watched, and the last passes wrote
                // this node's keys.
                let error = self
                    .allocator
                    .store_error()
                    .or_else(|| self.allocator.reconcile_error())
                    .or_else(|| self.ipcache.as_ref().and_then(|(c, _)| c.publish_error()));
                pb::StoreStatus {
                    backend: backend as i32,
                    connected: self.allocator.is_ready() && error.is_none(),
                    last_error: error.unwrap_or_default(),
                    lease_id: self.allocator.lease_id(),
                    revision: self.allocator.store_revision(),
                    pending_writes: (self.allocator.pending_writes()
                        + self.ipcache.as_ref().map_or(0, |(c, _)| c.pending_writes()))
                        as u32,
                }
            }),
            cluster_identities: list.len() as u32,
            local_identities: local as u32,
            cidr_identities: self.cidrs.len() as u32,
            ipcache_entries: self.ipcache.as_ref().map_or(0, |(c, _)| c.len() as u32),
            loader: self.ipcache.as_ref().map(|(_, l)| l.status().to_proto()),
            boot_id: self.boot_id.to_string(),
            kvstore_heartbeat: Some(
                self.heartbeat
                    .as_ref()
                    .map_or_else(HeartbeatReport::not_applicable, HeartbeatWatchdog::report)
                    .to_proto(),
            ),
        }))
    }
}

/// One `WatchIdentities` stream: the snapshot, then every change; a
/// watcher too slow for the changes starts over with a fresh snapshot.
struct IdentityWatch {
    allocator: Arc<IdentityAllocator>,
    boot_id: String,
    changes: broadcast::Receiver<(u64, IdentityChange)>,
    /// Messages of a snapshot not sent yet.
    pending: VecDeque<pb::WatchIdentitiesResponse>,
}

impl IdentityWatch {
    /// The next message; `None` when the allocator is gone.
    async fn next(&mut self) -> Option<pb::WatchIdentitiesResponse> {
        loop {
            if let Some(message) = self.pending.pop_front() {
                return Some(message);
            }
            let (revision, change) = match self.changes.recv().await {
                Ok(c) => c,
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let (snapshot, revision, changes) = self.allocator.subscribe();
                    self.changes = changes;
                    self.pending = snapshot_messages(&self.boot_id, snapshot, revision).into();
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            };
            let (added, removed) = match change {
                IdentityChange::Upsert(r) => (vec![record_proto(&r)], Vec::new()),
                IdentityChange::Delete(id) => (Vec::new(), vec![id]),
            };
            return Some(pb::WatchIdentitiesResponse {
                boot_id: self.boot_id.clone(),
                snapshot: false,
                snapshot_complete: false,
                revision,
                added,
                removed,
            });
        }
    }
}

/// A snapshot of the identities at `revision` in chunks (at least one
/// message, the last one marked complete).
fn snapshot_messages(boot_id: &str, snapshot: Vec<IdentityRecord>, revision: u64) -> Vec<pb::WatchIdentitiesResponse> {
    let chunks: Vec<Vec<IdentityRecord>> = if snapshot.is_empty() {
        vec![Vec::new()]
    } else {
        snapshot.chunks(SNAPSHOT_CHUNK).map(<[_]>::to_vec).collect()
    };
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| pb::WatchIdentitiesResponse {
            boot_id: boot_id.to_string(),
            snapshot: true,
            snapshot_complete: i == last,
            revision,
            added: chunk.iter().map(record_proto).collect(),
            removed: Vec::new(),
        })
        .collect()
}
