//! `rivet.k8s.v1.PodDirectory` (LookupPod from the synced pod cache) and
//! `rivet.k8s.v1.KubernetesSyncService` (GetStatus).

use std::sync::Arc;

use rivet_common::grpc::{BootId, status_with_reason};
use rivet_common::k8s_name;
use rivet_proto::k8s::v1 as pb;
use rivet_proto::k8s::v1::kubernetes_sync_service_server::{KubernetesSyncService, KubernetesSyncServiceServer};
use rivet_proto::k8s::v1::pod_directory_server::{PodDirectory, PodDirectoryServer};
use tonic::{Request, Response, Status};

use crate::SyncState;
use crate::caches::Caches;
use crate::feed::Feed;

/// Both services over one state.
#[derive(Clone, Debug)]
pub struct SyncService {
    node_name: String,
    boot_id: BootId,
    caches: Caches,
    feed: Arc<Feed>,
    state: Arc<SyncState>,
}

impl SyncService {
    /// The services of node `node_name`.
    pub fn new(node_name: String, boot_id: BootId, caches: Caches, feed: Arc<Feed>, state: Arc<SyncState>) -> Self {
        Self {
            node_name,
            boot_id,
            caches,
            feed,
            state,
        }
    }

    /// Routes for both services.
    pub fn into_routes(self) -> tonic::service::Routes {
        tonic::service::Routes::new(PodDirectoryServer::new(self.clone()))
            .add_service(KubernetesSyncServiceServer::new(self))
    }
}

#[tonic::async_trait]
impl PodDirectory for SyncService {
    async fn lookup_pod(
        &self,
        request: Request<pb::LookupPodRequest>,
    ) -> Result<Response<pb::LookupPodResponse>, Status> {
        let request = request.into_inner();
        k8s_name::check_namespace(&request.namespace)
            .map_err(|e| Status::invalid_argument(format!("namespace {:?}: {e}", request.namespace)))?;
        k8s_name::check_dns_subdomain(&request.name)
            .map_err(|e| Status::invalid_argument(format!("name {:?}: {e}", request.name)))?;
        let pods = self.caches.status.kind("Pod").unwrap_or_default();
        if !pods.synced && pods.forbidden {
            return Err(status_with_reason(
                tonic::Code::PermissionDenied,
                format!("node {}'s pod cache cannot list: {}", self.node_name, pods.last_error),
                pb::ErrorReason::ApiForbidden,
            ));
        }
        if !pods.synced {
            return Err(status_with_reason(
                tonic::Code::Unavailable,
                format!(
                    "the pod cache of node {} has not completed its initial list; retry",
                    self.node_name
                ),
                pb::ErrorReason::CacheNotSynced,
            ));
        }
        let found = self
            .caches
            .pod(&request.namespace, &request.name)
            .filter(|pod| request.uid.is_empty() || pod.metadata.uid.as_deref() == Some(request.uid.as_str()));
        let response = match found {
            Some(pod) => pb::LookupPodResponse {
                presence: pb::PodPresence::Present.into(),
                uid: pod.metadata.uid.clone().unwrap_or_default(),
                node_name: pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default(),
                boot_id: self.boot_id.to_string(),
            },
            None => pb::LookupPodResponse {
                presence: pb::PodPresence::Absent.into(),
                boot_id: self.boot_id.to_string(),
                ..Default::default()
            },
        };
        Ok(Response::new(response))
    }
}

#[tonic::async_trait]
impl KubernetesSyncService for SyncService {
    async fn get_status(&self, _: Request<pb::GetStatusRequest>) -> Result<Response<pb::GetStatusResponse>, Status> {
        let kinds = self
            .caches
            .status
            .kinds()
            .into_iter()
            .map(|(kind, s)| pb::WatchedKind {
                kind: kind.into(),
                synced: s.synced,
                objects: s.objects,
                relists: s.relists,
                last_error: s.last_error,
            })
            .collect();
        let feed = self.feed.report();
        let state = &self.state;
        Ok(Response::new(pb::GetStatusResponse {
            node_name: self.node_name.clone(),
            kinds,
            caches_synced: self.caches.status.all_synced(),
            cache_sync_timed_out: state.cache_sync_timed_out(),
            node_ready: state.node_ready(),
            fed: vec![pb::FedDaemon {
                name: "svc-endpoint".into(),
                connected: feed.connected,
                seen_boot_id: feed.seen_boot_id,
                replays: feed.replays,
                last_replay_unix_nanos: feed.last_replay_unix_nanos,
                last_error: feed.last_error,
            }],
            endpoint_objects_applied: state.endpoint_objects_applied(),
            endpoint_objects_deleted: state.endpoint_objects_deleted(),
            boot_id: self.boot_id.to_string(),
        }))
    }
}
