//! A node in Kubernetes mode against a real kube-apiserver: the node's
//! daemons ([`EndpointNode`], svc-endpoint with `--k8s-sync-socket`),
//! svc-k8s-sync as a real process with the ServiceAccount of
//! `deploy/rbac/svc-k8s-sync.yaml`, and pods that are network namespaces
//! wired by rivet-cni (CNI ADD with kubelet's `K8S_POD_*` args, run in the
//! node namespace as a runtime does) with Pod objects in the API (nodeName
//! set; no kubelet).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::netns::TcpServerGuard;
use rivet_common::testing::{DaemonCommand, DaemonProcess, workspace_binary};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::namespace_service_client::NamespaceServiceClient;
use rivet_proto::k8s::v1 as k8spb;
use rivet_proto::k8s::v1::kubernetes_sync_service_client::KubernetesSyncServiceClient;
use rivet_proto::k8s::v1::pod_directory_client::PodDirectoryClient;
use rivet_testkit::cni::{self, cni_env, exec_in_netns, node_conf, result_ips};
use rivet_testkit::kube::{KubeApiServer, ServiceAccountAccess};
use rivet_testkit::loader::HOST_PREFIX;
use rivet_testkit::node::{EndpointNode, NodeOptions};
use serde_json::json;

/// How long a probe waits for an answer.
pub const PROBE: Duration = Duration::from_millis(500);

/// How long anything in these tests may take to converge.
pub const CONVERGE: Duration = Duration::from_secs(30);

/// Polls `check` every 50 ms until it returns `Ok`, panicking with its last
/// error after `timeout`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let started = Instant::now();
    loop {
        match check().await {
            Ok(value) => return value,
            Err(e) if started.elapsed() > timeout => panic!("{what}: not after {timeout:?}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A pod wired by rivet-cni.
pub struct CniPod {
    /// Its network namespace (removed on drop).
    pub pod: cni::Pod,
    /// Its IPv4 address.
    pub ipv4: IpAddr,
}

/// The cluster of one node.
pub struct Cluster {
    /// The pods by name (dropped first).
    pub pods: BTreeMap<String, CniPod>,
    /// The node's daemons.
    pub node: EndpointNode,
    /// svc-k8s-sync.
    pub sync: DaemonProcess,
    /// svc-k8s-sync's ServiceAccount access.
    pub access: ServiceAccountAccess,
    /// The API server (dropped last).
    pub api: KubeApiServer,
}

impl Cluster {
    /// Starts the API server with Rivet's CRDs, the node in Kubernetes mode,
    /// the Node object and svc-k8s-sync, and waits until svc-k8s-sync
    /// synced its caches and replayed them to svc-endpoint.
    pub async fn start() -> Self {
        Self::start_with("svc-k8s-sync", &[]).await
    }

    /// [`start`](Self::start) with the ServiceAccount of
    /// `deploy/rbac/<component>.yaml` and extra flags for svc-k8s-sync;
    /// does not wait for the caches.
    pub async fn start_with(component: &str, sync_args: &[&str]) -> Self {
        Self::start_node(component, NodeOptions::default(), sync_args).await
    }

    /// A node in cluster-pool IPAM: svc-ipam without a pool, svc-k8s-sync
    /// with `--ipam-mode cluster-pool` and `sync_args`; waits for the
    /// caches like [`start`](Self::start).
    pub async fn start_cluster_pool(sync_args: &[&str]) -> Self {
        let mut args = vec!["--ipam-mode", "cluster-pool"];
        args.extend_from_slice(sync_args);
        let options = NodeOptions {
            cluster_pool: true,
            ..NodeOptions::default()
        };
        Self::start_node("svc-k8s-sync", options, &args).await
    }

    async fn start_node(component: &str, options: NodeOptions, sync_args: &[&str]) -> Self {
        let api = KubeApiServer::start().await.expect("kube-apiserver starts");
        api.apply_crds().await.expect("Rivet's CRDs are established");
        let access = api
            .service_account_client(component)
            .await
            .expect("the ServiceAccount and its RBAC apply");
        let node = EndpointNode::start(NodeOptions {
            k8s_sync: true,
            ..options
        })
        .await
        .expect("the node's daemons start");
        let nodes: Api<Node> = Api::all(api.admin_client());
        nodes
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": { "name": node.node.node_name },
                    "spec": { "taints": [{ "key": "node.rivet.io/agent-not-ready", "effect": "NoSchedule" }] },
                }))
                .expect("a Node"),
            )
            .await
            .expect("the Node is created");
        let sockets = node.sockets();
        let sync = DaemonCommand::new(workspace_binary("svc-k8s-sync"), sockets.join("svc-k8s-sync.sock"))
            .args(["--socket-dir".as_ref(), sockets.as_os_str()])
            .args(["--state-dir".as_ref(), node.state_dir().as_os_str()])
            .args(["--node-name", &node.node.node_name])
            .args(["--kubeconfig".as_ref(), access.kubeconfig.as_os_str()])
            .args(["--node-address", "198.19.0.1"])
            .args(["--feed-poll-seconds", "0.2", "--node-ready-period-seconds", "1"])
            .args(sync_args)
            .log_to(node.node.dir.path().join("svc-k8s-sync.log"))
            .spawn()
            .await
            .expect("svc-k8s-sync starts");
        let cluster = Self {
            pods: BTreeMap::new(),
            node,
            sync,
            access,
            api,
        };
        if component == "svc-k8s-sync" {
            cluster.wait_replayed(1).await;
        }
        cluster
    }

    /// The admin client.
    pub fn admin(&self) -> Client {
        self.api.admin_client()
    }

    /// A channel to svc-k8s-sync.
    pub async fn sync_channel(&self) -> DaemonChannel {
        connect_unix(self.sync.socket(), &ClientOptions::default())
            .await
            .expect("svc-k8s-sync answers")
    }

    /// svc-k8s-sync's GetStatus.
    pub async fn sync_status(&self) -> k8spb::GetStatusResponse {
        KubernetesSyncServiceClient::new(self.sync_channel().await)
            .get_status(k8spb::GetStatusRequest {})
            .await
            .expect("GetStatus answers")
            .into_inner()
    }

    /// svc-k8s-sync's LookupPod.
    pub async fn lookup_pod(&self, namespace: &str, name: &str) -> Result<k8spb::LookupPodResponse, tonic::Status> {
        PodDirectoryClient::new(self.sync_channel().await)
            .lookup_pod(k8spb::LookupPodRequest {
                namespace: namespace.into(),
                name: name.into(),
                uid: String::new(),
            })
            .await
            .map(|r| r.into_inner())
    }

    /// Waits until svc-k8s-sync synced every cache and completed `replays`
    /// replays into svc-endpoint (of the current svc-k8s-sync process).
    pub async fn wait_replayed(&self, replays: u64) -> k8spb::GetStatusResponse {
        eventually("svc-k8s-sync synced and replayed", CONVERGE, || async {
            let status = self.sync_status().await;
            let fed = status.fed.first().cloned().unwrap_or_default();
            if status.caches_synced && fed.replays >= replays {
                Ok(status)
            } else {
                Err(format!("{status:?}"))
            }
        })
        .await
    }

    /// Creates namespace `name` with `labels` (or replaces its labels).
    pub async fn namespace(&self, name: &str, labels: &[(&str, &str)]) {
        let namespaces: Api<Namespace> = Api::all(self.admin());
        let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
        namespaces
            .patch(
                name,
                &PatchParams::apply("rivet-test").force(),
                &Patch::Apply(json!({
                    "apiVersion": "v1", "kind": "Namespace",
                    "metadata": { "name": name, "labels": labels },
                })),
            )
            .await
            .expect("the namespace is applied");
    }

    /// Creates pod `namespace/name` in the API (on this node, with `labels`
    /// and a named port `http` 8080), then its network namespace through
    /// rivet-cni's ADD with kubelet's CNI_ARGS (svc-endpoint takes the
    /// labels from svc-k8s-sync); panics unless the ADD succeeds. Pod names
    /// are unique per cluster (they are container ids).
    pub async fn create_pod(&mut self, namespace: &str, name: &str, labels: &[(&str, &str)]) {
        let pods: Api<Pod> = Api::namespaced(self.admin(), namespace);
        let labels_map: BTreeMap<&str, &str> = labels.iter().copied().collect();
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": name, "namespace": namespace, "labels": labels_map },
            "spec": {
                "nodeName": self.node.node.node_name,
                "containers": [{ "name": "main", "image": "busybox", "ports": [{ "name": "http", "containerPort": 8080 }] }],
            },
        }))
        .expect("a Pod");
        let created = pods
            .create(&PostParams::default(), &pod)
            .await
            .expect("the Pod is created");
        let uid = created.metadata.uid.unwrap_or_default();
        let cni_pod = cni::Pod::new(name);
        let mut env = cni_env("ADD", name, &cni_pod.path(), "eth0");
        for (key, value) in &mut env {
            if key == "CNI_ARGS" {
                *value = format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};\
                     K8S_POD_INFRA_CONTAINER_ID={name};K8S_POD_UID={uid}"
                );
            }
        }
        let conf = node_conf(
            "1.0.0",
            &self.node.sockets(),
            HOST_PREFIX,
            &self.dir().join("rivet-cni.log"),
            None,
        );
        let run = exec_in_netns(
            &self.node.node.node.ns.path(),
            &workspace_binary("rivet-cni"),
            &env,
            conf.to_string().as_bytes(),
            CONVERGE,
        )
        .await
        .expect("rivet-cni runs");
        let ipv4 = result_ips(&run.ok())
            .expect("the result has addresses")
            .into_iter()
            .find(IpAddr::is_ipv4)
            .expect("an IPv4 address");
        self.pods.insert(name.to_string(), CniPod { pod: cni_pod, ipv4 });
    }

    /// [`create_pod`](Self::create_pod), then waits until the endpoint has
    /// its labels' identity.
    pub async fn pod(&mut self, namespace: &str, name: &str, labels: &[(&str, &str)]) -> pb::Endpoint {
        self.create_pod(namespace, name, labels).await;
        let want: Vec<String> = labels.iter().map(|(k, v)| format!("k8s:{k}={v}")).collect();
        self.wait_endpoint(namespace, name, |e| {
            !e.labels_pending && want.iter().all(|l| e.identity_labels.contains(l))
        })
        .await
    }

    /// The pod `name`.
    pub fn cni_pod(&self, name: &str) -> &CniPod {
        self.pods.get(name).unwrap_or_else(|| panic!("no pod {name}"))
    }

    /// A TCP echo server on `port` of pod `name`'s IPv4 address.
    pub fn tcp_server(&self, name: &str, port: u16) -> TcpServerGuard {
        let pod = self.cni_pod(name);
        pod.pod
            .ns
            .tcp_echo_server(&[SocketAddr::new(pod.ipv4, port)])
            .expect("a TCP server in the pod")
    }

    /// The endpoint of pod `namespace/name`.
    pub async fn endpoint(&self, namespace: &str, name: &str) -> Option<pb::Endpoint> {
        self.node
            .endpoints()
            .await
            .list_endpoints(pb::ListEndpointsRequest {
                pod_namespace: namespace.into(),
                ..Default::default()
            })
            .await
            .expect("ListEndpoints answers")
            .into_inner()
            .endpoints
            .into_iter()
            .find(|e| e.pod_name == name)
    }

    /// Waits until the endpoint of `namespace/name` is ready and `ok`.
    pub async fn wait_endpoint(&self, namespace: &str, name: &str, ok: impl Fn(&pb::Endpoint) -> bool) -> pb::Endpoint {
        eventually(&format!("endpoint of {namespace}/{name}"), CONVERGE, || async {
            match self.endpoint(namespace, name).await {
                Some(e) if e.state == pb::EndpointState::Ready as i32 && ok(&e) => Ok(e),
                other => Err(format!("{other:?}")),
            }
        })
        .await
    }

    /// svc-endpoint's namespaces with their labels.
    pub async fn endpoint_namespaces(&self) -> Vec<pb::Namespace> {
        let channel = connect_unix(
            &self.node.sockets().join("svc-endpoint.sock"),
            &ClientOptions::default(),
        )
        .await
        .expect("svc-endpoint answers");
        NamespaceServiceClient::new(channel)
            .list_namespaces(pb::ListNamespacesRequest {})
            .await
            .expect("ListNamespaces answers")
            .into_inner()
            .namespaces
    }

    /// Every endpoint of the node.
    pub async fn endpoints(&self) -> Vec<pb::Endpoint> {
        self.node
            .endpoints()
            .await
            .list_endpoints(pb::ListEndpointsRequest::default())
            .await
            .expect("ListEndpoints answers")
            .into_inner()
            .endpoints
    }

    /// Regenerations of every endpoint, summed.
    pub async fn regenerations(&self) -> u64 {
        self.endpoints().await.iter().map(|e| e.regenerations).sum()
    }

    /// The repository's revision once policy `kind namespace/name` of
    /// origin KUBERNETES is there (`present`) or gone (`!present`).
    pub async fn wait_policy(&self, kind: &str, namespace: &str, name: &str, present: bool) -> u64 {
        eventually(
            &format!("policy {kind} {namespace}/{name} present={present}"),
            CONVERGE,
            || async {
                let listed = self
                    .node
                    .policies()
                    .await
                    .list_policies(pb::ListPoliciesRequest {
                        namespace: namespace.into(),
                        origin: pb::PolicyOrigin::Kubernetes.into(),
                        include_documents: false,
                    })
                    .await
                    .expect("ListPolicies answers")
                    .into_inner();
                let found = listed.policies.iter().find(|p| {
                    p.key
                        .as_ref()
                        .is_some_and(|k| k.kind == kind && k.namespace == namespace && k.name == name)
                });
                match (found, present) {
                    (Some(p), true) => Ok(p.revision),
                    (None, false) => Ok(listed.revision),
                    _ => Err(format!("{:?}", listed.policies)),
                }
            },
        )
        .await
    }

    /// Waits until the endpoints of `pods` (all when empty) realised policy
    /// revision `revision` (endpoints a change does not affect keep theirs).
    pub async fn wait_realised(&self, revision: u64, pods: &[&str]) {
        eventually(&format!("{pods:?} realise revision {revision}"), CONVERGE, || async {
            let endpoints = self.endpoints().await;
            let behind: Vec<_> = endpoints
                .iter()
                .filter(|e| pods.is_empty() || pods.contains(&e.pod_name.as_str()))
                .filter(|e| e.policy_revision < revision || e.state != pb::EndpointState::Ready as i32)
                .map(|e| (e.pod_name.clone(), e.policy_revision, e.state))
                .collect();
            if behind.is_empty() {
                Ok(())
            } else {
                Err(format!("{behind:?}"))
            }
        })
        .await
    }

    /// Namespace `shop` with pods `client` and `server` and a NetworkPolicy
    /// letting only `app=client` into `server`, realised.
    pub async fn shop_with_server_policy(&mut self) {
        self.namespace("shop", &[]).await;
        self.pod("shop", "client", &[("app", "client")]).await;
        self.pod("shop", "server", &[("app", "server")]).await;
        let policy = serde_json::from_value(serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": { "name": "server", "namespace": "shop" },
            "spec": {
                "podSelector": { "matchLabels": { "app": "server" } },
                "ingress": [{ "from": [{ "podSelector": { "matchLabels": { "app": "client" } } }] }],
            },
        }))
        .expect("the shop policy is a NetworkPolicy");
        Api::<k8s_openapi::api::networking::v1::NetworkPolicy>::namespaced(self.admin(), "shop")
            .create(&PostParams::default(), &policy)
            .await
            .expect("the API server must accept the shop policy");
        let revision = self.wait_policy("NetworkPolicy", "shop", "server", true).await;
        self.wait_realised(revision, &["server"]).await;
    }

    /// `count` pings (every 5 ms, as root) from pod `from` to pod `to` in a
    /// thread: (sent, received).
    pub fn ping_in_background(&self, from: &str, to: &str, count: u64) -> std::thread::JoinHandle<(u64, u64)> {
        let ns = self.cni_pod(from).pod.ns.name().to_owned();
        let dst = self.cni_pod(to).ipv4.to_string();
        std::thread::spawn(move || {
            let out = std::process::Command::new("ip")
                .args([
                    "netns", "exec", &ns, "ping", "-4", "-n", "-q", "-i", "0.005", "-W", "1", "-c",
                ])
                .args([count.to_string().as_str(), dst.as_str()])
                .env("LC_ALL", "C")
                .output()
                .expect("ping runs");
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let line = text
                .lines()
                .find(|l| l.contains("packets transmitted"))
                .unwrap_or_else(|| panic!("ping's summary: {text}"));
            let mut numbers = line
                .split(',')
                .map(|p| p.split_whitespace().next().unwrap().parse::<u64>().unwrap());
            (numbers.next().unwrap(), numbers.next().unwrap())
        })
    }

    /// Whether this node's Node carries Rivet's not-ready taint.
    pub async fn not_ready_taint(&self) -> bool {
        Api::<Node>::all(self.admin())
            .get(&self.node.node.node_name)
            .await
            .expect("the Node")
            .spec
            .and_then(|s| s.taints)
            .unwrap_or_default()
            .iter()
            .any(|t| t.key == "node.rivet.io/agent-not-ready")
    }

    /// The real rivet-operator with its own ServiceAccount, allocating from
    /// 198.18.0.0/16 (/24 per node) and 2001:2::/104, plus `extra` flags;
    /// returned once it leads.
    pub async fn start_operator(&self, extra: &[&str]) -> rivet_testkit::operator::Operator {
        let access = self
            .api
            .service_account_client("rivet-operator")
            .await
            .expect("the operator's ServiceAccount");
        let mut args = vec![
            "--cluster-pool-ipv4-cidr",
            "198.18.0.0/16",
            "--cluster-pool-ipv4-mask-size",
            "24",
            "--cluster-pool-ipv6-cidr",
            "2001:2::/104",
        ];
        args.extend_from_slice(extra);
        let operator = rivet_testkit::operator::Operator::start(&access, &args)
            .await
            .expect("rivet-operator starts");
        operator.wait_leading(CONVERGE).await.expect("the operator leads");
        operator
    }

    /// Whether pod `from` completes a TCP echo with pod `to` on `port`.
    pub fn tcp(&self, from: &str, to: &str, port: u16) -> bool {
        self.cni_pod(from)
            .pod
            .ns
            .tcp_echo(SocketAddr::new(self.cni_pod(to).ipv4, port), PROBE)
            .expect("the harness can run a TCP probe")
    }

    /// The log of svc-k8s-sync.
    pub fn sync_log(&self) -> String {
        self.sync.log()
    }

    /// The dir of this node's files.
    pub fn dir(&self) -> PathBuf {
        self.node.node.dir.path().to_path_buf()
    }
}
