//! The real datapath in the kernel: a node namespace, pod namespaces and the
//! svc-loader process inside the node, with real traffic between pods.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use rivet_bpf_sys as sys;
use rivet_datapath::maps::legacy::CtEntryV1;
use rivet_datapath::maps::{CT_F_SEEN_REPLY, CT_TCP_ESTABLISHED, Ct4Key, Ct6Key, CtEntry};
use rivet_datapath::spec::{MAP_CT4, MAP_CT6};
use rivet_proto::loader::v1 as pb;
use rivet_testkit::frames;
use rivet_testkit::loader::{LoaderNode, address_entry, entry, policy, prefix};
use tonic::Code;

type Client = rivet_proto::loader::v1::loader_service_client::LoaderServiceClient<rivet_common::grpc::DaemonChannel>;

use pb::{Direction::*, Protocol, Verdict::*};

const BIN: &str = env!("CARGO_BIN_EXE_svc-loader");
const A: u32 = 1001; // identities
const B: u32 = 1002;
const C: u32 = 1003;
const SHORT: Duration = Duration::from_millis(700);

async fn node(pods: &[&str]) -> LoaderNode {
    LoaderNode::start(BIN.as_ref(), pods, &[])
        .await
        .expect("a test node with svc-loader starts")
}

fn v4(node: &LoaderNode, pod: &str) -> IpAddr {
    node.pod(pod).ipv4().unwrap()
}

fn v6(node: &LoaderNode, pod: &str) -> IpAddr {
    node.pod(pod).ipv6().unwrap()
}

fn pings(node: &LoaderNode, from: &str, to: IpAddr) -> u32 {
    node.pod(from)
        .ping(to, 3, Duration::from_millis(50), Duration::from_secs(1))
        .expect("ping runs")
        .received
}

/// `count` pings at 5 per millisecond from `from` to `dst`, in the
/// background; yields ping's summary.
fn flood_ping(node: &LoaderNode, from: &str, dst: IpAddr, count: u32) -> std::thread::JoinHandle<String> {
    let mut command = node.pod(from).ns.command("ping");
    command.args([
        "-n",
        "-q",
        "-i",
        "0.0002",
        "-W",
        "1",
        "-c",
        &count.to_string(),
        &dst.to_string(),
    ]);
    std::thread::spawn(move || {
        let out = command.output().expect("ping runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    })
}

/// Packets pod `pod` has received on its eth0.
fn received(node: &LoaderNode, pod: &str) -> u64 {
    node.pod(pod).ns.link_packets("eth0").expect("eth0 counters").0
}

/// Waits until pod `pod` has received at least `count` packets (traffic
/// really flows through the datapath), at most 10 s; returns its count.
async fn wait_received(node: &LoaderNode, pod: &str, count: u64) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = received(node, pod);
        if now >= count {
            return now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "pod {pod} received {now} packets, waiting for {count}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Applies an endpoint that must be accepted.
async fn apply(client: &mut Client, request: pb::ApplyEndpointRequest) -> pb::ApplyEndpointResponse {
    client
        .apply_endpoint(request)
        .await
        .expect("the endpoint is applied")
        .into_inner()
}

fn unrestricted(revision: u64) -> pb::EndpointPolicy {
    policy(revision, false, false, vec![])
}

#[tokio::test]
async fn policy_allows_denies_and_conntrack_lets_replies_through() {
    let node = node(&["a", "b", "c"]).await;
    let mut client = node.client().await;
    // a: unrestricted. b: ingress from a on ICMP, TCP 8080, UDP 5353 and TCP
    // 9000-9010; egress enforced with no allow (it may only answer).
    // c: ingress enforced with nothing allowed.
    client
        .apply_endpoint(node.endpoint("a", 1, A, unrestricted(1)))
        .await
        .expect("apply a");
    let b_policy = policy(
        1,
        true,
        true,
        vec![
            entry(Ingress, A, Protocol::Icmp, 0, 0, Allow),
            entry(Ingress, A, Protocol::Icmpv6, 0, 0, Allow),
            entry(Ingress, A, Protocol::Tcp, 8080, 0, Allow),
            entry(Ingress, A, Protocol::Udp, 5353, 0, Allow),
            entry(Ingress, A, Protocol::Tcp, 9000, 9010, Allow),
        ],
    );
    let applied = client
        .apply_endpoint(node.endpoint("b", 2, B, b_policy))
        .await
        .expect("apply b")
        .into_inner();
    assert!(applied.changed);
    let ep = applied.endpoint.expect("the realised endpoint is returned");
    assert_eq!(
        ep.from_container,
        pb::AttachState::Attached as i32,
        "from_container attached"
    );
    assert_eq!(
        ep.to_container,
        pb::AttachState::Attached as i32,
        "to_container attached"
    );
    client
        .apply_endpoint(node.endpoint("c", 3, C, policy(1, true, false, vec![])))
        .await
        .expect("apply c");

    let b = node.pod("b");
    let _tcp = b.tcp_server(8080).unwrap();
    let _tcp_other = b.tcp_server(8081).unwrap();
    let _range_in = b.tcp_server(9005).unwrap();
    let _range_out = b.tcp_server(9011).unwrap();
    let _udp = b.udp_server(5353).unwrap();
    let a = node.pod("a");
    for dst in [v4(&node, "b"), v6(&node, "b")] {
        assert_eq!(pings(&node, "a", dst), 3, "ICMP from a to b ({dst}) is allowed");
        assert!(
            a.tcp_echo(SocketAddr::new(dst, 8080), SHORT).unwrap(),
            "TCP a→b:8080 ({dst}) is allowed"
        );
        assert!(
            a.udp_echo(SocketAddr::new(dst, 5353), SHORT).unwrap(),
            "UDP a→b:5353 ({dst}) is allowed"
        );
        assert!(
            a.tcp_echo(SocketAddr::new(dst, 9005), SHORT).unwrap(),
            "9005 is inside the 9000-9010 range"
        );
        assert!(
            !a.tcp_echo(SocketAddr::new(dst, 9011), SHORT).unwrap(),
            "9011 is outside the range"
        );
        assert!(
            !a.tcp_echo(SocketAddr::new(dst, 8081), SHORT).unwrap(),
            "TCP a→b:8081 has no allow"
        );
        assert_eq!(
            pings(&node, "a", if dst.is_ipv4() { v4(&node, "c") } else { v6(&node, "c") }),
            0,
            "c's ingress allows nothing: a must not reach c"
        );
        assert_eq!(
            pings(&node, "b", if dst.is_ipv4() { v4(&node, "a") } else { v6(&node, "a") }),
            0,
            "b's egress allows nothing: b cannot open connections to a"
        );
    }
    assert!(
        node.drops(pb::DropReason::PolicyDefaultDeny).await >= 8,
        "default-deny drops are counted by reason"
    );

    // Deny wins over allow; wildcard identity and port entries.
    let deny_policy = policy(
        2,
        true,
        true,
        vec![
            entry(Ingress, 0, Protocol::Tcp, 0, 0, Allow),
            entry(Ingress, A, Protocol::Tcp, 8081, 0, Deny),
            entry(Ingress, 0, Protocol::Any, 0, 0, Allow),
            entry(Ingress, A, Protocol::Icmp, 0, 0, Deny),
        ],
    );
    let r = client
        .apply_endpoint(node.endpoint("b", 2, B, deny_policy))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.endpoint.unwrap().policy_revision,
        2,
        "the realised revision is returned"
    );
    let dst = v4(&node, "b");
    assert!(
        a.tcp_echo(SocketAddr::new(dst, 9011), SHORT).unwrap(),
        "any-port allow for any identity"
    );
    assert!(
        !a.tcp_echo(SocketAddr::new(dst, 8081), SHORT).unwrap(),
        "a deny entry wins over the wildcard allow"
    );
    let denied_before = node.drops(pb::DropReason::PolicyDenied).await;
    assert_eq!(
        pings(&node, "a", dst),
        0,
        "ICMP from a is denied although 'any protocol' is allowed"
    );
    assert!(
        node.drops(pb::DropReason::PolicyDenied).await > denied_before,
        "denials are counted"
    );
    assert_eq!(
        pings(&node, "a", v6(&node, "b")),
        3,
        "ICMPv6 is not covered by the ICMP deny"
    );

    let got = client
        .get_endpoint_policy(pb::GetEndpointPolicyRequest { endpoint_id: 2 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.revision, 2);
    assert!(
        got.entries
            .iter()
            .any(|e| e.entry.as_ref().unwrap().verdict == Deny as i32 && e.packets > 0),
        "the deny entry counted the dropped packets: {got:?}"
    );
}

#[tokio::test]
async fn drops_are_streamed_with_their_reason() {
    let node = node(&["a", "c"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("a", 1, A, unrestricted(1))).await;
    apply(&mut client, node.endpoint("c", 3, C, policy(1, true, false, vec![]))).await;
    let mut events = client
        .monitor_events(pb::MonitorEventsRequest {
            types: vec![pb::EventType::Drop as i32, pb::EventType::PolicyVerdict as i32],
            endpoint_ids: vec![3],
        })
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(Duration::from_secs(5), events.message())
        .await
        .expect("the stream acknowledges the subscription")
        .unwrap()
        .expect("the stream stays open");
    assert_eq!(
        first.r#type,
        pb::EventType::Subscribed as i32,
        "the first message says the subscription is in place: {first:?}"
    );
    let _ = pings(&node, "a", v4(&node, "c"));
    let event = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let e = events.message().await.unwrap().expect("the stream stays open");
            if e.r#type == pb::EventType::Drop as i32 {
                return e;
            }
        }
    })
    .await
    .expect("a drop event arrives");
    assert_eq!(event.drop_reason, pb::DropReason::PolicyDefaultDeny as i32, "{event:?}");
    assert_eq!(event.endpoint_id, 3);
    assert_eq!(event.direction, Ingress as i32);
    assert_eq!(
        event.source_identity, A,
        "the event names the source identity: {event:?}"
    );
    assert_eq!(event.destination_identity, C);
    let t = event.tuple.unwrap();
    assert_eq!(t.source_address, [198, 18, 0, 2]);
    assert_eq!(t.protocol, 1);
}

/// One echo round trip on `stream`: `payload` comes back within `within`.
fn echoes(stream: &mut std::net::TcpStream, payload: &[u8], within: Duration) -> std::io::Result<()> {
    stream.set_read_timeout(Some(within))?;
    stream.write_all(payload)?;
    let mut buf = vec![0u8; payload.len()];
    stream.read_exact(&mut buf)?;
    assert_eq!(buf, payload, "the echo server returns what it got");
    Ok(())
}

#[tokio::test]
async fn a_policy_change_reaches_established_connections_at_their_next_packet() {
    let node = node(&["a", "b"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("a", 1, A, unrestricted(1))).await;
    // b: ingress from a on 8080; egress enforced too, allowing nothing (b
    // only answers).
    let allow = |revision| {
        policy(
            revision,
            true,
            true,
            vec![entry(Ingress, A, Protocol::Tcp, 8080, 0, Allow)],
        )
    };
    apply(&mut client, node.endpoint("b", 2, B, allow(1))).await;
    let _server = node.pod("b").tcp_server(8080).unwrap();
    let dst = SocketAddr::new(v4(&node, "b"), 8080);
    let mut held = node.pod("a").tcp_stream(dst, SHORT).expect("connect while allowed");
    echoes(&mut held, b"allowed", SHORT).expect("an allowed connection works");

    // A change to b's policy that keeps the connection allowed (another
    // entry; egress still allows nothing): its replies still follow the
    // ingress policy that let it open, not b's egress.
    let mut wider = allow(2);
    wider.entries.push(entry(Ingress, C, Protocol::Tcp, 9090, 0, Allow));
    apply(&mut client, node.endpoint("b", 2, B, wider)).await;
    echoes(&mut held, b"still allowed", SHORT).expect("a change that keeps a connection allowed keeps it");

    // Revoked: the connection's next packet is dropped, on policy.
    let denied_before = node.drops(pb::DropReason::PolicyDefaultDeny).await;
    apply(&mut client, node.endpoint("b", 2, B, policy(3, true, true, vec![]))).await;
    held.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    held.write_all(b"revoked").unwrap();
    let denied = node
        .drops_reaching(
            pb::DropReason::PolicyDefaultDeny,
            denied_before + 1,
            Duration::from_secs(5),
        )
        .await;
    assert!(
        denied > denied_before,
        "the established connection's next segment is dropped by the new policy"
    );
    let mut buf = [0u8; 7];
    let read = held.read(&mut buf);
    assert!(
        matches!(&read, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        "nothing comes back through a revoked policy: {read:?}"
    );
    assert!(
        !node.pod("a").tcp_echo(dst, SHORT).unwrap(),
        "and a new connection follows the new policy"
    );

    // Allowed again: the same connection resumes (TCP retransmits what was dropped).
    apply(&mut client, node.endpoint("b", 2, B, allow(4))).await;
    held.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    held.read_exact(&mut buf)
        .expect("the retransmitted segment passes once policy allows the connection again");
    assert_eq!(&buf, b"revoked");
}

#[tokio::test]
async fn kill_9_of_the_loader_loses_no_packet_and_the_restart_adopts() {
    let mut node = node(&["a", "b"]).await;
    let mut client = node.client().await;
    let a_req = node.endpoint("a", 1, A, unrestricted(1));
    let b_req = node.endpoint(
        "b",
        2,
        B,
        policy(1, true, false, vec![entry(Ingress, A, Protocol::Icmp, 0, 0, Allow)]),
    );
    client.apply_endpoint(a_req.clone()).await.unwrap();
    client.apply_endpoint(b_req.clone()).await.unwrap();

    // 5 pings per millisecond for 3 s while the loader dies and restarts.
    let dst = v4(&node, "b");
    let before = received(&node, "b");
    let pinger = flood_ping(&node, "a", dst, 15000);
    wait_received(&node, "b", before + 1000).await;
    node.loader.kill9();
    // The datapath keeps forwarding with the loader dead.
    let at_kill = received(&node, "b");
    wait_received(&node, "b", at_kill + 2000).await;
    node.loader.restart().await.expect("the loader restarts on its pins");
    let text = pinger.join().unwrap();
    assert!(
        text.contains("15000 packets transmitted, 15000 received"),
        "no ping may be lost while the loader is down or restarting:\n{text}"
    );

    let mut client = node.client().await;
    let status = client
        .get_datapath_status(pb::GetDatapathStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = status.maps.iter().map(|m| m.name.as_str()).collect();
    for map in [
        "config",
        "ct4",
        "ct6",
        "endpoints",
        "events",
        "ipcache",
        "metrics",
        "policy",
    ] {
        assert!(names.contains(&map), "{map} is pinned: {names:?}");
    }
    assert!(
        status.maps.iter().all(|m| m.reused),
        "a restarted loader adopts every pinned map: {status:?}"
    );
    assert_eq!(status.object_sha256.len(), 64);
    for req in [a_req, b_req] {
        let r = client.apply_endpoint(req).await.unwrap().into_inner();
        assert!(
            !r.changed,
            "re-applying the same revision after a restart changes nothing"
        );
        let ep = r.endpoint.unwrap();
        assert_eq!(
            ep.from_container,
            pb::AttachState::Attached as i32,
            "adopted: attached with the new program"
        );
    }
}

#[tokio::test]
async fn identity_change_under_traffic_drops_nothing_still_allowed() {
    let node = node(&["a", "b"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("a", 1, A, unrestricted(1))).await;
    let b_policy = policy(
        1,
        true,
        false,
        vec![
            entry(Ingress, A, Protocol::Icmp, 0, 0, Allow),
            entry(Ingress, 4242, Protocol::Icmp, 0, 0, Allow),
        ],
    );
    client.apply_endpoint(node.endpoint("b", 2, B, b_policy)).await.unwrap();
    let dst = v4(&node, "b");
    let before = received(&node, "b");
    let pinger = flood_ping(&node, "a", dst, 5000);
    wait_received(&node, "b", before + 1000).await;
    let r = client
        .apply_endpoint(node.endpoint("a", 1, 4242, unrestricted(2)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.endpoint.unwrap().identity, 4242);
    let text = pinger.join().unwrap();
    assert!(
        text.contains("5000 received"),
        "an identity change must not drop allowed traffic:\n{text}"
    );
    // A new flow is judged with the new identity.
    apply(
        &mut client,
        node.endpoint(
            "b",
            2,
            B,
            policy(2, true, false, vec![entry(Ingress, A, Protocol::Icmp, 0, 0, Allow)]),
        ),
    )
    .await;
    let fresh = node
        .pod("a")
        .ping(dst, 2, Duration::from_millis(50), Duration::from_secs(1))
        .unwrap();
    assert!(
        fresh.received < 2,
        "after the change only the new identity counts for policy"
    );
}

/// What refused requests must leave as it was: the loader's endpoints and
/// IP cache, its peer nodes, and the tc filters of every interface a request
/// named.
async fn datapath_snapshot(node: &LoaderNode, client: &mut Client, interfaces: &[&str]) -> String {
    let endpoints = client
        .list_endpoints(pb::ListEndpointsRequest {})
        .await
        .unwrap()
        .into_inner();
    let ipcache = client
        .list_ipcache(pb::ListIpcacheRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries;
    let nodes = node
        .routing_client()
        .await
        .list_nodes(pb::ListNodesRequest {})
        .await
        .unwrap()
        .into_inner();
    let mut filters = Vec::new();
    for name in interfaces {
        let ifindex = node.node.ns.ifindex(name).unwrap();
        let found = node
            .node
            .ns
            .in_ns(move || {
                [svc_loader::tc::Direction::Ingress, svc_loader::tc::Direction::Egress]
                    .map(|d| svc_loader::tc::bpf_filters(ifindex, d).expect("listing tc filters"))
            })
            .unwrap();
        filters.push(format!("{name}: {found:?}"));
    }
    format!(
        "endpoints {:?} {:?} {:?}\nipcache {ipcache:?}\nnodes {:?}\nfilters {filters:?}",
        endpoints.endpoints, endpoints.orphan_attachments, endpoints.orphan_policy_endpoint_ids, nodes.nodes
    )
}

#[tokio::test]
async fn bad_requests_are_refused_and_change_nothing() {
    let node = node(&["a", "b"]).await;
    let mut client = node.client().await;
    let good = node.endpoint("a", 1, A, unrestricted(1));
    apply(&mut client, node.endpoint("b", 2, B, unrestricted(1))).await;
    // Interfaces a request may name that are not a pod's veth: a veth
    // without the endpoint prefix, a bridge with it, loopback.
    node.node
        .ns
        .ip(&["link", "add", "other0", "type", "veth", "peer", "name", "other1"])
        .unwrap();
    node.node
        .ns
        .ip(&[
            "link",
            "add",
            &format!("{}br0", rivet_testkit::loader::HOST_PREFIX),
            "type",
            "bridge",
        ])
        .unwrap();
    let bridge = format!("{}br0", rivet_testkit::loader::HOST_PREFIX);
    let a_veth = node.pod("a").host_ifname.clone();
    let b_veth = node.pod("b").host_ifname.clone();
    let interfaces = ["lo", "other0", bridge.as_str(), a_veth.as_str(), b_veth.as_str()];
    let before = datapath_snapshot(&node, &mut client, &interfaces).await;

    // What a client acts on is the reason (svc-endpoint drops an endpoint
    // whose interface is gone), decoded into the typed client error.
    type LoaderError = rivet_common::grpc::RpcError<pb::ErrorReason>;
    let mut unknown = good.clone();
    unknown.host_ifindex = 999_999;
    let err = LoaderError::from(client.apply_endpoint(unknown).await.unwrap_err());
    assert_eq!(err.code(), Code::NotFound, "unknown interface");
    assert_eq!(err.reason(), Some(pb::ErrorReason::InterfaceNotFound), "{err:?}");

    for (name, refused) in [
        ("loopback", "lo"),
        ("a bridge with the endpoint prefix", bridge.as_str()),
    ] {
        let mut not_veth = good.clone();
        not_veth.host_ifindex = node.node.ns.ifindex(refused).unwrap();
        let err = LoaderError::from(client.apply_endpoint(not_veth).await.unwrap_err());
        assert_eq!(
            err.code(),
            Code::PermissionDenied,
            "{name}: a non-veth is refused: {}",
            err.message()
        );
        assert_eq!(
            err.reason(),
            Some(pb::ErrorReason::InterfaceNotEndpoint),
            "{name}: {err:?}"
        );
    }

    // A veth without the endpoint prefix.
    let mut wrong_prefix = good.clone();
    wrong_prefix.host_ifindex = node.node.ns.ifindex("other0").unwrap();
    let err = client.apply_endpoint(wrong_prefix).await.unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied, "{}", err.message());
    assert!(err.message().contains("prefix"), "{}", err.message());

    // Another endpoint's veth, and its addresses.
    let mut held = good.clone();
    held.host_ifindex = node.pod("b").host_ifindex;
    let err = LoaderError::from(client.apply_endpoint(held).await.unwrap_err());
    assert_eq!(err.reason(), Some(pb::ErrorReason::InterfaceHeld), "{err:?}");
    let mut stolen = good.clone();
    stolen.addresses = node.endpoint("b", 2, B, unrestricted(1)).addresses;
    let err = LoaderError::from(client.apply_endpoint(stolen).await.unwrap_err());
    assert_eq!(err.reason(), Some(pb::ErrorReason::AddressHeld), "{err:?}");

    // Fields out of range.
    type Edit = Box<dyn Fn(&mut pb::ApplyEndpointRequest)>;
    let out_of_range: [(&str, Edit); 9] = [
        ("endpoint_id", Box::new(|r| r.endpoint_id = 0)),
        ("endpoint_id", Box::new(|r| r.endpoint_id = 65_536)),
        ("endpoint_id", Box::new(|r| r.endpoint_id = u32::MAX)),
        ("identity", Box::new(|r| r.identity = 0)),
        ("mac", Box::new(|r| r.mac = vec![1, 2, 3])),
        ("addresses", Box::new(|r| r.addresses = vec![vec![198, 18, 0]])),
        ("addresses", Box::new(|r| r.addresses = Vec::new())),
        (
            "policy.entries",
            Box::new(|r| {
                r.policy = Some(policy(
                    2,
                    true,
                    false,
                    vec![entry(Ingress, B, Protocol::Tcp, 70_000, 0, Allow)],
                ))
            }),
        ),
        (
            "policy.entries",
            Box::new(|r| {
                r.policy = Some(policy(
                    2,
                    true,
                    false,
                    vec![entry(Ingress, B, Protocol::Tcp, 8080, 80, Allow)],
                ))
            }),
        ),
    ];
    for (field, edit) in out_of_range {
        let mut bad = good.clone();
        edit(&mut bad);
        let err = client.apply_endpoint(bad).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {}", err.message());
        assert!(
            err.message().contains(field),
            "the refusal names {field}: {}",
            err.message()
        );
    }
    for endpoint_id in [0, 65_536] {
        let err = client
            .remove_endpoint(pb::RemoveEndpointRequest {
                endpoint_id,
                host_ifindex: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Code::InvalidArgument,
            "RemoveEndpoint {endpoint_id}: {err:?}"
        );
    }
    // Removing by an interface that is no endpoint's touches nothing.
    for name in ["lo", "other0", bridge.as_str()] {
        let host_ifindex = node.node.ns.ifindex(name).unwrap();
        match client
            .remove_endpoint(pb::RemoveEndpointRequest {
                endpoint_id: 0,
                host_ifindex,
            })
            .await
        {
            Ok(r) => assert!(!r.into_inner().removed, "{name}: nothing to remove"),
            Err(e) => assert_eq!(e.code(), Code::PermissionDenied, "{name}: {e:?}"),
        }
    }
    let big = pb::UpsertIpcacheRequest {
        entries: vec![
            pb::IpcacheEntry {
                prefix: Some(rivet_proto::net::IpPrefix {
                    address: vec![198, 18, 1, 0],
                    prefix_length: 24,
                }),
                identity: 7,
                tunnel_endpoint: vec![],
            };
            5000
        ],
    };
    assert_eq!(
        client.upsert_ipcache(big).await.unwrap_err().code(),
        Code::InvalidArgument,
        "batch size limit"
    );
    let bad_prefix = pb::UpsertIpcacheRequest {
        entries: vec![pb::IpcacheEntry {
            prefix: Some(rivet_proto::net::IpPrefix {
                address: vec![198, 18, 1, 1],
                prefix_length: 33,
            }),
            identity: 7,
            tunnel_endpoint: vec![],
        }],
    };
    assert_eq!(
        client.upsert_ipcache(bad_prefix).await.unwrap_err().code(),
        Code::InvalidArgument,
        "a /33"
    );
    // Path-like node names (this loader routes nothing: refused either way).
    let err = node
        .routing_client()
        .await
        .replace_nodes(pb::ReplaceNodesRequest {
            nodes: vec![pb::PeerNode {
                name: "../../../sys/fs/bpf/x".into(),
                underlay_ipv4: vec![198, 19, 9, 1],
                underlay_ipv6: vec![],
                pod_cidrs: vec![],
            }],
        })
        .await
        .unwrap_err();
    assert!(
        matches!(err.code(), Code::InvalidArgument | Code::FailedPrecondition),
        "{err:?}"
    );

    assert_eq!(
        datapath_snapshot(&node, &mut client, &interfaces).await,
        before,
        "refused requests change nothing"
    );
    client.apply_endpoint(good).await.expect("a good request still works");
}

#[tokio::test]
async fn other_uids_cannot_talk_to_the_loader() {
    let node = LoaderNode::start(BIN.as_ref(), &["a"], &["--allowed-uids", "4242"]).await;
    // The readiness probe itself runs as root, which is not allowed: start fails.
    let err = node.expect_err("a loader that admits only UID 4242 never answers root");
    assert!(err.to_string().contains("did not answer"), "{err}");
}

#[tokio::test]
async fn removing_an_endpoint_detaches_and_forgets_it() {
    let node = node(&["a", "b"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("a", 1, A, unrestricted(1))).await;
    apply(&mut client, node.endpoint("b", 2, B, policy(1, true, false, vec![]))).await;
    assert_eq!(pings(&node, "a", v4(&node, "b")), 0, "b allows nothing");
    let r = client
        .remove_endpoint(pb::RemoveEndpointRequest {
            endpoint_id: 2,
            host_ifindex: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.removed);
    let again = client
        .remove_endpoint(pb::RemoveEndpointRequest {
            endpoint_id: 2,
            host_ifindex: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.removed, "removing twice is a no-op");
    let list = client
        .list_endpoints(pb::ListEndpointsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.endpoints.len(), 1);
    assert!(list.orphan_attachments.is_empty(), "b's programs are detached");
    let b_ifindex = node.pod("b").host_ifindex;
    let filters = node
        .node
        .ns
        .in_ns(move || {
            [svc_loader::tc::Direction::Ingress, svc_loader::tc::Direction::Egress]
                .map(|d| svc_loader::tc::bpf_filters(b_ifindex, d).expect("listing b's tc filters"))
        })
        .unwrap();
    assert_eq!(filters, [vec![], vec![]], "b's tc filters are deleted");
}

#[tokio::test]
async fn related_icmp_errors_pass_with_their_connection() {
    let node = node(&["a", "b"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("a", 1, A, unrestricted(1))).await;
    // b accepts UDP from a on any port but may send nothing on its own: the
    // port-unreachable error for a closed port passes only as related traffic.
    let b_policy = policy(1, true, true, vec![entry(Ingress, A, Protocol::Udp, 0, 0, Allow)]);
    client.apply_endpoint(node.endpoint("b", 2, B, b_policy)).await.unwrap();
    for dst in [v4(&node, "b"), v6(&node, "b")] {
        let target = SocketAddr::new(dst, 9); // nothing listens on b:9
        let outcome = node
            .pod("a")
            .ns
            .in_ns(move || {
                let bind: SocketAddr = if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().unwrap();
                let socket = std::net::UdpSocket::bind(bind)?;
                socket.connect(target)?;
                socket.set_read_timeout(Some(Duration::from_secs(2)))?;
                socket.send(b"ping")?;
                let mut buf = [0u8; 16];
                Ok::<_, std::io::Error>(socket.recv(&mut buf).map_err(|e| e.kind()))
            })
            .unwrap()
            .unwrap();
        assert_eq!(
            outcome,
            Err(std::io::ErrorKind::ConnectionRefused),
            "the ICMP port-unreachable from b ({dst}) must reach a as part of a's connection"
        );
    }
}

/// An IPv6 frame from a pod's `eth0` with a Hop-by-Hop header (Router
/// Alert) before its ICMPv6 message, as MLD reports are sent.
fn hop_by_hop_icmp6(src_mac: [u8; 6], dst_mac: [u8; 6], src: Ipv6Addr, dst: Ipv6Addr, icmp_type: u8) -> Vec<u8> {
    // Hop-by-Hop: Router Alert (MLD), PadN; hop limit 1.
    let router_alert = frames::ExtHeader::Raw {
        kind: frames::proto::HOP_BY_HOP,
        bytes: vec![0, 5, 2, 0, 0, 1, 0],
    };
    // An MLDv2 report with no records (or an echo request with id 0).
    let icmp = frames::icmp6(src, dst, icmp_type, 0, [0; 4], &[]);
    let packet = frames::ipv6(src, dst, 1, &[router_alert], frames::proto::ICMPV6, &icmp);
    frames::ethernet(dst_mac, src_mac, frames::ETH_P_IPV6, &packet)
}

#[tokio::test]
async fn mld_reports_from_the_unspecified_address_pass_and_spoofed_sources_are_dropped() {
    let node = node(&["a"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("a", 1, A, unrestricted(1))).await;
    let pod = node.pod("a");
    let (pod_mac, host_mac) = (pod.pod_mac, pod.host_mac);
    let all_mld_routers: Ipv6Addr = "ff02::16".parse().unwrap();
    let gateway: Ipv6Addr = "2001:2::1".parse().unwrap();
    let spoofed: Ipv6Addr = "2001:2:ffff::99".parse().unwrap();
    let mld = vec![
        hop_by_hop_icmp6(
            pod_mac,
            [0x33, 0x33, 0, 0, 0, 0x16],
            Ipv6Addr::UNSPECIFIED,
            all_mld_routers,
            143
        );
        5
    ];
    let spoof = vec![hop_by_hop_icmp6(pod_mac, host_mac, spoofed, gateway, 128); 3];

    let before = node.drops(pb::DropReason::InvalidSourceAddress).await;
    pod.ns
        .in_ns(move || frames::send_frames("eth0", &mld))
        .unwrap()
        .unwrap();
    pod.ns
        .in_ns(move || frames::send_frames("eth0", &spoof))
        .unwrap()
        .unwrap();
    let after = node
        .drops_reaching(pb::DropReason::InvalidSourceAddress, before + 3, Duration::from_secs(5))
        .await;
    assert_eq!(
        after - before,
        3,
        "the spoofed packets (behind the same Hop-by-Hop header) are dropped, \
         the MLD reports from :: are not"
    );
}

// ------------------------------------------------- ipBlocks matched by address

const CIDR_1: u32 = 1 << 24; // CIDR identities
const CIDR_2: u32 = (1 << 24) + 1;
const CIDR_3: u32 = (1 << 24) + 2;
const CIDR_4: u32 = (1 << 24) + 3;

fn host_prefix(address: IpAddr) -> u32 {
    if address.is_ipv4() { 32 } else { 128 }
}

/// b and c share identity B; a's policies name them by address. Before the
/// address prefixes, an ipBlock of a pod's /32 never applied to the pod (its
/// endpoint identity won) and `except` could not tell b from c.
#[tokio::test]
async fn ipblocks_match_pod_addresses_per_address() {
    let node = node(&["a", "b", "c"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("b", 2, B, unrestricted(1))).await;
    apply(&mut client, node.endpoint("c", 3, B, unrestricted(1))).await;
    let b = [v4(&node, "b"), v6(&node, "b")];
    let c = [v4(&node, "c"), v6(&node, "c")];
    let wide: [(IpAddr, u32); 2] = [("198.18.0.0".parse().unwrap(), 15), ("2001:2::".parse().unwrap(), 48)];

    // Egress to b's /32 and /128 only.
    let to_b = egress_to_hosts(1, &b, Allow, Vec::new());
    apply(&mut client, node.endpoint("a", 1, A, to_b)).await;
    for (b, c) in b.into_iter().zip(c) {
        assert_eq!(pings(&node, "a", b), 3, "ipBlock {b}/{}: a reaches b", host_prefix(b));
        assert_eq!(
            pings(&node, "a", c),
            0,
            "c ({c}) shares b's identity but not its address"
        );
    }

    // Egress to the wide blocks except c; ingress from them except c.
    let mut prefixes = Vec::new();
    let mut entries = Vec::new();
    for (direction, (block, except)) in [(Egress, (CIDR_1, CIDR_2)), (Ingress, (CIDR_3, CIDR_4))] {
        for (family, ((net, len), c)) in wide.into_iter().zip(c).enumerate() {
            // Distinct identities per family: one prefix, one identity.
            let (block, except) = (block + (family as u32) * 16, except + (family as u32) * 16);
            prefixes.push(prefix(direction, net, len, block));
            prefixes.push(prefix(direction, c, host_prefix(c), except));
            entries.push(address_entry(direction, block, Protocol::Any, 0, Allow));
        }
    }
    let all_but_c = pb::EndpointPolicy {
        prefixes,
        ..policy(2, true, true, entries)
    };
    let applied = apply(&mut client, node.endpoint("a", 1, A, all_but_c)).await;
    assert_eq!(applied.endpoint.unwrap().policy_prefixes, 8, "4 prefixes per direction");
    let a = [v4(&node, "a"), v6(&node, "a")];
    for ((b, c), a) in b.into_iter().zip(c).zip(a) {
        assert_eq!(pings(&node, "a", b), 3, "egress: {b} is inside the block");
        assert_eq!(pings(&node, "a", c), 0, "egress: {c} is excepted");
        assert_eq!(pings(&node, "b", a), 3, "ingress: b ({b}) is inside the block");
        assert_eq!(pings(&node, "c", a), 0, "ingress: c ({c}) is excepted, b is not");
    }
    let listed = client
        .get_endpoint_policy(pb::GetEndpointPolicyRequest { endpoint_id: 1 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        listed.prefixes.len(),
        8,
        "GetEndpointPolicy lists the prefixes: {listed:?}"
    );
    assert!(
        listed.prefixes.iter().any(|p| p.prefix
            == Some(rivet_proto::net::IpPrefix {
                address: vec![198, 18, 0, 0],
                prefix_length: 15
            })
            && p.cidr_identity == CIDR_1
            && p.direction == Egress as i32),
        "{listed:?}"
    );
    assert!(
        listed
            .entries
            .iter()
            .all(|e| e.entry.as_ref().unwrap().peer_kind == pb::PeerKind::Address as i32),
        "entries keep their peer kind: {listed:?}"
    );
    assert!(
        listed.entries.iter().any(|e| e.packets > 0),
        "address entries count the packets they allowed: {listed:?}"
    );

    // A deny by address beats an allow by identity (a Rivet deny ipBlock).
    let deny_c = egress_to_hosts(3, &c, Deny, vec![entry(Egress, B, Protocol::Any, 0, 0, Allow)]);
    apply(&mut client, node.endpoint("a", 1, A, deny_c)).await;
    let denied_before = node.drops(pb::DropReason::PolicyDenied).await;
    for (b, c) in b.into_iter().zip(c) {
        assert_eq!(pings(&node, "a", b), 3, "identity allow for B: a reaches b ({b})");
        assert_eq!(pings(&node, "a", c), 0, "the address deny of c ({c}) wins");
    }
    assert!(
        node.drops(pb::DropReason::PolicyDenied).await >= denied_before + 6,
        "dropped as policy-denied, not default deny"
    );

    // A policy without prefixes takes them out of the map; so does removal.
    let r = apply(
        &mut client,
        node.endpoint(
            "a",
            1,
            A,
            policy(4, false, true, vec![entry(Egress, B, Protocol::Any, 0, 0, Allow)]),
        ),
    )
    .await;
    assert_eq!(r.endpoint.unwrap().policy_prefixes, 0);
    for c in c {
        assert_eq!(pings(&node, "a", c), 3, "no address deny is left behind for {c}");
    }
    apply(
        &mut client,
        node.endpoint("a", 1, A, egress_to_hosts(5, &c[..1], Deny, Vec::new())),
    )
    .await;
    client
        .remove_endpoint(pb::RemoveEndpointRequest {
            endpoint_id: 1,
            host_ifindex: 0,
        })
        .await
        .unwrap();
    let listing = client
        .list_endpoints(pb::ListEndpointsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        listing.orphan_policy_endpoint_ids.is_empty(),
        "removing the endpoint removed its prefixes: {listing:?}"
    );
}

/// An egress-only policy: `entries`, and `verdict` by address for each
/// of `hosts` (its /32 or /128, with CIDR identity CIDR_1, CIDR_2, ... in
/// order).
fn egress_to_hosts(
    revision: u64,
    hosts: &[IpAddr],
    verdict: pb::Verdict,
    mut entries: Vec<pb::PolicyEntry>,
) -> pb::EndpointPolicy {
    let cidr = |i: usize| CIDR_1 + i as u32;
    entries.extend((0..hosts.len()).map(|i| address_entry(Egress, cidr(i), Protocol::Any, 0, verdict)));
    pb::EndpointPolicy {
        prefixes: hosts
            .iter()
            .enumerate()
            .map(|(i, &host)| prefix(Egress, host, host_prefix(host), cidr(i)))
            .collect(),
        ..policy(revision, false, true, entries)
    }
}

/// Address entries are validated with their prefixes: nothing is written.
#[tokio::test]
async fn address_entries_without_their_prefix_are_refused() {
    let node = node(&["a"]).await;
    let mut client = node.client().await;
    let orphan = policy(
        1,
        false,
        true,
        vec![address_entry(Egress, CIDR_1, Protocol::Any, 0, Allow)],
    );
    let err = client
        .apply_endpoint(node.endpoint("a", 1, A, orphan))
        .await
        .expect_err("an address entry needs its prefix");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("policy.entries[0].peer_identity"), "{err:?}");
    let listing = client
        .list_endpoints(pb::ListEndpointsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(listing.endpoints.is_empty(), "nothing was written: {listing:?}");
}

/// A pin directory of a loader that predates `ep_prefixes` (simulated by
/// removing that pin while the loader is down) is adopted: the other maps are
/// reused, the new one is created beside them, and address matching works.
#[tokio::test]
async fn a_pin_set_without_the_prefix_map_is_adopted() {
    let mut node = node(&["a", "b"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("b", 2, B, unrestricted(1))).await;
    let b = v4(&node, "b");
    let a_req = node.endpoint("a", 1, A, egress_to_hosts(1, &[b], Allow, Vec::new()));
    apply(&mut client, a_req.clone()).await;
    drop(client);
    node.loader.kill9();
    std::fs::remove_file(node.pins.0.join("ep_prefixes")).expect("the ep_prefixes pin exists");
    node.loader
        .restart()
        .await
        .expect("the loader restarts on the older pin set");
    let mut client = node.client().await;
    let status = client
        .get_datapath_status(pb::GetDatapathStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    for map in &status.maps {
        assert_eq!(map.reused, map.name != "ep_prefixes", "{map:?}");
    }
    assert!(node.pins.0.join("ep_prefixes").exists(), "the new map is pinned");
    assert_eq!(
        pings(&node, "a", b),
        0,
        "the new map is empty until the policy is applied again"
    );
    let r = apply(&mut client, a_req).await;
    assert!(r.changed, "the prefixes are written again");
    assert_eq!(pings(&node, "a", b), 3, "a reaches b through the new map");
}

// ------------------------------------------------- upgrade of ct_entry layout

/// Every entry of the map pinned at `pin`, as `(key, value)`.
fn ct_entries<K: aya::Pod + Ord, V: aya::Pod>(pin: &std::path::Path) -> std::collections::BTreeMap<K, V> {
    use std::os::fd::AsFd as _;
    let fd = sys::obj_get(pin).unwrap_or_else(|e| panic!("opening {}: {e}", pin.display()));
    let mut entries = std::collections::BTreeMap::new();
    let mut cursor = None;
    while let Some(key) = sys::next_key::<K>(fd.as_fd(), cursor.as_ref()).expect("walking the map") {
        if let Some(value) = sys::lookup::<K, V>(fd.as_fd(), &key).expect("reading an entry") {
            entries.insert(key, value);
        }
        cursor = Some(key);
    }
    entries
}

/// The kernel's view of the map pinned at `pin`.
fn pinned_map_info(pin: &std::path::Path) -> sys::MapInfo {
    use std::os::fd::AsFd as _;
    let fd = sys::obj_get(pin).unwrap_or_else(|e| panic!("opening {}: {e}", pin.display()));
    sys::map_info(fd.as_fd()).expect("the map's info")
}

/// A conntrack map with `value_size` and the spec the loader's flags ask
/// for (an LRU hash of `--ct-max` entries), holding `entries`, pinned at
/// `pin` in place of what was there: the pin an earlier loader left.
fn pin_ct_map<K: aya::Pod, V: aya::Pod>(pin: &std::path::Path, entries: &[(K, V)]) -> u32 {
    use std::os::fd::AsFd as _;
    let like = pinned_map_info(&pin.with_file_name(MAP_CT4));
    let fd = sys::map_create(
        like.map_type,
        size_of::<K>() as u32,
        size_of::<V>() as u32,
        like.max_entries,
        like.map_flags,
    )
    .expect("creating a conntrack map");
    for (key, value) in entries {
        sys::update(fd.as_fd(), key, value, 0).expect("writing an entry");
    }
    match std::fs::remove_file(pin) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => panic!("removing {}: {e}", pin.display()),
        _ => {}
    }
    sys::obj_pin(fd.as_fd(), pin).expect("pinning the map");
    sys::map_info(fd.as_fd()).unwrap().id
}

/// `entry` as a loader of the first `ct_entry` layout wrote it.
fn as_v1(entry: &CtEntry) -> CtEntryV1 {
    CtEntryV1 {
        expires: entry.expires,
        packets_fwd: entry.packets_fwd,
        bytes_fwd: entry.bytes_fwd,
        packets_rev: entry.packets_rev,
        bytes_rev: entry.bytes_rev,
        src_identity: entry.src_identity,
        endpoint_id: entry.endpoint_id,
        tcp_state: entry.tcp_state,
        tcp_flags_fwd: entry.tcp_flags_fwd,
        tcp_flags_rev: entry.tcp_flags_rev,
        flags: entry.flags,
        lifetime: entry.lifetime,
    }
}

/// An entry no packet of the test touches, with every field set.
fn idle_entry(seed: u64) -> CtEntryV1 {
    CtEntryV1 {
        expires: u64::MAX - seed,
        packets_fwd: 10 + seed,
        bytes_fwd: 1000 + seed,
        packets_rev: 20 + seed,
        bytes_rev: 2000 + seed,
        src_identity: A,
        endpoint_id: 7,
        tcp_state: CT_TCP_ESTABLISHED,
        tcp_flags_fwd: 0x18,
        tcp_flags_rev: 0x10,
        flags: CT_F_SEEN_REPLY,
        lifetime: 21_600,
    }
}

fn idle_ct4_key(port: u16) -> Ct4Key {
    let (src, dst) = (
        "198.19.250.1:40000".parse().unwrap(),
        std::net::SocketAddrV4::new([198, 19, 250, 2].into(), port),
    );
    Ct4Key::new(src, dst, 6, 0)
}

fn idle_ct6_key(port: u16) -> Ct6Key {
    let src = "[2001:2:0:fa::1]:40000".parse().unwrap();
    let dst = std::net::SocketAddrV6::new("2001:2:0:fa::2".parse().unwrap(), port, 0, 0);
    Ct6Key::new(src, dst, 6, 0)
}

/// svc-loader upgraded across the cached-verdict change: the conntrack maps
/// an earlier loader pinned with 56-byte entries are migrated with every
/// entry, and the established connection keeps its entry (its counters go on
/// from the migrated ones; the verdict is taken again at its next packet).
#[tokio::test]
async fn an_upgrade_from_the_first_ct_entry_layout_keeps_every_connection() {
    let mut node = node(&["a", "b"]).await;
    let mut client = node.client().await;
    apply(&mut client, node.endpoint("a", 1, A, unrestricted(1))).await;
    let b_policy = policy(
        1,
        true,
        true,
        vec![
            entry(Ingress, A, Protocol::Tcp, 8080, 0, Allow),
            entry(Ingress, A, Protocol::Icmpv6, 0, 0, Allow),
        ],
    );
    apply(&mut client, node.endpoint("b", 2, B, b_policy)).await;
    let _server = node.pod("b").tcp_server(8080).unwrap();
    let dst = SocketAddr::new(v4(&node, "b"), 8080);
    let mut held = node.pod("a").tcp_stream(dst, SHORT).expect("connect while allowed");
    echoes(&mut held, b"before the upgrade", SHORT).expect("the connection works");
    assert_eq!(pings(&node, "a", v6(&node, "b")), 3, "a pings b over IPv6");
    drop(client);
    node.loader.kill9();

    // What the earlier loader would have left: the same entries in 56 bytes,
    // plus one idle connection per family.
    let (ct4_pin, ct6_pin) = (node.pins.0.join(MAP_CT4), node.pins.0.join(MAP_CT6));
    let mut old4: Vec<(Ct4Key, CtEntryV1)> = ct_entries::<Ct4Key, CtEntry>(&ct4_pin)
        .iter()
        .map(|(k, v)| (*k, as_v1(v)))
        .collect();
    let mut old6: Vec<(Ct6Key, CtEntryV1)> = ct_entries::<Ct6Key, CtEntry>(&ct6_pin)
        .iter()
        .map(|(k, v)| (*k, as_v1(v)))
        .collect();
    let flow = old4
        .iter()
        .find(|(k, v)| k.protocol == 6 && k.dst().port() == 8080 && v.tcp_state == CT_TCP_ESTABLISHED)
        .copied()
        .unwrap_or_else(|| panic!("the established connection has its entry: {old4:?}"));
    assert!(
        old6.iter().any(|(k, _)| k.protocol == 58),
        "the IPv6 ping has its entry: {old6:?}"
    );
    old4.push((idle_ct4_key(9), idle_entry(4)));
    old6.push((idle_ct6_key(9), idle_entry(6)));
    let old4_id = pin_ct_map(&ct4_pin, &old4);
    let old6_id = pin_ct_map(&ct6_pin, &old6);

    node.loader
        .restart()
        .await
        .expect("the upgraded loader starts on the old pins");
    let mut client = node.client().await;
    client
        .get_datapath_status(pb::GetDatapathStatusRequest {})
        .await
        .expect("the loader serves");

    for (pin, old_id) in [(&ct4_pin, old4_id), (&ct6_pin, old6_id)] {
        let info = pinned_map_info(pin);
        assert_eq!(
            info.value_size as usize,
            size_of::<CtEntry>(),
            "{} has the new layout",
            pin.display()
        );
        assert_ne!(info.id, old_id, "{} names the new map", pin.display());
        let mut migrating = pin.clone().into_os_string();
        migrating.push(svc_loader::datapath::MIGRATING_PIN_SUFFIX);
        assert!(!std::path::Path::new(&migrating).exists(), "no migration pin is left");
    }
    let new4 = ct_entries::<Ct4Key, CtEntry>(&ct4_pin);
    let new6 = ct_entries::<Ct6Key, CtEntry>(&ct6_pin);
    for (key, old) in &old4 {
        let new = new4.get(key).unwrap_or_else(|| panic!("{key:?} was migrated"));
        // Untouched since: the same fields, no cached verdict. (Packets of
        // the test's own flows may have refreshed theirs.)
        if new.policy_revision == 0 {
            assert_eq!(*new, CtEntry::from(*old), "{key:?}");
        }
        assert_eq!(
            (new.src_identity, new.endpoint_id),
            (old.src_identity, old.endpoint_id),
            "{key:?}"
        );
    }
    for (key, old) in &old6 {
        let new = new6.get(key).unwrap_or_else(|| panic!("{key:?} was migrated"));
        if new.policy_revision == 0 {
            assert_eq!(*new, CtEntry::from(*old), "{key:?}");
        }
    }
    for (map, old) in [("ct4", old4.len()), ("ct6", old6.len())] {
        let log = node.loader.log();
        let copied = log
            .lines()
            .filter(|l| l.contains("conntrack map migrated to the current entry layout"))
            .find(|l| l.contains(&format!("map=\"{map}\"")))
            .and_then(|l| l.split("copied=").nth(1)?.split(' ').next()?.parse::<usize>().ok())
            .unwrap_or_else(|| panic!("the migration of {map} is logged with its count: {log}"));
        assert!(copied >= old, "{map}: {copied} of {old} entries counted as copied");
    }
    assert_eq!(
        new4[&idle_ct4_key(9)],
        CtEntry::from(idle_entry(4)),
        "an idle IPv4 entry is as it was"
    );
    assert_eq!(
        new6[&idle_ct6_key(9)],
        CtEntry::from(idle_entry(6)),
        "an idle IPv6 entry is as it was"
    );

    // The connection goes on through the new programs on its migrated entry.
    echoes(&mut held, b"after the upgrade", Duration::from_secs(5)).expect("the connection survives the upgrade");
    let after = ct_entries::<Ct4Key, CtEntry>(&ct4_pin)[&flow.0];
    assert!(
        after.packets_fwd > flow.1.packets_fwd && after.policy_revision != 0,
        "the new datapath took the verdict again and counts on from the migrated entry: {:?} then {after:?}",
        flow.1
    );
}

/// A loader that died half way through the migration (the new map pinned
/// under its temporary name, some entries already touched by the new
/// programs) is finished by the next start: the new map is the one kept,
/// what the new programs wrote wins, and the rest comes from the old map.
#[tokio::test]
async fn an_interrupted_ct_migration_completes_at_the_next_start() {
    let mut node = node(&["a"]).await;
    node.loader.kill9();
    let ct4_pin = node.pins.0.join(MAP_CT4);
    let mut migrating_pin = ct4_pin.clone().into_os_string();
    migrating_pin.push(svc_loader::datapath::MIGRATING_PIN_SUFFIX);
    let migrating_pin = std::path::PathBuf::from(migrating_pin);

    let (touched, copied, stale, only_old) = (idle_ct4_key(1), idle_ct4_key(2), idle_ct4_key(3), idle_ct4_key(4));
    // The new map of the dead loader: one entry the new programs refreshed
    // (a cached verdict), one copied and unchanged since, one copied before
    // the old programs updated it.
    let touched_value = CtEntry {
        policy_revision: 42,
        packets_fwd: 999,
        ..CtEntry::from(idle_entry(1))
    };
    let new_id = pin_ct_map(
        &migrating_pin,
        &[
            (touched, touched_value),
            (copied, CtEntry::from(idle_entry(2))),
            (stale, CtEntry::from(idle_entry(3))),
        ],
    );
    let updated = CtEntryV1 {
        packets_fwd: 5000,
        ..idle_entry(3)
    };
    pin_ct_map(
        &ct4_pin,
        &[
            (touched, idle_entry(1)),
            (copied, idle_entry(2)),
            (stale, updated),
            (only_old, idle_entry(4)),
        ],
    );

    node.loader
        .restart()
        .await
        .expect("the loader starts after an interrupted migration");
    let mut client = node.client().await;
    client
        .get_datapath_status(pb::GetDatapathStatusRequest {})
        .await
        .expect("the loader serves");

    assert!(!migrating_pin.exists(), "the migration pin was moved over the old one");
    assert_eq!(
        pinned_map_info(&ct4_pin).id,
        new_id,
        "the new map of the interrupted run is kept"
    );
    let entries = ct_entries::<Ct4Key, CtEntry>(&ct4_pin);
    assert_eq!(entries[&touched], touched_value, "what the new programs wrote wins");
    assert_eq!(entries[&copied], CtEntry::from(idle_entry(2)));
    assert_eq!(
        entries[&stale],
        CtEntry::from(updated),
        "an update of the old programs is copied again"
    );
    assert_eq!(
        entries[&only_old],
        CtEntry::from(idle_entry(4)),
        "an entry not copied yet is copied"
    );
    assert_eq!(entries.len(), 4);
}
