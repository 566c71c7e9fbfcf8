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

use rivet_proto::loader::v1 as pb;
use rivet_proto::net::{IpPrefix, address_bytes};
use rivet_testkit::loader::{ExternalClient, LoaderNode, UNDERLAY_IFNAME, Underlay, policy};
use rivet_testkit::service::{NameServer, ask_name, ask_name_udp, ask_names, name_and_peer};

const BIN: &str = env!("CARGO_BIN_EXE_svc-loader");
const REMOTE_NODE: u32 = 6;
const BACKEND_PORT: u16 = 8080;
const CLUSTER_NODE_PORT: u16 = 30080;
const LOCAL_NODE_PORT: u16 = 30081;
/// New connections per check: 2 backends all on one side by chance is 2^-29.
const CONNECTIONS: usize = 30;
const TIMEOUT: Duration = Duration::from_secs(3);

/// Who answered `CONNECTIONS` new connections from the client to `dst`,
/// with the client address each backend saw.
fn answers(client: &ExternalClient, dst: SocketAddr) -> BTreeMap<String, Vec<IpAddr>> {
    let mut by_backend: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    for answer in ask_names(&client.ns, dst, CONNECTIONS, TIMEOUT) {
        let answer = answer.unwrap_or_else(|e| panic!("asking NodePort {dst}: {e}"));
        let (name, peer) = name_and_peer(&answer).unwrap_or_else(|| panic!("answer from {dst}: {answer:?}"));
        by_backend.entry(name.to_owned()).or_default().push(peer);
    }
    by_backend
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

/// Node `index` with backend pod `b<index>` (identity 1000 + index, no policy).
async fn node(underlay: &Underlay, index: u8, mode: &str) -> LoaderNode {
    let pod = format!("b{index}");
    let args = ["--routing-mode", mode, "--underlay-interface", UNDERLAY_IFNAME];
    let node = LoaderNode::start_on_underlay(BIN.as_ref(), underlay, index, &[&pod], &args)
        .await
        .expect("a test node on the underlay with svc-loader starts");
    let request = node.endpoint(
        &pod,
        u32::from(index),
        1000 + u32::from(index),
        policy(1, false, false, Vec::new()),
    );
    node.client()
        .await
        .apply_endpoint(request)
        .await
        .expect("the endpoint applies");
    node
}

/// What svc-identity would publish on `local` about node `peer_index`: its
/// underlay addresses as remote-node, its pod with its tunnel endpoint; and
/// the peer's routes.
async fn learn_peer(local: &LoaderNode, peer: &LoaderNode, peer_index: u8) {
    let tunnel = Some(Underlay::ipv4(peer_index));
    let mut entries = vec![
        ipcache_entry(IpAddr::V4(Underlay::ipv4(peer_index)), REMOTE_NODE, None),
        ipcache_entry(IpAddr::V6(Underlay::ipv6(peer_index)), REMOTE_NODE, None),
    ];
    for a in peer.pod(&format!("b{peer_index}")).addrs() {
        entries.push(ipcache_entry(a, 1000 + u32::from(peer_index), tunnel));
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

/// The address of node `index` on the underlay in `family` (0: IPv4, 1: IPv6).
fn node_addr(index: u8, family: usize) -> IpAddr {
    if family == 0 {
        IpAddr::V4(Underlay::ipv4(index))
    } else {
        IpAddr::V6(Underlay::ipv6(index))
    }
}

async fn nodeport_from_outside(mode: &str) {
    let underlay = Underlay::new().unwrap();
    let n1 = node(&underlay, 1, mode).await;
    let n2 = node(&underlay, 2, mode).await;
    learn_peer(&n1, &n2, 2).await;
    learn_peer(&n2, &n1, 1).await;
    let b1 = n1.pod("b1").addrs();
    let b2 = n2.pod("b2").addrs();
    let sockets =
        |addrs: &[IpAddr]| -> Vec<SocketAddr> { addrs.iter().map(|a| SocketAddr::new(*a, BACKEND_PORT)).collect() };
    let _servers = [
        NameServer::start_reporting_peer(&n1.pod("b1").ns, "b1", &sockets(&b1)).unwrap(),
        NameServer::start_reporting_peer(&n2.pod("b2").ns, "b2", &sockets(&b2)).unwrap(),
    ];
    raw::upsert_services(&n1, 1, &b1, &b2).await;
    raw::upsert_services(&n2, 2, &b1, &b2).await;
    let client = underlay.add_external_client().unwrap();
    let status = n1
        .client()
        .await
        .get_datapath_status(pb::GetDatapathStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let attached: Vec<(&str, u32)> = status
        .programs
        .iter()
        .filter(|p| p.name.ends_with("_netdev"))
        .map(|p| (p.name.as_str(), p.attachments))
        .collect();
    assert_eq!(attached, [("from_netdev", 1), ("to_netdev", 1)], "ul0 serves NodePort");

    for family in 0..2 {
        let client_addr = client.addrs()[family];
        // Cluster, through either node: both backends answer; the node's own
        // sees the client, the other node's sees the node (SNAT).
        for (via, local, remote) in [(1, "b1", "b2"), (2, "b2", "b1")] {
            let dst = SocketAddr::new(node_addr(via, family), CLUSTER_NODE_PORT);
            let by_backend = answers(&client, dst);
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
        let by_backend = answers(&client, dst);
        assert_eq!(
            by_backend.keys().map(String::as_str).collect::<Vec<_>>(),
            ["b1"],
            "Local via node 1 ({mode}, {dst}): {by_backend:?}"
        );
        assert!(by_backend["b1"].iter().all(|p| *p == client_addr), "{by_backend:?}");

        // Local via node 2, which has no backend of it: refused at once.
        let before = n2.drops(pb::DropReason::NoServiceBackend).await;
        let dst = SocketAddr::new(node_addr(2, family), LOCAL_NODE_PORT);
        match ask_name(&client.ns, dst, TIMEOUT) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            other => panic!("Local via node 2 ({mode}, {dst}) is refused with a RST: {other:?}"),
        }
        assert!(
            n2.drops_reaching(pb::DropReason::NoServiceBackend, before + 1, Duration::from_secs(5))
                .await
                > before,
            "node 2 counts the rejected SYN as no-service-backend ({mode}, {dst})"
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

/// The services every node holds, written straight into the node's pinned
/// maps as svc-loader's LoadBalancerService lays them out (it is not on
/// main yet; the tests move to UpsertService when it is): per family a
/// Cluster service on NodePort 30080 over b1 and b2, and a Local one on
/// 30081 over b1 only, whose EXTERNAL table on node 2 is empty; and a
/// Cluster UDP service on 30080 over both.
mod raw {
    use super::*;
    use aya::maps::{HashMap, MapData};

    fn map<K: aya::Pod, V: aya::Pod>(node: &LoaderNode, name: &str) -> HashMap<MapData, K, V> {
        let data = MapData::from_pin(node.pins.0.join(name)).unwrap();
        HashMap::try_from(aya::maps::Map::HashMap(data)).unwrap()
    }

    fn addr16(a: IpAddr) -> [u8; 16] {
        let mut out = [0u8; 16];
        match a {
            IpAddr::V4(v4) => out[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => out = v6.octets(),
        }
        out
    }

    fn fe_key(family: u8, port: u16, scope: u8) -> [u8; 24] {
        fe_key_of(family, port, 6, scope)
    }

    fn fe_key_of(family: u8, port: u16, protocol: u8, scope: u8) -> [u8; 24] {
        let mut k = [0u8; 24];
        k[16..18].copy_from_slice(&port.to_be_bytes());
        k[18] = protocol;
        k[19] = family;
        k[20] = scope;
        k
    }

    fn fe(service: u32, table: u32, count: u16, flags: u16) -> [u8; 16] {
        let mut v = [0u8; 16];
        v[0..4].copy_from_slice(&service.to_ne_bytes());
        v[4..8].copy_from_slice(&table.to_ne_bytes());
        v[8..10].copy_from_slice(&count.to_ne_bytes());
        v[10..12].copy_from_slice(&flags.to_ne_bytes());
        v
    }

    fn table(ids: &[u32]) -> [u32; 1021] {
        let mut t = [0u32; 1021];
        if !ids.is_empty() {
            for (i, slot) in t.iter_mut().enumerate() {
                *slot = ids[i % ids.len()];
            }
        }
        t
    }

    pub async fn upsert_services(node: &LoaderNode, index: u8, b1: &[IpAddr], b2: &[IpAddr]) {
        let mut backends: HashMap<MapData, u32, [u8; 20]> = map(node, "lb_backends");
        let mut tables: HashMap<MapData, u32, [u32; 1021]> = map(node, "lb_maglev");
        let mut frontends: HashMap<MapData, [u8; 24], [u8; 16]> = map(node, "lb_frontends");
        for family in 0..2usize {
            let fam = if family == 0 { 4 } else { 6 };
            let id1 = 1 + 2 * family as u32;
            let id2 = id1 + 1;
            for (id, a) in [(id1, b1[family]), (id2, b2[family])] {
                let mut v = [0u8; 20];
                v[..16].copy_from_slice(&addr16(a));
                v[16..18].copy_from_slice(&BACKEND_PORT.to_be_bytes());
                v[18] = fam;
                backends.insert(id, v, 0).unwrap();
            }
            let local = if index == 1 { vec![id1] } else { vec![] };
            let t = 10 * (family as u32 + 1);
            tables.insert(t, table(&[id1, id2]), 0).unwrap(); // Cluster
            tables.insert(t + 1, table(&[id1]), 0).unwrap(); // Local, internal
            tables.insert(t + 2, table(&local), 0).unwrap(); // Local, external
            frontends
                .insert(fe_key(fam, CLUSTER_NODE_PORT, 0), fe(1 + family as u32, t, 2, 2), 0)
                .unwrap();
            frontends
                .insert(
                    fe_key_of(fam, CLUSTER_NODE_PORT, 17, 0),
                    fe(5 + family as u32, t, 2, 2),
                    0,
                )
                .unwrap();
            frontends
                .insert(
                    fe_key(fam, LOCAL_NODE_PORT, 0),
                    fe(3 + family as u32, t + 1, 1, 2 | 8),
                    0,
                )
                .unwrap();
            frontends
                .insert(
                    fe_key(fam, LOCAL_NODE_PORT, 1),
                    fe(3 + family as u32, t + 2, local.len() as u16, 2 | 8),
                    0,
                )
                .unwrap();
        }
    }
}
