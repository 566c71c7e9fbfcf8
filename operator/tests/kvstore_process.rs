//! The kvstore duties in the rivet-operator binary: with `--etcd-endpoints`
//! the leader writes the heartbeat and mirrors RivetNodes, with the RBAC of
//! deploy/rbac/rivet-operator.yaml, and counts both in /metrics.

use std::time::{Duration, Instant};

use etcd_client::Client;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use rivet_common::cluster::NodeRecord;
use rivet_common::testing::{http_get, metric_sample};
use rivet_k8s::{RivetNode, RivetNodeSpec};
use rivet_operator::kvstore::Layout;
use rivet_testkit::kube::KubeApiServer;
use rivet_testkit::operator::Operator;

/// Polls `key` until `pred` holds for its value and mod revision (30 s).
async fn wait_key(etcd: &Client, key: &str, what: &str, pred: impl Fn(&str, i64) -> bool) -> (String, i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let resp = etcd.kv_client().get(key, None).await.unwrap();
        if let Some(kv) = resp.kvs().first() {
            let value = kv.value_str().unwrap().to_string();
            if pred(&value, kv.mod_revision()) {
                return (value, kv.mod_revision());
            }
        }
        assert!(Instant::now() < deadline, "{what}: {key}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_leader_writes_the_heartbeat_and_mirrors_rivet_nodes() {
    let server = KubeApiServer::start().await.expect("kube-apiserver starts");
    server.apply_crds().await.expect("CRDs applied");
    let access = server.service_account_client("rivet-operator").await.unwrap();
    let admin = server.admin_client();
    let node: Node = serde_json::from_value(serde_json::json!({"metadata": {"name": "n1"}})).unwrap();
    Api::<Node>::all(admin.clone())
        .create(&PostParams::default(), &node)
        .await
        .unwrap();
    Api::<RivetNode>::all(admin)
        .create(&PostParams::default(), &RivetNode::new("n1", RivetNodeSpec::default()))
        .await
        .unwrap();
    // The kvstore beside the API server's keys, under its own prefix.
    let endpoint = server.etcd().endpoint();
    let etcd = Client::connect([endpoint.clone()], None).await.unwrap();
    let layout = Layout::new("rivet/state/", "c1");

    let operator = Operator::start(
        &access,
        &[
            "--etcd-endpoints",
            &endpoint,
            "--cluster-name",
            "c1",
            "--kvstore-heartbeat-interval",
            "200ms",
        ],
    )
    .await
    .expect("rivet-operator starts");
    operator.wait_leading(Duration::from_secs(30)).await.unwrap();

    let (value, _) = wait_key(&etcd, &layout.node_key("n1"), "n1 mirrored", |_, _| true).await;
    let record: NodeRecord = serde_json::from_str(&value).unwrap();
    assert_eq!((record.name.as_str(), record.cluster.as_str()), ("n1", "c1"));
    let (first, revision) = wait_key(&etcd, &layout.heartbeat_key(), "a heartbeat", |_, _| true).await;
    assert!(
        humantime::parse_rfc3339(&first).is_ok(),
        "the heartbeat is an RFC 3339 time: {first:?}"
    );
    wait_key(&etcd, &layout.heartbeat_key(), "the next heartbeat", |_, r| {
        r > revision
    })
    .await;

    let metrics = http_get(operator.metrics_address(), "/metrics").await.unwrap();
    let written = metric_sample(
        &metrics,
        r#"rivet_operator_kvstore_heartbeat_writes_total{result="written"}"#,
    );
    assert!(written >= Some(2.0), "{metrics}");
    let created = metric_sample(
        &metrics,
        r#"rivet_operator_kvstore_mirror_writes_total{kind="node",action="created"}"#,
    );
    assert_eq!(created, Some(1.0), "{metrics}");
}
