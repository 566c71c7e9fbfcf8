//! The service catalog with real daemons (testkit's node: svc-loader in a
//! node namespace, svc-ipam, svc-identity, svc-endpoint, real pods):
//! - a Service with a selector takes the matching pods as backends through
//!   their named port, a pod added later joins, a deleted one leaves;
//! - svc-loader holds what the catalog resolves (`wait`), per family;
//! - kill -9 of svc-endpoint: the restarted one keeps every Service, its
//!   cluster IPs and service ids, resolves the same backends and leaves
//!   svc-loader's services exactly as they were (backend ids, tables).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::service_catalog_service_client::ServiceCatalogServiceClient;
use rivet_proto::loader::v1 as lb;
use rivet_proto::loader::v1::load_balancer_service_client::LoadBalancerServiceClient;
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

/// ApplyServiceObject of `document` (origin API, no wait).
async fn apply(node: &EndpointNode, document: &str) -> pb::ApplyServiceObjectResponse {
    catalog(node)
        .await
        .apply_service_object(pb::ApplyServiceObjectRequest {
            document: document.into(),
            origin: pb::ServiceOrigin::Api as i32,
            wait: false,
        })
        .await
        .unwrap_or_else(|e| panic!("applying {document}: {e}"))
        .into_inner()
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

/// svc-loader's services (LoadBalancerService.ListServices), by id.
async fn loader_services(node: &EndpointNode) -> Vec<lb::LbServiceStatus> {
    let socket = node.sockets().join("svc-loader.sock");
    let channel = connect_unix(&socket, &ClientOptions::default())
        .await
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", socket.display()));
    let mut services = LoadBalancerServiceClient::new(channel)
        .list_services(lb::ListServicesRequest::default())
        .await
        .expect("svc-loader lists its services")
        .into_inner()
        .services;
    services.sort_by_key(|s| s.service.as_ref().map_or(0, |s| s.service_id));
    services
}

/// `address:port` of every backend svc-loader holds for `service_id`.
fn loader_backends(services: &[lb::LbServiceStatus], service_id: u32) -> BTreeSet<String> {
    services
        .iter()
        .filter_map(|s| s.service.as_ref())
        .filter(|s| s.service_id == service_id)
        .flat_map(|s| &s.backends)
        .map(|b| {
            let address = rivet_proto::net::address_from_bytes(&b.address).expect("an address");
            std::net::SocketAddr::new(address, u16::try_from(b.port).expect("a port")).to_string()
        })
        .collect()
}

/// Polls until svc-loader holds `want` for the Service's loader services
/// (both families together) and the catalog says each is realised.
async fn wait_loader(node: &EndpointNode, name: &str, want: &BTreeSet<String>) -> Vec<lb::LbServiceStatus> {
    let started = Instant::now();
    loop {
        let service = get(node, name).await;
        let held = loader_services(node).await;
        let backends: BTreeSet<String> = service
            .load_balancer
            .iter()
            .flat_map(|e| loader_backends(&held, e.service_id))
            .collect();
        if backends == *want && service.load_balancer.iter().all(|e| e.realised) {
            return held;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "svc-loader holds {backends:?} for Service {name}, not {want:?} (realised: {:?}), after {DEADLINE:?}",
            service.load_balancer
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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

    let applied = apply(&node, WEB).await;
    assert_eq!(applied.cluster_ips, ["198.19.128.1", "2001:2:0:ff::1"]);

    // web-1 on both families, at its named port; db-1 is not selected.
    let service = wait_backends(&node, "web", &at_http(&web1)).await;
    assert_eq!(service.load_balancer.len(), 2, "one loader service per family");
    let held = wait_loader(&node, "web", &at_http(&web1)).await;
    for entry in &service.load_balancer {
        let loader = held
            .iter()
            .filter_map(|s| s.service.as_ref())
            .find(|s| s.service_id == entry.service_id)
            .unwrap_or_else(|| panic!("svc-loader holds no service {}", entry.service_id));
        let frontend = rivet_proto::net::format_address(&loader.frontends[0].address);
        let want = if entry.family == "IPv4" {
            "198.19.128.1"
        } else {
            "2001:2:0:ff::1"
        };
        assert_eq!((frontend.as_str(), loader.frontends[0].port), (want, 80), "{loader:?}");
        assert_eq!(
            loader_backends(&held, entry.service_id).len(),
            1,
            "{entry:?}: one address per family"
        );
    }

    // A pod added with matching labels joins; a deleted one leaves.
    let web2 = node.add_pod_with_ports("web-2", &["k8s:app=web"], http_port()).await;
    let both: BTreeSet<String> = at_http(&web1).union(&at_http(&web2)).cloned().collect();
    wait_backends(&node, "web", &both).await;
    wait_loader(&node, "web", &both).await;
    node.delete_endpoint(web1.id).await;
    let before = wait_backends(&node, "web", &at_http(&web2)).await;
    let held_before = wait_loader(&node, "web", &at_http(&web2)).await;

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
    // The restarted svc-endpoint replayed the same set: svc-loader's
    // services, backend ids and tables are what they were.
    wait_loader(&node, "web", &at_http(&web2)).await;
    assert_eq!(
        loader_services(&node).await,
        held_before,
        "svc-loader's services changed"
    );

    // The same document again changes nothing.
    let again = apply(&node, WEB).await;
    assert!(!again.changed, "restored exactly as stored");
    assert_eq!(again.cluster_ips, applied.cluster_ips);
}
