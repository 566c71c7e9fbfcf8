//! Two nodes on an underlay, each with its own svc-loader in native or
//! vxlan mode: routes to peers (NodeRoutingService), pod traffic across
//! nodes, and what the loader refuses.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rivet_proto::loader::v1 as pb;
use rivet_proto::net::{IpPrefix, address_bytes};
use rivet_testkit::loader::{LoaderNode, UNDERLAY_IFNAME, Underlay, cluster_ip_service, policy};
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_svc-loader");
const A: u32 = 1001; // identities
const B: u32 = 1002;

fn mode_args(mode: &str) -> [&str; 4] {
    ["--routing-mode", mode, "--underlay-interface", UNDERLAY_IFNAME]
}

/// Node `index` in `mode` with one pod, `p<index>`, whose endpoint is
/// applied with identity `identity` and `pol`.
async fn node(underlay: &Underlay, index: u8, mode: &str, identity: u32, pol: pb::EndpointPolicy) -> LoaderNode {
    let pod = format!("p{index}");
    let node = LoaderNode::start_on_underlay(BIN.as_ref(), underlay, index, &[&pod], &mode_args(mode))
        .await
        .expect("a test node on the underlay with svc-loader starts");
    let request = node.endpoint(&pod, u32::from(index), identity, pol);
    node.client()
        .await
        .apply_endpoint(request)
        .await
        .expect("the endpoint applies");
    node
}

fn open() -> pb::EndpointPolicy {
    policy(1, false, false, Vec::new())
}

fn cidr(net: &str) -> IpPrefix {
    let net: ipnet::IpNet = net.parse().unwrap();
    IpPrefix {
        address: address_bytes(net.network()),
        prefix_length: u32::from(net.prefix_len()),
    }
}

/// Node `index` as a peer: its underlay addresses and pod CIDRs.
fn peer(index: u8) -> pb::PeerNode {
    pb::PeerNode {
        name: format!("node-{index}"),
        underlay_ipv4: address_bytes(IpAddr::V4(Underlay::ipv4(index))),
        underlay_ipv6: address_bytes(IpAddr::V6(Underlay::ipv6(index))),
        pod_cidrs: vec![
            cidr(&format!("198.18.{index}.0/24")),
            cidr(&format!("2001:2:0:{index}::/64")),
        ],
    }
}

async fn replace(node: &LoaderNode, nodes: Vec<pb::PeerNode>) -> pb::ReplaceNodesResponse {
    node.routing_client()
        .await
        .replace_nodes(pb::ReplaceNodesRequest { nodes })
        .await
        .expect("ReplaceNodes succeeds")
        .into_inner()
}

fn pings(node: &LoaderNode, pod: &str, to: IpAddr) -> u32 {
    node.pod(pod)
        .ping(to, 3, Duration::from_millis(50), Duration::from_secs(2))
        .expect("ping runs")
        .received
}

fn addrs(node: &LoaderNode, pod: &str) -> Vec<IpAddr> {
    node.pod(pod).addrs()
}

/// p1 on node 1 pings p2 on node 2 and talks TCP to it, both families.
fn p1_reaches_p2(n1: &LoaderNode, n2: &LoaderNode, mode: &str) {
    let server = n2.pod("p2").tcp_server(0).unwrap();
    for dst in addrs(n2, "p2") {
        assert_eq!(pings(n1, "p1", dst), 3, "p1 → {dst} across nodes ({mode})");
        assert!(
            n1.pod("p1")
                .tcp_echo(SocketAddr::new(dst, server.port()), Duration::from_secs(3))
                .unwrap(),
            "TCP p1 → {dst} ({mode})"
        );
    }
}

async fn list_nodes(node: &LoaderNode) -> pb::ListNodesResponse {
    node.routing_client()
        .await
        .list_nodes(pb::ListNodesRequest {})
        .await
        .expect("ListNodes succeeds")
        .into_inner()
}

/// The overlay programs in GetDatapathStatus: (name, attachments).
async fn overlay_programs(node: &LoaderNode) -> Vec<(String, u32)> {
    node.client()
        .await
        .get_datapath_status(pb::GetDatapathStatusRequest {})
        .await
        .expect("GetDatapathStatus succeeds")
        .into_inner()
        .programs
        .into_iter()
        .filter(|p| p.name.ends_with("overlay"))
        .map(|p| (p.name, p.attachments))
        .collect()
}

#[tokio::test]
async fn native_routing_reaches_pods_across_nodes_and_replace_nodes_owns_only_its_routes() {
    let underlay = Underlay::new().unwrap();
    let n1 = node(&underlay, 1, "native", A, open()).await;
    let n2 = node(&underlay, 2, "native", B, open()).await;
    // A route of someone else to a CIDR no peer has: never touched.
    n1.node
        .ns
        .ip(&["route", "add", "198.18.99.0/24", "via", "198.19.254.2"])
        .unwrap();

    let r = replace(&n1, vec![peer(2)]).await;
    assert_eq!((r.routes_added, r.routes_removed, r.routes_unchanged), (2, 0, 0));
    replace(&n2, vec![peer(1)]).await;
    assert_eq!(
        n1.rivet_routes(),
        [
            "198.18.2.0/24 via 198.19.254.2 dev ul0",
            "2001:2:0:2::/64 via 2001:2:0:fe::2 dev ul0 metric 1024 pref medium"
        ]
    );
    let again = replace(&n1, vec![peer(2)]).await;
    assert_eq!(
        (again.routes_added, again.routes_removed, again.routes_unchanged),
        (0, 0, 2)
    );

    p1_reaches_p2(&n1, &n2, "native");

    let listed = list_nodes(&n1).await;
    assert_eq!(listed.routing_mode, pb::RoutingMode::Native as i32);
    assert_eq!(listed.underlay_interface, UNDERLAY_IFNAME);
    assert_eq!((listed.routes, listed.nodes.len()), (2, 1));
    assert_eq!(listed.nodes[0].name, "node-2");

    // The peer leaves: exactly its routes go.
    let gone = replace(&n1, Vec::new()).await;
    assert_eq!((gone.routes_added, gone.routes_removed), (0, 2));
    assert!(n1.rivet_routes().is_empty(), "{:?}", n1.rivet_routes());
    let others = n1.node.ns.ip(&["route", "show", "198.18.99.0/24"]).unwrap();
    assert!(others.contains("via 198.19.254.2"), "{others}");
}

#[tokio::test]
async fn bad_replace_nodes_input_is_refused_naming_the_field_and_changes_nothing() {
    let underlay = Underlay::new().unwrap();
    let n1 = node(&underlay, 1, "vxlan", A, open()).await;
    replace(&n1, vec![peer(2)]).await;
    let before = n1.rivet_routes();
    assert_eq!(before.len(), 2, "{before:?}");

    let mut bad_name = peer(3);
    bad_name.name = "Node_3".into();
    let mut short_address = peer(3);
    short_address.underlay_ipv4 = vec![198, 19, 254];
    let mut no_v4 = peer(3);
    no_v4.underlay_ipv4.clear();
    let mut host_bits = peer(3);
    host_bits.pod_cidrs[0] = IpPrefix {
        address: vec![198, 18, 3, 7],
        prefix_length: 24,
    };
    let mut overlapping = peer(3);
    overlapping.pod_cidrs[0] = cidr("198.18.2.128/25");
    let mut duplicate = peer(2);
    duplicate.pod_cidrs.clear();
    let cases = [
        (vec![peer(2), bad_name], "nodes[1].name"),
        (vec![peer(2), short_address], "nodes[1].underlay_ipv4"),
        (vec![peer(2), no_v4], "nodes[1].underlay_ipv4"),
        (vec![peer(2), host_bits], "nodes[1].pod_cidrs[0].address"),
        (vec![peer(2), overlapping], "nodes[1].pod_cidrs[0]"),
        (vec![peer(2), duplicate], "nodes[1].name"),
    ];
    let mut client = n1.routing_client().await;
    for (nodes, field) in cases {
        let err = client
            .replace_nodes(pb::ReplaceNodesRequest { nodes })
            .await
            .expect_err("bad input is refused");
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err:?}");
        assert!(err.message().starts_with(field), "{field}: {}", err.message());
    }
    assert_eq!(n1.rivet_routes(), before, "nothing changed");

    // A routing mode needs an underlay that exists.
    let err = LoaderNode::start(
        BIN.as_ref(),
        &[],
        &["--routing-mode", "native", "--underlay-interface", "nosuch0"],
    )
    .await
    .expect_err("no underlay, no start");
    assert!(
        err.to_string()
            .contains("the underlay interface nosuch0 does not exist in the loader's network namespace"),
        "{err}"
    );

    // A loader without a routing mode holds no peers.
    let single = LoaderNode::start(BIN.as_ref(), &[], &[]).await.unwrap();
    let err = single
        .routing_client()
        .await
        .replace_nodes(pb::ReplaceNodesRequest { nodes: vec![peer(2)] })
        .await
        .expect_err("no routing mode");
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(
        rivet_common::grpc::error_reason::<pb::ErrorReason>(&err),
        Some(pb::ErrorReason::RoutingDisabled),
        "{err:?}"
    );
}

#[tokio::test]
async fn the_vxlan_device_is_created_with_the_tunnel_mtu_and_adopted_by_a_restart() {
    let underlay = Underlay::new().unwrap();
    let mut n1 = node(&underlay, 1, "vxlan", A, open()).await;
    let ns = &n1.node.ns;
    let details = ns.ip(&["-d", "link", "show", "rivet_vxlan"]).unwrap();
    for want in ["mtu 1450", "external", "dstport 8472", "nolearning", "NOARP", "UP"] {
        assert!(details.contains(want), "{want} in {details}");
    }
    let ifindex = ns.ifindex("rivet_vxlan").unwrap();
    replace(&n1, vec![peer(2)]).await;
    assert_eq!(
        n1.rivet_routes(),
        [
            "198.18.2.0/24 dev rivet_vxlan scope link src 198.19.254.1",
            "2001:2:0:2::/64 dev rivet_vxlan src 2001:2:0:fe::1 metric 1024 pref medium"
        ]
    );

    n1.loader.kill9();
    n1.loader.restart().await.expect("the loader restarts");
    assert_eq!(
        n1.node.ns.ifindex("rivet_vxlan").unwrap(),
        ifindex,
        "adopted, not recreated"
    );
    assert_eq!(
        n1.rivet_routes().len(),
        2,
        "routes stay until the peers are pushed again"
    );
    let listed = list_nodes(&n1).await;
    assert_eq!(
        (
            listed.routing_mode,
            listed.tunnel_interface.as_str(),
            listed.tunnel_port,
            listed.routes
        ),
        (pb::RoutingMode::Vxlan as i32, "rivet_vxlan", 8472, 2)
    );
    assert!(listed.nodes.is_empty(), "peers are in memory only");
    let r = replace(&n1, vec![peer(2)]).await;
    assert_eq!((r.routes_added, r.routes_removed, r.routes_unchanged), (0, 0, 2));
}

const C: u32 = 1003;
const REMOTE_NODE: u32 = 6;

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

async fn upsert_ipcache(node: &LoaderNode, entries: Vec<pb::IpcacheEntry>) {
    node.client()
        .await
        .upsert_ipcache(pb::UpsertIpcacheRequest { entries })
        .await
        .expect("UpsertIpcache succeeds");
}

/// What svc-identity's registry and ipcache publish on node `local` about
/// node `peer` and its pod `p<peer>` of `identity`: the peer's underlay
/// addresses as remote-node, the pod's addresses with the peer's tunnel
/// endpoint; and the peer in ReplaceNodes.
async fn learn_peer(local: &LoaderNode, peer_node: &LoaderNode, peer_index: u8, identity: u32) {
    let tunnel = Some(Underlay::ipv4(peer_index));
    let mut entries = vec![
        ipcache_entry(IpAddr::V4(Underlay::ipv4(peer_index)), REMOTE_NODE, None),
        ipcache_entry(IpAddr::V6(Underlay::ipv6(peer_index)), REMOTE_NODE, None),
    ];
    for a in addrs(peer_node, &format!("p{peer_index}")) {
        entries.push(ipcache_entry(a, identity, tunnel));
    }
    upsert_ipcache(local, entries).await;
    replace(local, vec![peer(peer_index)]).await;
}

/// p2's policy: ingress from `identities` (ICMP, ICMPv6, TCP and UDP, any port).
fn ingress_from(revision: u64, identities: &[u32]) -> pb::EndpointPolicy {
    use rivet_testkit::loader::entry;
    let entries = identities
        .iter()
        .map(|id| entry(pb::Direction::Ingress, *id, pb::Protocol::Any, 0, 0, pb::Verdict::Allow))
        .collect();
    policy(revision, true, false, entries)
}

/// Nodes 1 and 2 in `mode`, p1 (identity A, unrestricted) and p2 (identity
/// B, ingress from A only), each knowing the other.
async fn two_nodes(underlay: &Underlay, mode: &str) -> (LoaderNode, LoaderNode) {
    let n1 = node(underlay, 1, mode, A, open()).await;
    let n2 = node(underlay, 2, mode, B, ingress_from(1, &[A])).await;
    learn_peer(&n1, &n2, 2, B).await;
    learn_peer(&n2, &n1, 1, A).await;
    (n1, n2)
}

/// 3 pings from namespace `ns` to `dst` (from `source` if given): how many
/// came back.
fn pings_from(ns: &rivet_common::testing::netns::NetNs, source: Option<IpAddr>, dst: IpAddr) -> u32 {
    let mut command = ns.command("ping");
    command.args(["-n", "-q", "-c", "3", "-i", "0.05", "-W", "1"]);
    if let Some(source) = source {
        command.args(["-I", &source.to_string()]);
    }
    let out = command.arg(dst.to_string()).output().expect("ping runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split(", ")
        .find_map(|part| part.strip_suffix(" received").and_then(|n| n.trim().parse().ok()))
        .unwrap_or_else(|| panic!("ping output: {text}"))
}

/// Pings from node namespace `ns` with the kernel's choice of source, after
/// checking that its route's preferred source is `src` (the node's
/// underlay address): replies received of 3.
fn node_pings(ns: &rivet_common::testing::netns::NetNs, src: IpAddr, dst: IpAddr) -> u32 {
    let route = ns.ip(&["route", "get", &dst.to_string()]).expect("ip route get runs");
    assert!(
        route.contains(&format!("src {src}")),
        "node traffic to {dst} leaves from {src}: {route}"
    );
    pings_from(ns, None, dst)
}

#[tokio::test]
async fn vxlan_carries_pod_traffic_and_node_b_enforces_the_identity_in_the_vni() {
    let underlay = Underlay::new().unwrap();
    let (n1, n2) = two_nodes(&underlay, "vxlan").await;

    p1_reaches_p2(&n1, &n2, "vxlan");
    for dst in addrs(&n1, "p1") {
        assert_eq!(pings(&n2, "p2", dst), 3, "p2 → {dst} through the tunnel");
    }
    let (_, sent) = n1.node.ns.link_packets("rivet_vxlan").unwrap();
    assert!(sent > 0, "node 1 sent through rivet_vxlan");

    // p1 gets identity C on node 1; node 2's ipcache still says A for its
    // address. Node 2 believes the VNI: p2 (ingress from A only) refuses.
    let denied_before = n2.drops(pb::DropReason::PolicyDefaultDeny).await;
    n1.client()
        .await
        .apply_endpoint(n1.endpoint("p1", 1, C, open()))
        .await
        .unwrap();
    for dst in addrs(&n2, "p2") {
        assert_eq!(
            pings(&n1, "p1", dst),
            0,
            "p1 as C → {dst}: denied by the VNI's identity"
        );
    }
    assert!(
        n2.drops_reaching(
            pb::DropReason::PolicyDefaultDeny,
            denied_before + 6,
            Duration::from_secs(5)
        )
        .await
            >= denied_before + 6
    );
    // And allowing C on p2 lets it in again.
    n2.client()
        .await
        .apply_endpoint(n2.endpoint("p2", 2, B, ingress_from(2, &[A, C])))
        .await
        .unwrap();
    for dst in addrs(&n2, "p2") {
        assert_eq!(pings(&n1, "p1", dst), 3, "p1 as C → {dst}, C allowed");
    }

    assert_eq!(
        overlay_programs(&n1).await,
        [("from_overlay".to_owned(), 1), ("to_overlay".to_owned(), 1)]
    );
}

#[tokio::test]
async fn node_originated_traffic_to_a_remote_pod_arrives_as_remote_node() {
    let underlay = Underlay::new().unwrap();
    let (n1, n2) = two_nodes(&underlay, "vxlan").await;
    let sources = [IpAddr::V4(Underlay::ipv4(1)), IpAddr::V6(Underlay::ipv6(1))];
    let targets = addrs(&n2, "p2");
    // p2 lets A in, not remote-node.
    for (src, dst) in sources.iter().zip(&targets) {
        assert_eq!(
            node_pings(&n1.node.ns, *src, *dst),
            0,
            "node 1 → {dst} before remote-node is allowed"
        );
    }
    assert!(n2.drops(pb::DropReason::PolicyDefaultDeny).await >= 6);
    n2.client()
        .await
        .apply_endpoint(n2.endpoint("p2", 2, B, ingress_from(2, &[A, REMOTE_NODE])))
        .await
        .unwrap();
    for (src, dst) in sources.iter().zip(&targets) {
        assert_eq!(
            node_pings(&n1.node.ns, *src, *dst),
            3,
            "node 1 ({src}) → {dst} as remote-node"
        );
    }
    // An address of the peer's pod CIDR that is in no ipcache entry (a pod
    // not published yet): the route leads into the tunnel, but there is no
    // endpoint to send it to.
    let unknown: IpAddr = "198.18.2.99".parse().unwrap();
    assert_eq!(node_pings(&n1.node.ns, sources[0], unknown), 0);
    assert!(
        n1.drops_reaching(pb::DropReason::NoTunnelEndpoint, 3, Duration::from_secs(5))
            .await
            >= 3
    );
}

#[tokio::test]
async fn a_packet_too_big_for_the_tunnel_gets_frag_needed_and_tcp_finds_the_path_mtu() {
    let underlay = Underlay::new().unwrap();
    let (n1, n2) = two_nodes(&underlay, "vxlan").await;
    let [v4, v6] = addrs(&n2, "p2")[..] else { panic!() };
    // 1472 + 28 = 1500 bytes of IPv4, 1452 + 48 = 1500 of IPv6: over 1450.
    for (dst, size) in [(v4, "1472"), (v6, "1452")] {
        let out = n1
            .pod("p1")
            .ns
            .command("ping")
            .args([
                "-n",
                "-c",
                "2",
                "-i",
                "0.2",
                "-W",
                "1",
                "-M",
                "do",
                "-s",
                size,
                &dst.to_string(),
            ])
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("mtu = 1450") || text.contains("mtu=1450") || text.contains("mtu: 1450"),
            "{dst}: too big gets the tunnel MTU:\n{text}"
        );
    }
    // Fits: passes.
    assert_eq!(
        n1.pod("p1")
            .ping(v4, 2, Duration::from_millis(50), Duration::from_secs(2))
            .unwrap()
            .received,
        2
    );
    // TCP between 1500-MTU pods: 1 MB each way through the 1450 tunnel,
    // twice per family. Once the path MTU is known, the segments fit and
    // skip the node's stack: a GSO burst is checked per segment, not as
    // one 64 KB packet.
    let server = n2.pod("p2").tcp_server(0).unwrap();
    for dst in [v4, v6] {
        echo_1mb(&n1, SocketAddr::new(dst, server.port()));
        let forwarded = forwarded_by_stack(&n1);
        echo_1mb(&n1, SocketAddr::new(dst, server.port()));
        assert!(
            forwarded_by_stack(&n1) - forwarded <= 2,
            "TCP to {dst} with the path MTU known went through node 1's stack: {} datagrams",
            forwarded_by_stack(&n1) - forwarded
        );
    }
}

/// 1 MB echoed by the TCP server at `dst` for p1.
fn echo_1mb(n1: &LoaderNode, dst: SocketAddr) {
    let mut stream = n1.pod("p1").tcp_stream(dst, Duration::from_secs(3)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let sent: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let writer = {
        let mut w = stream.try_clone().unwrap();
        let data = sent.clone();
        std::thread::spawn(move || std::io::Write::write_all(&mut w, &data))
    };
    let mut back = vec![0u8; sent.len()];
    std::io::Read::read_exact(&mut stream, &mut back).expect("the echo comes back whole");
    writer.join().unwrap().unwrap();
    assert!(back == sent, "TCP to {dst}: echo differs");
}

/// Datagrams the node's stack forwarded (IPv4 and IPv6, /proc/net/snmp{,6}).
fn forwarded_by_stack(node: &LoaderNode) -> u64 {
    let read = |file: &str| {
        let out = node.node.ns.command("cat").arg(file).output().expect("cat runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let snmp = read("/proc/net/snmp");
    let mut lines = snmp.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (lines.next().unwrap(), lines.next().unwrap());
    let v4: u64 = names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(n, _)| *n == "ForwDatagrams")
        .and_then(|(_, v)| v.parse().ok())
        .expect("Ip: ForwDatagrams");
    let v6: u64 = read("/proc/net/snmp6")
        .lines()
        .find_map(|l| {
            l.strip_prefix("Ip6OutForwDatagrams")
                .and_then(|v| v.trim().parse().ok())
        })
        .expect("Ip6OutForwDatagrams");
    v4 + v6
}

#[tokio::test]
async fn vxlan_from_a_non_node_or_with_vni_host_is_dropped_by_node_b() {
    let underlay = Underlay::new().unwrap();
    let (_n1, n2) = two_nodes(&underlay, "vxlan").await;
    // A third namespace on the underlay with its own kernel VXLAN device:
    // UDP to p2 with the VNI its route says.
    let rogue = rivet_common::testing::netns::NetNs::new("rvr").unwrap();
    underlay.join(&rogue, 9).unwrap();
    let run = |args: &[&str]| rogue.ip(args).unwrap();
    run(&["link", "add", "vx", "type", "vxlan", "external", "dstport", "8472"]);
    run(&["link", "set", "vx", "arp", "off", "up"]);
    run(&["addr", "add", "198.18.9.1/32", "dev", "vx"]);
    let p2 = n2.pod("p2").ipv4().unwrap();
    let server = n2.pod("p2").udp_server(0).unwrap();
    let socket = rogue.udp_socket("198.18.9.1:0".parse().unwrap()).unwrap();
    let send_with_vni = |vni: u32| {
        rogue
            .ip(&[
                "route",
                "replace",
                &format!("{p2}/32"),
                "encap",
                "ip",
                "id",
                &vni.to_string(),
                "dst",
                &Underlay::ipv4(2).to_string(),
                "dev",
                "vx",
            ])
            .unwrap();
        for _ in 0..3 {
            socket.send_to(b"vni", SocketAddr::new(p2, server.port())).unwrap();
        }
    };

    // Not a node: even the allowed identity A is not believed.
    send_with_vni(A);
    assert!(
        n2.drops_reaching(pb::DropReason::TunnelSourceNotNode, 3, Duration::from_secs(5))
            .await
            >= 3
    );
    // Now 198.19.254.9 is a node (the registry claimed it as remote-node).
    upsert_ipcache(
        &n2,
        vec![ipcache_entry(IpAddr::V4(Underlay::ipv4(9)), REMOTE_NODE, None)],
    )
    .await;
    send_with_vni(1); // host: no node sends it
    assert!(
        n2.drops_reaching(pb::DropReason::TunnelIdentityInvalid, 3, Duration::from_secs(5))
            .await
            >= 3
    );
    send_with_vni(0);
    assert!(
        n2.drops_reaching(pb::DropReason::TunnelIdentityInvalid, 6, Duration::from_secs(5))
            .await
            >= 6
    );
    let denied = n2.drops(pb::DropReason::PolicyDefaultDeny).await;
    send_with_vni(C); // a node's VNI is believed: C is not allowed into p2
    assert!(
        n2.drops_reaching(pb::DropReason::PolicyDefaultDeny, denied + 3, Duration::from_secs(5))
            .await
            >= denied + 3
    );
    assert_eq!(server.datagrams(), 0, "nothing reached p2 so far");
    send_with_vni(A); // and A is
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while server.datagrams() < 3 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(server.datagrams(), 3, "A's datagrams from a node reach p2");
}

/// Packets pod `pod` has received on its eth0.
fn received(node: &LoaderNode, pod: &str) -> u64 {
    node.pod(pod).ns.link_packets("eth0").expect("eth0 counters").0
}

/// Waits until pod `pod` has received at least `count` packets, at most 10 s.
async fn wait_received(node: &LoaderNode, pod: &str, count: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while received(node, pod) < count && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(received(node, pod) >= count, "{pod} received {count} packets");
}

#[tokio::test]
async fn kill_9_of_either_loader_loses_no_packet_across_the_tunnel_and_the_restart_adopts_it() {
    let underlay = Underlay::new().unwrap();
    let (mut n1, mut n2) = two_nodes(&underlay, "vxlan").await;
    let tunnel = n1.node.ns.ifindex("rivet_vxlan").unwrap();
    let dst = n2.pod("p2").ipv4().unwrap();
    // Batches of 2000 pings at up to 5 per millisecond, back to back, while
    // each loader dies and restarts: every batch must come back whole.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pinger = {
        let ns_path = n1.pod("p1").ns.name().to_owned();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let ns = rivet_common::testing::netns::NetNs::existing(&ns_path).unwrap();
            let mut batches = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let out = ns
                    .command("ping")
                    .args(["-n", "-q", "-i", "0.0002", "-W", "1", "-c", "2000", &dst.to_string()])
                    .output()
                    .unwrap();
                batches.push(String::from_utf8_lossy(&out.stdout).into_owned());
            }
            batches
        })
    };
    let before = received(&n2, "p2");
    wait_received(&n2, "p2", before + 1000).await;
    for index in [1, 2] {
        let node = if index == 1 { &mut n1 } else { &mut n2 };
        node.loader.kill9();
        // The datapath keeps forwarding with the loader dead.
        let at_kill = received(&n2, "p2");
        wait_received(&n2, "p2", at_kill + 1000).await;
        let node = if index == 1 { &mut n1 } else { &mut n2 };
        node.loader.restart().await.expect("the loader restarts on its pins");
        let restarted = received(&n2, "p2");
        wait_received(&n2, "p2", restarted + 1000).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let batches = pinger.join().unwrap();
    assert!(batches.len() >= 2, "{batches:?}");
    for text in &batches {
        assert!(
            text.contains("2000 packets transmitted, 2000 received"),
            "no ping may be lost while a loader is down or restarting:\n{text}"
        );
    }
    assert_eq!(
        n1.node.ns.ifindex("rivet_vxlan").unwrap(),
        tunnel,
        "adopted, not recreated"
    );
    assert_eq!(n1.rivet_routes().len(), 2);
    assert_eq!(
        overlay_programs(&n1).await,
        [("from_overlay".to_owned(), 1), ("to_overlay".to_owned(), 1)],
        "the restarted loader's overlay programs run on rivet_vxlan"
    );
}

#[tokio::test]
async fn a_pod_spoofing_its_source_is_dropped_by_its_own_node_before_the_tunnel() {
    let underlay = Underlay::new().unwrap();
    let (n1, n2) = two_nodes(&underlay, "vxlan").await;
    let p1 = n1.pod("p1");
    // Another pod's address (p2's neighbour on node 2) as p1's second address.
    p1.ns.ip(&["addr", "add", "198.18.2.77/32", "dev", "eth0"]).unwrap();
    let dst = n2.pod("p2").ipv4().unwrap();
    let sent_before = n1.node.ns.link_packets("rivet_vxlan").unwrap().1;
    assert_eq!(pings_from(&p1.ns, Some("198.18.2.77".parse().unwrap()), dst), 0);
    assert!(
        n1.drops_reaching(pb::DropReason::InvalidSourceAddress, 3, Duration::from_secs(5))
            .await
            >= 3
    );
    assert_eq!(
        n1.node.ns.link_packets("rivet_vxlan").unwrap().1,
        sent_before,
        "nothing spoofed entered the tunnel"
    );
    assert_eq!(pings(&n1, "p1", dst), 3, "p1's own address still passes");
}

#[tokio::test]
async fn native_receive_judges_a_remote_pod_by_its_ipcache_identity() {
    let underlay = Underlay::new().unwrap();
    let (n1, n2) = two_nodes(&underlay, "native").await;
    // p2 lets A in: node 2's ipcache says p1's addresses are A.
    p1_reaches_p2(&n1, &n2, "native");
    // The sending node publishes p1 as C now: node 2 refuses it.
    let denied = n2.drops(pb::DropReason::PolicyDefaultDeny).await;
    let tunnel = Some(Underlay::ipv4(1));
    upsert_ipcache(
        &n2,
        addrs(&n1, "p1")
            .into_iter()
            .map(|a| ipcache_entry(a, C, tunnel))
            .collect(),
    )
    .await;
    for dst in addrs(&n2, "p2") {
        assert_eq!(pings(&n1, "p1", dst), 0, "p1 as C → {dst}");
    }
    assert!(
        n2.drops_reaching(pb::DropReason::PolicyDefaultDeny, denied + 6, Duration::from_secs(5))
            .await
            >= denied + 6
    );
}

/// Polls `ip route show proto 77` in `node` until it has `count` lines
/// (the loader's resync is what changes it), for at most 10 s.
async fn wait_routes(node: &LoaderNode, count: usize, what: &str) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let routes = node.rivet_routes();
        if routes.len() == count {
            return routes;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: {count} routes of proto 77 within 10 s, have {routes:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls until p1 on `n1` gets an echo reply from `dst` (after a link comes
/// up: IPv6 duplicate address detection and neighbour discovery first).
fn wait_ping(n1: &LoaderNode, dst: IpAddr) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while n1
        .pod("p1")
        .ping(dst, 1, Duration::from_millis(50), Duration::from_secs(1))
        .expect("ping runs")
        .received
        == 0
    {
        assert!(std::time::Instant::now() < deadline, "p1 → {dst} within 10 s");
    }
}

#[tokio::test]
async fn native_routes_taken_by_the_underlay_going_down_or_deleted_come_back() {
    let underlay = Underlay::new().unwrap();
    // A long backstop: the rtnetlink notifications are what must bring them.
    let args = [&mode_args("native")[..], &["--route-resync-seconds", "3600"]].concat();
    let n1 = LoaderNode::start_on_underlay(BIN.as_ref(), &underlay, 1, &["p1"], &args)
        .await
        .expect("node 1 starts");
    n1.client()
        .await
        .apply_endpoint(n1.endpoint("p1", 1, A, open()))
        .await
        .expect("the endpoint applies");
    let n2 = node(&underlay, 2, "native", B, open()).await;
    replace(&n1, vec![peer(2)]).await;
    replace(&n2, vec![peer(1)]).await;
    let before = n1.rivet_routes();
    assert_eq!(before.len(), 2, "{before:?}");
    p1_reaches_p2(&n1, &n2, "native");

    // The partition: the kernel removes the routes with the link (IPv6
    // addresses kept, as in svc-health's partition test).
    let ns = &n1.node.ns;
    ns.sysctl("net.ipv6.conf.ul0.keep_addr_on_down", "1").unwrap();
    ns.ip(&["link", "set", UNDERLAY_IFNAME, "down"]).unwrap();
    wait_routes(&n1, 0, "underlay down").await;
    ns.ip(&["link", "set", UNDERLAY_IFNAME, "up"]).unwrap();
    assert_eq!(wait_routes(&n1, 2, "underlay up again").await, before);
    for dst in addrs(&n2, "p2") {
        wait_ping(&n1, dst);
    }
    p1_reaches_p2(&n1, &n2, "native, after the partition");

    // Someone deletes one of ours.
    ns.ip(&["route", "del", "198.18.2.0/24", "proto", "77"]).unwrap();
    assert_eq!(wait_routes(&n1, 2, "after ip route del").await, before);
    let listed = list_nodes(&n1).await;
    assert_eq!((listed.routes, listed.nodes.len()), (2, 1));
}

#[tokio::test]
async fn vxlan_routes_come_back_when_the_tunnel_device_goes_down_and_up() {
    let underlay = Underlay::new().unwrap();
    let n1 = node(&underlay, 1, "vxlan", A, open()).await;
    replace(&n1, vec![peer(2)]).await;
    let before = n1.rivet_routes();
    assert_eq!(before.len(), 2, "{before:?}");
    let ns = &n1.node.ns;
    ns.ip(&["link", "set", "rivet_vxlan", "down"]).unwrap();
    wait_routes(&n1, 0, "rivet_vxlan down").await;
    ns.ip(&["link", "set", "rivet_vxlan", "up"]).unwrap();
    assert_eq!(wait_routes(&n1, 2, "rivet_vxlan up again").await, before);
}

/// A ClusterIP on node 1 whose backend, p2, is on node 2: TCP and UDP from
/// p1 reach it, and the replies, back through the stack (native) or the
/// tunnel (vxlan), come from the VIP (reverse NAT on node 1's to_container
/// or from_overlay). IPv4 and IPv6.
async fn cluster_ip_to_a_backend_on_another_node(mode: &str) {
    use rivet_testkit::service::{NameServer, ask_name, ask_name_udp};
    let underlay = Underlay::new().unwrap();
    let (n1, n2) = two_nodes(&underlay, mode).await;
    let p2 = n2.pod("p2");
    let targets: Vec<SocketAddr> = addrs(&n2, "p2").into_iter().map(|a| SocketAddr::new(a, 8080)).collect();
    let _server = NameServer::start(&p2.ns, "p2", &targets).expect("p2 serves its name");
    let vips: [IpAddr; 2] = ["198.19.128.90".parse().unwrap(), "2001:2:0:ff::90".parse().unwrap()];
    let mut lb = n1.lb_client().await;
    for (i, (vip, target)) in vips.into_iter().zip(&targets).enumerate() {
        assert_eq!(vip.is_ipv4(), target.is_ipv4());
        for (protocol, id) in [(pb::Protocol::Tcp, 90 + i as u32), (pb::Protocol::Udp, 190 + i as u32)] {
            let backend = [(*target, pb::BackendState::Active)];
            let service = cluster_ip_service(id, SocketAddr::new(vip, 80), protocol, &backend);
            lb.upsert_service(pb::UpsertServiceRequest { service: Some(service) })
                .await
                .expect("node 1's loader takes the service");
        }
        let service = SocketAddr::new(vip, 80);
        let p1 = &n1.pod("p1").ns;
        // ask_name checks the socket's peer is the VIP.
        assert_eq!(
            ask_name(p1, service, Duration::from_secs(3)).unwrap_or_else(|e| panic!("{mode}: TCP to {service}: {e}")),
            "p2"
        );
        assert_eq!(
            ask_name_udp(p1, service, Duration::from_secs(3))
                .unwrap_or_else(|e| panic!("{mode}: UDP to {service}: {e}")),
            "p2"
        );
    }
}

#[tokio::test]
async fn cluster_ip_to_a_backend_on_another_node_native() {
    cluster_ip_to_a_backend_on_another_node("native").await;
}

#[tokio::test]
async fn cluster_ip_to_a_backend_on_another_node_vxlan() {
    cluster_ip_to_a_backend_on_another_node("vxlan").await;
}
