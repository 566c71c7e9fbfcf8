//! Issue 12 §2 end to end: svc-endpoint with the real svc-identity,
//! svc-ipam and svc-loader, and namespace pods. An ipBlock matches pod
//! addresses (an egress ipBlock of B's /32 lets A reach B), and `except` is
//! decided per address: two pods of one identity fall on different sides;
//! an egress ipBlock naming a port resolves it per pod address.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use rivet_proto::endpoint::v1 as pb;
use rivet_proto::loader::v1 as ldpb;
use rivet_testkit::node::{EndpointNode, NodeOptions};
use support::{pings, until};

/// X and B share one identity, yet `192.0.0.0/4 except X/32` denies only X;
/// the same for ingress with two clients of one identity. `rivet bpf policy
/// get` shows the address entries and their prefixes.
#[tokio::test(flavor = "multi_thread")]
async fn ipblocks_match_pod_addresses_and_except_is_per_address() {
    let mut node = EndpointNode::start(NodeOptions::default())
        .await
        .expect("the node's daemons start");
    node.add_pod("a", &["k8s:app=client"]).await;
    let a2 = node.add_pod("a2", &["k8s:app=client"]).await;
    let b = node.add_pod("b", &["k8s:app=web"]).await;
    let x = node.add_pod("x", &["k8s:app=web"]).await;
    assert_eq!(b.identity, x.identity, "b and x share one identity");
    let (a2_ip, b_ip, x_ip) = (node.ipv4("a2"), node.ipv4("b"), node.ipv4("x"));
    let egress = |to: &str| {
        format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: clients-out, namespace: default}}\n\
             spec:\n  podSelector: {{matchLabels: {{app: client}}}}\n  policyTypes: [Egress]\n  egress:\n  - to: [{to}]\n"
        )
    };

    node.apply_policy(&egress(&format!("{{ipBlock: {{cidr: {b_ip}/32}}}}")))
        .await;
    assert!(pings(&node, "a", "b"), "egress ipBlock {b_ip}/32 lets a reach b");
    assert!(!pings(&node, "a", "x"), "x has b's identity but not its address");

    node.apply_policy(&egress(&format!(
        "{{ipBlock: {{cidr: 192.0.0.0/4, except: [{x_ip}/32]}}}}"
    )))
    .await;
    assert!(pings(&node, "a", "b"), "192.0.0.0/4 except x: a reaches b");
    assert!(!pings(&node, "a", "x"), "the except denies x, and only x");

    node.apply_policy(&format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: web-in, namespace: default}}\n\
         spec:\n  podSelector: {{matchLabels: {{app: web}}}}\n  ingress:\n  \
         - from: [{{ipBlock: {{cidr: 198.18.0.0/15, except: [{a2_ip}/32]}}}}]\n"
    ))
    .await;
    assert!(pings(&node, "a", "b"), "ingress: a is inside the block");
    assert!(
        !pings(&node, "a2", "b"),
        "ingress: a2 shares a's identity but is excepted"
    );

    // The datapath view names the address entries and their prefixes.
    let output = std::process::Command::new(rivet_common::testing::workspace_binary("rivet"))
        .arg("--socket-dir")
        .arg(node.sockets())
        .args(["bpf", "policy", "get", &a2.id.to_string()])
        .output()
        .expect("the rivet CLI runs");
    let shown = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(
        shown.contains("addr:") && shown.contains("192.0.0.0/4") && shown.contains(&format!("{x_ip}/32")),
        "rivet bpf policy get shows the address entries and prefixes:\n{shown}"
    );
}

/// Issue 12 §2: an egress ipBlock naming a port lets a client reach each
/// pod inside the block on that pod's own number, and nothing else: web-0
/// and web-1 share an identity but name `http` 8080 and 8081. Each pod's
/// address gets a CIDR identity of its host prefix, which goes with the pod.
#[tokio::test(flavor = "multi_thread")]
async fn an_egress_ipblock_naming_a_port_reaches_each_pod_on_its_own_number() {
    let mut node = EndpointNode::start(NodeOptions::default())
        .await
        .expect("the node's daemons start");
    let client = node.add_pod("client", &["k8s:app=client"]).await;
    let mut webs = Vec::new();
    for (name, port) in [("web-0", 8080), ("web-1", 8081)] {
        let http = pb::NamedPort {
            name: "http".into(),
            protocol: "TCP".into(),
            port,
        };
        webs.push(node.add_pod_with_ports(name, &["k8s:app=web"], vec![http]).await);
    }
    assert_eq!(webs[0].identity, webs[1].identity, "web-0 and web-1 share one identity");
    let _servers: Vec<_> = ["web-0", "web-1"]
        .into_iter()
        .flat_map(|pod| [8080, 8081].map(|port| node.pod(pod).tcp_server(port).expect("a server")))
        .collect();
    let reaches = |to: &str, port: u16| {
        node.pod("client")
            .tcp_echo(SocketAddr::new(node.ipv4(to), port), Duration::from_millis(500))
            .expect("the harness can run a TCP probe")
    };
    node.apply_policy(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: clients-out, namespace: default}\n\
         spec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  \
         - to: [{ipBlock: {cidr: 198.18.0.0/15}}]\n    ports: [{port: http}]\n",
    )
    .await;
    assert!(reaches("web-0", 8080), "web-0's http is 8080");
    assert!(!reaches("web-0", 8081), "web-0 does not name 8081");
    assert!(reaches("web-1", 8081), "web-1's http is 8081");
    assert!(!reaches("web-1", 8080), "web-1 does not name 8080");

    // web-1 goes: its host prefix leaves the client's policy and its CIDR
    // identity is released (the ipcache holds nothing at its address).
    let web1_host = rivet_proto::net::IpPrefix {
        address: rivet_proto::net::address_bytes(node.ipv4("web-1")),
        prefix_length: 32,
    };
    node.delete_endpoint(webs[1].id).await;
    until(
        Duration::from_secs(10),
        "web-1's host prefix leaves the client's policy and the ipcache",
        async || {
            let held = node.datapath_policy(client.id).await;
            let ipcache = node
                .node
                .client()
                .await
                .list_ipcache(ldpb::ListIpcacheRequest::default())
                .await
                .expect("ListIpcache")
                .into_inner();
            let in_policy = held.prefixes.iter().any(|p| p.prefix.as_ref() == Some(&web1_host));
            let in_ipcache = ipcache.entries.iter().any(|e| e.prefix.as_ref() == Some(&web1_host));
            if !in_policy && !in_ipcache {
                Ok(())
            } else {
                Err(format!(
                    "still in the client's policy ({in_policy}) or the ipcache ({in_ipcache})"
                ))
            }
        },
    )
    .await;
    assert!(reaches("web-0", 8080), "web-0 is still reached on its own number");
}

/// Issue 16: a pod on another node (an ipcache entry svc-endpoint did not
/// make) declares named ports; egress rules naming them resolve against it,
/// by address (an ipBlock) and by identity (a podSelector), as for a local
/// pod, and go when its entry goes.
#[tokio::test(flavor = "multi_thread")]
async fn another_nodes_pod_resolves_named_ports_of_egress_rules_until_it_goes() {
    use rivet_common::grpc::{ClientOptions, connect_unix};
    use rivet_proto::identity::v1 as idpb;
    use rivet_proto::identity::v1::ipcache_service_client::IpcacheServiceClient;

    let mut node = EndpointNode::start(NodeOptions::default())
        .await
        .expect("the node's daemons start");
    let client = node.add_pod("client", &["k8s:app=client"]).await;
    node.apply_policy(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: clients-out, namespace: default}\n\
         spec:\n  podSelector: {matchLabels: {app: client}}\n  policyTypes: [Egress]\n  egress:\n  \
         - to: [{ipBlock: {cidr: 198.18.200.0/24}}]\n    ports: [{port: http}]\n  \
         - to: [{podSelector: {matchLabels: {app: client}}}]\n    ports: [{port: metrics}]\n",
    )
    .await;
    let remote = "198.18.200.7".parse().unwrap();
    let remote_host = rivet_proto::net::host_prefix(remote);
    // What the client's datapath policy resolves the two names to: the
    // remote host prefix and the ports of address and identity entries.
    let resolved = async |node: &EndpointNode| {
        let held = node.datapath_policy(client.id).await;
        let prefix = held.prefixes.iter().any(|p| p.prefix.as_ref() == Some(&remote_host));
        let ports = |kind: ldpb::PeerKind| -> Vec<u32> {
            held.entries
                .iter()
                .filter_map(|e| e.entry.as_ref())
                .filter(|e| e.peer_kind == kind as i32 && e.direction == ldpb::Direction::Egress as i32)
                .map(|e| e.port)
                .collect()
        };
        (prefix, ports(ldpb::PeerKind::Address), ports(ldpb::PeerKind::Identity))
    };
    let (prefix, by_address, by_identity) = resolved(&node).await;
    assert!(
        !prefix && !by_address.contains(&9090) && !by_identity.contains(&9100),
        "nothing names http or metrics yet: {prefix} {by_address:?} {by_identity:?}"
    );

    let mut ipcache = IpcacheServiceClient::new(
        connect_unix(node.identity.socket(), &ClientOptions::default())
            .await
            .expect("svc-identity's socket"),
    );
    let port = |name: &str, port| idpb::NamedPort {
        name: name.into(),
        protocol: "TCP".into(),
        port,
    };
    ipcache
        .upsert_ip(idpb::UpsertIpRequest {
            entries: vec![idpb::IpcacheEntry {
                prefix: Some(remote_host.clone()),
                identity: client.identity,
                host_ip: rivet_proto::net::address_bytes("198.19.254.2".parse().unwrap()),
                source: idpb::IpcacheSource::Kubernetes as i32,
                named_ports: vec![port("http", 9090), port("metrics", 9100)],
                ..Default::default()
            }],
        })
        .await
        .expect("another node's pod enters the ipcache");
    until(
        Duration::from_secs(10),
        "the remote pod's named ports resolve",
        async || match resolved(&node).await {
            (true, a, i) if a.contains(&9090) && i.contains(&9100) => Ok(()),
            other => Err(format!("resolved (prefix, by address, by identity): {other:?}")),
        },
    )
    .await;

    ipcache
        .delete_ip(idpb::DeleteIpRequest {
            prefixes: vec![remote_host.clone()],
            source: idpb::IpcacheSource::Kubernetes as i32,
        })
        .await
        .expect("the remote pod leaves the ipcache");
    until(
        Duration::from_secs(10),
        "the remote pod's named ports are withdrawn",
        async || match resolved(&node).await {
            (false, a, i) if !a.contains(&9090) && !i.contains(&9100) => Ok(()),
            other => Err(format!("resolved (prefix, by address, by identity): {other:?}")),
        },
    )
    .await;
}
