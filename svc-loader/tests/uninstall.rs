//! What a stopping loader leaves (`svc_loader::uninstall`, README
//! "Uninstall"): SIGTERM on a node no pod uses removes every filter of the
//! node, the routes to peers, the tunnel device and the pins; on a node
//! with a pod it removes nothing. Both routing modes; the underlay runs the
//! NodePort programs in both.

use std::net::IpAddr;
use std::time::Duration;

use rivet_proto::loader::v1 as pb;
use rivet_proto::net::{IpPrefix, address_bytes};
use rivet_testkit::loader::{LoaderNode, UNDERLAY_IFNAME, Underlay, policy};

const BIN: &str = env!("CARGO_BIN_EXE_svc-loader");

fn mode_args(mode: &str) -> [&str; 4] {
    ["--routing-mode", mode, "--underlay-interface", UNDERLAY_IFNAME]
}

fn cidr(net: &str) -> IpPrefix {
    let net: ipnet::IpNet = net.parse().unwrap();
    IpPrefix {
        address: address_bytes(net.network()),
        prefix_length: u32::from(net.prefix_len()),
    }
}

/// Node 2 as a peer, so the loader holds routes.
fn peer() -> pb::PeerNode {
    pb::PeerNode {
        name: "node-2".into(),
        underlay_ipv4: address_bytes(IpAddr::V4(Underlay::ipv4(2))),
        underlay_ipv6: address_bytes(IpAddr::V6(Underlay::ipv6(2))),
        pod_cidrs: vec![cidr("198.18.2.0/24"), cidr("2001:2:0:2::/64")],
    }
}

async fn start(underlay: &Underlay, mode: &str, pods: &[&str]) -> LoaderNode {
    let node = LoaderNode::start_on_underlay(BIN.as_ref(), underlay, 1, pods, &mode_args(mode))
        .await
        .expect("a test node on the underlay with svc-loader starts");
    for (i, pod) in pods.iter().enumerate() {
        let request = node.endpoint(pod, i as u32 + 1, 1001, policy(1, false, false, Vec::new()));
        node.client()
            .await
            .apply_endpoint(request)
            .await
            .expect("the endpoint applies");
    }
    node.routing_client()
        .await
        .replace_nodes(pb::ReplaceNodesRequest { nodes: vec![peer()] })
        .await
        .expect("ReplaceNodes succeeds");
    node
}

/// Every tc filter named `rivet-…` in the node, as `<dev> <hook>: <line>`.
fn rivet_filters(node: &LoaderNode) -> Vec<String> {
    let links = node.node.ns.ip(&["-o", "link", "show"]).expect("ip link runs");
    let mut found = Vec::new();
    for line in links.lines() {
        // "3: ul0@if4: <...>": the name before any '@'.
        let Some(name) = line.split(": ").nth(1).map(|n| n.split('@').next().unwrap_or(n)) else {
            continue;
        };
        for hook in ["ingress", "egress"] {
            let filters = node
                .node
                .ns
                .run(&["tc", "filter", "show", "dev", name, hook])
                .unwrap_or_default();
            found.extend(
                filters
                    .lines()
                    .filter(|l| l.contains("rivet-"))
                    .map(|l| format!("{name} {hook}: {}", l.trim())),
            );
        }
    }
    found
}

fn has_tunnel(node: &LoaderNode) -> bool {
    node.node.ns.has_link("rivet_vxlan").expect("ip link runs")
}

#[tokio::test]
async fn sigterm_on_a_node_no_pod_uses_removes_its_filters_routes_tunnel_and_pins() {
    for mode in ["vxlan", "native"] {
        let underlay = Underlay::new().unwrap();
        let mut node = start(&underlay, mode, &[]).await;
        assert!(node.pins.0.join("endpoints").exists(), "{mode}: pinned before");
        assert!(
            !rivet_filters(&node).is_empty(),
            "{mode}: NodePort filters on ul0 before"
        );
        assert_eq!(node.rivet_routes().len(), 2, "{mode}: routes to the peer before");
        assert_eq!(has_tunnel(&node), mode == "vxlan", "{mode}: the tunnel device before");

        let status = node.loader.terminate().await.expect("SIGTERM stops the loader");
        let log = node.loader.log();
        assert!(status.success(), "{mode}: a clean exit ({status}); log:\n{log}");
        assert!(
            log.contains("no pod uses the datapath: removed it from the node"),
            "{mode}: the uninstall is logged:\n{log}"
        );
        assert!(
            !node.pins.0.exists(),
            "{mode}: the pin dir {} is gone",
            node.pins.0.display()
        );
        assert_eq!(
            rivet_filters(&node),
            Vec::<String>::new(),
            "{mode}: no filter of ours left"
        );
        assert_eq!(
            node.rivet_routes(),
            Vec::<String>::new(),
            "{mode}: no route of ours left"
        );
        assert!(!has_tunnel(&node), "{mode}: no tunnel device left");
        assert!(!node.loader.socket().exists(), "{mode}: no socket left");
    }
}

#[tokio::test]
async fn sigterm_on_a_node_with_a_pod_keeps_the_datapath() {
    let underlay = Underlay::new().unwrap();
    let mut node = start(&underlay, "vxlan", &["p1", "p2"]).await;
    let filters = rivet_filters(&node);
    let pod_veth = node.pod("p1").host_ifname.clone();
    assert!(
        filters.iter().any(|f| f.starts_with(&format!("{pod_veth} "))),
        "the pod's veth runs the datapath: {filters:?}"
    );

    let status = node.loader.terminate().await.expect("SIGTERM stops the loader");
    let log = node.loader.log();
    assert!(status.success(), "a clean exit ({status}); log:\n{log}");
    assert!(
        log.contains("pods still use the datapath: kept"),
        "the decision is logged:\n{log}"
    );
    assert!(node.pins.0.join("endpoints").exists(), "the pins stay");
    assert_eq!(rivet_filters(&node), filters, "every filter stays");
    assert_eq!(node.rivet_routes().len(), 2, "the routes stay");
    assert!(has_tunnel(&node), "the tunnel device stays");
    // The pods keep their datapath with no loader running.
    for to in node.pod("p2").addrs() {
        let replies = node
            .pod("p1")
            .ping(to, 3, Duration::from_millis(50), Duration::from_secs(2))
            .expect("ping runs")
            .received;
        assert_eq!(replies, 3, "p1 reaches p2 at {to} after the loader stopped");
    }
}
