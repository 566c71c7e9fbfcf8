//! Who claims a prefix, the entries and deltas of the cache, and the
//! text forms of prefixes.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use rivet_proto::identity::v1 as pb;
use rivet_proto::net;

use crate::backend::IpNamedPort;

/// Who claims a prefix. The order is the precedence: a smaller variant wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpcacheSource {
    /// `0.0.0.0/0`, `::/0` → world. Server-owned.
    Reserved,
    /// An endpoint of this node; published to the store.
    LocalEndpoint,
    /// Another node's underlay address → remote-node, from the node
    /// registry. Server-owned.
    Node,
    /// Another node's entry learned from the store. Server-owned.
    KvStore,
    /// From the Kubernetes API (svc-k8s-sync); node-local.
    Kubernetes,
    /// A node-local CIDR identity; in-process callers only.
    Cidr,
}

impl IpcacheSource {
    /// Every source, by precedence.
    pub const ALL: [IpcacheSource; 6] = [
        Self::Reserved,
        Self::LocalEndpoint,
        Self::Node,
        Self::KvStore,
        Self::Kubernetes,
        Self::Cidr,
    ];

    /// From the protobuf enum; `None` for UNSPECIFIED and unknown values.
    pub fn from_proto(value: i32) -> Option<Self> {
        match pb::IpcacheSource::try_from(value).ok()? {
            pb::IpcacheSource::Unspecified => None,
            pb::IpcacheSource::Reserved => Some(Self::Reserved),
            pb::IpcacheSource::LocalEndpoint => Some(Self::LocalEndpoint),
            pb::IpcacheSource::Node => Some(Self::Node),
            pb::IpcacheSource::Kvstore => Some(Self::KvStore),
            pb::IpcacheSource::Kubernetes => Some(Self::Kubernetes),
            pb::IpcacheSource::Cidr => Some(Self::Cidr),
        }
    }

    /// The protobuf enum.
    pub fn to_proto(self) -> pb::IpcacheSource {
        match self {
            Self::Reserved => pb::IpcacheSource::Reserved,
            Self::LocalEndpoint => pb::IpcacheSource::LocalEndpoint,
            Self::Node => pb::IpcacheSource::Node,
            Self::KvStore => pb::IpcacheSource::Kvstore,
            Self::Kubernetes => pb::IpcacheSource::Kubernetes,
            Self::Cidr => pb::IpcacheSource::Cidr,
        }
    }

    /// The protobuf name (`LOCAL_ENDPOINT`), for messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Reserved => "RESERVED",
            Self::LocalEndpoint => "LOCAL_ENDPOINT",
            Self::Node => "NODE",
            Self::KvStore => "KVSTORE",
            Self::Kubernetes => "KUBERNETES",
            Self::Cidr => "CIDR",
        }
    }

    /// Only the server itself may claim with it (never a caller, not even
    /// in-process).
    pub(super) fn server_only(self) -> bool {
        matches!(self, Self::Reserved | Self::Node | Self::KvStore)
    }
}

impl std::fmt::Display for IpcacheSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One claim on a prefix; the effective entry of a prefix is its claim of
/// the highest precedence.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IpcacheEntry {
    /// The prefix (host bits zero).
    pub prefix: IpNet,
    /// Its identity (non-zero).
    pub identity: u32,
    /// The node hosting the address (its underlay address), if any.
    pub host_ip: Option<IpAddr>,
    /// Pod namespace, for inspection; may be empty.
    pub pod_namespace: String,
    /// Pod name, for inspection; may be empty.
    pub pod_name: String,
    /// Who claims it.
    pub source: IpcacheSource,
    /// The node that published it (set by the cache for local claims).
    pub node_name: String,
    /// The pod's named container ports (validated by the gRPC handler).
    pub named_ports: Vec<IpNamedPort>,
}

impl IpcacheEntry {
    /// A claim with no host or pod.
    pub fn new(prefix: IpNet, identity: u32, source: IpcacheSource) -> Self {
        Self {
            prefix,
            identity,
            host_ip: None,
            pod_namespace: String::new(),
            pod_name: String::new(),
            source,
            node_name: String::new(),
            named_ports: Vec::new(),
        }
    }

    /// The protobuf message.
    pub fn to_proto(&self) -> pb::IpcacheEntry {
        pb::IpcacheEntry {
            prefix: Some(net::prefix_to_proto(self.prefix)),
            identity: self.identity,
            host_ip: self.host_ip.map(net::address_bytes).unwrap_or_default(),
            pod_namespace: self.pod_namespace.clone(),
            pod_name: self.pod_name.clone(),
            source: self.source.to_proto() as i32,
            node_name: self.node_name.clone(),
            named_ports: self
                .named_ports
                .iter()
                .map(|p| pb::NamedPort {
                    name: p.name.clone(),
                    protocol: p.protocol.clone(),
                    port: u32::from(p.port),
                })
                .collect(),
        }
    }
}

/// One change of the effective view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcacheDelta {
    /// The cache revision after this change (one per change, per process).
    pub revision: u64,
    /// The prefix that changed.
    pub prefix: IpNet,
    /// Its new effective entry; `None` when no claim is left.
    pub entry: Option<IpcacheEntry>,
    /// The trace context of the request that made the change (an
    /// `UpsertIp` or `DeleteIp` call inside a pod's trace), so that the push
    /// to svc-loader links to it; `None` for changes without one (the
    /// store's watch, restore, export off).
    pub cause: Option<rivet_common::telemetry::TraceLink>,
}

/// A prefix as the API prints it: always `address/length`.
///
/// ```
/// let p = "198.18.0.5".parse::<std::net::IpAddr>().unwrap().into();
/// assert_eq!(svc_identity::ipcache::prefix_text(&p), "198.18.0.5/32");
/// ```
pub fn prefix_text(prefix: &IpNet) -> String {
    format!("{}/{}", prefix.addr(), prefix.prefix_len())
}

/// A prefix as the store keys it: a bare address for a host prefix
/// (`198.18.0.2`), `address/length` otherwise (backend.rs).
pub fn store_ip(prefix: &IpNet) -> String {
    if prefix.prefix_len() == prefix.max_prefix_len() {
        prefix.addr().to_string()
    } else {
        prefix_text(prefix)
    }
}

/// Parses `address/length` or a bare address (a host prefix); host bits
/// must be zero.
///
/// ```
/// use svc_identity::ipcache::parse_prefix;
/// assert_eq!(parse_prefix("2001:2::/64").unwrap().to_string(), "2001:2::/64");
/// assert_eq!(parse_prefix("198.18.0.5").unwrap().to_string(), "198.18.0.5/32");
/// assert!(parse_prefix("198.18.0.5/24").unwrap_err().contains("host bits"));
/// ```
pub fn parse_prefix(text: &str) -> Result<IpNet, String> {
    if text.contains('/') {
        let net: IpNet = text
            .parse()
            .map_err(|_| format!("{text:?} is not an address/length prefix"))?;
        if net.trunc() != net {
            return Err(format!(
                "{text} has host bits set beyond /{} (the prefix is {})",
                net.prefix_len(),
                net.trunc()
            ));
        }
        Ok(net)
    } else {
        let addr: IpAddr = text
            .parse()
            .map_err(|_| format!("{text:?} is not an IP address or prefix"))?;
        Ok(IpNet::from(addr))
    }
}

/// The claims on one prefix, highest precedence first.
pub(super) type Claims = BTreeMap<IpcacheSource, IpcacheEntry>;
