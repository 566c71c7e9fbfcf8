//! `k8s`: Rivet driven by a real kube-apiserver (v1.34, testkit's
//! [`KubeApiServer`]) on one simulated node: svc-k8s-sync with deploy/'s
//! ServiceAccount, svc-endpoint in Kubernetes mode, every daemon real:
//!
//! 1. a NetworkPolicy created (then deleted) through the API until it is
//!    realised on every endpoint (`--endpoints` of them, Pods in the API
//!    with this node's name): each endpoint's realised policy revision moved
//!    past the one before and its ingress enforcement flipped, as
//!    svc-endpoint's WatchEndpoints reports them; p50/p99 over `--rounds`.
//!    Peer, interleaved in the same run: the same policy through the origin
//!    API `rivet policy apply` uses (PolicyService.UpsertPolicy, origin API,
//!    no wait), until the same signal.
//!    ratio = Kubernetes create p50 / direct create p50 (goal ≤ 1.5×);
//! 2. a pod's `app` label patched in the API until its endpoint runs on the
//!    new identity with the policy regenerated (Ready, identity labels with
//!    the new value; then svc-loader is checked to hold that identity),
//!    p50/p99 over `--label-patches`;
//! 3. `--pods` Pods (most on other nodes, in other namespaces) and
//!    `--policies` NetworkPolicies in the API: svc-k8s-sync killed with
//!    SIGKILL and restarted; the time until its GetStatus says caches_synced
//!    and until its replay to svc-endpoint completed, then its VmRSS and its
//!    CPU over `--cpu-window-seconds` at steady state (`/proc/<pid>/stat`).
//!    The creates run `--api-concurrency` at a time; their time is printed.
//!
//! Endpoints are `endpoint`'s veth pairs in the node namespace
//! ([`endpoint_requests`]); everything is removed when the node and the API
//! server drop, also on error.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::DaemonCommand;
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use rivet_proto::endpoint::v1::policy_service_client::PolicyServiceClient;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use rivet_proto::k8s::v1 as k8spb;
use rivet_proto::k8s::v1::kubernetes_sync_service_client::KubernetesSyncServiceClient;
use rivet_proto::loader::v1 as ldpb;
use rivet_proto::loader::v1::loader_service_client::LoaderServiceClient;
use rivet_testkit::kube::KubeApiServer;
use rivet_testkit::node::{EndpointNode, NodeOptions};
use tokio::sync::watch;

use crate::endpoint::{
    APPS, CALL_TIMEOUT, LOADER_ENDPOINTS_MAX, MAX_ENDPOINTS, container_id, create_all, endpoint_requests,
};
use crate::procfs::{cpu_seconds, pid, rss_mib};
use crate::report::{BenchResult, load_average, ms, percentile, sibling_binary};

/// Namespaces of the other nodes' pods and of the policies of (3).
const OTHER_NAMESPACES: u32 = 10;
/// Node names the other pods are spread over.
const OTHER_NODES: u32 = 50;
/// How long one measured step may take before the benchmark gives up.
const STEP_TIMEOUT: Duration = Duration::from_secs(300);
/// How often svc-k8s-sync's GetStatus is polled after its restart.
const STATUS_POLL: Duration = Duration::from_millis(10);

/// Options of the Kubernetes benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct K8sArgs {
    /// Endpoints on the node (netns-less pods through svc-endpoint, with Pod
    /// objects on this node), selected by the policy of (1).
    #[arg(long, default_value_t = 500)]
    endpoints: u32,
    /// Rounds of (1): each creates and deletes the policy once per path.
    #[arg(long, default_value_t = 20)]
    rounds: u32,
    /// Label patches of (2).
    #[arg(long, default_value_t = 50)]
    label_patches: u32,
    /// Pods in the API for (3), the node's own included.
    #[arg(long, default_value_t = 10_000)]
    pods: u32,
    /// NetworkPolicies in the API for (3) (other namespaces: they select
    /// none of this node's pods).
    #[arg(long, default_value_t = 1000)]
    policies: u32,
    /// Concurrent CreateEndpoint calls while growing the node.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Concurrent creates against the API server.
    #[arg(long, default_value_t = 32)]
    api_concurrency: usize,
    /// The window over which svc-k8s-sync's steady CPU is measured, seconds.
    #[arg(long, default_value_t = 10)]
    cpu_window_seconds: u64,
    /// Goal for the ratio (reported, not enforced).
    #[arg(long, default_value_t = 1.5)]
    goal_ratio: f64,
}

/// Runs the benchmark.
pub async fn run(args: &K8sArgs) -> anyhow::Result<BenchResult> {
    anyhow::ensure!(
        args.endpoints > 0 && args.endpoints <= MAX_ENDPOINTS,
        "need 0 < --endpoints <= {MAX_ENDPOINTS} (the node's /22 pool)"
    );
    anyhow::ensure!(
        args.pods >= args.endpoints,
        "--pods counts the node's own: it must be >= --endpoints"
    );
    anyhow::ensure!(
        args.rounds > 0 && args.label_patches > 0 && args.concurrency > 0 && args.api_concurrency > 0,
        "--rounds, --label-patches, --concurrency and --api-concurrency must be positive"
    );
    let sync_bin = sibling_binary("svc-k8s-sync")?;
    for daemon in ["svc-loader", "svc-identity", "svc-ipam", "svc-endpoint"] {
        sibling_binary(daemon)?;
    }
    let bin_dir = sync_bin
        .parent()
        .ok_or_else(|| anyhow::anyhow!("{} has no parent dir", sync_bin.display()))?
        .to_path_buf();

    // Guards, dropped on every return path: the node (daemons, namespace
    // with the veths, pins, temp dir), svc-k8s-sync, the API server (and
    // its etcd and temp dir).
    let setup = Instant::now();
    let api = KubeApiServer::start().await?;
    api.apply_crds().await?;
    let access = api.service_account_client("svc-k8s-sync").await?;
    let admin = api.admin_client();
    let node = EndpointNode::start(NodeOptions {
        bin_dir: Some(bin_dir),
        loader_endpoints_max: Some(LOADER_ENDPOINTS_MAX),
        k8s_sync: true,
        ..NodeOptions::default()
    })
    .await?;
    let node_name = node.node.node_name.clone();
    Api::<Node>::all(admin.clone())
        .create(&PostParams::default(), &node_object(&node_name)?)
        .await?;
    let sockets = node.sockets();
    let mut sync = DaemonCommand::new(&sync_bin, sockets.join("svc-k8s-sync.sock"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), node.state_dir().as_os_str()])
        .args(["--node-name", &node_name])
        .args(["--kubeconfig".as_ref(), access.kubeconfig.as_os_str()])
        .log_to(node.node.dir.path().join("svc-k8s-sync.log"))
        .spawn()
        .await?;
    println!(
        "setup: kube-apiserver ready in {:.1} s, node {node_name} with svc-k8s-sync in {:.1} s",
        api.ready_after().as_secs_f64(),
        setup.elapsed().as_secs_f64()
    );

    let options = ClientOptions {
        request_timeout: CALL_TIMEOUT,
        ..ClientOptions::default()
    };
    let channel = |name: &str| {
        let path = sockets.join(format!("{name}.sock"));
        let options = options.clone();
        async move { connect_unix(&path, &options).await }
    };
    let endpoints = EndpointServiceClient::new(channel("svc-endpoint").await?);
    let mut policies = PolicyServiceClient::new(channel("svc-endpoint").await?);
    let ipam = IpamClient::new(channel("svc-ipam").await?);
    let mut loader = LoaderServiceClient::new(channel("svc-loader").await?);
    let mut status = KubernetesSyncServiceClient::new(channel("svc-k8s-sync").await?);

    // The node's pods: Pod objects first (svc-k8s-sync feeds their labels),
    // then the endpoints; every one must end on its labels' identity.
    let n = args.endpoints as usize;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), "default");
    let started = Instant::now();
    create_objects(
        &admin,
        (0..args.endpoints).map(|i| own_pod(i, &node_name)),
        args.api_concurrency,
    )
    .await?;
    let requests = endpoint_requests(&node, &ipam, args.endpoints, args.concurrency).await?;
    create_all(&endpoints, &requests, args.concurrency).await?;
    let realised = Realised::watch(endpoints.clone()).await?;
    realised
        .until("every endpoint on its pod's labels", |eps| {
            eps.len() == n
                && eps
                    .values()
                    .all(|e| ready(e) && !e.labels_pending && e.identity_labels.iter().any(|l| l == "k8s:tier=bench"))
        })
        .await?;
    println!(
        "{n} pods in the API and their endpoints ready on their labels' identities in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // 1. NetworkPolicy through the API vs UpsertPolicy, interleaved.
    let network_policies: Api<NetworkPolicy> = Api::namespaced(admin.clone(), "default");
    let mut samples: HashMap<(Route, Change), Vec<f64>> = HashMap::new();
    for round in 0..args.rounds {
        let order = if round % 2 == 0 {
            [Route::Kubernetes, Route::Direct]
        } else {
            [Route::Direct, Route::Kubernetes]
        };
        for path in order {
            for change in [Change::Create, Change::Delete] {
                let before = realised.max_revision();
                let started = Instant::now();
                match (path, change) {
                    (Route::Kubernetes, Change::Create) => {
                        network_policies
                            .create(
                                &PostParams::default(),
                                &network_policy("bench-k8s", "default", "tier", "bench")?,
                            )
                            .await?;
                    }
                    (Route::Kubernetes, Change::Delete) => {
                        network_policies.delete("bench-k8s", &DeleteParams::default()).await?;
                    }
                    (Route::Direct, Change::Create) => {
                        policies
                            .upsert_policy(pb::UpsertPolicyRequest {
                                document: direct_policy()?,
                                origin: pb::PolicyOrigin::Api.into(),
                                wait: false,
                            })
                            .await?;
                    }
                    (Route::Direct, Change::Delete) => {
                        policies
                            .delete_policy(pb::DeletePolicyRequest {
                                key: Some(pb::PolicyKey {
                                    kind: "NetworkPolicy".into(),
                                    namespace: "default".into(),
                                    name: "bench-direct".into(),
                                }),
                                origin: pb::PolicyOrigin::Api.into(),
                                wait: false,
                            })
                            .await?;
                    }
                }
                let enforced = change == Change::Create;
                realised
                    .until(&format!("{path:?} {change:?} realised on {n} endpoints"), |eps| {
                        eps.len() == n
                            && eps
                                .values()
                                .all(|e| e.policy_revision > before && e.ingress_enforced == enforced && ready(e))
                    })
                    .await?;
                samples.entry((path, change)).or_default().push(ms(started.elapsed()));
            }
        }
    }
    let mut quantiles = |path, change| {
        let values = samples.entry((path, change)).or_default();
        (percentile(values, 0.50), percentile(values, 0.99))
    };
    let (k8s_create_p50, k8s_create_p99) = quantiles(Route::Kubernetes, Change::Create);
    let (k8s_delete_p50, k8s_delete_p99) = quantiles(Route::Kubernetes, Change::Delete);
    let (direct_create_p50, direct_create_p99) = quantiles(Route::Direct, Change::Create);
    let (direct_delete_p50, direct_delete_p99) = quantiles(Route::Direct, Change::Delete);
    println!(
        "policy on {n} endpoints, {} interleaved rounds: NetworkPolicy through the API create p50 \
         {k8s_create_p50:.0} ms p99 {k8s_create_p99:.0} ms, delete p50 {k8s_delete_p50:.0} ms p99 \
         {k8s_delete_p99:.0} ms; UpsertPolicy (origin API) create p50 {direct_create_p50:.0} ms p99 \
         {direct_create_p99:.0} ms, delete p50 {direct_delete_p50:.0} ms p99 {direct_delete_p99:.0} ms",
        args.rounds
    );

    // 2. Label patches, with a policy selecting every endpoint in place.
    network_policies
        .create(
            &PostParams::default(),
            &network_policy("bench-k8s", "default", "tier", "bench")?,
        )
        .await?;
    let before = realised.max_revision();
    realised
        .until("the policy of (2) realised", |eps| {
            eps.values()
                .all(|e| e.policy_revision > before && e.ingress_enforced && ready(e))
        })
        .await?;
    let mut label_ms = Vec::with_capacity(args.label_patches as usize);
    for patch in 0..args.label_patches {
        let i = patch % args.endpoints;
        let name = container_id(i);
        let value = format!("patched-{patch}");
        let label = format!("k8s:app={value}");
        let started = Instant::now();
        pods.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {"app": value}}})),
        )
        .await?;
        let identity = realised
            .until(&format!("pod {name} on the identity of {label}"), |eps| {
                eps.values()
                    .any(|e| e.pod_name == name && ready(e) && e.identity_labels.contains(&label))
            })
            .await?
            .values()
            .find(|e| e.pod_name == name)
            .map(|e| (e.id, e.identity))
            .unwrap_or_default();
        label_ms.push(ms(started.elapsed()));
        check_identity(&mut loader, identity).await?;
    }
    let (label_p50, label_p99) = (percentile(&mut label_ms, 0.50), percentile(&mut label_ms, 0.99));
    println!(
        "pod label patch to the new identity realised in svc-loader ({} patches): p50 {label_p50:.0} ms, \
         p99 {label_p99:.0} ms",
        args.label_patches
    );

    // 3. A big cluster: other nodes' pods and policies; svc-k8s-sync's
    // re-list after kill -9, memory and steady CPU.
    let started = Instant::now();
    for k in 0..OTHER_NAMESPACES {
        api.ensure_namespace(&other_namespace(k)).await?;
    }
    let others = args.pods - args.endpoints;
    create_objects(&admin, (0..others).map(other_pod), args.api_concurrency).await?;
    let pods_s = started.elapsed().as_secs_f64();
    let policies_started = Instant::now();
    create_objects(&admin, (0..args.policies).map(other_policy), args.api_concurrency).await?;
    let policies_s = policies_started.elapsed().as_secs_f64();
    println!(
        "setup of (3): {others} pods of {OTHER_NODES} other nodes in {:.1} s ({:.0}/s) and {} NetworkPolicies in \
         {policies_s:.1} s ({:.0}/s), {} concurrent creates",
        pods_s,
        f64::from(others) / pods_s,
        args.policies,
        f64::from(args.policies) / policies_s,
        args.api_concurrency
    );
    let replays_before = replays(&mut status).await?;
    sync.kill9();
    let restarted = Instant::now();
    sync.restart().await?;
    let mut status = KubernetesSyncServiceClient::new(channel("svc-k8s-sync").await?);
    let synced = wait_status(&mut status, "caches synced", |s| s.caches_synced).await?;
    let list_ms = ms(restarted.elapsed());
    let objects: HashMap<String, u64> = synced.kinds.iter().map(|k| (k.kind.clone(), k.objects)).collect();
    wait_status(&mut status, "the replay to svc-endpoint", |s| {
        s.fed.iter().any(|f| f.replays > 0 && f.last_error.is_empty())
    })
    .await?;
    let replay_ms = ms(restarted.elapsed());
    anyhow::ensure!(
        objects.get("NetworkPolicy").copied().unwrap_or_default() >= u64::from(args.policies)
            && objects.get("Pod").copied().unwrap_or_default() == u64::from(args.endpoints),
        "svc-k8s-sync's caches after the re-list: {objects:?}; expected {} NetworkPolicies and this node's {} pods",
        args.policies,
        args.endpoints
    );
    println!(
        "svc-k8s-sync kill -9 and restart with {} pods and {} policies in the API: caches synced after \
         {list_ms:.0} ms, replay to svc-endpoint done after {replay_ms:.0} ms (replays before: {replays_before}); \
         cached: {objects:?}",
        args.pods, args.policies
    );
    let sync_pid = pid(sync.pid())?;
    let cpu_before = cpu_seconds(sync_pid)?;
    let window = Instant::now();
    tokio::time::sleep(Duration::from_secs(args.cpu_window_seconds)).await;
    let cpu = cpu_seconds(sync_pid)? - cpu_before;
    let cpu_percent = 100.0 * cpu / window.elapsed().as_secs_f64();
    let rss = rss_mib(sync_pid, "svc-k8s-sync")?;
    let load = load_average()?;
    println!(
        "svc-k8s-sync at steady state: VmRSS {rss:.1} MiB, CPU {cpu_percent:.2}% of a core over {} s \
         (load average {load:.1})",
        args.cpu_window_seconds
    );

    let ratio = k8s_create_p50 / direct_create_p50;
    println!(
        "ratio = NetworkPolicy through the API p50 / UpsertPolicy p50 = {ratio:.2} (goal <= {}: {})",
        args.goal_ratio,
        if ratio <= args.goal_ratio { "met" } else { "NOT met" }
    );
    drop(realised);
    drop(sync);
    drop(node);
    drop(api);
    Ok(BenchResult {
        name: "k8s".into(),
        metrics: vec![
            ("k8s_policy_p50_ms".into(), k8s_create_p50),
            ("k8s_policy_p99_ms".into(), k8s_create_p99),
            ("direct_policy_p50_ms".into(), direct_create_p50),
            ("direct_policy_p99_ms".into(), direct_create_p99),
            ("k8s_policy_delete_p50_ms".into(), k8s_delete_p50),
            ("k8s_policy_delete_p99_ms".into(), k8s_delete_p99),
            ("direct_policy_delete_p50_ms".into(), direct_delete_p50),
            ("direct_policy_delete_p99_ms".into(), direct_delete_p99),
            ("policy_endpoints".into(), n as f64),
            ("policy_rounds".into(), f64::from(args.rounds)),
            ("label_patch_p50_ms".into(), label_p50),
            ("label_patch_p99_ms".into(), label_p99),
            ("api_pods".into(), f64::from(args.pods)),
            ("api_policies".into(), f64::from(args.policies)),
            ("api_setup_s".into(), pods_s + policies_s),
            ("sync_initial_list_ms".into(), list_ms),
            ("sync_replay_done_ms".into(), replay_ms),
            ("sync_rss_mib".into(), rss),
            ("sync_cpu_percent".into(), cpu_percent),
            ("load_average".into(), load),
            ("goal_ratio".into(), args.goal_ratio),
            ("goal_met".into(), f64::from(u8::from(ratio <= args.goal_ratio))),
        ],
        ratio,
    })
}

/// Which way a policy reaches svc-endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Route {
    /// A NetworkPolicy object, through svc-k8s-sync.
    Kubernetes,
    /// PolicyService.UpsertPolicy/DeletePolicy with origin API.
    Direct,
}

/// What happens to the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Change {
    Create,
    Delete,
}

fn ready(e: &pb::Endpoint) -> bool {
    e.state == pb::EndpointState::Ready as i32
}

/// The node's endpoints as svc-endpoint's WatchEndpoints reports them, kept
/// by a task reading the stream (aborted on drop).
struct Realised {
    view: watch::Receiver<View>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug, Default)]
struct View {
    endpoints: HashMap<u32, pb::Endpoint>,
    /// Why the stream ended.
    ended: Option<String>,
}

impl Realised {
    async fn watch(mut client: EndpointServiceClient<DaemonChannel>) -> anyhow::Result<Self> {
        let mut stream = client
            .watch_endpoints(pb::WatchEndpointsRequest::default())
            .await?
            .into_inner();
        let (tx, view) = watch::channel(View::default());
        let task = tokio::spawn(async move {
            let ended = loop {
                match stream.message().await {
                    Ok(Some(event)) => tx.send_modify(|v| match event.event {
                        Some(pb::watch_endpoints_response::Event::Upserted(e)) => {
                            v.endpoints.insert(e.id, e);
                        }
                        Some(pb::watch_endpoints_response::Event::Removed(e)) => {
                            v.endpoints.remove(&e.id);
                        }
                        Some(pb::watch_endpoints_response::Event::Synced(_)) | None => {}
                    }),
                    Ok(None) => break "the stream ended".to_string(),
                    Err(e) => break e.to_string(),
                }
            };
            tx.send_modify(|v| v.ended = Some(ended));
        });
        Ok(Self { view, task })
    }

    /// The highest policy revision any endpoint realised.
    fn max_revision(&self) -> u64 {
        self.view
            .borrow()
            .endpoints
            .values()
            .map(|e| e.policy_revision)
            .max()
            .unwrap_or_default()
    }

    /// Waits until `done` holds for the endpoints; returns them.
    async fn until(
        &self,
        what: &str,
        mut done: impl FnMut(&HashMap<u32, pb::Endpoint>) -> bool,
    ) -> anyhow::Result<HashMap<u32, pb::Endpoint>> {
        let mut view = self.view.clone();
        let waited = tokio::time::timeout(STEP_TIMEOUT, view.wait_for(|v| v.ended.is_some() || done(&v.endpoints)))
            .await
            .map_err(|_| anyhow::anyhow!("{what}: not reached after {STEP_TIMEOUT:?}"))??;
        if let Some(ended) = &waited.ended {
            anyhow::bail!("{what}: svc-endpoint's WatchEndpoints failed: {ended}");
        }
        Ok(waited.endpoints.clone())
    }
}

impl Drop for Realised {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Checks that svc-loader runs endpoint `id` on `identity`.
async fn check_identity(
    loader: &mut LoaderServiceClient<DaemonChannel>,
    (id, identity): (u32, u32),
) -> anyhow::Result<()> {
    let listed = loader.list_endpoints(ldpb::ListEndpointsRequest {}).await?.into_inner();
    let held = listed
        .endpoints
        .iter()
        .find(|e| e.endpoint_id == id)
        .map(|e| e.identity);
    anyhow::ensure!(
        held == Some(identity),
        "svc-loader holds identity {held:?} for endpoint {id}, svc-endpoint reports {identity}"
    );
    Ok(())
}

/// Polls svc-k8s-sync's GetStatus until `done`.
async fn wait_status(
    client: &mut KubernetesSyncServiceClient<DaemonChannel>,
    what: &str,
    done: impl Fn(&k8spb::GetStatusResponse) -> bool,
) -> anyhow::Result<k8spb::GetStatusResponse> {
    let since = Instant::now();
    loop {
        let status = client.get_status(k8spb::GetStatusRequest {}).await?.into_inner();
        if done(&status) {
            return Ok(status);
        }
        anyhow::ensure!(
            since.elapsed() < STEP_TIMEOUT,
            "svc-k8s-sync: {what} not reached after {STEP_TIMEOUT:?}: {status:?}"
        );
        tokio::time::sleep(STATUS_POLL).await;
    }
}

/// Completed replays to svc-endpoint so far.
async fn replays(client: &mut KubernetesSyncServiceClient<DaemonChannel>) -> anyhow::Result<u64> {
    let status = client.get_status(k8spb::GetStatusRequest {}).await?.into_inner();
    Ok(status.fed.iter().map(|f| f.replays).sum())
}

fn other_namespace(k: u32) -> String {
    format!("bench-other-{k}")
}

/// Pod `bench-<i>` of this node, with the labels `endpoint` uses.
fn own_pod(i: u32, node: &str) -> anyhow::Result<Pod> {
    pod_object(
        "default",
        &container_id(i),
        node,
        &format!("bench-{}", i % APPS),
        "bench",
    )
}

/// Another node's pod, in one of the other namespaces.
fn other_pod(i: u32) -> anyhow::Result<Pod> {
    pod_object(
        &other_namespace(i % OTHER_NAMESPACES),
        &format!("other-{i}"),
        &format!("other-node-{}", i % OTHER_NODES),
        &format!("other-{}", i % 100),
        "other",
    )
}

fn pod_object(namespace: &str, name: &str, node: &str, app: &str, tier: &str) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(serde_json::json!({
        "metadata": {"namespace": namespace, "name": name, "labels": {"app": app, "tier": tier}},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "app", "image": "bench.invalid/app", "ports": [{"name": "http", "containerPort": 80}]}],
        },
    }))?)
}

fn node_object(name: &str) -> anyhow::Result<Node> {
    Ok(serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?)
}

/// `endpoint`'s policy: selects `key=value`, ingress from any pod of the
/// namespace on TCP 80 and 443.
fn network_policy(name: &str, namespace: &str, key: &str, value: &str) -> anyhow::Result<NetworkPolicy> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": {key: value}},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [{"podSelector": {}}],
                "ports": [{"protocol": "TCP", "port": 80}, {"protocol": "TCP", "port": 443}],
            }],
        },
    }))?)
}

/// The same policy as a document for UpsertPolicy, named `bench-direct`.
fn direct_policy() -> anyhow::Result<String> {
    Ok(serde_json::to_string(&network_policy(
        "bench-direct",
        "default",
        "tier",
        "bench",
    )?)?)
}

/// A policy of an other namespace, selecting some of its pods.
fn other_policy(i: u32) -> anyhow::Result<NetworkPolicy> {
    network_policy(
        &format!("other-{i}"),
        &other_namespace(i % OTHER_NAMESPACES),
        "app",
        &format!("other-{}", i % 100),
    )
}

/// Creates namespaced `objects` each in its own namespace, `concurrency` at
/// a time.
async fn create_objects<K>(
    client: &Client,
    objects: impl Iterator<Item = anyhow::Result<K>>,
    concurrency: usize,
) -> anyhow::Result<()>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    futures::stream::iter(objects)
        .map(|object| async move {
            let object = object?;
            let namespace = object.meta().namespace.clone().unwrap_or_default();
            let api: Api<K> = Api::namespaced(client.clone(), &namespace);
            api.create(&PostParams::default(), &object).await?;
            anyhow::Ok(())
        })
        .buffer_unordered(concurrency)
        .try_collect::<()>()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_direct_policy_is_the_api_policy_renamed() {
        let direct: serde_json::Value = serde_json::from_str(&direct_policy().unwrap()).unwrap();
        let api = serde_json::to_value(network_policy("bench-k8s", "default", "tier", "bench").unwrap()).unwrap();
        assert_eq!(direct["spec"], api["spec"]);
        assert_eq!(direct["metadata"]["name"], "bench-direct");
    }
}
