//! Issue 12 §2 end to end: svc-endpoint with the real svc-identity,
//! svc-ipam and svc-loader, and namespace pods. An ipBlock matches pod
//! addresses (an egress ipBlock of B's /32 lets A reach B), and `except` is
//! decided per address: two pods of one identity fall on different sides.

use std::time::Duration;

use svc_endpoint::testing::{EndpointNode, NodeOptions};

fn pings(node: &EndpointNode, from: &str, to: &str) -> bool {
    node.pod(from)
        .ping(node.ipv4(to), 1, Duration::from_millis(10), Duration::from_millis(500))
        .expect("the harness can ping")
        .received
        == 1
}

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
