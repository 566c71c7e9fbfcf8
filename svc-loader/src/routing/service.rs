//! The `rivet.loader.v1.NodeRoutingService` gRPC service: validation,
//! error codes and conversions around [`NodeRouting`].

use std::net::IpAddr;
use std::sync::Arc;

use rivet_common::grpc::{BootId, status_with_reason};
use rivet_proto::loader::v1 as pb;
use rivet_proto::net::{IpPrefix, address_bytes};
use tonic::{Code, Request, Response, Status};

use super::{NodeRouting, PeerNode, RoutingError, RoutingMode, TUNNEL_INTERFACE};
use crate::events::{self, LoaderMetrics};
use crate::validate;

/// Implements `rivet.loader.v1.NodeRoutingService`.
#[derive(Debug, Clone)]
pub struct NodeRoutingService {
    routing: Arc<NodeRouting>,
    metrics: LoaderMetrics,
    boot_id: BootId,
}

impl NodeRoutingService {
    /// A service over `routing`.
    pub fn new(routing: Arc<NodeRouting>, boot_id: BootId, metrics: LoaderMetrics) -> Self {
        Self {
            routing,
            metrics,
            boot_id,
        }
    }

    /// The tonic server.
    pub fn into_server(self) -> pb::node_routing_service_server::NodeRoutingServiceServer<Self> {
        pb::node_routing_service_server::NodeRoutingServiceServer::new(self)
    }

    fn fail(&self, method: &'static str, status: Status) -> Status {
        events::request_failed(&self.metrics, method, &status);
        status
    }

    async fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce(&NodeRouting) -> Result<R, RoutingError> + Send + 'static,
    ) -> Result<R, Status> {
        let routing = self.routing.clone();
        tokio::task::spawn_blocking(move || f(&routing))
            .await
            .map_err(|e| Status::internal(format!("routing task failed: {e}")))?
            .map_err(status)
    }
}

fn status(e: RoutingError) -> Status {
    match e {
        RoutingError::Disabled => status_with_reason(
            Code::FailedPrecondition,
            e.to_string(),
            pb::ErrorReason::RoutingDisabled,
        ),
        RoutingError::Route { .. } | RoutingError::List(_) => Status::internal(e.to_string()),
    }
}

fn mode_proto(mode: RoutingMode) -> pb::RoutingMode {
    match mode {
        RoutingMode::None => pb::RoutingMode::None,
        RoutingMode::Native => pb::RoutingMode::Native,
        RoutingMode::Vxlan => pb::RoutingMode::Vxlan,
    }
}

fn peer_proto(p: &PeerNode) -> pb::PeerNode {
    pb::PeerNode {
        name: p.name.clone(),
        underlay_ipv4: p
            .underlay_ipv4
            .map(|a| address_bytes(IpAddr::V4(a)))
            .unwrap_or_default(),
        underlay_ipv6: p
            .underlay_ipv6
            .map(|a| address_bytes(IpAddr::V6(a)))
            .unwrap_or_default(),
        pod_cidrs: p
            .pod_cidrs
            .iter()
            .map(|c| IpPrefix {
                address: address_bytes(c.network()),
                prefix_length: u32::from(c.prefix_len()),
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl pb::node_routing_service_server::NodeRoutingService for NodeRoutingService {
    async fn replace_nodes(
        &self,
        request: Request<pb::ReplaceNodesRequest>,
    ) -> Result<Response<pb::ReplaceNodesResponse>, Status> {
        const METHOD: &str = "ReplaceNodes";
        let mode = self.routing.setup().mode;
        if mode == RoutingMode::None {
            return Err(self.fail(METHOD, status(RoutingError::Disabled)));
        }
        let peers = validate::peer_nodes("nodes", &request.get_ref().nodes, mode)
            .map_err(|e| self.fail(METHOD, Status::invalid_argument(e.to_string())))?;
        let count = peers.len();
        let changes = self
            .blocking(move |r| r.replace_nodes(peers))
            .await
            .map_err(|s| self.fail(METHOD, s))?;
        events::peer_routes_replaced(&self.metrics, mode.as_str(), count, &changes);
        Ok(Response::new(pb::ReplaceNodesResponse {
            routes_added: changes.added,
            routes_removed: changes.removed,
            routes_unchanged: changes.unchanged,
            boot_id: self.boot_id.to_string(),
        }))
    }

    async fn list_nodes(
        &self,
        _request: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        let setup = self.routing.setup().clone();
        let status = if setup.mode == RoutingMode::None {
            None
        } else {
            Some(
                self.blocking(|r| r.status())
                    .await
                    .map_err(|s| self.fail("ListNodes", s))?,
            )
        };
        Ok(Response::new(pb::ListNodesResponse {
            routing_mode: mode_proto(setup.mode) as i32,
            nodes: status.iter().flat_map(|s| s.peers.iter().map(peer_proto)).collect(),
            underlay_interface: setup.underlay.map(|(name, _)| name).unwrap_or_default(),
            tunnel_interface: if setup.tunnel_ifindex.is_some() {
                TUNNEL_INTERFACE.to_owned()
            } else {
                String::new()
            },
            tunnel_port: if setup.mode == RoutingMode::Vxlan {
                u32::from(setup.tunnel_port)
            } else {
                0
            },
            routes: status.map(|s| s.routes).unwrap_or(0),
            boot_id: self.boot_id.to_string(),
        }))
    }
}
