//! Identity GC over svc-identity's `kubernetes` store, in-process against a
//! real kube-apiserver: the GC as rivet-operator's ServiceAccount and the
//! nodes as svc-identity's `KubernetesBackend` with svc-identity's, each
//! with exactly its deploy/rbac file.

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use rivet_k8s::kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use rivet_k8s::{RivetEndpoint, RivetEndpointSpec, RivetEndpointStatus, RivetIdentity};
use rivet_operator::identity_gc::crd::CrdIdentityGc;
use rivet_operator::identity_gc::{DeleteRate, GC_UNUSED_SINCE_ANNOTATION, GcError, IdentityGcMetrics, Store};
use rivet_operator::term::Term;
use rivet_testkit::kube::KubeApiServer;
use svc_identity::backend::{AcquireOutcome, CreateOutcome, IdentityBackend};
use svc_identity::kubernetes_backend::KubernetesBackend;

struct Cluster {
    server: KubeApiServer,
    operator: rivet_k8s::kube::Client,
    identity: rivet_k8s::kube::Client,
}

async fn cluster() -> Cluster {
    let server = KubeApiServer::start().await.expect("kube-apiserver starts");
    server.apply_crds().await.expect("CRDs applied");
    server.ensure_namespace("shop").await.unwrap();
    let operator = server.service_account_client("rivet-operator").await.unwrap().client;
    let identity = server.service_account_client("svc-identity").await.unwrap().client;
    Cluster {
        server,
        operator,
        identity,
    }
}

fn term() -> Term {
    Term::begin("test", 0, Instant::now() + Duration::from_secs(3600))
}

fn new_gc(cluster: &Cluster) -> (CrdIdentityGc, IdentityGcMetrics) {
    let metrics = IdentityGcMetrics::default();
    let rate = DeleteRate::per_second(NonZeroU32::new(10_000).unwrap());
    (
        CrdIdentityGc::new(cluster.operator.clone(), rate, metrics.clone()),
        metrics,
    )
}

/// A pod's RivetEndpoint using `identity` (as svc-k8s-sync writes it).
async fn endpoint(cluster: &Cluster, name: &str, identity: u32) {
    let api: Api<RivetEndpoint> = Api::namespaced(cluster.server.admin_client(), "shop");
    let object = RivetEndpoint {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        spec: RivetEndpointSpec {},
        status: None,
    };
    api.create(&PostParams::default(), &object).await.unwrap();
    let status = serde_json::json!({ "status": RivetEndpointStatus {
        id: 1,
        node: "node-a".into(),
        identity: Some(identity),
        ..RivetEndpointStatus::default()
    }});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap();
}

/// The object of `id`: (labels, marked), if it exists.
async fn identity(cluster: &Cluster, id: u32) -> Option<(Vec<String>, bool)> {
    let api: Api<RivetIdentity> = Api::all(cluster.server.admin_client());
    let object = api.get_opt(&id.to_string()).await.unwrap()?;
    let marked = object
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(GC_UNUSED_SINCE_ANNOTATION));
    Some((object.spec.labels, marked))
}

#[tokio::test]
async fn an_unreferenced_identity_goes_after_exactly_two_rounds_and_a_referenced_one_never() {
    let cluster = cluster().await;
    let node = KubernetesBackend::new(cluster.identity.clone());
    for (id, labels) in [(500, "k8s:app=web"), (501, "k8s:app=db"), (502, "k8s:app=api")] {
        assert_eq!(node.create_identity(id, labels).await.unwrap(), CreateOutcome::Created);
    }
    endpoint(&cluster, "web-1", 500).await;
    let (mut gc, metrics) = new_gc(&cluster);
    let term = term();

    let first = gc.round(&term).await.unwrap();
    assert_eq!(
        (first.scanned, first.in_use, first.deleted, first.candidates),
        (3, 1, 0, 2)
    );
    assert_eq!(
        identity(&cluster, 501).await,
        Some((vec!["k8s:app=db".into()], true)),
        "marked"
    );
    assert_eq!(
        identity(&cluster, 500).await.map(|i| i.1),
        Some(false),
        "used: not marked"
    );

    // A pod starts using 502 before round two: its mark goes, it stays.
    endpoint(&cluster, "api-1", 502).await;
    let second = gc.round(&term).await.unwrap();
    assert_eq!(second.deleted, 1, "{second:?}");
    assert_eq!(identity(&cluster, 501).await, None);
    assert_eq!(identity(&cluster, 500).await.map(|i| i.1), Some(false));
    assert_eq!(
        identity(&cluster, 502).await.map(|i| i.1),
        Some(false),
        "used again: unmarked"
    );
    assert_eq!(metrics.deleted(Store::Kubernetes), 1);
}

#[tokio::test]
async fn an_identity_acquired_between_the_rounds_survives_them() {
    let cluster = cluster().await;
    let creator = KubernetesBackend::new(cluster.identity.clone());
    assert_eq!(
        creator.create_identity(600, "k8s:app=web").await.unwrap(),
        CreateOutcome::Created
    );
    let (mut gc, _) = new_gc(&cluster);
    let term = term();
    gc.round(&term).await.unwrap();
    assert_eq!(identity(&cluster, 600).await.map(|i| i.1), Some(true));

    // Another node's svc-identity (it listed the marked object) acquires it.
    let node = KubernetesBackend::new(cluster.identity.clone());
    node.list_identities().await.unwrap();
    assert_eq!(
        node.acquire(600, "k8s:app=web").await.unwrap(),
        AcquireOutcome::Acquired
    );
    assert_eq!(
        identity(&cluster, 600).await.map(|i| i.1),
        Some(false),
        "acquire unmarks"
    );

    let second = gc.round(&term).await.unwrap();
    assert_eq!(second.deleted, 0, "{second:?}");
    assert!(identity(&cluster, 600).await.is_some());
}

/// Round two's deletes run while a node acquires the same identities (a
/// fresh backend: read, unmark): each acquire lands before its delete (the
/// resourceVersion moved: 409, the identity survives) or after it (re-
/// created with the same number): every acquired identity exists after.
#[tokio::test]
async fn acquires_racing_round_two_leave_every_acquired_identity_in_place() {
    let cluster = cluster().await;
    let creator = KubernetesBackend::new(cluster.identity.clone());
    let ids: Vec<u32> = (700..760).collect();
    for &id in &ids {
        assert_eq!(
            creator.create_identity(id, &format!("k8s:app=r{id}")).await.unwrap(),
            CreateOutcome::Created
        );
    }
    let (mut gc, _) = new_gc(&cluster);
    let term = term();
    assert_eq!(gc.round(&term).await.unwrap().candidates, ids.len());
    let node = KubernetesBackend::new(cluster.identity.clone());
    let acquires = async {
        let mut got = Vec::new();
        for &id in ids.iter().rev().filter(|id| *id % 2 == 1) {
            got.push((id, node.acquire(id, &format!("k8s:app=r{id}")).await.unwrap()));
        }
        got
    };
    let (report, acquired) = tokio::join!(gc.round(&term), acquires);
    let report = report.unwrap();
    let mut recreated = 0;
    for (id, outcome) in acquired {
        assert_ne!(outcome, AcquireOutcome::Conflict, "{id}");
        recreated += usize::from(outcome == AcquireOutcome::MasterRecreated);
        let (labels, _) = identity(&cluster, id)
            .await
            .unwrap_or_else(|| panic!("{id} acquired but gone"));
        assert_eq!(labels, [format!("k8s:app=r{id}")]);
    }
    for id in ids.iter().filter(|id| *id % 2 == 0) {
        assert_eq!(identity(&cluster, *id).await, None, "{id} unused for two rounds");
    }
    eprintln!("racing round two: {report:?}, {recreated} re-created after their delete");
}

#[tokio::test]
async fn a_term_that_ended_deletes_nothing() {
    let cluster = cluster().await;
    let node = KubernetesBackend::new(cluster.identity.clone());
    assert_eq!(
        node.create_identity(800, "k8s:app=web").await.unwrap(),
        CreateOutcome::Created
    );
    let (mut gc, metrics) = new_gc(&cluster);
    let term = term();
    gc.round(&term).await.unwrap();
    term.end();
    assert!(matches!(gc.round(&term).await, Err(GcError::NotLeading(_))));
    assert!(identity(&cluster, 800).await.is_some());
    assert_eq!(metrics.runs(Store::Kubernetes, "not_leading"), 1);
}

/// After a failover the new leader starts with no candidates; a mark the
/// last leader left counts as round one, so the identity goes at the new
/// leader's second round, not its first.
#[tokio::test]
async fn a_new_leader_counts_the_last_leaders_mark_as_round_one() {
    let cluster = cluster().await;
    let node = KubernetesBackend::new(cluster.identity.clone());
    assert_eq!(
        node.create_identity(900, "k8s:app=web").await.unwrap(),
        CreateOutcome::Created
    );
    let (mut old_leader, _) = new_gc(&cluster);
    let old_term = term();
    old_leader.round(&old_term).await.unwrap();
    old_term.end();
    assert_eq!(identity(&cluster, 900).await.map(|i| i.1), Some(true));

    let (mut new_leader, _) = new_gc(&cluster);
    let new_term = Term::begin("test-b", 1, Instant::now() + Duration::from_secs(3600));
    let first = new_leader.round(&new_term).await.unwrap();
    assert_eq!((first.deleted, first.candidates), (0, 1), "{first:?}");
    assert!(identity(&cluster, 900).await.is_some());
    assert_eq!(new_leader.round(&new_term).await.unwrap().deleted, 1);
    assert_eq!(identity(&cluster, 900).await, None);
}
