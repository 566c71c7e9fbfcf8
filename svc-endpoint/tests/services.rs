//! The service catalog with real daemons (testkit's node: svc-loader in a
//! node namespace, svc-ipam, svc-identity, svc-endpoint, real pods):
//! - a Service with a selector takes the matching pods as backends through
//!   their named port, a pod added later joins, a deleted one leaves;
//! - kill -9 of svc-endpoint: the restarted one keeps every Service, its
//!   cluster IPs and service ids, and resolves the same backends.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::service_catalog_service_client::ServiceCatalogServiceClient;
use rivet_testkit::node::{EndpointNode, NodeOptions};

const DEADLINE: Duration = Duration::from_secs(20);

const WEB: &str = "\
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  ipFamilyPolicy: PreferDualStack
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: http}]
";

async fn start_node() -> EndpointNode {
    EndpointNode::start(NodeOptions {
        endpoint_args: [
            "--service-cidr",
            "198.19.128.0/20",
            "--service-cidr",
            "2001:2:0:ff::/112",
        ]
        .map(String::from)
        .to_vec(),
        ..NodeOptions::default()
    })
    .await
    .expect("the node starts")
}

async fn catalog(node: &EndpointNode) -> ServiceCatalogServiceClient<DaemonChannel> {
    let socket = node.sockets().join("svc-endpoint.sock");
    let channel = connect_unix(&socket, &ClientOptions::default())
        .await
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", socket.display()));
    ServiceCatalogServiceClient::new(channel)
}

async fn get(node: &EndpointNode, name: &str) -> pb::ServiceView {
    catalog(node)
        .await
        .get_service(pb::GetServiceRequest {
            namespace: "default".into(),
            name: name.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("getting Service {name}: {e}"))
        .into_inner()
        .service
        .expect("a service")
}

/// `address:port` of every backend of `service`.
fn backends(service: &pb::ServiceView) -> BTreeSet<String> {
    service
        .backends
        .iter()
        .map(|b| {
            let address: std::net::IpAddr = b.address.parse().expect("an address");
            std::net::SocketAddr::new(address, u16::try_from(b.port).expect("a port")).to_string()
        })
        .collect()
}

/// `address:8080` of each address of `endpoint`.
fn at_http(endpoint: &pb::Endpoint) -> BTreeSet<String> {
    endpoint
        .addresses
        .iter()
        .map(|a| {
            let address = rivet_proto::net::address_from_bytes(&a.address).expect("an address");
            std::net::SocketAddr::new(address, 8080).to_string()
        })
        .collect()
}

/// Polls the Service until its backends are `want`.
async fn wait_backends(node: &EndpointNode, name: &str, want: &BTreeSet<String>) -> pb::ServiceView {
    let started = Instant::now();
    loop {
        let service = get(node, name).await;
        if backends(&service) == *want {
            return service;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "Service {name}'s backends are {:?}, not {want:?}, after {DEADLINE:?}",
            backends(&service)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn http_port() -> Vec<pb::NamedPort> {
    vec![pb::NamedPort {
        name: "http".into(),
        protocol: "TCP".into(),
        port: 8080,
    }]
}

#[tokio::test(flavor = "multi_thread")]
async fn a_selector_service_follows_its_pods_and_keeps_its_addresses_and_ids_across_kill_9() {
    let mut node = start_node().await;
    let web1 = node.add_pod_with_ports("web-1", &["k8s:app=web"], http_port()).await;
    node.add_pod_with_ports("db-1", &["k8s:app=db"], http_port()).await;

    let applied = catalog(&node)
        .await
        .apply_service_object(pb::ApplyServiceObjectRequest {
            document: WEB.into(),
            origin: pb::ServiceOrigin::Api as i32,
            wait: false,
        })
        .await
        .expect("the Service applies")
        .into_inner();
    assert_eq!(applied.cluster_ips, ["198.19.128.1", "2001:2:0:ff::1"]);

    // web-1 on both families, at its named port; db-1 is not selected.
    let service = wait_backends(&node, "web", &at_http(&web1)).await;
    assert_eq!(service.load_balancer.len(), 2, "one loader service per family");

    // A pod added with matching labels joins; a deleted one leaves.
    let web2 = node.add_pod_with_ports("web-2", &["k8s:app=web"], http_port()).await;
    let both: BTreeSet<String> = at_http(&web1).union(&at_http(&web2)).cloned().collect();
    wait_backends(&node, "web", &both).await;
    node.delete_endpoint(web1.id).await;
    let before = wait_backends(&node, "web", &at_http(&web2)).await;

    // kill -9: the restarted svc-endpoint has the same Service, addresses and ids.
    let stored = std::fs::read_dir(node.state_dir().join("services"))
        .expect("the services dir")
        .count();
    assert_eq!(stored, 1, "one object stored");
    node.endpoint_daemon().kill9();
    node.endpoint_daemon().restart().await.expect("svc-endpoint restarts");
    let after = wait_backends(&node, "web", &at_http(&web2)).await;
    assert_eq!(after.cluster_ips, before.cluster_ips);
    let ids = |s: &pb::ServiceView| {
        s.load_balancer
            .iter()
            .map(|e| (e.family.clone(), e.service_id))
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&after), ids(&before));

    // The same document again changes nothing.
    let again = catalog(&node)
        .await
        .apply_service_object(pb::ApplyServiceObjectRequest {
            document: WEB.into(),
            origin: pb::ServiceOrigin::Api as i32,
            wait: false,
        })
        .await
        .expect("the Service applies again")
        .into_inner();
    assert!(!again.changed, "restored exactly as stored");
    assert_eq!(again.cluster_ips, applied.cluster_ips);
}
