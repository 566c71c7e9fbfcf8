//! svc-identity with the `kubernetes` store, as real processes against a
//! real kube-apiserver (rivet-testkit's KubeApiServer), each with exactly
//! the RBAC of deploy/rbac/svc-identity.yaml.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use rivet_common::testing::{DaemonCommand, DaemonProcess};
use rivet_k8s::RivetIdentity;
use rivet_k8s::k8s_openapi::api::core::v1::Pod;
use rivet_k8s::kube::api::{Api, DeleteParams, ListParams};
use rivet_proto::identity::v1 as pb;
use rivet_testkit::kube::{KubeApiServer, ServiceAccountAccess};
use svc_identity::backend::{
    AcquireOutcome, BackendError, CreateOutcome, IdentityBackend, IdentityEvent, IdentityRecord,
};
use svc_identity::kubernetes_backend::KubernetesBackend;
use tonic::Code;

mod support;

use support::{allocate, client, labels};

const BIN: &str = env!("CARGO_BIN_EXE_svc-identity");

/// svc-identity as `node`, its identities in the API server of `kubeconfig`.
async fn spawn(dir: &Path, node: &str, kubeconfig: &Path) -> DaemonProcess {
    let sockets = dir.join(node).join("sockets");
    DaemonCommand::new(BIN, sockets.join("svc-identity.sock"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), dir.join(node).join("state").as_os_str()])
        .args([
            "--node-name",
            node,
            "--identity-store",
            "kubernetes",
            "--resync-seconds",
            "1",
        ])
        .args(["--kubeconfig".as_ref(), kubeconfig.as_os_str()])
        .log_to(dir.join(format!("{node}.log")))
        .spawn()
        .await
        .expect("svc-identity starts")
}

/// A kube-apiserver with Rivet's CRDs and svc-identity's ServiceAccount
/// bound to exactly deploy/rbac/svc-identity.yaml.
async fn server_with_identity_account() -> (KubeApiServer, ServiceAccountAccess) {
    let server = KubeApiServer::start().await.expect("kube-apiserver starts");
    server.apply_crds().await.expect("CRDs applied");
    let access = server
        .service_account_client("svc-identity")
        .await
        .expect("svc-identity's ServiceAccount");
    (server, access)
}

const SETS: usize = 500;

#[tokio::test]
async fn two_nodes_allocating_the_same_500_label_sets_concurrently_get_one_id_per_set() {
    let (server, access) = server_with_identity_account().await;
    let dir = tempfile::tempdir().unwrap();
    let a = spawn(dir.path(), "node-a", &access.kubeconfig).await;
    let b = spawn(dir.path(), "node-b", &access.kubeconfig).await;
    let mut tasks = Vec::new();
    for (node, daemon) in [("a", &a), ("b", &b)] {
        for worker in 0..10 {
            let mut c = client(daemon).await;
            // Both nodes walk the same sets in the same order: each set is
            // asked for on both nodes at about the same time.
            tasks.push(tokio::spawn(async move {
                let mut got = Vec::new();
                for k in 0..SETS / 10 {
                    let i = worker * (SETS / 10) + k;
                    got.push((node, i, allocate(&mut c, i).await.expect("allocation succeeds")));
                }
                got
            }));
        }
    }
    let mut by_set: BTreeMap<usize, BTreeMap<&str, u32>> = BTreeMap::new();
    for t in tasks {
        for (node, i, id) in t.await.unwrap() {
            by_set.entry(i).or_default().insert(node, id);
        }
    }
    assert_eq!(by_set.len(), SETS);
    let mut owners: BTreeMap<u32, usize> = BTreeMap::new();
    for (i, ids) in &by_set {
        let distinct: BTreeSet<u32> = ids.values().copied().collect();
        assert_eq!(
            distinct.len(),
            1,
            "label set {i} must have one id on both nodes: {ids:?}"
        );
        let id = *distinct.first().unwrap();
        assert!(id >= 256, "cluster identities start at 256");
        if let Some(other) = owners.insert(id, *i) {
            panic!("id {id} is bound to two label sets ({other} and {i})");
        }
    }
    // The API holds exactly one RivetIdentity per set, named by its id.
    let objects = Api::<RivetIdentity>::all(server.admin_client())
        .list(&ListParams::default())
        .await
        .expect("listing RivetIdentities as admin");
    let in_api: BTreeMap<u32, Vec<String>> = objects
        .items
        .iter()
        .map(|o| {
            (
                o.metadata.name.as_ref().unwrap().parse().unwrap(),
                o.spec.labels.clone(),
            )
        })
        .collect();
    assert_eq!(in_api.len(), SETS, "one RivetIdentity per label set");
    for (id, i) in &owners {
        assert_eq!(in_api.get(id), Some(&labels(*i)), "RivetIdentity {id}");
    }
    // Each node sees the other's identities through its watch.
    for daemon in [&a, &b] {
        let mut c = client(daemon).await;
        let listed = c
            .list_identities(pb::ListIdentitiesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let cluster: BTreeSet<u32> = listed.identities.iter().map(|i| i.id).filter(|id| *id >= 256).collect();
        assert_eq!(
            cluster,
            owners.keys().copied().collect(),
            "{}",
            daemon.socket().display()
        );
        let status = c.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner();
        let store = status.store.unwrap();
        assert_eq!(store.backend, pb::StoreBackend::Kubernetes as i32);
        assert!(store.connected, "{store:?}");
    }
    drop((a, b));
}

#[tokio::test]
async fn with_deploy_rbac_it_works_and_what_is_outside_it_is_refused_with_403_named() {
    let (server, access) = server_with_identity_account().await;
    let dir = tempfile::tempdir().unwrap();
    let node = spawn(dir.path(), "node-a", &access.kubeconfig).await;
    let id = allocate(&mut client(&node).await, 1)
        .await
        .expect("allocation with deploy/rbac's permissions");

    // Outside the ClusterRole: deleting identities, reading pods.
    let identities = Api::<RivetIdentity>::all(access.client.clone());
    let refused = identities
        .delete(&id.to_string(), &DeleteParams::default())
        .await
        .expect_err("svc-identity may not delete identities");
    assert!(
        matches!(&refused, rivet_k8s::kube::Error::Api(s) if s.code == 403),
        "{refused}"
    );
    let refused = Api::<Pod>::all(access.client.clone())
        .list(&ListParams::default())
        .await
        .expect_err("svc-identity may not list pods");
    assert!(
        matches!(&refused, rivet_k8s::kube::Error::Api(s) if s.code == 403),
        "{refused}"
    );

    // A ServiceAccount without the identity permissions (svc-k8s-sync's):
    // the store's refusal is typed and names the verb and resource...
    let other = server
        .service_account_client("svc-k8s-sync")
        .await
        .expect("svc-k8s-sync's ServiceAccount");
    let backend = KubernetesBackend::new(other.client.clone());
    match backend.list_identities().await {
        Err(BackendError::Refused {
            verb: "list",
            resource: "rivetidentities.rivet.io",
            code: 403,
            ..
        }) => {}
        other => panic!("expected a 403 refusal of list: {other:?}"),
    }
    let refused = backend.create_identity(300, "k8s:app=web").await.unwrap_err();
    assert!(
        matches!(
            refused,
            BackendError::Refused {
                verb: "create",
                code: 403,
                ..
            }
        ),
        "{refused:?}"
    );
    // ...and a daemon running with it says so: PERMISSION_DENIED on
    // allocation, the listing's refusal in GetStatus.
    let denied = spawn(dir.path(), "node-b", &other.kubeconfig).await;
    let mut c = client(&denied).await;
    let status = allocate(&mut c, 2)
        .await
        .expect_err("allocation without create is refused");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    assert!(
        status
            .message()
            .contains("the API server refused `create` on rivetidentities.rivet.io (403)"),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("deploy/rbac/svc-identity.yaml"),
        "{}",
        status.message()
    );
    let listing_refused = |store: &pb::StoreStatus| {
        !store.connected && store.last_error.contains("`list` on rivetidentities.rivet.io (403)")
    };
    let mut store = c
        .get_status(pb::GetStatusRequest {})
        .await
        .unwrap()
        .into_inner()
        .store
        .unwrap();
    // The listing controller reports its first failure: poll the status.
    for _ in 0..200 {
        if listing_refused(&store) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        store = c
            .get_status(pb::GetStatusRequest {})
            .await
            .unwrap()
            .into_inner()
            .store
            .unwrap();
    }
    assert!(listing_refused(&store), "{store:?}");
    drop((node, denied));
}

#[tokio::test]
async fn a_watch_the_api_server_ends_resumes_from_the_last_version_seen() {
    let (server, access) = server_with_identity_account().await;
    // Watch requests the API server ends after one second.
    let backend = KubernetesBackend::new(access.client.clone()).with_watch_timeout(1);
    let (listed, revision) = backend.list_identities().await.unwrap();
    assert_eq!(listed, []);
    let mut watch = backend.watch_identities(revision).await.unwrap();
    let (events, mut received) = tokio::sync::mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        while let Some(event) = watch.next().await {
            if events.send(event).is_err() {
                break;
            }
        }
    });
    let record = |id: u32, labels: &str| IdentityRecord {
        id,
        labels: labels.into(),
    };
    assert_eq!(
        backend.create_identity(300, "k8s:app=a").await.unwrap(),
        CreateOutcome::Created
    );
    assert_eq!(
        received.recv().await.unwrap().unwrap(),
        IdentityEvent::Upsert(record(300, "k8s:app=a"))
    );
    // The first request ended and the watch went on with a second one.
    for _ in 0..200 {
        if backend.watch_requests() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(backend.watch_requests() >= 2, "the API server ends a watch after 1 s");
    assert_eq!(
        backend.create_identity(301, "k8s:app=b").await.unwrap(),
        CreateOutcome::Created
    );
    assert_eq!(
        received.recv().await.unwrap().unwrap(),
        IdentityEvent::Upsert(record(301, "k8s:app=b"))
    );
    Api::<RivetIdentity>::all(server.admin_client())
        .delete("300", &DeleteParams::default())
        .await
        .unwrap();
    assert_eq!(
        received.recv().await.unwrap().unwrap(),
        IdentityEvent::Delete { id: 300 }
    );
    assert!(received.try_recv().is_err(), "nothing else: no error, no duplicate");
    reader.abort();
}

#[tokio::test]
async fn acquiring_an_identity_the_watch_knows_sends_no_request_and_a_deleted_one_is_recreated() {
    let (server, access) = server_with_identity_account().await;
    let other_node = KubernetesBackend::new(access.client.clone());
    assert_eq!(
        other_node.create_identity(400, "k8s:app=x").await.unwrap(),
        CreateOutcome::Created
    );
    let backend = KubernetesBackend::new(access.client.clone());
    let (listed, revision) = backend.list_identities().await.unwrap();
    assert_eq!(
        listed,
        [IdentityRecord {
            id: 400,
            labels: "k8s:app=x".into()
        }]
    );
    let mut watch = backend.watch_identities(revision).await.unwrap();
    // What a reconcile pass does for every held identity, every resync.
    for _ in 0..3 {
        assert_eq!(
            backend.acquire(400, "k8s:app=x").await.unwrap(),
            AcquireOutcome::Acquired
        );
    }
    assert_eq!(backend.reads(), 0, "known from the listing: no request");
    assert_eq!(
        backend.acquire(400, "k8s:app=y").await.unwrap(),
        AcquireOutcome::Conflict
    );
    // Deleted (the operator's GC) while still held here: re-created.
    Api::<RivetIdentity>::all(server.admin_client())
        .delete("400", &DeleteParams::default())
        .await
        .unwrap();
    assert_eq!(watch.next().await.unwrap().unwrap(), IdentityEvent::Delete { id: 400 });
    let reads = backend.reads();
    assert_eq!(
        backend.acquire(400, "k8s:app=x").await.unwrap(),
        AcquireOutcome::MasterRecreated
    );
    assert_eq!(backend.reads(), reads + 1, "unknown now: read, then created");
    let object = Api::<RivetIdentity>::all(server.admin_client())
        .get("400")
        .await
        .unwrap();
    assert_eq!(object.spec.labels, ["k8s:app=x"]);
}

/// The identity GC deleted an identity this node still holds (a pod
/// started between the GC's listing and its delete): the reconcile pass,
/// level-triggered, re-creates it with the same number and labels.
#[tokio::test]
async fn an_identity_held_here_but_deleted_anyway_is_recreated_by_the_reconcile_pass() {
    let (server, access) = server_with_identity_account().await;
    let dir = tempfile::tempdir().unwrap();
    let daemon = spawn(dir.path(), "node-a", &access.kubeconfig).await;
    let mut c = client(&daemon).await;
    let id = allocate(&mut c, 7).await.expect("allocation succeeds");
    let api = Api::<RivetIdentity>::all(server.admin_client());
    let before = api.get(&id.to_string()).await.unwrap();
    api.delete(&id.to_string(), &DeleteParams::default()).await.unwrap();
    // Wait for the re-created object on a watch (a new uid), no sleep.
    let params = rivet_k8s::kube::api::WatchParams::default()
        .fields(&format!("metadata.name={id}"))
        .timeout(30);
    let mut events = api.watch(&params, "0").await.unwrap().boxed();
    let recreated = loop {
        match events.next().await.expect("re-created within 30 s").unwrap() {
            rivet_k8s::kube::api::WatchEvent::Added(object) if object.metadata.uid != before.metadata.uid => {
                break object;
            }
            _ => {}
        }
    };
    assert_eq!(recreated.spec.labels, before.spec.labels);
    assert_eq!(allocate(&mut c, 7).await.unwrap(), id, "the same number");
}
