//! In-process managers over a node's real svc-identity, svc-ipam and
//! svc-loader, with faults injected per call ([`Faults`]), and the check that
//! nothing of an endpoint is left anywhere.

#![allow(dead_code)]

use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use rivet_common::backoff::Backoff;
use rivet_common::controller::Controllers;
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::identity::v1::ipcache_service_client::IpcacheServiceClient;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::loader::v1 as ldpb;
use rivet_testkit::node::EndpointNode;
use svc_endpoint::clients::{ApiResult, IdentityApi, IpamApi, LoaderApi};
use svc_endpoint::events::EndpointMetrics;
use svc_endpoint::manager::{Dependencies, EndpointManager, ManagerOptions};
use tokio::sync::watch;
use tonic::Status;

/// What a faulty call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Calls the real daemon.
    Pass,
    /// Answers UNAVAILABLE, as svc-identity does while its store is
    /// unreachable.
    Unavailable,
    /// Answers INTERNAL (not retried).
    Internal,
    /// Answers UNIMPLEMENTED, as a daemon older than the call does.
    Unimplemented,
    /// Calls the real daemon, then answers INTERNAL: the work is done but
    /// the caller sees a failure, the harder case to undo.
    InternalAfterCall,
    /// Waits until the mode changes (a hung dependency).
    Block,
    /// Panics, once (then passes): a bug in the code the call runs in.
    PanicOnce,
    /// Answers NOT_FOUND without the daemon's reason (as a proxy or an
    /// unknown service would): it says nothing about what is missing.
    NotFoundWithoutReason,
    /// Answers UNAVAILABLE with svc-identity's reason KVSTORE_UNREACHABLE,
    /// as it does for a label set it has not seen while the kvstore is away.
    KvstoreUnreachable,
    /// Answers ABORTED, as svc-identity does when other nodes allocated
    /// concurrently more often than its retries allow.
    Aborted,
}

/// One call's fault: its mode and how many matching calls entered (a watch,
/// so a test waits on the count, never on time).
#[derive(Debug)]
pub struct Fault {
    mode: watch::Sender<Mode>,
    calls: watch::Sender<u32>,
    /// Matching calls that found the mode `Block` and waited.
    blocked: watch::Sender<u32>,
    /// Only calls whose key contains this are affected and counted.
    only: Mutex<Option<String>>,
}

impl Default for Fault {
    fn default() -> Self {
        Self {
            mode: watch::channel(Mode::Pass).0,
            calls: watch::channel(0).0,
            blocked: watch::channel(0).0,
            only: Mutex::new(None),
        }
    }
}

impl Fault {
    /// Sets the mode for every call.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Sets the mode for calls whose key contains `key` only, and counts
    /// those only, from zero.
    pub fn set_for(&self, key: &str, mode: Mode) {
        *self.only.lock().unwrap() = Some(key.to_string());
        self.calls.send_replace(0);
        self.mode.send_replace(mode);
    }

    /// Matching calls so far.
    pub fn calls(&self) -> u32 {
        *self.calls.borrow()
    }

    /// Waits until `n` matching calls entered.
    pub async fn entered(&self, n: u32) {
        let mut rx = self.calls.subscribe();
        rx.wait_for(|c| *c >= n).await.expect("the fault lives");
    }

    /// Waits until `n` matching calls found the mode `Block`.
    pub async fn blocked(&self, n: u32) {
        let mut rx = self.blocked.subscribe();
        rx.wait_for(|c| *c >= n).await.expect("the fault lives");
    }

    /// The mode for a call described by `key`, once it is not blocked.
    async fn enter(&self, key: &str) -> Mode {
        if self
            .only
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|only| !key.contains(only.as_str()))
        {
            return Mode::Pass;
        }
        self.calls.send_modify(|n| *n += 1);
        let mut rx = self.mode.subscribe();
        if *rx.borrow_and_update() == Mode::Block {
            self.blocked.send_modify(|n| *n += 1);
        }
        *rx.wait_for(|m| *m != Mode::Block).await.expect("the fault lives")
    }
}

/// The faults of every call the tests need.
#[derive(Debug, Default)]
pub struct Faults {
    /// svc-identity AllocateIdentity (key: the labels).
    pub allocate: Fault,
    /// svc-identity AllocateCidrIdentities (key: the prefixes).
    pub allocate_cidrs: Fault,
    /// svc-identity UpsertIp (key: the prefixes).
    pub upsert_ip: Fault,
    /// svc-identity DeleteIp (key: the prefixes).
    pub delete_ip: Fault,
    /// svc-loader ApplyEndpoint (key: `endpoint/<id>`).
    pub apply: Fault,
    /// svc-loader RemoveEndpoint (key: `endpoint/<id>`).
    pub remove: Fault,
    /// svc-loader ListEndpoints (key: empty).
    pub list: Fault,
    /// svc-loader ListEndpointInterfaces (key: empty).
    pub interfaces: Fault,
    /// svc-ipam Release (key: the container id).
    pub ipam_release: Fault,
    /// svc-ipam Restore (key: the container id).
    pub ipam_restore: Fault,
}

struct FaultyIdentity {
    inner: Arc<dyn IdentityApi>,
    faults: Arc<Faults>,
}

struct FaultyLoader {
    inner: Arc<dyn LoaderApi>,
    faults: Arc<Faults>,
}

struct FaultyIpam {
    inner: Arc<dyn IpamApi>,
    faults: Arc<Faults>,
}

/// Runs `call` after `fault` let it through.
fn faulty<'a, T: Send + 'a>(
    fault: &'a Fault,
    what: &'static str,
    key: String,
    call: impl FnOnce() -> BoxFuture<'a, ApiResult<T>> + Send + 'a,
) -> BoxFuture<'a, ApiResult<T>> {
    async move {
        match fault.enter(&key).await {
            Mode::Unavailable => Err(Status::unavailable(format!(
                "{what}: the store is unreachable: injected by the test"
            ))),
            Mode::Internal => Err(Status::internal(format!("{what}: injected failure"))),
            Mode::Unimplemented => Err(Status::unimplemented(format!("{what}: injected by the test"))),
            Mode::InternalAfterCall => {
                call().await?;
                Err(Status::internal(format!("{what}: injected failure after the call")))
            }
            Mode::NotFoundWithoutReason => Err(Status::not_found(format!("{what}: injected, without a reason"))),
            Mode::KvstoreUnreachable => Err(rivet_common::grpc::status_with_reason(
                tonic::Code::Unavailable,
                format!("{what}: the store is unreachable: injected by the test"),
                idpb::ErrorReason::KvstoreUnreachable,
            )),
            Mode::Aborted => Err(Status::aborted(format!("{what}: contention, injected by the test"))),
            Mode::PanicOnce => {
                fault.set(Mode::Pass);
                panic!("{what}: injected panic")
            }
            Mode::Pass | Mode::Block => call().await,
        }
    }
    .boxed()
}

impl IdentityApi for FaultyIdentity {
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>> {
        self.inner.boot_id()
    }
    fn allocate(
        &self,
        request: idpb::AllocateIdentityRequest,
    ) -> BoxFuture<'_, ApiResult<idpb::AllocateIdentityResponse>> {
        let key = request.labels.join(",");
        faulty(&self.faults.allocate, "allocating an identity", key, move || {
            self.inner.allocate(request)
        })
    }
    fn release(
        &self,
        request: idpb::ReleaseIdentityRequest,
    ) -> BoxFuture<'_, ApiResult<idpb::ReleaseIdentityResponse>> {
        self.inner.release(request)
    }
    fn list(&self, request: idpb::ListIdentitiesRequest) -> BoxFuture<'_, ApiResult<idpb::ListIdentitiesResponse>> {
        self.inner.list(request)
    }
    fn watch(&self) -> BoxFuture<'_, ApiResult<BoxStream<'static, ApiResult<idpb::WatchIdentitiesResponse>>>> {
        self.inner.watch()
    }
    fn watch_ipcache(&self) -> BoxFuture<'_, ApiResult<BoxStream<'static, ApiResult<idpb::WatchIpcacheResponse>>>> {
        self.inner.watch_ipcache()
    }
    fn allocate_cidrs(
        &self,
        request: idpb::AllocateCidrIdentitiesRequest,
    ) -> BoxFuture<'_, ApiResult<idpb::AllocateCidrIdentitiesResponse>> {
        let key = prefixes_key(request.prefixes.iter());
        faulty(
            &self.faults.allocate_cidrs,
            "allocating CIDR identities",
            key,
            move || self.inner.allocate_cidrs(request),
        )
    }
    fn release_cidrs(
        &self,
        request: idpb::ReleaseCidrIdentitiesRequest,
    ) -> BoxFuture<'_, ApiResult<idpb::ReleaseCidrIdentitiesResponse>> {
        self.inner.release_cidrs(request)
    }
    fn upsert_ip(&self, request: idpb::UpsertIpRequest) -> BoxFuture<'_, ApiResult<idpb::UpsertIpResponse>> {
        let key = prefixes_key(request.entries.iter().filter_map(|e| e.prefix.as_ref()));
        faulty(&self.faults.upsert_ip, "publishing IP cache entries", key, move || {
            self.inner.upsert_ip(request)
        })
    }
    fn end_replay(&self, request: idpb::EndReplayRequest) -> BoxFuture<'_, ApiResult<idpb::EndReplayResponse>> {
        self.inner.end_replay(request)
    }
    fn delete_ip(&self, request: idpb::DeleteIpRequest) -> BoxFuture<'_, ApiResult<idpb::DeleteIpResponse>> {
        let key = prefixes_key(request.prefixes.iter());
        faulty(
            &self.faults.delete_ip,
            "unpublishing IP cache entries",
            key,
            move || self.inner.delete_ip(request),
        )
    }
}

impl LoaderApi for FaultyLoader {
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>> {
        self.inner.boot_id()
    }
    fn apply(&self, request: ldpb::ApplyEndpointRequest) -> BoxFuture<'_, ApiResult<ldpb::ApplyEndpointResponse>> {
        let key = format!("endpoint/{}", request.endpoint_id);
        faulty(&self.faults.apply, "applying an endpoint", key, move || {
            self.inner.apply(request)
        })
    }
    fn remove(&self, request: ldpb::RemoveEndpointRequest) -> BoxFuture<'_, ApiResult<ldpb::RemoveEndpointResponse>> {
        let key = format!("endpoint/{}", request.endpoint_id);
        faulty(&self.faults.remove, "removing an endpoint", key, move || {
            self.inner.remove(request)
        })
    }
    fn list(&self) -> BoxFuture<'_, ApiResult<ldpb::ListEndpointsResponse>> {
        faulty(&self.faults.list, "listing the datapath", String::new(), move || {
            self.inner.list()
        })
    }
    fn interfaces(&self) -> BoxFuture<'_, ApiResult<ldpb::ListEndpointInterfacesResponse>> {
        faulty(
            &self.faults.interfaces,
            "listing the endpoints' interfaces",
            String::new(),
            move || self.inner.interfaces(),
        )
    }
}

impl IpamApi for FaultyIpam {
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>> {
        self.inner.boot_id()
    }
    fn restore(&self, request: ipampb::RestoreRequest) -> BoxFuture<'_, ApiResult<ipampb::AllocateResponse>> {
        let key = request
            .owner
            .as_ref()
            .map(|o| o.container_id.clone())
            .unwrap_or_default();
        faulty(&self.faults.ipam_restore, "re-reserving addresses", key, move || {
            self.inner.restore(request)
        })
    }
    fn release(&self, request: ipampb::ReleaseRequest) -> BoxFuture<'_, ApiResult<ipampb::ReleaseResponse>> {
        let key = request
            .owner
            .as_ref()
            .map(|o| o.container_id.clone())
            .unwrap_or_default();
        faulty(&self.faults.ipam_release, "releasing addresses", key, move || {
            self.inner.release(request)
        })
    }
}

/// The fault key of a call about `prefixes`: them as text, comma-separated.
fn prefixes_key<'a>(prefixes: impl Iterator<Item = &'a rivet_proto::net::IpPrefix>) -> String {
    prefixes
        .map(rivet_proto::net::format_prefix)
        .collect::<Vec<_>>()
        .join(",")
}

/// The node's real dependencies behind `faults`.
pub fn faulty_dependencies(node: &EndpointNode, faults: &Arc<Faults>) -> Dependencies {
    let real = node.dependencies();
    Dependencies {
        identity: Arc::new(FaultyIdentity {
            inner: real.identity,
            faults: faults.clone(),
        }),
        ipam: Arc::new(FaultyIpam {
            inner: real.ipam,
            faults: faults.clone(),
        }),
        loader: Arc::new(FaultyLoader {
            inner: real.loader,
            faults: faults.clone(),
        }),
        pods: None,
    }
}

/// Options for a test manager: quick retries.
pub fn options(state: &Path) -> ManagerOptions {
    ManagerOptions {
        retry_backoff: Backoff::new(Duration::from_millis(20), Duration::from_millis(200)),
        dependency_poll: Duration::from_millis(200),
        ..ManagerOptions::new(state)
    }
}

/// A started in-process manager over `deps`, and its controllers (keep
/// them: dropping the last handle stops every background loop).
pub fn start_manager(options: ManagerOptions, deps: Dependencies) -> (EndpointManager, Controllers) {
    let manager = EndpointManager::new(options, deps, EndpointMetrics::default()).expect("the manager starts");
    let controllers = Controllers::new();
    manager.start(&controllers);
    (manager, controllers)
}

/// Polls `check` (a status the manager or a daemon reports) every 20 ms
/// until it returns `Ok`, and returns that value; once `within` passed,
/// panics with `what` and the last `Err` (what was seen instead).
pub async fn until<T>(within: Duration, what: &str, mut check: impl AsyncFnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + within;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(seen) => assert!(Instant::now() < deadline, "{what} within {within:?}: {seen}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls `check` until it holds (see [`until`]).
pub async fn eventually(within: Duration, what: &str, mut check: impl AsyncFnMut() -> bool) {
    until(within, what, async || {
        if check().await {
            Ok(())
        } else {
            Err("it did not hold".into())
        }
    })
    .await;
}

/// Asserts that nothing of endpoint `id` (container `container`, whose
/// addresses were `addresses`) is left: no datapath entry or attachment, no
/// identity reference, no ipcache entry, no state dir, and (with
/// `addresses_released`) no address in svc-ipam.
pub async fn assert_nothing_left(
    node: &EndpointNode,
    state_dir: &Path,
    id: u16,
    (container, addresses): (&str, &[IpAddr]),
    addresses_released: bool,
    what: &str,
) {
    let listed = node.datapath_endpoints().await;
    assert!(
        listed.endpoints.iter().all(|e| e.endpoint_id != u32::from(id))
            && listed.orphan_attachments.is_empty()
            && !listed.orphan_policy_endpoint_ids.contains(&u32::from(id)),
        "{what}: nothing of endpoint {id} in the datapath: {listed:?}"
    );
    let identities = node.local_identities().await;
    let owner = format!("endpoint/{id}");
    assert!(
        identities.identities.iter().all(|i| !i.owners.contains(&owner)),
        "{what}: no identity reference of endpoint {id}"
    );
    let channel = rivet_common::grpc::connect_unix(node.identity.socket(), &Default::default())
        .await
        .unwrap();
    let ipcache = IpcacheServiceClient::new(channel)
        .list_ipcache(idpb::ListIpcacheRequest {
            source: idpb::IpcacheSource::LocalEndpoint.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let pod_addresses: Vec<Vec<u8>> = addresses.iter().map(|a| rivet_proto::net::address_bytes(*a)).collect();
    assert!(
        ipcache.entries.iter().all(|e| !pod_addresses
            .iter()
            .any(|a| e.prefix.as_ref().is_some_and(|p| p.address == *a))),
        "{what}: no ipcache entry of {container}: {ipcache:?}"
    );
    let leftovers: Vec<_> = std::fs::read_dir(state_dir.join("endpoints"))
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|name| name.split('_').next() == Some(&id.to_string()))
                .collect()
        })
        .unwrap_or_default();
    assert!(
        leftovers.is_empty(),
        "{what}: no state dir of endpoint {id}: {leftovers:?}"
    );
    if addresses_released {
        let held: Vec<_> = node
            .allocations()
            .await
            .into_iter()
            .filter(|a| a.owner.as_ref().is_some_and(|o| o.container_id == container))
            .collect();
        assert!(
            held.is_empty(),
            "{what}: {container}'s addresses are released: {held:?}"
        );
    }
}

/// Whether one ping from pod `from` to pod `to`'s IPv4 address is answered
/// (within 500 ms).
pub fn pings(node: &EndpointNode, from: &str, to: &str) -> bool {
    node.pod(from)
        .ping(node.ipv4(to), 1, Duration::from_millis(10), Duration::from_millis(500))
        .expect("the harness can ping")
        .received
        == 1
}

/// svc-endpoint's GetStatus.
pub async fn endpoint_status(node: &EndpointNode) -> pb::GetStatusResponse {
    node.endpoints()
        .await
        .get_status(pb::GetStatusRequest {})
        .await
        .expect("GetStatus")
        .into_inner()
}
