//! ClusterIP load balancing in the real datapath: a node namespace with pod
//! namespaces, svc-loader inside it, services programmed through its
//! LoadBalancerService, and real TCP and UDP traffic from a client pod to a
//! service address, IPv4 and IPv6.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use rivet_datapath::maps::{LbAffinity, LbAffinityKey, LbBackend};
use rivet_proto::loader::v1 as pb;
use rivet_testkit::loader::{LoaderNode, cluster_ip_service, entry, policy};
use rivet_testkit::service::{HeldConnection, NameServer, ask_name, ask_name_udp, ask_names, connect_and_reset};

mod lb_maps;
use lb_maps::LbMaps;

use pb::{Direction::*, Protocol, Verdict::*};

const BIN: &str = env!("CARGO_BIN_EXE_svc-loader");
const CLIENT: u32 = 1001; // identities
const BACKEND: u32 = 1002;
/// Where the backends' name servers listen.
const TARGET_PORT: u16 = 8080;
/// The services' port.
const SERVICE_PORT: u16 = 80;
const TIMEOUT: Duration = Duration::from_secs(2);

/// A service address of each family (svc-endpoint's default service CIDRs).
fn vips(n: u8) -> [IpAddr; 2] {
    [
        IpAddr::V4(Ipv4Addr::new(198, 19, 128, n)),
        IpAddr::V6(Ipv6Addr::new(0x2001, 2, 0, 0xff, 0, 0, 0, u16::from(n))),
    ]
}

/// The pod's address of `vip`'s family.
fn addr_of(node: &LoaderNode, pod: &str, vip: IpAddr) -> IpAddr {
    let pod = node.pod(pod);
    if vip.is_ipv4() { pod.ipv4() } else { pod.ipv6() }.expect("test pods have both families")
}

/// A test node with `pods`, each an endpoint without policy (identity
/// CLIENT for "client", BACKEND otherwise) serving its name on TCP and UDP
/// port TARGET_PORT at both its addresses.
struct ServiceNode {
    node: LoaderNode,
    lb: LbMaps,
    _servers: Vec<NameServer>,
}

impl ServiceNode {
    async fn start(pods: &[&str]) -> Self {
        let node = LoaderNode::start(BIN.as_ref(), pods, &[])
            .await
            .expect("a test node with svc-loader starts");
        let mut client = node.client().await;
        let mut servers = Vec::new();
        for (i, name) in pods.iter().enumerate() {
            let identity = if *name == "client" { CLIENT } else { BACKEND };
            client
                .apply_endpoint(node.endpoint(name, i as u32 + 1, identity, policy(1, false, false, vec![])))
                .await
                .unwrap_or_else(|e| panic!("endpoint {name} applied: {e}"));
            let pod = node.pod(name);
            let addrs: Vec<SocketAddr> = pod
                .addrs()
                .into_iter()
                .map(|ip| SocketAddr::new(ip, TARGET_PORT))
                .collect();
            servers.push(NameServer::start(&pod.ns, name, &addrs).expect("name server starts"));
        }
        let lb = LbMaps::open(&node.pins.0);
        Self {
            node,
            lb,
            _servers: servers,
        }
    }

    /// Service `id` at `vip`:SERVICE_PORT over `protocol` with `backends`
    /// (pod, state) on TARGET_PORT.
    async fn upsert(&mut self, id: u32, vip: IpAddr, protocol: Protocol, backends: &[(&str, pb::BackendState)]) {
        self.upsert_with(id, vip, protocol, backends, 0).await;
    }

    async fn upsert_with(
        &mut self,
        id: u32,
        vip: IpAddr,
        protocol: Protocol,
        backends: &[(&str, pb::BackendState)],
        affinity_timeout_seconds: u32,
    ) {
        let backends: Vec<(SocketAddr, pb::BackendState)> = backends
            .iter()
            .map(|(pod, state)| (SocketAddr::new(addr_of(&self.node, pod, vip), TARGET_PORT), *state))
            .collect();
        let mut service = cluster_ip_service(id, SocketAddr::new(vip, SERVICE_PORT), protocol, &backends);
        service.affinity_timeout_seconds = affinity_timeout_seconds;
        self.apply(service).await;
    }

    async fn apply(&self, service: pb::LbService) {
        self.node
            .lb_client()
            .await
            .upsert_service(pb::UpsertServiceRequest { service: Some(service) })
            .await
            .expect("the loader takes the service");
    }

    fn client_ns(&self) -> &rivet_common::testing::netns::NetNs {
        &self.node.pod("client").ns
    }
}

use pb::BackendState::{Active as ACTIVE, Terminating as TERMINATING};

fn tally(answers: &[std::io::Result<String>]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for answer in answers {
        let name = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("every connection is answered: {e}"));
        *counts.entry(name.clone()).or_default() += 1;
    }
    counts
}

#[tokio::test]
async fn cluster_ip_reaches_its_backends_over_tcp_and_udp_and_replies_come_from_the_vip() {
    let mut t = ServiceNode::start(&["client", "b1", "b2"]).await;
    for (i, vip) in vips(10).into_iter().enumerate() {
        let id = 10 + i as u32;
        t.upsert(id, vip, Protocol::Tcp, &[("b1", ACTIVE), ("b2", ACTIVE)])
            .await;
        t.upsert(id + 100, vip, Protocol::Udp, &[("b1", ACTIVE), ("b2", ACTIVE)])
            .await;
        let service = SocketAddr::new(vip, SERVICE_PORT);
        // ask_name checks the socket's peer is the VIP.
        let first = ask_name(t.client_ns(), service, TIMEOUT).unwrap_or_else(|e| panic!("TCP to {service}: {e}"));
        assert!(first == "b1" || first == "b2", "{first}");
        let counts = tally(&ask_names(t.client_ns(), service, 40, TIMEOUT));
        assert_eq!(
            counts.keys().cloned().collect::<BTreeSet<_>>(),
            BTreeSet::from(["b1".to_string(), "b2".to_string()]),
            "40 connections to {service} reach both backends: {counts:?}"
        );
        // UDP: the client's socket is connected to the VIP, so only an
        // answer from the VIP reaches it.
        let name = ask_name_udp(t.client_ns(), service, TIMEOUT).unwrap_or_else(|e| panic!("UDP to {service}: {e}"));
        assert!(name == "b1" || name == "b2", "{name}");
        // The backend's own address still works directly.
        let direct = SocketAddr::new(addr_of(&t.node, "b1", vip), TARGET_PORT);
        assert_eq!(ask_name(t.client_ns(), direct, TIMEOUT).unwrap(), "b1");
    }
}

#[tokio::test]
async fn a_pod_reaches_itself_through_its_service() {
    let mut t = ServiceNode::start(&["client", "b1"]).await;
    for (i, vip) in vips(20).into_iter().enumerate() {
        let id = 20 + i as u32;
        t.upsert(id, vip, Protocol::Tcp, &[("client", ACTIVE)]).await;
        t.upsert(id + 100, vip, Protocol::Udp, &[("client", ACTIVE)]).await;
        let service = SocketAddr::new(vip, SERVICE_PORT);
        for _ in 0..3 {
            assert_eq!(
                ask_name(t.client_ns(), service, TIMEOUT).unwrap_or_else(|e| panic!("hairpin TCP to {service}: {e}")),
                "client"
            );
        }
        assert_eq!(
            ask_name_udp(t.client_ns(), service, TIMEOUT).unwrap_or_else(|e| panic!("hairpin UDP to {service}: {e}")),
            "client"
        );
        let mut held = HeldConnection::open(t.client_ns(), service, TIMEOUT).expect("a held hairpin connection");
        for _ in 0..5 {
            assert_eq!(held.ask().expect("the hairpin connection keeps answering"), "client");
        }
    }
}

/// One client port reaching two ClusterIPs that share their backend: after
/// DNAT both connections would be one tuple (client:port → backend), and
/// the second SYN would meet the first connection. The second one leaves
/// with another client port (lb_port_remap, as the kernel's NAT): both are
/// established at once, each answered, from its own VIP, the first
/// undisturbed by the second.
#[tokio::test]
async fn one_client_port_reaches_two_services_sharing_a_backend() {
    let mut t = ServiceNode::start(&["client", "b1"]).await;
    for (i, (vip1, vip2)) in vips(30).into_iter().zip(vips(31)).enumerate() {
        let id = 30 + i as u32;
        t.upsert(id, vip1, Protocol::Tcp, &[("b1", ACTIVE)]).await;
        t.upsert(id + 100, vip2, Protocol::Tcp, &[("b1", ACTIVE)]).await;
        let local = SocketAddr::new(addr_of(&t.node, "client", vip1), 40000 + i as u16);
        let mut held = Vec::new();
        for vip in [vip1, vip2] {
            let service = SocketAddr::new(vip, SERVICE_PORT);
            let conn = HeldConnection::open_from(t.client_ns(), local, service, TIMEOUT)
                .unwrap_or_else(|e| panic!("a connection from {local} to {service}: {e}"));
            assert_eq!(conn.first, "b1");
            assert_eq!(conn.peer_addr().unwrap(), service, "the socket's peer is the VIP");
            held.push((service, conn));
        }
        for round in 0..3 {
            for (service, conn) in &mut held {
                let answer = conn
                    .ask()
                    .unwrap_or_else(|e| panic!("{local} → {service}, round {round}: {e}"));
                assert_eq!(answer, "b1", "{local} → {service}");
            }
        }
    }
}

/// The release services bench's pattern (issue 17's lost flow): one client
/// pod connects from the same `PORTS` client ports to one service after
/// another, all sharing two backends, each connection closed with a reset.
/// A port coming back to another service lands, after translation, on the
/// tuple an earlier, closed flow to the same backend held: that flow's
/// entries must not keep the tuple (nor the remapped ports) from new flows.
/// Every connect is answered, nothing is dropped.
#[tokio::test]
async fn client_ports_reused_across_services_sharing_backends_lose_no_connection() {
    const SERVICES: u8 = 12;
    const PORTS: u16 = 1000;
    let mut t = ServiceNode::start(&["client", "b1", "b2"]).await;
    for family in 0..2 {
        let services: Vec<SocketAddr> = (0..SERVICES)
            .map(|s| SocketAddr::new(vips(100 + s)[family], SERVICE_PORT))
            .collect();
        for (s, service) in services.iter().enumerate() {
            let id = 100 + 100 * family as u32 + s as u32;
            t.upsert(id, service.ip(), Protocol::Tcp, &[("b1", ACTIVE), ("b2", ACTIVE)])
                .await;
        }
        let client = addr_of(&t.node, "client", services[0].ip());
        let drops_before = t.node.drop_counters().await;
        for service in &services {
            let connections = (0..PORTS)
                .map(|k| (SocketAddr::new(client, 20000 + k), *service))
                .collect();
            if let Err((k, e)) = connect_and_reset(t.client_ns(), connections, Duration::from_secs(3)) {
                panic!(
                    "connection {k} to {service} unanswered: {e}; drops before {drops_before:?}, now {:?}",
                    t.node.drop_counters().await
                );
            }
        }
        assert_eq!(
            t.node.drop_counters().await,
            drops_before,
            "no packet of the {} connections was dropped",
            services.len() * usize::from(PORTS)
        );
    }
}

#[tokio::test]
async fn the_backends_ingress_policy_judges_the_client_on_the_service_path() {
    let mut t = ServiceNode::start(&["client", "b1"]).await;
    let mut loader = t.node.client().await;
    let deny = policy(
        2,
        true,
        false,
        vec![
            entry(Ingress, CLIENT, Protocol::Tcp, u32::from(TARGET_PORT), 0, Deny),
            entry(Ingress, 0, Protocol::Any, 0, 0, Allow),
        ],
    );
    loader
        .apply_endpoint(t.node.endpoint("b1", 2, BACKEND, deny))
        .await
        .expect("b1 denies the client");
    for (i, vip) in vips(30).into_iter().enumerate() {
        t.upsert(30 + i as u32, vip, Protocol::Tcp, &[("b1", ACTIVE)]).await;
        let service = SocketAddr::new(vip, SERVICE_PORT);
        let denied_before = t.node.drops(pb::DropReason::PolicyDenied).await;
        let err = ask_name(t.client_ns(), service, Duration::from_millis(500))
            .expect_err("the backend's policy denies the client through the service");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
        assert!(
            t.node
                .drops_reaching(pb::DropReason::PolicyDenied, denied_before + 1, TIMEOUT)
                .await
                > denied_before,
            "the SYN to {service} is dropped as policy-denied"
        );
    }
    let allow = policy(3, true, false, vec![entry(Ingress, CLIENT, Protocol::Tcp, 0, 0, Allow)]);
    loader
        .apply_endpoint(t.node.endpoint("b1", 2, BACKEND, allow))
        .await
        .expect("b1 allows the client");
    for vip in vips(30) {
        let service = SocketAddr::new(vip, SERVICE_PORT);
        assert_eq!(ask_name(t.client_ns(), service, TIMEOUT).unwrap(), "b1");
    }
}

#[tokio::test]
async fn a_service_without_backends_rejects_at_once_with_its_drop_reason() {
    let mut t = ServiceNode::start(&["client", "b1"]).await;
    for (i, vip) in vips(40).into_iter().enumerate() {
        let id = 40 + i as u32;
        t.upsert(id, vip, Protocol::Tcp, &[]).await;
        t.upsert(id + 100, vip, Protocol::Udp, &[]).await;
        let service = SocketAddr::new(vip, SERVICE_PORT);
        let rejected_before = t.node.drops(pb::DropReason::NoServiceBackend).await;
        let started = Instant::now();
        let err = ask_name(t.client_ns(), service, Duration::from_secs(5)).expect_err("no backend: refused");
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::ConnectionRefused,
            "TCP to {service}: {err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "refused at once, not after a timeout: {:?}",
            started.elapsed()
        );
        let err = ask_name_udp(t.client_ns(), service, Duration::from_secs(5)).expect_err("no backend: unreachable");
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::ConnectionRefused,
            "UDP to {service}: {err}"
        );
        let rejected = t.node.drops(pb::DropReason::NoServiceBackend).await;
        assert!(rejected >= rejected_before + 2, "{rejected_before} -> {rejected}");
        // A backend appears: the service answers.
        t.upsert(id, vip, Protocol::Tcp, &[("b1", ACTIVE)]).await;
        assert_eq!(ask_name(t.client_ns(), service, TIMEOUT).unwrap(), "b1");
    }
}

#[tokio::test]
async fn icmp_errors_from_a_backend_reach_the_client_from_the_vip() {
    let t = ServiceNode::start(&["client", "b1"]).await;
    for (i, vip) in vips(50).into_iter().enumerate() {
        // Nothing listens on the target port of this service: b1's stack
        // answers ICMP port unreachable about the translated datagram.
        let closed = SocketAddr::new(addr_of(&t.node, "b1", vip), 9999);
        let mut service = cluster_ip_service(
            50 + i as u32,
            SocketAddr::new(vip, SERVICE_PORT),
            Protocol::Udp,
            &[(closed, ACTIVE)],
        );
        t.apply(service.clone()).await;
        let target = SocketAddr::new(vip, SERVICE_PORT);
        let err = ask_name_udp(t.client_ns(), target, Duration::from_secs(3))
            .expect_err("the backend's port unreachable reaches the client");
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::ConnectionRefused,
            "UDP to {target}: {err}"
        );
        // TCP: the backend's RST, reverse-NATed, refuses the connection.
        service.protocol = Protocol::Tcp as i32;
        service.service_id += 100;
        t.apply(service).await;
        let err = ask_name(t.client_ns(), target, Duration::from_secs(3)).expect_err("the backend's RST");
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::ConnectionRefused,
            "TCP to {target}: {err}"
        );
    }
}

#[tokio::test]
async fn a_terminating_backend_keeps_its_connections_and_gets_no_new_ones() {
    let mut t = ServiceNode::start(&["client", "b1", "b2"]).await;
    for (i, vip) in vips(60).into_iter().enumerate() {
        let id = 60 + i as u32;
        t.upsert(id, vip, Protocol::Tcp, &[("b1", ACTIVE), ("b2", ACTIVE)])
            .await;
        let service = SocketAddr::new(vip, SERVICE_PORT);
        let mut held = HeldConnection::open(t.client_ns(), service, TIMEOUT).expect("a held connection");
        let leaving = held.first.clone();
        let staying = if leaving == "b1" { "b2" } else { "b1" };
        let states = [(leaving.as_str(), TERMINATING), (staying, ACTIVE)];
        t.upsert(id, vip, Protocol::Tcp, &states).await;
        for _ in 0..5 {
            assert_eq!(held.ask().expect("the open connection survives"), leaving);
        }
        let counts = tally(&ask_names(t.client_ns(), service, 20, TIMEOUT));
        assert_eq!(
            counts.keys().cloned().collect::<Vec<_>>(),
            vec![staying.to_string()],
            "new connections avoid the terminating {leaving}"
        );
        assert_eq!(held.ask().expect("still open"), leaving);
    }
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of bpf_ktime_get_ns().
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we own.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(r, 0, "clock_gettime");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[tokio::test]
async fn session_affinity_keeps_a_client_on_one_backend_until_its_timeout() {
    const TIMEOUT_S: u32 = 60;
    let mut t = ServiceNode::start(&["client", "b1", "b2", "b3"]).await;
    let backends = [("b1", ACTIVE), ("b2", ACTIVE), ("b3", ACTIVE)];
    for (i, vip) in vips(70).into_iter().enumerate() {
        let id = 70 + i as u32;
        t.upsert_with(id, vip, Protocol::Tcp, &backends, TIMEOUT_S).await;
        let service = SocketAddr::new(vip, SERVICE_PORT);
        // Every new connection of the client goes to one backend (without
        // affinity, 30 connections spread over the three).
        let counts = tally(&ask_names(t.client_ns(), service, 30, TIMEOUT));
        assert_eq!(counts.len(), 1, "one backend for the client: {counts:?}");
        let chosen = counts.keys().next().unwrap().clone();
        let client = addr_of(&t.node, "client", vip);
        let key = LbAffinityKey::new(client, id);
        let entry = t.lb.affinity(&key).expect("the client's affinity entry");
        assert_eq!(backend_name(&t, entry.backend_id, vip), chosen);

        // A fresh entry wins over the Maglev table...
        let other = ["b1", "b2", "b3"].into_iter().find(|b| *b != chosen).unwrap();
        let other_id =
            t.lb.backend_id(SocketAddr::new(addr_of(&t.node, other, vip), TARGET_PORT));
        t.lb.set_affinity(
            &key,
            LbAffinity {
                last_used: monotonic_ns(),
                backend_id: other_id,
                pad: 0,
            },
        );
        let counts = tally(&ask_names(t.client_ns(), service, 10, TIMEOUT));
        assert_eq!(
            counts.keys().collect::<Vec<_>>(),
            vec![other],
            "the fresh affinity entry wins"
        );
        // ...and one older than the timeout does not: a new choice.
        t.lb.set_affinity(
            &key,
            LbAffinity {
                last_used: monotonic_ns() - (u64::from(TIMEOUT_S) + 1) * 1_000_000_000,
                backend_id: other_id,
                pad: 0,
            },
        );
        let counts = tally(&ask_names(t.client_ns(), service, 10, TIMEOUT));
        assert_eq!(
            counts.keys().collect::<Vec<_>>(),
            vec![&chosen],
            "a stale entry is replaced"
        );
        let entry = t.lb.affinity(&key).expect("the entry");
        assert_eq!(backend_name(&t, entry.backend_id, vip), chosen);
    }
}

#[tokio::test]
async fn connections_spread_over_backends_and_survive_the_removal_of_another() {
    let mut t = ServiceNode::start(&["client", "b1", "b2", "b3"]).await;
    let all = [("b1", ACTIVE), ("b2", ACTIVE), ("b3", ACTIVE)];
    for (i, vip) in vips(80).into_iter().enumerate() {
        let id = 80 + i as u32;
        t.upsert(id, vip, Protocol::Tcp, &all).await;
        let service = SocketAddr::new(vip, SERVICE_PORT);
        let counts = tally(&ask_names(t.client_ns(), service, 300, TIMEOUT));
        for b in ["b1", "b2", "b3"] {
            let n = counts.get(b).copied().unwrap_or(0);
            assert!((60..=140).contains(&n), "300 connections over 3 backends: {counts:?}");
        }
        let mut held: Vec<HeldConnection> = (0..24)
            .map(|_| HeldConnection::open(t.client_ns(), service, TIMEOUT).expect("a held connection"))
            .collect();
        assert!(held.iter().any(|h| h.first != "b3"), "some held connections on b1/b2");
        t.upsert(id, vip, Protocol::Tcp, &[("b1", ACTIVE), ("b2", ACTIVE)])
            .await;
        for h in held.iter_mut().filter(|h| h.first != "b3") {
            let first = h.first.clone();
            assert_eq!(h.ask().expect("a connection to a surviving backend survives"), first);
        }
        let counts = tally(&ask_names(t.client_ns(), service, 30, TIMEOUT));
        assert!(
            !counts.contains_key("b3"),
            "no new connection to the removed b3: {counts:?}"
        );
    }
}

/// The name of the pod backend `id` is (at `vip`'s family).
fn backend_name(t: &ServiceNode, id: u32, vip: IpAddr) -> String {
    let backend: LbBackend = t.lb.backend(id).expect("the backend exists");
    let addr = backend.socket_addr().expect("a backend address").ip();
    t.node
        .node
        .pods()
        .iter()
        .find(|p| addr_of(&t.node, &p.spec.name, vip) == addr)
        .unwrap_or_else(|| panic!("no pod at {addr}"))
        .spec
        .name
        .clone()
}
