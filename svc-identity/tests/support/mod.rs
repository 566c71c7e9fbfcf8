//! What the daemon tests share: a client of a running svc-identity, the
//! numbered label sets they allocate, and its node listing.

#![allow(dead_code)] // Each test binary uses its own part.

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::DaemonProcess;
use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;
use rivet_proto::identity::v1::node_service_client::NodeServiceClient;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// A client of the daemon's IdentityService.
pub async fn client(d: &DaemonProcess) -> IdentityServiceClient<DaemonChannel> {
    IdentityServiceClient::new(connect_unix(d.socket(), &ClientOptions::default()).await.unwrap())
}

/// Label set number `i`.
pub fn labels(i: usize) -> Vec<String> {
    vec![
        format!("k8s:app=app-{i}"),
        "k8s:io.kubernetes.pod.namespace=default".to_string(),
    ]
}

/// Allocates set `i` with an anonymous reference; its id.
pub async fn allocate(c: &mut IdentityServiceClient<DaemonChannel>, i: usize) -> Result<u32, tonic::Status> {
    allocate_owned(c, i, "").await
}

/// Allocates set `i` for `owner` (idempotent per owner); its id.
pub async fn allocate_owned(
    c: &mut IdentityServiceClient<DaemonChannel>,
    i: usize,
    owner: &str,
) -> Result<u32, tonic::Status> {
    c.allocate_identity(pb::AllocateIdentityRequest {
        labels: labels(i),
        owner: owner.into(),
    })
    .await
    .map(|r| r.into_inner().identity.unwrap().id)
}

/// A channel to the daemon's socket.
pub async fn channel(d: &DaemonProcess) -> DaemonChannel {
    connect_unix(d.socket(), &ClientOptions::default()).await.unwrap()
}

/// The daemon's ListNodes.
pub async fn list_nodes(d: &DaemonProcess) -> pb::ListNodesResponse {
    NodeServiceClient::new(channel(d).await)
        .list_nodes(pb::ListNodesRequest {})
        .await
        .expect("ListNodes")
        .into_inner()
}

/// Polls `d`'s ListNodes until it listed and `pred` holds (20 s); the
/// nodes by name.
pub async fn nodes_until(
    d: &DaemonProcess,
    what: &str,
    pred: impl Fn(&BTreeMap<String, pb::Node>) -> bool,
) -> BTreeMap<String, pb::Node> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let listing = list_nodes(d).await;
        let nodes: BTreeMap<String, pb::Node> = listing.nodes.into_iter().map(|n| (n.name.clone(), n)).collect();
        if listing.listed && pred(&nodes) {
            return nodes;
        }
        assert!(Instant::now() < deadline, "{what}: {nodes:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
