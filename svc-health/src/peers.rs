//! The peer nodes, from svc-identity's node registry
//! (`rivet.identity.v1.NodeService/ListNodes`), read again every round: the
//! registry is the one truth about who is in the cluster (level-triggered;
//! nothing here survives a restart of either daemon).

use std::future::Future;
use std::net::IpAddr;
use std::path::Path;
use std::pin::Pin;
use std::time::Duration;

use rivet_common::grpc::{ClientOptions, DaemonChannel, RpcError, connect_unix_lazy};
use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::node_service_client::NodeServiceClient;

use crate::probe::Peer;

/// What the registry lists: this node's health endpoint addresses and the
/// peers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeListing {
    /// This node's name as the registry knows it (empty: not listed yet).
    pub local_name: String,
    /// This node's health endpoint addresses.
    pub local_health_addresses: Vec<IpAddr>,
    /// Every other node.
    pub peers: Vec<Peer>,
}

/// Why the peers could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum PeerListError {
    /// The call failed (or svc-identity was not reached).
    #[error("svc-identity NodeService.ListNodes: {0}")]
    Call(#[from] RpcError<pb::ErrorReason>),
    /// A node came with an address that is not one.
    #[error("node {node} has an unreadable {field}: {source}")]
    UnreadableAddress {
        /// The node.
        node: String,
        /// `addresses` or `health_addresses`.
        field: &'static str,
        /// Why.
        source: rivet_proto::net::AddressError,
    },
}

/// Where the peers come from.
pub trait PeerSource: Send + Sync {
    /// The current listing.
    fn list(&self) -> Pin<Box<dyn Future<Output = Result<NodeListing, PeerListError>> + Send + '_>>;
}

/// svc-identity's `NodeService` over its socket (connected lazily, so
/// svc-identity may start later or restart).
#[derive(Clone, Debug)]
pub struct RegistryPeers {
    client: NodeServiceClient<DaemonChannel>,
}

impl RegistryPeers {
    /// A client of svc-identity at `socket`; each call may take `timeout`.
    pub fn new(socket: &Path, timeout: Duration) -> Self {
        let options = ClientOptions {
            connect_timeout: timeout,
            request_timeout: timeout,
            ..ClientOptions::default()
        };
        Self {
            client: NodeServiceClient::new(connect_unix_lazy(socket, &options)),
        }
    }
}

fn addresses(node: &pb::Node, field: &'static str, raw: &[Vec<u8>]) -> Result<Vec<IpAddr>, PeerListError> {
    raw.iter()
        .map(|a| {
            rivet_proto::net::address_from_bytes(a).map_err(|source| PeerListError::UnreadableAddress {
                node: node.name.clone(),
                field,
                source,
            })
        })
        .collect()
}

/// The listing of a `ListNodes` answer.
pub fn from_response(response: &pb::ListNodesResponse) -> Result<NodeListing, PeerListError> {
    let mut listing = NodeListing::default();
    for node in &response.nodes {
        let health = addresses(node, "health_addresses", &node.health_addresses)?;
        if node.local {
            listing.local_name = node.name.clone();
            listing.local_health_addresses = health;
            continue;
        }
        listing.peers.push(Peer {
            name: node.name.clone(),
            addresses: addresses(node, "addresses", &node.addresses)?,
            health_addresses: health,
        });
    }
    listing.peers.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(listing)
}

impl PeerSource for RegistryPeers {
    fn list(&self) -> Pin<Box<dyn Future<Output = Result<NodeListing, PeerListError>> + Send + '_>> {
        let mut client = self.client.clone();
        Box::pin(async move {
            let response = client
                .list_nodes(pb::ListNodesRequest::default())
                .await
                .map_err(RpcError::from)?;
            from_response(response.get_ref())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rivet_proto::net::address_bytes;

    fn node(name: &str, local: bool, address: &str, health: &[&str]) -> pb::Node {
        pb::Node {
            name: name.into(),
            addresses: vec![address_bytes(address.parse().unwrap())],
            health_addresses: health.iter().map(|a| address_bytes(a.parse().unwrap())).collect(),
            local,
            ..Default::default()
        }
    }

    #[test]
    fn the_local_node_is_not_a_peer() {
        let response = pb::ListNodesResponse {
            nodes: vec![
                node("n1", true, "198.19.254.1", &["198.18.1.2"]),
                node("n3", false, "198.19.254.3", &[]),
                node("n2", false, "198.19.254.2", &["198.18.2.2"]),
            ],
            cluster: "c".into(),
            listed: true,
            boot_id: "b".into(),
        };
        let listing = from_response(&response).unwrap();
        assert_eq!(listing.local_name, "n1");
        assert_eq!(
            listing.local_health_addresses,
            vec!["198.18.1.2".parse::<IpAddr>().unwrap()]
        );
        let names: Vec<&str> = listing.peers.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["n2", "n3"]);
    }

    #[test]
    fn an_unreadable_address_is_an_error_naming_the_node() {
        let mut bad = node("n2", false, "198.19.254.2", &[]);
        bad.addresses = vec![b"198.19.254.2".to_vec()];
        let response = pb::ListNodesResponse {
            nodes: vec![bad],
            ..Default::default()
        };
        let error = from_response(&response).unwrap_err();
        assert!(error.to_string().contains("node n2"), "{error}");
    }

    #[tokio::test]
    async fn an_absent_svc_identity_is_a_call_error() {
        let dir = tempfile::tempdir().unwrap();
        let source = RegistryPeers::new(&dir.path().join("svc-identity.sock"), Duration::from_millis(200));
        assert!(matches!(source.list().await, Err(PeerListError::Call(_))));
    }
}
