//! Pods on different nodes reach each other, and nodes that leave or crash
//! are forgotten (issue 16 §6): a 3-node cluster of the testkit fixture
//! (the real `rivet cluster up`: one etcd, an underlay bridge, a `rivet
//! node up` per node namespace), once with native routing and once with
//! VXLAN, IPv4 and IPv6. One cluster per mode carries all the cases, in
//! order:
//!
//! 1. every pod reaches every pod on the other nodes (ping and a TCP echo,
//!    both families), and every node's datapath holds each peer's underlay
//!    addresses as `remote-node`;
//! 2. a node leaves (`rivet cluster stop-node`): the others drop it at once
//!    — no route to its pod CIDRs or via its address in their namespaces,
//!    no ipcache entry for its pods or its addresses, no FDB entry towards
//!    it — and the rest still talk;
//! 3. it rejoins (`start-node`) with a new pod: the full mesh again;
//! 4. a node crashes (SIGKILL to its supervisor and every daemon): the
//!    others drop it when its lease expires (a short TTL), the same checks;
//! 5. it rejoins: the full mesh again.
//!
//! Needs root, a bpffs at /sys/fs/bpf, the rivet users and etcd 3.6
//! (`cargo xtask install`) and the workspace binaries (`cargo build
//! --bins`). Addresses come from 198.18.0.0/15 and 2001:2::/48 only.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rivet_common::testing::netns::TcpServerGuard;
use rivet_testkit::cluster::{Cluster, ClusterNode, ClusterOptions, ClusterPod, NodeState, Routing};

/// svc-identity's lease TTL on every node: a crashed node's keys go this
/// long after its last renewal.
const LEASE_TTL_SECONDS: u64 = 5;

/// How long the survivors may take to forget a crashed node: the lease
/// TTL, then the watch and the pushes to the loaders.
const CRASH_FORGOTTEN_WITHIN: Duration = Duration::from_secs(LEASE_TTL_SECONDS * 3 + 30);

/// The reserved identity of other nodes' addresses.
const REMOTE_NODE: u32 = 6;

/// The port of every pod's TCP echo server.
const ECHO_PORT: u16 = 80;

/// A pod with its echo server running.
struct ServingPod {
    pod: ClusterPod,
    _server: TcpServerGuard,
}

async fn serving_pod(cluster: &mut Cluster, node: usize, name: &str) -> ServingPod {
    let label = format!("app={name}");
    let pod = cluster.add_pod(node, "default", name, &[&label]).await;
    let server = pod
        .netns
        .tcp_echo_server(&[pod.socket_v4(ECHO_PORT), pod.socket_v6(ECHO_PORT)])
        .expect("an echo server in the pod");
    ServingPod { pod, _server: server }
}

/// Every pod reaches every pod of another node: ping and a TCP echo, IPv4
/// and IPv6.
fn assert_full_mesh(pods: &[&ServingPod]) {
    let mut failed = Vec::new();
    for from in pods {
        for to in pods.iter().filter(|p| p.pod.node != from.pod.node) {
            for addr in to.pod.addrs() {
                let what = format!(
                    "{} (node {}) -> {} (node {}) {addr}",
                    from.pod.name, from.pod.node, to.pod.name, to.pod.node
                );
                let ping = from
                    .pod
                    .netns
                    .ping(addr, 2, Duration::from_millis(50), Duration::from_secs(2))
                    .expect("ping runs");
                if ping.received != ping.transmitted {
                    failed.push(format!("{what}: ping {}/{}", ping.received, ping.transmitted));
                }
                let echo = from
                    .pod
                    .netns
                    .tcp_echo(SocketAddr::new(addr, ECHO_PORT), Duration::from_secs(3))
                    .expect("the TCP probe runs");
                if !echo {
                    failed.push(format!("{what}: no TCP echo"));
                }
            }
        }
    }
    assert!(
        failed.is_empty(),
        "unreachable across nodes:\n  {}",
        failed.join("\n  ")
    );
}

/// Every running node's datapath holds every other running node's underlay
/// addresses as `remote-node`.
async fn assert_peers_are_remote_nodes(cluster: &Cluster) {
    for node in running(cluster) {
        let ipcache = node.datapath_ipcache().await.expect("ListIpcache");
        for peer in running(cluster).filter(|p| p.index != node.index) {
            for addr in [IpAddr::V4(peer.underlay_v4), IpAddr::V6(peer.underlay_v6)] {
                let identity = entry_of(&ipcache, addr).map(|e| e.identity);
                assert_eq!(
                    identity,
                    Some(REMOTE_NODE),
                    "{}: the ipcache holds {}'s address {addr} as remote-node",
                    node.name,
                    peer.name
                );
            }
        }
    }
}

fn running(cluster: &Cluster) -> impl Iterator<Item = &ClusterNode> {
    cluster.nodes().iter().filter(|n| n.state == NodeState::Running)
}

/// The host entry (/32, /128) of `addr` in a loader's ipcache listing.
fn entry_of(
    ipcache: &[rivet_proto::loader::v1::IpcacheEntry],
    addr: IpAddr,
) -> Option<&rivet_proto::loader::v1::IpcacheEntry> {
    let full = if addr.is_ipv4() { 32 } else { 128 };
    ipcache.iter().find(|e| {
        e.prefix
            .as_ref()
            .and_then(|p| rivet_proto::net::prefix_from_proto(p).ok())
            .is_some_and(|net| net.addr() == addr && net.prefix_len() == full)
    })
}

/// Nothing of node `gone` is left on the running nodes: no route to its
/// pod CIDRs or via its addresses, no ipcache entry for its pods
/// (`gone_pods`) or its addresses, no FDB entry towards it.
async fn assert_forgotten(cluster: &Cluster, gone: usize, gone_pods: &[IpAddr]) {
    let gone = cluster.node(gone);
    let gone_addrs = [IpAddr::V4(gone.underlay_v4), IpAddr::V6(gone.underlay_v6)];
    for node in running(cluster) {
        for family in ["-4", "-6"] {
            let routes = node.ip(&[family, "route", "show", "table", "all"]);
            for cidr in &gone.pod_cidrs {
                assert!(
                    !routes.contains(cidr.as_str()),
                    "{}: a route to {cidr} of {} is left:\n{routes}",
                    node.name,
                    gone.name
                );
            }
            for addr in gone_addrs {
                let via = format!("via {addr} ");
                assert!(
                    !routes.contains(&via),
                    "{}: a route via {addr} ({}) is left:\n{routes}",
                    node.name,
                    gone.name
                );
            }
        }
        let ipcache = node.datapath_ipcache().await.expect("ListIpcache");
        for addr in gone_pods.iter().chain(&gone_addrs) {
            assert!(
                entry_of(&ipcache, *addr).is_none(),
                "{}: the ipcache still holds {addr} of {}: {:?}",
                node.name,
                gone.name,
                entry_of(&ipcache, *addr)
            );
        }
        let tunnel_endpoint = gone.underlay_v4.octets();
        let towards: Vec<_> = ipcache
            .iter()
            .filter(|e| e.tunnel_endpoint == tunnel_endpoint)
            .collect();
        assert!(
            towards.is_empty(),
            "{}: entries still tunnel to {}: {towards:?}",
            node.name,
            gone.name
        );
        let fdb = node.ip(&["neigh", "show", "nud", "permanent"]) + &bridge_fdb(node);
        for addr in gone_addrs {
            assert!(
                !fdb.contains(&format!("dst {addr} ")),
                "{}: an FDB entry towards {} is left:\n{fdb}",
                node.name,
                gone.name
            );
        }
    }
}

/// `bridge fdb show` in the node namespace (the VXLAN device's entries).
fn bridge_fdb(node: &ClusterNode) -> String {
    node.netns.run(&["bridge", "fdb", "show"]).expect("bridge fdb show")
}

async fn node_leaves_and_crashes(routing: Routing) {
    let mut cluster = Cluster::start(ClusterOptions {
        routing,
        lease_ttl_seconds: Some(LEASE_TTL_SECONDS),
        ..Default::default()
    })
    .await
    .expect("rivet cluster up");
    let p1 = serving_pod(&mut cluster, 1, "p1").await;
    let p2 = serving_pod(&mut cluster, 2, "p2").await;
    let p3 = serving_pod(&mut cluster, 3, "p3").await;
    cluster.wait_converged().await;
    assert_full_mesh(&[&p1, &p2, &p3]);
    assert_peers_are_remote_nodes(&cluster).await;

    // A clean leave: forgotten at once (no lease expiry involved).
    let p3_addrs = p3.pod.addrs();
    drop(p3);
    cluster.stop_node(3).await;
    cluster
        .wait_converged_within(Duration::from_secs(LEASE_TTL_SECONDS))
        .await;
    assert_forgotten(&cluster, 3, &p3_addrs).await;
    assert_full_mesh(&[&p1, &p2]);

    // It rejoins.
    cluster.start_node(3).await;
    let p3 = serving_pod(&mut cluster, 3, "p3b").await;
    cluster.wait_converged().await;
    assert_full_mesh(&[&p1, &p2, &p3]);
    assert_peers_are_remote_nodes(&cluster).await;

    // A crash: forgotten once its lease expired.
    let p2_addrs = p2.pod.addrs();
    cluster.crash_node(2).await;
    let took = cluster.wait_converged_within(CRASH_FORGOTTEN_WITHIN).await;
    assert_forgotten(&cluster, 2, &p2_addrs).await;
    assert_full_mesh(&[&p1, &p3]);
    eprintln!("{routing:?}: a crashed node was forgotten {took:?} after the crash (lease TTL {LEASE_TTL_SECONDS} s)");

    // It rejoins (start-node cleans up what the crash left first).
    drop(p2);
    cluster.start_node(2).await;
    let p2 = serving_pod(&mut cluster, 2, "p2b").await;
    cluster.wait_converged().await;
    assert_full_mesh(&[&p1, &p2, &p3]);
    assert_peers_are_remote_nodes(&cluster).await;
    drop((p1, p2, p3));
    cluster.down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_routing_pods_reach_across_nodes_and_peers_forget_nodes_that_leave_or_crash() {
    node_leaves_and_crashes(Routing::Native).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vxlan_pods_reach_across_nodes_and_peers_forget_nodes_that_leave_or_crash() {
    node_leaves_and_crashes(Routing::Vxlan).await;
}
