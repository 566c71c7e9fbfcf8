//! Arbitrary protobuf bytes decoded as the daemons' request messages and
//! passed to what the daemon does with them:
//!
//! - svc-ipam: the real handlers (`IpamService`) over a real store in a
//!   fresh directory per input: a refused request changes nothing, and no
//!   address is ever held twice;
//! - svc-loader, svc-identity, svc-endpoint: the request validation their
//!   handlers call before changing anything (the datapath, the kvstore and
//!   the endpoint manager are not run here).
//!
//! Every refusal must be INVALID_ARGUMENT naming the field (`field: why`),
//! never a panic.
//!
//! Input: frames of `[kind][length: u16 LE][message bytes]`.

#![no_main]

use std::sync::{Arc, LazyLock};

use libfuzzer_sys::fuzz_target;
use prost::Message;
use rivet_common::grpc::BootId;
use rivet_proto::ipam::v1 as ipam;
use rivet_proto::loader::v1 as loader;
use svc_ipam::events::IpamMetrics;
use svc_ipam::pool::PoolSet;
use svc_ipam::service::IpamService;
use svc_ipam::store::IpamStore;
use svc_loader::routing::RoutingMode;
use svc_loader::validate as lv;
use tonic::{Code, Request, Status};

/// Most frames one input runs (a longer input is cut here).
const MAX_FRAMES: usize = 16;

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime")
});

fuzz_target!(|data: &[u8]| {
    // tmpfs: the store fsyncs every change.
    let dir = tempfile::Builder::new()
        .prefix("rivet-fuzz-ipam")
        .tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("a temp dir");
    let pools = PoolSet::new(&["default=198.18.0.0/30,2001:2::/126".parse().expect("pool spec")]).expect("pools");
    let store = Arc::new(IpamStore::open(dir.path(), pools, IpamMetrics::default()).expect("a fresh store"));
    let ipam = IpamService::new(store.clone(), BootId::random(), IpamMetrics::default());

    let mut rest = data;
    for _ in 0..MAX_FRAMES {
        let [kind, lo, hi, tail @ ..] = rest else {
            break;
        };
        let len = usize::from(u16::from_le_bytes([*lo, *hi])).min(tail.len());
        let (message, next) = tail.split_at(len);
        rest = next;
        RUNTIME.block_on(frame(*kind, message, &ipam, &store));
    }
});

async fn frame(kind: u8, bytes: &[u8], ipam: &IpamService, store: &IpamStore) {
    use ipam::ipam_server::Ipam as _;
    let before = snapshot(store);
    let outcome: Option<Result<(), Status>> = match kind % 25 {
        0 => call(bytes, |r| ipam.allocate(Request::new(r))).await,
        1 => call(bytes, |r| ipam.release(Request::new(r))).await,
        2 => call(bytes, |r| ipam.release_address(Request::new(r))).await,
        3 => call(bytes, |r| ipam.restore(Request::new(r))).await,
        4 => call(bytes, |r| ipam.list(Request::new(r))).await,
        5 => call(bytes, |r| ipam.set_pool(Request::new(r))).await,
        6 => loader_check::<loader::ApplyEndpointRequest, _>(bytes, |r| lv::endpoint(r).map(drop)),
        7 => loader_check::<loader::UpsertIpcacheRequest, _>(bytes, |r| {
            lv::ipcache_entries("entries", &r.entries).map(drop)
        }),
        8 => loader_check::<loader::DeleteIpcacheRequest, _>(bytes, |r| {
            lv::ipcache_prefixes("prefixes", &r.prefixes).map(drop)
        }),
        9 => loader_check::<loader::ReplaceNodesRequest, _>(bytes, |r| {
            // Any mode the loader runs with peers.
            lv::peer_nodes("nodes", &r.nodes, RoutingMode::Native)?;
            lv::peer_nodes("nodes", &r.nodes, RoutingMode::Vxlan).map(drop)
        }),
        10 => loader_check::<loader::UpsertServiceRequest, _>(bytes, |r| {
            let service = r
                .service
                .as_ref()
                .ok_or_else(|| svc_loader::lb::validate::missing("service"))?;
            svc_loader::lb::validate::service("service", service).map(drop)
        }),
        11 => loader_check::<loader::ReplaceServicesRequest, _>(bytes, |r| {
            svc_loader::lb::validate::service_set(&r.services).map(drop)
        }),
        12 => loader_check::<loader::RemoveEndpointRequest, _>(bytes, |r| {
            lv::endpoint_id("endpoint_id", r.endpoint_id).map(drop)
        }),
        kind => k8s_check(kind, bytes),
    };
    let after = snapshot(store);
    if let Some(Err(status)) = &outcome {
        check_refusal(status);
        assert_eq!(
            before,
            after,
            "a refused request ({}) changed svc-ipam's state",
            status.message()
        );
    }
    check_ipam_state(store);
}

/// Decodes `bytes` as `R` and runs `handler`; `None` when they do not
/// decode (tonic refuses those before any handler).
async fn call<R, T, F>(bytes: &[u8], handler: impl FnOnce(R) -> F) -> Option<Result<(), Status>>
where
    R: Message + Default,
    F: std::future::Future<Output = Result<T, Status>>,
{
    let request = R::decode(bytes).ok()?;
    Some(handler(request).await.map(drop))
}

fn loader_check<R: Message + Default, F>(bytes: &[u8], check: F) -> Option<Result<(), Status>>
where
    F: FnOnce(&R) -> Result<(), lv::InvalidField>,
{
    let request = R::decode(bytes).ok()?;
    Some(check(&request).map_err(|e| {
        assert!(!e.field.is_empty() && !e.reason.is_empty(), "{e:?}");
        Status::invalid_argument(e.to_string())
    }))
}

/// A refusal of a request's content is INVALID_ARGUMENT naming the field,
/// unless it carries an ErrorReason (the store's rule violations, which
/// clients act on by reason).
fn check_refusal(status: &Status) {
    let has_reason = !status.details().is_empty();
    match status.code() {
        Code::InvalidArgument if !has_reason => assert!(
            names_field(status.message()),
            "a refusal that names no field: {:?}",
            status.message()
        ),
        Code::Internal | Code::Unknown => panic!("an internal error for a client's request: {status:?}"),
        _ => {}
    }
}

/// `field: reason`, the field a path like `policy.entries[3].port` (or
/// `id or owner`).
fn names_field(message: &str) -> bool {
    let Some((field, reason)) = message.split_once(": ") else {
        return false;
    };
    !field.is_empty()
        && !reason.is_empty()
        && field
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.[] ".contains(&b))
}

/// What a refusal must leave unchanged: the pools and every allocation.
fn snapshot(store: &IpamStore) -> String {
    let listing = store.list();
    format!("{:?} {:?}", listing.pools, listing.allocations)
}

/// No address is held twice in a pool.
fn check_ipam_state(store: &IpamStore) {
    let listing = store.list();
    let mut seen = std::collections::BTreeSet::new();
    for a in &listing.allocations {
        assert!(
            seen.insert((a.pool.clone(), a.address)),
            "{} is held twice: {listing:?}",
            a.address
        );
    }
}

#[cfg(feature = "k8s-daemons")]
mod k8s_daemons {
    use prost::Message;
    use rivet_proto::endpoint::v1 as endpoint;
    use rivet_proto::identity::v1 as identity;
    use svc_endpoint::service as es;
    use svc_identity::service as is;
    use tonic::Status;

    fn check<R: Message + Default>(
        bytes: &[u8],
        f: impl FnOnce(&R) -> Result<(), Status>,
    ) -> Option<Result<(), Status>> {
        let request = R::decode(bytes).ok()?;
        Some(f(&request))
    }

    pub(super) fn check_kind(kind: u8, bytes: &[u8]) -> Option<Result<(), Status>> {
        match kind {
            13 => check::<identity::AllocateIdentityRequest>(bytes, |r| is::validate_allocate(r).map(drop)),
            14 => check::<identity::ReleaseIdentityRequest>(bytes, |r| is::validate_release(r).map(drop)),
            15 => check::<identity::LookupIdentityRequest>(bytes, |r| is::validate_lookup(r).map(drop)),
            16 => check::<identity::AllocateCidrIdentitiesRequest>(bytes, |r| {
                is::validate_cidr_request(&r.owner, &r.prefixes).map(drop)
            }),
            17 => check::<endpoint::CreateEndpointRequest>(bytes, |r| es::validate_create(r).map(drop)),
            18 => check::<endpoint::DeleteEndpointRequest>(bytes, |r| es::parse_ref(r.r#ref.as_ref()).map(drop)),
            19 => check::<endpoint::UpdateLabelsRequest>(bytes, |r| es::validate_update_labels(r).map(drop)),
            20 => check::<endpoint::UpsertPolicyRequest>(bytes, |r| es::validate_upsert_policy(r).map(drop)),
            21 => check::<endpoint::DeletePolicyRequest>(bytes, |r| es::validate_delete_policy(r).map(drop)),
            22 => check::<endpoint::SetNamespaceLabelsRequest>(bytes, |r| es::validate_namespace_labels(r).map(drop)),
            23 => check::<endpoint::SetPodMetadataRequest>(bytes, |r| match &r.metadata {
                Some(m) => es::parse_pod_metadata("metadata", m).map(drop),
                None => Ok(()),
            }),
            24 => check::<identity::EndReplayRequest>(bytes, |r| is::validate_end_replay(r).map(drop)),
            _ => None,
        }
    }
}

#[cfg(feature = "k8s-daemons")]
use k8s_daemons::check_kind as k8s_check;

/// Without the feature, only svc-ipam and svc-loader are fuzzed.
#[cfg(not(feature = "k8s-daemons"))]
fn k8s_check(_: u8, _: &[u8]) -> Option<Result<(), Status>> {
    None
}
