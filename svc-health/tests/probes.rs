//! The probes and the prober against a real peer: two network namespaces
//! joined by a veth, the peer serving `/hello` in its namespace, the prober's
//! sockets made in the other (root; namespaces removed on drop). The peers
//! are listed by a fixed source here; `daemon.rs` runs the daemon against a
//! real svc-identity.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use rivet_common::testing::netns::{NetNs, veth_pair};
use svc_health::events::HealthMetrics;
use svc_health::net::{self, EchoSequence, NamespaceSockets, NetProbes};
use svc_health::peers::{NodeListing, PeerListError, PeerSource};
use svc_health::probe::{FailureKind, Peer, ProbeKind};
use svc_health::prober::{LocalNode, Prober, ProberOptions};
use svc_health::table::TargetStatus;

const A4: &str = "198.18.0.1";
const B4: &str = "198.18.0.2";
const A6: &str = "2001:2::1";
const B6: &str = "2001:2::2";

struct Fixed(NodeListing);

impl PeerSource for Fixed {
    fn list(&self) -> Pin<Box<dyn Future<Output = Result<NodeListing, PeerListError>> + Send + '_>> {
        let listing = self.0.clone();
        Box::pin(async move { Ok(listing) })
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Node A (the prober's namespace) and node B (the peer), on one link.
struct Pair {
    a: NetNs,
    b: NetNs,
}

impl Pair {
    fn new() -> Self {
        let a = NetNs::new("hpa").unwrap();
        let b = NetNs::new("hpb").unwrap();
        veth_pair(&a, "ul0", &b, "ul0").unwrap();
        for (ns, v4, v6) in [(&a, A4, A6), (&b, B4, B6)] {
            // Else the kernel flushes the IPv6 addresses when the link goes down.
            ns.sysctl("net.ipv6.conf.ul0.keep_addr_on_down", "1").unwrap();
            ns.ip(&["addr", "add", &format!("{v4}/24"), "dev", "ul0"]).unwrap();
            ns.ip(&["-6", "addr", "add", &format!("{v6}/64"), "dev", "ul0", "nodad"])
                .unwrap();
        }
        // The prober runs as root here: its group may open ICMP echo sockets (in A only).
        a.sysctl("net.ipv4.ping_group_range", "0 0").unwrap();
        Self { a, b }
    }

    /// B's `/hello` on both its addresses, served until the task is aborted.
    fn serve_hello_in_b(&self) -> Vec<tokio::task::JoinHandle<Result<(), net::HelloError>>> {
        [B4, B6]
            .iter()
            .map(|addr| {
                let address = SocketAddr::new(ip(addr), net::HEALTH_PORT);
                let listener = self
                    .b
                    .in_ns(move || net::hello_listener(&net::OwnNamespace, address))
                    .unwrap()
                    .unwrap();
                tokio::spawn(net::serve_hello(tokio::net::TcpListener::from_std(listener).unwrap()))
            })
            .collect()
    }

    fn prober(&self, timeout: Duration) -> Prober {
        let listing = NodeListing {
            local_name: "a".into(),
            local_health_addresses: vec![],
            peers: vec![Peer {
                name: "b".into(),
                addresses: vec![ip(B4), ip(B6)],
                health_addresses: vec![],
            }],
        };
        let probes = NetProbes {
            node: Arc::new(NamespaceSockets::enter(&self.a.path()).unwrap()),
            health_endpoint: None,
            port: net::HEALTH_PORT,
            sequence: Arc::new(EchoSequence::default()),
        };
        Prober::new(
            ProberOptions {
                interval: timeout * 2,
                timeout,
            },
            LocalNode {
                name: "a".into(),
                node_addresses: vec![ip(A4), ip(A6)],
            },
            Arc::new(Fixed(listing)),
            Arc::new(probes),
            HealthMetrics::default(),
        )
    }
}

fn failures(prober: &Prober) -> Vec<String> {
    let snapshot = prober.snapshot();
    snapshot.table.peers["b"]
        .targets
        .values()
        .filter_map(|s| s.last_failure.as_ref().map(|(_, f)| format!("{:?}: {f}", f.kind)))
        .collect()
}

fn statuses(prober: &Prober) -> Vec<(ProbeKind, IpAddr, TargetStatus, Option<FailureKind>)> {
    let snapshot = prober.snapshot();
    snapshot.table.peers["b"]
        .targets
        .iter()
        .map(|(t, s)| {
            (
                t.kind,
                t.address,
                s.status.clone(),
                s.last_failure.as_ref().map(|(_, f)| f.kind),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_is_reachable_then_partitioned_then_back() {
    let pair = Pair::new();
    let servers = pair.serve_hello_in_b();
    let prober = pair.prober(Duration::from_millis(500));

    prober.round().await;
    let snapshot = prober.snapshot();
    let row = &snapshot.table.peers["b"];
    assert_eq!(row.reachable, Some(true), "{:#?}", row);
    assert_eq!(row.targets.len(), 4, "ICMP and HTTP on both addresses: {row:#?}");
    for (target, state) in &row.targets {
        let latency = state.latency.expect("a latency");
        assert!(
            latency > Duration::ZERO && latency < Duration::from_millis(500),
            "{target:?}: {latency:?}"
        );
    }

    // The underlay link goes down on B's side.
    pair.b.ip(&["link", "set", "ul0", "down"]).unwrap();
    prober.round().await;
    let snapshot = prober.snapshot();
    let row = &snapshot.table.peers["b"];
    assert_eq!(row.reachable, Some(false));
    for (kind, address, status, failure) in statuses(&prober) {
        assert_eq!(status, TargetStatus::Unreachable, "{kind} {address}");
        assert!(
            matches!(failure, Some(FailureKind::Timeout | FailureKind::NoRoute)),
            "{kind} {address}: {:?}",
            failures(&prober)
        );
    }
    assert_eq!(snapshot.table.summary(), (1, 0));

    pair.b.ip(&["link", "set", "ul0", "up"]).unwrap();
    // The neighbour entries are resolved again: a round or two at most.
    let mut rounds = 0;
    loop {
        prober.round().await;
        rounds += 1;
        if prober.snapshot().table.peers["b"].reachable == Some(true) {
            break;
        }
        assert!(
            rounds < 5,
            "b not reachable again: {:?} {:#?}",
            failures(&prober),
            statuses(&prober)
        );
    }
    let snapshot = prober.snapshot();
    assert!(
        snapshot.table.peers["b"]
            .targets
            .values()
            .all(|s| s.consecutive_failures == 0 && s.last_failure.is_some())
    );
    for server in servers {
        server.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_hello_server_is_refused_while_icmp_answers() {
    let pair = Pair::new();
    let prober = pair.prober(Duration::from_millis(500));
    prober.round().await;
    for (kind, address, status, failure) in statuses(&prober) {
        match kind {
            ProbeKind::IcmpNode => assert_eq!(status, TargetStatus::Reachable, "{address}"),
            _ => {
                assert_eq!(status, TargetStatus::Unreachable, "{kind} {address}");
                assert_eq!(failure, Some(FailureKind::Refused), "{kind} {address}");
            }
        }
    }
    let snapshot = prober.snapshot();
    assert_eq!(snapshot.table.peers["b"].reachable, Some(false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn icmp_needs_the_namespace_to_allow_echo_sockets() {
    let pair = Pair::new();
    pair.a.sysctl("net.ipv4.ping_group_range", "1 0").unwrap();
    let sockets = NamespaceSockets::enter(&pair.a.path()).unwrap();
    let failure = net::icmp_echo(&sockets, ip(B4), 1, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert_eq!(failure.kind, FailureKind::Socket, "{failure}");
    assert!(failure.message.contains("ping_group_range"), "{failure}");
    pair.a.sysctl("net.ipv4.ping_group_range", "0 0").unwrap();
    let latency = net::icmp_echo(&sockets, ip(B6), 2, Duration::from_millis(300))
        .await
        .unwrap();
    assert!(latency < Duration::from_millis(300));
}
