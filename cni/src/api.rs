//! The outside world of one invocation, behind traits so the verbs
//! ([`crate::plugin`]) are testable without a kernel or daemons: netlink
//! ([`Netlink`], real: [`crate::netlink::RtNetlink`]), svc-ipam
//! ([`IpamApi`]) and svc-endpoint ([`EndpointApi`]) (real:
//! [`crate::grpc`]), and a delegated IPAM plugin ([`DelegateExec`], real:
//! [`crate::delegate::ExecDelegate`]).

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use futures::future::BoxFuture;
use ipnet::IpNet;
use rivet_common::grpc::RpcError;
use rivet_proto::endpoint::v1 as eppb;
use rivet_proto::ipam::v1 as ipampb;

use crate::env::Command;
use crate::error::CniError;

/// A link as netlink reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Interface index in its namespace.
    pub index: u32,
    /// Name.
    pub name: String,
    /// MAC address, when it has one.
    pub mac: Option<[u8; 6]>,
    /// MTU.
    pub mtu: u32,
    /// Administratively up.
    pub up: bool,
    /// `IFLA_INFO_KIND` (`veth`, `dummy`, ...), when it has one.
    pub kind: Option<String>,
}

/// A veth pair to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VethRequest {
    /// Host-side name, in the node namespace.
    pub host_name: String,
    /// Container-side name (`CNI_IFNAME`), created directly in `netns`.
    pub peer_name: String,
    /// The container's network namespace (`CNI_NETNS`).
    pub netns: std::path::PathBuf,
    /// MTU of both ends.
    pub mtu: u32,
}

/// The two ends of a created veth pair, both up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Veth {
    /// Host side (node namespace).
    pub host: Link,
    /// Container side (container namespace).
    pub peer: Link,
}

/// One address of the container interface and the gateway it routes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodAddress {
    /// Address with the pool's prefix length (added with `noprefixroute`,
    /// IPv6 also `nodad`).
    pub address: IpNet,
    /// Gateway of the address's family: on no interface, answered by the
    /// datapath; the pod gets a link route to it.
    pub gateway: IpAddr,
}

/// A route in the container, through the gateway of its family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodRoute {
    /// Destination (`0.0.0.0/0` and `::/0` for the default routes).
    pub dst: IpNet,
    /// Next hop.
    pub gw: IpAddr,
}

/// What to configure on the container interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodConfig {
    /// Index of the container interface in its namespace.
    pub ifindex: u32,
    /// Its addresses, at most one per family.
    pub addresses: Vec<PodAddress>,
    /// Routes, added after the link routes to the gateways; each with the
    /// family's address as source.
    pub routes: Vec<PodRoute>,
}

/// A route read back from a namespace (main table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteEntry {
    /// Destination.
    pub dst: IpNet,
    /// Next hop, if any.
    pub gw: Option<IpAddr>,
    /// Output interface, if any.
    pub oif: Option<u32>,
}

/// The container interface as found by CHECK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodState {
    /// The interface.
    pub link: Link,
    /// Its addresses.
    pub addresses: Vec<IpNet>,
    /// Routes of the namespace's main table.
    pub routes: Vec<RouteEntry>,
}

/// A netlink (or namespace) operation that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{action}: {reason}")]
pub struct NetlinkError {
    /// What was being done, with the names involved.
    pub action: String,
    /// Why it failed.
    pub reason: String,
    /// The errno, when the kernel gave one.
    pub errno: Option<i32>,
}

impl NetlinkError {
    /// An error with an errno.
    pub fn os(action: impl Into<String>, errno: i32) -> Self {
        Self {
            action: action.into(),
            reason: std::io::Error::from_raw_os_error(errno).to_string(),
            errno: Some(errno),
        }
    }

    /// An error without an errno.
    pub fn other(action: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            action: action.into(),
            reason: reason.into(),
            errno: None,
        }
    }

    /// Whether the kernel said "exists".
    pub fn is_exists(&self) -> bool {
        self.errno == Some(libc::EEXIST)
    }
}

/// Netlink in the node namespace (where rivet-cni runs) and in container
/// namespaces.
pub trait Netlink: Send + Sync {
    /// Checks that `path` is a network namespace (not merely a file).
    fn check_netns<'a>(&'a self, path: &'a Path) -> BoxFuture<'a, Result<(), NetlinkError>>;
    /// The node-namespace link called `name`, if any.
    fn host_link<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<Link>, NetlinkError>>;
    /// Creates a veth pair, the peer directly in the container namespace
    /// under its final name; both ends up with the MTU.
    fn create_veth<'a>(&'a self, request: &'a VethRequest) -> BoxFuture<'a, Result<Veth, NetlinkError>>;
    /// Addresses, gateway link routes and routes on the container interface.
    fn configure_pod<'a>(&'a self, netns: &'a Path, config: &'a PodConfig) -> BoxFuture<'a, Result<(), NetlinkError>>;
    /// `<address>/32` and `/128` routes via the host veth in the node namespace.
    fn add_host_routes<'a>(
        &'a self,
        host_ifindex: u32,
        addresses: &'a [IpAddr],
    ) -> BoxFuture<'a, Result<(), NetlinkError>>;
    /// Deletes the node-namespace link `name` (its veth peer goes with it);
    /// whether it existed.
    fn delete_host_link<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, NetlinkError>>;
    /// The container interface `ifname` in `netns`, its addresses and the
    /// namespace's routes; `None` when there is no such interface.
    fn inspect_pod<'a>(
        &'a self,
        netns: &'a Path,
        ifname: &'a str,
    ) -> BoxFuture<'a, Result<Option<PodState>, NetlinkError>>;
}

/// A failed svc-ipam call, with the reason svc-ipam sent.
pub type IpamError = RpcError<ipampb::ErrorReason>;
/// What an svc-ipam call returns.
pub type IpamResult<T> = Result<T, IpamError>;
/// A failed svc-endpoint call, with the reason svc-endpoint sent.
pub type EndpointError = RpcError<eppb::ErrorReason>;
/// What an svc-endpoint call returns.
pub type EndpointResult<T> = Result<T, EndpointError>;

/// svc-ipam. Every call has its own deadline.
pub trait IpamApi: Send + Sync {
    /// Reachable, and `pool` exists (`List` of the pool).
    fn ready<'a>(&'a self, pool: &'a str, timeout: Duration) -> BoxFuture<'a, IpamResult<()>>;
    /// `Allocate`.
    fn allocate(
        &self,
        request: ipampb::AllocateRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, IpamResult<ipampb::Allocation>>;
    /// `Release` of everything `owner` holds; the released allocations.
    fn release(&self, owner: ipampb::Owner, timeout: Duration) -> BoxFuture<'_, IpamResult<Vec<ipampb::Allocation>>>;
    /// `ReleaseAddress` of one address (its wire bytes) of `pool`.
    fn release_address(
        &self,
        pool: String,
        address: Vec<u8>,
        timeout: Duration,
    ) -> BoxFuture<'_, IpamResult<Vec<ipampb::Allocation>>>;
    /// Every allocation of `pool`.
    fn allocations(&self, pool: String, timeout: Duration) -> BoxFuture<'_, IpamResult<Vec<ipampb::Allocation>>>;
}

/// svc-endpoint. Every call has its own deadline.
pub trait EndpointApi: Send + Sync {
    /// Reachable (`GetInfo`).
    fn ready(&self, timeout: Duration) -> BoxFuture<'_, EndpointResult<()>>;
    /// `CreateEndpoint`; the server gets `timeout` as the call's deadline.
    fn create(
        &self,
        request: eppb::CreateEndpointRequest,
        timeout: Duration,
    ) -> BoxFuture<'_, EndpointResult<eppb::Endpoint>>;
    /// `DeleteEndpoint` by container id and interface; ids deleted.
    fn delete(
        &self,
        container_id: String,
        interface: String,
        timeout: Duration,
    ) -> BoxFuture<'_, EndpointResult<Vec<u32>>>;
    /// `DeleteEndpoint` by id; ids deleted.
    fn delete_id(&self, id: u32, timeout: Duration) -> BoxFuture<'_, EndpointResult<Vec<u32>>>;
    /// `GetEndpoint` by container id and interface; `None` when unknown.
    fn get(
        &self,
        container_id: String,
        interface: String,
        timeout: Duration,
    ) -> BoxFuture<'_, EndpointResult<Option<eppb::Endpoint>>>;
    /// `ListEndpoints`: every endpoint, and whether svc-endpoint's restore
    /// is complete (before that the list may miss endpoints).
    fn list(&self, timeout: Duration) -> BoxFuture<'_, EndpointResult<(Vec<eppb::Endpoint>, bool)>>;
}

/// Runs a delegated IPAM plugin the way libcni does: the executable `plugin`
/// from `CNI_PATH`, the invocation's environment with `CNI_COMMAND` set to
/// `command`, the invocation's stdin.
pub trait DelegateExec: Send + Sync {
    /// The plugin's stdout on success; its error (code and message as it
    /// printed them) otherwise. The plugin gets this invocation's
    /// environment with `CNI_COMMAND` set, and `env` on top (GC names each
    /// attachment it releases with `CNI_CONTAINERID` and `CNI_IFNAME`).
    fn exec<'a>(
        &'a self,
        plugin: &'a str,
        command: Command,
        env: &'a [(&'static str, String)],
        stdin: &'a [u8],
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Vec<u8>, CniError>>;
}
