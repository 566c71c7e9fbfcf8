//! svc-identity with the `kubernetes` store, as real processes against a
//! real kube-apiserver (rivet-testkit's KubeApiServer), each with exactly
//! the RBAC of deploy/rbac/svc-identity.yaml.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use rivet_common::testing::{DaemonCommand, DaemonProcess};
use rivet_k8s::k8s_openapi::api::core::v1::Pod;
use rivet_k8s::kube::Client;
use rivet_k8s::kube::api::{Api, DeleteParams, ListParams};
use rivet_k8s::kube::api::{Patch, PatchParams, PostParams};
use rivet_k8s::{
    NodeAddress, RivetEndpoint, RivetEndpointSpec, RivetEndpointState, RivetEndpointStatus, RivetIdentity, RivetNode,
    RivetNodeSpec,
};
use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::ipcache_service_client::IpcacheServiceClient;
use rivet_testkit::kube::{KubeApiServer, ServiceAccountAccess};
use serde_json::json;
use std::time::Instant;
use svc_identity::backend::{
    AcquireOutcome, BackendError, CreateOutcome, IdentityBackend, IdentityEvent, IdentityRecord,
};
use svc_identity::kubernetes_backend::KubernetesBackend;
use tonic::Code;

mod support;

use support::{allocate, channel, client, labels, nodes_until};

const BIN: &str = env!("CARGO_BIN_EXE_svc-identity");

/// svc-identity as `node`, its identities in the API server of `kubeconfig`.
async fn spawn(dir: &Path, node: &str, kubeconfig: &Path) -> DaemonProcess {
    spawn_with(dir, node, kubeconfig, &[]).await
}

/// [`spawn`] with `extra` flags.
async fn spawn_with(dir: &Path, node: &str, kubeconfig: &Path, extra: &[&str]) -> DaemonProcess {
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
        .args(extra)
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

/// A RivetNode as svc-k8s-sync and the operator leave it: addresses and
/// pod CIDRs.
fn rivet_node(name: &str, addresses: &[&str], pod_cidrs: &[&str]) -> RivetNode {
    let mut node = RivetNode::new(
        name,
        RivetNodeSpec {
            addresses: addresses
                .iter()
                .map(|ip| NodeAddress {
                    type_: "InternalIP".into(),
                    ip: ip.to_string(),
                })
                .collect(),
            pod_cidrs: pod_cidrs.iter().map(ToString::to_string).collect(),
            ..RivetNodeSpec::default()
        },
    );
    node.metadata.resource_version = None;
    node
}

/// Creates RivetEndpoint `shop/<name>` of a pod on `node` with `identity`
/// at `ipv4`, ready (its status as svc-k8s-sync writes it).
async fn create_endpoint(admin: &Client, name: &str, node: &str, identity: u32, ipv4: &str) {
    let api = Api::<RivetEndpoint>::namespaced(admin.clone(), "shop");
    api.create(&PostParams::default(), &RivetEndpoint::new(name, RivetEndpointSpec {}))
        .await
        .expect("RivetEndpoint created");
    let status = RivetEndpointStatus {
        id: 7,
        node: node.into(),
        identity: Some(identity),
        ipv4: Some(ipv4.into()),
        state: RivetEndpointState::Ready,
        ..RivetEndpointStatus::default()
    };
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": status })),
    )
    .await
    .expect("RivetEndpoint status written");
}

/// `d`'s IP cache entries of `source` as prefix → (identity, node, host
/// IP) once `pred` holds (polled, 20 s).
async fn ipcache_until(
    d: &DaemonProcess,
    source: pb::IpcacheSource,
    what: &str,
    pred: impl Fn(&BTreeMap<String, (u32, String, String)>) -> bool,
) {
    let mut ipcache = IpcacheServiceClient::new(channel(d).await);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let entries = ipcache
            .list_ipcache(pb::ListIpcacheRequest {
                source: source as i32,
                page_size: 1000,
                ..Default::default()
            })
            .await
            .expect("ListIpcache")
            .into_inner()
            .entries;
        let by_prefix: BTreeMap<String, (u32, String, String)> = entries
            .into_iter()
            .map(|e| {
                let host = if e.host_ip.is_empty() {
                    String::new()
                } else {
                    rivet_proto::net::format_address(&e.host_ip)
                };
                (
                    rivet_proto::net::format_prefix(&e.prefix.unwrap()),
                    (e.identity, e.node_name, host),
                )
            })
            .collect();
        if pred(&by_prefix) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {by_prefix:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn addresses(node: &pb::Node) -> Vec<String> {
    node.addresses
        .iter()
        .map(|a| rivet_proto::net::format_address(a))
        .collect()
}

fn pod_cidrs(node: &pb::Node) -> Vec<String> {
    node.pod_cidrs.iter().map(rivet_proto::net::format_prefix).collect()
}

/// CRD mode across nodes: with exactly deploy/rbac/svc-identity.yaml,
/// every other node's RivetNode is a peer (addresses, pod CIDRs; its
/// addresses remote-node in the IP cache), this node's own RivetNode gives
/// its addresses and pod CIDRs (no --node-address, no --pod-cidr: the
/// cluster pool's allocation), and every other node's RivetEndpoint is an
/// IP cache entry with its identity and its node as host, following
/// changes and deletions; this node's own RivetEndpoints stay local.
#[tokio::test]
async fn rivet_nodes_are_the_peers_and_other_nodes_rivet_endpoints_the_ip_cache() {
    let (server, access) = server_with_identity_account().await;
    server.ensure_namespace("shop").await.expect("namespace shop");
    let admin = server.admin_client();
    let rivet_nodes = Api::<RivetNode>::all(admin.clone());
    for node in [
        rivet_node("node-a", &["198.19.254.1"], &["198.18.64.0/24"]),
        rivet_node("node-b", &["2001:2:0:fe::2", "198.19.254.2"], &["198.18.65.0/24"]),
    ] {
        rivet_nodes
            .create(&PostParams::default(), &node)
            .await
            .expect("RivetNode created");
    }
    create_endpoint(&admin, "web-b", "node-b", 300, "198.18.65.5").await;
    create_endpoint(&admin, "web-a", "node-a", 301, "198.18.64.5").await;

    let dir = tempfile::tempdir().unwrap();
    let a = spawn_with(dir.path(), "node-a", &access.kubeconfig, &["--routing-mode", "native"]).await;
    let nodes = nodes_until(&a, "node-a lists node-b", |n| n.contains_key("node-b")).await;
    let (own, peer) = (&nodes["node-a"], &nodes["node-b"]);
    assert!(own.local && !peer.local);
    assert_eq!(addresses(own), ["198.19.254.1"], "from its RivetNode");
    assert_eq!(pod_cidrs(own), ["198.18.64.0/24"], "the allocation, not a flag");
    assert_eq!(own.routing_mode, pb::RoutingMode::Native as i32);
    assert_eq!(addresses(peer), ["198.19.254.2", "2001:2:0:fe::2"]);
    assert_eq!(pod_cidrs(peer), ["198.18.65.0/24"]);
    ipcache_until(&a, pb::IpcacheSource::Node, "node-b's addresses are remote-node", |c| {
        c.get("198.19.254.2/32") == Some(&(6, "node-b".into(), String::new()))
            && c.get("2001:2:0:fe::2/128").is_some_and(|e| e.0 == 6)
            && c.len() == 2
    })
    .await;
    ipcache_until(&a, pb::IpcacheSource::Kvstore, "node-b's pod, not node-a's", |c| {
        c.get("198.18.65.5/32") == Some(&(300, "node-b".into(), "198.19.254.2".into())) && c.len() == 1
    })
    .await;

    // The operator allocates another CIDR; the pod changes identity; a
    // second pod comes; then the first goes.
    rivet_nodes
        .patch(
            "node-a",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "podCidrs": ["198.18.64.0/24", "2001:2:0:64::/64"] } })),
        )
        .await
        .unwrap();
    nodes_until(&a, "node-a's new allocation", |n| {
        pod_cidrs(&n["node-a"]) == ["198.18.64.0/24", "2001:2:0:64::/64"]
    })
    .await;
    let endpoints = Api::<RivetEndpoint>::namespaced(admin.clone(), "shop");
    endpoints
        .patch_status(
            "web-b",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "identity": 310 } })),
        )
        .await
        .unwrap();
    create_endpoint(&admin, "db-b", "node-b", 320, "198.18.65.6").await;
    ipcache_until(
        &a,
        pb::IpcacheSource::Kvstore,
        "the new identity and the second pod",
        |c| c.get("198.18.65.5/32").is_some_and(|e| e.0 == 310) && c.get("198.18.65.6/32").is_some_and(|e| e.0 == 320),
    )
    .await;
    endpoints.delete("web-b", &DeleteParams::default()).await.unwrap();
    ipcache_until(&a, pb::IpcacheSource::Kvstore, "the deleted pod's entry goes", |c| {
        !c.contains_key("198.18.65.5/32") && c.contains_key("198.18.65.6/32")
    })
    .await;

    // node-b leaves: no peer, no remote-node claims.
    rivet_nodes.delete("node-b", &DeleteParams::default()).await.unwrap();
    nodes_until(&a, "node-b left", |n| n.len() == 1).await;
    ipcache_until(
        &a,
        pb::IpcacheSource::Node,
        "node-b's addresses are not remote-node any more",
        |c| c.is_empty(),
    )
    .await;
    drop(a);
}
