//! The verbs: ADD (svc-ipam or a delegated IPAM plugin, or chained after
//! another plugin), DEL, CHECK, STATUS and GC, over the traits of
//! [`crate::api`].
//!
//! ADD runs its steps in order and records what each did; a failure undoes
//! everything recorded, newest first (endpoint, veth with its routes,
//! addresses), so a failed ADD leaves nothing behind even when the runtime
//! never calls DEL. DEL and GC do as much as they can and report every
//! failure; an address is released only once its endpoint is gone, so the
//! datapath never holds an address svc-ipam may hand out again.

use std::collections::HashSet;
use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::future;
use ipnet::IpNet;
use rivet_common::grpc::RpcError;
use rivet_common::mac::{format_mac, parse_mac};
use rivet_proto::endpoint::v1 as eppb;
use rivet_proto::ipam::v1 as ipampb;
use rivet_proto::net;
use serde_json::Value;
use tonic::{Code, Status};
use tracing::Instrument as _;

use crate::api::{
    DelegateExec, EndpointApi, EndpointError, IpamApi, IpamError, Link, Netlink, NetlinkError, PodAddress, PodConfig,
    PodRoute, Veth, VethRequest,
};
use crate::env::{CniEnv, Command};
use crate::error::{CniError, codes};
use crate::naming::host_ifname;
use crate::netconf::{Attachment, EndpointKind, NetConf};
use crate::result::{CniResult, Interface, IpConfig, Route};
use crate::version::CniVersion;

/// The budget of the undo after a failed ADD (the invocation's own deadline
/// may be what failed).
pub const CLEANUP_BUDGET: Duration = Duration::from_secs(10);

/// One invocation: its environment, netconf and raw stdin (handed to a
/// delegated IPAM plugin as is).
#[derive(Debug, Clone)]
pub struct Invocation {
    /// The `CNI_*` environment.
    pub env: CniEnv,
    /// The parsed netconf.
    pub conf: NetConf,
    /// stdin as read.
    pub stdin: Vec<u8>,
}

/// The implementations of the outside world.
#[derive(Clone, Copy)]
pub struct Deps<'a> {
    /// Netlink.
    pub netlink: &'a dyn Netlink,
    /// svc-ipam.
    pub ipam: &'a dyn IpamApi,
    /// svc-endpoint.
    pub endpoints: &'a dyn EndpointApi,
    /// Delegated IPAM plugins.
    pub delegate: &'a dyn DelegateExec,
}

/// When the invocation must be done; every call gets what is left.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    end: Instant,
    budget: Duration,
}

impl Deadline {
    /// `budget` from now.
    pub fn after(budget: Duration) -> Self {
        Self {
            end: Instant::now() + budget,
            budget,
        }
    }

    /// Time left for `step`; code 11 naming the step once none is left.
    pub fn remaining(&self, step: &str) -> Result<Duration, CniError> {
        let left = self.end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(CniError::new(
                codes::TRY_AGAIN_LATER,
                format!(
                    "{step}: the invocation ran out of time ({}s, timeoutSeconds)",
                    self.budget.as_secs()
                ),
            ));
        }
        Ok(left)
    }

    /// Runs `f` with what is left, as a bound on the whole future (netlink
    /// and process calls have no deadline of their own).
    async fn bound<T>(
        &self,
        step: &str,
        f: impl std::future::Future<Output = Result<T, CniError>>,
    ) -> Result<T, CniError> {
        let left = self.remaining(step)?;
        match tokio::time::timeout(left, f).await {
            Ok(result) => result,
            Err(_) => Err(CniError::new(
                codes::TRY_AGAIN_LATER,
                format!(
                    "{step}: the invocation ran out of time ({}s, timeoutSeconds)",
                    self.budget.as_secs()
                ),
            )),
        }
    }
}

/// What an ADD did so far, to undo on failure.
#[derive(Debug, Default)]
struct Undo {
    /// CreateEndpoint was sent (it may have succeeded even if the reply was lost).
    endpoint: bool,
    /// The host veth that was (or may have been) created.
    veth: Option<String>,
    /// svc-ipam was asked for addresses.
    ipam: bool,
    /// The delegated IPAM plugin was asked for addresses.
    delegated: Option<String>,
}

/// Addresses and where they came from.
struct Addresses {
    pod: Vec<PodAddress>,
    /// svc-ipam pool per address (empty for a delegated plugin).
    pools: Vec<String>,
    /// Extra routes of a delegated plugin's result.
    extra_routes: Vec<Route>,
}

/// Error 1 unless the config's version has `verb` (added in `since`).
fn require_version(has: bool, verb: &str, since: &str, version: impl std::fmt::Display) -> Result<(), CniError> {
    if has {
        return Ok(());
    }
    Err(CniError::new(
        codes::INCOMPATIBLE_VERSION,
        format!("{verb} needs cniVersion {since} or later, the config is {version}"),
    ))
}

/// Runs the invocation's verb; `Some(json)` is the result to print.
pub async fn run(deps: Deps<'_>, inv: &Invocation) -> Result<Option<Value>, CniError> {
    let deadline = Deadline::after(inv.conf.timeout);
    let version = inv.conf.cni_version;
    match inv.env.command {
        Command::Add => add(deps, inv, deadline).await.map(Some),
        Command::Del => del(deps, inv, deadline).await.map(|()| None),
        Command::Check => {
            require_version(version.has_check(), "CHECK", "0.4.0", version)?;
            check(deps, inv, deadline).await.map(|()| None)
        }
        Command::Status => {
            require_version(version.has_status_and_gc(), "STATUS", "1.1.0", version)?;
            readiness(deps, &inv.conf, inv.conf.ipam.is_none(), deadline)
                .await
                .map(|()| None)
        }
        Command::Gc => {
            require_version(version.has_status_and_gc(), "GC", "1.1.0", version)?;
            gc(deps, inv, deadline).await.map(|()| None)
        }
        Command::Version => Err(CniError::new(
            codes::INTERNAL,
            "VERSION is answered before a netconf is parsed",
        )),
    }
}

fn netlink_error(e: NetlinkError) -> CniError {
    CniError::new(codes::NETLINK, e.to_string())
}

/// What svc-ipam's refusal means to the runtime (CNI spec error codes):
/// a full pool, a write that was not made durable or a node still waiting
/// for its pod CIDRs clears by itself (11, try again later); a pool or requested address the netconf names wrongly
/// is a bad network configuration (7); the rest are svc-ipam's refusals (101).
fn ipam_code(reason: ipampb::ErrorReason) -> u32 {
    use ipampb::ErrorReason as R;
    match reason {
        R::PoolExhausted | R::StateNotDurable | R::NoPoolYet => codes::TRY_AGAIN_LATER,
        R::PoolNotFound | R::FamilyNotConfigured | R::AddressNotUsable => codes::INVALID_NETCONF,
        // The last two are SetPool's; Allocate never sends them.
        R::Unspecified
        | R::AddressHeld
        | R::OwnerHoldsOther
        | R::WrongPool
        | R::PoolChangeStrandsAllocations
        | R::PoolFixedByFlag => codes::IPAM,
    }
}

/// What svc-endpoint's refusal means to the runtime: conditions that clear
/// by themselves (no identity while the kvstore is down, a removal retried
/// in the background, a regeneration that goes on) are 11, the rest 102.
fn endpoint_code(reason: eppb::ErrorReason, code: Code) -> u32 {
    use eppb::ErrorReason as R;
    match reason {
        R::IdentityUnavailable
        | R::NotRealisedInTime
        | R::RemovalPending
        | R::EndpointRemoved
        | R::NotReady
        | R::EndpointIdsExhausted => codes::TRY_AGAIN_LATER,
        // The dependency's own code is kept: UNAVAILABLE means it restarts.
        R::RegenerationFailed if code == Code::Unavailable => codes::TRY_AGAIN_LATER,
        _ => codes::ENDPOINT,
    }
}

fn ipam_error(step: &str, e: &IpamError) -> CniError {
    daemon_error("svc-ipam", step, e, e.reason().map(ipam_code), codes::IPAM)
}

fn endpoint_error(step: &str, e: &EndpointError) -> CniError {
    let code = e.reason().map(|r| endpoint_code(r, e.code()));
    daemon_error("svc-endpoint", step, e, code, codes::ENDPOINT)
}

/// A daemon's refusal as a CNI error: the code its reason maps to; with no
/// reason (the daemon was not reached, or the call ran out of time) the
/// transport conditions are 11 (try again later), the rest `fallback`.
fn daemon_error<R: rivet_proto::ErrorReason>(
    daemon: &str,
    step: &str,
    e: &RpcError<R>,
    by_reason: Option<u32>,
    fallback: u32,
) -> CniError {
    let code = by_reason.unwrap_or(match e.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Aborted | Code::Cancelled => codes::TRY_AGAIN_LATER,
        _ => fallback,
    });
    let details = match e.reason() {
        Some(reason) => format!("gRPC status {:?}, reason {}", e.code(), reason.name()),
        None => format!("gRPC status {:?}", e.code()),
    };
    CniError::new(code, format!("{step}: {daemon}: {}", e.message())).with_details(details)
}

/// svc-endpoint (and, when it is the IPAM, svc-ipam with the pool) answer:
/// code 50 when one is unreachable, 7 when the pool does not exist.
async fn readiness(deps: Deps<'_>, conf: &NetConf, with_ipam: bool, deadline: Deadline) -> Result<(), CniError> {
    let timeout = deadline.remaining("readiness")?;
    let endpoint = deps.endpoints.ready(timeout);
    let ipam = async {
        if with_ipam {
            deps.ipam.ready(&conf.ipam_pool, timeout).await
        } else {
            Ok(())
        }
    };
    let (endpoint, ipam) = future::join(endpoint, ipam).await;
    let not_available = |daemon: &str, socket: &Path, status: &Status| {
        CniError::new(
            codes::NOT_AVAILABLE,
            format!(
                "{daemon} is not available at {}: {}",
                socket.display(),
                status.message()
            ),
        )
        .with_details(format!("gRPC status {:?}", status.code()))
    };
    if let Err(e) = endpoint {
        return Err(not_available("svc-endpoint", &conf.endpoint_socket(), e.status()));
    }
    match ipam {
        Ok(()) => Ok(()),
        Err(e) if e.is(ipampb::ErrorReason::PoolNotFound) => Err(CniError::netconf(format!(
            "ipamPool={:?}: svc-ipam has no such pool ({})",
            conf.ipam_pool,
            e.message()
        ))),
        Err(e) => Err(not_available("svc-ipam", &conf.ipam_socket(), e.status())),
    }
}

fn netns_of(env: &CniEnv) -> Result<&Path, CniError> {
    env.netns
        .as_deref()
        .ok_or_else(|| CniError::env(format!("CNI_NETNS is not set ({} requires it)", env.command)))
}

// --------------------------------------------------------------------- ADD --

async fn add(deps: Deps<'_>, inv: &Invocation, deadline: Deadline) -> Result<Value, CniError> {
    if let Some(prev) = &inv.conf.prev_result {
        return add_chained(deps, inv, prev, deadline).await;
    }
    let (env, conf) = (&inv.env, &inv.conf);
    let netns = netns_of(env)?;
    deadline
        .bound("checking CNI_NETNS", async {
            deps.netlink.check_netns(netns).await.map_err(|e| {
                CniError::env(format!("CNI_NETNS={}: {}", netns.display(), e.reason)).with_details(e.to_string())
            })
        })
        .await?;
    readiness(deps, conf, conf.ipam.is_none(), deadline).await?;
    let host_name = host_ifname(&conf.host_interface_prefix, &env.container_id, &env.ifname);
    let existing = deadline
        .bound("looking up the host interface", async {
            deps.netlink.host_link(&host_name).await.map_err(netlink_error)
        })
        .await?;
    if let Some(link) = existing {
        return Err(CniError::new(
            codes::ALREADY_EXISTS,
            format!(
                "host interface {host_name} (index {}) already exists: container {} interface {} is attached \
                 already (DEL it first), or another attachment's name collides",
                link.index, env.container_id, env.ifname
            ),
        ));
    }
    let mut undo = Undo::default();
    match add_steps(deps, inv, &host_name, &mut undo, deadline).await {
        Ok(result) => Ok(result),
        Err(err) => {
            tracing::warn!(error = %err, "ADD failed; undoing what it did");
            let cleanup = undo_add(deps, inv, undo)
                .instrument(tracing::info_span!("cni.add.undo"))
                .await;
            Err(match cleanup {
                Ok(()) => err,
                Err(problems) => {
                    let details = if err.details.is_empty() {
                        format!("undoing the ADD failed too: {problems}")
                    } else {
                        format!("{}; undoing the ADD failed too: {problems}", err.details)
                    };
                    err.with_details(details)
                }
            })
        }
    }
}

async fn add_steps(
    deps: Deps<'_>,
    inv: &Invocation,
    host_name: &str,
    undo: &mut Undo,
    deadline: Deadline,
) -> Result<Value, CniError> {
    let (env, conf) = (&inv.env, &inv.conf);
    let netns = netns_of(env)?;

    let addresses = match &conf.ipam {
        None => {
            undo.ipam = true;
            let span = tracing::info_span!(
                "cni.ipam.allocate",
                pool = %conf.ipam_pool,
                rivet.pod.addresses = tracing::field::Empty,
            );
            let addresses = allocate(deps, inv, deadline).instrument(span.clone()).await?;
            let assigned: Vec<String> = addresses.pod.iter().map(|a| a.address.to_string()).collect();
            span.record("rivet.pod.addresses", assigned.join(",").as_str());
            addresses
        }
        Some(delegated) => {
            undo.delegated = Some(delegated.plugin_type.clone());
            delegated_add(deps, inv, &delegated.plugin_type, deadline)
                .instrument(tracing::info_span!("cni.ipam.delegate", plugin = %delegated.plugin_type))
                .await?
        }
    };
    tracing::info!(addresses = ?addresses.pod.iter().map(|a| a.address.to_string()).collect::<Vec<_>>(), "addresses assigned");

    let request = VethRequest {
        host_name: host_name.to_string(),
        peer_name: env.ifname.clone(),
        netns: netns.to_path_buf(),
        mtu: conf.mtu,
    };
    // Recorded before the request: a create cut short by the deadline may
    // still have happened. EEXIST means nothing was created (the name was
    // free a moment ago, so the one that exists now is someone else's, or
    // the container already has CNI_IFNAME).
    undo.veth = Some(host_name.to_string());
    let veth: Veth = deadline
        .bound("creating the veth pair", async {
            deps.netlink.create_veth(&request).await.map_err(|e| {
                if e.is_exists() {
                    undo.veth = None;
                }
                netlink_error(e)
            })
        })
        .instrument(tracing::info_span!("cni.netlink.veth", host = %host_name))
        .await?;
    tracing::info!(host = %veth.host.name, host_ifindex = veth.host.index, peer_ifindex = veth.peer.index, "veth created");

    let mut routes: Vec<PodRoute> = Vec::new();
    for a in &addresses.pod {
        let dst = if a.address.addr().is_ipv4() {
            IpNet::new(IpAddr::from([0u8; 4]), 0)
        } else {
            IpNet::new(IpAddr::from([0u16; 8]), 0)
        }
        .expect("prefix 0 is valid");
        routes.push(PodRoute { dst, gw: a.gateway });
    }
    for r in &addresses.extra_routes {
        if routes.iter().any(|o| o.dst == r.dst) {
            continue;
        }
        let gw = match r.gw {
            Some(gw) => gw,
            None => match addresses
                .pod
                .iter()
                .find(|a| a.address.addr().is_ipv4() == r.dst.addr().is_ipv4())
            {
                Some(a) => a.gateway,
                None => continue,
            },
        };
        routes.push(PodRoute { dst: r.dst, gw });
    }
    let pod_config = PodConfig {
        ifindex: veth.peer.index,
        addresses: addresses.pod.clone(),
        routes,
    };
    deadline
        .bound("configuring the container interface", async {
            deps.netlink
                .configure_pod(netns, &pod_config)
                .await
                .map_err(netlink_error)
        })
        .instrument(tracing::info_span!("cni.netlink.pod", ifname = %env.ifname))
        .await?;

    let ips: Vec<IpAddr> = addresses.pod.iter().map(|a| a.address.addr()).collect();
    deadline
        .bound("adding the host routes", async {
            deps.netlink
                .add_host_routes(veth.host.index, &ips)
                .await
                .map_err(netlink_error)
        })
        .instrument(tracing::info_span!("cni.netlink.host_routes"))
        .await?;

    let mac = veth.peer.mac.ok_or_else(|| {
        CniError::new(
            codes::NETLINK,
            format!("{} in the container has no MAC address", env.ifname),
        )
    })?;
    let request = eppb::CreateEndpointRequest {
        container_id: env.container_id.clone(),
        interface: env.ifname.clone(),
        netns_path: netns.display().to_string(),
        host_interface: veth.host.name.clone(),
        host_ifindex: veth.host.index,
        addresses: addresses
            .pod
            .iter()
            .zip(&addresses.pools)
            .map(|(a, pool)| eppb::EndpointAddress {
                address: net::address_bytes(a.address.addr()),
                ipam_pool: pool.clone(),
            })
            .collect(),
        mac: mac.to_vec(),
        pod_namespace: env.args.pod_namespace.clone().unwrap_or_default(),
        pod_name: env.args.pod_name.clone().unwrap_or_default(),
        pod_uid: env.args.pod_uid.clone().unwrap_or_default(),
        labels: conf.labels.clone(),
        r#async: false,
        named_ports: named_ports(conf),
        kind: endpoint_kind(conf).into(),
    };
    undo.endpoint = true;
    let endpoint = create_endpoint(deps, request, deadline).await?;
    tracing::info!(
        endpoint_id = endpoint.id,
        identity = endpoint.identity,
        "endpoint ready"
    );

    let host_mac = veth.host.mac.map(|m| format_mac(&m));
    let result = CniResult {
        interfaces: vec![
            Interface {
                name: veth.host.name.clone(),
                mac: host_mac,
                sandbox: None,
                mtu: Some(veth.host.mtu),
            },
            Interface {
                name: env.ifname.clone(),
                mac: Some(format_mac(&mac)),
                sandbox: Some(netns.display().to_string()),
                mtu: Some(veth.peer.mtu),
            },
        ],
        ips: addresses
            .pod
            .iter()
            .map(|a| IpConfig {
                address: a.address,
                gateway: Some(a.gateway),
                interface: Some(1),
            })
            .collect(),
        routes: pod_config
            .routes
            .iter()
            .map(|r| Route {
                dst: r.dst,
                gw: Some(r.gw),
            })
            .collect(),
        dns: conf.dns.clone(),
    };
    Ok(result.render(conf.cni_version))
}

/// The netconf's endpoint kind on the wire.
fn endpoint_kind(conf: &NetConf) -> eppb::EndpointKind {
    match conf.endpoint_kind {
        EndpointKind::Pod => eppb::EndpointKind::Pod,
        EndpointKind::Health => eppb::EndpointKind::Health,
    }
}

/// The netconf's named container ports as svc-endpoint takes them.
fn named_ports(conf: &NetConf) -> Vec<eppb::NamedPort> {
    conf.named_ports
        .iter()
        .map(|p| eppb::NamedPort {
            name: p.name.clone(),
            protocol: p.protocol.clone(),
            port: u32::from(p.port),
        })
        .collect()
}

async fn create_endpoint(
    deps: Deps<'_>,
    request: eppb::CreateEndpointRequest,
    deadline: Deadline,
) -> Result<eppb::Endpoint, CniError> {
    let timeout = deadline.remaining("creating the endpoint")?;
    let span = tracing::info_span!(
        "cni.endpoint.create",
        container.id = %request.container_id,
        k8s.namespace.name = tracing::field::Empty,
        k8s.pod.name = tracing::field::Empty,
        rivet.endpoint.id = tracing::field::Empty,
        rivet.identity.id = tracing::field::Empty,
    );
    if !request.pod_namespace.is_empty() {
        span.record("k8s.namespace.name", request.pod_namespace.as_str());
    }
    if !request.pod_name.is_empty() {
        span.record("k8s.pod.name", request.pod_name.as_str());
    }
    let endpoint = deps
        .endpoints
        .create(request, timeout)
        .instrument(span.clone())
        .await
        .map_err(|e| endpoint_error("creating the endpoint", &e))?;
    span.record("rivet.endpoint.id", endpoint.id);
    span.record("rivet.identity.id", endpoint.identity);
    Ok(endpoint)
}

fn owner(env: &CniEnv) -> ipampb::Owner {
    ipampb::Owner {
        container_id: env.container_id.clone(),
        interface: env.ifname.clone(),
    }
}

/// Allocates one address per family, both requests at once (svc-ipam makes
/// concurrent allocations durable with one write).
async fn allocate(deps: Deps<'_>, inv: &Invocation, deadline: Deadline) -> Result<Addresses, CniError> {
    let (env, conf) = (&inv.env, &inv.conf);
    let timeout = deadline.remaining("allocating addresses")?;
    let one = |family: ipampb::Family, v4: bool| async move {
        let requested = conf.requested_ips.iter().find(|ip| ip.is_ipv4() == v4);
        let request = ipampb::AllocateRequest {
            owner: Some(owner(env)),
            pool: conf.ipam_pool.clone(),
            family: family.into(),
            requested_address: requested.copied().map(net::address_bytes).unwrap_or_default(),
        };
        let step = if v4 {
            "allocating an IPv4 address"
        } else {
            "allocating an IPv6 address"
        };
        let allocation = match deps.ipam.allocate(request, timeout).await {
            Ok(a) => a,
            Err(e) if e.is(ipampb::ErrorReason::FamilyNotConfigured) => {
                if let Some(ip) = requested {
                    return Err(CniError::netconf(format!(
                        "requested address {ip}: svc-ipam pool {:?} has no range of its family",
                        conf.ipam_pool
                    )));
                }
                tracing::debug!(pool = %conf.ipam_pool, ?family, "the pool has no range of this family");
                return Ok(None);
            }
            Err(e) => return Err(ipam_error(step, &e)),
        };
        let bad = |what: &str| {
            CniError::new(
                codes::IPAM,
                format!("{step}: svc-ipam returned {what} in {allocation:?}"),
            )
        };
        let address = net::address_from_bytes(&allocation.address).map_err(|_| bad("an invalid address"))?;
        let gateway = net::address_from_bytes(&allocation.gateway).map_err(|_| bad("an invalid gateway"))?;
        let prefix = u8::try_from(allocation.prefix_length).map_err(|_| bad("an invalid prefix length"))?;
        let net = IpNet::new(address, prefix).map_err(|_| bad("an invalid prefix length"))?;
        if address.is_ipv4() != v4 || gateway.is_ipv4() != v4 {
            return Err(bad("an address of the wrong family"));
        }
        Ok(Some((PodAddress { address: net, gateway }, allocation.pool.clone())))
    };
    let (v4, v6) = future::join(one(ipampb::Family::Ipv4, true), one(ipampb::Family::Ipv6, false)).await;
    let mut out = Addresses {
        pod: Vec::new(),
        pools: Vec::new(),
        extra_routes: Vec::new(),
    };
    for (address, pool) in [v4?, v6?].into_iter().flatten() {
        out.pod.push(address);
        out.pools.push(pool);
    }
    if out.pod.is_empty() {
        return Err(CniError::new(
            codes::IPAM,
            format!(
                "svc-ipam pool {:?} has neither an IPv4 nor an IPv6 range",
                conf.ipam_pool
            ),
        ));
    }
    Ok(out)
}

async fn delegated_add(
    deps: Deps<'_>,
    inv: &Invocation,
    plugin: &str,
    deadline: Deadline,
) -> Result<Addresses, CniError> {
    let step = format!("delegated IPAM plugin {plugin} ADD");
    let timeout = deadline.remaining(&step)?;
    let stdout = deps
        .delegate
        .exec(plugin, Command::Add, &[], &inv.stdin, timeout)
        .await?;
    let value: Value = serde_json::from_slice(&stdout)
        .map_err(|e| CniError::new(codes::DELEGATED_IPAM, format!("{step}: its output is not JSON: {e}")))?;
    let result = CniResult::parse(&value, &step).map_err(|e| CniError::new(codes::DELEGATED_IPAM, e.msg))?;
    let mut out = Addresses {
        pod: Vec::new(),
        pools: Vec::new(),
        extra_routes: result.routes.clone(),
    };
    for ip in &result.ips {
        let v4 = ip.address.addr().is_ipv4();
        if out.pod.iter().any(|a| a.address.addr().is_ipv4() == v4) {
            return Err(CniError::new(
                codes::DELEGATED_IPAM,
                format!(
                    "{step}: more than one {} address; rivet-cni takes one per family",
                    if v4 { "IPv4" } else { "IPv6" }
                ),
            ));
        }
        let gateway = ip.gateway.filter(|g| g.is_ipv4() == v4).ok_or_else(|| {
            CniError::new(
                codes::DELEGATED_IPAM,
                format!(
                    "{step}: {} has no gateway of its family; configure one (host-local: \"gateway\")",
                    ip.address
                ),
            )
        })?;
        out.pod.push(PodAddress {
            address: ip.address,
            gateway,
        });
        out.pools.push(String::new());
    }
    if out.pod.is_empty() {
        return Err(CniError::new(
            codes::DELEGATED_IPAM,
            format!("{step}: its result has no address"),
        ));
    }
    Ok(out)
}

/// Undoes a failed ADD with a fresh budget; the problems, if any.
async fn undo_add(deps: Deps<'_>, inv: &Invocation, undo: Undo) -> Result<(), String> {
    let deadline = Deadline::after(CLEANUP_BUDGET);
    let env = &inv.env;
    let mut problems = Vec::new();
    let mut endpoint_gone = true;
    if undo.endpoint {
        match deadline.remaining("undo: deleting the endpoint") {
            Ok(t) => match deps
                .endpoints
                .delete(env.container_id.clone(), env.ifname.clone(), t)
                .await
            {
                Ok(deleted) => tracing::info!(?deleted, "undo: endpoint deleted"),
                Err(s) => {
                    endpoint_gone = false;
                    problems.push(format!("deleting the endpoint: {}", s.message()));
                }
            },
            Err(e) => {
                endpoint_gone = false;
                problems.push(e.msg);
            }
        }
    }
    if let Some(name) = &undo.veth {
        let deleted = deadline
            .bound("undo: deleting the veth", async {
                deps.netlink.delete_host_link(name).await.map_err(netlink_error)
            })
            .await;
        match deleted {
            Ok(existed) => tracing::info!(host = %name, existed, "undo: veth deleted"),
            Err(e) => problems.push(e.msg),
        }
    }
    if !endpoint_gone {
        problems.push("addresses kept until the endpoint is gone (DEL releases them)".into());
    } else if undo.ipam {
        match deadline.remaining("undo: releasing addresses") {
            Ok(t) => match deps.ipam.release(owner(env), t).await {
                Ok(released) => tracing::info!(
                    released = ?released.iter().map(|a| net::format_address(&a.address)).collect::<Vec<_>>(),
                    "undo: addresses released"
                ),
                Err(s) => problems.push(format!("releasing addresses: {}", s.message())),
            },
            Err(e) => problems.push(e.msg),
        }
    } else if let Some(plugin) = &undo.delegated {
        let released = deadline
            .bound(
                "undo: delegated IPAM DEL",
                deps.delegate
                    .exec(plugin, Command::Del, &[], &inv.stdin, CLEANUP_BUDGET),
            )
            .await;
        if let Err(e) = released {
            problems.push(format!("delegated IPAM plugin {plugin} DEL: {}", e.msg));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        tracing::error!(?problems, "undoing the failed ADD left something behind");
        Err(problems.join("; "))
    }
}

/// The host-side veth of a previous plugin's result: the first interface
/// without sandbox that is a veth in the node namespace.
async fn chained_host_link(deps: Deps<'_>, prev: &CniResult, deadline: Deadline) -> Result<Option<Link>, CniError> {
    for candidate in prev.interfaces.iter().filter(|i| i.sandbox.is_none()) {
        let link = deadline
            .bound("looking up the host interface", async {
                deps.netlink.host_link(&candidate.name).await.map_err(netlink_error)
            })
            .await?;
        if let Some(link) = link
            && link.kind.as_deref() == Some("veth")
        {
            return Ok(Some(link));
        }
    }
    Ok(None)
}

async fn add_chained(
    deps: Deps<'_>,
    inv: &Invocation,
    prev_value: &Value,
    deadline: Deadline,
) -> Result<Value, CniError> {
    let (env, conf) = (&inv.env, &inv.conf);
    let netns = netns_of(env)?;
    let prev = CniResult::parse(prev_value, "prevResult")?;
    let index = prev.container_interface(&env.ifname).ok_or_else(|| {
        CniError::netconf(format!(
            "prevResult: no interface {} with a sandbox (chaining needs the previous plugin's container interface)",
            env.ifname
        ))
    })?;
    let ips = prev.ips_of(index);
    if ips.is_empty() {
        return Err(CniError::netconf(format!("prevResult: no address on {}", env.ifname)));
    }
    for family in [true, false] {
        if ips.iter().filter(|ip| ip.address.addr().is_ipv4() == family).count() > 1 {
            return Err(CniError::netconf(format!(
                "prevResult: more than one {} address on {}; rivet-cni takes one per family",
                if family { "IPv4" } else { "IPv6" },
                env.ifname
            )));
        }
    }
    readiness(deps, conf, false, deadline).await?;
    let host = chained_host_link(deps, &prev, deadline).await?.ok_or_else(|| {
        CniError::netconf("prevResult: no interface without sandbox is a veth in this namespace (the host side)")
    })?;
    let mac = match &prev.interfaces[index].mac {
        Some(mac) => parse_mac(mac).ok_or_else(|| {
            CniError::netconf(format!(
                "prevResult: interface {} has MAC {mac:?}, not aa:bb:cc:dd:ee:ff",
                env.ifname
            ))
        })?,
        None => {
            let state = deadline
                .bound("reading the container interface", async {
                    deps.netlink
                        .inspect_pod(netns, &env.ifname)
                        .await
                        .map_err(netlink_error)
                })
                .await?
                .ok_or_else(|| CniError::netconf(format!("{} does not exist in {}", env.ifname, netns.display())))?;
            state
                .link
                .mac
                .ok_or_else(|| CniError::new(codes::NETLINK, format!("{} has no MAC address", env.ifname)))?
        }
    };
    let request = eppb::CreateEndpointRequest {
        container_id: env.container_id.clone(),
        interface: env.ifname.clone(),
        netns_path: netns.display().to_string(),
        host_interface: host.name.clone(),
        host_ifindex: host.index,
        addresses: ips
            .iter()
            .map(|ip| eppb::EndpointAddress {
                address: net::address_bytes(ip.address.addr()),
                ipam_pool: String::new(),
            })
            .collect(),
        mac: mac.to_vec(),
        pod_namespace: env.args.pod_namespace.clone().unwrap_or_default(),
        pod_name: env.args.pod_name.clone().unwrap_or_default(),
        pod_uid: env.args.pod_uid.clone().unwrap_or_default(),
        labels: conf.labels.clone(),
        r#async: false,
        named_ports: named_ports(conf),
        kind: endpoint_kind(conf).into(),
    };
    match create_endpoint(deps, request, deadline).await {
        Ok(endpoint) => {
            tracing::info!(endpoint_id = endpoint.id, host = %host.name, "chained endpoint ready");
        }
        Err(err) => {
            let undo = Undo {
                endpoint: true,
                ..Undo::default()
            };
            let cleanup = undo_add(deps, inv, undo).await;
            return Err(match cleanup {
                Ok(()) => err,
                Err(problems) => err.with_details(format!("undoing the ADD failed too: {problems}")),
            });
        }
    }
    let mut out = prev_value.clone();
    if out.get("cniVersion").is_none() {
        out["cniVersion"] = Value::String(conf.cni_version.as_str().into());
    }
    Ok(out)
}

// --------------------------------------------------------------------- DEL --

/// Whether a prevResult came from another plugin Rivet is chained after: it
/// has a host-side interface and none of them is Rivet's own veth.
fn is_chained(prev: &CniResult, host_name: &str) -> bool {
    prev.interfaces.iter().any(|i| i.sandbox.is_none()) && !prev.interfaces.iter().any(|i| i.name == host_name)
}

fn parse_prev_leniently(conf: &NetConf) -> Option<CniResult> {
    let prev = conf.prev_result.as_ref()?;
    match CniResult::parse(prev, "prevResult") {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(error = %e, "ignoring a prevResult that does not parse");
            None
        }
    }
}

async fn del(deps: Deps<'_>, inv: &Invocation, deadline: Deadline) -> Result<(), CniError> {
    let (env, conf) = (&inv.env, &inv.conf);
    let host_name = host_ifname(&conf.host_interface_prefix, &env.container_id, &env.ifname);
    let chained = parse_prev_leniently(conf).is_some_and(|p| is_chained(&p, &host_name));
    let mut errors: Vec<CniError> = Vec::new();

    let endpoint = async {
        let timeout = deadline.remaining("deleting the endpoint")?;
        deps.endpoints
            .delete(env.container_id.clone(), env.ifname.clone(), timeout)
            .await
            .map_err(|e| endpoint_error("deleting the endpoint", &e))
    }
    .instrument(tracing::info_span!("cni.endpoint.delete"))
    .await;
    let endpoint_gone = match endpoint {
        Ok(deleted) => {
            tracing::info!(?deleted, "endpoint deleted");
            true
        }
        Err(e) => {
            errors.push(e);
            false
        }
    };
    if chained {
        tracing::info!("chained after another plugin: only the endpoint is Rivet's");
        return first_error(errors);
    }

    let veth = deadline
        .bound("deleting the veth", async {
            deps.netlink.delete_host_link(&host_name).await.map_err(netlink_error)
        })
        .instrument(tracing::info_span!("cni.netlink.delete", host = %host_name))
        .await;
    match veth {
        Ok(existed) => tracing::info!(host = %host_name, existed, "veth deleted"),
        Err(e) => errors.push(e),
    }

    if !endpoint_gone {
        tracing::warn!("keeping the addresses until svc-endpoint deleted the endpoint");
    } else if let Some(delegated) = &conf.ipam {
        let step = format!("delegated IPAM plugin {} DEL", delegated.plugin_type);
        let released = async {
            let timeout = deadline.remaining(&step)?;
            deps.delegate
                .exec(&delegated.plugin_type, Command::Del, &[], &inv.stdin, timeout)
                .await
        }
        .instrument(tracing::info_span!("cni.ipam.delegate", plugin = %delegated.plugin_type))
        .await;
        if let Err(e) = released {
            errors.push(e);
        }
    } else {
        let released = async {
            let timeout = deadline.remaining("releasing addresses")?;
            deps.ipam
                .release(owner(env), timeout)
                .await
                .map_err(|e| ipam_error("releasing addresses", &e))
        }
        .instrument(tracing::info_span!("cni.ipam.release"))
        .await;
        match released {
            Ok(released) => tracing::info!(
                released = ?released.iter().map(|a| net::format_address(&a.address)).collect::<Vec<_>>(),
                "addresses released"
            ),
            Err(e) => errors.push(e),
        }
    }
    first_error(errors)
}

/// The first error, with the others in its details.
fn first_error(mut errors: Vec<CniError>) -> Result<(), CniError> {
    if errors.is_empty() {
        return Ok(());
    }
    let first = errors.remove(0);
    if errors.is_empty() {
        return Err(first);
    }
    let rest: Vec<String> = errors.iter().map(|e| format!("code {}: {}", e.code, e.msg)).collect();
    let details = if first.details.is_empty() {
        format!("also: {}", rest.join("; "))
    } else {
        format!("{}; also: {}", first.details, rest.join("; "))
    };
    Err(first.with_details(details))
}

// ------------------------------------------------------------------- CHECK --

fn check_failed(msg: impl Into<String>) -> CniError {
    CniError::new(codes::CHECK_FAILED, msg)
}

async fn check(deps: Deps<'_>, inv: &Invocation, deadline: Deadline) -> Result<(), CniError> {
    let (env, conf) = (&inv.env, &inv.conf);
    let netns = netns_of(env)?;
    let prev_value = conf
        .prev_result
        .as_ref()
        .ok_or_else(|| CniError::netconf("CHECK needs prevResult (the result of ADD)"))?;
    let prev = CniResult::parse(prev_value, "prevResult")?;
    let host_name = host_ifname(&conf.host_interface_prefix, &env.container_id, &env.ifname);
    let chained = is_chained(&prev, &host_name);
    let index = prev
        .container_interface(&env.ifname)
        .ok_or_else(|| check_failed(format!("prevResult has no container interface {}", env.ifname)))?;

    if let (Some(delegated), false) = (&conf.ipam, chained) {
        let step = format!("delegated IPAM plugin {} CHECK", delegated.plugin_type);
        let timeout = deadline.remaining(&step)?;
        deps.delegate
            .exec(&delegated.plugin_type, Command::Check, &[], &inv.stdin, timeout)
            .await?;
    }

    // The host side.
    let host = if chained {
        chained_host_link(deps, &prev, deadline)
            .await?
            .ok_or_else(|| check_failed("the host-side veth of prevResult is missing"))?
    } else {
        let link = deadline
            .bound("looking up the host interface", async {
                deps.netlink.host_link(&host_name).await.map_err(netlink_error)
            })
            .await?
            .ok_or_else(|| {
                check_failed(format!(
                    "host interface {host_name} (the node side of {}'s veth) is missing",
                    env.ifname
                ))
            })?;
        if link.kind.as_deref() != Some("veth") {
            return Err(check_failed(format!(
                "host interface {host_name} is a {}, not a veth",
                link.kind.as_deref().unwrap_or("device without kind")
            )));
        }
        if !link.up {
            return Err(check_failed(format!("host interface {host_name} is down")));
        }
        link
    };

    // The container interface.
    let pod = deadline
        .bound("reading the container interface", async {
            deps.netlink
                .inspect_pod(netns, &env.ifname)
                .await
                .map_err(netlink_error)
        })
        .await?
        .ok_or_else(|| check_failed(format!("interface {} is missing in {}", env.ifname, netns.display())))?;
    if let (Some(expected), Some(actual)) = (&prev.interfaces[index].mac, pod.link.mac)
        && !expected.eq_ignore_ascii_case(&format_mac(&actual))
    {
        return Err(check_failed(format!(
            "{} has MAC {}, ADD reported {expected}",
            env.ifname,
            format_mac(&actual)
        )));
    }
    if !pod.link.up {
        return Err(check_failed(format!("{} is down", env.ifname)));
    }
    let expected_ips = prev.ips_of(index);
    for ip in &expected_ips {
        if !pod.addresses.contains(&ip.address) {
            return Err(check_failed(format!(
                "{} lacks address {} (it has {:?})",
                env.ifname,
                ip.address,
                pod.addresses.iter().map(ToString::to_string).collect::<Vec<_>>()
            )));
        }
        if chained {
            continue;
        }
        if let Some(gw) = ip.gateway {
            let default = pod
                .routes
                .iter()
                .any(|r| r.dst.prefix_len() == 0 && r.dst.addr().is_ipv4() == gw.is_ipv4() && r.gw == Some(gw));
            if !default {
                return Err(check_failed(format!(
                    "the container has no default route via {gw} for {}",
                    ip.address
                )));
            }
        }
    }

    // The endpoint.
    let timeout = deadline.remaining("reading the endpoint")?;
    let endpoint = deps
        .endpoints
        .get(env.container_id.clone(), env.ifname.clone(), timeout)
        .await
        .map_err(|e| endpoint_error("reading the endpoint", &e))?
        .ok_or_else(|| {
            check_failed(format!(
                "svc-endpoint has no endpoint for container {} interface {}",
                env.container_id, env.ifname
            ))
        })?;
    let state = eppb::EndpointState::try_from(endpoint.state).unwrap_or(eppb::EndpointState::Unspecified);
    if state != eppb::EndpointState::Ready {
        let mut msg = format!("endpoint {} is {}, not ready", endpoint.id, state.as_str_name());
        if !endpoint.last_error.is_empty() {
            msg.push_str(&format!(" (last error: {})", endpoint.last_error));
        }
        return Err(check_failed(msg));
    }
    if endpoint.host_ifindex != host.index {
        return Err(check_failed(format!(
            "endpoint {} is on host interface index {}, but {} has index {}",
            endpoint.id, endpoint.host_ifindex, host.name, host.index
        )));
    }
    for ip in &expected_ips {
        let address = ip.address.addr();
        if !endpoint
            .addresses
            .iter()
            .any(|a| a.address == net::address_bytes(address))
        {
            return Err(check_failed(format!(
                "endpoint {} does not hold {address}",
                endpoint.id
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------- GC --

async fn gc(deps: Deps<'_>, inv: &Invocation, deadline: Deadline) -> Result<(), CniError> {
    let conf = &inv.conf;
    let Some(valid) = &conf.valid_attachments else {
        tracing::info!("GC without cni.dev/valid-attachments: nothing is removed");
        return Ok(());
    };
    let valid: HashSet<(&str, &str)> = valid
        .iter()
        .map(|Attachment { container_id, ifname }| (container_id.as_str(), ifname.as_str()))
        .collect();
    let mut errors = Vec::new();
    let mut released = 0usize;

    let timeout = deadline.remaining("listing endpoints")?;
    let (endpoints, restore_complete) = deps
        .endpoints
        .list(timeout)
        .await
        .map_err(|e| endpoint_error("listing endpoints", &e))?;
    if !restore_complete {
        return Err(CniError::new(
            codes::TRY_AGAIN_LATER,
            "svc-endpoint is still restoring its endpoints; GC must wait for the complete list",
        ));
    }
    // Whose endpoints this network may collect: with svc-ipam, those holding
    // an address of its pool; with a delegated plugin, those on a host veth
    // of its prefix whose addresses svc-ipam does not manage.
    let ours = |ep: &eppb::Endpoint| match conf.ipam {
        None => ep.addresses.iter().any(|a| a.ipam_pool == conf.ipam_pool),
        Some(_) => {
            ep.host_interface.starts_with(&conf.host_interface_prefix)
                && ep.addresses.iter().all(|a| a.ipam_pool.is_empty())
        }
    };
    let mut kept_addresses: HashSet<Vec<u8>> = HashSet::new();
    // The attachments whose endpoint GC removed.
    let mut removed: Vec<Attachment> = Vec::new();
    for ep in &endpoints {
        if !ours(ep) || valid.contains(&(ep.container_id.as_str(), ep.interface.as_str())) {
            continue;
        }
        tracing::info!(endpoint_id = ep.id, container = %ep.container_id, interface = %ep.interface, "GC: stale endpoint");
        let timeout = deadline.remaining("deleting a stale endpoint")?;
        match deps.endpoints.delete_id(ep.id, timeout).await {
            Ok(_) => removed.push(Attachment {
                container_id: ep.container_id.clone(),
                ifname: ep.interface.clone(),
            }),
            Err(e) => {
                errors.push(endpoint_error("deleting a stale endpoint", &e));
                // Its addresses stay reserved while the endpoint exists.
                kept_addresses.extend(ep.addresses.iter().map(|a| a.address.clone()));
                continue;
            }
        }
        let expected = host_ifname(&conf.host_interface_prefix, &ep.container_id, &ep.interface);
        if ep.host_interface == expected {
            let deleted = deadline
                .bound("deleting a stale veth", async {
                    deps.netlink.delete_host_link(&expected).await.map_err(netlink_error)
                })
                .await;
            if let Err(e) = deleted {
                errors.push(e);
            }
        }
    }
    for ep in &endpoints {
        if valid.contains(&(ep.container_id.as_str(), ep.interface.as_str())) {
            kept_addresses.extend(ep.addresses.iter().map(|a| a.address.clone()));
        }
    }

    if let Some(delegated) = &conf.ipam {
        // The delegated plugin holds the removed attachments' addresses.
        if let Err(e) = delegated_gc(deps, inv, &delegated.plugin_type, &removed, deadline).await {
            errors.push(e);
        }
    } else {
        let timeout = deadline.remaining("listing allocations")?;
        let allocations = deps
            .ipam
            .allocations(conf.ipam_pool.clone(), timeout)
            .await
            .map_err(|e| ipam_error("listing allocations", &e))?;
        for a in allocations {
            let Some(o) = &a.owner else { continue };
            if valid.contains(&(o.container_id.as_str(), o.interface.as_str())) || kept_addresses.contains(&a.address) {
                continue;
            }
            // A veth of an ADD that died before its endpoint existed.
            if crate::env::check_container_id(&o.container_id).is_ok() && crate::env::check_ifname(&o.interface).is_ok()
            {
                let name = host_ifname(&conf.host_interface_prefix, &o.container_id, &o.interface);
                let deleted = deadline
                    .bound("deleting a stale veth", async {
                        deps.netlink.delete_host_link(&name).await.map_err(netlink_error)
                    })
                    .await;
                if let Err(e) = deleted {
                    errors.push(e);
                    continue;
                }
            }
            let timeout = deadline.remaining("releasing a stale address")?;
            match deps
                .ipam
                .release_address(a.pool.clone(), a.address.clone(), timeout)
                .await
            {
                Ok(r) => released += r.len(),
                Err(e) => errors.push(ipam_error("releasing a stale address", &e)),
            }
        }
    }
    tracing::info!(
        removed_endpoints = removed.len(),
        released,
        errors = errors.len(),
        "GC done"
    );
    first_error(errors)
}

/// Releases what a delegated IPAM plugin holds for the attachments GC
/// removed: its own GC when it speaks CNI 1.1 (then it also finds addresses
/// of ADDs that died before their endpoint existed); else its DEL for each
/// removed attachment (`CNI_CONTAINERID`, `CNI_IFNAME`, no netns), in the
/// newest version both support (DEL means the same in all of them).
async fn delegated_gc(
    deps: Deps<'_>,
    inv: &Invocation,
    plugin: &str,
    removed: &[Attachment],
    deadline: Deadline,
) -> Result<(), CniError> {
    let timeout = deadline.remaining("asking the delegated IPAM plugin its versions")?;
    let request = serde_json::json!({"cniVersion": inv.conf.cni_version.as_str()}).to_string();
    let out = deps
        .delegate
        .exec(plugin, Command::Version, &[], request.as_bytes(), timeout)
        .await?;
    let supported: Vec<String> = serde_json::from_slice::<Value>(&out)
        .ok()
        .and_then(|v| serde_json::from_value(v.get("supportedVersions")?.clone()).ok())
        .unwrap_or_default();
    if supported.iter().any(|v| v == CniVersion::V1_1_0.as_str()) {
        let timeout = deadline.remaining("delegated IPAM GC")?;
        deps.delegate
            .exec(plugin, Command::Gc, &[], &inv.stdin, timeout)
            .await?;
        return Ok(());
    }
    let Some(version) = CniVersion::ALL
        .into_iter()
        .rev()
        .find(|v| supported.iter().any(|s| s == v.as_str()))
    else {
        return Err(CniError::new(
            codes::DELEGATED_IPAM,
            format!(
                "delegated IPAM plugin {plugin} supports none of rivet-cni's versions (it says {:?}); \
                 the addresses of {} removed attachments stay allocated",
                supported,
                removed.len()
            ),
        ));
    };
    let mut conf: Value = serde_json::from_slice(&inv.stdin)
        .map_err(|e| CniError::decode(format!("re-reading the network configuration: {e}")))?;
    conf["cniVersion"] = version.as_str().into();
    let stdin = conf.to_string();
    let mut errors = Vec::new();
    for Attachment { container_id, ifname } in removed {
        let timeout = deadline.remaining("delegated IPAM DEL of a stale attachment")?;
        let env = [
            ("CNI_CONTAINERID", container_id.clone()),
            ("CNI_IFNAME", ifname.clone()),
            ("CNI_NETNS", String::new()),
        ];
        match deps
            .delegate
            .exec(plugin, Command::Del, &env, stdin.as_bytes(), timeout)
            .await
        {
            Ok(_) => {
                tracing::info!(container = %container_id, interface = %ifname, plugin, "GC: delegated addresses released")
            }
            Err(e) => errors.push(e),
        }
    }
    first_error(errors)
}

#[cfg(test)]
mod tests;
