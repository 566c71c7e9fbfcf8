//! The identity GC in the rivet-operator binary: the leader collects, with
//! the RBAC of deploy/rbac/rivet-operator.yaml, and counts it in /metrics.

use std::time::Duration;

use etcd_client::{Client, EventType, WatchOptions};
use futures::StreamExt;
use rivet_common::controller::Controllers;
use rivet_common::testing::{http_get, metric_sample};
use rivet_operator::kvstore::Layout;
use rivet_testkit::kube::KubeApiServer;
use rivet_testkit::operator::Operator;
use svc_identity::backend::{CreateOutcome, IdentityBackend};
use svc_identity::etcd_backend::{EtcdBackend, EtcdOptions};

#[tokio::test]
async fn the_leader_collects_an_unused_etcd_identity_and_counts_it() {
    let server = KubeApiServer::start().await.expect("kube-apiserver starts");
    server.apply_crds().await.expect("CRDs applied");
    let access = server.service_account_client("rivet-operator").await.unwrap();
    // svc-identity's keys live beside the API server's, under their prefix.
    let etcd = server.etcd().endpoint();
    let node = EtcdBackend::connect(EtcdOptions::new(vec![etcd.clone()], "node-a"), &Controllers::new())
        .await
        .unwrap();
    assert_eq!(
        node.create_identity(300, "k8s:app=web").await.unwrap(),
        CreateOutcome::Created
    );
    node.release("k8s:app=web").await.unwrap();
    assert_eq!(
        node.create_identity(301, "k8s:app=db").await.unwrap(),
        CreateOutcome::Created
    );
    let layout = Layout::default();
    let mut raw = Client::connect([etcd.clone()], None).await.unwrap();
    let mut deletions = raw
        .watch(layout.id_prefix(), Some(WatchOptions::new().with_prefix()))
        .await
        .unwrap();

    let operator = Operator::start(&access, &["--etcd-endpoints", &etcd, "--identity-gc-interval", "1s"])
        .await
        .expect("rivet-operator starts");
    operator.wait_leading(Duration::from_secs(30)).await.unwrap();
    let deleted = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let resp = deletions.next().await.unwrap().unwrap();
            if let Some(event) = resp.events().iter().find(|e| e.event_type() == EventType::Delete) {
                return event.kv().unwrap().key_str().unwrap().to_string();
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no deletion within 30 s; log:\n{}", operator.log()));
    assert_eq!(deleted, layout.id_key(300));
    let used = raw.get(layout.id_key(301), None).await.unwrap();
    assert_eq!(used.kvs().len(), 1, "a used identity stays");

    let metrics = http_get(operator.metrics_address(), "/metrics").await.unwrap();
    let series = "rivet_operator_identity_gc_identities_deleted_total{store=\"etcd\"}";
    assert_eq!(metric_sample(&metrics, series), Some(1.0), "{metrics}");
    let rounds = metric_sample(
        &metrics,
        "rivet_operator_identity_gc_runs_total{store=\"etcd\",outcome=\"succeeded\"}",
    );
    assert!(rounds >= Some(2.0), "two rounds at least: {rounds:?}");
    let log = operator.log();
    assert!(
        log.lines()
            .any(|l| l.contains("identity GC round done") && l.contains("deleted=1")),
        "{log}"
    );
}
