//! Policy bypasses of the datapath, closed: raw frames from pods and raw
//! ICMPv6 from a namespace outside the node, each checked through the
//! datapath's drop counters (a drop of the expected reason is the signal).
//!
//! Counters are per node and summed over directions. Where a test shows
//! that some packets pass, it sends them first and a marker that must be
//! dropped after them on the same interface, then checks that the drop
//! count rose by exactly the markers.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::time::{Duration, Instant};

use rivet_common::testing::netns::{NetNs, veth_pair};
use rivet_proto::loader::v1 as pb;
use rivet_testkit::frames::{self, ExtHeader, TCP_SYN, proto};
use rivet_testkit::loader::{LoaderNode, entry, policy};

use pb::{Direction::*, Protocol, Verdict::*};

type Client = rivet_proto::loader::v1::loader_service_client::LoaderServiceClient<rivet_common::grpc::DaemonChannel>;

const BIN: &str = env!("CARGO_BIN_EXE_svc-loader");
const A: u32 = 1001;
const B: u32 = 1002;
/// How long a counter may take to show a drop.
const SIGNAL: Duration = Duration::from_secs(5);

async fn node(pods: &[&str]) -> LoaderNode {
    LoaderNode::start(BIN.as_ref(), pods, &[])
        .await
        .expect("a test node with svc-loader starts")
}

async fn apply(client: &mut Client, request: pb::ApplyEndpointRequest) {
    client.apply_endpoint(request).await.expect("the endpoint is applied");
}

/// Every non-zero drop counter, for failure messages.
async fn drop_list(node: &LoaderNode) -> Vec<(String, String, u64)> {
    let name = |reason| pb::DropReason::try_from(reason).map_or("?", |r| r.as_str_name());
    let direction = |d| pb::Direction::try_from(d).map_or("?", |d| d.as_str_name());
    node.drop_counters()
        .await
        .iter()
        .map(|d| (name(d.reason).to_owned(), direction(d.direction).to_owned(), d.packets))
        .collect()
}

/// Drops of every reason.
async fn all_drops(node: &LoaderNode) -> u64 {
    node.drop_counters().await.iter().map(|d| d.packets).sum()
}

/// Waits until the `reason` counter reaches `target` (or [`SIGNAL`]
/// passes) and returns it.
async fn drops_reaching(node: &LoaderNode, reason: pb::DropReason, target: u64) -> u64 {
    node.drops_reaching(reason, target, SIGNAL).await
}

fn v6(node: &LoaderNode, pod: &str) -> Ipv6Addr {
    match node.pod(pod).ipv6().unwrap() {
        IpAddr::V6(a) => a,
        IpAddr::V4(_) => unreachable!(),
    }
}

fn v4(node: &LoaderNode, pod: &str) -> Ipv4Addr {
    match node.pod(pod).ipv4().unwrap() {
        IpAddr::V4(a) => a,
        IpAddr::V6(_) => unreachable!(),
    }
}

/// Sends `packets` (IPv6) as frames from `pod`'s eth0 to its gateway MAC,
/// or to `dst_mac` when given.
fn send6(node: &LoaderNode, pod: &str, dst_mac: Option<[u8; 6]>, packets: Vec<Vec<u8>>) {
    send(node, pod, dst_mac, frames::ETH_P_IPV6, packets);
}

fn send4(node: &LoaderNode, pod: &str, packets: Vec<Vec<u8>>) {
    send(node, pod, None, frames::ETH_P_IP, packets);
}

fn send(node: &LoaderNode, pod: &str, dst_mac: Option<[u8; 6]>, ethertype: u16, packets: Vec<Vec<u8>>) {
    let p = node.pod(pod);
    let (src, dst) = (p.pod_mac, dst_mac.unwrap_or(p.host_mac));
    let frames: Vec<Vec<u8>> = packets
        .iter()
        .map(|packet| frames::ethernet(dst, src, ethertype, packet))
        .collect();
    p.ns.in_ns(move || frames::send_frames("eth0", &frames))
        .expect("entering the pod")
        .expect("sending raw frames");
}

fn ip6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

// ------------------------------------------------------- from outside the node

/// A namespace outside the node, joined to it by a veth (`up0` in the node)
/// and routed to the pods' prefixes through it: 2001:2:1::2 and 198.18.1.2.
struct Outside {
    ns: NetNs,
}

impl Outside {
    fn new(node: &LoaderNode) -> Self {
        let ns = NetNs::new("rvo").expect("outside namespace");
        let n = &node.node.ns;
        veth_pair(n, "up0", &ns, "eth0").expect("veth node<->outside");
        for (target, args) in [
            (
                n,
                ["-6", "addr", "add", "2001:2:1::1/64", "dev", "up0", "nodad"].as_slice(),
            ),
            (n, ["addr", "add", "198.18.1.1/24", "dev", "up0"].as_slice()),
            (
                &ns,
                ["-6", "addr", "add", "2001:2:1::2/64", "dev", "eth0", "nodad"].as_slice(),
            ),
            (&ns, ["addr", "add", "198.18.1.2/24", "dev", "eth0"].as_slice()),
            (
                &ns,
                ["-6", "route", "add", "2001:2::/64", "via", "2001:2:1::1"].as_slice(),
            ),
            (&ns, ["route", "add", "198.18.0.0/24", "via", "198.18.1.1"].as_slice()),
        ] {
            target.ip(args).expect("addressing the outside link");
        }
        Self { ns }
    }

    /// Sends one ICMPv6 message of `kind` (for echo requests: identifier
    /// `id`, sequence 1) to `dst` with `hop_limit`; with `reply_within`,
    /// whether an echo reply with that identifier came back in time.
    fn icmp6(&self, dst: Ipv6Addr, kind: u8, id: u16, hop_limit: i32, reply_within: Option<Duration>) -> bool {
        self.ns
            .in_ns(move || icmp6_exchange(dst, kind, id, hop_limit, reply_within))
            .expect("entering the outside namespace")
            .expect("raw ICMPv6 socket")
    }
}

fn icmp6_exchange(
    dst: Ipv6Addr,
    kind: u8,
    id: u16,
    hop_limit: i32,
    reply_within: Option<Duration>,
) -> std::io::Result<bool> {
    let last = || std::io::Error::last_os_error();
    // SAFETY: plain socket calls on a socket owned by `fd`, with buffers and
    // option values of the sizes passed.
    unsafe {
        let raw = libc::socket(libc::AF_INET6, libc::SOCK_RAW, libc::IPPROTO_ICMPV6);
        if raw < 0 {
            return Err(last());
        }
        let fd = OwnedFd::from_raw_fd(raw);
        let set = |level, name, value: i32| {
            if libc::setsockopt(
                fd.as_raw_fd(),
                level,
                name,
                std::ptr::from_ref(&value).cast(),
                size_of::<i32>() as u32,
            ) < 0
            {
                return Err(last());
            }
            Ok(())
        };
        set(libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, hop_limit)?;
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        if libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            std::ptr::from_ref(&tv).cast(),
            size_of::<libc::timeval>() as u32,
        ) < 0
        {
            return Err(last());
        }
        // The kernel computes the ICMPv6 checksum of raw ICMPv6 sockets.
        let [i0, i1] = id.to_be_bytes();
        let message = [kind, 0, 0, 0, i0, i1, 0, 1, b'r', b'i', b'v', b'e', b't', 0, 0, 0];
        let mut to: libc::sockaddr_in6 = std::mem::zeroed();
        to.sin6_family = libc::AF_INET6 as u16;
        to.sin6_addr.s6_addr = dst.octets();
        if libc::sendto(
            fd.as_raw_fd(),
            message.as_ptr().cast(),
            message.len(),
            0,
            std::ptr::from_ref(&to).cast(),
            size_of::<libc::sockaddr_in6>() as u32,
        ) < 0
        {
            return Err(last());
        }
        let Some(wait) = reply_within else { return Ok(false) };
        let deadline = Instant::now() + wait;
        let mut buf = [0u8; 1500];
        while Instant::now() < deadline {
            let n = libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0);
            if n >= 8 && buf[0] == 129 && buf[4..6] == id.to_be_bytes() {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// The reproduction: an echo request with identifier 0 from outside
/// the node reached a pod under default-deny ingress (its "ports" parsed as
/// 0, which meant link plumbing). Now every echo and every informational
/// type is ICMP traffic under policy, and so is an ND-typed message that a
/// router forwarded (hop limit below 255, global source).
#[tokio::test]
async fn icmpv6_from_outside_the_node_is_under_ingress_policy_whatever_its_identifier() {
    let node = node(&["a"]).await;
    let outside = Outside::new(&node);
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("a", 1, A, policy(1, true, false, vec![]))).await;
    let pod = v6(&node, "a");
    let deny = pb::DropReason::PolicyDefaultDeny;

    let before = node.drops(deny).await;
    // Identifier 7 first: dropped today as well, so the outside route works.
    assert!(!outside.icmp6(pod, 128, 7, 64, None));
    assert_eq!(
        drops_reaching(&node, deny, before + 1).await,
        before + 1,
        "echo id 7 is dropped"
    );
    assert!(
        !outside.icmp6(pod, 128, 0, 64, Some(Duration::from_millis(500))),
        "an echo request with identifier 0 must not get a reply from a default-deny pod"
    );
    assert_eq!(
        drops_reaching(&node, deny, before + 2).await,
        before + 2,
        "echo id 0 is dropped as policy-default-deny"
    );
    // Node information query (139), an unassigned informational type (200),
    // and a neighbour solicitation forwarded by the node (hop limit 255
    // when sent, 254 when it reaches the pod).
    for (kind, hop_limit) in [(139, 64), (200, 64), (135, 255)] {
        let n = node.drops(deny).await;
        outside.icmp6(pod, kind, 0, hop_limit, None);
        assert_eq!(
            drops_reaching(&node, deny, n + 1).await,
            n + 1,
            "ICMPv6 type {kind} from outside is under policy"
        );
    }

    // An allowed ICMPv6 peer (the outside is `world`) still gets replies.
    apply(
        &mut client,
        node.endpoint(
            "a",
            1,
            A,
            policy(2, true, false, vec![entry(Ingress, 2, Protocol::Icmpv6, 0, 0, Allow)]),
        ),
    )
    .await;
    for id in [0, 7] {
        assert!(
            outside.icmp6(pod, 128, id, 64, Some(Duration::from_secs(2))),
            "an allowed peer's echo (identifier {id}) is answered"
        );
    }
}

// ------------------------------------------------------------- out of a pod

/// Link-local sources: only ND and MLD as the RFCs send them stay on the
/// link unenforced; anything else from a link-local source is not the
/// pod's address (invalid source), and ICMPv6 to multicast from the pod's
/// own address is egress traffic under policy.
#[tokio::test]
async fn link_local_egress_is_limited_to_neighbour_discovery_and_mld() {
    let node = node(&["a"]).await;
    let mut client = node.client().await;
    // Egress enforced with nothing allowed.
    apply(&mut client, node.endpoint("a", 1, A, policy(1, false, true, vec![]))).await;
    let pod = v6(&node, "a");
    let ll = ip6("fe80::a");
    let node_ll = ip6("fe80::1");
    let all_nodes = ip6("ff02::1");
    let solicited = ip6("ff02::1:ff00:2");
    let all_routers = ip6("ff02::2");
    let mc_mac = [0x33, 0x33, 0, 0, 0, 1];
    let invalid = pb::DropReason::InvalidSourceAddress;
    let deny = pb::DropReason::PolicyDefaultDeny;

    // Link plumbing: DAD (NS from ::, hop limit 255), a router
    // solicitation from link-local, an NA from the pod's own address to the
    // node's link-local address, and an MLDv2 report from link-local (hop
    // limit 1, Router Alert). None of these may be dropped. Then one marker.
    let plumbing = vec![
        frames::ipv6(
            Ipv6Addr::UNSPECIFIED,
            solicited,
            255,
            &[],
            proto::ICMPV6,
            &frames::icmp6(Ipv6Addr::UNSPECIFIED, solicited, 135, 0, [0; 4], &pod.octets()),
        ),
        frames::ipv6(
            ll,
            all_routers,
            255,
            &[],
            proto::ICMPV6,
            &frames::icmp6(ll, all_routers, 133, 0, [0; 4], &[]),
        ),
        frames::ipv6(
            pod,
            node_ll,
            255,
            &[],
            proto::ICMPV6,
            &frames::icmp6(pod, node_ll, 136, 0, [0x60, 0, 0, 0], &pod.octets()),
        ),
        frames::ipv6(
            ll,
            ip6("ff02::16"),
            1,
            &[ExtHeader::Raw {
                kind: proto::HOP_BY_HOP,
                bytes: vec![0, 5, 2, 0, 0, 1, 0],
            }],
            proto::ICMPV6,
            &frames::icmp6(ll, ip6("ff02::16"), 143, 0, [0; 4], &[]),
        ),
    ];
    let tcp_ll = |dst: Ipv6Addr| {
        frames::ipv6(
            ll,
            dst,
            64,
            &[],
            proto::TCP,
            &frames::tcp(ll.into(), dst.into(), 40000, 22, TCP_SYN),
        )
    };
    let before = node.drops(invalid).await;
    let all_before = all_drops(&node).await;
    send6(&node, "a", None, plumbing);
    send6(&node, "a", None, vec![tcp_ll(node_ll)]);
    assert_eq!(
        drops_reaching(&node, invalid, before + 1).await,
        before + 1,
        "TCP from a link-local source to the node's link-local address is an invalid source"
    );
    assert_eq!(
        all_drops(&node).await,
        all_before + 1,
        "the ND and MLD plumbing sent before the marker passed"
    );

    // Everything else from link-local, to link-local or multicast: UDP to
    // all-nodes, an echo request, and an ND-typed message with hop limit 64.
    let before = node.drops(invalid).await;
    send6(
        &node,
        "a",
        Some(mc_mac),
        vec![
            frames::ipv6(
                ll,
                all_nodes,
                64,
                &[],
                proto::UDP,
                &frames::udp(ll.into(), all_nodes.into(), 5353, 5353, b"x"),
            ),
            frames::ipv6(
                ll,
                node_ll,
                64,
                &[],
                proto::ICMPV6,
                &frames::icmp6(ll, node_ll, 128, 0, frames::echo_rest(0, 1), &[]),
            ),
            frames::ipv6(
                ll,
                all_nodes,
                64,
                &[],
                proto::ICMPV6,
                &frames::icmp6(ll, all_nodes, 136, 0, [0; 4], &ll.octets()),
            ),
            // A spoofed global source sending ICMPv6 to multicast.
            frames::ipv6(
                ip6("2001:2:ffff::99"),
                all_nodes,
                64,
                &[],
                proto::ICMPV6,
                &frames::icmp6(ip6("2001:2:ffff::99"), all_nodes, 128, 0, frames::echo_rest(0, 1), &[]),
            ),
        ],
    );
    assert_eq!(
        drops_reaching(&node, invalid, before + 4).await,
        before + 4,
        "non-plumbing traffic from link-local or spoofed sources is an invalid source"
    );

    // From the pod's own address, ICMPv6 to multicast is egress traffic.
    let before = node.drops(deny).await;
    send6(
        &node,
        "a",
        Some(mc_mac),
        vec![frames::ipv6(
            pod,
            all_nodes,
            64,
            &[],
            proto::ICMPV6,
            &frames::icmp6(pod, all_nodes, 128, 0, frames::echo_rest(0, 1), &[]),
        )],
    );
    assert_eq!(
        drops_reaching(&node, deny, before + 1).await,
        before + 1,
        "an echo request to all-nodes is under egress policy"
    );
}

/// TCP behind Destination Options, Routing or an Authentication Header is
/// TCP with its ports (a port deny applies); a chain the datapath cannot
/// finish is dropped with its own reason.
#[tokio::test]
async fn tcp_behind_extension_headers_is_tcp_and_unfinished_chains_are_dropped() {
    let node = node(&["a", "b"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("a", 1, A, policy(1, false, false, vec![]))).await;
    // b: any protocol from a is allowed, except TCP 8081.
    let b_policy = policy(
        1,
        true,
        false,
        vec![
            entry(Ingress, A, Protocol::Any, 0, 0, Allow),
            entry(Ingress, A, Protocol::Tcp, 8081, 0, Deny),
        ],
    );
    apply(&mut client, node.endpoint("b", 2, B, b_policy)).await;
    let (src, dst) = (v6(&node, "a"), v6(&node, "b"));
    let syn = |headers: &[ExtHeader], dport: u16| {
        frames::ipv6(
            src,
            dst,
            64,
            headers,
            proto::TCP,
            &frames::tcp(src.into(), dst.into(), 40000 + dport % 1000, dport, TCP_SYN),
        )
    };
    let denied = pb::DropReason::PolicyDenied;
    let chains: Vec<(&str, Vec<ExtHeader>)> = vec![
        ("Destination Options", vec![ExtHeader::DestinationOptions { len: 0 }]),
        ("Routing", vec![ExtHeader::Routing { len: 0 }]),
        ("Authentication Header", vec![ExtHeader::Authentication { len: 4 }]),
        (
            "an atomic Fragment header (offset 0, no more fragments)",
            vec![ExtHeader::Fragment {
                offset: 0,
                more: false,
                id: 7,
            }],
        ),
        (
            "Hop-by-Hop, Destination Options, Routing, AH, Destination Options",
            vec![
                ExtHeader::HopByHop { len: 0 },
                ExtHeader::DestinationOptions { len: 1 },
                ExtHeader::Routing { len: 2 },
                ExtHeader::Authentication { len: 1 },
                ExtHeader::DestinationOptions { len: 0 },
            ],
        ),
    ];
    for (name, headers) in &chains {
        let before = node.drops(denied).await;
        // The allowed port first: it must pass; then the denied one.
        send6(&node, "a", None, vec![syn(headers, 8080), syn(headers, 8081)]);
        assert_eq!(
            drops_reaching(&node, denied, before + 1).await,
            before + 1,
            "TCP to 8081 behind {name} is denied (and to 8080 is not)"
        );
    }

    let chain = pb::DropReason::ExtHeaderChain;
    let nine = vec![ExtHeader::DestinationOptions { len: 0 }; 9];
    let truncated = vec![ExtHeader::Raw {
        kind: proto::DEST_OPTS,
        bytes: vec![16, 1, 4, 0, 0, 0, 0],
    }];
    let late_hop_by_hop = vec![ExtHeader::DestinationOptions { len: 0 }, ExtHeader::HopByHop { len: 0 }];
    let eight = vec![ExtHeader::DestinationOptions { len: 0 }; 8];
    let atomic = ExtHeader::Fragment {
        offset: 0,
        more: false,
        id: 9,
    };
    let two_fragment_headers = vec![atomic.clone(), atomic];
    let before = node.drops(chain).await;
    send6(
        &node,
        "a",
        None,
        vec![
            syn(&eight, 8080), // the longest chain walked: passes
            syn(&nine, 8080),
            syn(&truncated, 8080),
            syn(&late_hop_by_hop, 8080),
            syn(&two_fragment_headers, 8080),
        ],
    );
    assert_eq!(
        drops_reaching(&node, chain, before + 4).await,
        before + 4,
        "9 headers, a truncated header, a Hop-by-Hop header that is not first and a second \
         Fragment header are dropped"
    );
    assert_eq!(node.drops(pb::DropReason::InvalidPacket).await, 0);
}

/// Fragments follow their flow: the first fragment's ports are remembered
/// (by source, destination, protocol and identification) and the later
/// ones get the first one's conntrack and policy verdict. A non-first
/// fragment whose first was never seen is dropped where policy applies.
#[tokio::test]
async fn fragments_follow_the_verdict_of_their_first_fragment() {
    let node = node(&["a", "b"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("a", 1, A, policy(1, false, false, vec![]))).await;
    // b accepts UDP 5353 from a and may only answer.
    let b_policy = policy(1, true, true, vec![entry(Ingress, A, Protocol::Udp, 5353, 0, Allow)]);
    apply(&mut client, node.endpoint("b", 2, B, b_policy)).await;
    let server = node.pod("b").udp_server(5353).expect("UDP server in b");
    let _closed = node.pod("b").udp_server(5354).expect("UDP server in b");

    // Real large datagrams, fragmented by a's stack, echoed (and fragmented
    // again) by b's: both ways through conntrack.
    let a = node.pod("a");
    for dst in [IpAddr::V4(v4(&node, "b")), IpAddr::V6(v6(&node, "b"))] {
        let echoed =
            a.ns.in_ns(move || big_udp_echo(SocketAddr::new(dst, 5353), 4000))
                .expect("entering a")
                .expect("UDP from a");
        assert!(
            echoed,
            "a 4000-byte datagram to {dst}:5353 and its echo pass in fragments; drops: {:?}",
            drop_list(&node).await
        );
    }

    // Raw fragments to the allowed and to the closed port.
    let deny = pb::DropReason::PolicyDefaultDeny;
    let (s4, d4) = (v4(&node, "a"), v4(&node, "b"));
    let (s6, d6) = (v6(&node, "a"), v6(&node, "b"));
    let data = vec![7u8; 2000];
    let before_served = server.datagrams();
    let before = node.drops(deny).await;
    let mut packets4 = frames::ipv4_fragments(
        s4,
        d4,
        proto::UDP,
        0x4242,
        &frames::udp(s4.into(), d4.into(), 33000, 5353, &data),
        1000,
    );
    packets4.extend(frames::ipv4_fragments(
        s4,
        d4,
        proto::UDP,
        0x4243,
        &frames::udp(s4.into(), d4.into(), 33001, 5354, &data),
        1000,
    ));
    send4(&node, "a", packets4);
    let mut packets6 = frames::ipv6_fragments(
        s6,
        d6,
        &[ExtHeader::DestinationOptions { len: 0 }],
        proto::UDP,
        0x4242_4242,
        &frames::udp(s6.into(), d6.into(), 33000, 5353, &data),
        1000,
    );
    packets6.extend(frames::ipv6_fragments(
        s6,
        d6,
        &[],
        proto::UDP,
        0x4242_4243,
        &frames::udp(s6.into(), d6.into(), 33001, 5354, &data),
        1000,
    ));
    send6(&node, "a", None, packets6);
    assert_eq!(
        drops_reaching(&node, deny, before + 6).await,
        before + 6,
        "every fragment (3 per datagram) to the closed port 5354 is dropped like its first"
    );
    let deadline = Instant::now() + SIGNAL;
    while server.datagrams() < before_served + 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        server.datagrams(),
        before_served + 2,
        "both raw fragmented datagrams to 5353 were reassembled in b"
    );

    // A non-first fragment whose first fragment never came.
    let untracked = pb::DropReason::FragmentUntracked;
    let before = node.drops(untracked).await;
    let lone4 = frames::ipv4_fragments(
        s4,
        d4,
        proto::UDP,
        0x5151,
        &frames::udp(s4.into(), d4.into(), 33002, 5353, &data),
        1000,
    );
    let lone6 = frames::ipv6_fragments(
        s6,
        d6,
        &[],
        proto::UDP,
        0x5151_5151,
        &frames::udp(s6.into(), d6.into(), 33002, 5353, &data),
        1000,
    );
    send4(&node, "a", vec![lone4[1].clone()]);
    send6(&node, "a", None, vec![lone6[2].clone()]);
    assert_eq!(
        drops_reaching(&node, untracked, before + 2).await,
        before + 2,
        "a non-first fragment without its first is dropped as untracked"
    );
}

/// Sends a `len`-byte datagram to `dst` from a fresh socket (resent every
/// 200 ms) until it comes back whole, for up to 3 s.
fn big_udp_echo(dst: SocketAddr, len: usize) -> std::io::Result<bool> {
    let bind: SocketAddr = if dst.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().unwrap();
    let socket = std::net::UdpSocket::bind(bind)?;
    socket.connect(dst)?;
    socket.set_read_timeout(Some(Duration::from_millis(200)))?;
    let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let mut buf = vec![0u8; len + 100];
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        socket.send(&payload)?;
        match socket.recv(&mut buf) {
            Ok(n) if buf[..n] == payload[..] => return Ok(true),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}
