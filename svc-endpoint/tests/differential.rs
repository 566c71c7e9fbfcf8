//! Differential test: the real datapath against the policy engine.
//!
//! Random policies (NetworkPolicy and RivetNetworkPolicy: pod and namespace
//! selectors with matchExpressions, ipBlocks with excepts, ports with
//! endPort, TCP/UDP/SCTP and Rivet's ICMP/ICMPv6/ANY, deny rules, entities,
//! policyTypes,
//! enableDefaultDeny) over random identities are resolved by the engine and
//! realised in a really loaded datapath through the loader library, exactly
//! as an ApplyEndpoint request is (`validate::endpoint`, then
//! `EndpointDatapath::apply`). Random packets (IPv4/IPv6; TCP, UDP, SCTP,
//! ICMP echo, other ICMP types; with and without IPv6 extension headers;
//! fragments; ND and MLD plumbing and ND that is not; link-local traffic;
//! broken header chains) then run through the real `from_container` /
//! `to_container` programs with `BPF_PROG_TEST_RUN`, the subject's and (for
//! traffic to the peer that is a local endpoint) that endpoint's policy,
//! each as a new flow (conntrack is emptied after every case, fragment ids
//! are unique), and every verdict and drop reason is compared with
//! [`PolicyRepository::evaluate`], which answers straight from the rules.
//!
//! The seed is random per run and printed; `RIVET_DIFF_SEED=<n>` replays
//! one, `RIVET_DIFF_SCENARIOS=<n>` changes how many policy sets are tried
//! (each with [`PACKETS_PER_SCENARIO`] packets).
//!
//! Named ports: the subject's and each pod peer's own ports (every pod is
//! known to the engine as a local endpoint would be: by identity and by
//! address), in ingress rules and in egress rules with any peers: selectors,
//! none or the entity `all`, and ipBlocks (whose pods get CIDR identities
//! for their host prefixes, as svc-endpoint allocates them).
//!
//! ipBlocks: cidrs and excepts around the peers' addresses, pods included.
//! Each prefix gets a CIDR identity (from 2^24, in the selector cache and in
//! the ipcache, where an endpoint's own /32 outranks a CIDR prefix of the
//! same address, as in svc-identity); the datapath matches them per address
//! through the endpoint's prefixes.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Instant;

use ipnet::IpNet;
use rand::rngs::StdRng;
use rand::seq::IndexedRandom as _;
use rand::{Rng, SeedableRng};
use rivet_common::identity::CIDR_IDENTITY_MIN;
use rivet_common::labels::Labels;
use rivet_common::testing::netns::{NetNs, veth_pair};
use rivet_policy::{
    Decision, Direction, NamedPort, PacketPeer, Policy, PolicyOrigin, PolicyRepository, Protocol, ResolvedPolicy,
    SelectorCache, Subject,
};
use rivet_proto::loader::v1 as pb;
use rivet_testkit::frames::{self, ExtHeader, TCP_SYN, proto};
use rivet_testkit::loader::PinDir;
use serde_json::{Value, json};
use svc_loader::datapath::{Datapath, DatapathOptions, Hook};
use svc_loader::loader::EndpointDatapath;
use svc_loader::maps::{self, Event, IpcacheValue};

/// Packets run against each random policy set.
const PACKETS_PER_SCENARIO: usize = 40;
/// Policy sets per run unless `RIVET_DIFF_SCENARIOS` says otherwise.
const DEFAULT_SCENARIOS: usize = 150;
/// Host-side veth prefix of the test namespace.
const PREFIX: &str = "rvdf";
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;
/// The peer that is an endpoint on the node (see `run`).
const LOCAL_PEER: usize = 0;

const SUBJECT_ID: u32 = 300;
const SUBJECT_V4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
const SUBJECT_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 2);
const NAMESPACES: [&str; 3] = ["ns-a", "ns-b", "ns-c"];
const POD_KEYS: [(&str, &[&str]); 2] = [("app", &["web", "db", "api"]), ("tier", &["front", "back"])];
const NAMESPACE_KEYS: [(&str, &[&str]); 3] = [
    ("team", &["red", "blue"]),
    ("env", &["prod", "dev"]),
    ("kubernetes.io/metadata.name", &["ns-a", "ns-b", "ns-c"]),
];
const PORTS: [u16; 8] = [53, 80, 443, 1000, 1500, 2000, 5432, 8080];
/// ipBlock cidrs around the peers' addresses (pods 198.18.100.1-6 and
/// 2001:2:0:100::1-6; host, world and remote-node in 198.18.200.0/24 and
/// 2001:2:0:200::/64); excepts are made inside them from the same
/// addresses. A `*` is replaced by a peer's address.
const CIDRS: [&str; 14] = [
    "0.0.0.0/0",
    "198.18.0.0/15",
    "198.18.100.0/24",
    "198.18.100.0/29",
    "198.18.200.0/24",
    "*/32",
    "*/30",
    "::/0",
    "2001:2::/48",
    "2001:2:0:100::/64",
    "2001:2:0:100::/125",
    "2001:2:0:200::/64",
    "*/128",
    "*/126",
];

#[test]
fn the_datapath_enforces_what_the_policy_engine_says() {
    let seed = std::env::var("RIVET_DIFF_SEED")
        .ok()
        .map(|s| s.parse::<u64>().expect("RIVET_DIFF_SEED is a number"))
        .unwrap_or_else(rand::random);
    let scenarios = std::env::var("RIVET_DIFF_SCENARIOS")
        .ok()
        .map_or(DEFAULT_SCENARIOS, |s| {
            s.parse().expect("RIVET_DIFF_SCENARIOS is a number")
        });
    eprintln!("differential test: seed {seed} (replay with RIVET_DIFF_SEED={seed}), {scenarios} scenarios");

    let started = Instant::now();
    let (cases, failures, seen, (pods_by_address, named_port_hosts)) =
        in_test_namespace(move |pin_dir| run(seed, scenarios, pin_dir));
    eprintln!(
        "differential test: {cases} cases in {:.1} s, {} disagreements (seed {seed}); expected outcomes: {seen:?}; \
         {pods_by_address} cases with a pod peer inside an ipBlock prefix of the subject, {named_port_hosts} at its \
         own host prefix (an ipBlock naming a port)",
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(
        pods_by_address * 100 >= cases,
        "the generator must put pod peers inside the subject's ipBlock prefixes in at least 1% of the cases: \
         {pods_by_address} of {cases}"
    );
    for outcome in [
        Outcome::Pass,
        Outcome::Drop(maps::DROP_POLICY_DENIED, 0),
        Outcome::Drop(maps::DROP_POLICY_DEFAULT_DENY, 0),
    ] {
        assert!(
            seen.get(&outcome).is_some_and(|n| *n * 100 >= cases),
            "the generator must exercise {outcome:?} in at least 1% of the cases: {seen:?}"
        );
    }
    assert!(
        cases >= scenarios * PACKETS_PER_SCENARIO / 2,
        "too few cases ran: {cases}"
    );
    if !failures.is_empty() {
        let shown: Vec<&String> = failures.iter().take(5).collect();
        panic!(
            "{} of {cases} cases disagree (seed {seed}, replay with RIVET_DIFF_SEED={seed}); the first ones:\n\n{}",
            failures.len(),
            shown.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n\n")
        );
    }
}

/// Disagreements the random test found, kept as fixed cases: each was a
/// datapath bug.
#[test]
fn regressions_found_by_the_differential_test() {
    in_test_namespace(|pin_dir| {
        let mut harness = Harness::new(pin_dir);
        let mut repo = PolicyRepository::new();
        let doc = json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "sctp", "namespace": "ns-a"},
            "spec": {"podSelector": {}, "policyTypes": ["Egress"],
                     "egress": [{"ports": [{"protocol": "SCTP", "port": 80}]}]},
        });
        repo.upsert(Policy::parse(&doc.to_string()).unwrap(), PolicyOrigin::Api)
            .unwrap();
        let subject: Labels = "k8s:io.kubernetes.pod.namespace=ns-a".parse().unwrap();
        let resolved = repo.resolve(&Subject::new(&subject), &SelectorCache::new());
        harness.apply(&resolved, 1, false);
        let world = Ipv4Addr::new(198, 18, 200, 1);
        let sctp = |dport| {
            let packet = frames::ipv4(SUBJECT_V4, world, proto::SCTP, 64, 0, None, &frames::sctp(40000, dport));
            frames::ethernet([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], frames::ETH_P_IP, &packet)
        };
        // The datapath read no SCTP ports: an SCTP port rule never matched.
        assert_eq!(
            harness.run(Direction::Egress, &[sctp(80)]),
            [Outcome::Pass],
            "SCTP to an allowed port passes"
        );
        assert_eq!(
            harness.run(Direction::Egress, &[sctp(81)]),
            [Outcome::Drop(maps::DROP_POLICY_DEFAULT_DENY, maps::DIR_EGRESS)],
            "SCTP to another port is default-denied"
        );

        // An ICMP error of no known connection was judged as the protocol
        // of the packet inside it: UDP allowed let an ICMP error through.
        let doc = json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "udp-only", "namespace": "ns-a"},
            "spec": {"podSelector": {}, "policyTypes": ["Egress"],
                     "egress": [{"ports": [{"protocol": "UDP"}]}]},
        });
        repo.upsert(Policy::parse(&doc.to_string()).unwrap(), PolicyOrigin::Api)
            .unwrap();
        let resolved = repo.resolve(&Subject::new(&subject), &SelectorCache::new());
        harness.apply(&resolved, 2, false);
        let world6 = Ipv6Addr::new(0x2001, 2, 0, 200, 0, 0, 0, 1);
        let inner = frames::ipv6(
            world6,
            SUBJECT_V6,
            64,
            &[],
            proto::UDP,
            &frames::udp(world6.into(), SUBJECT_V6.into(), 5353, 9, b"x"),
        );
        let error = frames::icmp6(SUBJECT_V6, world6, 1, 4, [0; 4], &inner[..48]);
        let packet = frames::ipv6(SUBJECT_V6, world6, 64, &[], proto::ICMPV6, &error);
        let frame = frames::ethernet([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], frames::ETH_P_IPV6, &packet);
        assert_eq!(
            harness.run(Direction::Egress, &[frame]),
            [Outcome::Drop(maps::DROP_POLICY_DEFAULT_DENY, maps::DIR_EGRESS)],
            "an ICMPv6 error of no connection is ICMPv6, which the policy does not allow"
        );
        let udp = frames::ipv6(
            SUBJECT_V6,
            world6,
            64,
            &[],
            proto::UDP,
            &frames::udp(SUBJECT_V6.into(), world6.into(), 9, 5353, b"x"),
        );
        let udp = frames::ethernet([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], frames::ETH_P_IPV6, &udp);
        assert_eq!(
            harness.run(Direction::Egress, &[udp]),
            [Outcome::Pass],
            "UDP is allowed"
        );
    });
}

/// Inputs the packet fuzzer (`fuzz/fuzz_targets/packet_path.rs`) found,
/// kept as fixed cases: each was a datapath bug.
#[test]
fn regressions_found_by_the_packet_fuzzer() {
    in_test_namespace(|pin_dir| {
        let mut harness = Harness::new(pin_dir);
        let mut repo = PolicyRepository::new();
        let doc = json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "pods-out-web-in", "namespace": "ns-a"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
                     "egress": [{"to": [{"podSelector": {}}]}],
                     "ingress": [{"ports": [{"protocol": "TCP", "port": 80}]}]},
        });
        repo.upsert(Policy::parse(&doc.to_string()).unwrap(), PolicyOrigin::Api)
            .unwrap();
        let subject: Labels = "k8s:io.kubernetes.pod.namespace=ns-a".parse().unwrap();
        let mut cache = SelectorCache::new();
        cache.upsert_identity(SUBJECT_ID, subject.clone());
        let resolved = repo.resolve(&Subject::new(&subject), &cache);
        harness.apply(&resolved, 1, false);
        let (pod_mac, node_mac) = ([2, 0, 0, 0, 0, 2], [2, 0, 0, 0, 0, 1]);
        let dropped_invalid = [Outcome::Drop(maps::DROP_INVALID_PACKET, maps::DIR_EGRESS)];

        // A truncated ARP request or neighbour solicitation was dropped
        // with no drop event and in no counter.
        let mut arp = frames::ethernet([0xff; 6], pod_mac, 0x0806, &[0, 1, 8, 0, 6, 4, 0, 1]);
        arp.extend_from_slice(&pod_mac);
        arp.extend_from_slice(&SUBJECT_V4.octets());
        assert_eq!(
            harness.run(Direction::Egress, &[arp]),
            dropped_invalid,
            "an ARP request cut before its target is an invalid packet"
        );
        let solicited: Ipv6Addr = "ff02::1:ff00:1".parse().unwrap();
        let target = Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1);
        let ns = frames::icmp6(SUBJECT_V6, solicited, 135, 0, [0; 4], &target.octets());
        let packet = frames::ipv6(SUBJECT_V6, solicited, 255, &[], proto::ICMPV6, &ns);
        let mut frame = frames::ethernet(node_mac, pod_mac, frames::ETH_P_IPV6, &packet);
        frame.truncate(frame.len() - 8);
        assert_eq!(
            harness.run(Direction::Egress, &[frame]),
            dropped_invalid,
            "a neighbour solicitation shorter than its payload length is an invalid packet"
        );

        // A pod's packet to itself with equal ports (every ICMP echo to
        // itself) passed its own ingress policy as the reply of the egress
        // conntrack entry it had just opened.
        let own = IpAddr::V6(SUBJECT_V6);
        let udp = frames::ipv6(
            SUBJECT_V6,
            SUBJECT_V6,
            64,
            &[],
            proto::UDP,
            &frames::udp(own, own, 53, 53, b"x"),
        );
        let udp = frames::ethernet(node_mac, pod_mac, frames::ETH_P_IPV6, &udp);
        let denied_in = Outcome::Drop(maps::DROP_POLICY_DEFAULT_DENY, maps::DIR_INGRESS);
        assert_eq!(
            harness.run(Direction::Egress, &[udp.clone(), udp]),
            [denied_in; 2],
            "UDP 53 -> 53 to itself leaves (egress allows pods) and is refused by its ingress, each time"
        );
        let echo = frames::icmp6(SUBJECT_V6, SUBJECT_V6, 128, 0, frames::echo_rest(7, 1), &[]);
        let echo = frames::ipv6(SUBJECT_V6, SUBJECT_V6, 64, &[], proto::ICMPV6, &echo);
        let echo = frames::ethernet(node_mac, pod_mac, frames::ETH_P_IPV6, &echo);
        assert_eq!(
            harness.run(Direction::Egress, &[echo.clone(), echo]),
            [denied_in; 2],
            "an echo to itself is refused by its ingress, each time"
        );
    });
}

/// One identity the packets come from or go to.
struct PeerSpec {
    identity: u32,
    labels: Option<Labels>,
    v4: Ipv4Addr,
    v6: Ipv6Addr,
    /// A pod's named container ports.
    named_ports: Vec<NamedPort>,
}

/// A loaded datapath with its own pins and the subject endpoint on a veth
/// of the calling thread's namespace (made by [`in_test_namespace`]).
struct Harness {
    loader: EndpointDatapath,
    ring: aya::maps::RingBuf<aya::maps::MapData>,
    ifindex: u32,
    /// The veth of the local peer endpoint.
    local_ifindex: u32,
}

impl Harness {
    fn new(pin_dir: std::path::PathBuf) -> Self {
        let mut opts = DatapathOptions::new(pin_dir);
        opts.ct4_max = 4096;
        opts.ct6_max = 4096;
        opts.endpoints_max = 64;
        opts.ipcache_max = 4096;
        opts.policy_max = 65536;
        opts.events_bytes = 1 << 16;
        let mut datapath = Datapath::open(opts).expect("the datapath loads with its own pins");
        let ring = datapath.take_events().expect("the event ring buffer");
        let loader = EndpointDatapath::new(datapath, PREFIX).expect("the loader library adopts it");
        let veth = |name: String| {
            svc_loader::netdev::name_to_ifindex(&name)
                .expect("interface lookup")
                .expect("the test veth")
        };
        Self {
            loader,
            ring,
            ifindex: veth(format!("{PREFIX}0")),
            local_ifindex: veth(format!("{PREFIX}2")),
        }
    }

    /// Realises the engine's resolved policy as svc-endpoint asks for it:
    /// the ApplyEndpoint request, checked by `validate::endpoint`, applied
    /// by `EndpointDatapath::apply`.
    fn apply(&self, resolved: &ResolvedPolicy, revision: u64, allow_from_host: bool) {
        let addresses = [SUBJECT_V4.into(), SUBJECT_V6.into()];
        self.apply_endpoint(
            1,
            self.ifindex,
            &addresses,
            SUBJECT_ID,
            resolved,
            revision,
            allow_from_host,
        );
    }

    /// [`apply`](Self::apply) for the local peer endpoint (id 2).
    fn apply_local(&self, peer: &PeerSpec, resolved: &ResolvedPolicy, revision: u64, allow_from_host: bool) {
        let addresses = [peer.v4.into(), peer.v6.into()];
        let ifindex = self.local_ifindex;
        self.apply_endpoint(
            2,
            ifindex,
            &addresses,
            peer.identity,
            resolved,
            revision,
            allow_from_host,
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn apply_endpoint(
        &self,
        endpoint_id: u32,
        ifindex: u32,
        addresses: &[IpAddr],
        identity: u32,
        resolved: &ResolvedPolicy,
        revision: u64,
        allow_from_host: bool,
    ) {
        let request = pb::ApplyEndpointRequest {
            endpoint_id,
            host_ifindex: ifindex,
            addresses: addresses.iter().map(|a| rivet_proto::net::address_bytes(*a)).collect(),
            mac: vec![2, 0, 0, 0, 0, endpoint_id as u8 + 1],
            identity,
            policy: Some(resolved.to_proto(revision, allow_from_host)),
        };
        let spec = svc_loader::validate::endpoint(&request).expect("the request is valid");
        self.loader.apply(&spec).expect("the endpoint is applied");
    }

    /// Runs each frame through the program of `direction`, then empties
    /// conntrack and the fragments map so that the next case is a new flow.
    fn run(&mut self, direction: Direction, frames: &[Vec<u8>]) -> Vec<Outcome> {
        let hook = match direction {
            Direction::Ingress => Hook::Egress,
            Direction::Egress => Hook::Ingress,
        };
        let mut outcomes = Vec::new();
        for frame in frames {
            let retval = self
                .loader
                .datapath()
                .test_run(hook, frame, self.ifindex)
                .expect("BPF_PROG_TEST_RUN");
            outcomes.push(outcome(retval, &mut self.ring));
        }
        let maps = self.loader.datapath().maps();
        let mut ct4 = maps.ct4.lock();
        let keys: Vec<_> = ct4.keys().filter_map(Result::ok).collect();
        for k in keys {
            let _ = ct4.remove(&k);
        }
        let mut ct6 = maps.ct6.lock();
        let keys: Vec<_> = ct6.keys().filter_map(Result::ok).collect();
        for k in keys {
            let _ = ct6.remove(&k);
        }
        // IPv4 identifications wrap after 65536 cases.
        let mut fragments = maps.fragments.lock();
        let keys: Vec<_> = fragments.keys().filter_map(Result::ok).collect();
        for k in keys {
            let _ = fragments.remove(&k);
        }
        outcomes
    }
}

/// Runs `f` in a fresh namespace holding the test veth, with a pin
/// directory of its own; both are removed afterwards (also on panic).
fn in_test_namespace<T: Send + 'static>(f: impl FnOnce(std::path::PathBuf) -> T + Send + 'static) -> T {
    static PINS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let ns = NetNs::new("rvdiff").expect("a test namespace");
    veth_pair(&ns, &format!("{PREFIX}0"), &ns, &format!("{PREFIX}1")).expect("a veth in it");
    veth_pair(&ns, &format!("{PREFIX}2"), &ns, &format!("{PREFIX}3")).expect("a second veth in it");
    let n = PINS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let pins = PinDir::of_node(&format!("diff-{}-{n}", std::process::id()));
    let pin_dir = pins.0.clone();
    let out = ns.in_ns(move || f(pin_dir)).expect("entering the test namespace");
    drop(ns);
    drop(pins);
    out
}

/// Runs every scenario inside the test namespace; returns the case count,
/// a description of each disagreement, how often each outcome was expected,
/// and how many cases had a pod peer inside an ipBlock prefix of the
/// subject (decided per address) and, of those, at the host prefix of an
/// ipBlock naming a port.
fn run(
    seed: u64,
    scenarios: usize,
    pin_dir: std::path::PathBuf,
) -> (
    usize,
    Vec<String>,
    std::collections::BTreeMap<Outcome, usize>,
    (usize, usize),
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut harness = Harness::new(pin_dir);

    let mut cases = 0;
    let mut pods_by_address = 0;
    let mut named_port_hosts = 0;
    let mut seen = std::collections::BTreeMap::new();
    let mut failures = Vec::new();
    let mut frag_id = 1u32;
    for scenario in 0..scenarios {
        let world = make_world(&mut rng);
        let documents: Vec<String> = (0..rng.random_range(1..=3))
            .map(|i| random_policy(&mut rng, i, &world.peers).to_string())
            .collect();
        let mut repo = PolicyRepository::new();
        for doc in &documents {
            let policy = Policy::parse(doc).unwrap_or_else(|e| panic!("generated policy is invalid: {e}\n{doc}"));
            repo.upsert(policy, PolicyOrigin::Api).expect("stored");
        }
        let mut cache = SelectorCache::new();
        cache.upsert_identity(SUBJECT_ID, world.subject.clone());
        cache.set_named_ports(SUBJECT_ID, world.subject_ports.clone());
        for address in [IpAddr::V4(SUBJECT_V4), IpAddr::V6(SUBJECT_V6)] {
            cache.set_address_named_ports(address, world.subject_ports.clone());
        }
        for peer in &world.peers {
            if let Some(labels) = &peer.labels {
                cache.upsert_identity(peer.identity, labels.clone());
                cache.set_named_ports(peer.identity, peer.named_ports.clone());
                for address in [IpAddr::V4(peer.v4), IpAddr::V6(peer.v6)] {
                    cache.set_address_named_ports(address, peer.named_ports.clone());
                }
            }
        }
        // A CIDR identity per ipBlock prefix and per host prefix a named
        // port needs, as svc-endpoint allocates them.
        let hosts = repo.named_port_hosts(&cache);
        let mut prefixes = repo.cidrs();
        prefixes.extend(hosts.iter().copied());
        let cidrs: Vec<(IpNet, u32)> = prefixes.into_iter().zip(CIDR_IDENTITY_MIN..).collect();
        for (prefix, id) in &cidrs {
            cache.set_cidr_identity(*prefix, *id);
        }
        let subject = Subject {
            labels: &world.subject,
            named_ports: &world.subject_ports,
        };
        let resolved = repo.resolve(&subject, &cache);
        let allow_from_host = rng.random_bool(0.5);
        harness.apply(&resolved, scenario as u64 + 1, allow_from_host);
        // Peer 0 is an endpoint on this node with its own policy: the
        // subject's traffic to it meets the subject's egress policy, then
        // its ingress policy, in from_container, and is redirected to it.
        let local = &world.peers[LOCAL_PEER];
        let local_labels = local.labels.as_ref().expect("a pod");
        let local_subject = Subject {
            labels: local_labels,
            named_ports: &local.named_ports,
        };
        let local_resolved = repo.resolve(&local_subject, &cache);
        harness.apply_local(local, &local_resolved, scenario as u64 + 1, allow_from_host);
        let mut ipcache: Vec<(IpAddr, u8, IpcacheValue)> = world
            .peers
            .iter()
            .filter(|p| p.identity != 2)
            .flat_map(|p| {
                let value = IpcacheValue::new(p.identity, None);
                [(IpAddr::V4(p.v4), 32, value), (IpAddr::V6(p.v6), 128, value)]
            })
            .collect();
        // The CIDR identities too (entities see them); an endpoint's own
        // /32 or /128 outranks a CIDR prefix of the same address.
        let cidr_entries: Vec<(IpAddr, u8, IpcacheValue)> = cidrs
            .iter()
            .map(|(prefix, id)| (prefix.network(), prefix.prefix_len(), IpcacheValue::new(*id, None)))
            .filter(|(a, l, _)| !ipcache.iter().any(|(pa, pl, _)| (pa, pl) == (a, l)))
            .collect();
        ipcache.extend(cidr_entries);
        harness.loader.upsert_ipcache(&ipcache).expect("ipcache entries");

        for _ in 0..PACKETS_PER_SCENARIO {
            let case = random_case(&mut rng, &world, &mut frag_id);
            let peer_spec = &world.peers[case.peer];
            let peer = PacketPeer {
                identity: peer_spec.identity,
                labels: peer_spec.labels.as_ref(),
                address: Some(case.address),
                named_ports: &peer_spec.named_ports,
            };
            let decision = repo.evaluate(&subject, case.direction, &peer, case.protocol, case.port);
            let to_local = case.direction == Direction::Egress
                && case.peer == LOCAL_PEER
                && matches!(
                    case.kind,
                    Kind::Plain | Kind::Fragments | Kind::LoneFragment | Kind::NdUnderPolicy | Kind::IcmpError
                );
            let local_decision = to_local.then(|| {
                let me = PacketPeer {
                    identity: SUBJECT_ID,
                    labels: Some(&world.subject),
                    address: Some(case.source),
                    named_ports: &world.subject_ports,
                };
                let d = repo.evaluate(&local_subject, Direction::Ingress, &me, case.protocol, case.port);
                (d, local_resolved.enforce_ingress)
            });
            let expected = expect(
                &case,
                decision,
                local_decision,
                &resolved,
                peer_spec.identity,
                allow_from_host,
            );
            let outcomes = harness.run(case.direction, &case.frames);
            cases += 1;
            if peer_spec.labels.is_some()
                && resolved
                    .prefixes_of(case.direction)
                    .any(|p| p.prefix.contains(&case.address))
            {
                pods_by_address += 1;
                let host = IpNet::from(case.address);
                if hosts.contains(&host) && resolved.prefixes_of(case.direction).any(|p| p.prefix == host) {
                    named_port_hosts += 1;
                }
            }
            *seen.entry(expected[0].any_direction()).or_insert(0) += 1;
            if outcomes != expected {
                failures.push(describe(
                    &documents,
                    &resolved,
                    allow_from_host,
                    &world,
                    &case,
                    decision,
                    &expected,
                    &outcomes,
                ));
            }
        }
        let stale: Vec<(IpAddr, u8)> = ipcache.iter().map(|(a, l, _)| (*a, *l)).collect();
        harness.loader.delete_ipcache(&stale).expect("ipcache cleanup");
    }
    (cases, failures, seen, (pods_by_address, named_port_hosts))
}

/// What one frame did: passed, or dropped with a reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Pass,
    /// Redirected to a local endpoint (`TC_ACT_REDIRECT`).
    Redirect,
    /// Dropped: the reason (`DROP_*`) and the direction of the endpoint
    /// whose check dropped it (`DIR_*`; 0 in counts, for any).
    Drop(u8, u8),
    Other(u32),
}

impl Outcome {
    /// The outcome with the drop direction left out (for counting).
    fn any_direction(self) -> Self {
        match self {
            Self::Drop(reason, _) => Self::Drop(reason, 0),
            other => other,
        }
    }
}

fn outcome(retval: u32, ring: &mut aya::maps::RingBuf<aya::maps::MapData>) -> Outcome {
    let mut dropped = None;
    while let Some(item) = ring.next() {
        if let Some(event) = Event::from_bytes(&item)
            && event.kind == maps::EVENT_DROP
        {
            dropped = Some((event.reason, event.direction));
        }
    }
    match (retval, dropped) {
        (TC_ACT_OK, None) => Outcome::Pass,
        (TC_ACT_REDIRECT, None) => Outcome::Redirect,
        (TC_ACT_SHOT, Some((reason, direction))) => Outcome::Drop(reason, direction),
        (other, _) => Outcome::Other(other),
    }
}

// ------------------------------------------------------------- the world

/// The subject endpoint's labels and the peers of this scenario.
struct World {
    subject: Labels,
    subject_ports: Vec<NamedPort>,
    /// Cluster pods, then host, world and remote-node.
    peers: Vec<PeerSpec>,
    namespace_labels: Vec<Vec<(String, String)>>,
}

fn make_world(rng: &mut StdRng) -> World {
    let namespace_labels: Vec<Vec<(String, String)>> = NAMESPACES
        .iter()
        .map(|ns| {
            let mut labels = vec![("kubernetes.io/metadata.name".to_owned(), (*ns).to_owned())];
            for (key, values) in &NAMESPACE_KEYS[..2] {
                if rng.random_bool(0.8) {
                    labels.push(((*key).to_owned(), (*values.choose(rng).unwrap()).to_owned()));
                }
            }
            labels
        })
        .collect();
    let pod = |rng: &mut StdRng, ns: usize| -> Labels {
        let mut text = vec![format!("k8s:io.kubernetes.pod.namespace={}", NAMESPACES[ns])];
        for (key, value) in &namespace_labels[ns] {
            text.push(format!("k8s:ns.labels/{key}={value}"));
        }
        for (key, values) in POD_KEYS {
            if rng.random_bool(0.75) {
                text.push(format!("k8s:{key}={}", values.choose(rng).unwrap()));
            }
        }
        text.join(",").parse().expect("generated labels parse")
    };
    let subject = pod(rng, 0);
    let subject_ports = named_ports(rng);
    let mut peers: Vec<PeerSpec> = (0..6u8)
        .map(|i| {
            let ns = rng.random_range(0..NAMESPACES.len());
            PeerSpec {
                identity: 301 + u32::from(i),
                labels: Some(pod(rng, ns)),
                v4: Ipv4Addr::new(198, 18, 100, i + 1),
                v6: Ipv6Addr::new(0x2001, 2, 0, 100, 0, 0, 0, u16::from(i) + 1),
                named_ports: named_ports(rng),
            }
        })
        .collect();
    for (identity, last) in [(1, 201), (2, 202), (6, 206)] {
        peers.push(PeerSpec {
            identity,
            labels: None,
            v4: Ipv4Addr::new(198, 18, 200, last),
            v6: Ipv6Addr::new(0x2001, 2, 0, 200, 0, 0, 0, u16::from(last)),
            named_ports: Vec::new(),
        });
    }
    World {
        subject,
        subject_ports,
        peers,
        namespace_labels,
    }
}

// ------------------------------------------------------------ policies

/// Named container ports a pod may have (each with a random number).
const PORT_NAMES: [(&str, Protocol); 3] = [("http", Protocol::Tcp), ("dns", Protocol::Udp), ("db", Protocol::Sctp)];

fn named_ports(rng: &mut StdRng) -> Vec<NamedPort> {
    let mut ports = Vec::new();
    for (name, protocol) in PORT_NAMES {
        if rng.random_bool(0.5) {
            ports.push(NamedPort::new(name, protocol, *PORTS.choose(rng).unwrap()));
        }
    }
    ports
}

fn random_selector(rng: &mut StdRng, keys: &[(&str, &[&str])]) -> Value {
    let mut selector = serde_json::Map::new();
    if rng.random_bool(0.5) {
        let (key, values) = keys.choose(rng).unwrap();
        selector.insert("matchLabels".into(), json!({ *key: values.choose(rng).unwrap() }));
    }
    if rng.random_bool(0.35) {
        let (key, values) = keys.choose(rng).unwrap();
        let expression = match rng.random_range(0..4) {
            0 => json!({"key": key, "operator": "In", "values": pick_some(rng, values)}),
            1 => json!({"key": key, "operator": "NotIn", "values": pick_some(rng, values)}),
            2 => json!({"key": key, "operator": "Exists"}),
            _ => json!({"key": key, "operator": "DoesNotExist"}),
        };
        selector.insert("matchExpressions".into(), json!([expression]));
    }
    Value::Object(selector)
}

fn pick_some<'a>(rng: &mut StdRng, values: &[&'a str]) -> Vec<&'a str> {
    let n = rng.random_range(1..=values.len());
    values.choose_multiple(rng, n).copied().collect()
}

/// An ipBlock around the peers' addresses, with up to two excepts of the
/// peers' addresses inside it.
fn random_ip_block(rng: &mut StdRng, peers: &[PeerSpec]) -> Value {
    let pick = |rng: &mut StdRng, v6: bool| -> IpAddr {
        let peer = peers.choose(rng).expect("peers");
        if v6 { peer.v6.into() } else { peer.v4.into() }
    };
    let template = *CIDRS.choose(rng).unwrap();
    let (address, len) = template.split_once('/').expect("a prefix");
    let len: u8 = len.parse().expect("a length");
    let v6 = template.contains(':') || len > 32;
    let address = if address == "*" {
        pick(rng, v6)
    } else {
        address.parse().expect("an address")
    };
    let cidr = IpNet::new(address, len).expect("a prefix").trunc();
    let max = if v6 { 128 } else { 32 };
    let mut except = std::collections::BTreeSet::new();
    for _ in 0..rng.random_range(0..=2) {
        let inside = pick(rng, v6);
        if len < max && cidr.contains(&inside) {
            let inner_len = rng.random_range(len + 1..=max);
            except.insert(IpNet::new(inside, inner_len).expect("a prefix").trunc());
        }
    }
    let except: Vec<String> = except.iter().map(ToString::to_string).collect();
    json!({"ipBlock": {"cidr": cidr.to_string(), "except": except}})
}

fn random_peer(rng: &mut StdRng, rivet: bool, peers: &[PeerSpec]) -> Value {
    if rng.random_bool(0.3) {
        return random_ip_block(rng, peers);
    }
    match rng.random_range(0..if rivet { 4 } else { 3 }) {
        0 => json!({"podSelector": random_selector(rng, &POD_KEYS)}),
        1 => json!({"namespaceSelector": random_selector(rng, &NAMESPACE_KEYS)}),
        2 => json!({
            "podSelector": random_selector(rng, &POD_KEYS),
            "namespaceSelector": random_selector(rng, &NAMESPACE_KEYS),
        }),
        _ => {
            let entities = ["world", "host", "cluster", "remote-node", "all"];
            json!({"entities": pick_some(rng, &entities)})
        }
    }
}

/// `named`: the probability that the port is a name.
fn random_port(rng: &mut StdRng, rivet: bool, named: f64) -> Value {
    if rng.random_bool(named) {
        let (name, protocol) = PORT_NAMES.choose(rng).unwrap();
        let protocol = match protocol {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            _ => "SCTP",
        };
        return json!({"protocol": protocol, "port": name});
    }
    let kinds: &[&str] = if rivet {
        &["TCP", "UDP", "SCTP", "ICMP", "ICMPv6", "ANY"]
    } else {
        &["TCP", "UDP", "SCTP"]
    };
    let protocol = *kinds.choose(rng).unwrap();
    if !matches!(protocol, "TCP" | "UDP" | "SCTP") || rng.random_bool(0.2) {
        return json!({"protocol": protocol});
    }
    let port = *PORTS.choose(rng).unwrap();
    if rng.random_bool(0.3) {
        let end = port + rng.random_range(1..=1200u16);
        json!({"protocol": protocol, "port": port, "endPort": end})
    } else if rng.random_bool(0.15) {
        json!({"port": port}) // protocol defaults to TCP
    } else {
        json!({"protocol": protocol, "port": port})
    }
}

fn random_rule(rng: &mut StdRng, rivet: bool, peers_key: &str, world: &[PeerSpec]) -> Value {
    let mut rule = serde_json::Map::new();
    let peers: Vec<Value> = (0..rng.random_range(0..=2))
        .map(|_| random_peer(rng, rivet, world))
        .collect();
    // Egress ipBlocks naming a port resolve per pod address: often named.
    let named = if peers_key == "to" && peers.iter().any(|p| p.get("ipBlock").is_some()) {
        0.5
    } else {
        0.2
    };
    if !peers.is_empty() {
        rule.insert(peers_key.into(), Value::Array(peers));
    }
    let ports = rng.random_range(0..=2);
    if ports > 0 {
        rule.insert(
            "ports".into(),
            Value::Array((0..ports).map(|_| random_port(rng, rivet, named)).collect()),
        );
    }
    Value::Object(rule)
}

fn random_policy(rng: &mut StdRng, index: usize, world: &[PeerSpec]) -> Value {
    let rivet = rng.random_bool(0.5);
    // Mostly in the subject's namespace, so that it selects the subject.
    let namespace = if rng.random_bool(0.85) {
        NAMESPACES[0]
    } else {
        NAMESPACES.choose(rng).unwrap()
    };
    let mut spec = serde_json::Map::new();
    spec.insert("podSelector".into(), random_selector(rng, &POD_KEYS));
    let rules = |rng: &mut StdRng, key: &str, max: usize| -> Value {
        Value::Array(
            (0..rng.random_range(0..=max))
                .map(|_| random_rule(rng, rivet, key, world))
                .collect(),
        )
    };
    spec.insert("ingress".into(), rules(rng, "from", 2));
    spec.insert("egress".into(), rules(rng, "to", 2));
    if rivet {
        if rng.random_bool(0.5) {
            spec.insert("ingressDeny".into(), json!([random_rule(rng, rivet, "from", world)]));
        }
        if rng.random_bool(0.5) {
            spec.insert("egressDeny".into(), json!([random_rule(rng, rivet, "to", world)]));
        }
        if rng.random_bool(0.3) {
            spec.insert(
                "enableDefaultDeny".into(),
                json!({"ingress": rng.random_bool(0.5), "egress": rng.random_bool(0.5)}),
            );
        }
    }
    if rng.random_bool(0.5) {
        let types: Vec<&str> = match rng.random_range(0..3) {
            0 => vec!["Ingress"],
            1 => vec!["Egress"],
            _ => vec!["Ingress", "Egress"],
        };
        spec.insert("policyTypes".into(), json!(types));
    }
    let (api_version, kind) = if rivet {
        ("rivet.io/v1", "RivetNetworkPolicy")
    } else {
        ("networking.k8s.io/v1", "NetworkPolicy")
    };
    json!({
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": format!("p{index}"), "namespace": namespace},
        "spec": spec,
    })
}

// ------------------------------------------------------------- packets

/// What kind of packet a case sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// One packet of a new connection.
    Plain,
    /// The first two fragments of a datagram: both follow its verdict.
    Fragments,
    /// A non-first fragment whose first never came.
    LoneFragment,
    /// Neighbour discovery as the RFC sends it: never under policy.
    NeighbourDiscovery,
    /// An ND message that is not plumbing (hop limit 64, or a global
    /// destination): ICMPv6 under policy.
    NdUnderPolicy,
    /// An MLDv2 report from a link-local address, hop limit 1: plumbing.
    Mld,
    /// Traffic with the node's link-local address (the host identity), or
    /// from the pod's link-local address (an invalid source).
    LinkLocal,
    /// An ICMP error about a packet of no known connection: ICMP under
    /// policy (it never opens a connection).
    IcmpError,
    /// More than 8 extension headers: dropped whatever the policy.
    LongChain,
    /// An extension header running past the packet.
    TruncatedChain,
}

struct Case {
    direction: Direction,
    peer: usize,
    /// The peer's address as the policy sees it.
    address: IpAddr,
    /// The subject's address in the packet.
    source: IpAddr,
    /// Sent from the pod's link-local address.
    invalid_source: bool,
    kind: Kind,
    /// IANA protocol and destination port as the policy sees them.
    protocol: u8,
    port: u16,
    what: String,
    frames: Vec<Vec<u8>>,
}

fn random_case(rng: &mut StdRng, world: &World, frag_id: &mut u32) -> Case {
    let direction = if rng.random_bool(0.5) {
        Direction::Ingress
    } else {
        Direction::Egress
    };
    let peer = rng.random_range(0..world.peers.len());
    let v6 = rng.random_bool(0.5);
    let kind = match rng.random_range(0..100) {
        0..67 => Kind::Plain,
        67..70 => Kind::IcmpError,
        70..80 => Kind::Fragments,
        80..84 => Kind::LoneFragment,
        84..87 if v6 => Kind::NeighbourDiscovery,
        87..89 if v6 => Kind::NdUnderPolicy,
        89..91 if v6 => Kind::Mld,
        91..95 if v6 => Kind::LinkLocal,
        95..97 if v6 => Kind::LongChain,
        97..100 if v6 => Kind::TruncatedChain,
        _ => Kind::Plain,
    };
    // Link-local traffic is with the node (the host identity).
    let peer = if kind == Kind::LinkLocal {
        world.peers.iter().position(|p| p.identity == 1).expect("a host peer")
    } else {
        peer
    };
    let node_ll = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
    let pod_ll = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 2);
    let invalid_source = kind == Kind::LinkLocal && direction == Direction::Egress && rng.random_bool(0.5);
    let (protocol, icmp_type) = match rng.random_range(0..100) {
        0..35 => (proto::TCP, 0),
        35..60 => (proto::UDP, 0),
        60..72 => (proto::SCTP, 0),
        72..92 => (if v6 { proto::ICMPV6 } else { proto::ICMP }, if v6 { 128 } else { 8 }),
        // Other informational types: ICMPv6 200, ICMP timestamp.
        _ => (if v6 { proto::ICMPV6 } else { proto::ICMP }, if v6 { 200 } else { 13 }),
    };
    // Often a number the destination pod names, so that named ports decide.
    let named_here = match direction {
        Direction::Ingress => &world.subject_ports,
        Direction::Egress => &world.peers[peer].named_ports,
    };
    let port = if matches!(protocol, proto::TCP | proto::UDP | proto::SCTP) {
        if !named_here.is_empty() && rng.random_bool(0.3) {
            named_here.choose(rng).expect("a named port").port
        } else if rng.random_bool(0.8) {
            *PORTS.choose(rng).unwrap() + rng.random_range(0..3) * rng.random_range(0..400)
        } else {
            rng.random_range(1..=65535)
        }
    } else {
        0
    };
    let sport = rng.random_range(1024..=65535u16);
    // Echo identifier 0 made every ICMPv6 echo link plumbing once.
    let echo_id = if rng.random_bool(0.2) { 0 } else { sport };
    let mut headers = Vec::new();
    if v6 && rng.random_bool(0.3) {
        if rng.random_bool(0.3) {
            headers.push(ExtHeader::HopByHop { len: 0 });
        }
        for _ in 0..rng.random_range(1..=3) {
            headers.push(match rng.random_range(0..3) {
                0 => ExtHeader::DestinationOptions {
                    len: rng.random_range(0..3),
                },
                1 => ExtHeader::Routing {
                    len: rng.random_range(0..3),
                },
                _ => ExtHeader::Authentication {
                    len: rng.random_range(1..5),
                },
            });
        }
    }
    let p = &world.peers[peer];
    let (src, dst): (IpAddr, IpAddr) = match (direction, v6) {
        _ if invalid_source => (pod_ll.into(), node_ll.into()),
        (Direction::Ingress, true) if kind == Kind::LinkLocal => (node_ll.into(), SUBJECT_V6.into()),
        (Direction::Egress, true) if kind == Kind::LinkLocal => (SUBJECT_V6.into(), node_ll.into()),
        (Direction::Ingress, false) => (p.v4.into(), SUBJECT_V4.into()),
        (Direction::Ingress, true) => (p.v6.into(), SUBJECT_V6.into()),
        (Direction::Egress, false) => (SUBJECT_V4.into(), p.v4.into()),
        (Direction::Egress, true) => (SUBJECT_V6.into(), p.v6.into()),
    };
    let address = if direction == Direction::Ingress { src } else { dst };
    let source = if direction == Direction::Ingress { dst } else { src };
    let l4 = |data: &[u8]| -> Vec<u8> {
        match protocol {
            proto::TCP => {
                let mut s = frames::tcp(src, dst, sport, port, TCP_SYN);
                s.extend_from_slice(data);
                s
            }
            proto::UDP => frames::udp(src, dst, sport, port, data),
            proto::SCTP => {
                let mut s = frames::sctp(sport, port);
                s.extend_from_slice(data);
                s
            }
            proto::ICMP => frames::icmp4(icmp_type, 0, frames::echo_rest(echo_id, 1), data),
            _ => frames::icmp6(
                v6_of(src),
                v6_of(dst),
                icmp_type,
                0,
                frames::echo_rest(echo_id, 1),
                data,
            ),
        }
    };
    let ethertype = if v6 { frames::ETH_P_IPV6 } else { frames::ETH_P_IP };
    let eth = |packet: Vec<u8>| frames::ethernet([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], ethertype, &packet);
    let ip = |headers: &[ExtHeader], protocol: u8, payload: &[u8]| -> Vec<u8> {
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => frames::ipv4(s, d, protocol, 64, 0, None, payload),
            _ => frames::ipv6(v6_of(src), v6_of(dst), 64, headers, protocol, payload),
        }
    };
    *frag_id += 1;
    let id = *frag_id;
    let fragments = |datagram: &[u8]| -> Vec<Vec<u8>> {
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => frames::ipv4_fragments(s, d, protocol, id as u16, datagram, 256),
            _ => frames::ipv6_fragments(v6_of(src), v6_of(dst), &headers, protocol, id, datagram, 256),
        }
    };
    let (frames_out, protocol_seen, what) = match kind {
        Kind::Plain | Kind::LinkLocal => (vec![eth(ip(&headers, protocol, &l4(b"rivet")))], protocol, "packet"),
        Kind::NdUnderPolicy => {
            // Ingress: a neighbour solicitation a router forwarded (hop
            // limit below 255); egress: a neighbour advertisement from the
            // pod's address to a global address.
            let (kind, hop_limit) = if direction == Direction::Ingress {
                (135, 64)
            } else {
                (136, if rng.random_bool(0.5) { 255 } else { 64 })
            };
            let nd = frames::icmp6(v6_of(src), v6_of(dst), kind, 0, [0; 4], &SUBJECT_V6.octets());
            (
                vec![eth(frames::ipv6(
                    v6_of(src),
                    v6_of(dst),
                    hop_limit,
                    &[],
                    proto::ICMPV6,
                    &nd,
                ))],
                proto::ICMPV6,
                "neighbour discovery that is not plumbing",
            )
        }
        Kind::IcmpError => {
            // Port unreachable from the receiver of a packet that went the
            // other way (inner: dst -> src), TCP or UDP.
            let inner_protocol = if rng.random_bool(0.5) { proto::TCP } else { proto::UDP };
            let inner_l4 = match inner_protocol {
                proto::TCP => frames::tcp(dst, src, port, sport, TCP_SYN),
                _ => frames::udp(dst, src, port, sport, b"rivet"),
            };
            let (icmp_protocol, packet) = match (src, dst) {
                (IpAddr::V4(s4), IpAddr::V4(d4)) => {
                    let inner = frames::ipv4(d4, s4, inner_protocol, 64, 0, None, &inner_l4);
                    let error = frames::icmp4(3, 3, [0; 4], &inner[..28]);
                    (proto::ICMP, frames::ipv4(s4, d4, proto::ICMP, 64, 0, None, &error))
                }
                _ => {
                    let (s6, d6) = (v6_of(src), v6_of(dst));
                    let inner = frames::ipv6(d6, s6, 64, &[], inner_protocol, &inner_l4);
                    let error = frames::icmp6(s6, d6, 1, 4, [0; 4], &inner[..48]);
                    (proto::ICMPV6, frames::ipv6(s6, d6, 64, &[], proto::ICMPV6, &error))
                }
            };
            (
                vec![eth(packet)],
                icmp_protocol,
                "ICMP port unreachable of no connection",
            )
        }
        Kind::Mld => {
            let source = if direction == Direction::Ingress {
                node_ll
            } else {
                pod_ll
            };
            let routers = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 0x16);
            let router_alert = ExtHeader::Raw {
                kind: proto::HOP_BY_HOP,
                bytes: vec![0, 5, 2, 0, 0, 1, 0],
            };
            let report = frames::icmp6(source, routers, 143, 0, [0; 4], &[]);
            (
                vec![eth(frames::ipv6(
                    source,
                    routers,
                    1,
                    &[router_alert],
                    proto::ICMPV6,
                    &report,
                ))],
                proto::ICMPV6,
                "MLDv2 report",
            )
        }
        Kind::Fragments => {
            let pieces = fragments(&l4(&[7; 600]));
            (
                pieces.into_iter().take(2).map(eth).collect(),
                protocol,
                "first two fragments",
            )
        }
        Kind::LoneFragment => {
            let pieces = fragments(&l4(&[7; 600]));
            (vec![eth(pieces[1].clone())], protocol, "lone non-first fragment")
        }
        Kind::NeighbourDiscovery => {
            // Ingress: the node's NS from its link-local address; egress:
            // the pod's DAD (from ::). Hop limit 255, to solicited-node.
            let target = if direction == Direction::Ingress {
                SUBJECT_V6
            } else {
                Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 9)
            };
            let source = if direction == Direction::Ingress {
                Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1)
            } else {
                Ipv6Addr::UNSPECIFIED
            };
            let solicited = Ipv6Addr::new(
                0xff02,
                0,
                0,
                0,
                0,
                1,
                0xff00 | (target.segments()[6] & 0xff),
                target.segments()[7],
            );
            let ns = frames::icmp6(source, solicited, 135, 0, [0; 4], &target.octets());
            (
                vec![eth(frames::ipv6(source, solicited, 255, &[], proto::ICMPV6, &ns))],
                proto::ICMPV6,
                "neighbour solicitation",
            )
        }
        Kind::LongChain => {
            let nine = vec![ExtHeader::DestinationOptions { len: 0 }; 9];
            (
                vec![eth(ip(&nine, protocol, &l4(b"x")))],
                protocol,
                "9 extension headers",
            )
        }
        Kind::TruncatedChain => {
            let broken = vec![ExtHeader::Raw {
                kind: proto::DEST_OPTS,
                bytes: vec![200, 1, 4, 0, 0, 0, 0],
            }];
            (vec![eth(ip(&broken, 59, &[]))], protocol, "truncated extension header")
        }
    };
    let what = format!(
        "{what}: {direction:?} {src} -> {dst}, protocol {protocol_seen}{}, source port {sport}, {} headers {:?}",
        if icmp_type != 0 && matches!(protocol, proto::ICMP | proto::ICMPV6) {
            format!(" type {icmp_type}")
        } else {
            format!(" port {port}")
        },
        if v6 { "IPv6" } else { "IPv4" },
        headers.iter().map(ExtHeader::kind).collect::<Vec<_>>(),
    );
    Case {
        direction,
        peer,
        address,
        source,
        invalid_source,
        kind,
        protocol: protocol_seen,
        // An ICMP error is judged as ICMP, which has no ports.
        port: if kind == Kind::IcmpError { 0 } else { port },
        what,
        frames: frames_out,
    }
}

fn v6_of(a: IpAddr) -> Ipv6Addr {
    match a {
        IpAddr::V6(a) => a,
        IpAddr::V4(a) => a.to_ipv6_mapped(),
    }
}

/// What the datapath must do with each frame of `case`, from the engine's
/// decision and the endpoint's settings.
/// `local`: for a packet to the local peer endpoint, that endpoint's
/// ingress decision and whether its ingress is enforced.
fn expect(
    case: &Case,
    decision: Decision,
    local: Option<(Decision, bool)>,
    resolved: &ResolvedPolicy,
    peer_identity: u32,
    allow_from_host: bool,
) -> Vec<Outcome> {
    let enforced = resolved.enforces(case.direction);
    // The subject's checks drop in its direction; the local peer's in ingress.
    let own = match case.direction {
        Direction::Ingress => maps::DIR_INGRESS,
        Direction::Egress => maps::DIR_EGRESS,
    };
    let verdict = |decision: Decision, passed: Outcome, direction: u8| match decision {
        Decision::NotEnforced | Decision::Allowed => passed,
        Decision::Denied => Outcome::Drop(maps::DROP_POLICY_DENIED, direction),
        Decision::DefaultDenied => Outcome::Drop(maps::DROP_POLICY_DEFAULT_DENY, direction),
    };
    let policy = || {
        let from_host = case.direction == Direction::Ingress && peer_identity == 1 && allow_from_host;
        match (verdict(decision, Outcome::Pass, own), local) {
            _ if from_host => Outcome::Pass,
            (Outcome::Pass, Some((local, _))) => verdict(local, Outcome::Redirect, maps::DIR_INGRESS),
            (outcome, _) => outcome,
        }
    };
    let untracked = |direction| vec![Outcome::Drop(maps::DROP_FRAGMENT_UNTRACKED, direction)];
    match case.kind {
        _ if case.invalid_source => vec![Outcome::Drop(maps::DROP_INVALID_SOURCE_ADDRESS, maps::DIR_EGRESS)],
        Kind::Plain | Kind::NdUnderPolicy | Kind::LinkLocal | Kind::IcmpError => vec![policy()],
        Kind::Fragments => vec![policy(); 2],
        Kind::LoneFragment if enforced => untracked(own),
        Kind::LoneFragment if local.is_some_and(|(_, enforced)| enforced) => untracked(maps::DIR_INGRESS),
        Kind::LoneFragment if local.is_some() => vec![Outcome::Redirect],
        Kind::LoneFragment | Kind::NeighbourDiscovery | Kind::Mld => vec![Outcome::Pass],
        Kind::LongChain | Kind::TruncatedChain => vec![Outcome::Drop(maps::DROP_EXT_HEADER_CHAIN, own)],
    }
}

#[allow(clippy::too_many_arguments)]
fn describe(
    documents: &[String],
    resolved: &ResolvedPolicy,
    allow_from_host: bool,
    world: &World,
    case: &Case,
    decision: Decision,
    expected: &[Outcome],
    outcomes: &[Outcome],
) -> String {
    let peer = &world.peers[case.peer];
    let mut out = String::new();
    let _ = writeln!(out, "case: {}", case.what);
    let _ = writeln!(
        out,
        "peer: identity {} {}",
        peer.identity,
        peer.labels.as_ref().map_or(String::new(), ToString::to_string)
    );
    let _ = writeln!(out, "subject: identity {SUBJECT_ID} {}", world.subject);
    let _ = writeln!(out, "namespaces: {:?}", world.namespace_labels);
    let _ = writeln!(out, "engine: {decision:?}, allow_from_host {allow_from_host}");
    let _ = writeln!(out, "expected {expected:?}, datapath {outcomes:?}");
    let _ = writeln!(
        out,
        "resolved: ingress enforced {}, egress enforced {}, entries {:?}, prefixes {:?}",
        resolved.enforce_ingress, resolved.enforce_egress, resolved.entries, resolved.prefixes
    );
    for doc in documents {
        let _ = writeln!(out, "policy: {doc}");
    }
    out
}
