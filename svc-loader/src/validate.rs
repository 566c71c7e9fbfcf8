//! Turns client requests into checked domain values. The loader is
//! privileged and its clients are not: every field is validated whole before
//! anything is written, and errors name the field (INVALID_ARGUMENT).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use rivet_common::identity::{self, CIDR_IDENTITY_MAX, CIDR_IDENTITY_MIN};
use rivet_proto::loader::v1 as pb;
use rivet_proto::net::IpPrefix;

use crate::policy_lpm::PolicyRule;
use crate::routing::{MAX_PEERS, MAX_POD_CIDRS, PeerNode, RoutingMode};
use rivet_datapath::maps::{DIR_EGRESS, DIR_INGRESS, IpcacheValue, VERDICT_ALLOW, VERDICT_DENY};

/// Most policy entries one endpoint may have (Cilium's per-endpoint map size).
pub const MAX_POLICY_ENTRIES: usize = 16384;
/// Most entries in one ipcache batch.
pub const MAX_IPCACHE_BATCH: usize = 4096;
/// Most address prefixes one endpoint may have (both directions).
pub const MAX_POLICY_PREFIXES: usize = 4096;

/// A request field that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct InvalidField {
    /// The field, as a path (`policy.entries[3].port`).
    pub field: String,
    /// What is wrong.
    pub reason: String,
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> InvalidField {
    InvalidField {
        field: field.into(),
        reason: reason.into(),
    }
}

/// A checked endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSpec {
    /// 1..=65535.
    pub endpoint_id: u32,
    /// Host-side veth, in the loader's network namespace.
    pub ifindex: u32,
    /// The pod's IPv4 address.
    pub ipv4: Option<Ipv4Addr>,
    /// The pod's IPv6 address.
    pub ipv6: Option<Ipv6Addr>,
    /// The pod-side MAC.
    pub mac: [u8; 6],
    /// Security identity.
    pub identity: u32,
    /// Policy to realise; `None` keeps the current one (a new endpoint
    /// starts enforced with no entries: fail closed).
    pub policy: Option<PolicySpec>,
}

/// A checked endpoint policy.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PolicySpec {
    /// svc-endpoint's revision.
    pub revision: u64,
    /// Ingress is enforced (some policy selects the pod for ingress).
    pub enforce_ingress: bool,
    /// Egress is enforced.
    pub enforce_egress: bool,
    /// Traffic from the host identity always enters.
    pub allow_from_host: bool,
    /// The rules.
    pub rules: Vec<PolicyRule>,
    /// The prefixes address-matched rules are looked up through, unique by
    /// (direction, address, length).
    pub prefixes: Vec<PolicyPrefix>,
}

/// One prefix of an endpoint's policy (`EndpointPrefix`): peer addresses in
/// `direction` whose longest prefix this is match the address-matched rules
/// of `cidr_identity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PolicyPrefix {
    /// `DIR_INGRESS` or `DIR_EGRESS`.
    pub direction: u8,
    /// The prefix's address (host bits clear).
    pub addr: IpAddr,
    /// The prefix length.
    pub len: u8,
    /// Its CIDR identity (>= 2^24).
    pub cidr_identity: u32,
}

/// Checks an ApplyEndpoint request.
pub fn endpoint(r: &pb::ApplyEndpointRequest) -> Result<EndpointSpec, InvalidField> {
    let endpoint_id = endpoint_id("endpoint_id", r.endpoint_id)?;
    if r.host_ifindex == 0 {
        return Err(invalid("host_ifindex", "must be set"));
    }
    if r.addresses.is_empty() || r.addresses.len() > 2 {
        return Err(invalid("addresses", "one IPv4 and/or one IPv6 address is required"));
    }
    let (mut ipv4, mut ipv6) = (None, None);
    for (i, raw) in r.addresses.iter().enumerate() {
        let field = format!("addresses[{i}]");
        match address(&field, raw)? {
            IpAddr::V4(a) if ipv4.is_none() => ipv4 = Some(a),
            IpAddr::V6(a) if ipv6.is_none() => ipv6 = Some(a),
            _ => return Err(invalid(field, "at most one address per family")),
        }
    }
    let mac: [u8; 6] = r
        .mac
        .as_slice()
        .try_into()
        .map_err(|_| invalid("mac", format!("must be 6 bytes, got {}", r.mac.len())))?;
    if mac == [0; 6] || mac[0] & 1 == 1 {
        return Err(invalid("mac", "must be a unicast, non-zero MAC"));
    }
    if r.identity == 0 {
        return Err(invalid("identity", "must be non-zero"));
    }
    let policy = r.policy.as_ref().map(policy).transpose()?;
    Ok(EndpointSpec {
        endpoint_id,
        ifindex: r.host_ifindex,
        ipv4,
        ipv6,
        mac,
        identity: r.identity,
        policy,
    })
}

/// Checks an endpoint id (1..=65535).
pub fn endpoint_id(field: &str, id: u32) -> Result<u32, InvalidField> {
    if id == 0 || id > 65535 {
        return Err(invalid(field, format!("must be 1..=65535, got {id}")));
    }
    Ok(id)
}

/// Checks an address: 4 or 16 bytes, not IPv4-mapped, not unspecified.
pub fn address(field: &str, raw: &[u8]) -> Result<IpAddr, InvalidField> {
    let addr = rivet_proto::net::address_from_bytes(raw).map_err(|e| invalid(field, e.to_string()))?;
    if addr.is_unspecified() || addr.is_multicast() {
        return Err(invalid(field, format!("{addr} is not a unicast address")));
    }
    Ok(addr)
}

/// Checks a prefix: address bytes with no bits beyond the prefix length.
pub fn prefix(field: &str, p: Option<&IpPrefix>) -> Result<(IpAddr, u8), InvalidField> {
    use rivet_proto::net::AddressError;
    let p = p.ok_or_else(|| invalid(field, "required"))?;
    let net = rivet_proto::net::prefix_from_proto(p).map_err(|e| {
        let part = match e {
            AddressError::PrefixLength { .. } => "prefix_length",
            _ => "address",
        };
        invalid(format!("{field}.{part}"), e.to_string())
    })?;
    Ok((net.addr(), net.prefix_len()))
}

/// Checks the entries of an UpsertIpcache request or of one ReplaceIpcache
/// chunk: at most [`MAX_IPCACHE_BATCH`], each a canonical prefix with a
/// non-zero identity and an empty or IPv4 tunnel endpoint.
pub fn ipcache_entries(
    field: &str,
    entries: &[pb::IpcacheEntry],
) -> Result<Vec<(IpAddr, u8, IpcacheValue)>, InvalidField> {
    if entries.len() > MAX_IPCACHE_BATCH {
        return Err(invalid(
            field,
            format!(
                "{} entries exceed the batch limit of {MAX_IPCACHE_BATCH}",
                entries.len()
            ),
        ));
    }
    entries
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let f = format!("{field}[{i}]");
            let (addr, len) = prefix(&format!("{f}.prefix"), e.prefix.as_ref())?;
            if e.identity == 0 {
                return Err(invalid(format!("{f}.identity"), "must be non-zero"));
            }
            let tunnel = match rivet_proto::net::optional_address_from_bytes(&e.tunnel_endpoint) {
                Ok(None) => None,
                Ok(Some(IpAddr::V4(a))) => Some(a),
                _ => {
                    return Err(invalid(
                        format!("{f}.tunnel_endpoint"),
                        format!(
                            "must be empty or 4 bytes (IPv4 underlay), got {}",
                            e.tunnel_endpoint.len()
                        ),
                    ));
                }
            };
            Ok((addr, len, IpcacheValue::new(e.identity, tunnel)))
        })
        .collect()
}

/// Checks the prefixes of a DeleteIpcache request: at most
/// [`MAX_IPCACHE_BATCH`], each canonical.
pub fn ipcache_prefixes(field: &str, prefixes: &[IpPrefix]) -> Result<Vec<(IpAddr, u8)>, InvalidField> {
    if prefixes.len() > MAX_IPCACHE_BATCH {
        return Err(invalid(
            field,
            format!(
                "{} entries exceed the batch limit of {MAX_IPCACHE_BATCH}",
                prefixes.len()
            ),
        ));
    }
    prefixes
        .iter()
        .enumerate()
        .map(|(i, p)| prefix(&format!("{field}[{i}]"), Some(p)))
        .collect()
}

fn direction(field: String, raw: i32, p: &pb::EndpointPolicy) -> Result<u8, InvalidField> {
    let (direction, enforced) = match pb::Direction::try_from(raw) {
        Ok(pb::Direction::Ingress) => (DIR_INGRESS, p.enforce_ingress),
        Ok(pb::Direction::Egress) => (DIR_EGRESS, p.enforce_egress),
        _ => return Err(invalid(field, "must be INGRESS or EGRESS")),
    };
    if !enforced {
        return Err(invalid(
            field,
            "a direction that is not enforced takes no entries or prefixes",
        ));
    }
    Ok(direction)
}

fn policy(p: &pb::EndpointPolicy) -> Result<PolicySpec, InvalidField> {
    if p.entries.len() > MAX_POLICY_ENTRIES {
        return Err(invalid(
            "policy.entries",
            format!("{} entries exceed the limit of {MAX_POLICY_ENTRIES}", p.entries.len()),
        ));
    }
    let prefixes = policy_prefixes(p)?;
    let mut rules = Vec::with_capacity(p.entries.len());
    for (i, e) in p.entries.iter().enumerate() {
        let f = |name: &str| format!("policy.entries[{i}].{name}");
        let direction = direction(f("direction"), e.direction, p)?;
        let verdict = match pb::Verdict::try_from(e.verdict) {
            Ok(pb::Verdict::Allow) => VERDICT_ALLOW,
            Ok(pb::Verdict::Deny) => VERDICT_DENY,
            _ => return Err(invalid(f("verdict"), "must be ALLOW or DENY")),
        };
        let protocol = match pb::Protocol::try_from(e.protocol) {
            Ok(pb::Protocol::Any) => 0u8,
            Ok(pb::Protocol::Unspecified) | Err(_) => return Err(invalid(f("protocol"), "must be set")),
            Ok(p) => p as i32 as u8,
        };
        let ported = matches!(protocol, 6 | 17 | 132);
        if e.port > 65535 || e.end_port > 65535 {
            return Err(invalid(f("port"), "ports are 0..=65535"));
        }
        if !ported && (e.port != 0 || e.end_port != 0) {
            return Err(invalid(f("port"), "only TCP, UDP and SCTP entries take ports"));
        }
        if e.end_port != 0 && (e.port == 0 || e.end_port < e.port) {
            return Err(invalid(f("end_port"), "must be >= port, with port set"));
        }
        let by_address = match pb::PeerKind::try_from(e.peer_kind) {
            Ok(pb::PeerKind::Identity) => false,
            Ok(pb::PeerKind::Address) => true,
            Err(_) => return Err(invalid(f("peer_kind"), "must be IDENTITY or ADDRESS")),
        };
        if by_address {
            cidr_identity(f("peer_identity"), e.peer_identity)?;
            if !prefixes
                .iter()
                .any(|p| p.direction == direction && p.cidr_identity == e.peer_identity)
            {
                return Err(invalid(
                    f("peer_identity"),
                    format!(
                        "CIDR identity {} is not the identity of any of policy.prefixes in this direction",
                        e.peer_identity
                    ),
                ));
            }
        }
        rules.push(PolicyRule {
            direction,
            by_address,
            peer_identity: e.peer_identity,
            protocol,
            port: e.port as u16,
            end_port: e.end_port as u16,
            verdict,
        });
    }
    Ok(PolicySpec {
        revision: p.revision,
        enforce_ingress: p.enforce_ingress,
        enforce_egress: p.enforce_egress,
        allow_from_host: p.allow_from_host,
        rules,
        prefixes,
    })
}

/// Checks a CIDR identity ([`identity::is_cidr`]): address-matched entries
/// and prefixes name one.
fn cidr_identity(field: String, id: u32) -> Result<u32, InvalidField> {
    if !identity::is_cidr(id) {
        return Err(invalid(
            field,
            format!("must be the CIDR identity of a prefix ({CIDR_IDENTITY_MIN}..={CIDR_IDENTITY_MAX}), got {id}"),
        ));
    }
    Ok(id)
}

fn policy_prefixes(p: &pb::EndpointPolicy) -> Result<Vec<PolicyPrefix>, InvalidField> {
    if p.prefixes.len() > MAX_POLICY_PREFIXES {
        return Err(invalid(
            "policy.prefixes",
            format!(
                "{} prefixes exceed the limit of {MAX_POLICY_PREFIXES}",
                p.prefixes.len()
            ),
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(p.prefixes.len());
    let mut out = Vec::with_capacity(p.prefixes.len());
    for (i, raw) in p.prefixes.iter().enumerate() {
        let f = |name: &str| format!("policy.prefixes[{i}].{name}");
        let direction = direction(f("direction"), raw.direction, p)?;
        let (addr, len) = prefix(&f("prefix"), raw.prefix.as_ref())?;
        cidr_identity(f("cidr_identity"), raw.cidr_identity)?;
        if !seen.insert((direction, addr, len)) {
            return Err(invalid(
                f("prefix"),
                format!("{addr}/{len} appears twice in this direction"),
            ));
        }
        out.push(PolicyPrefix {
            direction,
            addr,
            len,
            cidr_identity: raw.cidr_identity,
        });
    }
    Ok(out)
}

/// The peers of a `ReplaceNodes`, checked whole for routing `mode`: at most
/// [`MAX_PEERS`], each named by a unique DNS-1123 subdomain, with an
/// underlay address of 4 and/or 16 bytes (unicast; in vxlan mode the IPv4
/// one is required: tunnel endpoints are IPv4), at most
/// [`MAX_POD_CIDRS`] canonical, non-default pod CIDRs that overlap no other
/// peer's; in native mode an IPv6 pod CIDR needs an IPv6 underlay address.
pub fn peer_nodes(field: &str, nodes: &[pb::PeerNode], mode: RoutingMode) -> Result<Vec<PeerNode>, InvalidField> {
    if nodes.len() > MAX_PEERS {
        return Err(invalid(
            field,
            format!("{} nodes exceed the limit of {MAX_PEERS}", nodes.len()),
        ));
    }
    let mut names = std::collections::HashMap::new();
    let mut cidrs: Vec<(ipnet::IpNet, String)> = Vec::new();
    let mut peers = Vec::with_capacity(nodes.len());
    for (i, n) in nodes.iter().enumerate() {
        let f = format!("{field}[{i}]");
        rivet_common::k8s_name::check_dns_subdomain(&n.name)
            .map_err(|e| invalid(format!("{f}.name"), e.to_string()))?;
        if let Some(first) = names.insert(n.name.as_str(), i) {
            return Err(invalid(
                format!("{f}.name"),
                format!("{:?} is also {field}[{first}]", n.name),
            ));
        }
        let underlay_ipv4 = match underlay(&format!("{f}.underlay_ipv4"), &n.underlay_ipv4, 4)? {
            Some(IpAddr::V4(a)) => Some(a),
            _ => None,
        };
        let underlay_ipv6 = match underlay(&format!("{f}.underlay_ipv6"), &n.underlay_ipv6, 16)? {
            Some(IpAddr::V6(a)) => Some(a),
            _ => None,
        };
        if underlay_ipv4.is_none() && underlay_ipv6.is_none() {
            return Err(invalid(
                format!("{f}.underlay_ipv4"),
                "a node needs an underlay address",
            ));
        }
        if mode == RoutingMode::Vxlan && underlay_ipv4.is_none() {
            return Err(invalid(
                format!("{f}.underlay_ipv4"),
                "required in vxlan mode (tunnel endpoints are IPv4)",
            ));
        }
        if n.pod_cidrs.len() > MAX_POD_CIDRS {
            return Err(invalid(
                format!("{f}.pod_cidrs"),
                format!("{} CIDRs exceed the limit of {MAX_POD_CIDRS}", n.pod_cidrs.len()),
            ));
        }
        let mut pod_cidrs = Vec::with_capacity(n.pod_cidrs.len());
        for (j, c) in n.pod_cidrs.iter().enumerate() {
            let cf = format!("{f}.pod_cidrs[{j}]");
            let (addr, len) = prefix(&cf, Some(c))?;
            let net = ipnet::IpNet::new(addr, len).expect("a checked prefix");
            if len == 0 {
                return Err(invalid(
                    format!("{cf}.prefix_length"),
                    "a default route is not a pod CIDR",
                ));
            }
            if mode == RoutingMode::Native && net.addr().is_ipv6() && underlay_ipv6.is_none() {
                return Err(invalid(
                    cf,
                    "an IPv6 pod CIDR needs the node's underlay_ipv6 in native routing (no IPv6 route via an IPv4 next hop)",
                ));
            }
            cidrs.push((net, cf));
            pod_cidrs.push(net);
        }
        peers.push(PeerNode {
            name: n.name.clone(),
            underlay_ipv4,
            underlay_ipv6,
            pod_cidrs,
        });
    }
    // Sorted by network address, a CIDR overlaps an earlier one exactly
    // when it starts before the farthest end seen so far (per family).
    cidrs.sort_by_key(|(net, _)| (net.addr().is_ipv6(), net.network(), net.prefix_len()));
    let mut widest: Option<&(ipnet::IpNet, String)> = None;
    for c in &cidrs {
        if let Some(w) = widest
            && w.0.addr().is_ipv6() == c.0.addr().is_ipv6()
            && c.0.network() <= w.0.broadcast()
        {
            return Err(invalid(&c.1, format!("{} overlaps {} ({})", c.0, w.0, w.1)));
        }
        if widest.is_none_or(|w| w.0.addr().is_ipv6() != c.0.addr().is_ipv6() || c.0.broadcast() > w.0.broadcast()) {
            widest = Some(c);
        }
    }
    Ok(peers)
}

/// An optional underlay address of `len` bytes: unicast, not loopback or
/// unspecified.
fn underlay(field: &str, raw: &[u8], len: usize) -> Result<Option<IpAddr>, InvalidField> {
    if raw.is_empty() {
        return Ok(None);
    }
    if raw.len() != len {
        return Err(invalid(
            field,
            format!("must be empty or {len} bytes, got {}", raw.len()),
        ));
    }
    let a = rivet_proto::net::address_from_bytes(raw).map_err(|e| invalid(field, e.to_string()))?;
    if a.is_unspecified() || a.is_loopback() || a.is_multicast() || a == IpAddr::V4(Ipv4Addr::BROADCAST) {
        return Err(invalid(field, format!("{a} is not a unicast address")));
    }
    Ok(Some(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(name: &str, v4: &[u8], v6: &[u8], cidrs: &[(&[u8], u32)]) -> pb::PeerNode {
        pb::PeerNode {
            name: name.into(),
            underlay_ipv4: v4.to_vec(),
            underlay_ipv6: v6.to_vec(),
            pod_cidrs: cidrs
                .iter()
                .map(|(a, l)| IpPrefix {
                    address: a.to_vec(),
                    prefix_length: *l,
                })
                .collect(),
        }
    }

    const V6_NET: [u8; 16] = [0x20, 0x01, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0];
    const V6_NODE: [u8; 16] = [0x20, 0x01, 0, 2, 0, 0, 0, 0xfe, 0, 0, 0, 0, 0, 0, 0, 3];

    #[test]
    fn peer_nodes_refuse_what_the_mode_cannot_route_and_overlaps() {
        let v4_only = [peer("n3", &[198, 19, 254, 3], &[], &[(&V6_NET, 64)])];
        let err = peer_nodes("nodes", &v4_only, RoutingMode::Native).unwrap_err();
        assert_eq!(err.field, "nodes[0].pod_cidrs[0]", "{err}");
        // vxlan carries IPv6 pods over the IPv4 underlay.
        assert!(peer_nodes("nodes", &v4_only, RoutingMode::Vxlan).is_ok());
        let v6_only = [peer("n3", &[], &V6_NODE, &[(&[198, 18, 3, 0], 24)])];
        assert_eq!(
            peer_nodes("nodes", &v6_only, RoutingMode::Vxlan).unwrap_err().field,
            "nodes[0].underlay_ipv4"
        );
        // RFC 5549: an IPv4 CIDR via an IPv6 next hop.
        assert!(peer_nodes("nodes", &v6_only, RoutingMode::Native).is_ok());
        let nested = [
            peer("a", &[198, 19, 254, 3], &[], &[(&[198, 18, 0, 0], 16)]),
            peer("b", &[198, 19, 254, 4], &[], &[(&[198, 18, 200, 0], 24)]),
        ];
        let err = peer_nodes("nodes", &nested, RoutingMode::Vxlan).unwrap_err();
        assert_eq!(err.field, "nodes[1].pod_cidrs[0]", "{err}");
        assert!(
            err.reason.contains("overlaps 198.18.0.0/16 (nodes[0].pod_cidrs[0])"),
            "{err}"
        );
        let default_route = [peer("a", &[198, 19, 254, 3], &[], &[(&[0, 0, 0, 0], 0)])];
        assert_eq!(
            peer_nodes("nodes", &default_route, RoutingMode::Vxlan)
                .unwrap_err()
                .field,
            "nodes[0].pod_cidrs[0].prefix_length"
        );
        let loopback = [peer("a", &[127, 0, 0, 1], &[], &[])];
        assert_eq!(
            peer_nodes("nodes", &loopback, RoutingMode::Vxlan).unwrap_err().field,
            "nodes[0].underlay_ipv4"
        );
    }

    fn request() -> pb::ApplyEndpointRequest {
        pb::ApplyEndpointRequest {
            endpoint_id: 7,
            host_ifindex: 12,
            addresses: vec![
                vec![198, 18, 0, 2],
                "2001:2::2".parse::<Ipv6Addr>().unwrap().octets().to_vec(),
            ],
            mac: vec![0x02, 0, 0, 0, 0, 1],
            identity: 256,
            policy: Some(pb::EndpointPolicy {
                revision: 3,
                enforce_ingress: true,
                enforce_egress: false,
                allow_from_host: true,
                entries: vec![
                    pb::PolicyEntry {
                        direction: pb::Direction::Ingress as i32,
                        peer_identity: 300,
                        protocol: pb::Protocol::Tcp as i32,
                        port: 8000,
                        end_port: 8080,
                        verdict: pb::Verdict::Allow as i32,
                        peer_kind: pb::PeerKind::Identity as i32,
                    },
                    pb::PolicyEntry {
                        direction: pb::Direction::Ingress as i32,
                        peer_identity: CIDR_IDENTITY_MIN + 1,
                        protocol: pb::Protocol::Any as i32,
                        port: 0,
                        end_port: 0,
                        verdict: pb::Verdict::Deny as i32,
                        peer_kind: pb::PeerKind::Address as i32,
                    },
                ],
                prefixes: vec![pb::EndpointPrefix {
                    direction: pb::Direction::Ingress as i32,
                    prefix: Some(IpPrefix {
                        address: vec![198, 18, 0, 0],
                        prefix_length: 15,
                    }),
                    cidr_identity: CIDR_IDENTITY_MIN + 1,
                }],
            }),
        }
    }

    #[test]
    fn a_good_request_converts() {
        let spec = endpoint(&request()).unwrap();
        assert_eq!(spec.ipv4, Some(Ipv4Addr::new(198, 18, 0, 2)));
        let policy = spec.policy.unwrap();
        assert_eq!(policy.rules[0].end_port, 8080);
        assert!(!policy.rules[0].by_address);
        assert!(policy.rules[1].by_address);
        assert_eq!(
            policy.prefixes,
            [PolicyPrefix {
                direction: DIR_INGRESS,
                addr: "198.18.0.0".parse().unwrap(),
                len: 15,
                cidr_identity: CIDR_IDENTITY_MIN + 1,
            }]
        );
    }

    #[test]
    fn each_bad_field_is_named() {
        type Mutation = Box<dyn Fn(&mut pb::ApplyEndpointRequest)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("endpoint_id", Box::new(|r| r.endpoint_id = 0)),
            ("endpoint_id", Box::new(|r| r.endpoint_id = 70000)),
            ("host_ifindex", Box::new(|r| r.host_ifindex = 0)),
            ("addresses", Box::new(|r| r.addresses.clear())),
            ("addresses[0]", Box::new(|r| r.addresses[0] = vec![1, 2, 3])),
            ("addresses[1]", Box::new(|r| r.addresses[1] = vec![198, 18, 0, 3])),
            (
                "addresses[1]",
                Box::new(|r| r.addresses[1] = "::ffff:198.18.0.3".parse::<Ipv6Addr>().unwrap().octets().to_vec()),
            ),
            ("addresses[0]", Box::new(|r| r.addresses[0] = vec![0, 0, 0, 0])),
            ("mac", Box::new(|r| r.mac = vec![1, 2, 3])),
            ("mac", Box::new(|r| r.mac = vec![0x01, 0, 0x5e, 0, 0, 1])),
            ("identity", Box::new(|r| r.identity = 0)),
            (
                "policy.entries[0].direction",
                Box::new(|r| r.policy.as_mut().unwrap().entries[0].direction = 0),
            ),
            (
                "policy.entries[0].direction",
                Box::new(|r| r.policy.as_mut().unwrap().entries[0].direction = pb::Direction::Egress as i32),
            ),
            (
                "policy.entries[0].verdict",
                Box::new(|r| r.policy.as_mut().unwrap().entries[0].verdict = 9),
            ),
            (
                "policy.entries[0].protocol",
                Box::new(|r| r.policy.as_mut().unwrap().entries[0].protocol = 0),
            ),
            (
                "policy.entries[0].port",
                Box::new(|r| r.policy.as_mut().unwrap().entries[0].protocol = pb::Protocol::Icmp as i32),
            ),
            (
                "policy.entries[0].port",
                Box::new(|r| r.policy.as_mut().unwrap().entries[0].protocol = pb::Protocol::Any as i32),
            ),
            (
                "policy.entries[0].port",
                Box::new(|r| r.policy.as_mut().unwrap().entries[0].port = 70000),
            ),
            (
                "policy.entries[0].end_port",
                Box::new(|r| r.policy.as_mut().unwrap().entries[0].end_port = 10),
            ),
            (
                "policy.entries[0].peer_kind",
                Box::new(|r| r.policy.as_mut().unwrap().entries[0].peer_kind = 7),
            ),
            (
                "policy.entries[1].peer_identity",
                Box::new(|r| r.policy.as_mut().unwrap().entries[1].peer_identity = 300),
            ),
            (
                "policy.entries[1].peer_identity",
                Box::new(|r| r.policy.as_mut().unwrap().entries[1].peer_identity = CIDR_IDENTITY_MIN + 2),
            ),
            (
                "policy.prefixes",
                Box::new(|r| {
                    let p = r.policy.as_mut().unwrap();
                    p.prefixes = vec![p.prefixes[0].clone(); MAX_POLICY_PREFIXES + 1];
                }),
            ),
            (
                "policy.prefixes[0].direction",
                Box::new(|r| r.policy.as_mut().unwrap().prefixes[0].direction = pb::Direction::Egress as i32),
            ),
            (
                "policy.prefixes[0].direction",
                Box::new(|r| r.policy.as_mut().unwrap().prefixes[0].direction = 9),
            ),
            (
                "policy.prefixes[0].prefix",
                Box::new(|r| r.policy.as_mut().unwrap().prefixes[0].prefix = None),
            ),
            (
                "policy.prefixes[0].prefix.address",
                Box::new(|r| {
                    r.policy.as_mut().unwrap().prefixes[0].prefix.as_mut().unwrap().address = vec![198, 19, 0, 0]
                }),
            ),
            (
                "policy.prefixes[0].prefix.prefix_length",
                Box::new(|r| {
                    r.policy.as_mut().unwrap().prefixes[0]
                        .prefix
                        .as_mut()
                        .unwrap()
                        .prefix_length = 33
                }),
            ),
            (
                "policy.prefixes[0].cidr_identity",
                Box::new(|r| r.policy.as_mut().unwrap().prefixes[0].cidr_identity = 256),
            ),
            (
                "policy.prefixes[1].prefix",
                Box::new(|r| {
                    let p = r.policy.as_mut().unwrap();
                    let mut again = p.prefixes[0].clone();
                    again.cidr_identity += 5;
                    p.prefixes.push(again);
                }),
            ),
        ];
        for (field, mutate) in cases {
            let mut r = request();
            mutate(&mut r);
            let err = endpoint(&r).expect_err("a bad field must be refused");
            assert_eq!(err.field, field, "{err}");
        }
    }

    #[test]
    fn prefixes_must_be_aligned() {
        let p = |a: Vec<u8>, l| IpPrefix {
            address: a,
            prefix_length: l,
        };
        assert!(prefix("p", Some(&p(vec![198, 18, 0, 0], 24))).is_ok());
        assert_eq!(
            prefix("p", Some(&p(vec![198, 18, 0, 1], 24))).unwrap_err().field,
            "p.address"
        );
        assert_eq!(
            prefix("p", Some(&p(vec![198, 18, 0, 0], 33))).unwrap_err().field,
            "p.prefix_length"
        );
        assert!(prefix("p", Some(&p(vec![0; 16], 0))).is_ok());
        assert_eq!(prefix("p", None).unwrap_err().field, "p");
    }
}
