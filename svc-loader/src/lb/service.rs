//! The `rivet.loader.v1.LoadBalancerService` gRPC service: validation,
//! error codes and conversions around [`LoadBalancer`].

use std::sync::Arc;
use std::time::Instant;

use rivet_common::grpc::{BootId, status_with_reason};
use rivet_proto::loader::v1 as pb;
use rivet_proto::net::address_bytes;
use tokio_stream::StreamExt as _;
use tonic::{Code, Request, Response, Status, Streaming};

use super::{Frontend, LbError, LoadBalancer, Service, ServiceStatus, validate};
use crate::events::{self, LoaderMetrics};

/// Implements `rivet.loader.v1.LoadBalancerService`.
#[derive(Debug, Clone)]
pub struct LoadBalancerService {
    lb: Arc<LoadBalancer>,
    metrics: LoaderMetrics,
    boot_id: BootId,
}

impl LoadBalancerService {
    /// A service over `lb`.
    pub fn new(lb: Arc<LoadBalancer>, boot_id: BootId, metrics: LoaderMetrics) -> Self {
        Self { lb, metrics, boot_id }
    }

    /// The tonic server.
    pub fn into_server(self) -> pb::load_balancer_service_server::LoadBalancerServiceServer<Self> {
        pb::load_balancer_service_server::LoadBalancerServiceServer::new(self)
    }

    fn fail(&self, method: &'static str, status: Status) -> Status {
        events::request_failed(&self.metrics, method, &status);
        status
    }

    async fn blocking<R: Send + 'static>(
        &self,
        method: &'static str,
        f: impl FnOnce(&LoadBalancer) -> Result<R, LbError> + Send + 'static,
    ) -> Result<R, Status> {
        let lb = self.lb.clone();
        tokio::task::spawn_blocking(move || f(&lb))
            .await
            .map_err(|e| Status::internal(format!("load balancer task failed: {e}")))?
            .map_err(|e| self.fail(method, status(e)))
    }
}

/// Maps an error to its status and reason (`rivet.loader.v1.ErrorReason`).
fn status(e: LbError) -> Status {
    use pb::ErrorReason as R;
    let (code, reason) = match &e {
        LbError::FrontendHeld { .. } => (Code::AlreadyExists, R::FrontendHeld),
        e if e.is_map_full() => (Code::ResourceExhausted, R::MapFull),
        LbError::MapFull { .. } | LbError::Map { .. } | LbError::Restore(_) => {
            return Status::internal(e.to_string());
        }
    };
    status_with_reason(code, e.to_string(), reason)
}

fn invalid(e: crate::validate::InvalidField) -> Status {
    Status::invalid_argument(e.to_string())
}

/// A checked service as the proto says it (ListServices).
pub fn service_proto(s: &Service) -> pb::LbService {
    pb::LbService {
        service_id: s.id,
        family: if s.family == 4 {
            pb::Family::Ipv4
        } else {
            pb::Family::Ipv6
        } as i32,
        protocol: i32::from(s.protocol),
        frontends: s
            .frontends
            .iter()
            .map(|f| match f {
                Frontend::ClusterIp(addr) => pb::LbFrontend {
                    kind: pb::FrontendKind::ClusterIp as i32,
                    address: address_bytes(addr.ip()),
                    port: u32::from(addr.port()),
                },
                Frontend::NodePort(port) => pb::LbFrontend {
                    kind: pb::FrontendKind::NodePort as i32,
                    address: Vec::new(),
                    port: u32::from(*port),
                },
            })
            .collect(),
        backends: s.backends.iter().map(backend_proto).collect(),
        affinity_timeout_seconds: s.affinity_timeout,
        external_traffic_policy: if s.local {
            pb::TrafficPolicy::Local
        } else {
            pb::TrafficPolicy::Cluster
        } as i32,
    }
}

fn backend_proto(b: &super::Backend) -> pb::LbBackend {
    pb::LbBackend {
        address: address_bytes(b.addr.ip()),
        port: u32::from(b.addr.port()),
        state: if b.terminating {
            pb::BackendState::Terminating
        } else {
            pb::BackendState::Active
        } as i32,
        node_local: b.node_local,
    }
}

fn status_proto(s: &ServiceStatus) -> pb::LbServiceStatus {
    pb::LbServiceStatus {
        service: Some(service_proto(&s.service)),
        table_id: s.table_id,
        external_table_id: s.external_table_id,
        backends: s
            .service
            .backends
            .iter()
            .zip(&s.backends)
            .map(|(b, (id, slots))| pb::LbBackendStatus {
                backend: Some(backend_proto(b)),
                backend_id: *id,
                maglev_slots: *slots,
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl pb::load_balancer_service_server::LoadBalancerService for LoadBalancerService {
    async fn upsert_service(
        &self,
        request: Request<pb::UpsertServiceRequest>,
    ) -> Result<Response<pb::UpsertServiceResponse>, Status> {
        const METHOD: &str = "UpsertService";
        let service = request
            .get_ref()
            .service
            .as_ref()
            .ok_or_else(|| invalid(validate::missing("service")))
            .and_then(|s| validate::service("service", s).map_err(invalid))
            .map_err(|s| self.fail(METHOD, s))?;
        let start = Instant::now();
        let (id, backends) = (service.id, service.backends.len());
        let changed = self.blocking(METHOD, move |lb| lb.upsert(&service)).await?;
        events::service_upserted(&self.metrics, id, backends, changed, start.elapsed());
        Ok(Response::new(pb::UpsertServiceResponse {
            changed,
            boot_id: self.boot_id.to_string(),
        }))
    }

    async fn delete_service(
        &self,
        request: Request<pb::DeleteServiceRequest>,
    ) -> Result<Response<pb::DeleteServiceResponse>, Status> {
        const METHOD: &str = "DeleteService";
        let id = request.get_ref().service_id;
        if id == 0 {
            return Err(self.fail(METHOD, invalid(validate::nonzero("service_id"))));
        }
        let existed = self.blocking(METHOD, move |lb| lb.delete(id)).await?;
        events::service_deleted(&self.metrics, id, existed);
        Ok(Response::new(pb::DeleteServiceResponse {
            existed,
            boot_id: self.boot_id.to_string(),
        }))
    }

    async fn replace_services(
        &self,
        request: Request<Streaming<pb::ReplaceServicesRequest>>,
    ) -> Result<Response<pb::ReplaceServicesResponse>, Status> {
        const METHOD: &str = "ReplaceServices";
        let mut stream = request.into_inner();
        let mut all = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|s| self.fail(METHOD, s))?;
            all.extend(chunk.services);
            if all.len() > validate::MAX_SERVICES {
                return Err(self.fail(METHOD, invalid(validate::too_many_services(all.len()))));
            }
        }
        let services = validate::service_set(&all).map_err(|e| self.fail(METHOD, invalid(e)))?;
        let start = Instant::now();
        let total = services.len();
        let report = self.blocking(METHOD, move |lb| lb.replace(&services)).await?;
        events::services_replaced(&self.metrics, total, &report, start.elapsed());
        Ok(Response::new(pb::ReplaceServicesResponse {
            upserted: report.upserted,
            deleted: report.deleted,
            boot_id: self.boot_id.to_string(),
        }))
    }

    async fn list_services(
        &self,
        request: Request<pb::ListServicesRequest>,
    ) -> Result<Response<pb::ListServicesResponse>, Status> {
        const METHOD: &str = "ListServices";
        let count_entries = request.into_inner().count_entries;
        let lb = self.lb.clone();
        // Counting walks both flow maps and lb_affinity: only when asked.
        let (services, counts) =
            tokio::task::spawn_blocking(move || (lb.list(), count_entries.then(|| lb.dynamic_entries())))
                .await
                .map_err(|e| Status::internal(format!("load balancer task failed: {e}")))?;
        let (flow_entries, affinity_entries) = counts
            .transpose()
            .map_err(|e| self.fail(METHOD, Status::internal(e.to_string())))?
            .unwrap_or_default();
        Ok(Response::new(pb::ListServicesResponse {
            services: services.iter().map(status_proto).collect(),
            flow_entries,
            affinity_entries,
            entries_counted: count_entries,
            boot_id: self.boot_id.to_string(),
        }))
    }
}
