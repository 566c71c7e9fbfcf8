//! NodePort through the whole stack (issue 17 §3 "NodePort from a client
//! namespace on the underlay, both traffic policies"): a 2-node cluster of
//! the testkit fixture (the real `rivet cluster up`, native routing), a
//! backend pod on each node, Services of type NodePort applied with
//! `rivet cluster service apply` (svc-endpoint's catalog resolves the
//! selector, svc-loader's LoadBalancerService programs the maps), and a
//! client host on the underlay bridge.
//!
//! - externalTrafficPolicy Cluster: through node 1 both pods answer; the
//!   one on node 1 sees the client's address, the one on node 2 node 1's
//!   (SNAT);
//! - externalTrafficPolicy Local: through each node only its own pod
//!   answers, and sees the client's address.
//!
//! Needs root, a bpffs at /sys/fs/bpf, the rivet users and etcd 3.6
//! (`cargo xtask install`) and the workspace binaries (`cargo build
//! --bins`).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rivet_common::testing::netns::NetNs;
use rivet_testkit::cluster::{Cluster, ClusterOptions, Routing};
use rivet_testkit::service::{NameServer, peers_by_server};

const BACKEND_PORT: u16 = 8080;
const TIMEOUT: Duration = Duration::from_secs(3);
/// New connections per check: both backends of two missed by chance is 2^-29.
const CONNECTIONS: usize = 30;

fn service_yaml(name: &str, cluster_ip: &str, node_port: u16, policy: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  type: NodePort\n  \
         clusterIP: {cluster_ip}\n  externalTrafficPolicy: {policy}\n  selector: {{app: web}}\n  ports: [{{name: http, \
         port: 80, targetPort: {BACKEND_PORT}, nodePort: {node_port}}}]\n"
    )
}

/// Who answered `CONNECTIONS` new connections from `ns` to `dst`, with
/// the client address each saw.
fn answers(ns: &NetNs, dst: SocketAddr) -> BTreeMap<String, Vec<IpAddr>> {
    peers_by_server(ns, dst, CONNECTIONS, TIMEOUT)
}

#[tokio::test]
async fn nodeport_services_from_outside_the_cluster_both_traffic_policies() {
    let mut cluster = Cluster::start(ClusterOptions {
        nodes: 2,
        routing: Routing::Native,
        ..Default::default()
    })
    .await
    .expect("the cluster starts");
    let web1 = cluster.add_pod(1, "default", "web1", &["app=web"]).await;
    let web2 = cluster.add_pod(2, "default", "web2", &["app=web"]).await;
    cluster.wait_converged().await;
    let _servers = [
        NameServer::start_reporting_peer(&web1.netns, "web1", &[web1.socket_v4(BACKEND_PORT)]).unwrap(),
        NameServer::start_reporting_peer(&web2.netns, "web2", &[web2.socket_v4(BACKEND_PORT)]).unwrap(),
    ];
    let (cluster_ip, local_ip): (IpAddr, IpAddr) = ("198.19.128.20".parse().unwrap(), "198.19.128.21".parse().unwrap());
    cluster
        .apply_service(&service_yaml("web", "198.19.128.20", 30080, "Cluster"))
        .await;
    cluster
        .apply_service(&service_yaml("web-local", "198.19.128.21", 30081, "Local"))
        .await;
    // Each node holds both pods as backends, exactly one of them its own.
    let both_one_local = |list: &[rivet_proto::loader::v1::LbServiceStatus]| {
        list.iter().all(|s| {
            let backends = s.service.as_ref().map_or(&[][..], |s| &s.backends[..]);
            backends.len() == 2 && backends.iter().filter(|b| b.node_local).count() == 1
        })
    };
    cluster.wait_datapath_services(cluster_ip, both_one_local).await;
    cluster.wait_datapath_services(local_ip, both_one_local).await;
    let client = cluster.add_external_client();
    let client_addr = IpAddr::V4(rivet_testkit::loader::ExternalClient::IPV4);
    let node_addr = |i: usize| IpAddr::V4(cluster.node(i).underlay_v4);

    let by_backend = answers(&client.ns, SocketAddr::new(node_addr(1), 30080));
    assert_eq!(
        by_backend.keys().map(String::as_str).collect::<Vec<_>>(),
        ["web1", "web2"],
        "Cluster via node 1: {by_backend:?}"
    );
    assert!(by_backend["web1"].iter().all(|p| *p == client_addr), "{by_backend:?}");
    assert!(by_backend["web2"].iter().all(|p| *p == node_addr(1)), "{by_backend:?}");

    for (via, own) in [(1, "web1"), (2, "web2")] {
        let by_backend = answers(&client.ns, SocketAddr::new(node_addr(via), 30081));
        assert_eq!(
            by_backend.keys().map(String::as_str).collect::<Vec<_>>(),
            [own],
            "Local via node {via}: {by_backend:?}"
        );
        assert!(by_backend[own].iter().all(|p| *p == client_addr), "{by_backend:?}");
    }
}
