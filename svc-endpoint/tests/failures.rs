//! A failure injected at each regeneration step of a synchronous create
//! leaves nothing behind: no datapath entry or attachment, no identity
//! reference, no ipcache entry, no state dir. The manager runs in-process
//! against the node's real svc-identity, svc-ipam and svc-loader; one
//! wrapper makes the chosen step fail.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use rivet_proto::identity::v1 as idpb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;
use rivet_proto::identity::v1::ipcache_service_client::IpcacheServiceClient;
use rivet_proto::loader::v1 as ldpb;
use svc_endpoint::clients::{ApiResult, IdentityApi, LoaderApi};
use svc_endpoint::endpoint::RegenerationStep;
use svc_endpoint::events::EndpointMetrics;
use svc_endpoint::manager::{Dependencies, EndpointManager, ManagerError, ManagerOptions, NewEndpoint};
use svc_endpoint::service::validate_create;
use svc_endpoint::testing::{EndpointNode, NodeOptions};
use tonic::Status;

/// Delegates to the real daemon, failing one step.
struct Faulty<T: ?Sized> {
    inner: Arc<T>,
    fail: RegenerationStep,
}

fn injected() -> Status {
    Status::unavailable("injected failure")
}

impl IdentityApi for Faulty<dyn IdentityApi> {
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>> {
        self.inner.boot_id()
    }
    fn allocate(
        &self,
        request: idpb::AllocateIdentityRequest,
    ) -> BoxFuture<'_, ApiResult<idpb::AllocateIdentityResponse>> {
        if self.fail == RegenerationStep::Identity {
            return async { Err(injected()) }.boxed();
        }
        self.inner.allocate(request)
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
    fn allocate_cidrs(
        &self,
        request: idpb::AllocateCidrIdentitiesRequest,
    ) -> BoxFuture<'_, ApiResult<idpb::AllocateCidrIdentitiesResponse>> {
        self.inner.allocate_cidrs(request)
    }
    fn release_cidrs(
        &self,
        request: idpb::ReleaseCidrIdentitiesRequest,
    ) -> BoxFuture<'_, ApiResult<idpb::ReleaseCidrIdentitiesResponse>> {
        self.inner.release_cidrs(request)
    }
    fn upsert_ip(&self, request: idpb::UpsertIpRequest) -> BoxFuture<'_, ApiResult<idpb::UpsertIpResponse>> {
        if self.fail == RegenerationStep::Ipcache {
            return async { Err(injected()) }.boxed();
        }
        self.inner.upsert_ip(request)
    }
    fn delete_ip(&self, request: idpb::DeleteIpRequest) -> BoxFuture<'_, ApiResult<idpb::DeleteIpResponse>> {
        self.inner.delete_ip(request)
    }
}

impl LoaderApi for Faulty<dyn LoaderApi> {
    fn boot_id(&self) -> BoxFuture<'_, ApiResult<String>> {
        self.inner.boot_id()
    }
    fn apply(&self, request: ldpb::ApplyEndpointRequest) -> BoxFuture<'_, ApiResult<ldpb::ApplyEndpointResponse>> {
        if self.fail == RegenerationStep::Datapath {
            // Fail after the datapath did the work, the harder case to undo.
            let inner = self.inner.clone();
            return async move {
                inner.apply(request).await?;
                Err(injected())
            }
            .boxed();
        }
        self.inner.apply(request)
    }
    fn remove(&self, request: ldpb::RemoveEndpointRequest) -> BoxFuture<'_, ApiResult<ldpb::RemoveEndpointResponse>> {
        self.inner.remove(request)
    }
    fn list(&self) -> BoxFuture<'_, ApiResult<ldpb::ListEndpointsResponse>> {
        self.inner.list()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failure_at_each_regeneration_step_leaves_nothing_behind() {
    let mut node = EndpointNode::start(NodeOptions {
        without_endpoint_daemon: true,
        ..NodeOptions::default()
    })
    .await
    .expect("the node's daemons start");
    node.add_pod_interface("a").await;
    let real = node.dependencies();
    let socket = node.sockets();
    let identity_channel = rivet_common::grpc::connect_unix(&socket.join("svc-identity.sock"), &Default::default())
        .await
        .unwrap();
    let mut loader = node.node.client().await;

    for step in [
        RegenerationStep::Identity,
        RegenerationStep::Datapath,
        RegenerationStep::Ipcache,
        RegenerationStep::StateDir,
    ] {
        let state = tempfile::tempdir().unwrap();
        if step == RegenerationStep::StateDir {
            // A file where the endpoints directory should be: every write fails.
            std::fs::write(state.path().join("endpoints"), b"not a directory").unwrap();
        }
        let deps = Dependencies {
            identity: Arc::new(Faulty {
                inner: real.identity.clone(),
                fail: step,
            }),
            ipam: real.ipam.clone(),
            loader: Arc::new(Faulty {
                inner: real.loader.clone(),
                fail: step,
            }),
        };
        let manager =
            EndpointManager::new(ManagerOptions::new(state.path()), deps, EndpointMetrics::default()).unwrap();
        manager.start();
        let spec = validate_create(&node.create_request("a", &["k8s:app=faulty"])).unwrap();
        let e = manager
            .create(NewEndpoint { spec, sync: true }, Duration::from_secs(20))
            .await
            .expect_err("an injected failure must fail the create");
        let id = match &e {
            ManagerError::Regeneration { id, undone, source } => {
                assert_eq!(source.step, step, "the error names the failing step: {e}");
                assert!(*undone, "a failed synchronous create is undone: {e}");
                *id
            }
            other => panic!("expected a regeneration error at {step:?}, got {other}"),
        };
        assert!(
            manager.list().is_empty(),
            "a failed create leaves no endpoint ({step:?})"
        );

        let listed = loader
            .list_endpoints(ldpb::ListEndpointsRequest {})
            .await
            .unwrap()
            .into_inner();
        assert!(
            listed.endpoints.is_empty()
                && listed.orphan_attachments.is_empty()
                && listed.orphan_policy_endpoint_ids.is_empty(),
            "a failure at {step:?} must leave nothing in the datapath: {listed:?}"
        );
        let identities = IdentityServiceClient::new(identity_channel.clone())
            .list_identities(idpb::ListIdentitiesRequest {
                local_only: true,
                include_owners: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let owner = format!("endpoint/{id}");
        assert!(
            identities.identities.iter().all(|i| !i.owners.contains(&owner)),
            "a failure at {step:?} must release the identity reference"
        );
        let ipcache = IpcacheServiceClient::new(identity_channel.clone())
            .list_ipcache(idpb::ListIpcacheRequest {
                source: idpb::IpcacheSource::LocalEndpoint.into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(
            ipcache.entries.is_empty(),
            "a failure at {step:?} must leave no ipcache entry: {ipcache:?}"
        );
        let leftovers: Vec<_> = std::fs::read_dir(state.path().join("endpoints"))
            .map(|d| d.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(
            leftovers.is_empty(),
            "a failure at {step:?} must leave no state dir: {leftovers:?}"
        );
    }

    // With nothing injected the same create succeeds (the harness is sound).
    let state = tempfile::tempdir().unwrap();
    let manager = EndpointManager::new(ManagerOptions::new(state.path()), real, EndpointMetrics::default()).unwrap();
    manager.start();
    let spec = validate_create(&node.create_request("a", &["k8s:app=faulty"])).unwrap();
    manager
        .create(NewEndpoint { spec, sync: true }, Duration::from_secs(20))
        .await
        .expect("without an injected failure the create succeeds");
}
