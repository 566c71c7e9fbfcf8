//! What the daemon tests share: a client of a running svc-identity and the
//! numbered label sets they allocate.

#![allow(dead_code)] // Each test binary uses its own part.

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::DaemonProcess;
use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;

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
