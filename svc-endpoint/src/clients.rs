//! The daemons svc-endpoint drives, behind small traits: [`IdentityApi`]
//! (svc-identity), [`IpamApi`] (svc-ipam), [`LoaderApi`] and [`LoadBalancerApi`] (svc-loader) and,
//! in Kubernetes mode, [`PodDirectoryApi`] (svc-k8s-sync).
//! The gRPC implementations ([`GrpcIdentity`], [`GrpcIpam`], [`GrpcLoader`])
//! connect lazily over the node's Unix sockets, so svc-endpoint starts and
//! keeps running while a dependency is down or restarting.

use std::path::Path;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix_lazy, connection_lost_is_unavailable};
use rivet_proto::daemon::v1::{GetInfoRequest, daemon_client::DaemonClient};
use rivet_proto::identity::v1 as identity;
use rivet_proto::ipam::v1 as ipam;
use rivet_proto::k8s::v1 as k8s;
use rivet_proto::loader::v1 as loader;
use tonic::Status;

/// A call's result.
pub type ApiResult<T> = Result<T, Status>;

/// svc-identity as svc-endpoint uses it.
pub trait IdentityApi: Send + Sync + 'static {
    /// The server's boot id (GetInfo).
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>>;
    /// AllocateIdentity.
    fn allocate(
        &self,
        request: identity::AllocateIdentityRequest,
    ) -> BoxFuture<'_, ApiResult<identity::AllocateIdentityResponse>>;
    /// ReleaseIdentity.
    fn release(
        &self,
        request: identity::ReleaseIdentityRequest,
    ) -> BoxFuture<'_, ApiResult<identity::ReleaseIdentityResponse>>;
    /// ListIdentities.
    fn list(
        &self,
        request: identity::ListIdentitiesRequest,
    ) -> BoxFuture<'_, ApiResult<identity::ListIdentitiesResponse>>;
    /// WatchIdentities: snapshot then deltas.
    fn watch(&self) -> BoxFuture<'_, ApiResult<BoxStream<'static, ApiResult<identity::WatchIdentitiesResponse>>>>;
    /// AllocateCidrIdentities.
    fn allocate_cidrs(
        &self,
        request: identity::AllocateCidrIdentitiesRequest,
    ) -> BoxFuture<'_, ApiResult<identity::AllocateCidrIdentitiesResponse>>;
    /// ReleaseCidrIdentities.
    fn release_cidrs(
        &self,
        request: identity::ReleaseCidrIdentitiesRequest,
    ) -> BoxFuture<'_, ApiResult<identity::ReleaseCidrIdentitiesResponse>>;
    /// IpcacheService.WatchIpcache: snapshot then deltas of every entry.
    fn watch_ipcache(&self) -> BoxFuture<'_, ApiResult<BoxStream<'static, ApiResult<identity::WatchIpcacheResponse>>>>;
    /// IpcacheService.UpsertIp.
    fn upsert_ip(&self, request: identity::UpsertIpRequest) -> BoxFuture<'_, ApiResult<identity::UpsertIpResponse>>;
    /// IpcacheService.DeleteIp.
    fn delete_ip(&self, request: identity::DeleteIpRequest) -> BoxFuture<'_, ApiResult<identity::DeleteIpResponse>>;
    /// EndReplay: every claim was replayed to the boot it names.
    fn end_replay(&self, request: identity::EndReplayRequest) -> BoxFuture<'_, ApiResult<identity::EndReplayResponse>>;
}

/// svc-ipam as svc-endpoint uses it.
pub trait IpamApi: Send + Sync + 'static {
    /// The server's boot id (GetInfo).
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>>;
    /// Restore: re-reserve an address for its owner.
    fn restore(&self, request: ipam::RestoreRequest) -> BoxFuture<'_, ApiResult<ipam::AllocateResponse>>;
    /// Release: every address of an owner.
    fn release(&self, request: ipam::ReleaseRequest) -> BoxFuture<'_, ApiResult<ipam::ReleaseResponse>>;
}

/// svc-loader as svc-endpoint uses it.
pub trait LoaderApi: Send + Sync + 'static {
    /// The server's boot id (GetInfo).
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>>;
    /// ApplyEndpoint.
    fn apply(&self, request: loader::ApplyEndpointRequest) -> BoxFuture<'_, ApiResult<loader::ApplyEndpointResponse>>;
    /// RemoveEndpoint.
    fn remove(
        &self,
        request: loader::RemoveEndpointRequest,
    ) -> BoxFuture<'_, ApiResult<loader::RemoveEndpointResponse>>;
    /// ListEndpoints.
    fn list(&self) -> BoxFuture<'_, ApiResult<loader::ListEndpointsResponse>>;
    /// ListEndpointInterfaces.
    fn interfaces(&self) -> BoxFuture<'_, ApiResult<loader::ListEndpointInterfacesResponse>>;
}

fn boot_id(channel: &DaemonChannel) -> BoxFuture<'static, ApiResult<String>> {
    let mut client = DaemonClient::new(channel.clone());
    async move {
        let info = client
            .get_info(GetInfoRequest {})
            .await
            .map_err(connection_lost_is_unavailable)?;
        Ok(info.into_inner().boot_id)
    }
    .boxed()
}

/// svc-identity over its socket.
#[derive(Debug, Clone)]
pub struct GrpcIdentity {
    channel: DaemonChannel,
}

impl GrpcIdentity {
    /// A lazily connecting client of the socket at `path`.
    pub fn new(path: &Path, options: &ClientOptions) -> Self {
        Self {
            channel: connect_unix_lazy(path, options),
        }
    }

    fn identities(&self) -> identity::identity_service_client::IdentityServiceClient<DaemonChannel> {
        identity::identity_service_client::IdentityServiceClient::new(self.channel.clone())
    }

    fn ipcache(&self) -> identity::ipcache_service_client::IpcacheServiceClient<DaemonChannel> {
        identity::ipcache_service_client::IpcacheServiceClient::new(self.channel.clone())
    }
}

/// One unary call on a fresh client handle, boxed.
macro_rules! unary {
    ($client:expr, $method:ident, $request:expr) => {{
        let mut client = $client;
        let request = $request;
        async move {
            client
                .$method(request)
                .await
                .map(tonic::Response::into_inner)
                .map_err(connection_lost_is_unavailable)
        }
        .boxed()
    }};
}

impl IdentityApi for GrpcIdentity {
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>> {
        boot_id(&self.channel)
    }
    fn allocate(
        &self,
        request: identity::AllocateIdentityRequest,
    ) -> BoxFuture<'_, ApiResult<identity::AllocateIdentityResponse>> {
        unary!(self.identities(), allocate_identity, request)
    }
    fn release(
        &self,
        request: identity::ReleaseIdentityRequest,
    ) -> BoxFuture<'_, ApiResult<identity::ReleaseIdentityResponse>> {
        unary!(self.identities(), release_identity, request)
    }
    fn list(
        &self,
        request: identity::ListIdentitiesRequest,
    ) -> BoxFuture<'_, ApiResult<identity::ListIdentitiesResponse>> {
        unary!(self.identities(), list_identities, request)
    }
    fn watch(&self) -> BoxFuture<'_, ApiResult<BoxStream<'static, ApiResult<identity::WatchIdentitiesResponse>>>> {
        let mut client = self.identities();
        async move {
            let stream = client
                .watch_identities(identity::WatchIdentitiesRequest {})
                .await
                .map_err(connection_lost_is_unavailable)?
                .into_inner();
            Ok(stream.boxed())
        }
        .boxed()
    }
    fn allocate_cidrs(
        &self,
        request: identity::AllocateCidrIdentitiesRequest,
    ) -> BoxFuture<'_, ApiResult<identity::AllocateCidrIdentitiesResponse>> {
        unary!(self.identities(), allocate_cidr_identities, request)
    }
    fn release_cidrs(
        &self,
        request: identity::ReleaseCidrIdentitiesRequest,
    ) -> BoxFuture<'_, ApiResult<identity::ReleaseCidrIdentitiesResponse>> {
        unary!(self.identities(), release_cidr_identities, request)
    }
    fn watch_ipcache(&self) -> BoxFuture<'_, ApiResult<BoxStream<'static, ApiResult<identity::WatchIpcacheResponse>>>> {
        let mut client = self.ipcache();
        async move {
            let stream = client
                .watch_ipcache(identity::WatchIpcacheRequest { sources: Vec::new() })
                .await
                .map_err(connection_lost_is_unavailable)?
                .into_inner();
            Ok(stream.boxed())
        }
        .boxed()
    }
    fn upsert_ip(&self, request: identity::UpsertIpRequest) -> BoxFuture<'_, ApiResult<identity::UpsertIpResponse>> {
        unary!(self.ipcache(), upsert_ip, request)
    }
    fn end_replay(&self, request: identity::EndReplayRequest) -> BoxFuture<'_, ApiResult<identity::EndReplayResponse>> {
        unary!(self.identities(), end_replay, request)
    }
    fn delete_ip(&self, request: identity::DeleteIpRequest) -> BoxFuture<'_, ApiResult<identity::DeleteIpResponse>> {
        unary!(self.ipcache(), delete_ip, request)
    }
}

/// svc-ipam over its socket.
#[derive(Debug, Clone)]
pub struct GrpcIpam {
    channel: DaemonChannel,
}

impl GrpcIpam {
    /// A lazily connecting client of the socket at `path`.
    pub fn new(path: &Path, options: &ClientOptions) -> Self {
        Self {
            channel: connect_unix_lazy(path, options),
        }
    }

    fn client(&self) -> ipam::ipam_client::IpamClient<DaemonChannel> {
        ipam::ipam_client::IpamClient::new(self.channel.clone())
    }
}

impl IpamApi for GrpcIpam {
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>> {
        boot_id(&self.channel)
    }
    fn restore(&self, request: ipam::RestoreRequest) -> BoxFuture<'_, ApiResult<ipam::AllocateResponse>> {
        unary!(self.client(), restore, request)
    }
    fn release(&self, request: ipam::ReleaseRequest) -> BoxFuture<'_, ApiResult<ipam::ReleaseResponse>> {
        unary!(self.client(), release, request)
    }
}

/// svc-loader over its socket.
#[derive(Debug, Clone)]
pub struct GrpcLoader {
    channel: DaemonChannel,
}

impl GrpcLoader {
    /// A lazily connecting client of the socket at `path`.
    pub fn new(path: &Path, options: &ClientOptions) -> Self {
        Self {
            channel: connect_unix_lazy(path, options),
        }
    }

    fn client(&self) -> loader::loader_service_client::LoaderServiceClient<DaemonChannel> {
        loader::loader_service_client::LoaderServiceClient::new(self.channel.clone())
    }
}

impl LoaderApi for GrpcLoader {
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>> {
        boot_id(&self.channel)
    }
    fn apply(&self, request: loader::ApplyEndpointRequest) -> BoxFuture<'_, ApiResult<loader::ApplyEndpointResponse>> {
        unary!(self.client(), apply_endpoint, request)
    }
    fn remove(
        &self,
        request: loader::RemoveEndpointRequest,
    ) -> BoxFuture<'_, ApiResult<loader::RemoveEndpointResponse>> {
        unary!(self.client(), remove_endpoint, request)
    }
    fn list(&self) -> BoxFuture<'_, ApiResult<loader::ListEndpointsResponse>> {
        unary!(self.client(), list_endpoints, loader::ListEndpointsRequest {})
    }
    fn interfaces(&self) -> BoxFuture<'_, ApiResult<loader::ListEndpointInterfacesResponse>> {
        unary!(
            self.client(),
            list_endpoint_interfaces,
            loader::ListEndpointInterfacesRequest {}
        )
    }
}

/// svc-loader's LoadBalancerService as the service catalog uses it.
pub trait LoadBalancerApi: Send + Sync + 'static {
    /// The server's boot id (GetInfo).
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>>;
    /// UpsertService.
    fn upsert_service(&self, service: loader::LbService) -> BoxFuture<'_, ApiResult<loader::UpsertServiceResponse>>;
    /// DeleteService.
    fn delete_service(&self, service_id: u32) -> BoxFuture<'_, ApiResult<loader::DeleteServiceResponse>>;
    /// ReplaceServices: the whole set, sent in chunks of
    /// [`REPLACE_CHUNK`] services.
    fn replace_services(
        &self,
        services: Vec<loader::LbService>,
    ) -> BoxFuture<'_, ApiResult<loader::ReplaceServicesResponse>>;
    /// ListServices.
    fn list_services(&self) -> BoxFuture<'_, ApiResult<loader::ListServicesResponse>>;
}

/// Services per ReplaceServices message (loader.proto's bound).
pub const REPLACE_CHUNK: usize = 1000;

impl GrpcLoader {
    fn load_balancer(&self) -> loader::load_balancer_service_client::LoadBalancerServiceClient<DaemonChannel> {
        loader::load_balancer_service_client::LoadBalancerServiceClient::new(self.channel.clone())
    }
}

impl LoadBalancerApi for GrpcLoader {
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>> {
        boot_id(&self.channel)
    }
    fn upsert_service(&self, service: loader::LbService) -> BoxFuture<'_, ApiResult<loader::UpsertServiceResponse>> {
        unary!(
            self.load_balancer(),
            upsert_service,
            loader::UpsertServiceRequest { service: Some(service) }
        )
    }
    fn delete_service(&self, service_id: u32) -> BoxFuture<'_, ApiResult<loader::DeleteServiceResponse>> {
        unary!(
            self.load_balancer(),
            delete_service,
            loader::DeleteServiceRequest { service_id }
        )
    }
    fn replace_services(
        &self,
        services: Vec<loader::LbService>,
    ) -> BoxFuture<'_, ApiResult<loader::ReplaceServicesResponse>> {
        let mut client = self.load_balancer();
        async move {
            let mut chunks: Vec<loader::ReplaceServicesRequest> = services
                .chunks(REPLACE_CHUNK)
                .map(|c| loader::ReplaceServicesRequest { services: c.to_vec() })
                .collect();
            // An empty set is one empty message: the loader then holds none.
            if chunks.is_empty() {
                chunks.push(loader::ReplaceServicesRequest::default());
            }
            client
                .replace_services(futures::stream::iter(chunks))
                .await
                .map(tonic::Response::into_inner)
                .map_err(connection_lost_is_unavailable)
        }
        .boxed()
    }
    fn list_services(&self) -> BoxFuture<'_, ApiResult<loader::ListServicesResponse>> {
        unary!(
            self.load_balancer(),
            list_services,
            loader::ListServicesRequest::default()
        )
    }
}

/// svc-k8s-sync's pod directory as svc-endpoint uses it (Kubernetes mode:
/// restore asks whether a restored endpoint's pod still exists).
pub trait PodDirectoryApi: Send + Sync + 'static {
    /// PodDirectory.LookupPod.
    fn lookup(&self, request: k8s::LookupPodRequest) -> BoxFuture<'_, ApiResult<k8s::LookupPodResponse>>;
}

/// svc-k8s-sync's PodDirectory over its socket (`--k8s-sync-socket`).
#[derive(Debug, Clone)]
pub struct GrpcPodDirectory {
    channel: DaemonChannel,
}

impl GrpcPodDirectory {
    /// A lazily connecting client of the socket at `path`.
    pub fn new(path: &Path, options: &ClientOptions) -> Self {
        Self {
            channel: connect_unix_lazy(path, options),
        }
    }
}

impl PodDirectoryApi for GrpcPodDirectory {
    fn lookup(&self, request: k8s::LookupPodRequest) -> BoxFuture<'_, ApiResult<k8s::LookupPodResponse>> {
        unary!(
            k8s::pod_directory_client::PodDirectoryClient::new(self.channel.clone()),
            lookup_pod,
            request
        )
    }
}
