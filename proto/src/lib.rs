//! Generated gRPC contracts of every Rivet daemon, one module per API.
//!
//! Every response or stream message a client caches against carries the
//! server's `boot_id` (see [`HasBootId`]); a client that sees it change replays
//! its desired state (DESIGN.md §1).

/// Every Rivet `.proto` and its imports, an encoded
/// `google.protobuf.FileDescriptorSet`: what gRPC server reflection serves
/// (so `grpcurl` and other generic clients need no `.proto` files).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/rivet_descriptor.bin"));

/// Common to every daemon: who answers (`rivet.daemon.v1`).
pub mod daemon {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("rivet.daemon.v1");
    }
}

/// svc-ipam (`rivet.ipam.v1`).
pub mod ipam {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("rivet.ipam.v1");
    }
}

/// svc-identity: identities and the IP cache (`rivet.identity.v1`).
pub mod identity {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("rivet.identity.v1");

        /// The `domain` of the `google.rpc.ErrorInfo` details this API's
        /// errors carry; their `reason` is an [`ErrorReason`] value name.
        pub const ERROR_DOMAIN: &str = "identity.rivet.io";
    }
}

/// svc-endpoint: endpoints, policies and namespace labels (`rivet.endpoint.v1`).
pub mod endpoint {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("rivet.endpoint.v1");
    }
}

/// svc-loader: the privileged datapath owner (`rivet.loader.v1`).
pub mod loader {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("rivet.loader.v1");
    }
}

/// svc-gc: conntrack and NAT garbage collection (`rivet.gc.v1`).
pub mod gc {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("rivet.gc.v1");
    }
}

/// A message that carries the `boot_id` of the server that produced it.
pub trait HasBootId {
    /// The server's boot id (random per process start).
    fn boot_id(&self) -> &str;
}

macro_rules! has_boot_id {
    ($($ty:path),* $(,)?) => {
        $(impl HasBootId for $ty {
            fn boot_id(&self) -> &str {
                &self.boot_id
            }
        })*
    };
}

has_boot_id!(
    daemon::v1::DaemonInfo,
    ipam::v1::AllocateResponse,
    ipam::v1::ReleaseResponse,
    ipam::v1::ListResponse,
    identity::v1::AllocateIdentityResponse,
    identity::v1::ReleaseIdentityResponse,
    identity::v1::GetIdentityResponse,
    identity::v1::LookupIdentityResponse,
    identity::v1::ListIdentitiesResponse,
    identity::v1::WatchIdentitiesResponse,
    identity::v1::AllocateCidrIdentitiesResponse,
    identity::v1::ReleaseCidrIdentitiesResponse,
    identity::v1::GetStatusResponse,
    identity::v1::UpsertIpResponse,
    identity::v1::DeleteIpResponse,
    identity::v1::ListIpcacheResponse,
    identity::v1::WatchIpcacheResponse,
    endpoint::v1::CreateEndpointResponse,
    endpoint::v1::DeleteEndpointResponse,
    endpoint::v1::UpdateLabelsResponse,
    endpoint::v1::GetEndpointResponse,
    endpoint::v1::ListEndpointsResponse,
    endpoint::v1::GetStatusResponse,
    endpoint::v1::UpsertPolicyResponse,
    endpoint::v1::DeletePolicyResponse,
    endpoint::v1::ListPoliciesResponse,
    endpoint::v1::GetPolicyResponse,
    endpoint::v1::SetNamespaceLabelsResponse,
    endpoint::v1::ListNamespacesResponse,
    loader::v1::ApplyEndpointResponse,
    loader::v1::RemoveEndpointResponse,
    loader::v1::GetEndpointPolicyResponse,
    loader::v1::ListEndpointsResponse,
    loader::v1::UpsertIpcacheResponse,
    loader::v1::DeleteIpcacheResponse,
    loader::v1::ReplaceIpcacheResponse,
    loader::v1::ListIpcacheResponse,
    loader::v1::GetDatapathStatusResponse,
    loader::v1::DumpConntrackResponse,
    loader::v1::GetDropCountersResponse,
    loader::v1::MonitorEvent,
    gc::v1::RunNowResponse,
    gc::v1::StatusResponse,
);
