//! Rivet installed with `kubectl apply -k deploy/` on the real cluster
//! (issue 18 §4): control plane and two kubelet + containerd workers of
//! `rivet_e2e::kube_cluster`, started with no CNI, the Rivet image of this
//! run's binaries imported into both. One scenario, steps in order, each
//! failure naming its step:
//!
//! 1. `kubectl apply -k deploy/`: the DaemonSet is Ready on both nodes, the
//!    operator holds its Lease, each Node got a pod CIDR and became Ready.
//! 2. A Deployment of 10 busybox pods spread over both nodes (topology
//!    spread): every pod Running with an address of its node's pod CIDR
//!    (its RivetNode's); each pings a pod on the other node and gets a line
//!    echoed by it over TCP.
//! 3. A ClusterIP Service over them answers from every pod; backends on
//!    both nodes answer a pod on node 1.
//! 4. A NetworkPolicy applied with kubectl: a pod it does not allow is
//!    refused by a web pod on either node, one it allows gets through;
//!    deleting it lifts it. `kubectl get rivetendpoints` shows every pod
//!    ready with its identity (one for all web pods).
//! 5. Rolling update of the DaemonSet to a second tag of the image while a
//!    pod on node 1 pings a pod on node 2 and keeps a TCP stream to the
//!    Service: no echo reply missing by sequence number, every streamed
//!    byte echoed, the connection the same.
//! 6. Each daemon container on node 1 SIGKILLed through containerd: the
//!    kubelet restarts it (restartCount rises, Ready again); the same
//!    traffic loses nothing.
//! 7. Both nodes drained (and their pods' veths gone), `kubectl delete -k
//!    deploy/`: once the DaemonSet's pods are gone,
//!    `rivet_e2e::node_clean::rivet_leftovers` finds nothing on either node.
//!
//! Each node's pins are in the worker's own bpffs and go with the cluster.
//!
//! Needs root, containerd, runc, ctr, /usr/lib/cni, busybox-static, the
//! Kubernetes tools (`cargo xtask install`) and the workspace's binaries
//! (`cargo build --bins`; `cargo test --workspace` builds them).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};
use rivet_common::testing::workspace_binary;
use rivet_e2e::cross_node;
use rivet_e2e::image::BUSYBOX_IMAGE;
use rivet_e2e::kube_cluster::{KubeCluster, KubeClusterOptions, WorkerCni, node_ready};
use rivet_e2e::kube_deploy::{
    DEPLOY_TAG, EchoStream, PingMonitor, STEP_TIMEOUT, Scenario, busybox_pod, clients_only_policy,
    daemonset_rolled_out, deploy_dir, kill_container, name, pod_ready, ready_pods, rivet_image,
    write_image_tag_overlay, write_rivet_archives, yaml,
};
use rivet_e2e::node_clean::rivet_leftovers;
use rivet_k8s::RivetEndpoint;

/// The web Deployment's size.
const REPLICAS: usize = 10;
/// The web pods' echo port.
const ECHO_PORT: u16 = 9000;
/// The web pods' port that answers with the pod's name.
const NAME_PORT: u16 = 9001;
/// The daemon containers of `rivet-node`.
const DAEMONS: [&str; 6] = [
    "svc-ipam",
    "svc-identity",
    "svc-endpoint",
    "svc-loader",
    "svc-gc",
    "svc-k8s-sync",
];

fn web_deployment() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": "web", "namespace": "default" },
        "spec": {
            "replicas": REPLICAS,
            "selector": { "matchLabels": { "app": "web" } },
            "template": {
                "metadata": { "labels": { "app": "web" } },
                "spec": {
                    "terminationGracePeriodSeconds": 0,
                    "topologySpreadConstraints": [{
                        "maxSkew": 1,
                        "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "DoNotSchedule",
                        "labelSelector": { "matchLabels": { "app": "web" } }
                    }],
                    "containers": [{
                        "name": "echo",
                        "image": BUSYBOX_IMAGE,
                        "imagePullPolicy": "Never",
                        // An echo server: one `cat` per connection.
                        "command": ["nc", "-ll", "-p", ECHO_PORT.to_string(), "-e", "/bin/cat"]
                    }, {
                        "name": "name",
                        "image": BUSYBOX_IMAGE,
                        "imagePullPolicy": "Never",
                        // Answers every connection with the pod's name.
                        "command": ["nc", "-ll", "-p", NAME_PORT.to_string(), "-e", "/bin/hostname"]
                    }]
                }
            }
        }
    })
}

/// `web`: the echo port and the name port of the web pods.
fn web_service() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": { "name": "web", "namespace": "default" },
        "spec": {
            "selector": { "app": "web" },
            "ports": [
                { "name": "echo", "protocol": "TCP", "port": ECHO_PORT, "targetPort": ECHO_PORT },
                { "name": "name", "protocol": "TCP", "port": NAME_PORT, "targetPort": NAME_PORT }
            ]
        }
    })
}

/// Whether a Deployment rolled out: status for the current generation,
/// every replica updated and available.
fn deployment_rolled_out(deployment: &Deployment) -> Result<(), String> {
    let status = deployment.status.clone().unwrap_or_default();
    let generation = deployment.metadata.generation.unwrap_or_default();
    let want = deployment.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    if status.observed_generation == Some(generation)
        && status.updated_replicas == Some(want)
        && status.available_replicas == Some(want)
        && status.replicas == Some(want)
    {
        Ok(())
    } else {
        Err(format!("{:?}", status))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rivet_installed_with_kubectl_serves_a_two_node_cluster() {
    // The Rivet image of this run's binaries, under deploy/'s tag and a
    // second tag for the rolling update.
    let images = tempfile::Builder::new().prefix("rivet-e2e-deploy-").tempdir().unwrap();
    let second_tag = format!("e2e-{}", std::process::id());
    let bin_dir = workspace_binary("rivet").parent().unwrap().to_path_buf();
    let archives = write_rivet_archives(&bin_dir, images.path(), &[DEPLOY_TAG, &second_tag])
        .unwrap_or_else(|e| panic!("writing the Rivet images from {}: {e}", bin_dir.display()));
    let cluster = KubeCluster::start(KubeClusterOptions {
        cni: WorkerCni::None,
        images: vec![archives[0].clone()],
        ..KubeClusterOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("starting the cluster: {e}"));
    println!(
        "cluster {} up in {:.1} s",
        cluster.name(),
        cluster.started_in().as_secs_f64()
    );

    // 1. kubectl apply -k deploy/.
    let started = std::time::Instant::now();
    let deploy = deploy_dir();
    let mut scenario = Scenario {
        cluster,
        step: "1 (kubectl apply -k deploy/)",
    };
    scenario.kubectl(&["apply", "-k", &deploy.display().to_string()]);
    scenario.wait_rivet_node_rolled_out().await;
    let leases: Api<Lease> = Api::namespaced(scenario.cluster.admin_client(), "kube-system");
    let holder = scenario
        .wait("the operator's Lease kube-system/rivet-operator held", || {
            let leases = leases.clone();
            async move {
                let lease = leases.get_opt("rivet-operator").await.map_err(|e| e.to_string())?;
                lease
                    .as_ref()
                    .and_then(|l| l.spec.as_ref()?.holder_identity.clone())
                    .filter(|h| !h.is_empty())
                    .ok_or_else(|| format!("{lease:?}"))
            }
        })
        .await;
    let nodes: Api<Node> = Api::all(scenario.cluster.admin_client());
    let names: Vec<String> = scenario.cluster.workers().iter().map(|w| w.name.clone()).collect();
    let pod_cidrs = scenario.wait_pod_cidrs().await;
    scenario
        .cluster
        .wait_nodes_ready(STEP_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("step {}: {e}", scenario.step));
    for node in nodes.list(&ListParams::default()).await.unwrap() {
        assert!(
            node_ready(&node),
            "step {}: {:?} Ready",
            scenario.step,
            node.metadata.name
        );
    }
    // Each node's pins are in its own bpffs, none in the host's.
    for worker in scenario.cluster.workers() {
        let pins = format!("/sys/fs/bpf/rivet/{}", worker.name);
        assert!(
            worker.host_path(&pins).join("endpoints").exists(),
            "step {}: {}'s pins in its bpffs at {}",
            scenario.step,
            worker.name,
            worker.host_path(&pins).display()
        );
        assert!(
            !std::path::Path::new(&pins).exists(),
            "step {}: {pins} in the host's bpffs",
            scenario.step
        );
    }
    println!(
        "rivet-node Ready on both nodes {:.1} s after the apply; Lease held by {holder}; pod CIDRs {pod_cidrs:?}",
        started.elapsed().as_secs_f64()
    );

    // 2. 10 pods over both nodes, each with an address of its node's CIDR.
    scenario.step = "2 (a Deployment of 10 pods over both nodes)";
    let (node1, node2) = (names[0].clone(), names[1].clone());
    scenario.kubectl_stdin(
        &["apply", "-f", "-"],
        Some(&yaml(&[
            web_deployment(),
            busybox_pod("client", &node1, serde_json::json!({ "role": "client" })),
            busybox_pod("intruder", &node1, serde_json::json!({ "role": "intruder" })),
        ])),
    );
    let web = scenario
        .wait("10 web pods Ready", || async {
            ready_pods(&scenario.list_pods("default", "app=web").await, REPLICAS)
        })
        .await;
    let others = scenario
        .wait("the client and intruder pods Ready", || async {
            ready_pods(&scenario.list_pods("default", "role").await, 2)
        })
        .await;
    for (pod, node, ip) in web.iter().chain(&others) {
        let cidr = &pod_cidrs[node];
        assert!(
            cidr.contains(ip),
            "step {}: pod {pod} on {node} has {ip}, outside its node's pod CIDR {cidr}",
            scenario.step
        );
    }
    let on = |node: &str| -> Vec<(String, IpAddr)> {
        web.iter()
            .filter(|(_, n, _)| n == node)
            .map(|(p, _, ip)| (p.clone(), *ip))
            .collect()
    };
    let (web1, web2) = (on(&node1), on(&node2));
    assert_eq!(
        (web1.len(), web2.len()),
        (REPLICAS / 2, REPLICAS / 2),
        "step {}: the topology spread puts half the pods on each node: {web:?}",
        scenario.step
    );
    // Each web pod pings one on the other node and gets a line echoed.
    for (pods, remote) in [(&web1, &web2), (&web2, &web1)] {
        for ((pod, _), (peer, peer_ip)) in pods.iter().zip(remote.iter()) {
            cross_node::reaches(&|| scenario.cluster.kubectl().unwrap(), pod, *peer_ip, ECHO_PORT)
                .unwrap_or_else(|e| panic!("step {}: {pod} → {peer} on the other node: {e}", scenario.step));
        }
    }

    // 3. A ClusterIP Service over the 10 pods, from every pod.
    scenario.step = "3 (a ClusterIP Service from every pod)";
    scenario.kubectl_stdin(&["apply", "-f", "-"], Some(&web_service().to_string()));
    let service_api: Api<Service> = Api::namespaced(scenario.cluster.admin_client(), "default");
    let slices: Api<EndpointSlice> = Api::namespaced(scenario.cluster.admin_client(), "default");
    let vip: IpAddr = service_api
        .get("web")
        .await
        .unwrap()
        .spec
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse().ok())
        .unwrap_or_else(|| panic!("step {}: Service web has no ClusterIP", scenario.step));
    scenario
        .wait("the web Service's EndpointSlice with 10 ready endpoints", || {
            let slices = slices.clone();
            async move {
                let list = slices
                    .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
                    .await
                    .map_err(|e| e.to_string())?;
                let ready = list
                    .items
                    .iter()
                    .flat_map(|s| &s.endpoints)
                    .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
                    .count();
                if ready == REPLICAS {
                    Ok(())
                } else {
                    Err(format!("{ready} ready endpoints"))
                }
            }
        })
        .await;
    // The first answer on each node says Rivet programmed the Service
    // there; from then on every pod must get through at once.
    for (first, _) in [&web1[0], &web2[0]] {
        scenario
            .wait(&format!("{first} reaches the web Service at {vip}"), || async {
                scenario.echoes(first, vip, ECHO_PORT)
            })
            .await;
    }
    for pod in web.iter().chain(&others).map(|(p, _, _)| p) {
        scenario
            .echoes(pod, vip, ECHO_PORT)
            .unwrap_or_else(|e| panic!("step {}: {pod} → web ({vip}): {e}", scenario.step));
    }
    // Backends on both nodes answer a pod on node 1 through the ClusterIP.
    let names = scenario
        .exec(
            "client",
            &format!("i=0; while [ $i -lt 40 ]; do nc -w 3 {vip} {NAME_PORT} </dev/null; i=$((i+1)); done"),
        )
        .unwrap_or_else(|e| panic!("step {}: client → web ({vip}:{NAME_PORT}): {e}", scenario.step));
    let answered: Vec<&str> = names.lines().collect();
    assert_eq!(
        answered.len(),
        40,
        "step {}: 40 connections from client to {vip}:{NAME_PORT}, each answered by a backend: {answered:?}",
        scenario.step
    );
    for (node, pods) in [(&node1, &web1), (&node2, &web2)] {
        assert!(
            answered.iter().any(|a| pods.iter().any(|(p, _)| p == a)),
            "step {}: no backend on {node} answered client through {vip}: {answered:?}",
            scenario.step
        );
    }

    // 4. A NetworkPolicy: only role=client reaches the web pods' echo port.
    scenario.step = "4 (a NetworkPolicy applied with kubectl)";
    let policy = clients_only_policy("web-from-clients", "web", ECHO_PORT);
    scenario.kubectl_stdin(&["apply", "-f", "-"], Some(&policy.to_string()));
    let endpoints: Api<RivetEndpoint> = Api::namespaced(scenario.cluster.admin_client(), "default");
    let enforced = |want: bool| {
        let endpoints = endpoints.clone();
        async move {
            let list = endpoints
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let web: Vec<_> = list
                .items
                .iter()
                .filter(|e| e.metadata.name.as_deref().is_some_and(|n| n.starts_with("web-")))
                .map(|e| {
                    let status = e.status.clone().unwrap_or_default();
                    (e.metadata.name.clone().unwrap_or_default(), status.ingress_enforced)
                })
                .collect();
            if web.len() == REPLICAS && web.iter().all(|(_, e)| *e == want) {
                Ok(())
            } else {
                Err(format!("ingress enforced: {web:?}"))
            }
        }
    };
    scenario
        .wait("every web pod's RivetEndpoint ingress-enforced", || enforced(true))
        .await;
    // A web pod on the other node and one on the same node as the clients.
    let targets = [web2[0].clone(), web1[0].clone()];
    for (target, target_ip) in &targets {
        let denied = scenario.echoes("intruder", *target_ip, ECHO_PORT);
        assert!(
            denied.is_err(),
            "step {}: intruder reached {target} ({target_ip}) through the policy",
            scenario.step
        );
        scenario
            .echoes("client", *target_ip, ECHO_PORT)
            .unwrap_or_else(|e| panic!("step {}: client → {target} ({target_ip}), allowed: {e}", scenario.step));
    }
    scenario
        .echoes("client", vip, ECHO_PORT)
        .unwrap_or_else(|e| panic!("step {}: client → web ({vip}), allowed: {e}", scenario.step));

    // kubectl get rivetendpoints: every pod, ready, with its identity.
    scenario.step = "4 (kubectl get rivetendpoints)";
    let table = scenario.kubectl(&["get", "rivetendpoints", "-n", "default"]);
    let listed: serde_json::Value =
        serde_json::from_str(&scenario.kubectl(&["get", "rivetendpoints", "-n", "default", "-o", "json"])).unwrap();
    let mut identities = BTreeMap::new();
    for (pod, node, ip) in web.iter().chain(&others) {
        let item = listed["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|i| i["metadata"]["name"] == pod.as_str())
            .unwrap_or_else(|| panic!("step {}: no RivetEndpoint for {pod}:\n{table}", scenario.step));
        let status = &item["status"];
        assert_eq!(status["state"], "ready", "step {}: {pod}: {status}", scenario.step);
        assert_eq!(
            status["ipv4"],
            ip.to_string(),
            "step {}: {pod}: {status}",
            scenario.step
        );
        assert_eq!(status["node"], node.as_str(), "step {}: {pod}: {status}", scenario.step);
        let identity = status["identity"].as_u64().unwrap_or_default();
        assert!(
            identity >= 256,
            "step {}: {pod} has a cluster identity: {status}",
            scenario.step
        );
        let row = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(pod.as_str()))
            .unwrap_or_else(|| panic!("step {}: {pod} not in the table:\n{table}", scenario.step));
        assert!(
            row.contains(" ready ") && row.contains(&format!(" {identity} ")),
            "step {}: {pod}'s row shows its state and identity {identity}: {row}",
            scenario.step
        );
        identities.insert(pod.clone(), identity);
    }
    let web_identity = identities[&web1[0].0];
    assert!(
        web.iter().all(|(p, _, _)| identities[p] == web_identity),
        "step {}: the web pods share an identity on both nodes: {identities:?}",
        scenario.step
    );
    assert_ne!(
        identities["client"], identities["intruder"],
        "step {}: {identities:?}",
        scenario.step
    );
    println!("kubectl get rivetendpoints:\n{table}");

    scenario.step = "4 (deleting the NetworkPolicy)";
    scenario.kubectl(&["delete", "networkpolicy", "web-from-clients", "-n", "default"]);
    scenario
        .wait("no web pod's RivetEndpoint ingress-enforced", || enforced(false))
        .await;
    for (target, target_ip) in &targets {
        scenario
            .echoes("intruder", *target_ip, ECHO_PORT)
            .unwrap_or_else(|e| panic!("step {}: intruder → {target} without the policy: {e}", scenario.step));
    }

    // 5. Rolling update to the second tag under traffic.
    scenario.step = "5 (rolling update of the DaemonSet)";
    let second = rivet_image(&second_tag);
    scenario
        .cluster
        .import_images(&archives[1], &[&second])
        .await
        .unwrap_or_else(|e| panic!("step {}: importing {second}: {e}", scenario.step));
    let before: Vec<String> = scenario
        .list_pods("kube-system", "app.kubernetes.io/name=rivet-node")
        .await
        .iter()
        .filter_map(|p| p.metadata.uid.clone())
        .collect();
    // Pod to pod across the nodes, and to the Service.
    let (peer, peer_ip) = web2[1].clone();
    let traffic = Traffic::start(&scenario, &peer, peer_ip, vip).await;
    let overlay = tempfile::Builder::new().prefix("rivet-e2e-overlay-").tempdir().unwrap();
    write_image_tag_overlay(overlay.path(), &second_tag).unwrap();
    let rollout = std::time::Instant::now();
    scenario.kubectl(&["apply", "-k", &overlay.path().display().to_string()]);
    let daemonsets: Api<DaemonSet> = Api::namespaced(scenario.cluster.admin_client(), "kube-system");
    scenario
        .wait(&format!("rivet-node rolled out to {second}"), || {
            let daemonsets = daemonsets.clone();
            let scenario = &scenario;
            let second = second.clone();
            async move {
                let ds = daemonsets.get("rivet-node").await.map_err(|e| e.to_string())?;
                daemonset_rolled_out(&ds)?;
                let pods = scenario
                    .list_pods("kube-system", "app.kubernetes.io/name=rivet-node")
                    .await;
                let old: Vec<_> = pods
                    .iter()
                    .filter(|p| {
                        p.spec.as_ref().is_none_or(|s| {
                            s.containers
                                .iter()
                                .chain(s.init_containers.iter().flatten())
                                .any(|c| c.image.as_deref() != Some(second.as_str()))
                        }) || !pod_ready(p)
                    })
                    .map(name)
                    .collect();
                if pods.len() == 2 && old.is_empty() {
                    Ok(())
                } else {
                    Err(format!("{} pods, not updated or not ready: {old:?}", pods.len()))
                }
            }
        })
        .await;
    let deployments: Api<Deployment> = Api::namespaced(scenario.cluster.admin_client(), "kube-system");
    scenario
        .wait("rivet-operator rolled out", || {
            let deployments = deployments.clone();
            async move { deployment_rolled_out(&deployments.get("rivet-operator").await.map_err(|e| e.to_string())?) }
        })
        .await;
    let after = scenario
        .list_pods("kube-system", "app.kubernetes.io/name=rivet-node")
        .await;
    assert!(
        after
            .iter()
            .all(|p| p.metadata.uid.as_ref().is_some_and(|u| !before.contains(u))),
        "step {}: both rivet-node pods replaced",
        scenario.step
    );
    println!("rolled out in {:.1} s", rollout.elapsed().as_secs_f64());
    traffic.check(&scenario).await;

    // 6. Each daemon container on node 1 killed through containerd.
    scenario.step = "6 (daemon containers killed through the CRI)";
    let traffic = Traffic::start(&scenario, &peer, peer_ip, vip).await;
    let worker = scenario.worker(&node1);
    for daemon in DAEMONS {
        let status = |pod: &Pod| {
            pod.status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|c| c.iter().find(|c| c.name == daemon).cloned())
                .unwrap_or_else(|| panic!("step {}: no status of {daemon} in {}", scenario.step, name(pod)))
        };
        let pod = scenario.rivet_node_pod(&node1).await;
        let was = status(&pod);
        let id = was
            .container_id
            .clone()
            .unwrap_or_else(|| panic!("step {}: {daemon} has no container id", scenario.step));
        kill_container(worker, &id).unwrap_or_else(|e| panic!("step {}: killing {daemon}: {e}", scenario.step));
        scenario
            .wait(&format!("{daemon} on {node1} restarted and Ready"), || async {
                let now = status(&scenario.rivet_node_pod(&node1).await);
                if now.restart_count > was.restart_count && now.ready && now.container_id != was.container_id {
                    Ok(())
                } else {
                    Err(format!(
                        "restarts {} (was {}), ready {}, id {:?}",
                        now.restart_count, was.restart_count, now.ready, now.container_id
                    ))
                }
            })
            .await;
    }
    traffic.check(&scenario).await;

    // 7. Drained and deleted: nothing of Rivet on the nodes.
    scenario.step = "7 (drain, kubectl delete -k deploy/)";
    for node in [&node1, &node2] {
        // --force: the client and intruder pods have no controller.
        scenario.kubectl(&[
            "drain",
            node,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--force",
            "--timeout=180s",
        ]);
    }
    // Pods of grace 0 leave the API before their kubelet removed their
    // sandboxes; a node is drained once its pods' veths are gone.
    for worker in scenario.cluster.workers() {
        scenario
            .wait(&format!("no pod veth left on {}", worker.name), || async {
                let veths: Vec<String> = rivet_leftovers(worker)
                    .into_iter()
                    .filter(|l| l.starts_with("interface: lxc"))
                    .collect();
                if veths.is_empty() {
                    Ok(())
                } else {
                    Err(format!("{veths:?}"))
                }
            })
            .await;
    }
    // --ignore-not-found: the token controller may delete the
    // rivet-identity-token Secret with its ServiceAccount first.
    scenario.kubectl(&["delete", "-k", &deploy.display().to_string(), "--ignore-not-found"]);
    scenario
        .wait("the rivet-node pods gone", || async {
            let left: Vec<String> = scenario
                .list_pods("kube-system", "app.kubernetes.io/name=rivet-node")
                .await
                .iter()
                .map(|p| name(p).to_owned())
                .collect();
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{left:?}"))
            }
        })
        .await;
    for worker in scenario.cluster.workers() {
        let left = rivet_leftovers(worker);
        assert!(
            left.is_empty(),
            "step {}: {} still holds {left:#?}",
            scenario.step,
            worker.name
        );
    }

    // The cluster gone, so are the nodes' bpffs and their pins.
    let bpffs: Vec<_> = scenario
        .cluster
        .workers()
        .iter()
        .map(|w| w.host_path("/sys/fs/bpf"))
        .collect();
    drop(scenario);
    for bpffs in bpffs {
        assert!(!bpffs.exists(), "{} left", bpffs.display());
    }
}

/// A ping from `client` to a pod and a TCP stream from `client` to a
/// Service, running while a step disrupts Rivet.
struct Traffic {
    ping: PingMonitor,
    stream: EchoStream,
}

impl Traffic {
    async fn start(scenario: &Scenario, peer: &str, peer_ip: IpAddr, vip: IpAddr) -> Self {
        let ping = PingMonitor::start(scenario.cluster.kubectl().unwrap(), "client", peer_ip)
            .unwrap_or_else(|e| panic!("step {}: ping client → {peer}: {e}", scenario.step));
        let stream = EchoStream::start(scenario.cluster.kubectl().unwrap(), "client", vip, ECHO_PORT)
            .unwrap_or_else(|e| panic!("step {}: stream client → {vip}: {e}", scenario.step));
        // Both flow before the disruption starts.
        ping.wait_replies(3, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("step {}: {e}", scenario.step));
        if let Err(e) = stream.wait_echoed(3, Duration::from_secs(30)).await {
            panic!("step {}: {e}: {:?}", scenario.step, stream.stop());
        }
        Self { ping, stream }
    }

    /// After the disruption: both still flow, then nothing was lost.
    async fn check(self, scenario: &Scenario) {
        let _ = self.ping.wait_replies(3, Duration::from_secs(30)).await;
        let _ = self.stream.wait_echoed(3, Duration::from_secs(30)).await;
        let ping = self.ping.stop();
        let stream = self.stream.stop();
        println!("step {}: ping {ping:?}; stream {stream:?}", scenario.step);
        assert!(
            ping.lost.is_empty() && ping.received > 6,
            "step {}: echo replies lost (by sequence number): {ping:?}",
            scenario.step
        );
        assert!(
            stream.failure.is_none() && stream.echoed > 6,
            "step {}: the TCP stream to the Service: {stream:?}",
            scenario.step
        );
    }
}
