//! Rust mirrors of the map layouts in `include/rivet.h` (the contract between
//! the datapath and every process using its maps). Every struct is
//! `#[repr(C)]` with the same field order, sizes and explicit padding as the
//! C struct; the tests here check sizes, field offsets and constants against
//! clang's view of `rivet.h`, and svc-loader's tests check the key and value
//! sizes of the maps in the compiled object.
//!
//! Byte order: addresses and ports are stored in network byte order (an IPv4
//! address is `u32::from_ne_bytes(addr.octets())`, a port `port.to_be()`);
//! every other integer is host order. The constructors and accessors here
//! take and return `std::net` types and host-order ports, so callers never
//! swap bytes themselves.
//!
//! LPM trie keys: aya's [`LpmTrie`](aya::maps::LpmTrie) takes
//! [`lpm_trie::Key<K>`](aya::maps::lpm_trie::Key) (a `u32` prefix length
//! followed by `K`), so the typed maps use the *data* part of the C keys:
//! [`IpcacheKeyData`] and [`PolicyKeyData`]. [`IpcacheKey`] and [`PolicyKey`]
//! are the whole C structs (prefix length included) and convert to and from
//! the aya key with `to_lpm` / `from_lpm`.
//!
//! [`legacy`]: the layouts of earlier ABIs that svc-loader migrates on upgrade.
//! [`LbSockRevKey`] / [`LbSockRev`]: socket-level load balancing's `lb_sock_rev`.

pub mod legacy;
mod socket_lb;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use aya::maps::lpm_trie::Key as LpmKey;
use rivet_common::labels::ReservedIdentity;
pub use socket_lb::{LB_SOCK_REV_F_DATAGRAM, LbSockRev, LbSockRevKey};

// ------------------------------------------------------------------ identities

// The numbers are rivet_common's (the one owner of identity numbers);
// rivet.h's `IDENTITY_*` are checked against them by clang in the tests.

/// Any peer identity (policy wildcard): identity 0, which no label set has
/// ([`IdentityScope::None`](rivet_common::identity::IdentityScope::None)).
pub const IDENTITY_ANY: u32 = 0;
/// The node itself ([`ReservedIdentity::Host`]).
pub const IDENTITY_HOST: u32 = ReservedIdentity::Host.id();
/// Everything outside the cluster; also any address missing from the
/// ipcache ([`ReservedIdentity::World`]).
pub const IDENTITY_WORLD: u32 = ReservedIdentity::World.id();
/// The other nodes of the cluster: their underlay addresses in the ipcache,
/// and the VNI of traffic a node sends from itself
/// ([`ReservedIdentity::RemoteNode`]).
pub const IDENTITY_REMOTE_NODE: u32 = ReservedIdentity::RemoteNode.id();

// ------------------------------------------------------------------- endpoints

/// Endpoints map key kind: the host-side ifindex (a program finds its own endpoint).
pub const EP_KEY_IFINDEX: u32 = 1;
/// Endpoints map key kind: an IPv4 address of the endpoint.
pub const EP_KEY_IPV4: u32 = 4;
/// Endpoints map key kind: an IPv6 address of the endpoint.
pub const EP_KEY_IPV6: u32 = 6;

/// Enforce ingress policy (traffic into the pod).
pub const EP_F_ENFORCE_INGRESS: u32 = 1 << 0;
/// Enforce egress policy (traffic out of the pod).
pub const EP_F_ENFORCE_EGRESS: u32 = 1 << 1;
/// Always allow traffic from the node (kubelet probes).
pub const EP_F_ALLOW_FROM_HOST: u32 = 1 << 2;
/// `EndpointInfo::ipv4` is set.
pub const EP_F_HAS_IPV4: u32 = 1 << 3;
/// `EndpointInfo::ipv6` is set.
pub const EP_F_HAS_IPV6: u32 = 1 << 4;
/// The endpoint has ingress prefixes in `ep_prefixes` (ipBlocks matched by address).
pub const EP_F_INGRESS_PREFIXES: u32 = 1 << 5;
/// The endpoint has egress prefixes in `ep_prefixes`.
pub const EP_F_EGRESS_PREFIXES: u32 = 1 << 6;

// ---------------------------------------------------------------------- policy

/// Prefix bits of a policy key that are always matched whole:
/// endpoint_id + identity + direction + protocol.
pub const POLICY_PREFIX_FIXED_BITS: u32 = 80;
/// All bits of a policy key (the fixed part plus the 16 port bits).
pub const POLICY_PREFIX_FULL_BITS: u32 = 96;
/// Flag in a policy key's `direction`: the entry matches the peer by address
/// (`identity` is the CIDR identity of the peer address's longest prefix in
/// `ep_prefixes`).
pub const POLICY_DIR_BY_ADDRESS: u8 = 0x80;

/// Bits of an `ep_prefixes` key before the address (endpoint id, direction,
/// family, pad).
pub const EP_PREFIX_FIXED_BITS: u32 = 64;

/// Policy verdict: allow.
pub const VERDICT_ALLOW: u8 = 1;
/// Policy verdict: deny (wins over allow).
pub const VERDICT_DENY: u8 = 2;

// ------------------------------------------------------------------- conntrack

/// Into the pod (`to_container`, tc egress of the host-side veth).
pub const DIR_INGRESS: u8 = 1;
/// Out of the pod (`from_container`, tc ingress of the host-side veth).
pub const DIR_EGRESS: u8 = 2;

/// TCP conntrack state: SYN seen.
pub const CT_TCP_SYN: u8 = 1;
/// TCP conntrack state: established.
pub const CT_TCP_ESTABLISHED: u8 = 2;
/// TCP conntrack state: FIN or RST seen.
pub const CT_TCP_CLOSING: u8 = 3;

/// Conntrack entry flag: a reply was seen.
pub const CT_F_SEEN_REPLY: u8 = 1 << 0;
/// Conntrack entry flag: the opening side is closing.
pub const CT_F_CLOSING_FWD: u8 = 1 << 1;
/// Conntrack entry flag: the replying side is closing.
pub const CT_F_CLOSING_REV: u8 = 1 << 2;
/// Conntrack entry flag: the connection was translated by a service (its
/// tuple is the backend's); its replies are reverse-NATed.
pub const CT_F_SERVICE: u8 = 1 << 3;
/// Conntrack entry flag: the connection was translated by a NodePort into
/// a backend on this node; the backend's replies are reverse-translated
/// as they leave it.
pub const CT_F_NODEPORT: u8 = 1 << 4;

// ---------------------------------------------------------------------- config

/// Config flag: emit an event for every policy verdict (not only drops).
pub const CONFIG_EVENT_VERDICTS: u32 = 1 << 0;
/// Config flag: emit trace events.
pub const CONFIG_EVENT_TRACE: u32 = 1 << 1;

// --------------------------------------------------------------------- metrics

/// Metrics reason 0: forwarded.
pub const REASON_FORWARDED: u8 = 0;
/// Drop reason: a deny entry matched.
pub const DROP_POLICY_DENIED: u8 = 1;
/// Drop reason: enforcement on and no allow entry matched.
pub const DROP_POLICY_DEFAULT_DENY: u8 = 2;
/// Drop reason: malformed packet.
pub const DROP_INVALID_PACKET: u8 = 3;
/// Drop reason: neither IPv4, IPv6 nor ARP.
pub const DROP_UNSUPPORTED_L3: u8 = 4;
/// Drop reason: an L4 protocol the datapath does not handle.
pub const DROP_UNSUPPORTED_L4: u8 = 5;
/// Drop reason: the pod sent from an address that is not its own.
pub const DROP_INVALID_SOURCE_ADDRESS: u8 = 6;
/// Drop reason: the pod sent from a MAC that is not its own.
pub const DROP_INVALID_SOURCE_MAC: u8 = 7;
/// Drop reason: no endpoint entry for the interface.
pub const DROP_UNKNOWN_ENDPOINT: u8 = 8;
/// Drop reason: the conntrack map is full.
pub const DROP_CT_MAP_FULL: u8 = 9;
/// Drop reason: a packet invalid for its connection state.
pub const DROP_CT_INVALID: u8 = 10;
/// Drop reason: IP fragments are not supported (not produced since
/// fragments follow their flow; kept for counters of older datapaths).
pub const DROP_FRAGMENT_UNSUPPORTED: u8 = 11;
/// Drop reason: no route.
pub const DROP_NO_ROUTE: u8 = 12;
/// Drop reason: `bpf_redirect` to the destination endpoint failed.
pub const DROP_REDIRECT_FAILED: u8 = 13;
/// Drop reason: an IPv6 extension header chain the datapath cannot walk
/// (too long, truncated, or out of order).
pub const DROP_EXT_HEADER_CHAIN: u8 = 14;
/// Drop reason: a non-first fragment whose first fragment was not seen, in
/// an enforced direction.
pub const DROP_FRAGMENT_UNTRACKED: u8 = 15;
/// Drop reason: a VXLAN packet from an outer source address that is not a
/// node (no ipcache entry of identity remote-node).
pub const DROP_TUNNEL_SOURCE_NOT_NODE: u8 = 16;
/// Drop reason: a VXLAN packet whose VNI is no identity a node may send
/// (0, or host: a node sends its own traffic as remote-node).
pub const DROP_TUNNEL_IDENTITY_INVALID: u8 = 17;
/// Drop reason: a packet routed into the tunnel device whose destination
/// has no tunnel endpoint in the ipcache.
pub const DROP_NO_TUNNEL_ENDPOINT: u8 = 18;
/// Drop reason: a new flow to a service with no active backend, rejected
/// at once (TCP RST / ICMP destination unreachable to the client).
pub const DROP_NO_SERVICE_BACKEND: u8 = 19;
/// Drop reason: a new service flow whose translated tuple another live
/// flow holds, with every port it could be remapped to held as well
/// (ClusterIP's client port remapping, NodePort's SNAT).
pub const DROP_NAT_NO_PORT: u8 = 20;
/// Number of reasons the metrics map has room for.
pub const REASON_MAX: u32 = 64;
/// Entries of the per-CPU metrics array: `reason * 4 + direction`.
pub const METRICS_ENTRIES: u32 = REASON_MAX * 4;

/// Index of the metrics array for a reason and a direction (`DIR_*`).
pub const fn metrics_index(reason: u8, direction: u8) -> u32 {
    reason as u32 * 4 + direction as u32
}

/// A short, stable name for a `DROP_*` / `REASON_*` value (metrics labels,
/// CLI output). Unknown values are `"unknown"`.
pub const fn reason_name(reason: u8) -> &'static str {
    match reason {
        REASON_FORWARDED => "forwarded",
        DROP_POLICY_DENIED => "policy_denied",
        DROP_POLICY_DEFAULT_DENY => "policy_default_deny",
        DROP_INVALID_PACKET => "invalid_packet",
        DROP_UNSUPPORTED_L3 => "unsupported_l3",
        DROP_UNSUPPORTED_L4 => "unsupported_l4",
        DROP_INVALID_SOURCE_ADDRESS => "invalid_source_address",
        DROP_INVALID_SOURCE_MAC => "invalid_source_mac",
        DROP_UNKNOWN_ENDPOINT => "unknown_endpoint",
        DROP_CT_MAP_FULL => "ct_map_full",
        DROP_CT_INVALID => "ct_invalid",
        DROP_FRAGMENT_UNSUPPORTED => "fragment_unsupported",
        DROP_NO_ROUTE => "no_route",
        DROP_REDIRECT_FAILED => "redirect_failed",
        DROP_EXT_HEADER_CHAIN => "ext_header_chain",
        DROP_FRAGMENT_UNTRACKED => "fragment_untracked",
        DROP_TUNNEL_SOURCE_NOT_NODE => "tunnel_source_not_node",
        DROP_TUNNEL_IDENTITY_INVALID => "tunnel_identity_invalid",
        DROP_NO_TUNNEL_ENDPOINT => "no_tunnel_endpoint",
        DROP_NO_SERVICE_BACKEND => "no_service_backend",
        DROP_NAT_NO_PORT => "nat_no_port",
        _ => "unknown",
    }
}

// ---------------------------------------------------------------------- events

/// Event type: a drop.
pub const EVENT_DROP: u8 = 1;
/// Event type: a policy verdict.
pub const EVENT_POLICY_VERDICT: u8 = 2;
/// Event type: a trace point.
pub const EVENT_TRACE: u8 = 3;

/// Trace point: packet from the container.
pub const TRACE_FROM_CONTAINER: u8 = 1;
/// Trace point: packet to the container.
pub const TRACE_TO_CONTAINER: u8 = 2;
/// Trace point: packet handed to the node's stack.
pub const TRACE_TO_STACK: u8 = 3;
/// Trace point: packet redirected to a local endpoint.
pub const TRACE_TO_ENDPOINT: u8 = 4;
/// Trace point: packet into the tunnel (vxlan).
pub const TRACE_TO_OVERLAY: u8 = 5;
/// Trace point: packet out of the tunnel, to a local endpoint.
pub const TRACE_FROM_OVERLAY: u8 = 6;

// ------------------------------------------------------------ address helpers

/// An IPv4 address as stored in the maps (network byte order in memory).
pub fn ipv4_to_raw(addr: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(addr.octets())
}

/// The inverse of [`ipv4_to_raw`].
pub fn ipv4_from_raw(raw: u32) -> Ipv4Addr {
    Ipv4Addr::from(raw.to_ne_bytes())
}

/// An IPv6 address as stored in the maps (network byte order in memory).
pub fn ipv6_to_raw(addr: Ipv6Addr) -> [u32; 4] {
    let o = addr.octets();
    std::array::from_fn(|i| u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]))
}

/// The inverse of [`ipv6_to_raw`].
pub fn ipv6_from_raw(raw: [u32; 4]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    for (i, word) in raw.iter().enumerate() {
        o[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
    }
    Ipv6Addr::from(o)
}

/// An address stored as `family` (4 or 6) + `[u32; 4]`; `None` for another family.
pub fn ip_from_raw(family: u8, raw: [u32; 4]) -> Option<IpAddr> {
    match family {
        4 => Some(IpAddr::V4(ipv4_from_raw(raw[0]))),
        6 => Some(IpAddr::V6(ipv6_from_raw(raw))),
        _ => None,
    }
}

fn ip_to_raw(addr: IpAddr) -> (u8, [u32; 4]) {
    match addr {
        IpAddr::V4(v4) => (4, [ipv4_to_raw(v4), 0, 0, 0]),
        IpAddr::V6(v6) => (6, ipv6_to_raw(v6)),
    }
}

// ------------------------------------------------------------------- structs

/// `struct endpoint_key`: one entry per host-side ifindex and one per address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointKey {
    /// `EP_KEY_*`.
    pub kind: u32,
    /// The ifindex in `addr[0]` (host order), an IPv4 address in `addr[0]`,
    /// or an IPv6 address (network order).
    pub addr: [u32; 4],
}

impl EndpointKey {
    /// The entry a program finds its own endpoint by.
    pub fn ifindex(ifindex: u32) -> Self {
        Self {
            kind: EP_KEY_IFINDEX,
            addr: [ifindex, 0, 0, 0],
        }
    }

    /// The entry for one address of an endpoint.
    pub fn ip(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(v4) => Self::ipv4(v4),
            IpAddr::V6(v6) => Self::ipv6(v6),
        }
    }

    /// The entry for an IPv4 address of an endpoint.
    pub fn ipv4(addr: Ipv4Addr) -> Self {
        Self {
            kind: EP_KEY_IPV4,
            addr: [ipv4_to_raw(addr), 0, 0, 0],
        }
    }

    /// The entry for an IPv6 address of an endpoint.
    pub fn ipv6(addr: Ipv6Addr) -> Self {
        Self {
            kind: EP_KEY_IPV6,
            addr: ipv6_to_raw(addr),
        }
    }

    /// The ifindex of an `EP_KEY_IFINDEX` key.
    pub fn as_ifindex(&self) -> Option<u32> {
        (self.kind == EP_KEY_IFINDEX).then_some(self.addr[0])
    }

    /// The address of an `EP_KEY_IPV4` / `EP_KEY_IPV6` key.
    pub fn as_ip(&self) -> Option<IpAddr> {
        match self.kind {
            EP_KEY_IPV4 => Some(IpAddr::V4(ipv4_from_raw(self.addr[0]))),
            EP_KEY_IPV6 => Some(IpAddr::V6(ipv6_from_raw(self.addr))),
            _ => None,
        }
    }
}

/// `struct endpoint_info`: what a program knows about its endpoint (and a
/// peer endpoint on the same node).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct EndpointInfo {
    /// Endpoint id (the policy map's `endpoint_id`).
    pub endpoint_id: u32,
    /// Security identity of the endpoint.
    pub identity: u32,
    /// Host-side veth.
    pub ifindex: u32,
    /// `EP_F_*`.
    pub flags: u32,
    /// Pod-side MAC.
    pub mac: [u8; 6],
    /// Host-side veth MAC: the pod's gateway.
    pub node_mac: [u8; 6],
    /// IPv4 address (network order), valid with `EP_F_HAS_IPV4`.
    pub ipv4: u32,
    /// IPv6 address (network order), valid with `EP_F_HAS_IPV6`.
    pub ipv6: [u32; 4],
    /// The policy revision realised in the policy map for this endpoint.
    pub policy_revision: u64,
}

impl EndpointInfo {
    /// Sets (or clears) the IPv4 address and `EP_F_HAS_IPV4`.
    pub fn set_ipv4(&mut self, addr: Option<Ipv4Addr>) {
        match addr {
            Some(a) => {
                self.ipv4 = ipv4_to_raw(a);
                self.flags |= EP_F_HAS_IPV4;
            }
            None => {
                self.ipv4 = 0;
                self.flags &= !EP_F_HAS_IPV4;
            }
        }
    }

    /// Sets (or clears) the IPv6 address and `EP_F_HAS_IPV6`.
    pub fn set_ipv6(&mut self, addr: Option<Ipv6Addr>) {
        match addr {
            Some(a) => {
                self.ipv6 = ipv6_to_raw(a);
                self.flags |= EP_F_HAS_IPV6;
            }
            None => {
                self.ipv6 = [0; 4];
                self.flags &= !EP_F_HAS_IPV6;
            }
        }
    }

    /// The IPv4 address, if `EP_F_HAS_IPV4`.
    pub fn ipv4_addr(&self) -> Option<Ipv4Addr> {
        (self.flags & EP_F_HAS_IPV4 != 0).then(|| ipv4_from_raw(self.ipv4))
    }

    /// The IPv6 address, if `EP_F_HAS_IPV6`.
    pub fn ipv6_addr(&self) -> Option<Ipv6Addr> {
        (self.flags & EP_F_HAS_IPV6 != 0).then(|| ipv6_from_raw(self.ipv6))
    }
}

/// A prefix length that does not fit the address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("prefix length {prefix_len} is too long for {addr} (at most {max})")]
pub struct PrefixLenError {
    /// The address.
    pub addr: IpAddr,
    /// The prefix length asked for.
    pub prefix_len: u8,
    /// The longest one for the family.
    pub max: u8,
}

/// `addr` with the bits beyond `prefix_len` cleared.
fn network(addr: IpAddr, prefix_len: u8) -> Result<IpAddr, PrefixLenError> {
    let max = if addr.is_ipv4() { 32 } else { 128 };
    if prefix_len > max {
        return Err(PrefixLenError { addr, prefix_len, max });
    }
    Ok(match addr {
        IpAddr::V4(v4) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix_len)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask))
        }
        IpAddr::V6(v6) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix_len)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
        }
    })
}

/// Bits of the ipcache key data before the address (`family` + `pad`).
pub const IPCACHE_PREFIX_FIXED_BITS: u32 = 32;

/// `struct ipcache_key` as a whole (prefix length included).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IpcacheKey {
    /// LPM prefix length in bits, counting the 32 bits of `family` + `pad` first.
    pub prefixlen: u32,
    /// The key data (what aya's `Key<IpcacheKeyData>` carries).
    pub data: IpcacheKeyData,
}

/// The data part of `struct ipcache_key` (everything after `prefixlen`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IpcacheKeyData {
    /// 4 or 6.
    pub family: u8,
    /// Zero.
    pub pad: [u8; 3],
    /// The address (network order); IPv4 in `addr[0]`.
    pub addr: [u32; 4],
}

impl IpcacheKey {
    /// The key for `addr/prefix_len`; host bits beyond the prefix are cleared,
    /// so one prefix always has one key.
    pub fn new(addr: IpAddr, prefix_len: u8) -> Result<Self, PrefixLenError> {
        let (family, raw) = ip_to_raw(network(addr, prefix_len)?);
        Ok(Self {
            prefixlen: IPCACHE_PREFIX_FIXED_BITS + u32::from(prefix_len),
            data: IpcacheKeyData {
                family,
                pad: [0; 3],
                addr: raw,
            },
        })
    }

    /// The full-length key the datapath looks an address up with.
    pub fn lookup(addr: IpAddr) -> Self {
        let len = if addr.is_ipv4() { 32 } else { 128 };
        Self::new(addr, len).expect("full prefix length fits")
    }

    /// The prefix this key stands for: address and prefix length; `None` for
    /// a malformed key (unknown family, prefix length out of range).
    pub fn prefix(&self) -> Option<(IpAddr, u8)> {
        let addr = ip_from_raw(self.data.family, self.data.addr)?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = self.prefixlen.checked_sub(IPCACHE_PREFIX_FIXED_BITS)?;
        (len <= max).then_some((addr, len as u8))
    }

    /// The key for aya's [`LpmTrie`](aya::maps::LpmTrie).
    pub fn to_lpm(&self) -> LpmKey<IpcacheKeyData> {
        LpmKey::new(self.prefixlen, self.data)
    }

    /// From a key returned by aya's [`LpmTrie`](aya::maps::LpmTrie).
    pub fn from_lpm(key: &LpmKey<IpcacheKeyData>) -> Self {
        Self {
            prefixlen: key.prefix_len(),
            data: key.data(),
        }
    }
}

/// `struct ipcache_value`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IpcacheValue {
    /// Security identity of the prefix.
    pub identity: u32,
    /// IPv4 (network order) of the node to tunnel to; 0 = none.
    pub tunnel_endpoint: u32,
}

impl IpcacheValue {
    /// A value with an identity and an optional tunnel endpoint.
    pub fn new(identity: u32, tunnel_endpoint: Option<Ipv4Addr>) -> Self {
        Self {
            identity,
            tunnel_endpoint: tunnel_endpoint.map_or(0, ipv4_to_raw),
        }
    }

    /// The tunnel endpoint, if any.
    pub fn tunnel_endpoint_addr(&self) -> Option<Ipv4Addr> {
        (self.tunnel_endpoint != 0).then(|| ipv4_from_raw(self.tunnel_endpoint))
    }
}

/// `struct policy_key` as a whole (prefix length included). The policy
/// compiler in svc-loader's `policy_lpm` builds these.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKey {
    /// `POLICY_PREFIX_FIXED_BITS` + the number of port bits matched.
    pub prefixlen: u32,
    /// The key data (what aya's `Key<PolicyKeyData>` carries).
    pub data: PolicyKeyData,
}

/// The data part of `struct policy_key` (everything after `prefixlen`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKeyData {
    /// The endpoint the policy belongs to.
    pub endpoint_id: u32,
    /// Peer identity; `IDENTITY_ANY` = any.
    pub identity: u32,
    /// `DIR_*`.
    pub direction: u8,
    /// `IPPROTO_*`; 0 = any (then the port is never matched).
    pub protocol: u8,
    /// Destination port, network order.
    pub dport: u16,
}

impl PolicyKey {
    /// A key matching `port` on its first `port_bits` bits (0 = any port,
    /// 16 = exactly `port`); the low bits of `port` beyond the prefix are cleared.
    pub fn new(endpoint_id: u32, identity: u32, direction: u8, protocol: u8, port: u16, port_bits: u8) -> Self {
        let port_bits = port_bits.min(16);
        let mask = u16::MAX.checked_shl(16 - u32::from(port_bits)).unwrap_or(0);
        Self {
            prefixlen: POLICY_PREFIX_FIXED_BITS + u32::from(port_bits),
            data: PolicyKeyData {
                endpoint_id,
                identity,
                direction,
                protocol,
                dport: (port & mask).to_be(),
            },
        }
    }

    /// The full-length key the datapath looks a packet up with.
    pub fn lookup(endpoint_id: u32, identity: u32, direction: u8, protocol: u8, port: u16) -> Self {
        Self::new(endpoint_id, identity, direction, protocol, port, 16)
    }

    /// The destination port in host order (the first port of the block).
    pub fn port(&self) -> u16 {
        u16::from_be(self.data.dport)
    }

    /// How many port bits are matched (0..=16); `None` if the prefix length
    /// is outside `POLICY_PREFIX_FIXED_BITS..=POLICY_PREFIX_FULL_BITS`.
    pub fn port_bits(&self) -> Option<u8> {
        let bits = self.prefixlen.checked_sub(POLICY_PREFIX_FIXED_BITS)?;
        (bits <= 16).then_some(bits as u8)
    }

    /// The key for aya's [`LpmTrie`](aya::maps::LpmTrie).
    pub fn to_lpm(&self) -> LpmKey<PolicyKeyData> {
        LpmKey::new(self.prefixlen, self.data)
    }

    /// From a key returned by aya's [`LpmTrie`](aya::maps::LpmTrie).
    pub fn from_lpm(key: &LpmKey<PolicyKeyData>) -> Self {
        Self {
            prefixlen: key.prefix_len(),
            data: key.data(),
        }
    }
}

/// `struct policy_value`: verdict and counters of one policy entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PolicyValue {
    /// `VERDICT_*`.
    pub verdict: u8,
    /// Zero.
    pub pad: [u8; 7],
    /// Packets that matched (maintained by the datapath).
    pub packets: u64,
    /// Bytes that matched (maintained by the datapath).
    pub bytes: u64,
}

impl PolicyValue {
    /// A fresh entry with zero counters.
    pub fn new(verdict: u8) -> Self {
        Self {
            verdict,
            ..Self::default()
        }
    }
}

/// `struct ep_prefix_key` as a whole (prefix length included): one prefix an
/// endpoint matches peer addresses against in one direction.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EpPrefixKey {
    /// `EP_PREFIX_FIXED_BITS` + the prefix length.
    pub prefixlen: u32,
    /// The key data (what aya's `Key<EpPrefixKeyData>` carries).
    pub data: EpPrefixKeyData,
}

/// The data part of `struct ep_prefix_key` (everything after `prefixlen`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EpPrefixKeyData {
    /// The endpoint.
    pub endpoint_id: u32,
    /// `DIR_*`.
    pub direction: u8,
    /// 4 or 6.
    pub family: u8,
    /// Zero.
    pub pad: [u8; 2],
    /// The prefix's address (network order); IPv4 in `addr[0]`.
    pub addr: [u32; 4],
}

impl EpPrefixKey {
    /// The key for `addr/prefix_len` of an endpoint in a direction; host bits
    /// beyond the prefix are cleared, so one prefix always has one key.
    pub fn new(endpoint_id: u32, direction: u8, addr: IpAddr, prefix_len: u8) -> Result<Self, PrefixLenError> {
        let (family, raw) = ip_to_raw(network(addr, prefix_len)?);
        Ok(Self {
            prefixlen: EP_PREFIX_FIXED_BITS + u32::from(prefix_len),
            data: EpPrefixKeyData {
                endpoint_id,
                direction,
                family,
                pad: [0; 2],
                addr: raw,
            },
        })
    }

    /// The full-length key the datapath looks a peer address up with.
    pub fn lookup(endpoint_id: u32, direction: u8, addr: IpAddr) -> Self {
        let len = if addr.is_ipv4() { 32 } else { 128 };
        Self::new(endpoint_id, direction, addr, len).expect("full prefix length fits")
    }

    /// The prefix this key stands for; `None` for a malformed key (unknown
    /// family, prefix length out of range, host bits set).
    pub fn prefix(&self) -> Option<(IpAddr, u8)> {
        let addr = ip_from_raw(self.data.family, self.data.addr)?;
        let len = u8::try_from(self.prefixlen.checked_sub(EP_PREFIX_FIXED_BITS)?).ok()?;
        (network(addr, len).ok()? == addr).then_some((addr, len))
    }

    /// The key for aya's [`LpmTrie`](aya::maps::LpmTrie).
    pub fn to_lpm(&self) -> LpmKey<EpPrefixKeyData> {
        LpmKey::new(self.prefixlen, self.data)
    }

    /// From a key returned by aya's [`LpmTrie`](aya::maps::LpmTrie).
    pub fn from_lpm(key: &LpmKey<EpPrefixKeyData>) -> Self {
        Self {
            prefixlen: key.prefix_len(),
            data: key.data(),
        }
    }
}

/// `struct ep_prefix_value`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct EpPrefixValue {
    /// The CIDR identity of the prefix (>= 2^24).
    pub cidr_identity: u32,
}

/// `struct ct4_key`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ct4Key {
    /// Source address (network order).
    pub saddr: u32,
    /// Destination address (network order).
    pub daddr: u32,
    /// Source port (network order); ICMP: the echo id.
    pub sport: u16,
    /// Destination port (network order); ICMP: the echo id.
    pub dport: u16,
    /// `IPPROTO_*`.
    pub protocol: u8,
    /// `DIR_*` of the endpoint that opened the connection.
    pub direction: u8,
    /// Zero.
    pub pad: u16,
}

impl Ct4Key {
    /// A key from host-order socket addresses.
    pub fn new(src: SocketAddrV4, dst: SocketAddrV4, protocol: u8, direction: u8) -> Self {
        Self {
            saddr: ipv4_to_raw(*src.ip()),
            daddr: ipv4_to_raw(*dst.ip()),
            sport: src.port().to_be(),
            dport: dst.port().to_be(),
            protocol,
            direction,
            pad: 0,
        }
    }

    /// Source address and port (host order).
    pub fn src(&self) -> SocketAddrV4 {
        SocketAddrV4::new(ipv4_from_raw(self.saddr), u16::from_be(self.sport))
    }

    /// Destination address and port (host order).
    pub fn dst(&self) -> SocketAddrV4 {
        SocketAddrV4::new(ipv4_from_raw(self.daddr), u16::from_be(self.dport))
    }
}

/// `struct ct6_key`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ct6Key {
    /// Source address (network order).
    pub saddr: [u32; 4],
    /// Destination address (network order).
    pub daddr: [u32; 4],
    /// Source port (network order); ICMPv6: the echo id.
    pub sport: u16,
    /// Destination port (network order); ICMPv6: the echo id.
    pub dport: u16,
    /// `IPPROTO_*`.
    pub protocol: u8,
    /// `DIR_*` of the endpoint that opened the connection.
    pub direction: u8,
    /// Zero.
    pub pad: u16,
}

impl Ct6Key {
    /// A key from host-order socket addresses (flow info and scope are ignored).
    pub fn new(src: SocketAddrV6, dst: SocketAddrV6, protocol: u8, direction: u8) -> Self {
        Self {
            saddr: ipv6_to_raw(*src.ip()),
            daddr: ipv6_to_raw(*dst.ip()),
            sport: src.port().to_be(),
            dport: dst.port().to_be(),
            protocol,
            direction,
            pad: 0,
        }
    }

    /// Source address and port (host order).
    pub fn src(&self) -> SocketAddrV6 {
        SocketAddrV6::new(ipv6_from_raw(self.saddr), u16::from_be(self.sport), 0, 0)
    }

    /// Destination address and port (host order).
    pub fn dst(&self) -> SocketAddrV6 {
        SocketAddrV6::new(ipv6_from_raw(self.daddr), u16::from_be(self.dport), 0, 0)
    }
}

/// `struct ct_entry`: one connection (value of ct4 and ct6).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtEntry {
    /// `bpf_ktime_get_ns()` deadline (CLOCK_MONOTONIC nanoseconds).
    pub expires: u64,
    /// Packets from the opening side.
    pub packets_fwd: u64,
    /// Bytes from the opening side.
    pub bytes_fwd: u64,
    /// Packets from the replying side.
    pub packets_rev: u64,
    /// Bytes from the replying side.
    pub bytes_rev: u64,
    /// Identity of the opening side.
    pub src_identity: u32,
    /// Local endpoint the entry belongs to.
    pub endpoint_id: u32,
    /// `CT_TCP_*`, 0 for non-TCP.
    pub tcp_state: u8,
    /// TCP flags seen from the opening side.
    pub tcp_flags_fwd: u8,
    /// TCP flags seen from the replying side.
    pub tcp_flags_rev: u8,
    /// `CT_F_*`.
    pub flags: u8,
    /// Seconds of lifetime applied when `expires` was last written:
    /// `expires - lifetime` is when the entry was last refreshed. 0 in
    /// entries of a datapath that predates the field (it was padding).
    pub lifetime: u32,
    /// The [`DatapathConfig::policy_revision`] at which `policy_verdict`
    /// was taken: while it holds, the connection skips the policy lookup.
    pub policy_revision: u32,
    /// 0: the connection is allowed; else the `DROP_POLICY_*` reason that
    /// drops its packets.
    pub policy_verdict: u8,
    /// Zero.
    pub pad: [u8; 3],
}

impl CtEntry {
    /// When the datapath last refreshed the entry (CLOCK_MONOTONIC
    /// nanoseconds), or `None` for an entry written without `lifetime`.
    /// The datapath refreshes at most once a second, so the last packet may
    /// be up to a second later.
    pub fn last_refreshed(&self) -> Option<u64> {
        (self.lifetime != 0).then(|| self.expires.saturating_sub(u64::from(self.lifetime) * 1_000_000_000))
    }
}

/// `struct frag_key`: one fragmented datagram (the `fragments` map, written
/// and read by the datapath only).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    /// Source address (network order; IPv4 in `saddr[0]`).
    pub saddr: [u32; 4],
    /// Destination address.
    pub daddr: [u32; 4],
    /// IPv4 identification (16 bits) or the IPv6 Fragment header's.
    pub id: u32,
    /// 4 or 6.
    pub family: u8,
    /// IPv4 protocol, or the IPv6 Fragment header's next header.
    pub protocol: u8,
    /// Zero.
    pub pad: u16,
}

/// `struct frag_value`: what a datagram's first fragment recorded.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragValue {
    /// `bpf_ktime_get_ns()` deadline.
    pub expires: u64,
    /// Source port, network order (ICMP: the echo id).
    pub sport: u16,
    /// Destination port, network order.
    pub dport: u16,
    /// The L4 protocol.
    pub protocol: u8,
    /// Zero.
    pub pad: [u8; 3],
}

/// `struct ct_timeouts`: conntrack lifetimes in seconds.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtTimeouts {
    /// TCP after a SYN, before the handshake completes.
    pub tcp_syn: u32,
    /// Established TCP.
    pub tcp_established: u32,
    /// TCP after FIN or RST.
    pub tcp_closing: u32,
    /// UDP.
    pub udp: u32,
    /// ICMP / ICMPv6 echo.
    pub icmp: u32,
    /// Anything else.
    pub other: u32,
}

impl CtTimeouts {
    /// The defaults, Cilium's: TCP SYN 60 s, established 6 h, closing 10 s,
    /// everything non-TCP 60 s. The one place they are written: the
    /// loader's and svc-gc's flags default to these, and `rivet.h`'s
    /// `CT_DEFAULT_*` (what the datapath uses for a lifetime left at 0) are
    /// checked against them.
    pub const DEFAULT: Self = Self {
        tcp_syn: 60,
        tcp_established: 21_600,
        tcp_closing: 10,
        udp: 60,
        icmp: 60,
        other: 60,
    };
}

impl Default for CtTimeouts {
    /// [`CtTimeouts::DEFAULT`].
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// `struct datapath_config`: the single entry of the config map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DatapathConfig {
    /// `CONFIG_EVENT_*`.
    pub event_flags: u32,
    /// Bumped by the loader after every change to a map a policy verdict
    /// reads (endpoints, ipcache, policy, ep_prefixes): conntrack entries
    /// cached at another revision take their verdict again.
    pub policy_revision: u32,
    /// Conntrack lifetimes.
    pub ct: CtTimeouts,
}

/// `routing_config.mode`: single node.
pub const ROUTING_NONE: u32 = 0;
/// `routing_config.mode`: native routing.
pub const ROUTING_NATIVE: u32 = 1;
/// `routing_config.mode`: VXLAN tunnel.
pub const ROUTING_VXLAN: u32 = 2;

/// `struct routing_config`: the single entry of the routing map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RoutingConfig {
    /// `ROUTING_*`.
    pub mode: u32,
    /// The tunnel device (vxlan mode), else 0.
    pub tunnel_ifindex: u32,
    /// The tunnel device's MTU at start, for inspection (the datapath
    /// checks packets with `bpf_check_mtu` against the device).
    pub tunnel_mtu: u32,
    /// The underlay interface, else 0.
    pub underlay_ifindex: u32,
}

// -------------------------------------------------------------------- services

/// Slots of a Maglev table (a prime; Maglev wants it much larger than the
/// number of backends).
pub const LB_MAGLEV_SIZE: usize = 1021;

/// Frontend scope: from pods and the node itself (every active backend).
pub const SVC_SCOPE_INTERNAL: u8 = 0;
/// Frontend scope: a NodePort reached from outside the node with
/// externalTrafficPolicy Local (this node's backends only).
pub const SVC_SCOPE_EXTERNAL: u8 = 1;

/// Frontend flag: a ClusterIP (or another VIP).
pub const SVC_F_CLUSTER_IP: u16 = 1 << 0;
/// Frontend flag: a NodePort (address all zero = any address of this node).
pub const SVC_F_NODE_PORT: u16 = 1 << 1;
/// Frontend flag: sessionAffinity ClientIP for `affinity_timeout` seconds.
pub const SVC_F_AFFINITY: u16 = 1 << 2;
/// Frontend flag: externalTrafficPolicy Local (NodePort).
pub const SVC_F_LOCAL: u16 = 1 << 3;

/// Backend state: takes new flows.
pub const LB_BACKEND_ACTIVE: u8 = 0;
/// Backend state: keeps its flows, gets no new ones (in no Maglev table).
pub const LB_BACKEND_TERMINATING: u8 = 1;

/// `lb4_flows` / `lb6_flows` key direction: the client's tuple to the VIP.
pub const LB_FLOW_FORWARD: u8 = 3;
/// `lb4_flows` / `lb6_flows` key direction: the translated tuple client → backend.
pub const LB_FLOW_REVERSE: u8 = 4;
/// `lb4_flows` / `lb6_flows` key direction (NodePort SNAT): the translated
/// tuple client → backend, to the node address and SNAT port it leaves with.
/// (A ClusterIP flow with [`LB_FLOW_F_PORT_MAPPED`]: the client's tuple
/// client → VIP, to the port it leaves with.)
pub const LB_FLOW_SNAT_OUT: u8 = 5;
/// `lb4_flows` / `lb6_flows` key direction (NodePort SNAT): the reply's
/// tuple backend → node address:SNAT port, to the client's address and port.
/// (A ClusterIP flow with [`LB_FLOW_F_PORT_MAPPED`]: backend → client:the
/// remapped port, to the client's own port.)
pub const LB_FLOW_SNAT_IN: u8 = 6;
/// `LbFlow::flags`: hairpin, the client is its own backend (the forward
/// packet's source became the VIP too; the REVERSE key is VIP → backend).
pub const LB_FLOW_F_HAIRPIN: u8 = 1 << 0;
/// Flow flag (FORWARD and REVERSE entries): the client's port was remapped
/// (its translated tuple was another flow's); the port it leaves with is in
/// an [`LB_FLOW_SNAT_OUT`] entry keyed by the client's tuple, its own in an
/// [`LB_FLOW_SNAT_IN`] entry keyed by the reply's tuple.
pub const LB_FLOW_F_PORT_MAPPED: u8 = 1 << 1;

/// An address stored as `[u32; 4]` (network order, IPv4 in `[0]`) with
/// its family; `None` for an unknown family.
fn socket_from_raw(family: u8, raw: [u32; 4], port: u16) -> Option<SocketAddr> {
    ip_from_raw(family, raw).map(|ip| SocketAddr::new(ip, u16::from_be(port)))
}

/// `struct lb_frontend_key`: one frontend of a service (`lb_frontends`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LbFrontendKey {
    /// The VIP (network order; IPv4 in `addr[0]`); NodePort: all zero.
    pub addr: [u32; 4],
    /// Network order.
    pub port: u16,
    /// `IPPROTO_TCP` / `UDP` / `SCTP`.
    pub protocol: u8,
    /// 4 or 6.
    pub family: u8,
    /// `SVC_SCOPE_*`.
    pub scope: u8,
    /// Zero.
    pub pad: [u8; 3],
}

impl LbFrontendKey {
    /// The key of a VIP frontend (ClusterIP) with a host-order port.
    pub fn vip(addr: SocketAddr, protocol: u8, scope: u8) -> Self {
        let (family, raw) = ip_to_raw(addr.ip());
        Self {
            addr: raw,
            port: addr.port().to_be(),
            protocol,
            family,
            scope,
            pad: [0; 3],
        }
    }

    /// The key of a NodePort frontend (any address of the node) of `family`
    /// (4 or 6) with a host-order port.
    pub fn node_port(family: u8, port: u16, protocol: u8, scope: u8) -> Self {
        Self {
            addr: [0; 4],
            port: port.to_be(),
            protocol,
            family,
            scope,
            pad: [0; 3],
        }
    }

    /// The address; `None` for a NodePort key (all zero) or an unknown family.
    pub fn ip(&self) -> Option<IpAddr> {
        if self.addr == [0; 4] {
            return None;
        }
        ip_from_raw(self.family, self.addr)
    }

    /// The port in host order.
    pub fn port(&self) -> u16 {
        u16::from_be(self.port)
    }
}

/// `struct lb_frontend`: what a frontend leads to (`lb_frontends` value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbFrontend {
    /// The service (rev NAT entry, affinity key), chosen by svc-endpoint.
    pub service_id: u32,
    /// Its Maglev table in `lb_maglev` (the loader's).
    pub table_id: u32,
    /// Active backends in the table; 0: new flows are rejected.
    pub backend_count: u16,
    /// `SVC_F_*`.
    pub flags: u16,
    /// Seconds (with `SVC_F_AFFINITY`).
    pub affinity_timeout: u32,
}

/// `struct lb_backend`: one backend (`lb_backends`, keyed by the loader's
/// backend id).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbBackend {
    /// Network order; IPv4 in `addr[0]`.
    pub addr: [u32; 4],
    /// Network order.
    pub port: u16,
    /// 4 or 6.
    pub family: u8,
    /// `LB_BACKEND_*`.
    pub state: u8,
}

impl LbBackend {
    /// A backend at `addr` (host-order port) in `state`.
    pub fn new(addr: SocketAddr, state: u8) -> Self {
        let (family, raw) = ip_to_raw(addr.ip());
        Self {
            addr: raw,
            port: addr.port().to_be(),
            family,
            state,
        }
    }

    /// Address and host-order port; `None` for an unknown family.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        socket_from_raw(self.family, self.addr, self.port)
    }
}

/// `struct lb_maglev_table`: the backend id of every slot (0: none).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LbMaglevTable {
    /// `LB_MAGLEV_SIZE` slots.
    pub backend_ids: [u32; LB_MAGLEV_SIZE],
}

impl Default for LbMaglevTable {
    /// Every slot empty.
    fn default() -> Self {
        Self {
            backend_ids: [0; LB_MAGLEV_SIZE],
        }
    }
}

/// `struct lb_rev_nat`: the frontend replies of a service come from
/// (`lb_rev_nat`, keyed by service id).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbRevNat {
    /// Network order; IPv4 in `addr[0]`.
    pub addr: [u32; 4],
    /// Network order.
    pub port: u16,
    /// 4 or 6.
    pub family: u8,
    /// Zero.
    pub pad: u8,
}

impl LbRevNat {
    /// The frontend `addr` (host-order port).
    pub fn new(addr: SocketAddr) -> Self {
        let (family, raw) = ip_to_raw(addr.ip());
        Self {
            addr: raw,
            port: addr.port().to_be(),
            family,
            pad: 0,
        }
    }

    /// Address and host-order port; `None` for an unknown family.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        socket_from_raw(self.family, self.addr, self.port)
    }
}

/// [`LbServiceBackend::flags`]: terminating in this service (no new flows).
pub const LB_SVC_BACKEND_TERMINATING: u32 = 1 << 0;
/// [`LbServiceBackend::flags`]: a pod on this node (externalTrafficPolicy Local).
pub const LB_SVC_BACKEND_NODE_LOCAL: u32 = 1 << 1;

/// `struct lb_svc_backend_key`: one backend of a service (`lb_svc_backends`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LbSvcBackendKey {
    /// The service.
    pub service_id: u32,
    /// `0..backend_count` of its [`LbService`] record, by backend address.
    pub index: u32,
}

/// `struct lb_service_backend`: one backend of a service and its state in
/// it (`lb_svc_backends`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbServiceBackend {
    /// The `lb_backends` key.
    pub backend_id: u32,
    /// `LB_SVC_BACKEND_*`.
    pub flags: u32,
}

/// `struct lb_service`: svc-loader's record of one service (`lb_services`,
/// keyed by service id), which the datapath never reads: with its
/// backends in `lb_svc_backends`, what the other maps do not say
/// (terminating and node-local backends), so a restarted loader rebuilds
/// its index from the pins alone.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbService {
    /// The internal Maglev table.
    pub table_id: u32,
    /// The NodePort Local table, else 0.
    pub external_table_id: u32,
    /// Seconds, 0 = no affinity.
    pub affinity_timeout: u32,
    /// Its `lb_svc_backends` entries (indexes `0..backend_count`).
    pub backend_count: u16,
    /// 4 or 6.
    pub family: u8,
    /// `IPPROTO_*`.
    pub protocol: u8,
    /// `SVC_F_LOCAL` when externalTrafficPolicy is Local.
    pub flags: u32,
    /// Zero.
    pub pad: u32,
}

/// `struct lb_affinity_key`: a client of a service with session affinity.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LbAffinityKey {
    /// Network order; IPv4 in `client[0]`.
    pub client: [u32; 4],
    /// The service.
    pub service_id: u32,
    /// 4 or 6.
    pub family: u8,
    /// Zero.
    pub pad: [u8; 3],
}

impl LbAffinityKey {
    /// The key of `client` for `service_id`.
    pub fn new(client: IpAddr, service_id: u32) -> Self {
        let (family, raw) = ip_to_raw(client);
        Self {
            client: raw,
            service_id,
            family,
            pad: [0; 3],
        }
    }

    /// The client; `None` for an unknown family.
    pub fn client_ip(&self) -> Option<IpAddr> {
        ip_from_raw(self.family, self.client)
    }
}

/// `struct lb_affinity`: the backend a client got.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbAffinity {
    /// `bpf_ktime_get_ns()` of the last use (CLOCK_MONOTONIC nanoseconds).
    pub last_used: u64,
    /// The backend.
    pub backend_id: u32,
    /// Zero.
    pub pad: u32,
}

/// `struct lb_flow`: one direction of a translated connection (`lb4_flows`
/// / `lb6_flows`, keyed by [`Ct4Key`] / [`Ct6Key`] with `direction`
/// [`LB_FLOW_FORWARD`] or [`LB_FLOW_REVERSE`], or for NodePort's SNAT
/// [`LB_FLOW_SNAT_OUT`] or [`LB_FLOW_SNAT_IN`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbFlow {
    /// `bpf_ktime_get_ns()` deadline.
    pub expires: u64,
    /// FORWARD: the backend's address; REVERSE: the VIP (network order).
    pub addr: [u32; 4],
    /// Network order: the backend's port / the VIP's.
    pub port: u16,
    /// 4 or 6.
    pub family: u8,
    /// Zero (reserved for the datapath).
    pub flags: u8,
    /// The backend chosen.
    pub backend_id: u32,
    /// The service.
    pub service_id: u32,
    /// Seconds applied when `expires` was written (as `ct_entry`).
    pub lifetime: u32,
    /// Zero.
    pub pad: u32,
    /// Zero (the struct is 8-aligned: no implicit trailing padding).
    pub pad2: u32,
}

impl LbFlow {
    /// Address and host-order port it translates to; `None` for an unknown family.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        socket_from_raw(self.family, self.addr, self.port)
    }
}

/// `struct metrics_value`: one per-CPU counter pair.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MetricsValue {
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}

/// `struct event`: one ring buffer record (drop, verdict or trace).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Event {
    /// `bpf_ktime_get_ns()`.
    pub timestamp: u64,
    /// `EVENT_*` (C field `type`).
    pub kind: u8,
    /// `DROP_*`, or `TRACE_*` for traces.
    pub reason: u8,
    /// `DIR_*`.
    pub direction: u8,
    /// `VERDICT_*` for verdict events.
    pub verdict: u8,
    /// 4 or 6.
    pub family: u8,
    /// `IPPROTO_*`.
    pub protocol: u8,
    /// Zero.
    pub pad: u16,
    /// Local endpoint.
    pub endpoint_id: u32,
    /// Interface the packet was seen on.
    pub ifindex: u32,
    /// Identity of the source.
    pub src_identity: u32,
    /// Identity of the destination.
    pub dst_identity: u32,
    /// Source address (network order).
    pub saddr: [u32; 4],
    /// Destination address (network order).
    pub daddr: [u32; 4],
    /// Source port (network order).
    pub sport: u16,
    /// Destination port (network order).
    pub dport: u16,
    /// Packet length.
    pub length: u32,
}

impl Event {
    /// Decodes one ring buffer record; `None` if it is shorter than an event
    /// (longer records, from a newer datapath, are read as far as known).
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < size_of::<Self>() {
            return None;
        }
        // SAFETY: the length is checked, `Event` is plain old data (every bit
        // pattern is valid), and read_unaligned needs no alignment.
        Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<Self>()) })
    }

    /// Source address.
    pub fn src_ip(&self) -> Option<IpAddr> {
        ip_from_raw(self.family, self.saddr)
    }

    /// Destination address.
    pub fn dst_ip(&self) -> Option<IpAddr> {
        ip_from_raw(self.family, self.daddr)
    }

    /// Source port in host order.
    pub fn src_port(&self) -> u16 {
        u16::from_be(self.sport)
    }

    /// Destination port in host order.
    pub fn dst_port(&self) -> u16 {
        u16::from_be(self.dport)
    }
}

// SAFETY: every struct is #[repr(C)], made only of integers and integer
// arrays, with explicit padding fields (no implicit padding: the layout test
// checks size == sum of fields), so any bit pattern is a valid value.
unsafe impl aya::Pod for EndpointKey {}
unsafe impl aya::Pod for EndpointInfo {}
unsafe impl aya::Pod for IpcacheKey {}
unsafe impl aya::Pod for IpcacheKeyData {}
unsafe impl aya::Pod for IpcacheValue {}
unsafe impl aya::Pod for PolicyKey {}
unsafe impl aya::Pod for PolicyKeyData {}
unsafe impl aya::Pod for PolicyValue {}
unsafe impl aya::Pod for EpPrefixKey {}
unsafe impl aya::Pod for EpPrefixKeyData {}
unsafe impl aya::Pod for EpPrefixValue {}
unsafe impl aya::Pod for Ct4Key {}
unsafe impl aya::Pod for Ct6Key {}
unsafe impl aya::Pod for CtEntry {}
unsafe impl aya::Pod for CtTimeouts {}
unsafe impl aya::Pod for FragKey {}
unsafe impl aya::Pod for FragValue {}
unsafe impl aya::Pod for DatapathConfig {}
unsafe impl aya::Pod for RoutingConfig {}
unsafe impl aya::Pod for MetricsValue {}
unsafe impl aya::Pod for Event {}
unsafe impl aya::Pod for LbFrontendKey {}
unsafe impl aya::Pod for LbFrontend {}
unsafe impl aya::Pod for LbBackend {}
unsafe impl aya::Pod for LbMaglevTable {}
unsafe impl aya::Pod for LbRevNat {}
unsafe impl aya::Pod for LbServiceBackend {}
unsafe impl aya::Pod for LbSvcBackendKey {}
unsafe impl aya::Pod for LbService {}
unsafe impl aya::Pod for LbAffinityKey {}
unsafe impl aya::Pod for LbAffinity {}
unsafe impl aya::Pod for LbFlow {}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;
    use std::mem::{offset_of, size_of};
    use std::path::Path;
    use std::process::Command;

    use super::*;

    /// Sizes computed by hand from rivet.h (x86_64 and BPF agree: natural alignment).
    #[test]
    fn layout_sizes_by_hand() {
        assert_eq!(size_of::<EndpointKey>(), 20);
        assert_eq!(size_of::<EndpointInfo>(), 56);
        assert_eq!(size_of::<IpcacheKey>(), 24);
        assert_eq!(size_of::<IpcacheKeyData>(), 20);
        assert_eq!(size_of::<LpmKey<IpcacheKeyData>>(), 24);
        assert_eq!(size_of::<IpcacheValue>(), 8);
        assert_eq!(size_of::<PolicyKey>(), 16);
        assert_eq!(size_of::<PolicyKeyData>(), 12);
        assert_eq!(size_of::<LpmKey<PolicyKeyData>>(), 16);
        assert_eq!(size_of::<PolicyValue>(), 24);
        assert_eq!(size_of::<EpPrefixKey>(), 28);
        assert_eq!(size_of::<EpPrefixKeyData>(), 24);
        assert_eq!(size_of::<LpmKey<EpPrefixKeyData>>(), 28);
        assert_eq!(size_of::<EpPrefixValue>(), 4);
        assert_eq!(size_of::<Ct4Key>(), 16);
        assert_eq!(size_of::<Ct6Key>(), 40);
        assert_eq!(size_of::<CtEntry>(), 64);
        assert_eq!(size_of::<CtTimeouts>(), 24);
        assert_eq!(size_of::<LbSockRevKey>(), 32);
        assert_eq!(size_of::<LbSockRev>(), 24);
        assert_eq!(size_of::<DatapathConfig>(), 32);
        assert_eq!(size_of::<RoutingConfig>(), 16);
        assert_eq!(size_of::<MetricsValue>(), 16);
        assert_eq!(size_of::<Event>(), 72);
        assert_eq!(size_of::<LbFrontendKey>(), 24);
        assert_eq!(size_of::<LbFrontend>(), 16);
        assert_eq!(size_of::<LbBackend>(), 20);
        assert_eq!(size_of::<LbMaglevTable>(), 4 * LB_MAGLEV_SIZE);
        assert_eq!(size_of::<LbRevNat>(), 20);
        assert_eq!(size_of::<LbAffinityKey>(), 24);
        assert_eq!(size_of::<LbAffinity>(), 16);
        assert_eq!(size_of::<LbFlow>(), 48);
        assert_eq!(size_of::<LbServiceBackend>(), 8);
        assert_eq!(size_of::<LbSvcBackendKey>(), 8);
        assert_eq!(size_of::<LbService>(), 24);
        // The LPM data must be exactly the bits the prefix lengths count.
        assert_eq!(size_of::<PolicyKeyData>() * 8, POLICY_PREFIX_FULL_BITS as usize);
        assert_eq!(offset_of!(PolicyKeyData, dport) * 8, POLICY_PREFIX_FIXED_BITS as usize);
        assert_eq!(offset_of!(IpcacheKeyData, addr) * 8, IPCACHE_PREFIX_FIXED_BITS as usize);
    }

    /// The policy wildcard is a number no peer has (rivet_common's "no
    /// identity"), so a wildcard entry never doubles as one peer's entry.
    #[test]
    fn the_any_identity_is_no_identity() {
        use rivet_common::identity::IdentityScope;
        assert_eq!(IdentityScope::of(IDENTITY_ANY), IdentityScope::None);
    }

    /// (C struct, [(C field, Rust offset, Rust size)], Rust size).
    type Layout = (&'static str, Vec<(&'static str, usize, usize)>, usize);

    macro_rules! layout {
        ($c:literal, $ty:ty, [$($cf:literal => $($rf:ident).+ : $fty:ty),* $(,)?]) => {
            (
                $c,
                vec![$(($cf, offset_of!($ty, $($rf).+), size_of::<$fty>())),*],
                size_of::<$ty>(),
            )
        };
    }

    fn layouts() -> Vec<Layout> {
        vec![
            layout!("endpoint_key", EndpointKey, ["kind" => kind: u32, "addr" => addr: [u32; 4]]),
            layout!("endpoint_info", EndpointInfo, [
                "endpoint_id" => endpoint_id: u32, "identity" => identity: u32, "ifindex" => ifindex: u32,
                "flags" => flags: u32, "mac" => mac: [u8; 6], "node_mac" => node_mac: [u8; 6],
                "ipv4" => ipv4: u32, "ipv6" => ipv6: [u32; 4], "policy_revision" => policy_revision: u64,
            ]),
            layout!("ipcache_key", IpcacheKey, [
                "prefixlen" => prefixlen: u32, "family" => data.family: u8, "pad" => data.pad: [u8; 3],
                "addr" => data.addr: [u32; 4],
            ]),
            layout!("ipcache_value", IpcacheValue, ["identity" => identity: u32, "tunnel_endpoint" => tunnel_endpoint: u32]),
            layout!("policy_key", PolicyKey, [
                "prefixlen" => prefixlen: u32, "endpoint_id" => data.endpoint_id: u32, "identity" => data.identity: u32,
                "direction" => data.direction: u8, "protocol" => data.protocol: u8, "dport" => data.dport: u16,
            ]),
            layout!("ep_prefix_key", EpPrefixKey, [
                "prefixlen" => prefixlen: u32, "endpoint_id" => data.endpoint_id: u32,
                "direction" => data.direction: u8, "family" => data.family: u8, "pad" => data.pad: [u8; 2],
                "addr" => data.addr: [u32; 4],
            ]),
            layout!("ep_prefix_value", EpPrefixValue, ["cidr_identity" => cidr_identity: u32]),
            layout!("policy_value", PolicyValue, [
                "verdict" => verdict: u8, "pad" => pad: [u8; 7], "packets" => packets: u64, "bytes" => bytes: u64,
            ]),
            layout!("ct4_key", Ct4Key, [
                "saddr" => saddr: u32, "daddr" => daddr: u32, "sport" => sport: u16, "dport" => dport: u16,
                "protocol" => protocol: u8, "direction" => direction: u8, "pad" => pad: u16,
            ]),
            layout!("ct6_key", Ct6Key, [
                "saddr" => saddr: [u32; 4], "daddr" => daddr: [u32; 4], "sport" => sport: u16, "dport" => dport: u16,
                "protocol" => protocol: u8, "direction" => direction: u8, "pad" => pad: u16,
            ]),
            layout!("ct_entry", CtEntry, [
                "expires" => expires: u64, "packets_fwd" => packets_fwd: u64, "bytes_fwd" => bytes_fwd: u64,
                "packets_rev" => packets_rev: u64, "bytes_rev" => bytes_rev: u64,
                "src_identity" => src_identity: u32, "endpoint_id" => endpoint_id: u32,
                "tcp_state" => tcp_state: u8, "tcp_flags_fwd" => tcp_flags_fwd: u8,
                "tcp_flags_rev" => tcp_flags_rev: u8, "flags" => flags: u8, "lifetime" => lifetime: u32,
                "policy_revision" => policy_revision: u32, "policy_verdict" => policy_verdict: u8,
                "pad" => pad: [u8; 3],
            ]),
            layout!("frag_key", FragKey, [
                "saddr" => saddr: [u32; 4], "daddr" => daddr: [u32; 4], "id" => id: u32,
                "family" => family: u8, "protocol" => protocol: u8, "pad" => pad: u16,
            ]),
            layout!("frag_value", FragValue, [
                "expires" => expires: u64, "sport" => sport: u16, "dport" => dport: u16,
                "protocol" => protocol: u8, "pad" => pad: [u8; 3],
            ]),
            layout!("lb_sock_rev_key", LbSockRevKey, [
                "cookie" => cookie: u64, "addr" => addr: [u32; 4], "port" => port: u16,
                "family" => family: u8, "pad" => pad: [u8; 5],
            ]),
            layout!("lb_sock_rev", LbSockRev, [
                "addr" => addr: [u32; 4], "port" => port: u16, "family" => family: u8, "flags" => flags: u8,
                "last_used" => last_used: u32,
            ]),
            layout!("ct_timeouts", CtTimeouts, [
                "tcp_syn" => tcp_syn: u32, "tcp_established" => tcp_established: u32,
                "tcp_closing" => tcp_closing: u32, "udp" => udp: u32, "icmp" => icmp: u32, "other" => other: u32,
            ]),
            layout!("datapath_config", DatapathConfig, [
                "event_flags" => event_flags: u32, "policy_revision" => policy_revision: u32, "ct" => ct: CtTimeouts,
            ]),
            layout!("routing_config", RoutingConfig, [
                "mode" => mode: u32, "tunnel_ifindex" => tunnel_ifindex: u32,
                "tunnel_mtu" => tunnel_mtu: u32, "underlay_ifindex" => underlay_ifindex: u32,
            ]),
            layout!("metrics_value", MetricsValue, ["packets" => packets: u64, "bytes" => bytes: u64]),
            layout!("event", Event, [
                "timestamp" => timestamp: u64, "type" => kind: u8, "reason" => reason: u8,
                "direction" => direction: u8, "verdict" => verdict: u8, "family" => family: u8,
                "protocol" => protocol: u8, "pad" => pad: u16, "endpoint_id" => endpoint_id: u32,
                "ifindex" => ifindex: u32, "src_identity" => src_identity: u32, "dst_identity" => dst_identity: u32,
                "saddr" => saddr: [u32; 4], "daddr" => daddr: [u32; 4], "sport" => sport: u16, "dport" => dport: u16,
                "length" => length: u32,
            ]),
            layout!("lb_frontend_key", LbFrontendKey, [
                "addr" => addr: [u32; 4], "port" => port: u16, "protocol" => protocol: u8,
                "family" => family: u8, "scope" => scope: u8, "pad" => pad: [u8; 3],
            ]),
            layout!("lb_frontend", LbFrontend, [
                "service_id" => service_id: u32, "table_id" => table_id: u32,
                "backend_count" => backend_count: u16, "flags" => flags: u16,
                "affinity_timeout" => affinity_timeout: u32,
            ]),
            layout!("lb_backend", LbBackend, [
                "addr" => addr: [u32; 4], "port" => port: u16, "family" => family: u8, "state" => state: u8,
            ]),
            layout!("lb_maglev_table", LbMaglevTable, ["backend_ids" => backend_ids: [u32; LB_MAGLEV_SIZE]]),
            layout!("lb_rev_nat", LbRevNat, [
                "addr" => addr: [u32; 4], "port" => port: u16, "family" => family: u8, "pad" => pad: u8,
            ]),
            layout!("lb_service_backend", LbServiceBackend, ["backend_id" => backend_id: u32, "flags" => flags: u32]),
            layout!("lb_svc_backend_key", LbSvcBackendKey, ["service_id" => service_id: u32, "index" => index: u32]),
            layout!("lb_service", LbService, [
                "table_id" => table_id: u32, "external_table_id" => external_table_id: u32,
                "affinity_timeout" => affinity_timeout: u32, "backend_count" => backend_count: u16,
                "family" => family: u8, "protocol" => protocol: u8, "flags" => flags: u32, "pad" => pad: u32,
            ]),
            layout!("lb_affinity_key", LbAffinityKey, [
                "client" => client: [u32; 4], "service_id" => service_id: u32, "family" => family: u8,
                "pad" => pad: [u8; 3],
            ]),
            layout!("lb_affinity", LbAffinity, [
                "last_used" => last_used: u64, "backend_id" => backend_id: u32, "pad" => pad: u32,
            ]),
            layout!("lb_flow", LbFlow, [
                "expires" => expires: u64, "addr" => addr: [u32; 4], "port" => port: u16,
                "family" => family: u8, "flags" => flags: u8, "backend_id" => backend_id: u32,
                "service_id" => service_id: u32, "lifetime" => lifetime: u32, "pad" => pad: u32,
                "pad2" => pad2: u32,
            ]),
        ]
    }

    /// No implicit padding anywhere: fields are contiguous and fill the struct
    /// (what makes the `Pod` impls sound and the C layout unambiguous).
    #[test]
    fn layout_has_no_implicit_padding() {
        for (name, fields, size) in layouts() {
            let mut end = 0;
            for (field, offset, len) in &fields {
                assert_eq!(*offset, end, "{name}.{field} does not follow the previous field");
                end = offset + len;
            }
            assert_eq!(end, size, "{name} has trailing padding");
        }
    }

    fn constants() -> Vec<(&'static str, u64)> {
        vec![
            // rivet_common's reserved identities (IDENTITY_HOST/WORLD are theirs).
            ("IDENTITY_ANY", IDENTITY_ANY.into()),
            ("IDENTITY_HOST", IDENTITY_HOST.into()),
            ("IDENTITY_WORLD", IDENTITY_WORLD.into()),
            ("EP_KEY_IFINDEX", EP_KEY_IFINDEX.into()),
            ("EP_KEY_IPV4", EP_KEY_IPV4.into()),
            ("EP_KEY_IPV6", EP_KEY_IPV6.into()),
            ("EP_F_ENFORCE_INGRESS", EP_F_ENFORCE_INGRESS.into()),
            ("EP_F_ENFORCE_EGRESS", EP_F_ENFORCE_EGRESS.into()),
            ("EP_F_ALLOW_FROM_HOST", EP_F_ALLOW_FROM_HOST.into()),
            ("EP_F_HAS_IPV4", EP_F_HAS_IPV4.into()),
            ("EP_F_HAS_IPV6", EP_F_HAS_IPV6.into()),
            ("EP_F_INGRESS_PREFIXES", EP_F_INGRESS_PREFIXES.into()),
            ("EP_F_EGRESS_PREFIXES", EP_F_EGRESS_PREFIXES.into()),
            ("POLICY_DIR_BY_ADDRESS", POLICY_DIR_BY_ADDRESS.into()),
            ("EP_PREFIX_FIXED_BITS", EP_PREFIX_FIXED_BITS.into()),
            ("POLICY_PREFIX_FIXED_BITS", POLICY_PREFIX_FIXED_BITS.into()),
            ("POLICY_PREFIX_FULL_BITS", POLICY_PREFIX_FULL_BITS.into()),
            ("VERDICT_ALLOW", VERDICT_ALLOW.into()),
            ("VERDICT_DENY", VERDICT_DENY.into()),
            ("DIR_INGRESS", DIR_INGRESS.into()),
            ("DIR_EGRESS", DIR_EGRESS.into()),
            ("CT_TCP_SYN", CT_TCP_SYN.into()),
            ("CT_TCP_ESTABLISHED", CT_TCP_ESTABLISHED.into()),
            ("CT_TCP_CLOSING", CT_TCP_CLOSING.into()),
            ("CT_F_SEEN_REPLY", CT_F_SEEN_REPLY.into()),
            ("CT_F_CLOSING_FWD", CT_F_CLOSING_FWD.into()),
            ("CT_F_CLOSING_REV", CT_F_CLOSING_REV.into()),
            ("CT_F_SERVICE", CT_F_SERVICE.into()),
            ("CT_F_NODEPORT", CT_F_NODEPORT.into()),
            ("CONFIG_EVENT_VERDICTS", CONFIG_EVENT_VERDICTS.into()),
            ("CONFIG_EVENT_TRACE", CONFIG_EVENT_TRACE.into()),
            ("REASON_FORWARDED", REASON_FORWARDED.into()),
            ("DROP_POLICY_DENIED", DROP_POLICY_DENIED.into()),
            ("DROP_POLICY_DEFAULT_DENY", DROP_POLICY_DEFAULT_DENY.into()),
            ("DROP_INVALID_PACKET", DROP_INVALID_PACKET.into()),
            ("DROP_UNSUPPORTED_L3", DROP_UNSUPPORTED_L3.into()),
            ("DROP_UNSUPPORTED_L4", DROP_UNSUPPORTED_L4.into()),
            ("DROP_INVALID_SOURCE_ADDRESS", DROP_INVALID_SOURCE_ADDRESS.into()),
            ("DROP_INVALID_SOURCE_MAC", DROP_INVALID_SOURCE_MAC.into()),
            ("DROP_UNKNOWN_ENDPOINT", DROP_UNKNOWN_ENDPOINT.into()),
            ("DROP_CT_MAP_FULL", DROP_CT_MAP_FULL.into()),
            ("DROP_CT_INVALID", DROP_CT_INVALID.into()),
            ("DROP_FRAGMENT_UNSUPPORTED", DROP_FRAGMENT_UNSUPPORTED.into()),
            ("DROP_NO_ROUTE", DROP_NO_ROUTE.into()),
            ("DROP_REDIRECT_FAILED", DROP_REDIRECT_FAILED.into()),
            ("DROP_EXT_HEADER_CHAIN", DROP_EXT_HEADER_CHAIN.into()),
            ("DROP_FRAGMENT_UNTRACKED", DROP_FRAGMENT_UNTRACKED.into()),
            ("DROP_TUNNEL_SOURCE_NOT_NODE", DROP_TUNNEL_SOURCE_NOT_NODE.into()),
            ("DROP_TUNNEL_IDENTITY_INVALID", DROP_TUNNEL_IDENTITY_INVALID.into()),
            ("DROP_NO_TUNNEL_ENDPOINT", DROP_NO_TUNNEL_ENDPOINT.into()),
            ("DROP_NO_SERVICE_BACKEND", DROP_NO_SERVICE_BACKEND.into()),
            ("DROP_NAT_NO_PORT", DROP_NAT_NO_PORT.into()),
            ("LB_MAGLEV_SIZE", LB_MAGLEV_SIZE as u64),
            ("SVC_SCOPE_INTERNAL", SVC_SCOPE_INTERNAL.into()),
            ("SVC_SCOPE_EXTERNAL", SVC_SCOPE_EXTERNAL.into()),
            ("SVC_F_CLUSTER_IP", SVC_F_CLUSTER_IP.into()),
            ("SVC_F_NODE_PORT", SVC_F_NODE_PORT.into()),
            ("SVC_F_AFFINITY", SVC_F_AFFINITY.into()),
            ("SVC_F_LOCAL", SVC_F_LOCAL.into()),
            ("LB_BACKEND_ACTIVE", LB_BACKEND_ACTIVE.into()),
            ("LB_BACKEND_TERMINATING", LB_BACKEND_TERMINATING.into()),
            ("LB_FLOW_FORWARD", LB_FLOW_FORWARD.into()),
            ("LB_SVC_BACKEND_TERMINATING", LB_SVC_BACKEND_TERMINATING.into()),
            ("LB_SVC_BACKEND_NODE_LOCAL", LB_SVC_BACKEND_NODE_LOCAL.into()),
            ("LB_FLOW_REVERSE", LB_FLOW_REVERSE.into()),
            ("LB_FLOW_SNAT_OUT", LB_FLOW_SNAT_OUT.into()),
            ("LB_FLOW_SNAT_IN", LB_FLOW_SNAT_IN.into()),
            ("LB_FLOW_F_HAIRPIN", LB_FLOW_F_HAIRPIN.into()),
            ("LB_FLOW_F_PORT_MAPPED", LB_FLOW_F_PORT_MAPPED.into()),
            ("LB_SOCK_REV_F_DATAGRAM", LB_SOCK_REV_F_DATAGRAM.into()),
            ("IDENTITY_REMOTE_NODE", IDENTITY_REMOTE_NODE.into()),
            ("ROUTING_NONE", ROUTING_NONE.into()),
            ("ROUTING_NATIVE", ROUTING_NATIVE.into()),
            ("ROUTING_VXLAN", ROUTING_VXLAN.into()),
            ("TRACE_TO_OVERLAY", TRACE_TO_OVERLAY.into()),
            ("TRACE_FROM_OVERLAY", TRACE_FROM_OVERLAY.into()),
            ("REASON_MAX", REASON_MAX.into()),
            ("METRICS_ENTRIES", METRICS_ENTRIES.into()),
            ("EVENT_DROP", EVENT_DROP.into()),
            ("EVENT_POLICY_VERDICT", EVENT_POLICY_VERDICT.into()),
            ("EVENT_TRACE", EVENT_TRACE.into()),
            ("TRACE_FROM_CONTAINER", TRACE_FROM_CONTAINER.into()),
            ("TRACE_TO_CONTAINER", TRACE_TO_CONTAINER.into()),
            ("TRACE_TO_STACK", TRACE_TO_STACK.into()),
            ("TRACE_TO_ENDPOINT", TRACE_TO_ENDPOINT.into()),
            ("CT_DEFAULT_TCP_SYN", CtTimeouts::DEFAULT.tcp_syn.into()),
            ("CT_DEFAULT_TCP_ESTABLISHED", CtTimeouts::DEFAULT.tcp_established.into()),
            ("CT_DEFAULT_TCP_CLOSING", CtTimeouts::DEFAULT.tcp_closing.into()),
            ("CT_DEFAULT_UDP", CtTimeouts::DEFAULT.udp.into()),
            ("CT_DEFAULT_ICMP", CtTimeouts::DEFAULT.icmp.into()),
            ("CT_DEFAULT_OTHER", CtTimeouts::DEFAULT.other.into()),
        ]
    }

    /// Every size, field offset, field size and constant checked by clang
    /// itself against rivet.h, with `-target bpf` (what the datapath is
    /// compiled with): a C file of `_Static_assert`s generated from the Rust
    /// side, compiled with `-fsyntax-only`.
    #[test]
    fn layout_matches_rivet_h_according_to_clang() {
        let mut c = String::from("#include <stddef.h>\n#include \"rivet.h\"\n");
        for (name, fields, size) in layouts() {
            writeln!(
                c,
                "_Static_assert(sizeof(struct {name}) == {size}, \"sizeof(struct {name}) != {size}\");"
            )
            .unwrap();
            for (field, offset, len) in fields {
                writeln!(
                    c,
                    "_Static_assert(offsetof(struct {name}, {field}) == {offset}, \"offsetof({name}.{field}) != {offset}\");\n\
                     _Static_assert(sizeof(((struct {name} *)0)->{field}) == {len}, \"sizeof({name}.{field}) != {len}\");"
                )
                .unwrap();
            }
        }
        for (name, value) in constants() {
            writeln!(c, "_Static_assert({name} == {value}ULL, \"{name} != {value}\");").unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("layout.c");
        std::fs::write(&file, &c).unwrap();
        let include_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
        let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
        let out = Command::new(&clang)
            .args([
                "-target",
                "bpf",
                "-fsyntax-only",
                "-Werror",
                "-I",
                "/usr/include/x86_64-linux-gnu",
                "-I",
            ])
            .arg(&include_dir)
            .arg(&file)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {clang} ({e}); the layout test needs clang like the build does"));
        assert!(
            out.status.success(),
            "include/rivet.h and src/maps.rs disagree:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn addresses_are_stored_in_network_order() {
        let key = EndpointKey::ip("198.18.0.1".parse().unwrap());
        assert_eq!(key.kind, EP_KEY_IPV4);
        // In memory: 198, 18, 0, 1 - whatever the host byte order.
        assert_eq!(key.addr[0].to_ne_bytes(), [198, 18, 0, 1]);
        assert_eq!(key.as_ip(), Some("198.18.0.1".parse().unwrap()));

        let v6: Ipv6Addr = "2001:2::1".parse().unwrap();
        let key = EndpointKey::ip(IpAddr::V6(v6));
        assert_eq!(key.kind, EP_KEY_IPV6);
        assert_eq!(key.addr[0].to_ne_bytes(), [0x20, 0x01, 0x00, 0x02]);
        assert_eq!(key.addr[3].to_ne_bytes(), [0, 0, 0, 1]);
        assert_eq!(key.as_ip(), Some(IpAddr::V6(v6)));

        let key = EndpointKey::ifindex(7);
        assert_eq!((key.kind, key.addr), (EP_KEY_IFINDEX, [7, 0, 0, 0]));
        assert_eq!(key.as_ifindex(), Some(7));

        let ct = Ct4Key::new(
            "198.18.0.2:40000".parse().unwrap(),
            "198.18.0.3:80".parse().unwrap(),
            6,
            DIR_EGRESS,
        );
        assert_eq!(ct.dport.to_ne_bytes(), [0, 80]);
        assert_eq!(ct.src(), "198.18.0.2:40000".parse().unwrap());
        assert_eq!(ct.dst().port(), 80);

        let ct6 = Ct6Key::new(
            "[2001:2::2]:1".parse().unwrap(),
            "[2001:2::3]:443".parse().unwrap(),
            17,
            DIR_INGRESS,
        );
        assert_eq!(ct6.dst(), "[2001:2::3]:443".parse().unwrap());
        assert_eq!(ct6.sport.to_ne_bytes(), [0, 1]);

        let mut info = EndpointInfo::default();
        info.set_ipv4(Some("198.18.0.9".parse().unwrap()));
        info.set_ipv6(Some(v6));
        assert_eq!(info.flags, EP_F_HAS_IPV4 | EP_F_HAS_IPV6);
        assert_eq!(info.ipv4_addr(), Some("198.18.0.9".parse().unwrap()));
        assert_eq!(info.ipv6_addr(), Some(v6));
        info.set_ipv4(None);
        assert_eq!(info.ipv4_addr(), None);
        assert_eq!(info.flags, EP_F_HAS_IPV6);
    }

    #[test]
    fn ipcache_keys_count_family_bits_and_clear_host_bits() {
        let key = IpcacheKey::new("198.18.7.9".parse().unwrap(), 16).unwrap();
        assert_eq!(key.prefixlen, 32 + 16);
        assert_eq!(key.data.family, 4);
        assert_eq!(key.data.addr, [ipv4_to_raw("198.18.0.0".parse().unwrap()), 0, 0, 0]);
        assert_eq!(key.prefix(), Some(("198.18.0.0".parse().unwrap(), 16)));
        assert_eq!(IpcacheKey::from_lpm(&key.to_lpm()), key);

        let key = IpcacheKey::new("2001:2::ff".parse().unwrap(), 0).unwrap();
        assert_eq!((key.prefixlen, key.data.family, key.data.addr), (32, 6, [0; 4]));
        let key = IpcacheKey::lookup("2001:2::ff".parse().unwrap());
        assert_eq!(key.prefixlen, 160);
        assert_eq!(key.prefix(), Some(("2001:2::ff".parse().unwrap(), 128)));

        let err = IpcacheKey::new("198.18.0.1".parse().unwrap(), 33).unwrap_err();
        assert_eq!(err.max, 32);
        assert!(err.to_string().contains("198.18.0.1"), "{err}");
        assert!(IpcacheKey::new("2001:2::".parse().unwrap(), 129).is_err());
    }

    #[test]
    fn policy_keys_store_the_port_prefix_in_network_order() {
        let key = PolicyKey::new(9, 300, DIR_INGRESS, 6, 0x1234, 12);
        assert_eq!(key.prefixlen, POLICY_PREFIX_FIXED_BITS + 12);
        assert_eq!(key.data.dport.to_ne_bytes(), [0x12, 0x30]);
        assert_eq!(key.port(), 0x1230);
        assert_eq!(key.port_bits(), Some(12));
        assert_eq!(PolicyKey::from_lpm(&key.to_lpm()), key);
        let any = PolicyKey::new(9, 0, DIR_EGRESS, 0, 80, 0);
        assert_eq!((any.prefixlen, any.data.dport), (POLICY_PREFIX_FIXED_BITS, 0));
        assert_eq!(
            PolicyKey::lookup(1, 2, DIR_EGRESS, 17, 53).prefixlen,
            POLICY_PREFIX_FULL_BITS
        );
    }

    #[test]
    fn ep_prefix_keys_count_the_fixed_bits_and_clear_host_bits() {
        let key = EpPrefixKey::new(7, DIR_EGRESS, "198.18.0.77".parse().unwrap(), 24).unwrap();
        assert_eq!(key.prefixlen, EP_PREFIX_FIXED_BITS + 24);
        assert_eq!(
            (key.data.endpoint_id, key.data.direction, key.data.family),
            (7, DIR_EGRESS, 4)
        );
        assert_eq!(key.data.addr[0].to_ne_bytes(), [198, 18, 0, 0]);
        assert_eq!(key.prefix(), Some(("198.18.0.0".parse().unwrap(), 24)));
        assert_eq!(EpPrefixKey::from_lpm(&key.to_lpm()), key);
        let lookup = EpPrefixKey::lookup(7, DIR_INGRESS, "2001:2::5".parse().unwrap());
        assert_eq!((lookup.prefixlen, lookup.data.family), (EP_PREFIX_FIXED_BITS + 128, 6));
        assert!(EpPrefixKey::new(7, DIR_INGRESS, "2001:2::".parse().unwrap(), 129).is_err());
        let mut bad = key;
        bad.data.addr[0] = ipv4_to_raw("198.18.0.1".parse().unwrap());
        assert_eq!(bad.prefix(), None, "host bits set");
        bad = key;
        bad.data.family = 5;
        assert_eq!(bad.prefix(), None, "unknown family");
    }

    #[test]
    fn service_entries_store_network_order_and_read_back() {
        let vip: SocketAddr = "198.19.128.10:80".parse().unwrap();
        let key = LbFrontendKey::vip(vip, 6, SVC_SCOPE_INTERNAL);
        assert_eq!(key.addr[0].to_ne_bytes(), [198, 19, 128, 10]);
        assert_eq!(key.port.to_ne_bytes(), [0, 80]);
        assert_eq!(
            (key.family, key.protocol, key.ip(), key.port()),
            (4, 6, Some(vip.ip()), 80)
        );
        let np = LbFrontendKey::node_port(6, 30080, 17, SVC_SCOPE_EXTERNAL);
        assert_eq!((np.addr, np.family, np.ip(), np.port()), ([0; 4], 6, None, 30080));

        let backend: SocketAddr = "[2001:2::5]:8080".parse().unwrap();
        let b = LbBackend::new(backend, LB_BACKEND_TERMINATING);
        assert_eq!(b.addr[0].to_ne_bytes(), [0x20, 0x01, 0, 2]);
        assert_eq!(
            (b.family, b.state, b.socket_addr()),
            (6, LB_BACKEND_TERMINATING, Some(backend))
        );
        assert_eq!(LbRevNat::new(vip).socket_addr(), Some(vip));
        let affinity = LbAffinityKey::new(backend.ip(), 7);
        assert_eq!((affinity.client_ip(), affinity.service_id), (Some(backend.ip()), 7));
        let flow = LbFlow {
            addr: b.addr,
            port: b.port,
            family: 6,
            ..LbFlow::default()
        };
        assert_eq!(flow.socket_addr(), Some(backend));
        assert_eq!(LbMaglevTable::default().backend_ids, [0; LB_MAGLEV_SIZE]);
        assert_eq!(reason_name(DROP_NO_SERVICE_BACKEND), "no_service_backend");
        assert_eq!(reason_name(DROP_NAT_NO_PORT), "nat_no_port");
    }

    #[test]
    fn events_decode_from_ring_buffer_bytes() {
        let mut event = Event {
            timestamp: 5,
            kind: EVENT_DROP,
            reason: DROP_POLICY_DENIED,
            family: 4,
            protocol: 6,
            sport: 1234u16.to_be(),
            dport: 80u16.to_be(),
            ..Event::default()
        };
        event.saddr[0] = ipv4_to_raw("198.18.0.2".parse().unwrap());
        event.daddr[0] = ipv4_to_raw("198.18.0.3".parse().unwrap());
        let mut bytes = vec![0u8; 1];
        // SAFETY: Event is plain old data without padding.
        bytes.extend_from_slice(unsafe {
            std::slice::from_raw_parts((&raw const event).cast::<u8>(), size_of::<Event>())
        });
        let decoded = Event::from_bytes(&bytes[1..]).unwrap(); // unaligned on purpose
        assert_eq!(decoded, event);
        assert_eq!(decoded.src_ip(), Some("198.18.0.2".parse().unwrap()));
        assert_eq!((decoded.src_port(), decoded.dst_port()), (1234, 80));
        assert_eq!(Event::from_bytes(&bytes[1..40]), None);
        assert_eq!(reason_name(DROP_POLICY_DENIED), "policy_denied");
        assert_eq!(metrics_index(DROP_POLICY_DENIED, DIR_EGRESS), 6);
    }
}
