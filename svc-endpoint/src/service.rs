//! `rivet.endpoint.v1` over the [`EndpointManager`]: EndpointService,
//! PolicyService, NamespaceService and PodMetadataService. Every field is validated here before
//! the manager sees it; INVALID_ARGUMENT names the field.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use rivet_common::access::PeerAccess;
use rivet_common::grpc::{BootId, address_field, mac_field};
use rivet_common::k8s_name::{self, NameError};
use rivet_common::labels::{LabelSource, Labels};
use rivet_proto::endpoint::v1 as pb;
use tonic::{Request, Response, Status};

use crate::catalog::ServiceCatalog;
use crate::endpoint::{self, EndpointAddress, EndpointKind, EndpointSpec, EndpointState, unix_nanos};
use crate::manager::{
    DEFAULT_NAMESPACE, EndpointEvent, EndpointManager, EndpointSelector, KubernetesReplay, ManagerError, NewEndpoint,
    PodMetadata, PodName, parse_namespace_label,
};
use rivet_policy::{NamedPort, Policy, PolicyKey, PolicyKind, PolicyOrigin, Protocol, StoredPolicy};

/// Deadline of a call that carries none.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);

/// Implements the three services of `rivet.endpoint.v1`.
#[derive(Debug, Clone)]
pub struct EndpointApi {
    manager: EndpointManager,
    boot_id: BootId,
    /// Takes the service documents of a Kubernetes replay.
    catalog: Option<ServiceCatalog>,
}

impl EndpointApi {
    /// The API over `manager`.
    pub fn new(manager: EndpointManager, boot_id: BootId) -> Self {
        Self {
            manager,
            boot_id,
            catalog: None,
        }
    }

    /// With the service catalog that takes the service documents of a
    /// Kubernetes replay (without one they are refused).
    pub fn with_catalog(mut self, catalog: ServiceCatalog) -> Self {
        self.catalog = Some(catalog);
        self
    }

    /// The tonic servers: (endpoints, policies, namespaces, pod metadata).
    pub fn into_servers(
        self,
    ) -> (
        pb::endpoint_service_server::EndpointServiceServer<Self>,
        pb::policy_service_server::PolicyServiceServer<Self>,
        pb::namespace_service_server::NamespaceServiceServer<Self>,
        pb::pod_metadata_service_server::PodMetadataServiceServer<Self>,
    ) {
        (
            pb::endpoint_service_server::EndpointServiceServer::new(self.clone()),
            pb::policy_service_server::PolicyServiceServer::new(self.clone()),
            pb::namespace_service_server::NamespaceServiceServer::new(self.clone()),
            pb::pod_metadata_service_server::PodMetadataServiceServer::new(self),
        )
    }

    fn boot_id(&self) -> String {
        self.boot_id.as_str().to_string()
    }
}

/// The call's deadline (grpc-timeout) or the default.
fn deadline<T>(request: &Request<T>) -> Duration {
    rivet_common::grpc::request_deadline(request, DEFAULT_DEADLINE)
}

fn invalid(field: &str, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}

/// Printable, bounded identifier-ish text.
fn check_text(field: &str, value: &str, max: usize, required: bool) -> Result<(), Status> {
    if required && value.is_empty() {
        return Err(invalid(field, "required"));
    }
    if value.len() > max {
        return Err(invalid(field, format!("at most {max} bytes")));
    }
    if value.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(invalid(field, "must not contain whitespace or control characters"));
    }
    Ok(())
}

/// A Linux interface name: 1..=15 bytes, no '/', ':' or whitespace.
fn check_ifname(field: &str, value: &str) -> Result<(), Status> {
    check_text(field, value, 15, true)?;
    if value.contains(['/', ':']) || value == "." || value == ".." {
        return Err(invalid(field, "not a valid interface name"));
    }
    Ok(())
}

/// An optional Kubernetes name: empty (the caller's default), or one that
/// `rule` accepts ([`k8s_name::check_namespace`] for namespaces,
/// [`k8s_name::check_dns_subdomain`] for pod and policy names).
fn check_k8s_name(field: &str, value: &str, rule: fn(&str) -> Result<(), NameError>) -> Result<(), Status> {
    if value.is_empty() {
        return Ok(());
    }
    rule(value).map_err(|e| invalid(field, format!("{value:?} {e}")))
}

fn parse_labels(field: &str, raw: &[String]) -> Result<Labels, Status> {
    if raw.len() > 256 {
        return Err(invalid(field, "at most 256 labels"));
    }
    let labels = Labels::parse(raw).map_err(|e| invalid(field, e))?;
    // A pod's own labels never name a reserved identity or a CIDR: a client
    // of this socket must not make a pod `reserved:host` (rivet-cni refuses
    // them too; this is the daemon's own check).
    if let Some(label) = labels
        .iter()
        .find(|l| matches!(l.source(), LabelSource::Reserved | LabelSource::Cidr))
    {
        return Err(invalid(
            field,
            format!("{label}: source {} is not a pod label source", label.source()),
        ));
    }
    Ok(labels)
}

fn parse_named_ports(field: &str, raw: &[pb::NamedPort]) -> Result<Vec<NamedPort>, Status> {
    if raw.len() > 256 {
        return Err(invalid(field, "at most 256 named ports"));
    }
    let mut ports = Vec::with_capacity(raw.len());
    for (i, p) in raw.iter().enumerate() {
        let field = format!("{field}[{i}]");
        rivet_common::named_port::check_port_name(&p.name).map_err(|e| invalid(&format!("{field}.name"), e))?;
        let protocol = match p.protocol.as_str() {
            "" | "TCP" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => Protocol::Sctp,
            other => {
                return Err(invalid(
                    &format!("{field}.protocol"),
                    format!("{other:?}: must be TCP, UDP or SCTP"),
                ));
            }
        };
        let port = u16::try_from(p.port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| invalid(&format!("{field}.port"), "must be 1..65535"))?;
        ports.push(NamedPort {
            name: p.name.clone(),
            protocol,
            port,
        });
    }
    Ok(ports)
}

/// Validates a create request into a spec (id and creation time unset).
pub fn validate_create(r: &pb::CreateEndpointRequest) -> Result<EndpointSpec, Status> {
    check_text("container_id", &r.container_id, 256, true)?;
    check_ifname("interface", &r.interface)?;
    if !r.netns_path.starts_with('/') || r.netns_path.len() > 4096 || r.netns_path.chars().any(char::is_control) {
        return Err(invalid("netns_path", "must be an absolute path"));
    }
    check_ifname("host_interface", &r.host_interface)?;
    if r.host_ifindex == 0 {
        return Err(invalid("host_ifindex", "required"));
    }
    if r.addresses.is_empty() || r.addresses.len() > 2 {
        return Err(invalid("addresses", "one or two addresses (at most one per family)"));
    }
    let mut addresses = Vec::new();
    for (i, a) in r.addresses.iter().enumerate() {
        let field = format!("addresses[{i}].address");
        let address = address_field(&field, &a.address)?;
        if address.is_unspecified() || address.is_multicast() || address.is_loopback() {
            return Err(invalid(&field, "must be a unicast, non-loopback address"));
        }
        if addresses
            .iter()
            .any(|e: &EndpointAddress| e.address.is_ipv4() == address.is_ipv4())
        {
            return Err(invalid("addresses", "at most one address per family"));
        }
        check_text(&format!("addresses[{i}].ipam_pool"), &a.ipam_pool, 63, false)?;
        addresses.push(EndpointAddress {
            address,
            ipam_pool: a.ipam_pool.clone(),
        });
    }
    let mac = mac_field("mac", &r.mac)?;
    if mac == [0; 6] || mac[0] & 1 == 1 {
        return Err(invalid("mac", "must be a non-zero unicast MAC"));
    }
    check_k8s_name("pod_namespace", &r.pod_namespace, k8s_name::check_namespace)?;
    check_k8s_name("pod_name", &r.pod_name, k8s_name::check_dns_subdomain)?;
    check_text("pod_uid", &r.pod_uid, 128, false)?;
    Ok(EndpointSpec {
        id: 0,
        container_id: r.container_id.clone(),
        interface: r.interface.clone(),
        netns_path: r.netns_path.clone(),
        host_interface: r.host_interface.clone(),
        host_ifindex: r.host_ifindex,
        addresses,
        mac,
        pod_namespace: if r.pod_namespace.is_empty() {
            DEFAULT_NAMESPACE.into()
        } else {
            r.pod_namespace.clone()
        },
        pod_name: r.pod_name.clone(),
        pod_uid: r.pod_uid.clone(),
        labels: parse_labels("labels", &r.labels)?,
        named_ports: parse_named_ports("named_ports", &r.named_ports)?,
        created: SystemTime::UNIX_EPOCH,
        labels_pending: false,
        kind: endpoint_kind(r)?,
    })
}

/// The kind a create asks for; a health endpoint carries nothing of a pod.
fn endpoint_kind(r: &pb::CreateEndpointRequest) -> Result<EndpointKind, Status> {
    match pb::EndpointKind::try_from(r.kind) {
        Ok(pb::EndpointKind::Unspecified | pb::EndpointKind::Pod) => Ok(EndpointKind::Pod),
        Ok(pb::EndpointKind::Health) => {
            if !r.labels.is_empty() || !r.named_ports.is_empty() || !r.pod_name.is_empty() {
                return Err(invalid(
                    "kind",
                    "a health endpoint has no labels, named ports or pod name (its identity is reserved:health)",
                ));
            }
            Ok(EndpointKind::Health)
        }
        Err(_) => Err(invalid("kind", format!("unknown value {}", r.kind))),
    }
}

/// Only root creates the node's health endpoint (rivet-cni, run by `rivet
/// node up`): the reserved `health` identity is allowed by no pod policy, so
/// no other client of this socket may give it to an interface.
fn check_health_caller<T>(request: &Request<T>, kind: EndpointKind) -> Result<(), Status> {
    if kind != EndpointKind::Health {
        return Ok(());
    }
    match request.extensions().get::<PeerAccess>() {
        // No peer credentials: an in-process server (tests), not a socket peer.
        None => Ok(()),
        Some(p) if p.peer.uid == 0 => Ok(()),
        Some(p) => Err(Status::permission_denied(format!(
            "kind: only root (rivet-cni run by `rivet node up`) creates the health endpoint; uid {} may not",
            p.peer.uid
        ))),
    }
}

/// Validates an endpoint reference.
pub fn parse_ref(r: Option<&pb::EndpointRef>) -> Result<EndpointSelector, Status> {
    use pb::endpoint_ref::Ref;
    match r.and_then(|r| r.r#ref.as_ref()) {
        None => Err(invalid("ref", "required")),
        Some(Ref::Id(id)) => u16::try_from(*id)
            .ok()
            .filter(|id| *id != 0)
            .map(EndpointSelector::Id)
            .ok_or_else(|| invalid("ref.id", "must be 1..65535")),
        Some(Ref::Container(c)) => {
            check_text("ref.container.container_id", &c.container_id, 256, true)?;
            if !c.interface.is_empty() {
                check_ifname("ref.container.interface", &c.interface)?;
            }
            Ok(EndpointSelector::Container {
                container_id: c.container_id.clone(),
                interface: c.interface.clone(),
            })
        }
        Some(Ref::Pod(p)) => {
            if p.name.is_empty() {
                return Err(invalid("ref.pod.name", "required"));
            }
            check_k8s_name("ref.pod.namespace", &p.namespace, k8s_name::check_namespace)?;
            check_k8s_name("ref.pod.name", &p.name, k8s_name::check_dns_subdomain)?;
            Ok(EndpointSelector::Pod {
                namespace: if p.namespace.is_empty() {
                    DEFAULT_NAMESPACE.into()
                } else {
                    p.namespace.clone()
                },
                name: p.name.clone(),
            })
        }
        Some(Ref::Address(a)) => address_field("ref.address", a).map(EndpointSelector::Address),
    }
}

/// Validates an UpdateLabels request: the endpoints and their new labels.
pub fn validate_update_labels(r: &pb::UpdateLabelsRequest) -> Result<(EndpointSelector, Labels), Status> {
    Ok((parse_ref(r.r#ref.as_ref())?, parse_labels("labels", &r.labels)?))
}

/// Validates an UpsertPolicy request: its document parses as a policy
/// (of at most 1 MiB) and its origin is known.
pub fn validate_upsert_policy(r: &pb::UpsertPolicyRequest) -> Result<(Policy, PolicyOrigin), Status> {
    if r.document.len() > MAX_DOCUMENT_BYTES {
        return Err(invalid("document", format!("at most {MAX_DOCUMENT_BYTES} bytes")));
    }
    let origin = origin(r.origin)?;
    let policy = Policy::parse(&r.document).map_err(|e| invalid("document", e))?;
    Ok((policy, origin))
}

/// Validates a DeletePolicy request: the key and the origin.
pub fn validate_delete_policy(r: &pb::DeletePolicyRequest) -> Result<(PolicyKey, PolicyOrigin), Status> {
    Ok((parse_key(r.key.as_ref())?, origin(r.origin)?))
}

/// Validates a SetNamespaceLabels request into the namespace's labels.
pub fn validate_namespace_labels(r: &pb::SetNamespaceLabelsRequest) -> Result<BTreeMap<String, String>, Status> {
    parse_namespace_labels("", r)
}

fn origin(raw: i32) -> Result<PolicyOrigin, Status> {
    match pb::PolicyOrigin::try_from(raw) {
        Ok(pb::PolicyOrigin::Unspecified | pb::PolicyOrigin::Api) => Ok(PolicyOrigin::Api),
        Ok(pb::PolicyOrigin::Directory) => Ok(PolicyOrigin::Directory),
        Ok(pb::PolicyOrigin::Kubernetes) => Ok(PolicyOrigin::Kubernetes),
        Err(_) => Err(invalid("origin", format!("unknown value {raw}"))),
    }
}

fn origin_proto(origin: PolicyOrigin) -> pb::PolicyOrigin {
    match origin {
        PolicyOrigin::Api => pb::PolicyOrigin::Api,
        PolicyOrigin::Directory => pb::PolicyOrigin::Directory,
        PolicyOrigin::Kubernetes => pb::PolicyOrigin::Kubernetes,
    }
}

fn parse_key(key: Option<&pb::PolicyKey>) -> Result<PolicyKey, Status> {
    let key = key.ok_or_else(|| invalid("key", "required"))?;
    let kind = if key.kind.is_empty() {
        PolicyKind::NetworkPolicy
    } else {
        key.kind.parse().map_err(|_| {
            invalid(
                "key.kind",
                format!("{:?}: must be NetworkPolicy or RivetNetworkPolicy", key.kind),
            )
        })?
    };
    if key.name.is_empty() {
        return Err(invalid("key.name", "required"));
    }
    check_k8s_name("key.namespace", &key.namespace, k8s_name::check_namespace)?;
    check_k8s_name("key.name", &key.name, k8s_name::check_dns_subdomain)?;
    Ok(PolicyKey {
        kind,
        namespace: if key.namespace.is_empty() {
            DEFAULT_NAMESPACE.into()
        } else {
            key.namespace.clone()
        },
        name: key.name.clone(),
    })
}

fn key_proto(key: &PolicyKey) -> pb::PolicyKey {
    pb::PolicyKey {
        kind: key.kind.as_str().into(),
        namespace: key.namespace.clone(),
        name: key.name.clone(),
    }
}

fn policy_proto(stored: &StoredPolicy, documents: bool, selected: Vec<u32>) -> pb::Policy {
    pb::Policy {
        key: Some(key_proto(stored.policy.key())),
        origin: origin_proto(stored.origin).into(),
        api_version: stored.policy.api_version().into(),
        document: if documents {
            stored.policy.document().into()
        } else {
            String::new()
        },
        normalized_json: if documents {
            stored.policy.normalized_json()
        } else {
            String::new()
        },
        revision: stored.revision,
        updated_unix_nanos: unix_nanos(stored.updated),
        selected_endpoints: selected,
    }
}

fn status(e: ManagerError) -> Status {
    e.into()
}

#[tonic::async_trait]
impl pb::endpoint_service_server::EndpointService for EndpointApi {
    async fn create_endpoint(
        &self,
        request: Request<pb::CreateEndpointRequest>,
    ) -> Result<Response<pb::CreateEndpointResponse>, Status> {
        let deadline = deadline(&request);
        let spec = validate_create(request.get_ref())?;
        check_health_caller(&request, spec.kind)?;
        let r = request.into_inner();
        let (view, created) = self
            .manager
            .create(NewEndpoint { spec, sync: !r.r#async }, deadline)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::CreateEndpointResponse {
            endpoint: Some(endpoint::to_proto(&view.spec, &view.status, false)),
            created,
            boot_id: self.boot_id(),
        }))
    }

    async fn delete_endpoint(
        &self,
        request: Request<pb::DeleteEndpointRequest>,
    ) -> Result<Response<pb::DeleteEndpointResponse>, Status> {
        let deadline = deadline(&request);
        let selector = parse_ref(request.get_ref().r#ref.as_ref())?;
        let deleted = self.manager.delete(&selector, deadline).await.map_err(status)?;
        Ok(Response::new(pb::DeleteEndpointResponse {
            deleted: deleted.into_iter().map(u32::from).collect(),
            boot_id: self.boot_id(),
        }))
    }

    async fn update_labels(
        &self,
        request: Request<pb::UpdateLabelsRequest>,
    ) -> Result<Response<pb::UpdateLabelsResponse>, Status> {
        let deadline = deadline(&request);
        let r = request.into_inner();
        let (selector, labels) = validate_update_labels(&r)?;
        let (views, reidentified) = self
            .manager
            .update_labels(&selector, labels, !r.r#async, deadline)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::UpdateLabelsResponse {
            endpoints: views
                .iter()
                .map(|v| endpoint::to_proto(&v.spec, &v.status, false))
                .collect(),
            reidentified: u32::try_from(reidentified).unwrap_or(u32::MAX),
            boot_id: self.boot_id(),
        }))
    }

    async fn get_endpoint(
        &self,
        request: Request<pb::GetEndpointRequest>,
    ) -> Result<Response<pb::GetEndpointResponse>, Status> {
        let selector = parse_ref(request.get_ref().r#ref.as_ref())?;
        let view = self.manager.get(&selector).map_err(status)?;
        Ok(Response::new(pb::GetEndpointResponse {
            endpoint: Some(endpoint::to_proto(&view.spec, &view.status, true)),
            boot_id: self.boot_id(),
        }))
    }

    async fn list_endpoints(
        &self,
        request: Request<pb::ListEndpointsRequest>,
    ) -> Result<Response<pb::ListEndpointsResponse>, Status> {
        let r = request.into_inner();
        let state = match pb::EndpointState::try_from(r.state) {
            Ok(s) => EndpointState::from_proto(s),
            Err(_) => return Err(invalid("state", format!("unknown value {}", r.state))),
        };
        let endpoints = self
            .manager
            .list()
            .into_iter()
            .filter(|v| state.is_none_or(|s| v.status.state == s))
            .filter(|v| r.pod_namespace.is_empty() || v.spec.pod_namespace == r.pod_namespace)
            .filter(|v| r.identity == 0 || v.status.identity == r.identity)
            .map(|v| endpoint::to_proto(&v.spec, &v.status, r.include_history))
            .collect();
        Ok(Response::new(pb::ListEndpointsResponse {
            endpoints,
            restore_complete: self.manager.restore_progress().complete,
            boot_id: self.boot_id(),
        }))
    }

    type WatchEndpointsStream = futures::stream::BoxStream<'static, Result<pb::WatchEndpointsResponse, Status>>;

    async fn watch_endpoints(
        &self,
        request: Request<pb::WatchEndpointsRequest>,
    ) -> Result<Response<Self::WatchEndpointsStream>, Status> {
        use pb::watch_endpoints_response::Event;
        let include_history = request.get_ref().include_history;
        let boot_id = self.boot_id();
        let events = self.manager.watch().map(move |event| {
            let event = match event {
                EndpointEvent::Upserted(v) => Event::Upserted(endpoint::to_proto(&v.spec, &v.status, include_history)),
                EndpointEvent::Removed(v) => Event::Removed(endpoint::to_proto(&v.spec, &v.status, include_history)),
                EndpointEvent::Synced => Event::Synced(true),
            };
            Ok(pb::WatchEndpointsResponse {
                event: Some(event),
                boot_id: boot_id.clone(),
            })
        });
        Ok(Response::new(events.boxed()))
    }

    async fn get_status(&self, _: Request<pb::GetStatusRequest>) -> Result<Response<pb::GetStatusResponse>, Status> {
        let restore = self.manager.restore_progress();
        let (revision, policies) = self.manager.policy_summary();
        Ok(Response::new(pb::GetStatusResponse {
            restore: Some(pb::RestoreStatus {
                phase: if restore.complete {
                    pb::RestorePhase::Complete
                } else {
                    pb::RestorePhase::Running
                }
                .into(),
                found: restore.found,
                restored: restore.restored,
                dropped: restore.dropped,
                failed: restore.failed,
                started_unix_nanos: restore.started.map_or(0, unix_nanos),
                finished_unix_nanos: restore.finished.map_or(0, unix_nanos),
            }),
            endpoints_by_state: self
                .manager
                .counts()
                .into_iter()
                .map(|(state, count)| pb::StateCount {
                    state: state.to_proto().into(),
                    count: u32::try_from(count).unwrap_or(u32::MAX),
                })
                .collect(),
            policy_revision: revision,
            policies: u32::try_from(policies).unwrap_or(u32::MAX),
            dependencies: self
                .manager
                .dependencies()
                .into_iter()
                .map(|d| pb::Dependency {
                    name: d.name.into(),
                    connected: d.connected,
                    seen_boot_id: d.seen_boot_id,
                    last_resync_unix_nanos: d.last_resync.map_or(0, unix_nanos),
                    last_error: d.last_error,
                })
                .collect(),
            boot_id: self.boot_id(),
            policy_dir: {
                let dir = self.manager.policy_dir_status();
                dir.dir.map(|path| pb::PolicyDirStatus {
                    dir: path.display().to_string(),
                    scans: dir.scans,
                    files_rejected: dir.files_rejected,
                    last_error: dir.last_error,
                })
            },
            policy_sources: self
                .manager
                .policy_sources()
                .origins()
                .into_iter()
                .map(|o| origin_proto(o).into())
                .collect(),
            kubernetes_mode: self.manager.kubernetes_mode(),
            labels_pending: count(self.manager.labels_pending()),
        }))
    }
}

/// Largest policy document accepted.
const MAX_DOCUMENT_BYTES: usize = 1 << 20;

#[tonic::async_trait]
impl pb::policy_service_server::PolicyService for EndpointApi {
    async fn upsert_policy(
        &self,
        request: Request<pb::UpsertPolicyRequest>,
    ) -> Result<Response<pb::UpsertPolicyResponse>, Status> {
        let deadline = deadline(&request);
        let r = request.into_inner();
        let (policy, origin) = validate_upsert_policy(&r)?;
        let update = self
            .manager
            .upsert_policy(policy, origin, r.wait, deadline)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::UpsertPolicyResponse {
            key: Some(key_proto(&update.change.key)),
            revision: update.change.revision,
            changed: update.change.changed,
            affected_endpoints: u32::try_from(update.affected).unwrap_or(u32::MAX),
            realised_endpoints: u32::try_from(update.realised).unwrap_or(u32::MAX),
            boot_id: self.boot_id(),
        }))
    }

    async fn delete_policy(
        &self,
        request: Request<pb::DeletePolicyRequest>,
    ) -> Result<Response<pb::DeletePolicyResponse>, Status> {
        let deadline = deadline(&request);
        let r = request.into_inner();
        let (key, origin) = validate_delete_policy(&r)?;
        let update = self
            .manager
            .delete_policy(&key, origin, r.wait, deadline)
            .await
            .map_err(status)?;
        let (revision, _) = self.manager.policy_summary();
        Ok(Response::new(pb::DeletePolicyResponse {
            deleted: update.is_some(),
            revision,
            affected_endpoints: update
                .as_ref()
                .map_or(0, |u| u32::try_from(u.affected).unwrap_or(u32::MAX)),
            realised_endpoints: update
                .as_ref()
                .map_or(0, |u| u32::try_from(u.realised).unwrap_or(u32::MAX)),
            boot_id: self.boot_id(),
        }))
    }

    async fn list_policies(
        &self,
        request: Request<pb::ListPoliciesRequest>,
    ) -> Result<Response<pb::ListPoliciesResponse>, Status> {
        let r = request.into_inner();
        let only_origin = match pb::PolicyOrigin::try_from(r.origin) {
            Ok(pb::PolicyOrigin::Unspecified) => None,
            Ok(_) => Some(origin(r.origin)?),
            Err(_) => return Err(invalid("origin", format!("unknown value {}", r.origin))),
        };
        let (policies, revision) = self.manager.policies();
        Ok(Response::new(pb::ListPoliciesResponse {
            policies: policies
                .iter()
                .filter(|p| r.namespace.is_empty() || p.policy.key().namespace == r.namespace)
                .filter(|p| only_origin.is_none_or(|o| p.origin == o))
                .map(|p| policy_proto(p, r.include_documents, Vec::new()))
                .collect(),
            revision,
            boot_id: self.boot_id(),
        }))
    }

    async fn get_policy(
        &self,
        request: Request<pb::GetPolicyRequest>,
    ) -> Result<Response<pb::GetPolicyResponse>, Status> {
        let key = parse_key(request.get_ref().key.as_ref())?;
        let (stored, selected) = self.manager.policy(&key).ok_or_else(|| {
            rivet_common::grpc::status_with_reason(
                tonic::Code::NotFound,
                format!("no policy {key}"),
                pb::ErrorReason::PolicyNotFound,
            )
        })?;
        Ok(Response::new(pb::GetPolicyResponse {
            policy: Some(policy_proto(
                &stored,
                true,
                selected.into_iter().map(u32::from).collect(),
            )),
            boot_id: self.boot_id(),
        }))
    }
}

#[tonic::async_trait]
impl pb::namespace_service_server::NamespaceService for EndpointApi {
    async fn set_namespace_labels(
        &self,
        request: Request<pb::SetNamespaceLabelsRequest>,
    ) -> Result<Response<pb::SetNamespaceLabelsResponse>, Status> {
        let r = request.into_inner();
        let labels = validate_namespace_labels(&r)?;
        let (changed, affected) = self
            .manager
            .set_namespace_labels(&r.namespace, labels)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::SetNamespaceLabelsResponse {
            changed,
            affected_endpoints: u32::try_from(affected).unwrap_or(u32::MAX),
            boot_id: self.boot_id(),
        }))
    }

    async fn list_namespaces(
        &self,
        _: Request<pb::ListNamespacesRequest>,
    ) -> Result<Response<pb::ListNamespacesResponse>, Status> {
        Ok(Response::new(pb::ListNamespacesResponse {
            namespaces: self
                .manager
                .namespaces()
                .into_iter()
                .map(|(name, labels, endpoints)| pb::Namespace {
                    name,
                    labels: labels.labels.iter().map(|(k, v)| format!("k8s:{k}={v}")).collect(),
                    endpoints: u32::try_from(endpoints).unwrap_or(u32::MAX),
                    updated_unix_nanos: labels.updated.map_or(0, unix_nanos),
                })
                .collect(),
            boot_id: self.boot_id(),
        }))
    }
}

/// Items a replay may carry (a bound on what one call holds in memory).
const MAX_REPLAY_ITEMS: usize = 1_000_000;

/// Validates one pod's metadata (`field` names it in errors).
pub fn parse_pod_metadata(field: &str, m: &pb::PodMetadata) -> Result<(PodName, PodMetadata), Status> {
    let pod = m
        .pod
        .as_ref()
        .ok_or_else(|| invalid(&format!("{field}.pod"), "required"))?;
    if pod.namespace.is_empty() {
        return Err(invalid(&format!("{field}.pod.namespace"), "required"));
    }
    if pod.name.is_empty() {
        return Err(invalid(&format!("{field}.pod.name"), "required"));
    }
    check_k8s_name(
        &format!("{field}.pod.namespace"),
        &pod.namespace,
        k8s_name::check_namespace,
    )?;
    check_k8s_name(&format!("{field}.pod.name"), &pod.name, k8s_name::check_dns_subdomain)?;
    check_text(&format!("{field}.uid"), &m.uid, 128, false)?;
    let labels = parse_labels(&format!("{field}.labels"), &m.labels)?;
    // Only Kubernetes' own labels: a feed must not make a pod `reserved:host`.
    if let Some(label) = labels.iter().find(|l| l.source() != LabelSource::K8s) {
        return Err(invalid(
            &format!("{field}.labels"),
            format!("{label}: pod labels must have source k8s"),
        ));
    }
    let named_ports = parse_named_ports(&format!("{field}.named_ports"), &m.named_ports)?;
    Ok((
        (pod.namespace.clone(), pod.name.clone()),
        PodMetadata {
            uid: m.uid.clone(),
            labels,
            named_ports,
        },
    ))
}

/// Validates a SetNamespaceLabels request (or a replay's namespace item).
fn parse_namespace_labels(field: &str, r: &pb::SetNamespaceLabelsRequest) -> Result<BTreeMap<String, String>, Status> {
    let name_field = if field.is_empty() {
        "namespace".to_string()
    } else {
        format!("{field}.namespace")
    };
    let labels_field = if field.is_empty() {
        "labels".to_string()
    } else {
        format!("{field}.labels")
    };
    if r.namespace.is_empty() {
        return Err(invalid(&name_field, "required"));
    }
    check_k8s_name(&name_field, &r.namespace, k8s_name::check_namespace)?;
    if r.labels.len() > 256 {
        return Err(invalid(&labels_field, "at most 256 labels"));
    }
    let mut labels = BTreeMap::new();
    for (i, text) in r.labels.iter().enumerate() {
        let (key, value) = parse_namespace_label(text).map_err(|e| invalid(&format!("{labels_field}[{i}]"), e))?;
        labels.insert(key, value);
    }
    Ok(labels)
}

fn pod_ref(field: &str, pod: Option<&pb::PodRef>) -> Result<PodName, Status> {
    let pod = pod.ok_or_else(|| invalid(field, "required"))?;
    if pod.namespace.is_empty() {
        return Err(invalid(&format!("{field}.namespace"), "required"));
    }
    if pod.name.is_empty() {
        return Err(invalid(&format!("{field}.name"), "required"));
    }
    check_k8s_name(&format!("{field}.namespace"), &pod.namespace, k8s_name::check_namespace)?;
    check_k8s_name(&format!("{field}.name"), &pod.name, k8s_name::check_dns_subdomain)?;
    Ok((pod.namespace.clone(), pod.name.clone()))
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[tonic::async_trait]
impl pb::pod_metadata_service_server::PodMetadataService for EndpointApi {
    async fn set_pod_metadata(
        &self,
        request: Request<pb::SetPodMetadataRequest>,
    ) -> Result<Response<pb::SetPodMetadataResponse>, Status> {
        let deadline = deadline(&request);
        let r = request.into_inner();
        if !self.manager.kubernetes_mode() {
            return Err(status(ManagerError::KubernetesModeOff));
        }
        let metadata = r.metadata.as_ref().ok_or_else(|| invalid("metadata", "required"))?;
        let (pod, metadata) = parse_pod_metadata("metadata", metadata)?;
        let (changed, affected) = self
            .manager
            .set_pod_metadata(pod, metadata, r.wait, deadline)
            .await
            .map_err(status)?;
        Ok(Response::new(pb::SetPodMetadataResponse {
            changed,
            affected_endpoints: count(affected),
            boot_id: self.boot_id(),
        }))
    }

    async fn delete_pod_metadata(
        &self,
        request: Request<pb::DeletePodMetadataRequest>,
    ) -> Result<Response<pb::DeletePodMetadataResponse>, Status> {
        if !self.manager.kubernetes_mode() {
            return Err(status(ManagerError::KubernetesModeOff));
        }
        let pod = pod_ref("pod", request.get_ref().pod.as_ref())?;
        let deleted = self.manager.delete_pod_metadata(&pod).await.map_err(status)?;
        Ok(Response::new(pb::DeletePodMetadataResponse {
            deleted,
            boot_id: self.boot_id(),
        }))
    }

    async fn replay_kubernetes(
        &self,
        request: Request<tonic::Streaming<pb::ReplayKubernetesRequest>>,
    ) -> Result<Response<pb::ReplayKubernetesResponse>, Status> {
        use pb::replay_kubernetes_request::Item;
        if !self.manager.kubernetes_mode() {
            return Err(status(ManagerError::KubernetesModeOff));
        }
        let mut stream = request.into_inner();
        let mut replay = KubernetesReplay::default();
        let mut rejected = Vec::new();
        let mut reject = |item: String, error: &Status| {
            rejected.push(pb::ReplayItemError {
                item,
                error: error.message().to_string(),
                reason: rivet_common::grpc::error_reason::<pb::ErrorReason>(error).unwrap_or_default() as i32,
                service_object: None,
            })
        };
        let mut ended = false;
        let mut items = 0usize;
        let mut service_documents: Vec<(String, String)> = Vec::new();
        while let Some(request) = stream.message().await? {
            items += 1;
            if ended {
                return Err(invalid(
                    "end",
                    format!("item {items} follows `end`, which must be last; nothing was applied"),
                ));
            }
            if items > MAX_REPLAY_ITEMS {
                return Err(invalid(
                    "item",
                    format!("at most {MAX_REPLAY_ITEMS} items; nothing was applied"),
                ));
            }
            match request.item {
                Some(Item::Pod(p)) => match parse_pod_metadata("pod", &p) {
                    Ok((pod, metadata)) => {
                        replay.pods.insert(pod, metadata);
                    }
                    Err(e) => {
                        let name = p.pod.map(|p| format!("pod {}/{}", p.namespace, p.name));
                        reject(name.unwrap_or_else(|| format!("item {items}")), &e);
                        replay.rejected_pods = true;
                    }
                },
                Some(Item::Namespace(n)) => match parse_namespace_labels("namespace", &n) {
                    Ok(labels) => {
                        replay.namespaces.insert(n.namespace, labels);
                    }
                    Err(e) => {
                        reject(format!("namespace {}", n.namespace), &e);
                        replay.rejected_namespaces = true;
                    }
                },
                Some(Item::PolicyDocument(document)) => {
                    let parsed = if document.len() > MAX_DOCUMENT_BYTES {
                        Err(invalid(
                            "policy_document",
                            format!("at most {MAX_DOCUMENT_BYTES} bytes"),
                        ))
                    } else {
                        Policy::parse(&document).map_err(|e| invalid("policy_document", e))
                    };
                    match parsed {
                        Ok(policy) => replay.policies.push(policy),
                        Err(e) => {
                            reject(format!("item {items}"), &e);
                            replay.rejected_policies = true;
                        }
                    }
                }
                Some(Item::ServiceDocument(document)) => {
                    match crate::catalog_api::document("service_document", &document) {
                        Ok(()) if self.catalog.is_some() => service_documents.push((format!("item {items}"), document)),
                        Ok(()) => reject(
                            format!("item {items}"),
                            &Status::unimplemented("this svc-endpoint has no service catalog"),
                        ),
                        Err(e) => {
                            let e = rivet_common::grpc::status_with_reason(
                                e.code(),
                                e.message(),
                                pb::ErrorReason::ServiceInvalid,
                            );
                            reject(format!("item {items}"), &e);
                        }
                    }
                }
                Some(Item::End(true)) => ended = true,
                Some(Item::End(false)) | None => {
                    reject(format!("item {items}"), &invalid("item", "empty"));
                }
            }
        }
        if !ended {
            return Err(invalid(
                "end",
                "the replay ended without `end`: nothing was applied or forgotten",
            ));
        }
        let (pods, namespaces, policies) = (replay.pods.len(), replay.namespaces.len(), replay.policies.len());
        let outcome = self.manager.replay_kubernetes(replay).await.map_err(status)?;
        rejected.extend(outcome.rejected.iter().map(|(key, error)| pb::ReplayItemError {
            item: format!("policy {key}"),
            error: error.clone(),
            // The manager keeps policies' refusals as text.
            reason: pb::ErrorReason::Unspecified as i32,
            service_object: None,
        }));
        let mut services = crate::catalog::ServiceReplay::default();
        if let Some(catalog) = &self.catalog {
            services = catalog.replay_kubernetes(service_documents).await?;
        }
        rejected.extend(services.rejected.iter().map(|r| pb::ReplayItemError {
            item: r.item.clone(),
            error: r.message.clone(),
            reason: r.reason as i32,
            service_object: r.key.as_ref().map(crate::catalog_api::key_proto),
        }));
        Ok(Response::new(pb::ReplayKubernetesResponse {
            pods: count(pods),
            namespaces: count(namespaces),
            policies: count(policies - outcome.rejected.len()),
            pods_forgotten: count(outcome.pods_forgotten),
            namespaces_forgotten: count(outcome.namespaces_forgotten),
            policies_removed: count(outcome.policies_removed),
            affected_endpoints: count(outcome.affected_endpoints),
            rejected,
            boot_id: self.boot_id(),
            service_objects: count(services.applied),
            service_objects_removed: count(services.removed),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create() -> pb::CreateEndpointRequest {
        pb::CreateEndpointRequest {
            container_id: "abc123".into(),
            interface: "eth0".into(),
            netns_path: "/run/netns/pod".into(),
            host_interface: "lxc1234".into(),
            host_ifindex: 7,
            addresses: vec![pb::EndpointAddress {
                address: vec![198, 18, 0, 5],
                ipam_pool: "default".into(),
            }],
            mac: vec![2, 0, 0xc6, 0x12, 0, 5],
            pod_namespace: String::new(),
            pod_name: "web-1".into(),
            labels: vec!["k8s:app=web".into()],
            ..Default::default()
        }
    }

    #[test]
    fn a_valid_create_becomes_a_spec_in_the_default_namespace() {
        let spec = validate_create(&create()).expect("a complete request must validate");
        assert_eq!(
            spec.pod_namespace, "default",
            "an endpoint without a namespace lives in `default`"
        );
        assert_eq!(spec.mac, [2, 0, 0xc6, 0x12, 0, 5]);
    }

    #[test]
    fn every_bad_field_is_named() {
        type Mutation = Box<dyn Fn(&mut pb::CreateEndpointRequest)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("container_id", Box::new(|r| r.container_id.clear())),
            ("container_id", Box::new(|r| r.container_id = "a b".into())),
            ("interface", Box::new(|r| r.interface = "much-too-long-name".into())),
            ("netns_path", Box::new(|r| r.netns_path = "relative".into())),
            ("host_interface", Box::new(|r| r.host_interface = "a/b".into())),
            ("host_ifindex", Box::new(|r| r.host_ifindex = 0)),
            ("addresses", Box::new(|r| r.addresses.clear())),
            (
                "addresses[0].address",
                Box::new(|r| r.addresses[0].address = b"198.18.0.5".to_vec()),
            ),
            (
                "addresses[0].address",
                Box::new(|r| r.addresses[0].address = vec![0; 4]),
            ),
            (
                "addresses[0].address",
                Box::new(|r| {
                    r.addresses[0].address = "::ffff:198.18.0.5"
                        .parse::<std::net::Ipv6Addr>()
                        .unwrap()
                        .octets()
                        .to_vec()
                }),
            ),
            (
                "addresses",
                Box::new(|r| {
                    r.addresses.push(pb::EndpointAddress {
                        address: vec![198, 18, 0, 6],
                        ipam_pool: String::new(),
                    })
                }),
            ),
            ("mac", Box::new(|r| r.mac = vec![2, 0])),
            ("mac", Box::new(|r| r.mac = b"02:00:c6:12:00:05".to_vec())),
            ("mac", Box::new(|r| r.mac = vec![1, 0, 0x5e, 0, 0, 1])),
            ("pod_namespace", Box::new(|r| r.pod_namespace = "Shop".into())),
            // A namespace is a DNS label, a pod name a DNS subdomain.
            ("pod_namespace", Box::new(|r| r.pod_namespace = "shop.eu".into())),
            ("pod_name", Box::new(|r| r.pod_name = "web..1".into())),
            ("pod_name", Box::new(|r| r.pod_name = "web.-1".into())),
            ("labels", Box::new(|r| r.labels = vec!["k8s:=x".into()])),
            // A client must not give a pod a reserved identity or a CIDR's.
            ("labels", Box::new(|r| r.labels = vec!["reserved:host".into()])),
            ("labels", Box::new(|r| r.labels = vec!["cidr:198.18.0.0/15".into()])),
            // A health endpoint is no pod: its identity is reserved, whatever it would carry.
            (
                "kind",
                Box::new(|r| {
                    r.kind = pb::EndpointKind::Health.into();
                    r.labels = vec!["k8s:app=web".into()];
                }),
            ),
            (
                "kind",
                Box::new(|r| {
                    r.kind = pb::EndpointKind::Health.into();
                    r.pod_name = "web".into();
                }),
            ),
            ("kind", Box::new(|r| r.kind = 9)),
            (
                "named_ports[0].name",
                Box::new(|r| {
                    r.named_ports = vec![pb::NamedPort {
                        name: "HTTP".into(),
                        protocol: "TCP".into(),
                        port: 80,
                    }]
                }),
            ),
            (
                "named_ports[0].port",
                Box::new(|r| {
                    r.named_ports = vec![pb::NamedPort {
                        name: "http".into(),
                        protocol: "TCP".into(),
                        port: 70000,
                    }]
                }),
            ),
        ];
        for (field, mutate) in cases {
            let mut r = create();
            mutate(&mut r);
            let e = validate_create(&r).expect_err("an invalid request must be refused");
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(
                e.message().starts_with(&format!("{field}:")),
                "the error must name {field}: {}",
                e.message()
            );
        }
    }

    #[test]
    fn only_root_creates_the_health_endpoint() {
        use rivet_common::access::{Access, Peer};
        let mut r = create();
        r.labels.clear();
        r.pod_name.clear();
        r.named_ports.clear();
        r.kind = pb::EndpointKind::Health.into();
        let spec = validate_create(&r).unwrap();
        assert_eq!(spec.kind, EndpointKind::Health);
        let from = |uid| {
            let mut request = Request::new(r.clone());
            request.extensions_mut().insert(PeerAccess {
                peer: Peer {
                    uid,
                    gid: uid,
                    pid: None,
                    groups: vec![],
                },
                access: Access::Full,
            });
            request
        };
        check_health_caller(&from(0), spec.kind).unwrap();
        let refused = check_health_caller(&from(999), spec.kind).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(refused.message().contains("uid 999"), "{}", refused.message());
        // A pod from the same caller is fine.
        check_health_caller(&from(999), EndpointKind::Pod).unwrap();
    }

    #[test]
    fn references_parse_and_bad_ones_are_refused() {
        use pb::endpoint_ref::Ref;
        let r = |r: Ref| pb::EndpointRef { r#ref: Some(r) };
        assert_eq!(parse_ref(Some(&r(Ref::Id(5)))).unwrap(), EndpointSelector::Id(5));
        assert_eq!(
            parse_ref(Some(&r(Ref::Address(rivet_proto::net::address_bytes(
                "2001:2::5".parse().unwrap()
            )))))
            .unwrap(),
            EndpointSelector::Address("2001:2::5".parse().unwrap())
        );
        assert_eq!(
            parse_ref(Some(&r(Ref::Pod(pb::PodRef {
                namespace: String::new(),
                name: "web".into()
            }))))
            .unwrap(),
            EndpointSelector::Pod {
                namespace: "default".into(),
                name: "web".into()
            }
        );
        for bad in [
            r(Ref::Id(0)),
            r(Ref::Id(70000)),
            r(Ref::Address(b"198.18.0.5".to_vec())),
            r(Ref::Address(Vec::new())),
            pb::EndpointRef { r#ref: None },
        ] {
            assert_eq!(parse_ref(Some(&bad)).unwrap_err().code(), tonic::Code::InvalidArgument);
        }
    }
}
