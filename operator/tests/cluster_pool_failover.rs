//! Issue 15 §7: two rivet-operator processes, 100 Nodes joining and
//! leaving concurrently, the leader killed with SIGKILL in the middle. A
//! watch on the RivetNodes checks on every event that no pod CIDR is ever
//! held by two nodes; at the end every live node has its CIDRs, no gone
//! node's RivetNode outlives the grace, and the pool's allocated count (the
//! new leader's metric) equals the live nodes: nothing leaked.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt as _;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::{WatchStreamExt as _, watcher};
use rivet_common::testing::{http_get, metric_sample};
use rivet_k8s::RivetNode;
use rivet_operator::cluster_pool::allocator::{Family, overlap};

use rivet_testkit::kube::KubeApiServer;
use rivet_testkit::operator::Operator;
use serde_json::json;
use tokio::sync::watch;

const NODES: usize = 100;
/// Generous: 100 nodes, a failover and the grace on a busy machine.
const WAIT: Duration = Duration::from_secs(120);

/// What the watch has seen: the current CIDRs per RivetNode and every
/// moment two of them overlapped.
#[derive(Debug, Default, Clone)]
struct Seen {
    cidrs: BTreeMap<String, Vec<IpNet>>,
    /// A relist in progress (replaces `cidrs` when done).
    listing: Option<BTreeMap<String, Vec<IpNet>>>,
    violations: Vec<String>,
}

impl Seen {
    fn apply(&mut self, event: watcher::Event<RivetNode>) {
        let cidrs =
            |n: &RivetNode| -> Vec<IpNet> { n.spec.pod_cidrs.iter().map(|c| c.parse().expect("a CIDR")).collect() };
        match event {
            watcher::Event::Apply(n) => {
                self.cidrs.insert(n.name_any(), cidrs(&n));
                self.check(&n.name_any());
            }
            watcher::Event::Delete(n) => {
                self.cidrs.remove(&n.name_any());
            }
            watcher::Event::Init => self.listing = Some(BTreeMap::new()),
            watcher::Event::InitApply(n) => {
                self.listing.get_or_insert_default().insert(n.name_any(), cidrs(&n));
            }
            watcher::Event::InitDone => {
                self.cidrs = self.listing.take().unwrap_or_default();
                let names: Vec<String> = self.cidrs.keys().cloned().collect();
                for name in names {
                    self.check(&name);
                }
            }
        }
    }

    fn check(&mut self, name: &str) {
        let Some(mine) = self.cidrs.get(name) else { return };
        for (other, theirs) in &self.cidrs {
            if other == name {
                continue;
            }
            for a in mine {
                if let Some(b) = theirs.iter().find(|b| overlap(a, b)) {
                    self.violations
                        .push(format!("{name} holds {a} while {other} holds {b}"));
                }
            }
        }
    }

    fn allocated(&self) -> usize {
        self.cidrs.values().filter(|c| c.len() == 2).count()
    }
}

fn watch_rivet_nodes(client: kube::Client) -> (watch::Receiver<Seen>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(Seen::default());
    let api: Api<RivetNode> = Api::all(client);
    let task = tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()).default_backoff());
        while let Some(event) = events.next().await {
            // An error is retried by the watcher (with a fresh list).
            if let Ok(event) = event {
                tx.send_modify(|seen| seen.apply(event));
            }
        }
    });
    (rx, task)
}

async fn create_node(nodes: &Api<Node>, name: String) {
    let node: Node = serde_json::from_value(json!({ "metadata": { "name": name } })).unwrap();
    nodes
        .create(&PostParams::default(), &node)
        .await
        .unwrap_or_else(|e| panic!("creating Node {name}: {e}"));
}

async fn delete_node(nodes: &Api<Node>, name: String) {
    nodes
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("deleting Node {name}: {e}"));
}

/// Creates `join` and deletes `leave`, 8 calls at a time, interleaved.
async fn churn(nodes: &Api<Node>, join: Vec<String>, leave: Vec<String>) {
    let mut calls = Vec::new();
    let mut leave = leave.into_iter();
    for name in join {
        calls.push(futures::future::Either::Left(create_node(nodes, name)));
        if let Some(gone) = leave.next() {
            calls.push(futures::future::Either::Right(delete_node(nodes, gone)));
        }
    }
    for gone in leave {
        calls.push(futures::future::Either::Right(delete_node(nodes, gone)));
    }
    futures::stream::iter(calls)
        .buffer_unordered(8)
        .collect::<Vec<()>>()
        .await;
}

async fn allocated_metric(operator: &Operator, family: Family) -> Option<f64> {
    let text = http_get(operator.metrics_address(), "/metrics").await.ok()?;
    let line = format!("rivet_operator_pod_cidrs_allocated{{family=\"{family}\"}}");
    metric_sample(&text, &line)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_nodes_join_and_leave_across_a_kill9_failover_and_no_cidr_is_held_twice_or_leaks() {
    let server = KubeApiServer::start().await.expect("kube-apiserver starts");
    server.apply_crds().await.expect("the CRDs apply");
    let access = server.service_account_client("rivet-operator").await.unwrap();
    let args = [
        "--cluster-pool-ipv4-cidr",
        "198.18.0.0/16",
        "--cluster-pool-ipv6-cidr",
        "2001:2::/104",
        "--node-cidr-release-grace",
        "2",
        "--leader-election-lease-duration",
        "4s",
        "--leader-election-renew-deadline",
        "3s",
        "--leader-election-retry-period",
        "500ms",
    ];
    let mut a = Operator::start(&access, &args).await.expect("operator a starts");
    a.wait_leading(WAIT).await.expect("a leads");
    let b = Operator::start(&access, &args).await.expect("operator b starts");
    let (seen, watch_task) = watch_rivet_nodes(server.admin_client());
    let nodes: Api<Node> = Api::all(server.admin_client());

    let name = |i: usize| format!("node-{i:03}");
    let first: Vec<String> = (0..NODES / 2).map(name).collect();
    let second: Vec<String> = (NODES / 2..NODES).map(name).collect();
    let first_leaving: Vec<String> = (0..NODES / 2)
        .step_by(5)
        .chain((1..NODES / 2).step_by(5))
        .map(name)
        .collect();
    let second_leaving: Vec<String> = (NODES / 2..NODES).step_by(3).take(15).map(name).collect();

    // 50 join while a leads; once 15 have their CIDRs (the others still
    // being allocated), a is killed. The joins go on without a leader.
    let joining = tokio::spawn({
        let nodes = nodes.clone();
        let first = first.clone();
        async move { churn(&nodes, first, vec![]).await }
    });
    let mut rx = seen.clone();
    tokio::time::timeout(WAIT, rx.wait_for(|s| s.allocated() >= 15))
        .await
        .expect("a allocates for the first nodes")
        .unwrap();
    a.kill9();
    let allocated_by_a = seen.borrow().allocated();
    joining.await.unwrap();
    // While b takes over: 20 of them leave as 50 more join, then 15 of
    // those leave again.
    churn(&nodes, second.clone(), first_leaving.clone()).await;
    churn(&nodes, vec![], second_leaving.clone()).await;
    b.wait_leading(WAIT).await.expect("b takes over after a's kill -9");

    let gone: BTreeSet<String> = first_leaving.iter().chain(&second_leaving).cloned().collect();
    let live: BTreeSet<String> = first
        .iter()
        .chain(&second)
        .filter(|n| !gone.contains(*n))
        .cloned()
        .collect();
    let mut rx = seen.clone();
    let settled = tokio::time::timeout(
        WAIT,
        rx.wait_for(|s| {
            s.cidrs.keys().cloned().collect::<BTreeSet<_>>() == live
                && s.cidrs.values().all(|c| {
                    c.iter().any(|n| Family::of(n) == Family::V4) && c.iter().any(|n| Family::of(n) == Family::V6)
                })
        }),
    )
    .await;
    let now = seen.borrow().clone();
    assert!(
        settled.is_ok(),
        "within {WAIT:?} every live node has both CIDRs and no gone node's RivetNode remains; RivetNodes: {:?}\nlog of b:\n{}",
        now.cidrs,
        b.log()
    );
    assert!(
        now.violations.is_empty(),
        "a CIDR was held by two nodes ({} times), first: {:?}",
        now.violations.len(),
        &now.violations[..now.violations.len().min(6)]
    );
    assert_eq!(
        now.cidrs.values().map(Vec::len).sum::<usize>(),
        live.len() * 2,
        "one CIDR per family"
    );

    let text = http_get(b.metrics_address(), "/metrics").await.unwrap();
    let by_b = metric_sample(&text, "rivet_operator_pod_cidr_allocations_total{family=\"ipv4\"}");
    assert!(
        by_b.is_some_and(|n| n > 0.0),
        "b allocated after the failover (a had {allocated_by_a} nodes allocated when killed): {by_b:?}"
    );

    // The new leader's pool counts exactly the live nodes' blocks: none leaked.
    for family in [Family::V4, Family::V6] {
        let mut allocated = None;
        for _ in 0..100 {
            allocated = allocated_metric(&b, family).await;
            if allocated == Some(live.len() as f64) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(allocated, Some(live.len() as f64), "{family} blocks allocated");
    }
    watch_task.abort();
}
