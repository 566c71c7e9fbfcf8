//! Faults across nodes (issue 16 §6) on a 3-node `rivet cluster up`, one
//! cluster per routing mode shared by the cases (each makes its own pods in
//! its own namespace, so they do not interfere):
//!
//! - a pod on node A sending from an address that is not its own (another
//!   node's pod's) is dropped by node A with `invalid-source-address`;
//!   node B's pod never receives it (IPv4 and IPv6);
//! - VXLAN: a packet whose VNI claims an identity node B's policy allows,
//!   with that identity's inner source address, sent from an underlay
//!   address that is no node's (a rogue namespace on the underlay bridge
//!   with a kernel VXLAN device) is dropped by node B with
//!   `tunnel-source-not-node`, and never reaches the pod; the real pod of
//!   that identity gets through;
//! - kill -9 of every daemon of node A in turn while a pod on A and a pod
//!   on B flood-ping each other (IPv4 one way, IPv6 the other): 0 lost,
//!   each daemon running again before the next;
//! - VXLAN path MTU: pods get underlay MTU − 50; pods whose MTU says 1500
//!   get ICMP "fragmentation needed" / ICMPv6 "packet too big" with MTU 1450
//!   for a 1500-byte DF packet to another node, a 1450-byte one passes, and
//!   TCP writes of 1500-byte payloads come back through PMTU discovery.
//!
//! Needs root, a bpffs, etcd 3.6 (`cargo xtask install`) and the workspace
//! binaries (`cargo build --bins`).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use rivet_common::testing::netns::{NetNs, veth_pair};
use rivet_testkit::cluster::{Cluster, ClusterOptions, ClusterPod, Routing};
use rivet_testkit::monitor::NodeDrops;
use rivet_testkit::traffic::Pinger;

/// How long a datagram that passes may take to arrive (a loaded machine).
const ARRIVES_WITHIN: Duration = Duration::from_secs(5);
/// How long a datagram that must not arrive is waited for.
const NOT_SEEN_WITHIN: Duration = Duration::from_secs(1);
/// How long a flood ping may take to complete a run (a restart under way).
const PING_RUN_WITHIN: Duration = Duration::from_secs(30);
/// The rogue namespace's underlay address: on the underlay subnet, no node's.
const ROGUE_UNDERLAY: Ipv4Addr = Ipv4Addr::new(198, 19, 254, 200);
/// Pod MTU in VXLAN mode: the underlay's 1500 − 50.
const VXLAN_POD_MTU: u32 = 1450;

/// `rivet monitor -o json` of node `node`, its drops collected.
fn node_drops(cluster: &Cluster, node: usize) -> NodeDrops {
    NodeDrops::start(cluster.node(node).rivet(&["monitor", "-o", "json"]))
}

/// What `socket` receives within `within`, datagram by datagram.
fn received(socket: &UdpSocket, within: Duration) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = [0u8; 2048];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return got;
        }
        socket.set_read_timeout(Some(left)).unwrap();
        match socket.recv(&mut buf) {
            Ok(n) => got.push(buf[..n].to_vec()),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return got;
            }
            Err(e) => panic!("receiving: {e}"),
        }
    }
}

/// `ip <args>` in `ns`, or a panic naming it.
fn ip(ns: &NetNs, args: &[&str]) -> String {
    ns.ip(args)
        .unwrap_or_else(|e| panic!("ip {} in {}: {e}", args.join(" "), ns.name()))
}

/// `ping <args>` in `ns` (C locale); its stdout and stderr.
fn ping(ns: &NetNs, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns.name(), "ping"])
        .args(args)
        .env("LC_ALL", "C")
        .output()
        .expect("running ping");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// A pod on node 1 sends from another node's pod's address to a pod on
/// node 2: node 1 drops it (`invalid-source-address`), node 2's pod never
/// gets it; from its own address it gets through, before and after.
async fn spoofed_source_is_dropped_by_the_sending_node(cluster: &mut Cluster) {
    let sender = cluster.add_pod(1, "spoof", "sender", &["app=sender"]).await;
    let receiver = cluster.add_pod(2, "spoof", "receiver", &["app=receiver"]).await;
    let victim = cluster.add_pod(3, "spoof", "victim", &["app=victim"]).await;
    cluster.wait_converged().await;
    let drops_a = node_drops(cluster, 1);
    let drops_b = node_drops(cluster, 2);
    for (own, spoofed, to, prefix_len) in [
        (
            IpAddr::from(sender.ipv4),
            IpAddr::from(victim.ipv4),
            IpAddr::from(receiver.ipv4),
            "32",
        ),
        (sender.ipv6.into(), victim.ipv6.into(), receiver.ipv6.into(), "128"),
    ] {
        let to = SocketAddr::new(to, 7000);
        let inbox = receiver.netns.udp_socket(to).expect("a UDP socket in the receiver");
        let real = sender
            .netns
            .udp_socket(SocketAddr::new(own, 7001))
            .expect("a UDP socket on the sender's address");
        real.send_to(b"real-before", to).unwrap();
        assert_eq!(
            received(&inbox, ARRIVES_WITHIN).first().map(Vec::as_slice),
            Some(&b"real-before"[..]),
            "{own} -> {to} from the sender's own address arrives"
        );
        // The victim's address on the sender's interface: the kernel sends from it.
        let address = format!("{spoofed}/{prefix_len}");
        let mut add = vec!["addr", "add", &address, "dev", "eth0"];
        if spoofed.is_ipv6() {
            add.push("nodad");
        }
        ip(&sender.netns, &add);
        let forged = sender
            .netns
            .udp_socket(SocketAddr::new(spoofed, 7002))
            .expect("a UDP socket on the spoofed address");
        for _ in 0..3 {
            forged.send_to(b"spoofed", to).unwrap();
        }
        drops_a.wait_for("the sending node", "invalid-source-address", spoofed, to);
        real.send_to(b"real-after", to).unwrap();
        let got = received(&inbox, ARRIVES_WITHIN.min(NOT_SEEN_WITHIN * 3));
        assert_eq!(
            got,
            vec![b"real-after".to_vec()],
            "only the real datagram reaches the receiver, none from {spoofed}"
        );
        assert!(
            drops_b.of(spoofed, to).is_empty(),
            "node 2 never sees the spoofed packets: {:?}",
            drops_b.of(spoofed, to)
        );
        ip(&sender.netns, &["addr", "del", &address, "dev", "eth0"]);
    }
    for pod in [sender, receiver, victim] {
        cluster.delete_pod(pod).await;
    }
}

/// Node 2's policy lets only `app=client` pods reach the server; a rogue
/// namespace on the underlay bridge sends VXLAN with the client's identity
/// in the VNI and the client's address as inner source: node 2 drops it
/// (`tunnel-source-not-node`), the server never sees it.
async fn forged_vni_from_a_non_node_is_dropped_by_the_receiving_node(cluster: &mut Cluster) {
    let client = cluster.add_pod(1, "vni", "client", &["app=client"]).await;
    let other = cluster.add_pod(1, "vni", "other", &["app=other"]).await;
    let server = cluster.add_pod(2, "vni", "server", &["app=server"]).await;
    cluster.wait_converged().await;
    cluster
        .apply_policy(
            "
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: server-from-client, namespace: vni}
spec:
  podSelector: {matchLabels: {app: server}}
  ingress: [{from: [{podSelector: {matchLabels: {app: client}}}]}]
",
        )
        .await;
    let identity = cluster.node(1).json(&["endpoint", "get", "vni/client"])["identity"]
        .as_u64()
        .expect("the client's endpoint has an identity");
    let other_identity = cluster.node(1).json(&["endpoint", "get", "vni/other"])["identity"].clone();
    assert_ne!(Some(identity), other_identity.as_u64(), "client and other differ");
    let _echo = server
        .netns
        .udp_echo_server(&[server.socket_v4(7000), server.socket_v6(7000)])
        .expect("a UDP echo server in the server pod");
    // The policy holds over the real tunnel: the client in, the other pod out.
    for dst in [server.socket_v4(7000), server.socket_v6(7000)] {
        assert!(
            client.netns.udp_echo(dst, ARRIVES_WITHIN).unwrap(),
            "the client reaches {dst}"
        );
        assert!(
            !other.netns.udp_echo(dst, NOT_SEEN_WITHIN).unwrap(),
            "the other pod does not reach {dst}"
        );
    }

    let drops_b = node_drops(cluster, 2);
    let rogue = NetNs::new("rvtrogue").expect("the rogue namespace");
    let underlay = NetNs::existing(&cluster.record().plan.underlay_netns).expect("the underlay namespace");
    let port = format!("rg{:x}", std::process::id());
    veth_pair(&underlay, &port, &rogue, "ul0").expect("a veth from the underlay bridge to the rogue");
    ip(&underlay, &["link", "set", &port, "master", "ul"]);
    ip(&rogue, &["addr", "add", &format!("{ROGUE_UNDERLAY}/24"), "dev", "ul0"]);
    let node_b = cluster.node(2);
    let vni = identity.to_string();
    let remote = node_b.underlay_v4.to_string();
    ip(
        &rogue,
        &[
            "link",
            "add",
            "vx0",
            "type",
            "vxlan",
            "id",
            &vni,
            "remote",
            &remote,
            "local",
            "198.19.254.200",
            "dstport",
            "8472",
            "dev",
            "ul0",
        ],
    );
    ip(&rogue, &["link", "set", "vx0", "up"]);
    let node_b_vxlan_mac = node_b.netns.mac("rivet_vxlan").expect("node 2's rivet_vxlan device");
    let mac = node_b_vxlan_mac
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    for (source, dst, len) in [
        (IpAddr::from(client.ipv4), server.socket_v4(7000), "32"),
        (client.ipv6.into(), server.socket_v6(7000), "128"),
    ] {
        let mut add = vec!["addr", "add"];
        let own = format!("{source}/{len}");
        add.extend([own.as_str(), "dev", "vx0"]);
        if source.is_ipv6() {
            add.push("nodad");
        }
        ip(&rogue, &add);
        let target = format!("{}/{len}", dst.ip());
        let src = source.to_string();
        ip(&rogue, &["route", "add", &target, "dev", "vx0", "src", &src]);
        let to = dst.ip().to_string();
        ip(
            &rogue,
            &["neigh", "add", &to, "lladdr", &mac, "dev", "vx0", "nud", "permanent"],
        );
        let forged = rogue
            .udp_socket(SocketAddr::new(source, 7003))
            .expect("a UDP socket on the client's address in the rogue");
        for _ in 0..3 {
            forged.send_to(b"forged", dst).unwrap();
        }
        drops_b.wait_for("the receiving node", "tunnel-source-not-node", source, dst);
        assert!(
            received(&forged, NOT_SEEN_WITHIN).is_empty(),
            "the server echoed nothing to the forged {source} -> {dst}"
        );
        // The real client still gets through.
        assert!(
            client.netns.udp_echo(dst, ARRIVES_WITHIN).unwrap(),
            "the client reaches {dst}"
        );
    }
    drop(rogue);
    cluster.delete_policy("vni/server-from-client").await;
    for pod in [client, other, server] {
        cluster.delete_pod(pod).await;
    }
}

/// kill -9 of each daemon of node 1 while a pod there and a pod on node 2
/// flood-ping each other (IPv4 one way, IPv6 the other), a fresh pair of
/// pingers per daemon so a loss names its daemon: not one echo lost.
async fn kill9_of_each_daemon_of_a_node_under_traffic_loses_nothing(cluster: &mut Cluster) {
    let a = cluster.add_pod(1, "flow", "a", &["app=a"]).await;
    let b = cluster.add_pod(2, "flow", "b", &["app=b"]).await;
    cluster.wait_converged().await;
    let daemons: Vec<String> = cluster
        .node(1)
        .record()
        .expect("node 1 runs")
        .daemons
        .iter()
        .map(|d| d.name.clone())
        .collect();
    assert!(
        ["svc-ipam", "svc-identity", "svc-loader", "svc-endpoint", "svc-gc"]
            .iter()
            .all(|d| daemons.iter().any(|n| n == d)),
        "node 1 runs every node daemon: {daemons:?}"
    );
    // What the datapaths drop of the two pods' traffic, to name a loss's cause.
    let pod_addrs = [a.addrs(), b.addrs()].concat();
    let mut monitors = vec![(1, node_drops(cluster, 1)), (2, node_drops(cluster, 2))];
    let mut report = Vec::new();
    let mut lost = false;
    for daemon in &daemons {
        let flows = [
            ("a -> b IPv4", Pinger::start(a.netns.name(), b.ipv4.into())),
            ("b -> a IPv6", Pinger::start(b.netns.name(), a.ipv6.into())),
        ];
        for (_, pinger) in &flows {
            tokio::task::block_in_place(|| pinger.wait_runs(1, PING_RUN_WITHIN));
        }
        cluster.kill9(1, daemon).await;
        // The restarted daemon resynced: the peers and pods are where they were.
        cluster.wait_converged().await;
        // Traffic covers the restart and the resync: a whole run each way after them.
        for (_, pinger) in &flows {
            tokio::task::block_in_place(|| pinger.wait_runs(1, PING_RUN_WITHIN));
        }
        for (what, pinger) in flows {
            let totals = pinger.stop();
            lost |= totals.lost() > 0;
            report.push(format!("kill -9 of {daemon} of node 1, {what}: {totals:?}"));
        }
        if daemon == "svc-loader" {
            // Its restart ended node 1's monitor stream.
            monitors.push((1, node_drops(cluster, 1)));
        }
    }
    for (node, monitor) in &monitors {
        report.push(format!(
            "drops of their traffic on node {node}: {:?}",
            monitor.involving(&pod_addrs)
        ));
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        !lost,
        "no echo lost across kill -9 of each daemon of node 1:\n{}",
        report.join("\n")
    );
    for pod in [a, b] {
        cluster.delete_pod(pod).await;
    }
}

/// The MTU of `ifname` in `ns`.
fn mtu(ns: &NetNs, ifname: &str) -> u32 {
    let out = ip(ns, &["-j", "link", "show", ifname]);
    let links: serde_json::Value = serde_json::from_str(&out).expect("ip -j prints JSON");
    links[0]["mtu"].as_u64().expect("a link with an MTU") as u32
}

/// Sets `pod`'s eth0 and its node-side peer to MTU 1500: a pod that does
/// not know about the tunnel.
fn raise_mtu(cluster: &Cluster, pod: &ClusterPod) {
    let out = ip(&pod.netns, &["-j", "link", "show", "eth0"]);
    let links: serde_json::Value = serde_json::from_str(&out).expect("ip -j prints JSON");
    let peer = links[0]["link_index"].as_u64().expect("eth0 is a veth with a peer");
    let node = cluster.node(pod.node);
    let all: serde_json::Value = serde_json::from_str(&node.ip(&["-j", "link", "show"])).unwrap();
    let host_side = all
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["ifindex"].as_u64() == Some(peer))
        .and_then(|l| l["ifname"].as_str())
        .unwrap_or_else(|| panic!("node {} has eth0's peer (ifindex {peer}): {all}", node.name))
        .to_string();
    node.ip(&["link", "set", &host_side, "mtu", "1500"]);
    ip(&pod.netns, &["link", "set", "eth0", "mtu", "1500"]);
}

/// VXLAN: pod MTU 1450; a 1500-byte DF packet to another node gets "too
/// big" with MTU 1450, a 1450-byte one passes; TCP with 1500-MTU pods works
/// through PMTU discovery.
async fn path_mtu_over_the_tunnel(cluster: &mut Cluster) {
    let near = cluster.add_pod(1, "mtu", "near", &["app=near"]).await;
    let far = cluster.add_pod(2, "mtu", "far", &["app=far"]).await;
    cluster.wait_converged().await;
    assert_eq!(
        mtu(&near.netns, "eth0"),
        VXLAN_POD_MTU,
        "a pod's MTU leaves room for VXLAN"
    );
    raise_mtu(cluster, &near);
    raise_mtu(cluster, &far);
    let _echo = far
        .netns
        .tcp_echo_server(&[far.socket_v4(8080), far.socket_v6(8080)])
        .expect("a TCP echo server in the far pod");
    for (family, dst, header) in [("-4", IpAddr::from(far.ipv4), 28), ("-6", far.ipv6.into(), 48)] {
        let to = dst.to_string();
        let fits = (VXLAN_POD_MTU - header).to_string();
        let (ok, out) = ping(
            &near.netns,
            &[family, "-M", "do", "-c", "1", "-W", "3", "-s", &fits, &to],
        );
        assert!(ok, "a {VXLAN_POD_MTU}-byte DF ping to {to} passes: {out}");
        let too_big = (1500 - header).to_string();
        let (ok, out) = ping(
            &near.netns,
            &[family, "-M", "do", "-c", "1", "-W", "3", "-s", &too_big, &to],
        );
        // The ICMP itself ("Frag needed and DF set (mtu = 1450)", "Packet
        // too big: mtu=1450"), or the path MTU the kernel learned from it.
        let told = ["mtu = 1450", "mtu=1450", "mtu: 1450"].iter().any(|m| out.contains(m));
        assert!(
            !ok && told,
            "a 1500-byte DF ping to {to} gets ICMP too big with MTU {VXLAN_POD_MTU}: {out}"
        );
        // TCP: 1500-byte payloads, MSS from the 1500 MTU, PMTU brings it down.
        let dst = SocketAddr::new(dst, 8080);
        let mut stream = near
            .netns
            .tcp_stream(dst, ARRIVES_WITHIN)
            .unwrap_or_else(|e| panic!("connecting to {dst}: {e}"));
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let payload: Vec<u8> = (0..1500u32 * 20).map(|i| (i % 251) as u8).collect();
        for chunk in payload.chunks(1500) {
            stream.write_all(chunk).unwrap();
        }
        let mut back = vec![0u8; payload.len()];
        stream
            .read_exact(&mut back)
            .unwrap_or_else(|e| panic!("reading the echo of {} bytes from {dst}: {e}", payload.len()));
        assert!(back == payload, "the echo of {dst} is what was sent");
    }
    for pod in [near, far] {
        cluster.delete_pod(pod).await;
    }
}

async fn start(routing: Routing) -> Cluster {
    let cluster = Cluster::start(ClusterOptions {
        routing,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("rivet cluster up ({routing:?}): {e}"));
    cluster.wait_converged().await;
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_across_nodes_with_native_routing() {
    let mut cluster = start(Routing::Native).await;
    spoofed_source_is_dropped_by_the_sending_node(&mut cluster).await;
    eprintln!("native: spoofed sources dropped by the sending node");
    kill9_of_each_daemon_of_a_node_under_traffic_loses_nothing(&mut cluster).await;
    eprintln!("native: kill -9 of each daemon under traffic, nothing lost");
    cluster.down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_across_nodes_with_vxlan() {
    let mut cluster = start(Routing::Vxlan).await;
    spoofed_source_is_dropped_by_the_sending_node(&mut cluster).await;
    eprintln!("vxlan: spoofed sources dropped by the sending node");
    forged_vni_from_a_non_node_is_dropped_by_the_receiving_node(&mut cluster).await;
    eprintln!("vxlan: a forged VNI from a non-node dropped by the receiving node");
    path_mtu_over_the_tunnel(&mut cluster).await;
    eprintln!("vxlan: path MTU over the tunnel");
    kill9_of_each_daemon_of_a_node_under_traffic_loses_nothing(&mut cluster).await;
    eprintln!("vxlan: kill -9 of each daemon under traffic, nothing lost");
    cluster.down().await;
}
