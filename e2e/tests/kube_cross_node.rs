//! Pods on different nodes of the real cluster reach each other through
//! Rivet installed with `kubectl apply -k deploy/` (its default: the CRD
//! store, native routing): control plane and two kubelet + containerd
//! workers of `rivet_e2e::kube_cluster`, started with no CNI and the Rivet
//! image of this run's binaries.
//!
//! - A pod on node 1 and a pod on node 2 each ping the other and get a
//!   line echoed over TCP (IPv4: the operator's cluster pool is IPv4 only);
//!   the routes come from the RivetNodes (svc-identity's registry in CRD
//!   mode) and nothing else routes between the workers.
//! - Policy holds across nodes: a NetworkPolicy on the node-2 pod admitting
//!   only `role=client` lets the node-1 client through and refuses another
//!   pod of node 1, so the node-1 pods' identities reached node 2's IP
//!   cache (from their RivetEndpoints).
//!
//! Needs root, containerd, runc, ctr, /usr/lib/cni, busybox-static, the
//! Kubernetes tools (`cargo xtask install`) and the workspace's binaries
//! (`cargo build --bins`).

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use rivet_common::testing::workspace_binary;
use rivet_e2e::cross_node::{echo_pod, echoes, pods_reach_each_other};
use rivet_e2e::kube_cluster::{KubeCluster, KubeClusterOptions, WorkerCni};
use rivet_e2e::kube_deploy::{DEPLOY_TAG, deploy_dir, poll, write_rivet_archives};

/// How long one step may wait for the cluster.
const STEP_TIMEOUT: Duration = Duration::from_secs(120);
/// The echo pods' port.
const ECHO_PORT: u16 = 9000;

/// `kubectl <args>` with `stdin`; panics with its output on failure.
fn kubectl(cluster: &KubeCluster, args: &[&str], stdin: Option<&str>) -> String {
    use std::io::Write as _;
    let mut child = cluster
        .kubectl()
        .unwrap()
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running kubectl");
    let mut input = child.stdin.take().expect("piped");
    if let Some(stdin) = stdin {
        input.write_all(stdin.as_bytes()).expect("writing kubectl's stdin");
    }
    drop(input);
    let out = child.wait_with_output().expect("waiting for kubectl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "kubectl {args:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The address of pod `name` once it runs.
async fn running(pods: &Api<Pod>, name: &str) -> IpAddr {
    poll(&format!("pod {name} Running with an address"), STEP_TIMEOUT, || async {
        let pod = pods.get(name).await.map_err(|e| e.to_string())?;
        let status = pod.status.unwrap_or_default();
        match (status.phase.as_deref(), status.pod_ip.and_then(|ip| ip.parse().ok())) {
            (Some("Running"), Some(ip)) => Ok(ip),
            (phase, _) => Err(format!("phase {phase:?}")),
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_on_two_nodes_reach_each_other_and_policy_holds_across_them() {
    let images = tempfile::Builder::new().prefix("rivet-e2e-xnode-").tempdir().unwrap();
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

    kubectl(&cluster, &["apply", "-k", &deploy_dir().display().to_string()], None);
    let daemonsets: Api<DaemonSet> = Api::namespaced(cluster.admin_client(), "kube-system");
    poll("rivet-node Ready on both nodes", STEP_TIMEOUT, || async {
        let status = daemonsets
            .get("rivet-node")
            .await
            .map_err(|e| e.to_string())?
            .status
            .unwrap_or_default();
        if status.desired_number_scheduled == 2 && status.number_ready == 2 {
            Ok(())
        } else {
            Err(format!("{status:?}"))
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    let (node1, node2) = (&cluster.workers()[0].name, &cluster.workers()[1].name);
    let objects = [
        echo_pod("server", node2, serde_json::json!({ "role": "server" }), ECHO_PORT),
        echo_pod("client", node1, serde_json::json!({ "role": "client" }), ECHO_PORT),
        echo_pod("intruder", node1, serde_json::json!({ "role": "intruder" }), ECHO_PORT),
    ];
    let list = serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": objects }).to_string();
    kubectl(&cluster, &["apply", "-f", "-"], Some(&list));
    let pods: Api<Pod> = Api::namespaced(cluster.admin_client(), "default");
    let (server, client, intruder) = (
        running(&pods, "server").await,
        running(&pods, "client").await,
        running(&pods, "intruder").await,
    );
    let kubectl_command = || cluster.kubectl().unwrap();

    // Across the nodes, both ways (the first answer may wait for the peers'
    // routes; from then on every check must pass at once).
    poll(
        "client (node 1) and server (node 2) reach each other",
        STEP_TIMEOUT,
        || async { pods_reach_each_other(&kubectl_command, ("client", client), ("server", server), ECHO_PORT) },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    pods_reach_each_other(&kubectl_command, ("intruder", intruder), ("server", server), ECHO_PORT)
        .unwrap_or_else(|e| panic!("no policy yet: {e}"));

    // Policy across nodes: the server admits role=client only.
    let policy = serde_json::json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": { "name": "server-from-clients", "namespace": "default" },
        "spec": {
            "podSelector": { "matchLabels": { "role": "server" } },
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [{ "podSelector": { "matchLabels": { "role": "client" } } }],
                "ports": [{ "protocol": "TCP", "port": ECHO_PORT }]
            }]
        }
    });
    kubectl(&cluster, &["apply", "-f", "-"], Some(&policy.to_string()));
    poll(
        "the intruder on node 1 refused by the server's policy",
        STEP_TIMEOUT,
        || async {
            match echoes(&kubectl_command, "intruder", server, ECHO_PORT) {
                Ok(()) => Err("the intruder still gets through".to_string()),
                Err(_) => Ok(()),
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    echoes(&kubectl_command, "client", server, ECHO_PORT)
        .unwrap_or_else(|e| panic!("the client on node 1 is admitted by its identity: {e}"));
    // Replies of the allowed flow and traffic the server starts are not
    // ingress to it: the server still reaches the client.
    echoes(&kubectl_command, "server", client, ECHO_PORT)
        .unwrap_or_else(|e| panic!("the server reaches the client: {e}"));
}
