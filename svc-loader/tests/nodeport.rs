//! NodePort from outside the cluster: two nodes on an underlay, each with
//! its own svc-loader (native or vxlan) serving `from_netdev`/`to_netdev`
//! on `ul0`, a backend pod on each, and a client host on the underlay
//! bridge. externalTrafficPolicy Cluster reaches both nodes' backends
//! (the other node's SNATed to the node's address), Local only the node's
//! own with the client's address kept, and a node without a local backend
//! rejects with a RST and drop reason 19. IPv4 and IPv6; TCP, and UDP for
//! Cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rivet_common::testing::netns::NetNs;
use rivet_proto::loader::v1 as pb;
use rivet_proto::net::{IpPrefix, address_bytes};
use rivet_testkit::loader::{ExternalClient, LoaderNode, UNDERLAY_IFNAME, Underlay, policy};
use rivet_testkit::service::{HeldConnection, NameServer, ask_name, ask_name_udp, name_and_peer, peers_by_server};

const BIN: &str = env!("CARGO_BIN_EXE_svc-loader");
const REMOTE_NODE: u32 = 6;
const BACKEND_PORT: u16 = 8080;
const CLUSTER_NODE_PORT: u16 = 30080;
const LOCAL_NODE_PORT: u16 = 30081;
/// New connections per check: 2 backends all on one side by chance is 2^-29.
const CONNECTIONS: usize = 30;
const TIMEOUT: Duration = Duration::from_secs(3);

/// Who answered `CONNECTIONS` new connections from `ns` to `dst`, with
/// the client address each saw.
fn answers(ns: &NetNs, dst: SocketAddr) -> BTreeMap<String, Vec<IpAddr>> {
    peers_by_server(ns, dst, CONNECTIONS, TIMEOUT)
}

fn ipcache_entry(address: IpAddr, identity: u32, tunnel: Option<std::net::Ipv4Addr>) -> pb::IpcacheEntry {
    pb::IpcacheEntry {
        prefix: Some(IpPrefix {
            address: address_bytes(address),
            prefix_length: if address.is_ipv4() { 32 } else { 128 },
        }),
        identity,
        tunnel_endpoint: tunnel.map(|a| address_bytes(IpAddr::V4(a))).unwrap_or_default(),
    }
}

fn cidr(net: &str) -> IpPrefix {
    let net: ipnet::IpNet = net.parse().unwrap();
    IpPrefix {
        address: address_bytes(net.network()),
        prefix_length: u32::from(net.prefix_len()),
    }
}

/// Node `index` with its pods ([`pods_of`]; identities 1000 + 10 * index +
/// n, no policy).
async fn node(underlay: &Underlay, index: u8, mode: &str) -> LoaderNode {
    let pods = pods_of(index);
    let args = ["--routing-mode", mode, "--underlay-interface", UNDERLAY_IFNAME];
    let node = LoaderNode::start_on_underlay(BIN.as_ref(), underlay, index, &pods, &args)
        .await
        .expect("a test node on the underlay with svc-loader starts");
    for (n, pod) in pods.iter().enumerate() {
        let id = u32::from(index) * 10 + n as u32;
        let request = node.endpoint(pod, id, 1000 + id, policy(1, false, false, Vec::new()));
        node.client()
            .await
            .apply_endpoint(request)
            .await
            .expect("the endpoint applies");
    }
    node
}

/// The pods of node `index`: backend `b<index>`, and on node 1 the client
/// pod `c1`.
fn pods_of(index: u8) -> Vec<&'static str> {
    match index {
        1 => vec!["b1", "c1"],
        _ => vec!["b2"],
    }
}

/// What svc-identity would publish on `local` about node `peer_index`: its
/// underlay addresses as remote-node, its pods with its tunnel endpoint; and
/// the peer's routes.
async fn learn_peer(local: &LoaderNode, peer: &LoaderNode, peer_index: u8) {
    let tunnel = Some(Underlay::ipv4(peer_index));
    let mut entries = vec![
        ipcache_entry(IpAddr::V4(Underlay::ipv4(peer_index)), REMOTE_NODE, None),
        ipcache_entry(IpAddr::V6(Underlay::ipv6(peer_index)), REMOTE_NODE, None),
    ];
    for (n, pod) in pods_of(peer_index).iter().enumerate() {
        for a in peer.pod(pod).addrs() {
            entries.push(ipcache_entry(a, 1000 + u32::from(peer_index) * 10 + n as u32, tunnel));
        }
    }
    local
        .client()
        .await
        .upsert_ipcache(pb::UpsertIpcacheRequest { entries })
        .await
        .expect("UpsertIpcache succeeds");
    let node = pb::PeerNode {
        name: format!("node-{peer_index}"),
        underlay_ipv4: address_bytes(IpAddr::V4(Underlay::ipv4(peer_index))),
        underlay_ipv6: address_bytes(IpAddr::V6(Underlay::ipv6(peer_index))),
        pod_cidrs: vec![
            cidr(&format!("198.18.{peer_index}.0/24")),
            cidr(&format!("2001:2:0:{peer_index}::/64")),
        ],
    };
    local
        .routing_client()
        .await
        .replace_nodes(pb::ReplaceNodesRequest { nodes: vec![node] })
        .await
        .expect("ReplaceNodes succeeds");
}

/// A service of one family and `protocol`: a ClusterIP on port 80 and
/// NodePort `node_port`, backends (address, local to this node) on
/// BACKEND_PORT.
fn service(
    id: u32,
    protocol: pb::Protocol,
    cluster_ip: IpAddr,
    node_port: u16,
    backends: &[(IpAddr, bool)],
    policy: pb::TrafficPolicy,
) -> pb::LbService {
    pb::LbService {
        service_id: id,
        family: if cluster_ip.is_ipv4() {
            pb::Family::Ipv4
        } else {
            pb::Family::Ipv6
        } as i32,
        protocol: protocol as i32,
        frontends: vec![
            pb::LbFrontend {
                kind: pb::FrontendKind::ClusterIp as i32,
                address: address_bytes(cluster_ip),
                port: 80,
            },
            pb::LbFrontend {
                kind: pb::FrontendKind::NodePort as i32,
                address: Vec::new(),
                port: u32::from(node_port),
            },
        ],
        backends: backends
            .iter()
            .map(|(addr, node_local)| pb::LbBackend {
                address: address_bytes(*addr),
                port: u32::from(BACKEND_PORT),
                state: pb::BackendState::Active as i32,
                node_local: *node_local,
            })
            .collect(),
        affinity_timeout_seconds: 0,
        external_traffic_policy: policy as i32,
    }
}

/// The services every node holds (UpsertService), `b1`/`b2` local as they
/// are on node `index`: per family a Cluster service on TCP and one on UDP
/// (NodePort 30080) over both backends, and Local ones (TCP and UDP 30081)
/// over b1 only (node 2's external frontends of them have no backend).
async fn upsert_services(node: &LoaderNode, index: u8, b1: &[IpAddr], b2: &[IpAddr]) {
    let cluster_ips: [IpAddr; 4] = [
        "198.19.128.10".parse().unwrap(),
        "2001:2:0:ff::10".parse().unwrap(),
        "198.19.128.11".parse().unwrap(),
        "2001:2:0:ff::11".parse().unwrap(),
    ];
    let mut client = node.lb_client().await;
    for family in 0..2 {
        let both = [(b1[family], index == 1), (b2[family], index == 2)];
        let services = [
            service(
                1 + family as u32,
                pb::Protocol::Tcp,
                cluster_ips[family],
                CLUSTER_NODE_PORT,
                &both,
                pb::TrafficPolicy::Cluster,
            ),
            service(
                5 + family as u32,
                pb::Protocol::Udp,
                cluster_ips[family],
                CLUSTER_NODE_PORT,
                &both,
                pb::TrafficPolicy::Cluster,
            ),
            service(
                3 + family as u32,
                pb::Protocol::Tcp,
                cluster_ips[2 + family],
                LOCAL_NODE_PORT,
                &both[..1],
                pb::TrafficPolicy::Local,
            ),
            service(
                7 + family as u32,
                pb::Protocol::Udp,
                cluster_ips[2 + family],
                LOCAL_NODE_PORT,
                &both[..1],
                pb::TrafficPolicy::Local,
            ),
        ];
        for service in services {
            client
                .upsert_service(pb::UpsertServiceRequest { service: Some(service) })
                .await
                .expect("UpsertService succeeds");
        }
    }
}

/// The address of node `index` on the underlay in `family` (0: IPv4, 1: IPv6).
fn node_addr(index: u8, family: usize) -> IpAddr {
    if family == 0 {
        IpAddr::V4(Underlay::ipv4(index))
    } else {
        IpAddr::V6(Underlay::ipv6(index))
    }
}

/// Two nodes in `mode` with their backends serving, the services on both,
/// and the client on the underlay. Fields drop in order: the client and
/// servers first, then the nodes, the underlay last.
struct Setup {
    client: ExternalClient,
    _servers: [NameServer; 2],
    n2: LoaderNode,
    n1: LoaderNode,
    _underlay: Underlay,
}

impl Setup {
    async fn start(mode: &str) -> Self {
        let underlay = Underlay::new().unwrap();
        let n1 = node(&underlay, 1, mode).await;
        let n2 = node(&underlay, 2, mode).await;
        learn_peer(&n1, &n2, 2).await;
        learn_peer(&n2, &n1, 1).await;
        let b1 = n1.pod("b1").addrs();
        let b2 = n2.pod("b2").addrs();
        let sockets =
            |addrs: &[IpAddr]| -> Vec<SocketAddr> { addrs.iter().map(|a| SocketAddr::new(*a, BACKEND_PORT)).collect() };
        let servers = [
            NameServer::start_reporting_peer(&n1.pod("b1").ns, "b1", &sockets(&b1)).unwrap(),
            NameServer::start_reporting_peer(&n2.pod("b2").ns, "b2", &sockets(&b2)).unwrap(),
        ];
        upsert_services(&n1, 1, &b1, &b2).await;
        upsert_services(&n2, 2, &b1, &b2).await;
        let client = underlay.add_external_client().unwrap();
        Self {
            client,
            _servers: servers,
            n2,
            n1,
            _underlay: underlay,
        }
    }
}

/// The NodePort programs in `node`'s GetDatapathStatus: (name, program
/// id, external interfaces running it).
async fn netdev_programs(node: &LoaderNode) -> Vec<(String, u32, u32)> {
    node.client()
        .await
        .get_datapath_status(pb::GetDatapathStatusRequest {})
        .await
        .expect("GetDatapathStatus answers")
        .into_inner()
        .programs
        .into_iter()
        .filter(|p| p.name.ends_with("_netdev"))
        .map(|p| (p.name, p.program_id, p.attachments))
        .collect()
}

/// `ask` is refused (ECONNREFUSED: a RST or port unreachable) and `node`
/// counts it as no-service-backend.
async fn assert_rejected(node: &LoaderNode, what: &str, ask: impl FnOnce() -> std::io::Result<String>) {
    let before = node.drops(pb::DropReason::NoServiceBackend).await;
    match ask() {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
        other => panic!("{what} is refused: {other:?}"),
    }
    assert!(
        node.drops_reaching(pb::DropReason::NoServiceBackend, before + 1, Duration::from_secs(5))
            .await
            > before,
        "{what}: counted as no-service-backend"
    );
}

async fn nodeport_from_outside(mode: &str) {
    let Setup { n1, n2, client, .. } = &Setup::start(mode).await;
    let attached: Vec<(String, u32)> = netdev_programs(n1).await.into_iter().map(|(n, _, a)| (n, a)).collect();
    assert_eq!(
        attached,
        [("from_netdev".to_owned(), 1), ("to_netdev".to_owned(), 1)],
        "ul0 serves NodePort"
    );

    for family in 0..2 {
        let client_addr = client.addrs()[family];
        // Cluster, through either node: both backends answer; the node's own
        // sees the client, the other node's sees the node (SNAT).
        for (via, local, remote) in [(1, "b1", "b2"), (2, "b2", "b1")] {
            let dst = SocketAddr::new(node_addr(via, family), CLUSTER_NODE_PORT);
            let by_backend = answers(&client.ns, dst);
            assert_eq!(
                by_backend.keys().map(String::as_str).collect::<Vec<_>>(),
                ["b1", "b2"],
                "Cluster via node {via} ({mode}, {dst}) reaches both backends: {by_backend:?}"
            );
            assert!(
                by_backend[local].iter().all(|p| *p == client_addr),
                "{local} on node {via} sees the client {client_addr} ({mode}): {by_backend:?}"
            );
            assert!(
                by_backend[remote].iter().all(|p| *p == node_addr(via, family)),
                "{remote} on the other node sees node {via}'s address (SNAT, {mode}): {by_backend:?}"
            );
        }

        // UDP, Cluster via node 1: both backends answer (each datagram from
        // a new socket, so a new flow).
        let dst = SocketAddr::new(node_addr(1, family), CLUSTER_NODE_PORT);
        let names: BTreeSet<String> = (0..CONNECTIONS)
            .map(|_| ask_name_udp(&client.ns, dst, TIMEOUT).unwrap_or_else(|e| panic!("UDP to NodePort {dst}: {e}")))
            .collect();
        assert_eq!(
            names.iter().map(String::as_str).collect::<Vec<_>>(),
            ["b1", "b2"],
            "UDP Cluster via node 1 ({mode}, {dst})"
        );

        // Local via node 1: only b1, which sees the client.
        let dst = SocketAddr::new(node_addr(1, family), LOCAL_NODE_PORT);
        let by_backend = answers(&client.ns, dst);
        assert_eq!(
            by_backend.keys().map(String::as_str).collect::<Vec<_>>(),
            ["b1"],
            "Local via node 1 ({mode}, {dst}): {by_backend:?}"
        );
        assert!(by_backend["b1"].iter().all(|p| *p == client_addr), "{by_backend:?}");

        // Local via node 2, which has no backend of it: refused at once, TCP
        // by a RST, UDP by ICMP port unreachable.
        let dst = SocketAddr::new(node_addr(2, family), LOCAL_NODE_PORT);
        assert_rejected(n2, &format!("TCP Local via node 2 ({mode}, {dst})"), || {
            ask_name(&client.ns, dst, TIMEOUT)
        })
        .await;
        assert_rejected(n2, &format!("UDP Local via node 2 ({mode}, {dst})"), || {
            ask_name_udp(&client.ns, dst, TIMEOUT)
        })
        .await;

        // From pod c1 to its own node's NodePort (translated in
        // from_container): every backend, each seeing the pod's address.
        let c1 = n1.pod("c1");
        let c1_addr = c1.addrs()[family];
        let dst = SocketAddr::new(node_addr(1, family), CLUSTER_NODE_PORT);
        let by_backend = answers(&c1.ns, dst);
        assert_eq!(
            by_backend.keys().map(String::as_str).collect::<Vec<_>>(),
            ["b1", "b2"],
            "pod c1 → its node's NodePort ({mode}, {dst}): {by_backend:?}"
        );
        assert!(
            by_backend.values().flatten().all(|p| *p == c1_addr),
            "the backends see pod c1 {c1_addr} ({mode}): {by_backend:?}"
        );
        // To node 2's NodePort: node 2 translates it as any client's. Its
        // own backend's reply leaves b2 for the pod on node 1 (vxlan: by the
        // tunnel, not the underlay): the reverse translation happens in b2's
        // from_container, before it leaves; b1's comes back SNATed to node 2.
        let dst = SocketAddr::new(node_addr(2, family), CLUSTER_NODE_PORT);
        let by_backend = answers(&c1.ns, dst);
        assert_eq!(
            by_backend.keys().map(String::as_str).collect::<Vec<_>>(),
            ["b1", "b2"],
            "pod c1 → node 2's NodePort ({mode}, {dst}): {by_backend:?}"
        );
        assert!(by_backend["b2"].iter().all(|p| *p == c1_addr), "{by_backend:?}");
        assert!(
            by_backend["b1"].iter().all(|p| *p == node_addr(2, family)),
            "{by_backend:?}"
        );
    }
}

#[tokio::test]
async fn nodeport_from_outside_native() {
    nodeport_from_outside("native").await;
}

#[tokio::test]
async fn nodeport_from_outside_vxlan() {
    nodeport_from_outside("vxlan").await;
}

/// kill -9 of node 1's loader: the NodePort filters keep translating while
/// it is dead (connections held open through both backends, the SNATed one
/// included, keep answering; new ones are served), and the restarted
/// loader's programs take over the filters in place with the flows in the
/// pinned maps.
#[tokio::test]
async fn nodeport_survives_a_loader_kill_9_and_the_restart_adopts_the_filters() {
    let mut setup = Setup::start("native").await;
    let dst = SocketAddr::new(node_addr(1, 0), CLUSTER_NODE_PORT);
    // One held connection to each backend (b2's is SNATed by node 1).
    let mut held: BTreeMap<String, HeldConnection> = BTreeMap::new();
    for _ in 0..CONNECTIONS {
        let conn = HeldConnection::open(&setup.client.ns, dst, TIMEOUT).expect("a connection to the NodePort");
        let (name, _) = name_and_peer(&conn.first).expect("a name and a peer");
        held.entry(name.to_owned()).or_insert(conn);
        if held.len() == 2 {
            break;
        }
    }
    assert_eq!(held.len(), 2, "connections to both backends: {:?}", held.keys());
    let before = netdev_programs(&setup.n1).await;

    setup.n1.loader.kill9();
    let by_backend = answers(&setup.client.ns, dst);
    assert_eq!(
        by_backend.len(),
        2,
        "new connections with the loader dead: {by_backend:?}"
    );
    for (name, conn) in &mut held {
        let again = conn
            .ask()
            .unwrap_or_else(|e| panic!("the held connection to {name}, loader dead: {e}"));
        assert_eq!(name_and_peer(&again).map(|(n, _)| n), Some(name.as_str()));
    }

    setup
        .n1
        .loader
        .restart()
        .await
        .expect("the loader restarts on its pins");
    for (name, conn) in &mut held {
        let again = conn
            .ask()
            .unwrap_or_else(|e| panic!("the held connection to {name}, after the restart: {e}"));
        assert_eq!(name_and_peer(&again).map(|(n, _)| n), Some(name.as_str()));
    }
    let after = netdev_programs(&setup.n1).await;
    assert_eq!(
        after.iter().map(|(_, _, a)| *a).collect::<Vec<_>>(),
        [1, 1],
        "{after:?}"
    );
    for ((name, old, _), (_, new, _)) in before.iter().zip(&after) {
        assert_ne!(old, new, "{name}: the restarted loader's own program runs on ul0");
    }
    let by_backend = answers(&setup.client.ns, dst);
    assert_eq!(by_backend.len(), 2, "new connections after the restart: {by_backend:?}");
}
