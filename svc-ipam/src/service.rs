//! The `rivet.ipam.v1.Ipam` gRPC service: validates every field, maps rule
//! violations to gRPC codes, and stamps every response with the boot id.

use std::sync::Arc;

use rivet_common::grpc::{BootId, address_field, optional_address_field, prefix_field, status_with_reason};
use rivet_proto::ipam::v1 as pb;
use rivet_proto::net;
use tonic::{Code, Request, Response, Status};

use crate::allocator::{AllocError, Allocation, Owner};
use crate::events::{self, IpamMetrics};
use crate::pool::{DEFAULT_POOL, Family, PoolConfigError, PoolSource, PoolSpec};
use crate::store::{IpamStore, Listing, StoreError};

/// Implements `rivet.ipam.v1.Ipam` over an [`IpamStore`].
#[derive(Debug, Clone)]
pub struct IpamService {
    store: Arc<IpamStore>,
    boot_id: BootId,
    metrics: IpamMetrics,
}

impl IpamService {
    /// A service answering from `store`, stamping responses with `boot_id`.
    pub fn new(store: Arc<IpamStore>, boot_id: BootId, metrics: IpamMetrics) -> Self {
        Self {
            store,
            boot_id,
            metrics,
        }
    }

    /// The tonic server for this service.
    pub fn into_server(self) -> pb::ipam_server::IpamServer<Self> {
        pb::ipam_server::IpamServer::new(self)
    }

    fn fail(&self, method: &'static str, status: Status) -> Status {
        events::request_failed(
            &self.metrics,
            method,
            rivet_common::grpc::code_label(status.code()),
            status.message(),
        );
        status
    }
}

#[tonic::async_trait]
impl pb::ipam_server::Ipam for IpamService {
    #[tracing::instrument(
        name = "ipam.allocate",
        skip_all,
        fields(
            container.id = request.get_ref().owner.as_ref().map_or("", |o| o.container_id.as_str()),
            rivet.pod.addresses,
        )
    )]
    async fn allocate(&self, request: Request<pb::AllocateRequest>) -> Result<Response<pb::AllocateResponse>, Status> {
        let r = request.into_inner();
        let result = async {
            let owner = owner(r.owner.as_ref())?;
            let pool = pool_name(&r.pool);
            let requested = optional_address_field("requested_address", &r.requested_address)?;
            let family = match (family(r.family), requested) {
                (Some(f), Some(a)) if f != Family::of(&a) => {
                    return Err(Status::invalid_argument(format!(
                        "family: {f} does not match requested_address {a}"
                    )));
                }
                (Some(f), _) => f,
                (None, Some(a)) => Family::of(&a),
                (None, None) => {
                    return Err(Status::invalid_argument(
                        "family: must be FAMILY_IPV4 or FAMILY_IPV6 (or implied by requested_address)",
                    ));
                }
            };
            self.store
                .allocate(&owner, pool, family, requested)
                .await
                .map_err(|e| status(e, Code::AlreadyExists))
        }
        .await
        .map_err(|s| self.fail("Allocate", s))?;
        tracing::Span::current().record("rivet.pod.addresses", result.address.to_string().as_str());
        Ok(Response::new(pb::AllocateResponse {
            allocation: Some(self.allocation_proto(&result)),
            boot_id: self.boot_id.to_string(),
        }))
    }

    #[tracing::instrument(name = "ipam.release", skip_all)]
    async fn release(&self, request: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        let r = request.into_inner();
        let released = async {
            let owner = owner(r.owner.as_ref())?;
            self.store
                .release_owner(&owner)
                .await
                .map_err(|e| status(e, Code::FailedPrecondition))
        }
        .await
        .map_err(|s| self.fail("Release", s))?;
        Ok(Response::new(self.release_response(&released)))
    }

    #[tracing::instrument(name = "ipam.release_address", skip_all)]
    async fn release_address(
        &self,
        request: Request<pb::ReleaseAddressRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let r = request.into_inner();
        let released = async {
            let address = address_field("address", &r.address)?;
            let pool = (!r.pool.is_empty()).then_some(r.pool.as_str());
            self.store
                .release_address(pool, &address)
                .await
                .map_err(|e| status(e, Code::FailedPrecondition))
        }
        .await
        .map_err(|s| self.fail("ReleaseAddress", s))?;
        Ok(Response::new(self.release_response(released.as_slice())))
    }

    #[tracing::instrument(name = "ipam.restore", skip_all)]
    async fn restore(&self, request: Request<pb::RestoreRequest>) -> Result<Response<pb::AllocateResponse>, Status> {
        let r = request.into_inner();
        let result = async {
            let owner = owner(r.owner.as_ref())?;
            let address = address_field("address", &r.address)?;
            self.store
                .restore(&owner, pool_name(&r.pool), address)
                .await
                .map_err(|e| status(e, Code::FailedPrecondition))
        }
        .await
        .map_err(|s| self.fail("Restore", s))?;
        Ok(Response::new(pb::AllocateResponse {
            allocation: Some(self.allocation_proto(&result)),
            boot_id: self.boot_id.to_string(),
        }))
    }

    #[tracing::instrument(name = "ipam.list", skip_all)]
    async fn list(&self, request: Request<pb::ListRequest>) -> Result<Response<pb::ListResponse>, Status> {
        let r = request.into_inner();
        let listing = self.store.list();
        if !r.pool.is_empty() && !listing.pools.has_pool(&r.pool) {
            return Err(self.fail(
                "List",
                status_with_reason(
                    Code::NotFound,
                    format!("pool: {:?} does not exist", r.pool),
                    pb::ErrorReason::PoolNotFound,
                ),
            ));
        }
        Ok(Response::new(self.list_response(&listing, &r)))
    }

    #[tracing::instrument(name = "ipam.set_pool", skip_all, fields(pool = %request.get_ref().name))]
    async fn set_pool(&self, request: Request<pb::SetPoolRequest>) -> Result<Response<pb::SetPoolResponse>, Status> {
        let r = request.into_inner();
        let change = async {
            let cidrs = r
                .cidrs
                .iter()
                .enumerate()
                .map(|(i, c)| prefix_field(&format!("cidrs[{i}]"), Some(c)))
                .collect::<Result<Vec<_>, _>>()?;
            let spec = PoolSpec::new(&r.name, cidrs).map_err(|e| match e {
                PoolConfigError::Name { .. } => Status::invalid_argument(format!("name: {e}")),
                _ => Status::invalid_argument(format!("cidrs: {e}")),
            })?;
            self.store
                .set_pool(&spec)
                .await
                .map_err(|e| status(e, Code::FailedPrecondition))
        }
        .await
        .map_err(|s| self.fail("SetPool", s))?;
        let list = pb::ListRequest {
            pool: r.name,
            include_allocations: false,
        };
        Ok(Response::new(pb::SetPoolResponse {
            pool: self.list_response(&change.listing, &list).pools.into_iter().next(),
            changed: change.changed,
            boot_id: self.boot_id.to_string(),
        }))
    }
}

impl IpamService {
    fn allocation_proto(&self, a: &Allocation) -> pb::Allocation {
        self.store.with_pools(|pools| {
            let range = pools.range_of(&a.pool, &a.address).map(|i| &pools.ranges()[i]);
            allocation_proto(a, range)
        })
    }

    fn release_response(&self, released: &[Allocation]) -> pb::ReleaseResponse {
        pb::ReleaseResponse {
            released: released.iter().map(|a| self.allocation_proto(a)).collect(),
            boot_id: self.boot_id.to_string(),
        }
    }

    fn list_response(&self, listing: &Listing, r: &pb::ListRequest) -> pb::ListResponse {
        let pools = &listing.pools;
        let range_proto = |a: &Allocation| {
            let range = pools.range_of(&a.pool, &a.address).map(|i| &pools.ranges()[i]);
            allocation_proto(a, range)
        };
        let pools_proto = pools
            .names()
            .iter()
            .filter(|n| r.pool.is_empty() || **n == r.pool)
            .map(|name| pb::Pool {
                name: name.clone(),
                source: match pools.source(name) {
                    Some(PoolSource::Flag) => pb::PoolSource::Flag,
                    Some(PoolSource::SetPool) => pb::PoolSource::SetPool,
                    None => pb::PoolSource::Unspecified,
                } as i32,
                ranges: listing
                    .usage
                    .iter()
                    .filter(|u| pools.ranges()[u.range].pool == *name)
                    .map(|u| {
                        let range = &pools.ranges()[u.range];
                        pb::PoolRange {
                            family: family_proto(range.family()) as i32,
                            cidr: Some(net::prefix_to_proto(range.cidr)),
                            gateway: net::address_bytes(range.gateway),
                            size: saturate(u.size),
                            allocated: saturate(u.allocated),
                            available: saturate(u.size - u.allocated),
                        }
                    })
                    .collect(),
                allocations: if r.include_allocations {
                    listing
                        .allocations
                        .iter()
                        .filter(|a| a.pool == *name && pools.range_of(name, &a.address).is_some())
                        .map(range_proto)
                        .collect()
                } else {
                    Vec::new()
                },
            })
            .collect();
        pb::ListResponse {
            pools: pools_proto,
            orphaned: listing.orphaned.iter().map(range_proto).collect(),
            boot_id: self.boot_id.to_string(),
        }
    }
}

fn allocation_proto(a: &Allocation, range: Option<&crate::pool::PoolRange>) -> pb::Allocation {
    pb::Allocation {
        pool: a.pool.clone(),
        family: family_proto(a.family()) as i32,
        address: net::address_bytes(a.address),
        prefix_length: range.map(|r| u32::from(r.cidr.prefix_len())).unwrap_or_default(),
        gateway: range.map(|r| net::address_bytes(r.gateway)).unwrap_or_default(),
        owner: Some(pb::Owner {
            container_id: a.owner.container_id.clone(),
            interface: a.owner.interface.clone(),
        }),
    }
}

fn saturate(n: u128) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn family_proto(f: Family) -> pb::Family {
    match f {
        Family::V4 => pb::Family::Ipv4,
        Family::V6 => pb::Family::Ipv6,
    }
}

fn family(raw: i32) -> Option<Family> {
    match pb::Family::try_from(raw) {
        Ok(pb::Family::Ipv4) => Some(Family::V4),
        Ok(pb::Family::Ipv6) => Some(Family::V6),
        _ => None,
    }
}

fn pool_name(raw: &str) -> &str {
    if raw.is_empty() { DEFAULT_POOL } else { raw }
}

/// Validates the owner: a CNI container id and a Linux interface name.
fn owner(raw: Option<&pb::Owner>) -> Result<Owner, Status> {
    let o = raw.ok_or_else(|| Status::invalid_argument("owner: required"))?;
    let id = &o.container_id;
    if id.is_empty() || id.len() > 256 || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) {
        return Err(Status::invalid_argument(format!(
            "owner.container_id: {id:?} must be 1-256 characters of letters, digits, '.', '_' or '-'"
        )));
    }
    let ifname = &o.interface;
    if ifname.is_empty()
        || ifname.len() > 15
        || ifname == "."
        || ifname == ".."
        || ifname
            .bytes()
            .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace() || b == 0)
    {
        return Err(Status::invalid_argument(format!(
            "owner.interface: {ifname:?} is not a valid interface name (1-15 bytes, no '/', ':' or whitespace)"
        )));
    }
    Ok(Owner {
        container_id: id.clone(),
        interface: ifname.clone(),
    })
}

/// Maps a store error to a status and the reason a client acts on
/// (`rivet.ipam.v1.ErrorReason`); `held_by_other` is the code for an
/// address held by someone else (ALREADY_EXISTS on allocate,
/// FAILED_PRECONDITION on restore).
fn status(e: StoreError, held_by_other: Code) -> Status {
    use pb::ErrorReason as R;
    let (code, reason) = match &e {
        StoreError::Alloc(a) => match a {
            AllocError::NoPoolYet => (Code::Unavailable, R::NoPoolYet),
            AllocError::PoolConfig(_) => return Status::invalid_argument(format!("cidrs: {e}")),
            AllocError::PoolFixedByFlag { .. } => (Code::FailedPrecondition, R::PoolFixedByFlag),
            AllocError::PoolChangeStrandsAllocations { .. } => {
                (Code::FailedPrecondition, R::PoolChangeStrandsAllocations)
            }
            AllocError::UnknownPool { .. } => (Code::NotFound, R::PoolNotFound),
            AllocError::NoRangeForFamily { .. } => (Code::InvalidArgument, R::FamilyNotConfigured),
            AllocError::NotUsable { .. } => (Code::InvalidArgument, R::AddressNotUsable),
            AllocError::Exhausted { .. } => (Code::ResourceExhausted, R::PoolExhausted),
            AllocError::HeldByOther { .. } => (held_by_other, R::AddressHeld),
            AllocError::OwnerHoldsOther { .. } => (Code::FailedPrecondition, R::OwnerHoldsOther),
            AllocError::WrongPool { .. } => (Code::FailedPrecondition, R::WrongPool),
        },
        StoreError::Persist(_) => (Code::Unavailable, R::StateNotDurable),
        StoreError::Load(_) | StoreError::Writer { .. } => return Status::internal(e.to_string()),
    };
    status_with_reason(code, e.to_string(), reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolSet;
    use pb::ipam_server::Ipam;

    fn service(dir: &std::path::Path, pools: &str) -> IpamService {
        let pools = PoolSet::new(&[pools.parse().unwrap()]).unwrap();
        let store = IpamStore::open(dir, pools, IpamMetrics::default()).unwrap();
        IpamService::new(Arc::new(store), BootId::random(), IpamMetrics::default())
    }

    fn ip(text: &str) -> Vec<u8> {
        net::address_bytes(text.parse().unwrap())
    }

    fn req(container: &str, iface: &str, family: pb::Family, addr: &[u8]) -> Request<pb::AllocateRequest> {
        Request::new(pb::AllocateRequest {
            owner: Some(pb::Owner {
                container_id: container.into(),
                interface: iface.into(),
            }),
            pool: String::new(),
            family: family as i32,
            requested_address: addr.to_vec(),
        })
    }

    #[tokio::test]
    async fn invalid_fields_are_named_in_invalid_argument() {
        let dir = tempfile::tempdir().unwrap();
        let svc = service(dir.path(), "default=198.18.0.0/24");
        let cases = [
            (req("", "eth0", pb::Family::Ipv4, b""), "owner.container_id"),
            (req("a/b", "eth0", pb::Family::Ipv4, b""), "owner.container_id"),
            (req("abc", "", pb::Family::Ipv4, b""), "owner.interface"),
            (
                req("abc", "much-too-long-name", pb::Family::Ipv4, b""),
                "owner.interface",
            ),
            (req("abc", "eth0", pb::Family::Unspecified, b""), "family"),
            (req("abc", "eth0", pb::Family::Ipv4, b"abc"), "requested_address"),
            (req("abc", "eth0", pb::Family::Ipv4, b"198.18.0.9"), "requested_address"),
            (req("abc", "eth0", pb::Family::Ipv6, &ip("198.18.0.9")), "family"),
        ];
        for (r, field) in cases {
            let err = svc.allocate(r).await.unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
            assert!(
                err.message().starts_with(field),
                "the error names {field}: {}",
                err.message()
            );
        }
        let mut r = req("abc", "eth0", pb::Family::Ipv4, b"");
        r.get_mut().owner = None;
        assert_eq!(svc.allocate(r).await.unwrap_err().code(), Code::InvalidArgument);
    }

    #[tokio::test]
    async fn codes_for_rule_violations() {
        let dir = tempfile::tempdir().unwrap();
        let svc = service(dir.path(), "default=198.18.0.0/30");
        let ok = svc
            .allocate(req("a", "eth0", pb::Family::Ipv4, b""))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(ok.allocation.as_ref().unwrap().address, ip("198.18.0.2"));
        assert_eq!(ok.allocation.as_ref().unwrap().gateway, ip("198.18.0.1"));
        assert_eq!(ok.allocation.as_ref().unwrap().prefix_length, 30);
        assert!(!ok.boot_id.is_empty(), "every response carries the boot id");

        let err = svc.allocate(req("b", "eth0", pb::Family::Ipv4, b"")).await.unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert_eq!(reason(&err), Some(pb::ErrorReason::PoolExhausted));
        assert!(
            err.message().contains("pool default") && err.message().contains("all 1"),
            "{}",
            err.message()
        );

        let err = svc
            .allocate(req("b", "eth0", pb::Family::Ipv4, &ip("198.18.0.2")))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::AlreadyExists);
        assert_eq!(reason(&err), Some(pb::ErrorReason::AddressHeld));

        let restore = Request::new(pb::RestoreRequest {
            owner: Some(pb::Owner {
                container_id: "b".into(),
                interface: "eth0".into(),
            }),
            pool: String::new(),
            address: ip("198.18.0.2"),
        });
        let err = svc.restore(restore).await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition);
        assert_eq!(reason(&err), Some(pb::ErrorReason::AddressHeld));
        assert!(
            err.message().contains("held by a/eth0"),
            "restore names the current owner: {}",
            err.message()
        );

        let err = svc.allocate(req("b", "eth0", pb::Family::Ipv6, b"")).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
        assert_eq!(reason(&err), Some(pb::ErrorReason::FamilyNotConfigured));
        let err = svc
            .allocate(req("c", "eth0", pb::Family::Ipv4, &ip("198.18.1.9")))
            .await
            .unwrap_err();
        assert_eq!(reason(&err), Some(pb::ErrorReason::AddressNotUsable), "{err:?}");
        let mut r = req("b", "eth0", pb::Family::Ipv4, b"");
        r.get_mut().pool = "missing".into();
        let err = svc.allocate(r).await.unwrap_err();
        assert_eq!(err.code(), Code::NotFound);
        assert_eq!(reason(&err), Some(pb::ErrorReason::PoolNotFound));
        let err = svc
            .list(Request::new(pb::ListRequest {
                pool: "missing".into(),
                include_allocations: false,
            }))
            .await
            .unwrap_err();
        assert_eq!(reason(&err), Some(pb::ErrorReason::PoolNotFound));
        // Field validation carries no reason: nothing for a client to act on.
        let err = svc.allocate(req("", "eth0", pb::Family::Ipv4, b"")).await.unwrap_err();
        assert_eq!(reason(&err), None);
    }

    fn reason(status: &Status) -> Option<pb::ErrorReason> {
        rivet_common::grpc::error_reason(status)
    }
}
