//! `kubectl delete -k deploy/` plus draining leaves nothing on the nodes
//! (issue 18 §4; deploy/README.md "Uninstall"), on the real cluster of
//! `rivet_e2e::kube_cluster` (no CNI until Rivet's DaemonSet installs it):
//!
//! 1. `kubectl apply -k deploy/`, the DaemonSet rolled out, a busybox pod
//!    on each node Running on a Rivet address: the nodes hold Rivet's pins,
//!    filters, veths, CNI files and sockets (the check sees them).
//! 2. `kubectl drain --ignore-daemonsets --delete-emptydir-data` of both
//!    nodes (`--force`: the test pods have no controller), then `kubectl
//!    delete -k deploy/` and the DaemonSet's pods gone.
//! 3. `rivet_e2e::node_clean::rivet_leftovers` finds nothing on either
//!    node: no pin, tc filter, veth, tunnel, route, CNI file or socket.
//!
//! Needs root, containerd, runc, ctr, /usr/lib/cni, busybox-static, the
//! Kubernetes tools (`cargo xtask install`) and the workspace's binaries
//! (`cargo build --bins`).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use rivet_common::testing::workspace_binary;
use rivet_e2e::image::BUSYBOX_IMAGE;
use rivet_e2e::kube_cluster::{KubeCluster, KubeClusterOptions, WorkerCni};
use rivet_e2e::kube_deploy::{DEPLOY_TAG, deploy_dir, poll, write_rivet_archives};
use rivet_e2e::node_clean::rivet_leftovers;

/// `kubectl <args>` (with `stdin`); its stdout, or a panic naming `step`.
fn kubectl(cluster: &KubeCluster, step: &str, args: &[&str], stdin: Option<&str>) -> String {
    cluster
        .kubectl_output(args, stdin)
        .unwrap_or_else(|out| panic!("step {step}: kubectl {args:?}: {out}"))
}

fn busybox_pod(name: &str, node: &str) -> String {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": name, "namespace": "default" },
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sleep", "3600"]
            }]
        }
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_and_kubectl_delete_leave_nothing_on_the_nodes() {
    let images = tempfile::Builder::new()
        .prefix("rivet-e2e-uninstall-")
        .tempdir()
        .unwrap();
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
    let deploy = deploy_dir().display().to_string();

    // 1. Installed, with a pod on each node.
    let step = "1 (apply, a pod per node)";
    kubectl(&cluster, step, &["apply", "-k", &deploy], None);
    kubectl(
        &cluster,
        step,
        &[
            "-n",
            "kube-system",
            "rollout",
            "status",
            "daemonset/rivet-node",
            "--timeout=240s",
        ],
        None,
    );
    for worker in cluster.workers() {
        let pod = format!("bb-{}", worker.index);
        kubectl(
            &cluster,
            step,
            &["apply", "-f", "-"],
            Some(&busybox_pod(&pod, &worker.name)),
        );
        kubectl(
            &cluster,
            step,
            &["wait", "--for=condition=Ready", &format!("pod/{pod}"), "--timeout=180s"],
            None,
        );
    }
    for worker in cluster.workers() {
        let left = rivet_leftovers(worker);
        for what in ["pin dir", "interface: lxc", "tc filter", "CNI file", "socket dir entry"] {
            assert!(
                left.iter().any(|l| l.starts_with(what)),
                "step {step}: {} holds a {what} while installed: {left:#?}",
                worker.name
            );
        }
    }

    // 2. Drained, then deleted.
    let step = "2 (drain, kubectl delete -k)";
    for worker in cluster.workers() {
        kubectl(
            &cluster,
            step,
            &[
                "drain",
                &worker.name,
                "--ignore-daemonsets",
                "--delete-emptydir-data",
                "--force",
                "--timeout=180s",
            ],
            None,
        );
    }
    kubectl(&cluster, step, &["delete", "-k", &deploy, "--ignore-not-found"], None);
    let pods: Api<Pod> = Api::namespaced(cluster.admin_client(), "kube-system");
    poll("the rivet-node pods gone", Duration::from_secs(180), || {
        let pods = pods.clone();
        async move {
            let left = pods
                .list(&ListParams::default().labels("app.kubernetes.io/name=rivet-node"))
                .await
                .map_err(|e| e.to_string())?;
            let names: Vec<String> = left.items.iter().filter_map(|p| p.metadata.name.clone()).collect();
            if names.is_empty() {
                Ok(())
            } else {
                Err(format!("{names:?}"))
            }
        }
    })
    .await
    .unwrap_or_else(|e| panic!("step {step}: {e}"));

    // 3. Nothing left.
    for worker in cluster.workers() {
        let left = rivet_leftovers(worker);
        assert!(
            left.is_empty(),
            "step 3 (nothing left): {} still holds {left:#?}; its kubelet log: {}",
            worker.name,
            worker.kubelet_log().display()
        );
    }
}
