//! The `cluster-pool` duty in-process against a real kube-apiserver (and
//! its etcd), with the operator's own ServiceAccount and RBAC
//! (deploy/rbac/rivet-operator.yaml): Nodes get RivetNodes with pod CIDRs,
//! a gone Node's RivetNode is deleted after the grace and its CIDR reused,
//! exhaustion and conflicts are conditions, svc-k8s-sync's `Ready`
//! condition and spec fields are left alone, and a new term rebuilds the
//! allocation from the API objects.

use std::time::{Duration, Instant};

use futures::StreamExt as _;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::{Condition, await_condition, conditions};
use prometheus_client::registry::Registry;
use rivet_common::controller::Controllers;
use rivet_k8s::{CONDITION_POD_CIDRS_ALLOCATED, CONDITION_READY, NodeCondition, RivetNode};
use rivet_operator::cluster_pool::allocator::{Family, PoolConfig};
use rivet_operator::cluster_pool::{
    ClusterPool, ClusterPoolArgs, NODE_DELETED_AT_ANNOTATION, PoolMetrics, REASON_ALLOCATED, REASON_CONFLICT,
    REASON_EXHAUSTED,
};
use rivet_operator::term::{Duty, Term};
use rivet_testkit::kube::KubeApiServer;
use serde_json::json;

/// How long a condition may take to show up.
const WAIT: Duration = Duration::from_secs(30);
const GRACE: Duration = Duration::from_secs(2);

struct Harness {
    server: KubeApiServer,
    operator: kube::Client,
}

impl Harness {
    async fn start() -> Self {
        let server = KubeApiServer::start().await.expect("kube-apiserver starts");
        server.apply_crds().await.expect("the CRDs apply");
        let operator = server
            .service_account_client("rivet-operator")
            .await
            .expect("the operator's ServiceAccount")
            .client;
        Self { server, operator }
    }

    fn nodes(&self) -> Api<Node> {
        Api::all(self.server.admin_client())
    }

    fn rivet_nodes(&self) -> Api<RivetNode> {
        Api::all(self.server.admin_client())
    }

    async fn create_node(&self, name: &str) {
        let node: Node = serde_json::from_value(json!({ "metadata": { "name": name } })).unwrap();
        self.nodes()
            .create(&PostParams::default(), &node)
            .await
            .unwrap_or_else(|e| panic!("creating Node {name}: {e}"));
    }

    async fn delete_node(&self, name: &str) {
        self.nodes()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("deleting Node {name}: {e}"));
    }

    /// Starts the duty for a fresh term, as the elector would.
    fn start_term(&self, config: PoolConfig, grace: Duration) -> (Term, Controllers, PoolMetrics) {
        let metrics = PoolMetrics::default();
        let duty = ClusterPool::new(self.operator.clone(), config, grace, metrics.clone());
        let term = Term::begin("test", 0, Instant::now() + Duration::from_secs(3600));
        let controllers = Controllers::new();
        duty.start(&term, &controllers);
        (term, controllers, metrics)
    }

    /// Waits (on a watch) until RivetNode `name` satisfies `condition`.
    async fn wait_for(&self, name: &str, what: &str, condition: impl Condition<RivetNode>) -> RivetNode {
        let api = self.rivet_nodes();
        match tokio::time::timeout(WAIT, await_condition(api, name, condition)).await {
            Ok(Ok(Some(node))) => node,
            Ok(Ok(None)) => panic!("RivetNode {name} is gone while waiting until {what}"),
            Ok(Err(e)) => panic!("watching RivetNode {name}: {e}"),
            Err(_) => panic!(
                "RivetNode {name}: not {what} within {WAIT:?}; it is {:#?}",
                self.rivet_nodes().get_opt(name).await
            ),
        }
    }

    /// Waits until RivetNode `name` carries the node-deleted-at annotation.
    async fn wait_marked_gone(&self, name: &str) -> RivetNode {
        self.wait_for(name, "annotated as gone", |n: Option<&RivetNode>| {
            n.is_some_and(|n| n.annotations().contains_key(NODE_DELETED_AT_ANNOTATION))
        })
        .await
    }

    async fn wait_allocated(&self, name: &str) -> RivetNode {
        self.wait_for(name, "PodCIDRsAllocated=True", has_condition("True", REASON_ALLOCATED))
            .await
    }

    async fn wait_deleted(&self, name: &str) {
        let uid = self.rivet_nodes().get(name).await.unwrap().metadata.uid.unwrap();
        tokio::time::timeout(
            WAIT,
            await_condition(self.rivet_nodes(), name, conditions::is_deleted(&uid)),
        )
        .await
        .unwrap_or_else(|_| panic!("RivetNode {name} not deleted within {WAIT:?}"))
        .unwrap();
    }
}

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

fn condition<'a>(node: &'a RivetNode, type_: &str) -> Option<&'a NodeCondition> {
    node.status.as_ref()?.conditions.iter().find(|c| c.type_ == type_)
}

fn has_condition(status: &'static str, reason: &'static str) -> impl Condition<RivetNode> {
    move |node: Option<&RivetNode>| {
        node.and_then(|n| condition(n, CONDITION_POD_CIDRS_ALLOCATED))
            .is_some_and(|c| c.status == status && c.reason.as_deref() == Some(reason))
    }
}

fn pod_cidrs(node: &RivetNode) -> Vec<IpNet> {
    node.spec.pod_cidrs.iter().map(|c| c.parse().unwrap()).collect()
}

fn dual_stack() -> PoolConfig {
    PoolConfig::new(&nets(&["198.18.0.0/22"]), 24, &nets(&["2001:2::/112"]), 120).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_gets_one_cidr_per_family_and_a_gone_nodes_cidr_goes_to_the_next_node_after_the_grace() {
    let h = Harness::start().await;
    // svc-k8s-sync of node `pre` was first: its RivetNode has addresses and
    // a Ready condition of its own field manager, and no pod CIDRs.
    h.create_node("pre").await;
    let sync = PatchParams::apply("rivet-k8s-sync").force();
    h.rivet_nodes()
        .patch(
            "pre",
            &sync,
            &Patch::Apply(json!({
                "apiVersion": "rivet.io/v1", "kind": "RivetNode", "metadata": { "name": "pre" },
                "spec": { "addresses": [{ "type": "InternalIP", "ip": "198.19.0.1" }] },
            })),
        )
        .await
        .unwrap();
    h.rivet_nodes()
        .patch_status(
            "pre",
            &sync,
            &Patch::Apply(json!({
                "apiVersion": "rivet.io/v1", "kind": "RivetNode", "metadata": { "name": "pre" },
                "status": { "conditions": [{ "type": CONDITION_READY, "status": "True", "reason": "AgentReady" }] },
            })),
        )
        .await
        .unwrap();

    let (_term, controllers, _metrics) = h.start_term(dual_stack(), GRACE);
    let pre = h.wait_allocated("pre").await;
    assert_eq!(pod_cidrs(&pre), nets(&["198.18.0.0/24", "2001:2::/120"]));
    let ready = condition(&pre, CONDITION_READY).expect("svc-k8s-sync's Ready condition is kept");
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_deref()),
        ("True", Some("AgentReady"))
    );
    assert_eq!(pre.spec.addresses.len(), 1, "svc-k8s-sync's addresses are kept");

    // A Node without a RivetNode gets one, with the next blocks.
    h.create_node("n1").await;
    let n1 = h.wait_allocated("n1").await;
    let n1_cidrs = pod_cidrs(&n1);
    assert_eq!(n1_cidrs, nets(&["198.18.1.0/24", "2001:2::100/120"]));
    let allocated = condition(&n1, CONDITION_POD_CIDRS_ALLOCATED).unwrap();
    assert!(
        allocated.message.as_deref().unwrap().contains("198.18.1.0/24"),
        "{allocated:?}"
    );

    // The Node goes: the RivetNode is annotated, then deleted after the grace.
    let deleted = Instant::now();
    h.delete_node("n1").await;
    let marked = h.wait_marked_gone("n1").await;
    assert_eq!(pod_cidrs(&marked), n1_cidrs, "its CIDRs stay during the grace");
    h.create_node("n2").await;
    let n2 = h.wait_allocated("n2").await;
    assert_eq!(
        pod_cidrs(&n2),
        nets(&["198.18.2.0/24", "2001:2::200/120"]),
        "n1's blocks are reserved during the grace"
    );
    h.wait_deleted("n1").await;
    assert!(deleted.elapsed() >= GRACE, "deleted after {:?}", deleted.elapsed());

    // The freed blocks are the lowest: the next node gets them.
    h.create_node("n3").await;
    let n3 = h.wait_allocated("n3").await;
    assert_eq!(pod_cidrs(&n3), n1_cidrs, "n1's CIDRs are reused once released");
    controllers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_that_comes_back_within_the_grace_keeps_its_cidrs() {
    let h = Harness::start().await;
    let (_term, controllers, _metrics) = h.start_term(dual_stack(), Duration::from_secs(3600));
    h.create_node("back").await;
    let before = pod_cidrs(&h.wait_allocated("back").await);
    h.delete_node("back").await;
    h.wait_marked_gone("back").await;
    h.create_node("back").await;
    let after = h
        .wait_for("back", "no longer annotated", |n: Option<&RivetNode>| {
            n.is_some_and(|n| !n.annotations().contains_key(NODE_DELETED_AT_ANNOTATION))
        })
        .await;
    assert_eq!(pod_cidrs(&after), before);
    controllers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_exhausted_pool_is_a_condition_and_a_released_block_goes_to_the_waiting_node() {
    let h = Harness::start().await;
    let two_blocks = PoolConfig::new(&nets(&["198.18.0.0/23"]), 24, &[], 120).unwrap();
    let mut registry = Registry::with_prefix("rivet");
    let args = ClusterPoolArgs {
        cluster_pool_ipv4_cidr: nets(&["198.18.0.0/23"]),
        cluster_pool_ipv4_mask_size: 24,
        cluster_pool_ipv6_cidr: vec![],
        cluster_pool_ipv6_mask_size: 120,
        node_cidr_release_grace: 1,
    };
    assert_eq!(args.pool().unwrap(), two_blocks);
    let duty = ClusterPool::from_args(h.operator.clone(), &args, &mut registry).unwrap();
    let term = Term::begin("test", 0, Instant::now() + Duration::from_secs(3600));
    let controllers = Controllers::new();
    duty.start(&term, &controllers);

    for name in ["a", "b"] {
        h.create_node(name).await;
        h.wait_allocated(name).await;
    }
    h.create_node("c").await;
    let c = h
        .wait_for("c", "exhausted", has_condition("False", REASON_EXHAUSTED))
        .await;
    assert!(c.spec.pod_cidrs.is_empty());
    let message = condition(&c, CONDITION_POD_CIDRS_ALLOCATED)
        .unwrap()
        .message
        .clone()
        .unwrap();
    assert!(message.contains("198.18.0.0/23"), "{message}");
    let metrics = encode(&registry);
    assert!(
        metrics.contains("rivet_operator_pod_cidr_exhaustions_total{family=\"ipv4\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("rivet_operator_pod_cidrs_available{family=\"ipv4\"} 0"),
        "{metrics}"
    );

    let a_cidrs = pod_cidrs(&h.rivet_nodes().get("a").await.unwrap());
    h.delete_node("a").await;
    let c = h.wait_allocated("c").await;
    assert_eq!(pod_cidrs(&c), a_cidrs, "c gets a's block once it is released");
    assert!(
        h.rivet_nodes().get_opt("a").await.unwrap().is_none(),
        "the block was released by deleting a's RivetNode"
    );
    let metrics = encode(&registry);
    assert!(
        metrics.contains("rivet_operator_pod_cidr_releases_total{family=\"ipv4\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("rivet_operator_rivetnodes_deleted_total 1"),
        "{metrics}"
    );
    controllers.shutdown().await;
}

fn encode(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

#[tokio::test(flavor = "multi_thread")]
async fn overlapping_cidrs_are_a_conflict_on_the_newer_node_and_never_rewritten() {
    let h = Harness::start().await;
    // Nodes with their own pools (another field manager owns podCidrs),
    // overlapping by mistake; the older one is `old` (created first, or in
    // the same second: then the name decides).
    for (name, cidrs) in [("old", ["198.18.0.0/24"]), ("young", ["198.18.0.128/25"])] {
        h.create_node(name).await;
        h.rivet_nodes()
            .patch(
                name,
                &PatchParams::apply("by-hand"),
                &Patch::Apply(json!({
                    "apiVersion": "rivet.io/v1", "kind": "RivetNode", "metadata": { "name": name },
                    "spec": { "podCidrs": cidrs },
                })),
            )
            .await
            .unwrap();
    }
    let (_term, controllers, _metrics) =
        h.start_term(PoolConfig::new(&nets(&["198.18.0.0/22"]), 24, &[], 120).unwrap(), GRACE);
    let young = h
        .wait_for("young", "in conflict", has_condition("False", REASON_CONFLICT))
        .await;
    let message = condition(&young, CONDITION_POD_CIDRS_ALLOCATED)
        .unwrap()
        .message
        .clone()
        .unwrap();
    assert!(message.contains("RivetNode old"), "names the other node: {message}");
    assert_eq!(young.spec.pod_cidrs, vec!["198.18.0.128/25"], "never rewritten");
    let old = h
        .wait_for("old", "a condition", |n: Option<&RivetNode>| {
            n.and_then(|n| condition(n, CONDITION_POD_CIDRS_ALLOCATED)).is_some()
        })
        .await;
    assert_eq!(condition(&old, CONDITION_POD_CIDRS_ALLOCATED).unwrap().status, "True");
    assert_eq!(old.spec.pod_cidrs, vec!["198.18.0.0/24"]);

    // A new node gets neither block of theirs.
    h.create_node("new").await;
    assert_eq!(pod_cidrs(&h.wait_allocated("new").await), nets(&["198.18.1.0/24"]));
    controllers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_term_rebuilds_the_allocation_from_the_api_objects() {
    let h = Harness::start().await;
    let (term, controllers, _metrics) = h.start_term(dual_stack(), GRACE);
    for name in ["t1-a", "t1-b"] {
        h.create_node(name).await;
        h.wait_allocated(name).await;
    }
    // One of the first term's nodes goes: the term marks it (the grace
    // runs), then ends; its writes stop.
    h.delete_node("t1-a").await;
    h.wait_marked_gone("t1-a").await;
    term.end();
    controllers.shutdown().await;
    assert!(term.ensure().is_err());

    // A node joins without a leader and one holds a CIDR outside the pool;
    // t1-a, pending deletion, keeps its blocks held.
    h.create_node("gap").await;
    h.create_node("outside").await;
    h.rivet_nodes()
        .patch(
            "outside",
            &PatchParams::apply("by-hand"),
            &Patch::Apply(json!({
                "apiVersion": "rivet.io/v1", "kind": "RivetNode", "metadata": { "name": "outside" },
                "spec": { "podCidrs": ["198.18.2.0/24", "10.0.0.0/24"] },
            })),
        )
        .await
        .unwrap();
    assert!(
        h.rivet_nodes().get_opt("gap").await.unwrap().is_none(),
        "no leader: nothing created"
    );

    let (_term, controllers, _metrics) = h.start_term(dual_stack(), Duration::from_secs(3600));
    let gap = h.wait_allocated("gap").await;
    assert_eq!(
        pod_cidrs(&gap),
        nets(&["198.18.3.0/24", "2001:2::200/120"]),
        "t1-a (gone, in grace), t1-b and `outside` keep theirs"
    );
    h.create_node("after").await;
    let exhausted = h
        .wait_for("after", "exhausted", has_condition("False", REASON_EXHAUSTED))
        .await;
    assert_eq!(
        pod_cidrs(&exhausted),
        nets(&["2001:2::300/120"]),
        "IPv6 is not exhausted"
    );
    controllers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_nodes_joining_at_once_get_distinct_cidrs_and_the_handle_signals_when_all_have_them() {
    let h = Harness::start().await;
    let wide = PoolConfig::new(&nets(&["198.18.0.0/16"]), 24, &nets(&["2001:2::/112"]), 120).unwrap();
    let duty = ClusterPool::new(h.operator.clone(), wide, GRACE, PoolMetrics::default());
    let term = Term::begin("test", 0, Instant::now() + Duration::from_secs(3600));
    let controllers = Controllers::new();
    let pool = duty.start_term(&term, &controllers);
    let names: Vec<String> = (0..50).map(|i| format!("join-{i:02}")).collect();
    futures::stream::iter(names.iter().map(|n| h.create_node(n)))
        .buffer_unordered(16)
        .collect::<Vec<()>>()
        .await;
    tokio::time::timeout(WAIT, pool.wait_all_allocated(names.len()))
        .await
        .unwrap_or_else(|_| panic!("not all allocated within {WAIT:?}: {:?}", pool.view()));
    // What the handle signalled is what the API holds.
    let listed = h.rivet_nodes().list(&Default::default()).await.unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for node in &listed.items {
        let cidrs = pod_cidrs(node);
        assert_eq!(cidrs.len(), 2, "{}: {cidrs:?}", node.name_any());
        for cidr in cidrs {
            assert!(seen.insert(cidr), "{cidr} held twice");
        }
    }
    assert_eq!(listed.items.len(), names.len());
    assert_eq!(pool.view().usage[&Family::V4], (50, 256 - 50));
    assert_eq!(pool.view().usage[&Family::V6], (50, 256 - 50));
    controllers.shutdown().await;
}
