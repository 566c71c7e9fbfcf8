//! Two nodes on an underlay, each with its own svc-loader in native or
//! vxlan mode: routes to peers (NodeRoutingService), pod traffic across
//! nodes, and what the loader refuses.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rivet_proto::loader::v1 as pb;
use rivet_proto::net::{IpPrefix, address_bytes};
use rivet_testkit::loader::{LoaderNode, UNDERLAY_IFNAME, Underlay, policy};
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

/// `ip route show proto 77` of both families in the node, one line each.
fn rivet_routes(node: &LoaderNode) -> Vec<String> {
    ["-4", "-6"]
        .iter()
        .flat_map(|family| {
            node.node
                .ns
                .ip(&[family, "route", "show", "proto", "77"])
                .expect("ip route runs")
                .lines()
                .map(|l| l.trim().to_owned())
                .collect::<Vec<_>>()
        })
        .collect()
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
        rivet_routes(&n1),
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

    for dst in addrs(&n2, "p2") {
        assert_eq!(pings(&n1, "p1", dst), 3, "p1 → {dst} across nodes (native)");
    }
    let server = n2.pod("p2").tcp_server(8080).unwrap();
    for dst in addrs(&n2, "p2") {
        assert!(
            n1.pod("p1")
                .tcp_echo(SocketAddr::new(dst, server.port()), Duration::from_secs(3))
                .unwrap(),
            "TCP p1 → {dst}"
        );
    }

    let listed = n1
        .routing_client()
        .await
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.routing_mode, pb::RoutingMode::Native as i32);
    assert_eq!(listed.underlay_interface, UNDERLAY_IFNAME);
    assert_eq!((listed.routes, listed.nodes.len()), (2, 1));
    assert_eq!(listed.nodes[0].name, "node-2");

    // The peer leaves: exactly its routes go.
    let gone = replace(&n1, Vec::new()).await;
    assert_eq!((gone.routes_added, gone.routes_removed), (0, 2));
    assert!(rivet_routes(&n1).is_empty(), "{:?}", rivet_routes(&n1));
    let others = n1.node.ns.ip(&["route", "show", "198.18.99.0/24"]).unwrap();
    assert!(others.contains("via 198.19.254.2"), "{others}");
}

#[tokio::test]
async fn bad_replace_nodes_input_is_refused_naming_the_field_and_changes_nothing() {
    let underlay = Underlay::new().unwrap();
    let n1 = node(&underlay, 1, "vxlan", A, open()).await;
    replace(&n1, vec![peer(2)]).await;
    let before = rivet_routes(&n1);
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
    assert_eq!(rivet_routes(&n1), before, "nothing changed");

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
        rivet_routes(&n1),
        [
            "198.18.2.0/24 dev rivet_vxlan scope link",
            "2001:2:0:2::/64 dev rivet_vxlan metric 1024 pref medium"
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
        rivet_routes(&n1).len(),
        2,
        "routes stay until the peers are pushed again"
    );
    let listed = n1
        .routing_client()
        .await
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner();
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
