//! Services and EndpointSlices made through a real kube-apiserver reach
//! the node's service catalog (svc-endpoint, origin KUBERNETES) through
//! svc-k8s-sync: created, a condition changed (ready → terminating),
//! deleted, and replayed to a restarted svc-endpoint (what changed in the
//! API while it was down is what it serves after).
//!
//! Needs root, a bpffs, kube-apiserver and etcd 3.6 (`cargo xtask
//! install`) and the workspace binaries (`cargo build --bins`).

mod support;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use rivet_common::grpc::{ClientOptions, connect_unix};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::service_catalog_service_client::ServiceCatalogServiceClient;
use serde_json::json;
use support::{CONVERGE, Cluster, eventually};

/// A ClusterIP Service without selector (no controller-manager runs: its
/// EndpointSlices are made by the test) in the API server's service range
/// (`rivet_testkit::kube::SERVICE_CLUSTER_IP_RANGE`).
fn service(name: &str, cluster_ip: &str) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "namespace": "shop", "name": name },
        "spec": {
            "clusterIP": cluster_ip,
            "ports": [{ "name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080 }],
        },
    }))
    .expect("a Service")
}

/// An EndpointSlice of Service `service` with `endpoints` as (address,
/// ready, serving, terminating).
fn slice(name: &str, service: &str, endpoints: &[(&str, bool, bool, bool)]) -> EndpointSlice {
    let endpoints: Vec<_> = endpoints
        .iter()
        .map(|(address, ready, serving, terminating)| {
            json!({
                "addresses": [address],
                "conditions": { "ready": ready, "serving": serving, "terminating": terminating },
            })
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "namespace": "shop", "name": name,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "rivet-test",
            },
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }],
    }))
    .expect("an EndpointSlice")
}

/// The node's services (`rivet service list`'s source: svc-endpoint's
/// ServiceCatalogService.ListServices) in namespace `shop`.
async fn services(cluster: &Cluster) -> Result<Vec<pb::ServiceView>, String> {
    let channel = connect_unix(
        &cluster.node.sockets().join("svc-endpoint.sock"),
        &ClientOptions::default(),
    )
    .await
    .map_err(|e| e.to_string())?;
    ServiceCatalogServiceClient::new(channel)
        .list_services(pb::ListServicesRequest {
            namespace: "shop".into(),
        })
        .await
        .map(|r| r.into_inner().services)
        .map_err(|e| e.to_string())
}

/// Waits until service `shop/name` is listed and `ok`, or, with `ok` =
/// `None`, until it is not listed.
async fn wait_service(
    cluster: &Cluster,
    name: &str,
    ok: Option<&dyn Fn(&pb::ServiceView) -> bool>,
) -> Option<pb::ServiceView> {
    eventually(&format!("service shop/{name}"), CONVERGE, || async {
        let listed = services(cluster).await?;
        let found = listed.iter().find(|s| s.name == name);
        match (found, ok) {
            (Some(s), Some(ok)) if ok(s) => Ok(Some(s.clone())),
            (None, None) => Ok(None),
            _ => Err(format!("{listed:#?}")),
        }
    })
    .await
}

/// (address, ready, serving, terminating) of each backend, sorted.
fn backends(service: &pb::ServiceView) -> Vec<(String, bool, bool, bool)> {
    let mut out: Vec<_> = service
        .backends
        .iter()
        .map(|b| (b.address.clone(), b.ready, b.serving, b.terminating))
        .collect();
    out.sort();
    out
}

fn owned(endpoints: &[(&str, bool, bool, bool)]) -> Vec<(String, bool, bool, bool)> {
    endpoints
        .iter()
        .map(|(a, r, s, t)| (a.to_string(), *r, *s, *t))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn services_and_endpoint_slices_made_in_the_api_reach_the_catalog_change_go_and_are_replayed() {
    let mut cluster = Cluster::start().await;
    cluster.namespace("shop", &[]).await;
    let services_api: Api<Service> = Api::namespaced(cluster.admin(), "shop");
    let slices_api: Api<EndpointSlice> = Api::namespaced(cluster.admin(), "shop");

    // Created in the API: listed on the node with its clusterIP and backends.
    let ready = [("198.18.0.200", true, true, false), ("198.18.0.201", true, true, false)];
    services_api
        .create(&PostParams::default(), &service("web", "198.19.255.10"))
        .await
        .expect("the Service is created");
    slices_api
        .create(&PostParams::default(), &slice("web-1", "web", &ready))
        .await
        .expect("the EndpointSlice is created");
    let want = owned(&ready);
    let web = wait_service(&cluster, "web", Some(&|s| backends(s) == want))
        .await
        .expect("listed");
    assert_eq!(web.origin, pb::ServiceOrigin::Kubernetes as i32);
    assert_eq!(web.cluster_ips, ["198.19.255.10"]);
    assert_eq!(web.ports.len(), 1);
    assert_eq!((web.ports[0].port, web.ports[0].protocol.as_str()), (80, "TCP"));
    assert!(
        web.backends.iter().all(|b| b.port == 8080),
        "the slice's port: {:?}",
        web.backends
    );
    let listed = std::process::Command::new(rivet_common::testing::workspace_binary("rivet"))
        .arg("--socket-dir")
        .arg(cluster.node.sockets())
        .args(["service", "list"])
        .output()
        .expect("rivet service list runs");
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(
        listed.status.success() && text.contains("web") && text.contains("198.19.255.10"),
        "`rivet service list` on the node shows shop/web: {text}{}",
        String::from_utf8_lossy(&listed.stderr)
    );

    // A condition changed in the API (the pod behind .201 is terminating
    // and still serving): the backend is terminating on the node.
    let terminating = [("198.18.0.200", true, true, false), ("198.18.0.201", false, true, true)];
    slices_api
        .patch(
            "web-1",
            &PatchParams::apply("rivet-test").force(),
            &Patch::Apply(slice("web-1", "web", &terminating)),
        )
        .await
        .expect("the EndpointSlice is patched");
    let want = owned(&terminating);
    wait_service(&cluster, "web", Some(&|s| backends(s) == want)).await;

    // While svc-endpoint is down: `web` is deleted and `api` created in the
    // API. The restarted svc-endpoint keeps its catalog on disk; the replay
    // after its new boot_id makes it forget `web` and learn `api`.
    let replays = cluster.sync_status().await.fed[0].replays;
    cluster
        .node
        .endpoint_daemon()
        .terminate()
        .await
        .expect("svc-endpoint stops");
    services_api
        .delete("web", &DeleteParams::default())
        .await
        .expect("the Service is deleted");
    slices_api
        .delete("web-1", &DeleteParams::default())
        .await
        .expect("the EndpointSlice is deleted");
    services_api
        .create(&PostParams::default(), &service("api", "198.19.255.11"))
        .await
        .expect("the second Service is created");
    let api_backends = [("198.18.0.210", true, true, false)];
    slices_api
        .create(&PostParams::default(), &slice("api-1", "api", &api_backends))
        .await
        .expect("the second EndpointSlice is created");
    cluster
        .node
        .endpoint_daemon()
        .restart()
        .await
        .expect("svc-endpoint restarts");
    cluster.wait_replayed(replays + 1).await;
    let want = owned(&api_backends);
    let api = wait_service(&cluster, "api", Some(&|s| backends(s) == want))
        .await
        .expect("listed");
    assert_eq!(api.cluster_ips, ["198.19.255.11"]);
    wait_service(&cluster, "web", None).await;

    // Deleted in the API: gone from the node.
    services_api
        .delete("api", &DeleteParams::default())
        .await
        .expect("the Service is deleted");
    slices_api
        .delete("api-1", &DeleteParams::default())
        .await
        .expect("the EndpointSlice is deleted");
    wait_service(&cluster, "api", None).await;
    let status = cluster.sync_status().await;
    assert!(
        !status.fed[0].last_error.contains("shop"),
        "none of the test's objects was refused: {status:?}"
    );
}
