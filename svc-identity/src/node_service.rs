//! `rivet.identity.v1.NodeService` over the [`NodeRegistry`]: read-only.

use std::sync::Arc;

use rivet_proto::identity::v1 as pb;
use tonic::{Request, Response, Status};

use crate::registry::NodeRegistry;

/// Implements `rivet.identity.v1.NodeService`.
#[derive(Debug, Clone)]
pub struct NodeService {
    registry: Arc<NodeRegistry>,
}

impl NodeService {
    /// A service over `registry`.
    pub fn new(registry: Arc<NodeRegistry>) -> Self {
        Self { registry }
    }

    /// The tonic server.
    pub fn into_server(self) -> pb::node_service_server::NodeServiceServer<Self> {
        pb::node_service_server::NodeServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl pb::node_service_server::NodeService for NodeService {
    async fn list_nodes(&self, _: Request<pb::ListNodesRequest>) -> Result<Response<pb::ListNodesResponse>, Status> {
        Ok(Response::new(self.registry.list()))
    }
}
