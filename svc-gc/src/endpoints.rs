//! The node's endpoints, from svc-endpoint: which addresses still belong to a
//! pod. A pass deletes orphans only with a list that is complete (restore
//! finished) and non-empty; anything else skips orphan deletion for that pass.

use std::collections::HashSet;
use std::future::Future;
use std::net::IpAddr;
use std::path::Path;
use std::pin::Pin;
use std::time::Duration;

use rivet_common::grpc::{ClientOptions, DaemonChannel, RpcError, connect_unix_lazy};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;

/// What the endpoint source answered.
#[derive(Clone, Debug)]
pub enum EndpointList {
    /// Restore has completed: these are all addresses of all endpoints
    /// (possibly none).
    Complete(HashSet<IpAddr>),
    /// svc-endpoint is still restoring: the list may miss endpoints.
    Restoring,
    /// The list could not be had.
    Failed(EndpointListError),
}

/// Why the endpoint list could not be had.
#[derive(Clone, Debug, thiserror::Error)]
pub enum EndpointListError {
    /// svc-gc runs without an endpoint source.
    #[error("no endpoint source configured")]
    NotConfigured,
    /// svc-endpoint listed an address that is not one.
    #[error("endpoint {endpoint} has an unreadable address: {source}")]
    UnreadableAddress {
        /// The endpoint.
        endpoint: u32,
        /// Why what was listed is not an address.
        source: rivet_proto::net::AddressError,
    },
    /// svc-endpoint's `ListEndpoints` failed (or it was not reached).
    #[error("svc-endpoint ListEndpoints: {0}")]
    Call(#[from] RpcError<pb::ErrorReason>),
}

/// Where the node's endpoints come from.
pub trait EndpointSource: Send + Sync {
    /// The current list.
    fn list(&self) -> Pin<Box<dyn Future<Output = EndpointList> + Send + '_>>;
}

/// A fixed answer (tests; nodes without svc-endpoint use [`NoEndpoints`]).
#[derive(Clone, Debug)]
pub struct StaticEndpoints(pub EndpointList);

impl EndpointSource for StaticEndpoints {
    fn list(&self) -> Pin<Box<dyn Future<Output = EndpointList> + Send + '_>> {
        let list = self.0.clone();
        Box::pin(async move { list })
    }
}

/// No endpoint source: orphans are never deleted.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoEndpoints;

impl EndpointSource for NoEndpoints {
    fn list(&self) -> Pin<Box<dyn Future<Output = EndpointList> + Send + '_>> {
        Box::pin(async { EndpointList::Failed(EndpointListError::NotConfigured) })
    }
}

/// svc-endpoint's `ListEndpoints` over its socket (connected lazily,
/// reconnecting by itself: svc-endpoint may start later or restart).
#[derive(Clone, Debug)]
pub struct GrpcEndpoints {
    client: EndpointServiceClient<DaemonChannel>,
}

impl GrpcEndpoints {
    /// A client of svc-endpoint at `socket`; each list call may take `timeout`.
    pub fn new(socket: &Path, timeout: Duration) -> Self {
        let options = ClientOptions {
            connect_timeout: timeout,
            request_timeout: timeout,
            ..ClientOptions::default()
        };
        Self {
            client: EndpointServiceClient::new(connect_unix_lazy(socket, &options)),
        }
    }
}

/// Addresses of a `ListEndpoints` answer, as the pass needs them.
pub fn from_response(response: &pb::ListEndpointsResponse) -> EndpointList {
    if !response.restore_complete {
        return EndpointList::Restoring;
    }
    let mut addrs = HashSet::new();
    for endpoint in &response.endpoints {
        for address in &endpoint.addresses {
            match rivet_proto::net::address_from_bytes(&address.address) {
                Ok(ip) => {
                    addrs.insert(ip);
                }
                // One unreadable address could be the only one of a live pod:
                // better no orphan deletion than a wrong one.
                Err(source) => {
                    return EndpointList::Failed(EndpointListError::UnreadableAddress {
                        endpoint: endpoint.id,
                        source,
                    });
                }
            }
        }
    }
    EndpointList::Complete(addrs)
}

impl EndpointSource for GrpcEndpoints {
    fn list(&self) -> Pin<Box<dyn Future<Output = EndpointList> + Send + '_>> {
        let mut client = self.client.clone();
        Box::pin(async move {
            match client.list_endpoints(pb::ListEndpointsRequest::default()).await {
                Ok(response) => from_response(response.get_ref()),
                Err(status) => EndpointList::Failed(RpcError::from(status).into()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(id: u32, addrs: &[&str]) -> pb::Endpoint {
        endpoint_with(
            id,
            addrs
                .iter()
                .map(|a| rivet_proto::net::address_bytes(a.parse().unwrap())),
        )
    }

    fn endpoint_with(id: u32, addrs: impl Iterator<Item = Vec<u8>>) -> pb::Endpoint {
        pb::Endpoint {
            id,
            addresses: addrs
                .map(|address| pb::EndpointAddress {
                    address,
                    ipam_pool: "default".into(),
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn responses_become_lists() {
        let response = pb::ListEndpointsResponse {
            endpoints: vec![endpoint(1, &["198.18.0.2", "2001:2::2"]), endpoint(2, &["198.18.0.3"])],
            restore_complete: true,
            boot_id: "b".into(),
        };
        let EndpointList::Complete(addrs) = from_response(&response) else {
            panic!("a complete list");
        };
        assert_eq!(addrs.len(), 3);
        assert!(addrs.contains(&"2001:2::2".parse().unwrap()));

        let restoring = pb::ListEndpointsResponse {
            restore_complete: false,
            ..response.clone()
        };
        assert!(matches!(from_response(&restoring), EndpointList::Restoring));

        let bad = pb::ListEndpointsResponse {
            endpoints: vec![endpoint_with(3, [b"198.18.0.3".to_vec()].into_iter())],
            ..response
        };
        assert!(matches!(
            from_response(&bad),
            EndpointList::Failed(EndpointListError::UnreadableAddress { endpoint: 3, .. })
        ));
    }

    #[tokio::test]
    async fn an_absent_svc_endpoint_is_a_failed_list() {
        let dir = tempfile::tempdir().unwrap();
        let source = GrpcEndpoints::new(&dir.path().join("svc-endpoint.sock"), Duration::from_millis(200));
        assert!(matches!(
            source.list().await,
            EndpointList::Failed(EndpointListError::Call(_))
        ));
    }
}
