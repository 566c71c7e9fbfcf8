//! Rivet installed with `kubectl apply -k deploy/overlays/etcd` on the real
//! cluster (issue 18 §2: the overlay for the etcd identity store): the two
//! kubelet + containerd workers of `rivet_e2e::kube_cluster`, started with
//! no CNI, the Rivet image of this run's binaries imported, the overlay
//! pointed at the cluster's Rivet etcd (`KubeCluster::rivet_etcd_endpoint`,
//! the overlay's default). One scenario, steps in order:
//!
//! 1. The DaemonSet is Ready on both nodes and each RivetNode got a pod CIDR.
//! 2. A server pod on node 2 and two client pods on node 1 get addresses of
//!    their node's pod CIDR, and both clients ping the server and get a
//!    line echoed across the nodes: each node's svc-identity took its pod
//!    CIDRs from rivet-operator's mirror of its RivetNode in etcd, so the
//!    peers route them (before, the overlay had routing off).
//! 3. A NetworkPolicy letting only `role=client` reach the server: the
//!    other pod on node 1 is refused, the client gets through; node 2
//!    knows node 1's pods' identities from etcd.
//! 4. The identities live in etcd: no RivetIdentity object exists, and
//!    every pod's RivetEndpoint names a cluster identity.
//!
//! Needs root, containerd, runc, ctr, /usr/lib/cni, busybox-static, the
//! Kubernetes tools and etcd (`cargo xtask install`) and the workspace's
//! binaries (`cargo build --bins`; `cargo test --workspace` builds them).

use std::collections::BTreeMap;
use std::net::IpAddr;

use kube::api::{Api, ListParams};
use rivet_common::testing::workspace_binary;
use rivet_e2e::cross_node;
use rivet_e2e::kube_cluster::{KubeCluster, KubeClusterOptions, WorkerCni};
use rivet_e2e::kube_deploy::{
    DEPLOY_TAG, Scenario, busybox_pod, clients_only_policy, deploy_dir, ready_pods, write_rivet_archives, yaml,
};
use rivet_k8s::RivetEndpoint;

/// The server pod's echo port.
const ECHO_PORT: u16 = 9000;

/// `db` on `node`: busybox echoing every TCP connection on [`ECHO_PORT`].
fn echo_server(node: &str) -> serde_json::Value {
    let mut pod = busybox_pod("db", node, serde_json::json!({ "app": "db" }));
    pod["spec"]["containers"][0]["command"] =
        serde_json::json!(["nc", "-ll", "-p", ECHO_PORT.to_string(), "-e", "/bin/cat"]);
    pod
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_overlay_routes_and_enforces_policy_across_two_nodes() {
    let images = tempfile::Builder::new().prefix("rivet-e2e-etcd-").tempdir().unwrap();
    let bin_dir = workspace_binary("rivet").parent().unwrap().to_path_buf();
    let archives = write_rivet_archives(&bin_dir, images.path(), &[DEPLOY_TAG])
        .unwrap_or_else(|e| panic!("writing the Rivet image from {}: {e}", bin_dir.display()));
    let cluster = KubeCluster::start(KubeClusterOptions {
        cni: WorkerCni::None,
        images: archives,
        ..KubeClusterOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("starting the cluster: {e}"));
    drop(images);
    let overlay = deploy_dir().join("overlays/etcd");
    let kustomization = std::fs::read_to_string(overlay.join("kustomization.yaml")).unwrap();
    assert!(
        kustomization.contains(&format!("etcd-endpoints={}", cluster.rivet_etcd_endpoint())),
        "the overlay names the cluster's Rivet etcd {}:\n{kustomization}",
        cluster.rivet_etcd_endpoint()
    );

    // 1. kubectl apply -k deploy/overlays/etcd.
    let started = std::time::Instant::now();
    let mut scenario = Scenario {
        cluster,
        step: "1 (kubectl apply -k deploy/overlays/etcd)",
    };
    scenario.kubectl(&["apply", "-k", &overlay.display().to_string()]);
    scenario.wait_rivet_node_rolled_out().await;
    let pod_cidrs = scenario.wait_pod_cidrs().await;
    let names: Vec<String> = pod_cidrs.keys().cloned().collect();
    println!(
        "rivet-node (etcd overlay) Ready on both nodes {:.1} s after the apply; pod CIDRs {pod_cidrs:?}",
        started.elapsed().as_secs_f64()
    );

    // 2. Across the nodes.
    scenario.step = "2 (pods on both nodes reach each other)";
    let (node1, node2) = (names[0].clone(), names[1].clone());
    scenario.kubectl_stdin(
        &["apply", "-f", "-"],
        Some(&yaml(&[
            echo_server(&node2),
            busybox_pod("client", &node1, serde_json::json!({ "role": "client" })),
            busybox_pod("intruder", &node1, serde_json::json!({ "role": "intruder" })),
        ])),
    );
    let pods = scenario
        .wait("the db, client and intruder pods Ready", || async {
            ready_pods(&scenario.list_pods("default", "").await, 3)
        })
        .await;
    for (pod, node, ip) in &pods {
        let cidr = &pod_cidrs[node];
        assert!(
            cidr.contains(ip),
            "step {}: pod {pod} on {node} has {ip}, outside its node's pod CIDR {cidr}",
            scenario.step
        );
    }
    let db: IpAddr = pods.iter().find(|(p, _, _)| p == "db").expect("db is listed").2;
    // The first answer says both nodes route each other's CIDR; from then
    // on every pod gets through at once.
    scenario
        .wait("client reaches db on the other node", || async {
            cross_node::reaches(&|| scenario.cluster.kubectl().unwrap(), "client", db, ECHO_PORT)
        })
        .await;
    cross_node::reaches(&|| scenario.cluster.kubectl().unwrap(), "intruder", db, ECHO_PORT)
        .unwrap_or_else(|e| panic!("step {}: intruder → db across the nodes: {e}", scenario.step));

    // 3. A NetworkPolicy across the nodes.
    scenario.step = "3 (a NetworkPolicy across the nodes)";
    let policy = clients_only_policy("db-from-clients", "db", ECHO_PORT);
    scenario.kubectl_stdin(&["apply", "-f", "-"], Some(&policy.to_string()));
    let endpoints: Api<RivetEndpoint> = Api::namespaced(scenario.cluster.admin_client(), "default");
    scenario
        .wait("db's RivetEndpoint ingress-enforced", || {
            let endpoints = endpoints.clone();
            async move {
                let db = endpoints.get("db").await.map_err(|e| e.to_string())?;
                let status = db.status.unwrap_or_default();
                status.ingress_enforced.then_some(()).ok_or(format!("{status:?}"))
            }
        })
        .await;
    let denied = scenario.echoes("intruder", db, ECHO_PORT);
    assert!(
        denied.is_err(),
        "step {}: intruder on {node1} must not reach db on {node2} through the policy",
        scenario.step
    );
    scenario
        .echoes("client", db, ECHO_PORT)
        .unwrap_or_else(|e| panic!("step {}: client → db, allowed: {e}", scenario.step));

    // 4. The identities are etcd's, not RivetIdentity objects.
    scenario.step = "4 (identities in etcd)";
    let objects = scenario.kubectl(&["get", "rivetidentities", "-o", "name"]);
    assert!(
        objects.trim().is_empty(),
        "step {}: the etcd overlay keeps identities out of the API: {objects}",
        scenario.step
    );
    let listed = endpoints.list(&ListParams::default()).await.unwrap();
    let identities: BTreeMap<String, u32> = listed
        .items
        .iter()
        .map(|e| {
            let status = e.status.clone().unwrap_or_default();
            (
                e.metadata.name.clone().unwrap_or_default(),
                status.identity.unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(identities.len(), 3, "step {}: {identities:?}", scenario.step);
    assert!(
        identities.values().all(|id| *id >= 256),
        "step {}: every pod has a cluster identity: {identities:?}",
        scenario.step
    );
    assert_ne!(
        identities["client"], identities["intruder"],
        "step {}: other labels, other identities",
        scenario.step
    );
}
