//! The packet target's harness: the datapath it sets up, the frames it
//! builds and what it checks (see the target's docs).

use std::ffi::CString;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};
use std::process::Command;

use aya::maps::{MapData, RingBuf};
use ipnet::IpNet;
use rivet_common::identity::CIDR_IDENTITY_MIN;
use rivet_common::labels::Labels;
use rivet_policy::{Decision, Direction, PacketPeer, Policy, PolicyOrigin, PolicyRepository, SelectorCache, Subject};
use rivet_proto::loader::v1 as pb;
use svc_loader::datapath::{Datapath, DatapathOptions, Hook};
use svc_loader::loader::EndpointDatapath;
use svc_loader::maps::{self, Ct4Key, Ct6Key, Event, IpcacheValue};

use crate::frames::{self, ExtHeader, proto};

/// Most frames a structured input builds.
const MAX_FRAMES: usize = 8;
/// Bytes per structured record.
const RECORD: usize = 10;
/// Frames longer than this are cut (an MTU-sized frame; the kernel's
/// limit for a test run is about a page).
const MAX_FRAME: usize = 1514;

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
const ETH_P_ARP: u16 = 0x0806;

/// Host-side veth prefix: rvpf0 the client's, rvpf2 the server's, rvpf4
/// one with no endpoint.
const PREFIX: &str = "rvpf";
const NAMESPACE: &str = "fuzz";
const HOST: u32 = 1;
const WORLD: u32 = 2;
const REMOTE_NODE: u32 = 6;

/// The policies: the server takes the clients on a few ports, anyone on
/// 9000 and an ipBlock on 22; the clients reach the server, DNS anywhere
/// and the ipBlock on 443; every pod here denies the intruder and SMTP
/// out, and allows ICMP in from the cluster and out to world and cluster.
const POLICIES: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: server-in, namespace: fuzz}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress]
  ingress:
  - from: [{podSelector: {matchLabels: {app: client}}}]
    ports:
    - {protocol: TCP, port: 80}
    - {protocol: TCP, port: 443}
    - {protocol: TCP, port: 8000, endPort: 8100}
    - {protocol: UDP, port: 53}
  - ports: [{protocol: TCP, port: 9000}]
  - from:
    - ipBlock: {cidr: 198.18.64.0/18, except: [198.18.64.0/24]}
    - ipBlock: {cidr: "2001:2:0:40::/60", except: ["2001:2:0:40::/64"]}
    ports: [{protocol: TCP, port: 22}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: client-out, namespace: fuzz}
spec:
  podSelector: {matchLabels: {app: client}}
  policyTypes: [Egress]
  egress:
  - to: [{podSelector: {matchLabels: {app: server}}}]
  - ports: [{protocol: UDP, port: 53}]
  - to:
    - ipBlock: {cidr: 198.18.64.0/18, except: [198.18.64.0/24]}
    - ipBlock: {cidr: "2001:2:0:40::/60", except: ["2001:2:0:40::/64"]}
    ports: [{protocol: TCP, port: 443}]
---
apiVersion: rivet.io/v1
kind: RivetNetworkPolicy
metadata: {name: denies, namespace: fuzz}
spec:
  podSelector: {}
  policyTypes: [Ingress, Egress]
  ingress:
  - from: [{entities: [cluster]}]
    ports: [{protocol: ICMP}, {protocol: ICMPv6}]
  egress:
  - to: [{entities: [world, cluster]}]
    ports: [{protocol: ICMP}, {protocol: ICMPv6}]
  ingressDeny:
  - from: [{podSelector: {matchLabels: {app: intruder}}}]
  egressDeny:
  - ports: [{protocol: TCP, port: 25}]
"#;

/// Addresses a structured record picks from (IPv4, IPv6): the two local
/// endpoints, pods elsewhere, reserved identities, the ipBlock and its
/// except, and addresses no policy names.
const ADDRESSES: [(Ipv4Addr, Ipv6Addr); 14] = [
    // client (endpoint 1)
    (Ipv4Addr::new(198, 18, 0, 2), Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 2)),
    // server (endpoint 2)
    (Ipv4Addr::new(198, 18, 0, 3), Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 3)),
    // remote client
    (Ipv4Addr::new(198, 18, 4, 2), Ipv6Addr::new(0x2001, 2, 0, 4, 0, 0, 0, 2)),
    // intruder
    (Ipv4Addr::new(198, 18, 4, 3), Ipv6Addr::new(0x2001, 2, 0, 4, 0, 0, 0, 3)),
    // client of another namespace
    (Ipv4Addr::new(198, 18, 4, 4), Ipv6Addr::new(0x2001, 2, 0, 4, 0, 0, 0, 4)),
    // host
    (Ipv4Addr::new(198, 18, 0, 1), Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1)),
    // remote node
    (
        Ipv4Addr::new(198, 19, 254, 2),
        Ipv6Addr::new(0x2001, 2, 0, 0xfe, 0, 0, 0, 2),
    ),
    // world
    (
        Ipv4Addr::new(198, 18, 200, 1),
        Ipv6Addr::new(0x2001, 2, 0, 200, 0, 0, 0, 1),
    ),
    // in the ipBlock
    (
        Ipv4Addr::new(198, 18, 65, 7),
        Ipv6Addr::new(0x2001, 2, 0, 0x41, 0, 0, 0, 7),
    ),
    // in its except
    (
        Ipv4Addr::new(198, 18, 64, 7),
        Ipv6Addr::new(0x2001, 2, 0, 0x40, 0, 0, 0, 7),
    ),
    // link-local
    (
        Ipv4Addr::new(169, 254, 1, 1),
        Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1),
    ),
    (Ipv4Addr::UNSPECIFIED, Ipv6Addr::UNSPECIFIED),
    // multicast
    (Ipv4Addr::new(224, 0, 0, 1), Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1)),
    // nobody
    (Ipv4Addr::BROADCAST, Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 0xffff)),
];

/// Ports a structured record picks from: the policy's and their neighbours.
const PORTS: [u16; 20] = [
    80, 443, 8000, 8050, 8100, 53, 9000, 22, 25, 0, 1, 79, 81, 442, 7999, 8101, 8999, 9001, 65535, 5432,
];

/// Identities with labels: (identity, pod labels, namespace, address index).
const PODS: [(u32, &str, &str, usize); 5] = [
    (300, "k8s:app=client", NAMESPACE, 0),
    (301, "k8s:app=server", NAMESPACE, 1),
    (302, "k8s:app=client,k8s:zone=b", NAMESPACE, 2),
    (303, "k8s:app=intruder", NAMESPACE, 3),
    (304, "k8s:app=client", "other", 4),
];

/// A local endpoint.
struct Local {
    endpoint_id: u32,
    identity: u32,
    labels: Labels,
    v4: Ipv4Addr,
    v6: Ipv6Addr,
    ifindex: u32,
    allow_from_host: bool,
}

/// The interfaces a frame runs on.
#[derive(Clone, Copy, Debug)]
enum Iface {
    Client,
    Server,
    /// A pod-prefixed veth with no endpoint.
    Unknown,
}

impl Iface {
    fn of(bits: u8) -> Self {
        match bits & 3 {
            1 => Self::Server,
            2 => Self::Unknown,
            _ => Self::Client,
        }
    }
}

pub struct Harness {
    loader: EndpointDatapath,
    ring: RingBuf<MapData>,
    repo: PolicyRepository,
    locals: [Local; 2],
    unknown_ifindex: u32,
    /// Cluster identities' labels.
    labels: Vec<(u32, Labels)>,
    /// The IP cache as written (prefix, identity), for identity lookups.
    ipcache: Vec<(IpNet, u32)>,
    dump: Option<std::path::PathBuf>,
}

/// What a frame must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// `TC_ACT_OK`, no drop event.
    Pass,
    /// `TC_ACT_REDIRECT` (to a local endpoint), no drop event.
    Redirect,
    /// `TC_ACT_SHOT` with one drop event: reason, direction.
    Drop(u8, u8),
}

/// The expectation of a policy drop: the identities its event names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Identities {
    src: u32,
    dst: u32,
}

/// A well-formed packet of a flow, as the datapath's policy sees it.
#[derive(Clone, Copy, Debug)]
struct Flow {
    src: IpAddr,
    dst: IpAddr,
    protocol: u8,
    /// Host order; ICMP echo: the identifier in both.
    sport: u16,
    dport: u16,
    /// TTL / hop limit.
    ttl: u8,
}

impl Flow {
    /// The port policy matches: the destination port, 0 for ICMP.
    fn policy_port(&self) -> u16 {
        if matches!(self.protocol, proto::ICMP | proto::ICMPV6) {
            0
        } else {
            self.dport
        }
    }
}

/// What a frame is, read independently of the datapath.
#[derive(Debug)]
enum Class {
    /// Neither IPv4, IPv6 nor ARP.
    NotIp,
    Arp,
    /// An IP header, or the L4 header up to what the datapath reads of
    /// every packet of its protocol, is cut short.
    Truncated,
    Flow(Flow),
    /// Anything else: fragments, ICMP errors, ND and MLD, other
    /// protocols, headers the datapath may or may not accept.
    Other,
}

impl Harness {
    /// Namespaces, the datapath, the endpoints and their policy.
    pub fn setup() -> Self {
        enter_private_namespaces();
        run_ip(&["link", "set", "lo", "up"]);
        for i in [0, 2, 4] {
            let (host, peer) = (format!("{PREFIX}{i}"), format!("{PREFIX}{}", i + 1));
            run_ip(&["link", "add", &host, "type", "veth", "peer", "name", &peer]);
            run_ip(&["link", "set", &host, "up"]);
            run_ip(&["link", "set", &peer, "up"]);
        }
        let ifindex = |i: u32| {
            svc_loader::netdev::name_to_ifindex(&format!("{PREFIX}{i}"))
                .expect("looking up the fuzz veths")
                .expect("the fuzz veth exists")
        };

        let mut opts = DatapathOptions::new("/sys/fs/bpf/rivet/pktfuzz");
        opts.ct4_max = 8192;
        opts.ct6_max = 8192;
        opts.endpoints_max = 64;
        opts.ipcache_max = 1024;
        opts.policy_max = 4096;
        opts.ep_prefixes_max = 1024;
        opts.lb_flows_max = 1024;
        opts.lb_services_max = 64;
        opts.events_bytes = 1 << 16;
        let mut datapath = Datapath::open(opts).unwrap_or_else(|e| {
            panic!("loading the datapath (the packet target needs root, BPF and bpffs; it never skips): {e}")
        });
        let ring = datapath.take_events().expect("the event ring buffer");
        let loader = EndpointDatapath::new(datapath, PREFIX).expect("the loader library adopts the datapath");

        let mut repo = PolicyRepository::new();
        for policy in Policy::parse_all(POLICIES).expect("the fuzz policies parse") {
            repo.upsert(policy, PolicyOrigin::Api)
                .expect("the fuzz policies are stored");
        }
        let mut cache = SelectorCache::new();
        let mut labels = Vec::new();
        for (identity, pod, namespace, _) in PODS {
            let pod: Labels = pod.parse().expect("fixture labels");
            let identity_labels = pod
                .with_namespace(namespace, [("kubernetes.io/metadata.name", namespace)])
                .expect("fixture namespace labels");
            cache.upsert_identity(identity, identity_labels.clone());
            labels.push((identity, identity_labels));
        }
        let mut ipcache: Vec<(IpNet, u32)> = Vec::new();
        for (identity, _, _, address) in &PODS[2..] {
            let (v4, v6) = ADDRESSES[*address];
            ipcache.push((IpNet::from(IpAddr::V4(v4)), *identity));
            ipcache.push((IpNet::from(IpAddr::V6(v6)), *identity));
        }
        for (identity, address) in [(HOST, 5), (REMOTE_NODE, 6)] {
            let (v4, v6) = ADDRESSES[address];
            ipcache.push((IpNet::from(IpAddr::V4(v4)), identity));
            ipcache.push((IpNet::from(IpAddr::V6(v6)), identity));
        }
        // A CIDR identity per ipBlock prefix, in the selector cache and the
        // IP cache, as svc-endpoint and svc-identity allocate them.
        for (prefix, identity) in repo.cidrs().into_iter().zip(CIDR_IDENTITY_MIN..) {
            cache.set_cidr_identity(prefix, identity);
            ipcache.push((prefix, identity));
        }

        let local = |i: usize, endpoint_id: u32, ifindex: u32, allow_from_host: bool| {
            let (identity, _, _, address) = PODS[i];
            let (v4, v6) = ADDRESSES[address];
            Local {
                endpoint_id,
                identity,
                labels: labels[i].1.clone(),
                v4,
                v6,
                ifindex,
                allow_from_host,
            }
        };
        let locals = [local(0, 1, ifindex(0), false), local(1, 2, ifindex(2), true)];
        for endpoint in &locals {
            let resolved = repo.resolve(&Subject::new(&endpoint.labels), &cache);
            let request = pb::ApplyEndpointRequest {
                endpoint_id: endpoint.endpoint_id,
                host_ifindex: endpoint.ifindex,
                addresses: [IpAddr::V4(endpoint.v4), IpAddr::V6(endpoint.v6)]
                    .into_iter()
                    .map(rivet_proto::net::address_bytes)
                    .collect(),
                mac: vec![2, 0, 0, 0, 0, endpoint.endpoint_id as u8],
                identity: endpoint.identity,
                policy: Some(resolved.to_proto(1, endpoint.allow_from_host)),
            };
            let spec = svc_loader::validate::endpoint(&request).expect("the fuzz endpoint is a valid request");
            loader.apply(&spec).expect("the fuzz endpoint is applied");
        }
        let entries: Vec<(IpAddr, u8, IpcacheValue)> = ipcache
            .iter()
            .map(|(prefix, identity)| {
                (
                    prefix.network(),
                    prefix.prefix_len(),
                    IpcacheValue::new(*identity, None),
                )
            })
            .collect();
        loader.upsert_ipcache(&entries).expect("the fuzz IP cache is written");

        Self {
            loader,
            ring,
            repo,
            locals,
            unknown_ifindex: ifindex(4),
            labels,
            ipcache,
            dump: std::env::var_os("RIVET_PKTFUZZ_DUMP").map(Into::into),
        }
    }

    /// Runs one fuzz input.
    pub fn input(&mut self, data: &[u8]) {
        let Some((&head, rest)) = data.split_first() else {
            return;
        };
        if head & 1 == 1 {
            self.frame(hook_of(head >> 3), Iface::of(head >> 1), rest);
        } else {
            let mut previous: Option<Record> = None;
            for bytes in rest.chunks_exact(RECORD).take(MAX_FRAMES) {
                let record = Record::decode(bytes, previous.as_ref());
                let frame = record.build();
                if let Some(dir) = &self.dump {
                    dump(dir, &record, &frame);
                }
                self.frame(record.hook, record.iface, &frame);
                previous = Some(record);
            }
        }
        self.forget_flows();
    }

    /// Runs one frame and checks what it did.
    fn frame(&mut self, hook: Hook, iface: Iface, frame: &[u8]) {
        let frame = &frame[..frame.len().min(MAX_FRAME)];
        if !kernel_runs(frame) {
            return;
        }
        let own_dir = match hook {
            Hook::Ingress => maps::DIR_EGRESS,
            Hook::Egress => maps::DIR_INGRESS,
        };
        let class = classify(frame);
        let (ifindex, endpoint) = match iface {
            Iface::Client => (self.locals[0].ifindex, Some(0)),
            Iface::Server => (self.locals[1].ifindex, Some(1)),
            Iface::Unknown => (self.unknown_ifindex, None),
        };
        // Taken before the run: conntrack as the frame finds it.
        let fresh = match &class {
            Class::Flow(flow) => self.new_flow(flow),
            _ => false,
        };
        let expected = match (endpoint, &class) {
            (None, _) => Some((Outcome::Drop(maps::DROP_UNKNOWN_ENDPOINT, own_dir), None)),
            (Some(_), Class::NotIp) => Some((Outcome::Drop(maps::DROP_UNSUPPORTED_L3, own_dir), None)),
            (Some(_), Class::Arp) if hook == Hook::Egress => Some((Outcome::Pass, None)),
            (Some(_), Class::Truncated) => Some((Outcome::Drop(maps::DROP_INVALID_PACKET, own_dir), None)),
            (Some(e), Class::Flow(flow)) if fresh => Some(self.policy(hook, e, flow)),
            _ => None,
        };

        let retval = self
            .loader
            .datapath()
            .test_run(hook, frame, ifindex)
            .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of {} bytes: {e}", frame.len()));
        let mut drops = Vec::new();
        while let Some(item) = self.ring.next() {
            let event = Event::from_bytes(&item).expect("a whole event in the ring");
            if event.kind == maps::EVENT_DROP {
                drops.push(event);
            }
        }

        let program = hook.program();
        let allowed: &[u32] = match hook {
            Hook::Ingress => &[TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT],
            Hook::Egress => &[TC_ACT_OK, TC_ACT_SHOT],
        };
        assert!(
            allowed.contains(&retval),
            "{program} returned {retval}, not one of {allowed:?}, for {class:?}"
        );
        assert!(
            drops.len() <= 1,
            "{program}: more than one drop event for one frame: {drops:?}"
        );
        let drop = drops.first();
        if let Some(event) = drop {
            assert_eq!(
                retval, TC_ACT_SHOT,
                "{program}: a drop event but verdict {retval}: {event:?}"
            );
            assert!(
                defined_reason(event.reason),
                "{program}: drop reason {} is not one the datapath defines",
                event.reason
            );
            assert!(
                event.direction == maps::DIR_INGRESS || (hook == Hook::Ingress && event.direction == maps::DIR_EGRESS),
                "{program}: a drop event of direction {}",
                event.direction
            );
        }
        assert!(
            retval != TC_ACT_SHOT || drop.is_some(),
            "{program} dropped a frame ({class:?}) without a drop event: the drop is in no counter"
        );
        let outcome = match (retval, drop) {
            (TC_ACT_SHOT, Some(event)) => Outcome::Drop(event.reason, event.direction),
            (TC_ACT_REDIRECT, _) => Outcome::Redirect,
            _ => Outcome::Pass,
        };

        let Some((expected, identities)) = expected else {
            return;
        };
        assert_eq!(
            outcome, expected,
            "{program} on {iface:?}: {class:?} (expected {expected:?}, got {outcome:?})"
        );
        if let (Some(ids), Some(event)) = (identities, drop) {
            assert_eq!(
                Identities {
                    src: event.src_identity,
                    dst: event.dst_identity
                },
                ids,
                "{program} on {iface:?}: the drop event of {class:?} names other identities"
            );
        }
        if let Class::Flow(flow) = &class
            && fresh
        {
            self.check_conntrack(hook, flow, outcome, own_dir);
        }
    }

    /// What the datapath must do with a new flow's packet on endpoint
    /// `e`, from the policy engine's decisions.
    fn policy(&self, hook: Hook, e: usize, flow: &Flow) -> (Outcome, Option<Identities>) {
        let me = &self.locals[e];
        let port = flow.policy_port();
        let verdict = |decision: Decision, direction: u8| match decision {
            Decision::NotEnforced | Decision::Allowed => None,
            Decision::Denied => Some(Outcome::Drop(maps::DROP_POLICY_DENIED, direction)),
            Decision::DefaultDenied => Some(Outcome::Drop(maps::DROP_POLICY_DEFAULT_DENY, direction)),
        };
        match hook {
            Hook::Ingress => {
                let own = match flow.src {
                    IpAddr::V4(a) => a == me.v4,
                    IpAddr::V6(a) => a == me.v6,
                };
                if !own {
                    return (Outcome::Drop(maps::DROP_INVALID_SOURCE_ADDRESS, maps::DIR_EGRESS), None);
                }
                let (peer, labels) = self.identity_of(flow.dst);
                let to = PacketPeer {
                    identity: peer,
                    labels,
                    address: Some(flow.dst),
                    named_ports: &[],
                };
                let decision =
                    self.repo
                        .evaluate(&Subject::new(&me.labels), Direction::Egress, &to, flow.protocol, port);
                if let Some(drop) = verdict(decision, maps::DIR_EGRESS) {
                    return (
                        drop,
                        Some(Identities {
                            src: me.identity,
                            dst: peer,
                        }),
                    );
                }
                let Some(dst) = self.locals.iter().find(|l| match flow.dst {
                    IpAddr::V4(a) => a == l.v4,
                    IpAddr::V6(a) => a == l.v6,
                }) else {
                    return (Outcome::Pass, None);
                };
                let from = PacketPeer {
                    identity: me.identity,
                    labels: Some(&me.labels),
                    address: Some(flow.src),
                    named_ports: &[],
                };
                let decision = self.repo.evaluate(
                    &Subject::new(&dst.labels),
                    Direction::Ingress,
                    &from,
                    flow.protocol,
                    port,
                );
                if let Some(drop) = verdict(decision, maps::DIR_INGRESS) {
                    return (
                        drop,
                        Some(Identities {
                            src: me.identity,
                            dst: dst.identity,
                        }),
                    );
                }
                // TTL 1 is the stack's to answer (time exceeded).
                (if flow.ttl > 1 { Outcome::Redirect } else { Outcome::Pass }, None)
            }
            Hook::Egress => {
                let (peer, labels) = self.identity_of(flow.src);
                if peer == HOST && me.allow_from_host {
                    return (Outcome::Pass, None);
                }
                let from = PacketPeer {
                    identity: peer,
                    labels,
                    address: Some(flow.src),
                    named_ports: &[],
                };
                let decision = self.repo.evaluate(
                    &Subject::new(&me.labels),
                    Direction::Ingress,
                    &from,
                    flow.protocol,
                    port,
                );
                let drop = verdict(decision, maps::DIR_INGRESS).map(|drop| {
                    (
                        drop,
                        Some(Identities {
                            src: peer,
                            dst: me.identity,
                        }),
                    )
                });
                drop.unwrap_or((Outcome::Pass, None))
            }
        }
    }

    /// The identity of an address as the node knows it: a local
    /// endpoint's, the node (an IPv6 link-local address on a pod's link),
    /// the IP cache's longest prefix, else world.
    fn identity_of(&self, address: IpAddr) -> (u32, Option<&Labels>) {
        let labels = |identity: u32| self.labels.iter().find(|(i, _)| *i == identity).map(|(_, l)| l);
        for local in &self.locals {
            if address == IpAddr::V4(local.v4) || address == IpAddr::V6(local.v6) {
                return (local.identity, Some(&local.labels));
            }
        }
        if let IpAddr::V6(a) = address
            && a.is_unicast_link_local()
        {
            return (HOST, None);
        }
        let identity = self
            .ipcache
            .iter()
            .filter(|(prefix, _)| prefix.contains(&address))
            .max_by_key(|(prefix, _)| prefix.prefix_len())
            .map_or(WORLD, |(_, identity)| *identity);
        (identity, labels(identity))
    }

    /// The conntrack keys a packet of `flow` can meet: its own and its
    /// reply's, opened by an egress or an ingress check.
    fn conntrack_keys() -> [(bool, u8); 4] {
        [
            (false, maps::DIR_EGRESS),
            (false, maps::DIR_INGRESS),
            (true, maps::DIR_EGRESS),
            (true, maps::DIR_INGRESS),
        ]
    }

    /// Whether conntrack holds the key of `flow` (`reverse`: its reply's)
    /// opened in `direction`.
    fn has_entry(&self, flow: &Flow, reverse: bool, direction: u8) -> bool {
        let (src, dst, sport, dport) = if reverse {
            (flow.dst, flow.src, flow.dport, flow.sport)
        } else {
            (flow.src, flow.dst, flow.sport, flow.dport)
        };
        let maps = self.loader.datapath().maps();
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let key = Ct4Key::new(
                    SocketAddrV4::new(s, sport),
                    SocketAddrV4::new(d, dport),
                    flow.protocol,
                    direction,
                );
                maps.ct4.lock().get(&key, 0).is_ok()
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let key = Ct6Key::new(
                    SocketAddrV6::new(s, sport, 0, 0),
                    SocketAddrV6::new(d, dport, 0, 0),
                    flow.protocol,
                    direction,
                );
                maps.ct6.lock().get(&key, 0).is_ok()
            }
            _ => unreachable!("one family per flow"),
        }
    }

    /// No conntrack entry of the flow either way: its packet is judged by
    /// policy.
    fn new_flow(&self, flow: &Flow) -> bool {
        Self::conntrack_keys()
            .iter()
            .all(|(reverse, direction)| !self.has_entry(flow, *reverse, *direction))
    }

    /// A new flow dropped by its first check leaves no conntrack entry; a
    /// passed one leaves its own (and, delivered to a local endpoint, that
    /// endpoint's ingress entry).
    fn check_conntrack(&self, hook: Hook, flow: &Flow, outcome: Outcome, own_dir: u8) {
        match outcome {
            Outcome::Drop(_, dir) if dir == own_dir => {
                for (reverse, direction) in Self::conntrack_keys() {
                    assert!(
                        !self.has_entry(flow, reverse, direction),
                        "{}: a dropped new flow left a conntrack entry: {flow:?}",
                        hook.program()
                    );
                }
            }
            Outcome::Drop(..) => {}
            Outcome::Pass | Outcome::Redirect => {
                assert!(
                    self.has_entry(flow, false, own_dir),
                    "{}: a passed new flow has no conntrack entry: {flow:?}",
                    hook.program()
                );
                if outcome == Outcome::Redirect {
                    assert!(
                        self.has_entry(flow, false, maps::DIR_INGRESS),
                        "{}: a flow delivered to a local endpoint has no ingress entry: {flow:?}",
                        hook.program()
                    );
                }
            }
        }
    }

    /// Empties conntrack and the fragments map: the next input starts with
    /// no flows.
    fn forget_flows(&self) {
        let maps = self.loader.datapath().maps();
        let mut ct4 = maps.ct4.lock();
        let keys: Vec<_> = ct4.keys().filter_map(Result::ok).collect();
        for key in keys {
            let _ = ct4.remove(&key);
        }
        let mut ct6 = maps.ct6.lock();
        let keys: Vec<_> = ct6.keys().filter_map(Result::ok).collect();
        for key in keys {
            let _ = ct6.remove(&key);
        }
        let mut fragments = maps.fragments.lock();
        let keys: Vec<_> = fragments.keys().filter_map(Result::ok).collect();
        for key in keys {
            let _ = fragments.remove(&key);
        }
    }
}

/// Whether `BPF_PROG_TEST_RUN` takes the frame: the kernel (6.18 here)
/// refuses an Ethernet header alone and an IPv4 or IPv6 frame shorter than
/// its fixed IP header, with EINVAL.
fn kernel_runs(frame: &[u8]) -> bool {
    let ip = match frame.get(12..14) {
        Some([0x08, 0x00]) => 20,
        Some([0x86, 0xdd]) => 40,
        _ => 1,
    };
    frame.len() >= 14 + ip
}

fn hook_of(bits: u8) -> Hook {
    if bits & 1 == 1 { Hook::Egress } else { Hook::Ingress }
}

/// The drop reasons of rivet.h (`DROP_FRAGMENT_UNSUPPORTED` is no longer
/// produced).
fn defined_reason(reason: u8) -> bool {
    (maps::DROP_POLICY_DENIED..=maps::DROP_NAT_NO_PORT).contains(&reason) && reason != maps::DROP_FRAGMENT_UNSUPPORTED
}

/// Reads a frame as a strict parser would, with no code of the datapath's.
fn classify(frame: &[u8]) -> Class {
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let ip = &frame[14..];
    match ethertype {
        frames::ETH_P_IP => {
            if ip.len() < 20 || ip[0] & 0xf < 5 {
                return Class::Truncated;
            }
            let l4 = usize::from(ip[0] & 0xf) * 4;
            let offset = u16::from_be_bytes([ip[6], ip[7]]) & 0x1fff;
            if offset != 0 || ip[0] >> 4 != 4 {
                return Class::Other;
            }
            let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
            let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
            transport(src.into(), dst.into(), ip[9], ip[8], ip.get(l4..).unwrap_or_default())
        }
        frames::ETH_P_IPV6 => {
            if ip.len() < 40 {
                return Class::Truncated;
            }
            if ip[0] >> 4 != 6 {
                return Class::Other;
            }
            let (mut next, mut off, mut fragment) = (ip[6], 40usize, false);
            for i in 0..8 {
                if !matches!(next, 0 | 43 | 44 | 51 | 60) {
                    break;
                }
                let Some(h) = ip.get(off..off + 8) else {
                    return Class::Other;
                };
                let len = match next {
                    0 if i != 0 => return Class::Other,
                    44 if fragment || u16::from_be_bytes([h[2], h[3]]) & 0xfff8 != 0 => return Class::Other,
                    44 => {
                        fragment = true;
                        8
                    }
                    51 => (usize::from(h[1]) + 2) * 4,
                    _ => (usize::from(h[1]) + 1) * 8,
                };
                if off + len > ip.len() {
                    return Class::Other;
                }
                off += len;
                next = h[0];
            }
            if matches!(next, 0 | 43 | 44 | 51 | 60) {
                return Class::Other;
            }
            let octets = |at: usize| -> [u8; 16] { ip[at..at + 16].try_into().expect("16 bytes") };
            let (src, dst) = (Ipv6Addr::from(octets(8)), Ipv6Addr::from(octets(24)));
            transport(src.into(), dst.into(), next, ip[7], &ip[off..])
        }
        ETH_P_ARP => Class::Arp,
        _ => Class::NotIp,
    }
}

/// The L4 part of [`classify`].
fn transport(src: IpAddr, dst: IpAddr, protocol: u8, ttl: u8, l4: &[u8]) -> Class {
    let port = |at: usize| u16::from_be_bytes([l4[at], l4[at + 1]]);
    let flow = |sport, dport| {
        Class::Flow(Flow {
            src,
            dst,
            protocol,
            sport,
            dport,
            ttl,
        })
    };
    match protocol {
        proto::TCP | proto::UDP if l4.len() < 4 => Class::Truncated,
        proto::TCP if l4.len() < 20 => Class::Other,
        proto::UDP if l4.len() < 8 => Class::Other,
        proto::TCP | proto::UDP => flow(port(0), port(2)),
        proto::ICMP if src.is_ipv4() => match l4 {
            _ if l4.len() < 8 => Class::Truncated,
            // Errors carry another packet's tuple.
            [3 | 11 | 12, ..] => Class::Other,
            [0 | 8, ..] => flow(port(4), port(4)),
            _ => flow(0, 0),
        },
        proto::ICMPV6 if src.is_ipv6() => match l4 {
            _ if l4.len() < 8 => Class::Truncated,
            // Errors, and neighbour discovery and MLD (link plumbing).
            [1..=4 | 130..=137 | 143, ..] => Class::Other,
            [128 | 129, ..] => flow(port(4), port(4)),
            _ => flow(0, 0),
        },
        _ => Class::Other,
    }
}

/// One structured frame, from [`RECORD`] bytes:
///
/// 0. bit 0 the program (`to_container` if set), bits 1-2 the interface,
///    bit 3 IPv6, bits 4-5 TCP / UDP / ICMP / SCTP, bit 6 the reply of the
///    previous frame (its addresses and ports swapped, its family), bit 7
///    32 bytes of payload;
/// 1. 2. source and destination among [`ADDRESSES`];
/// 3. 4. the source port (ICMP: the echo identifier);
/// 5. the destination port among [`PORTS`];
/// 6. TCP flags, or the ICMP type;
/// 7. TTL / hop limit;
/// 8. bits 0-2 IPv6 extension headers, bits 3-4 a first, a later or an
///    atomic fragment;
/// 9. bytes cut from the end.
#[derive(Clone, Debug)]
struct Record {
    hook: Hook,
    iface: Iface,
    v6: bool,
    protocol: u8,
    payload: bool,
    src: usize,
    dst: usize,
    sport: u16,
    dport: u16,
    flags: u8,
    ttl: u8,
    shape: u8,
    cut: u8,
}

impl Record {
    fn decode(b: &[u8], previous: Option<&Record>) -> Self {
        let mut r = Self {
            hook: hook_of(b[0]),
            iface: Iface::of(b[0] >> 1),
            v6: b[0] & 8 != 0,
            protocol: [proto::TCP, proto::UDP, proto::ICMP, proto::SCTP][usize::from(b[0] >> 4 & 3)],
            payload: b[0] & 0x80 != 0,
            src: usize::from(b[1]) % ADDRESSES.len(),
            dst: usize::from(b[2]) % ADDRESSES.len(),
            sport: u16::from_be_bytes([b[3], b[4]]),
            dport: PORTS[usize::from(b[5]) % PORTS.len()],
            flags: b[6],
            ttl: b[7],
            shape: b[8],
            cut: b[9],
        };
        if let Some(p) = previous.filter(|_| b[0] & 0x40 != 0) {
            (r.src, r.dst, r.sport, r.dport, r.v6, r.protocol) = (p.dst, p.src, p.dport, p.sport, p.v6, p.protocol);
        }
        r
    }

    fn build(&self) -> Vec<u8> {
        let (s4, s6) = ADDRESSES[self.src];
        let (d4, d6) = ADDRESSES[self.dst];
        let (src, dst): (IpAddr, IpAddr) = if self.v6 {
            (s6.into(), d6.into())
        } else {
            (s4.into(), d4.into())
        };
        let data: &[u8] = if self.payload { &[0x5a; 32] } else { &[] };
        let icmp = self.protocol == proto::ICMP;
        let (protocol, segment) = match self.protocol {
            proto::TCP => {
                let mut s = frames::tcp(src, dst, self.sport, self.dport, self.flags);
                s.extend_from_slice(data);
                (proto::TCP, s)
            }
            proto::UDP => (proto::UDP, frames::udp(src, dst, self.sport, self.dport, data)),
            _ if icmp && self.v6 => (
                proto::ICMPV6,
                frames::icmp6(s6, d6, self.flags, 0, frames::echo_rest(self.sport, 1), data),
            ),
            _ if icmp => (
                proto::ICMP,
                frames::icmp4(self.flags, 0, frames::echo_rest(self.sport, 1), data),
            ),
            _ => {
                let mut s = frames::sctp(self.sport, self.dport);
                s.extend_from_slice(data);
                (proto::SCTP, s)
            }
        };
        // 0: whole; 1: a first fragment; 2: a later one (from byte 8); 3: an
        // atomic fragment (IPv6) / whole.
        let fragment = self.shape >> 3 & 3;
        let body = if fragment == 2 {
            segment.get(8..).unwrap_or_default()
        } else {
            &segment[..]
        };
        let id = self.sport;
        let (ethertype, mut packet) = if self.v6 {
            let mut headers = match self.shape & 7 {
                0 => vec![],
                1 => vec![ExtHeader::HopByHop { len: 0 }],
                2 => vec![ExtHeader::DestinationOptions { len: 1 }],
                3 => vec![ExtHeader::Routing { len: 0 }],
                4 => vec![ExtHeader::Authentication { len: 1 }],
                5 => vec![ExtHeader::HopByHop { len: 0 }, ExtHeader::DestinationOptions { len: 0 }],
                6 => vec![
                    ExtHeader::HopByHop { len: 0 },
                    ExtHeader::Routing { len: 0 },
                    ExtHeader::Authentication { len: 1 },
                    ExtHeader::DestinationOptions { len: 0 },
                ],
                _ => vec![ExtHeader::DestinationOptions { len: 0 }; 9],
            };
            match fragment {
                1 => headers.push(ExtHeader::Fragment {
                    offset: 0,
                    more: true,
                    id: u32::from(id),
                }),
                2 => headers.push(ExtHeader::Fragment {
                    offset: 8,
                    more: false,
                    id: u32::from(id),
                }),
                3 => headers.push(ExtHeader::Fragment {
                    offset: 0,
                    more: false,
                    id: u32::from(id),
                }),
                _ => {}
            }
            (
                frames::ETH_P_IPV6,
                frames::ipv6(s6, d6, self.ttl, &headers, protocol, body),
            )
        } else {
            let fragment = match fragment {
                1 => Some((0, true)),
                2 => Some((8, false)),
                _ => None,
            };
            (
                frames::ETH_P_IP,
                frames::ipv4(s4, d4, protocol, self.ttl, id, fragment, body),
            )
        };
        packet.truncate(packet.len().saturating_sub(usize::from(self.cut)));
        frames::ethernet([2, 0, 0, 0, 0, 0xfe], [2, 0, 0, 0, 0, 1], ethertype, &packet)
    }
}

/// Writes `frame` as a raw input of `record`'s program and interface.
fn dump(dir: &std::path::Path, record: &Record, frame: &[u8]) {
    use std::hash::{Hash as _, Hasher as _};
    let iface = match record.iface {
        Iface::Client => 0,
        Iface::Server => 1,
        Iface::Unknown => 2,
    };
    let program = u8::from(record.hook == Hook::Egress);
    let mut input = vec![1 | iface << 1 | program << 3];
    input.extend_from_slice(frame);
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    input.hash(&mut hasher);
    let path = dir.join(format!("raw-{:016x}", hasher.finish()));
    std::fs::write(&path, input).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// This thread into a network namespace and a mount namespace of its own,
/// with a fresh bpffs over `/sys/fs/bpf` in the latter (mounts made private
/// first: nothing propagates back to the machine's).
fn enter_private_namespaces() {
    // SAFETY: unshare takes flags only; it changes this thread's namespaces.
    if unsafe { libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWNS) } != 0 {
        panic!(
            "unshare(CLONE_NEWNET | CLONE_NEWNS): {} (the packet target needs root)",
            std::io::Error::last_os_error()
        );
    }
    mount(None, "/", None, libc::MS_REC | libc::MS_PRIVATE);
    mount(Some("bpf"), "/sys/fs/bpf", Some("bpf"), 0);
}

fn mount(source: Option<&str>, target: &str, fs_type: Option<&str>, flags: libc::c_ulong) {
    let c = |s: &str| CString::new(s).expect("no NUL");
    let (source_c, target_c, fs_c) = (source.map(c), c(target), fs_type.map(c));
    let ptr = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: NUL-terminated strings (or null) that outlive the call; no data.
    let r = unsafe { libc::mount(ptr(&source_c), target_c.as_ptr(), ptr(&fs_c), flags, std::ptr::null()) };
    if r != 0 {
        panic!(
            "mount {source:?} on {target} ({fs_type:?}): {} (the packet target needs root and bpffs)",
            std::io::Error::last_os_error()
        );
    }
}

/// `ip <args>` in this thread's network namespace; panics on failure.
fn run_ip(args: &[&str]) {
    let output = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running ip {}: {e}", args.join(" ")));
    assert!(
        output.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
}
