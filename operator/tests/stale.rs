//! Duty `stale-objects` in-process against a real kube-apiserver, with the
//! operator's ServiceAccount (`deploy/rbac/rivet-operator.yaml`): the
//! RivetEndpoint GC and the not-ready taint. The taint against a real
//! svc-k8s-sync is in svc-k8s-sync's tests (kubernetes.rs).

use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use rivet_common::controller::Controllers;
use rivet_k8s::{NodeCondition, RivetEndpoint, RivetNode, RivetNodeStatus};
use rivet_operator::stale::endpoints::{self, StaleReason};
use rivet_operator::stale::{StaleArgs, StaleMetrics, StaleObjects};
use rivet_operator::term::{Duty, Term};
use rivet_testkit::kube::{KubeApiServer, delete_pod_now};
use serde_json::json;

const CONVERGE: Duration = Duration::from_secs(30);

async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let started = Instant::now();
    loop {
        match check().await {
            Ok(value) => return value,
            Err(e) if started.elapsed() > CONVERGE => panic!("{what}: not after {CONVERGE:?}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

fn term() -> Term {
    Term::begin("test", 0, Instant::now() + Duration::from_secs(3600))
}

/// The API server with the CRDs and the operator's ServiceAccount client.
async fn api() -> (KubeApiServer, Client) {
    let api = KubeApiServer::start().await.expect("kube-apiserver starts");
    api.apply_crds().await.expect("the CRDs are established");
    let access = api
        .service_account_client("rivet-operator")
        .await
        .expect("the operator's RBAC applies");
    (api, access.client)
}

/// Creates pod `shop/name` (no node, no kubelet); returns its UID.
async fn create_pod(admin: &Client, name: &str) -> String {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": { "name": name, "namespace": "shop" },
        "spec": { "containers": [{ "name": "main", "image": "busybox" }] },
    }))
    .unwrap();
    Api::<Pod>::namespaced(admin.clone(), "shop")
        .create(&PostParams::default(), &pod)
        .await
        .expect("the pod is created")
        .metadata
        .uid
        .expect("a uid")
}

/// Creates the RivetEndpoint `shop/name` owned by pod `name` with `uid`,
/// as svc-k8s-sync writes it.
async fn create_endpoint(admin: &Client, name: &str, uid: &str) {
    let endpoint: RivetEndpoint = serde_json::from_value(json!({
        "apiVersion": "rivet.io/v1", "kind": "RivetEndpoint",
        "metadata": {
            "name": name, "namespace": "shop",
            "ownerReferences": [{ "apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid }],
        },
        "spec": {},
    }))
    .unwrap();
    Api::<RivetEndpoint>::namespaced(admin.clone(), "shop")
        .create(&PostParams::default(), &endpoint)
        .await
        .expect("the RivetEndpoint is created");
}

async fn endpoint_names(admin: &Client) -> Vec<String> {
    let mut names: Vec<String> = Api::<RivetEndpoint>::namespaced(admin.clone(), "shop")
        .list(&ListParams::default())
        .await
        .expect("RivetEndpoints list")
        .items
        .into_iter()
        .filter_map(|e| e.metadata.name)
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread")]
async fn endpoints_of_deleted_and_re_created_pods_go_and_those_of_live_pods_stay() {
    let (api, operator) = api().await;
    let admin = api.admin_client();
    api.ensure_namespace("shop").await.unwrap();

    let live = create_pod(&admin, "live").await;
    create_endpoint(&admin, "live", &live).await;
    let gone = create_pod(&admin, "gone").await;
    create_endpoint(&admin, "gone", &gone).await;
    delete_pod_now(admin.clone(), "shop", "gone").await.unwrap();
    let old = create_pod(&admin, "replaced").await;
    create_endpoint(&admin, "replaced", &old).await;
    delete_pod_now(admin.clone(), "shop", "replaced").await.unwrap();
    let new = create_pod(&admin, "replaced").await;
    assert_ne!(old, new);
    assert_eq!(endpoint_names(&admin).await, ["gone", "live", "replaced"]);

    let controllers = Controllers::new();
    let metrics = StaleMetrics::default();
    let args = StaleArgs {
        endpoint_gc_interval: Duration::from_millis(200),
        set_node_taints: false,
        ..StaleArgs::default()
    };
    StaleObjects::new(operator, args, metrics.clone()).start(&term(), &controllers);
    eventually("the stale RivetEndpoints are deleted", || async {
        match endpoint_names(&admin).await {
            names if names == ["live"] => Ok(()),
            names => Err(format!("{names:?}")),
        }
    })
    .await;
    // More passes delete nothing more.
    let outcomes = controllers
        .status()
        .iter()
        .find(|c| c.name == "endpoint-gc")
        .expect("endpoint-gc runs")
        .outcomes;
    controllers.wait_outcomes("endpoint-gc", outcomes + 2).await;
    assert_eq!(endpoint_names(&admin).await, ["live"]);
    let mut text = String::new();
    let mut registry = prometheus_client::registry::Registry::with_prefix("rivet_operator");
    metrics.register(&mut registry);
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains(r#"rivet_operator_stale_endpoints_deleted_total{reason="pod_gone"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"rivet_operator_stale_endpoints_deleted_total{reason="pod_replaced"} 1"#),
        "{text}"
    );
    controllers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_created_while_the_pass_runs_keeps_its_endpoint() {
    let (api, operator) = api().await;
    let admin = api.admin_client();
    api.ensure_namespace("shop").await.unwrap();
    let gone = create_pod(&admin, "gone").await;
    create_endpoint(&admin, "gone", &gone).await;
    delete_pod_now(admin.clone(), "shop", "gone").await.unwrap();

    // The pass reads the pods, then the pod "late" and its endpoint appear
    // (the pod cache lags the endpoint cache), then it reads the endpoints.
    let pods = Api::<Pod>::namespaced(admin.clone(), "shop")
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let index = endpoints::pod_index(&pods);
    let late = create_pod(&admin, "late").await;
    create_endpoint(&admin, "late", &late).await;
    let listed = Api::<RivetEndpoint>::namespaced(admin.clone(), "shop")
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let candidates = endpoints::candidates(&listed, &index);
    let mut names: Vec<&str> = candidates.iter().map(|c| c.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["gone", "late"], "both look stale in the caches");

    let report = endpoints::collect(&operator, &term(), candidates, &StaleMetrics::default())
        .await
        .expect("the pass completes");
    assert_eq!(report.deleted, [("shop/gone".to_string(), StaleReason::PodGone)]);
    assert_eq!(report.kept, ["shop/late"], "the live GET found the new pod");
    assert_eq!(endpoint_names(&admin).await, ["late"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_endpoint_rewritten_before_the_delete_stays_and_an_ended_term_deletes_nothing() {
    let (api, operator) = api().await;
    let admin = api.admin_client();
    api.ensure_namespace("shop").await.unwrap();
    let old = create_pod(&admin, "web").await;
    create_endpoint(&admin, "web", &old).await;
    let endpoints_api = Api::<RivetEndpoint>::namespaced(admin.clone(), "shop");
    let listed = endpoints_api.list(&ListParams::default()).await.unwrap().items;
    // The pod is re-created; svc-k8s-sync rewrites the endpoint's owner
    // after the pass read it.
    delete_pod_now(admin.clone(), "shop", "web").await.unwrap();
    let new = create_pod(&admin, "web").await;
    let candidates = endpoints::candidates(&listed, &endpoints::PodIndex::default());
    assert_eq!(candidates.len(), 1);

    let ended = term();
    ended.end();
    let refused = endpoints::collect(&operator, &ended, candidates.clone(), &StaleMetrics::default()).await;
    assert!(
        matches!(refused, Err(rivet_operator::stale::StaleError::NotLeading(_))),
        "{refused:?}"
    );
    assert_eq!(endpoint_names(&admin).await, ["web"], "an ended term deletes nothing");

    endpoints_api
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "ownerReferences": [
                { "apiVersion": "v1", "kind": "Pod", "name": "web", "uid": new }
            ] } })),
        )
        .await
        .unwrap();
    let report = endpoints::collect(&operator, &term(), candidates, &StaleMetrics::default())
        .await
        .expect("the pass completes");
    assert!(report.deleted.is_empty(), "{report:?}");
    assert_eq!(report.kept, ["shop/web"], "the resourceVersion precondition failed");
    assert_eq!(endpoint_names(&admin).await, ["web"]);
}

/// Creates Node `name` with `taints` (key, effect).
async fn create_node(admin: &Client, name: &str, taints: &[(&str, &str)]) {
    let taints: Vec<_> = taints
        .iter()
        .map(|(key, effect)| json!({ "key": key, "effect": effect }))
        .collect();
    Api::<Node>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({ "metadata": { "name": name }, "spec": { "taints": taints } })).unwrap(),
        )
        .await
        .expect("the Node is created");
}

/// Writes RivetNode `name`'s Ready condition as svc-k8s-sync does.
async fn report_ready(admin: &Client, name: &str, status: &str, heartbeat: Timestamp) {
    let api: Api<RivetNode> = Api::all(admin.clone());
    let params = PatchParams::apply("svc-k8s-sync").force();
    api.patch(
        name,
        &params,
        &Patch::Apply(json!({
            "apiVersion": "rivet.io/v1", "kind": "RivetNode",
            "metadata": { "name": name }, "spec": {},
        })),
    )
    .await
    .expect("the RivetNode is applied");
    let condition = NodeCondition {
        type_: "Ready".into(),
        status: status.into(),
        reason: Some("Test".into()),
        message: Some("written by the test".into()),
        last_transition_time: Some(rivet_k8s::format_time(heartbeat)),
        last_heartbeat_time: Some(rivet_k8s::format_time(heartbeat)),
    };
    api.patch_status(
        name,
        &params,
        &Patch::Apply(json!({
            "apiVersion": "rivet.io/v1", "kind": "RivetNode",
            "status": RivetNodeStatus { conditions: vec![condition] },
        })),
    )
    .await
    .expect("the status is applied");
}

/// Node `name`'s taints but those the API server's admission adds
/// (`node.kubernetes.io/not-ready` on a Node without a Ready condition).
async fn taints(admin: &Client, name: &str) -> Vec<(String, String)> {
    Api::<Node>::all(admin.clone())
        .get(name)
        .await
        .expect("the Node")
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| !t.key.starts_with("node.kubernetes.io/"))
        .map(|t| (t.key, t.effect))
        .collect()
}

async fn remove_taints(admin: &Client, name: &str) {
    Api::<Node>::all(admin.clone())
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "taints": [{ "key": "example.com/keep", "effect": "NoExecute" }] } })),
        )
        .await
        .unwrap();
}

fn pair(key: &str, effect: &str) -> (String, String) {
    (key.into(), effect.into())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_not_ready_taint_goes_back_on_nodes_whose_rivet_node_is_not_ready_or_stale() {
    let (api, operator) = api().await;
    let admin = api.admin_client();
    let keep = pair("example.com/keep", "NoExecute");
    let not_ready = pair("node.rivet.io/agent-not-ready", "NoSchedule");
    for name in ["ready", "down", "stale", "fresh-node"] {
        create_node(&admin, name, &[("example.com/keep", "NoExecute")]).await;
    }
    let now = Timestamp::now();
    report_ready(&admin, "ready", "True", now).await;
    report_ready(&admin, "down", "False", now).await;
    report_ready(&admin, "stale", "True", now - Duration::from_secs(120)).await;

    let controllers = Controllers::new();
    let grace = Duration::from_secs(4);
    let args = StaleArgs {
        endpoint_gc_interval: Duration::ZERO,
        node_status_grace: grace,
        set_node_taints: true,
    };
    StaleObjects::new(operator, args, StaleMetrics::default()).start(&term(), &controllers);
    for name in ["down", "stale"] {
        eventually(&format!("node {name} is tainted"), || async {
            match taints(&admin, name).await {
                t if t == [keep.clone(), not_ready.clone()] => Ok(()),
                t => Err(format!("{t:?}")),
            }
        })
        .await;
    }
    assert_eq!(
        taints(&admin, "ready").await,
        std::slice::from_ref(&keep),
        "a ready node is left alone"
    );
    assert_eq!(
        taints(&admin, "fresh-node").await,
        std::slice::from_ref(&keep),
        "a node without a RivetNode is left alone"
    );

    // Each change of a node wakes a pass; none adds the taint twice.
    let outcomes = controllers
        .status()
        .iter()
        .find(|c| c.name == "node-taint")
        .unwrap()
        .outcomes;
    report_ready(&admin, "down", "False", Timestamp::now()).await;
    controllers.wait_outcomes("node-taint", outcomes + 2).await;
    assert_eq!(taints(&admin, "down").await, [keep.clone(), not_ready.clone()]);

    // Ready again (the agent removes the taint): it stays off while the
    // heartbeat is refreshed, and comes back once it is not.
    report_ready(&admin, "down", "True", Timestamp::now()).await;
    remove_taints(&admin, "down").await;
    let removed_at = Instant::now();
    let heartbeats = async {
        while removed_at.elapsed() < grace * 2 {
            report_ready(&admin, "down", "True", Timestamp::now()).await;
            assert_eq!(
                taints(&admin, "down").await,
                std::slice::from_ref(&keep),
                "no taint while fresh"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    heartbeats.await;
    let stopped = Instant::now();
    eventually("the taint is back once the heartbeat is stale", || async {
        match taints(&admin, "down").await {
            t if t == [keep.clone(), not_ready.clone()] => Ok(()),
            t => Err(format!("{t:?}")),
        }
    })
    .await;
    // Heartbeats are whole seconds and came every 0.5 s.
    assert!(
        stopped.elapsed() + Duration::from_millis(1600) >= grace,
        "not before the grace: {:?}",
        stopped.elapsed()
    );
    controllers.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn taint_changes_racing_the_duty_are_never_lost() {
    let (api, operator) = api().await;
    let admin = api.admin_client();
    create_node(&admin, "busy", &[]).await;
    report_ready(&admin, "busy", "False", Timestamp::now()).await;
    let controllers = Controllers::new();
    let args = StaleArgs {
        endpoint_gc_interval: Duration::ZERO,
        ..StaleArgs::default()
    };
    StaleObjects::new(operator, args, StaleMetrics::default()).start(&term(), &controllers);
    // Another writer (an agent flapping, another controller) takes the
    // not-ready taint off and adds one of its own, 20 times, while the
    // duty puts the taint back after each: with resourceVersion
    // preconditions on both sides (the writer retries its 409s) no taint
    // of the writer is lost and the not-ready taint is never doubled.
    let nodes: Api<Node> = Api::all(admin.clone());
    for i in 0..20 {
        loop {
            let node = nodes.get("busy").await.unwrap();
            let mut taints: Vec<_> = node
                .spec
                .and_then(|s| s.taints)
                .unwrap_or_default()
                .into_iter()
                .filter(|t| t.key != "node.rivet.io/agent-not-ready")
                .collect();
            taints.push(k8s_openapi::api::core::v1::Taint {
                key: format!("example.com/t{i}"),
                effect: "NoSchedule".into(),
                ..Default::default()
            });
            let patch = json!({
                "metadata": { "resourceVersion": node.metadata.resource_version },
                "spec": { "taints": taints },
            });
            match nodes.patch("busy", &PatchParams::default(), &Patch::Merge(patch)).await {
                Ok(_) => break,
                Err(e) if rivet_k8s::status_code(&e) == Some(409) => continue,
                Err(e) => panic!("patching the taints: {e}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(i % 4 * 5)).await;
    }
    let mut expected: Vec<(String, String)> = (0..20)
        .map(|i| (format!("example.com/t{i}"), "NoSchedule".to_string()))
        .collect();
    expected.push(pair("node.rivet.io/agent-not-ready", "NoSchedule"));
    expected.sort();
    eventually("every taint is there once", || async {
        let mut all = taints(&admin, "busy").await;
        all.sort();
        if all == expected {
            Ok(())
        } else {
            Err(format!("{all:?}"))
        }
    })
    .await;
    controllers.shutdown().await;
}
