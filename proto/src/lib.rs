//! Generated gRPC contracts of every Rivet daemon, one module per API.
//!
//! Every response or stream message a client caches against carries the
//! server's `boot_id` (see [`HasBootId`]); a client that sees it change replays
//! its desired state (DESIGN.md §1).

/// Every Rivet `.proto` and its imports, an encoded
/// `google.protobuf.FileDescriptorSet`: what gRPC server reflection serves
/// (so `grpcurl` and other generic clients need no `.proto` files).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/rivet_descriptor.bin"));

pub mod net;

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

/// svc-health: connectivity between nodes (`rivet.health.v1`).
pub mod health {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("rivet.health.v1");
    }
}

/// svc-k8s-sync: pod lookups and watch status (`rivet.k8s.v1`).
pub mod k8s {
    /// Version 1.
    pub mod v1 {
        tonic::include_proto!("rivet.k8s.v1");
    }
}

/// Why a call failed, as one API declares it: the `ErrorReason` enum of its
/// proto. A server sends the value's name as the `reason` of a
/// `google.rpc.ErrorInfo` detail in the API's [`DOMAIN`](Self::DOMAIN)
/// (`rivet_common::grpc::status_with_reason`); a client decodes it back
/// (`rivet_common::grpc::error_reason`) and decides on it, never on the
/// message text or on a generic gRPC code.
///
/// ```
/// use rivet_proto::ErrorReason as _;
/// use rivet_proto::ipam::v1::ErrorReason;
/// assert_eq!(ErrorReason::PoolExhausted.name(), "POOL_EXHAUSTED");
/// assert_eq!(ErrorReason::from_name("POOL_EXHAUSTED"), Some(ErrorReason::PoolExhausted));
/// assert_eq!(ErrorReason::from_name("ERROR_REASON_UNSPECIFIED"), None);
/// assert_eq!(<ErrorReason as rivet_proto::ErrorReason>::DOMAIN, "ipam.rivet.io");
/// ```
pub trait ErrorReason: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// The `ErrorInfo` domain of the API, `<daemon>.rivet.io`.
    const DOMAIN: &'static str;

    /// The value's name as the proto declares it (`POOL_EXHAUSTED`): the
    /// `ErrorInfo` reason.
    fn name(self) -> &'static str;

    /// The value of a reason name; `None` for the unspecified value and for
    /// names this build does not know (a newer server's).
    fn from_name(name: &str) -> Option<Self>;

    /// Every value but the unspecified one, in declaration order.
    fn all() -> Vec<Self>;
}

macro_rules! error_reason {
    ($($ty:ty => $domain:literal),* $(,)?) => {
        $(impl ErrorReason for $ty {
            const DOMAIN: &'static str = $domain;

            fn name(self) -> &'static str {
                self.as_str_name()
            }

            fn from_name(name: &str) -> Option<Self> {
                Self::from_str_name(name).filter(|r| *r != Self::Unspecified)
            }

            fn all() -> Vec<Self> {
                // prost enums are dense from 0 in our protos; stop at the
                // first number that is not a value.
                (1..).map_while(|n| Self::try_from(n).ok()).collect()
            }
        })*
    };
}

error_reason!(
    ipam::v1::ErrorReason => "ipam.rivet.io",
    identity::v1::ErrorReason => "identity.rivet.io",
    endpoint::v1::ErrorReason => "endpoint.rivet.io",
    loader::v1::ErrorReason => "loader.rivet.io",
    gc::v1::ErrorReason => "gc.rivet.io",
    k8s::v1::ErrorReason => "k8s.rivet.io",
    health::v1::ErrorReason => "health.rivet.io",
);

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
    endpoint::v1::WatchEndpointsResponse,
    endpoint::v1::SetPodMetadataResponse,
    endpoint::v1::DeletePodMetadataResponse,
    endpoint::v1::ReplayKubernetesResponse,
    k8s::v1::LookupPodResponse,
    k8s::v1::GetStatusResponse,
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
    loader::v1::UpsertServiceResponse,
    loader::v1::DeleteServiceResponse,
    loader::v1::ReplaceServicesResponse,
    loader::v1::ListServicesResponse,
    gc::v1::RunNowResponse,
    gc::v1::StatusResponse,
    health::v1::GetHealthResponse,
);

#[cfg(test)]
mod tests {
    use super::ErrorReason;

    /// Every reason of one API survives the trip through its name, and the
    /// names are unique across the API.
    fn round_trips<R: ErrorReason>(expected: usize) {
        let all = R::all();
        assert_eq!(all.len(), expected, "{}: a reason was added or lost", R::DOMAIN);
        let mut names = std::collections::BTreeSet::new();
        for reason in all {
            assert_eq!(R::from_name(reason.name()), Some(reason), "{}: {reason:?}", R::DOMAIN);
            assert!(names.insert(reason.name()), "{}: {} twice", R::DOMAIN, reason.name());
            assert!(
                reason.name().bytes().all(|b| b.is_ascii_uppercase() || b == b'_'),
                "ErrorInfo reasons are UPPER_SNAKE_CASE: {}",
                reason.name()
            );
        }
        assert_eq!(R::from_name("ERROR_REASON_UNSPECIFIED"), None);
        assert_eq!(R::from_name("NO_SUCH_REASON"), None);
        assert!(R::DOMAIN.ends_with(".rivet.io"));
    }

    #[test]
    fn every_reason_enum_round_trips() {
        round_trips::<crate::ipam::v1::ErrorReason>(11);
        round_trips::<crate::identity::v1::ErrorReason>(7);
        round_trips::<crate::endpoint::v1::ErrorReason>(22);
        round_trips::<crate::loader::v1::ErrorReason>(10);
        round_trips::<crate::gc::v1::ErrorReason>(3);
        round_trips::<crate::k8s::v1::ErrorReason>(2);
        round_trips::<crate::health::v1::ErrorReason>(2);
    }

    /// A message of one text field, as a client built before the bytes
    /// encoding wrote it.
    fn old_text(fields: &[(u32, &str)]) -> Vec<u8> {
        let mut buf = Vec::new();
        for (number, text) in fields {
            prost::encoding::string::encode(*number, &(*text).to_string(), &mut buf);
        }
        buf
    }

    /// The fields that were text moved to new numbers and the old ones are
    /// reserved: an old client's text is an unknown field to a new reader,
    /// never bytes ("1::2" is 4 bytes, an IPv4 address to a length check)
    /// or a prefix.
    #[test]
    fn text_from_an_old_client_is_never_read_as_an_address() {
        use prost::Message as _;
        let r = crate::ipam::v1::AllocateRequest::decode(&*old_text(&[(4, "1::2")])).unwrap();
        assert!(r.requested_address.is_empty());
        let a = crate::ipam::v1::Allocation::decode(&*old_text(&[(3, "1::2"), (5, "1::1")])).unwrap();
        assert!(a.address.is_empty() && a.gateway.is_empty());
        let r = crate::ipam::v1::ReleaseAddressRequest::decode(&*old_text(&[(2, "1::2")])).unwrap();
        assert!(r.address.is_empty());
        let r = crate::ipam::v1::RestoreRequest::decode(&*old_text(&[(3, "1::2")])).unwrap();
        assert!(r.address.is_empty());
        let p = crate::ipam::v1::PoolRange::decode(&*old_text(&[(2, "::/0"), (3, "1::1")])).unwrap();
        assert!(p.cidr.is_none() && p.gateway.is_empty());

        let r = crate::endpoint::v1::EndpointRef::decode(&*old_text(&[(4, "1::2")])).unwrap();
        assert_eq!(r.r#ref, None);
        let a = crate::endpoint::v1::EndpointAddress::decode(&*old_text(&[(1, "1::2")])).unwrap();
        assert!(a.address.is_empty());
        // Six characters are six bytes: a MAC to a length check.
        let c = crate::endpoint::v1::CreateEndpointRequest::decode(&*old_text(&[(7, "aabbcc")])).unwrap();
        assert!(c.mac.is_empty());
        let e = crate::endpoint::v1::Endpoint::decode(&*old_text(&[(8, "aabbcc")])).unwrap();
        assert!(e.mac.is_empty());

        let c = crate::identity::v1::CidrIdentity::decode(&*old_text(&[(1, "::/0")])).unwrap();
        assert_eq!(c.prefix, None);
        let r = crate::identity::v1::AllocateCidrIdentitiesRequest::decode(&*old_text(&[(1, "::/0")])).unwrap();
        assert!(r.prefixes.is_empty());
        let r = crate::identity::v1::ReleaseCidrIdentitiesRequest::decode(&*old_text(&[(1, "::/0")])).unwrap();
        assert!(r.prefixes.is_empty());
        let e = crate::identity::v1::IpcacheEntry::decode(&*old_text(&[(1, "1::2"), (3, "1::1")])).unwrap();
        assert!(e.prefix.is_none() && e.host_ip.is_empty());
        let r = crate::identity::v1::DeleteIpRequest::decode(&*old_text(&[(1, "::/0")])).unwrap();
        assert!(r.prefixes.is_empty());
        let r = crate::identity::v1::ListIpcacheRequest::decode(&*old_text(&[(3, "::/0")])).unwrap();
        assert_eq!(r.start_after, None);
        let w = crate::identity::v1::WatchIpcacheResponse::decode(&*old_text(&[(6, "::/0")])).unwrap();
        assert!(w.deleted.is_empty());
    }

    #[test]
    fn domains_are_distinct() {
        let domains = [
            <crate::ipam::v1::ErrorReason as ErrorReason>::DOMAIN,
            <crate::identity::v1::ErrorReason as ErrorReason>::DOMAIN,
            <crate::endpoint::v1::ErrorReason as ErrorReason>::DOMAIN,
            <crate::loader::v1::ErrorReason as ErrorReason>::DOMAIN,
            <crate::gc::v1::ErrorReason as ErrorReason>::DOMAIN,
            <crate::k8s::v1::ErrorReason as ErrorReason>::DOMAIN,
            <crate::health::v1::ErrorReason as ErrorReason>::DOMAIN,
        ];
        let unique: std::collections::BTreeSet<_> = domains.iter().collect();
        assert_eq!(unique.len(), domains.len());
    }
}
