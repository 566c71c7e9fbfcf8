//! svc-identity as real processes: two nodes on one real etcd, crashes of a
//! node and of etcd, and the embedded store across kill -9.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use etcd_client::GetOptions;
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::etcd::EtcdServer;
use rivet_common::testing::{DaemonCommand, DaemonProcess};
use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_svc-identity");

fn command(dir: &Path, node: &str, etcd: Option<&str>) -> DaemonCommand {
    let sockets = dir.join(node).join("sockets");
    let mut cmd = DaemonCommand::new(BIN, sockets.join("svc-identity.sock"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), dir.join(node).join("state").as_os_str()])
        .args(["--node-name", node, "--lease-ttl-seconds", "2", "--resync-seconds", "1"])
        .log_to(dir.join(format!("{node}.log")));
    if let Some(e) = etcd {
        cmd = cmd.args(["--etcd-endpoints", e]);
    }
    cmd
}

async fn start_etcd() -> EtcdServer {
    tokio::task::spawn_blocking(EtcdServer::start)
        .await
        .unwrap()
        .expect("etcd starts")
}

/// svc-identity as `node` on `etcd`.
async fn spawn(dir: &Path, node: &str, etcd: &EtcdServer) -> DaemonProcess {
    command(dir, node, Some(&etcd.endpoint()))
        .spawn()
        .await
        .expect("svc-identity starts")
}

async fn client(d: &DaemonProcess) -> IdentityServiceClient<DaemonChannel> {
    IdentityServiceClient::new(connect_unix(d.socket(), &ClientOptions::default()).await.unwrap())
}

fn labels(i: usize) -> Vec<String> {
    vec![
        format!("k8s:app=app-{i}"),
        "k8s:io.kubernetes.pod.namespace=default".to_string(),
    ]
}

async fn allocate(c: &mut IdentityServiceClient<DaemonChannel>, i: usize) -> Result<u32, tonic::Status> {
    c.allocate_identity(pb::AllocateIdentityRequest {
        labels: labels(i),
        owner: String::new(),
    })
    .await
    .map(|r| r.into_inner().identity.unwrap().id)
}

async fn store_status(c: &mut IdentityServiceClient<DaemonChannel>) -> pb::StoreStatus {
    c.get_status(pb::GetStatusRequest {})
        .await
        .expect("GetStatus")
        .into_inner()
        .store
        .expect("the store's status")
}

/// Polls GetStatus until `pred` holds for the store (10 s).
async fn wait_store(
    c: &mut IdentityServiceClient<DaemonChannel>,
    what: &str,
    pred: impl Fn(&pb::StoreStatus) -> bool,
) -> pb::StoreStatus {
    let mut last = store_status(c).await;
    for _ in 0..200 {
        if pred(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        last = store_status(c).await;
    }
    panic!("{what}: {last:?}");
}

async fn raw_keys(endpoint: &str, prefix: &str) -> BTreeMap<String, String> {
    let mut c = etcd_client::Client::connect([endpoint], None).await.unwrap();
    let r = c.get(prefix, Some(GetOptions::new().with_prefix())).await.unwrap();
    r.kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().to_string(), kv.value_str().unwrap().to_string()))
        .collect()
}

#[tokio::test]
async fn two_nodes_racing_on_overlapping_label_sets_agree_on_one_id_each() {
    let etcd = start_etcd().await;
    let dir = tempfile::tempdir().unwrap();
    let a = spawn(dir.path(), "node-a", &etcd).await;
    let b = spawn(dir.path(), "node-b", &etcd).await;
    let mut tasks = Vec::new();
    for (node, daemon) in [("a", &a), ("b", &b)] {
        for worker in 0..10 {
            let mut c = client(daemon).await;
            tasks.push(tokio::spawn(async move {
                let mut got = Vec::new();
                // Both nodes walk the same 1000 sets, each worker a slice, in different orders.
                for k in 0..100 {
                    let i = if node == "a" {
                        worker * 100 + k
                    } else {
                        999 - (worker * 100 + k)
                    };
                    got.push((node, i, allocate(&mut c, i).await.expect("allocation succeeds")));
                }
                got
            }));
        }
    }
    let mut by_set: BTreeMap<usize, BTreeSet<u32>> = BTreeMap::new();
    for t in tasks {
        for (_, i, id) in t.await.unwrap() {
            by_set.entry(i).or_default().insert(id);
        }
    }
    assert_eq!(by_set.len(), 1000);
    let mut owners: BTreeMap<u32, usize> = BTreeMap::new();
    for (i, ids) in &by_set {
        assert_eq!(
            ids.len(),
            1,
            "label set {i} must have exactly one id on both nodes, got {ids:?}"
        );
        let id = *ids.iter().next().unwrap();
        assert!(id >= 256, "cluster identities start at 256");
        if let Some(other) = owners.insert(id, *i) {
            panic!("id {id} is bound to two label sets ({other} and {i})");
        }
    }
    let keys = raw_keys(&etcd.endpoint(), "rivet/state/identities/v1/").await;
    let masters = keys.keys().filter(|k| k.contains("/id/")).count();
    let values: Vec<_> = keys.iter().filter(|(k, _)| k.contains("/value/")).collect();
    assert_eq!(masters, 1000, "one master key per label set");
    assert_eq!(values.len(), 2000, "one value key per node and label set");
    let (k, v) = values[0];
    assert!(
        k.ends_with("/node-a") || k.ends_with("/node-b"),
        "value keys end with the node name: {k}"
    );
    let id: u32 = v.parse().expect("a value key holds the id");
    let label_part = k
        .trim_start_matches("rivet/state/identities/v1/value/")
        .rsplit_once('/')
        .unwrap()
        .0;
    assert_eq!(
        keys[&format!("rivet/state/identities/v1/id/{id}")],
        label_part,
        "master key id → labels"
    );
    drop((a, b));
}

#[tokio::test]
async fn a_killed_node_loses_its_value_keys_after_the_lease_ttl() {
    let etcd = start_etcd().await;
    let dir = tempfile::tempdir().unwrap();
    let mut a = spawn(dir.path(), "node-a", &etcd).await;
    let b = spawn(dir.path(), "node-b", &etcd).await;
    let (mut ca, mut cb) = (client(&a).await, client(&b).await);
    let shared = allocate(&mut ca, 1).await.unwrap();
    assert_eq!(allocate(&mut cb, 1).await.unwrap(), shared);
    allocate(&mut ca, 2).await.unwrap();
    a.kill9();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let keys = raw_keys(&etcd.endpoint(), "rivet/state/identities/v1/value/").await;
    assert!(
        keys.keys().all(|k| !k.ends_with("/node-a")),
        "node-a's value keys expire with its lease: {keys:?}"
    );
    assert!(keys.keys().any(|k| k.ends_with("/node-b")), "node-b is unaffected");
    assert_eq!(allocate(&mut cb, 1).await.unwrap(), shared, "node-b keeps its identity");
}

#[tokio::test]
async fn etcd_outage_keeps_known_sets_and_refuses_new_ones_then_recovers() {
    let mut etcd = start_etcd().await;
    let dir = tempfile::tempdir().unwrap();
    let a = spawn(dir.path(), "node-a", &etcd).await;
    let mut c = client(&a).await;
    let known = allocate(&mut c, 1).await.unwrap();
    let healthy = store_status(&mut c).await;
    assert!(
        healthy.connected && healthy.last_error.is_empty() && healthy.lease_id != 0,
        "with etcd up the store is connected with a lease: {healthy:?}"
    );
    etcd.stop();
    let down = wait_store(&mut c, "GetStatus reports the outage", |s| {
        !s.connected && !s.last_error.is_empty()
    })
    .await;
    assert!(down.last_error.contains("identities"), "{down:?}");
    assert_eq!(
        allocate(&mut c, 1).await.unwrap(),
        known,
        "a set this node holds allocates from cache"
    );
    let err = allocate(&mut c, 2).await.expect_err("a new set needs the store");
    assert_eq!(err.code(), Code::Unavailable, "{}", err.message());
    let etcd = tokio::task::spawn_blocking(move || {
        etcd.restart().expect("etcd restarts");
        etcd
    })
    .await
    .unwrap();
    let mut fresh = None;
    for _ in 0..100 {
        match allocate(&mut c, 2).await {
            Ok(id) => {
                fresh = Some(id);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let fresh = fresh.expect("allocation recovers when etcd returns");
    wait_store(&mut c, "GetStatus reports the recovery", |s| {
        s.connected && s.last_error.is_empty()
    })
    .await;
    assert_ne!(fresh, known, "no duplicate ids");
    let keys = raw_keys(&etcd.endpoint(), "rivet/state/identities/v1/").await;
    assert_eq!(
        keys.keys().filter(|k| k.contains("/id/")).count(),
        2,
        "one master key per set: {keys:?}"
    );
    assert!(
        keys.iter()
            .any(|(k, v)| k.contains("app-1") && k.ends_with("/node-a") && *v == known.to_string()),
        "the held identity's value key is still there after the outage: {keys:?}"
    );
}

#[tokio::test]
async fn embedded_store_keeps_every_acknowledged_identity_across_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = command(dir.path(), "solo", None).spawn().await.unwrap();
    let mut c = client(&a).await;
    let mut acked = BTreeMap::new();
    let worker = tokio::spawn(async move {
        let mut got = Vec::new();
        for i in 0..2000 {
            match allocate(&mut c, i).await {
                Ok(id) => got.push((i, id)),
                Err(_) => break,
            }
        }
        got
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.kill9();
    for (i, id) in worker.await.unwrap() {
        acked.insert(i, id);
    }
    assert!(!acked.is_empty(), "some allocations were acknowledged before the kill");
    a.restart().await.expect("restarts on the embedded store");
    let mut c = client(&a).await;
    for (i, id) in &acked {
        assert_eq!(
            allocate(&mut c, *i).await.unwrap(),
            *id,
            "identity of set {i} survives kill -9"
        );
    }
}

#[tokio::test]
async fn keys_that_vanish_from_etcd_are_recreated_with_the_same_id() {
    let etcd = start_etcd().await;
    let dir = tempfile::tempdir().unwrap();
    let a = spawn(dir.path(), "node-a", &etcd).await;
    let mut c = client(&a).await;
    let id = allocate(&mut c, 7).await.unwrap();
    // An over-eager GC (or a restored etcd backup) loses both keys.
    let mut raw = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    raw.delete(
        "rivet/state/identities/v1/",
        Some(etcd_client::DeleteOptions::new().with_prefix()),
    )
    .await
    .unwrap();
    let mut restored = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let keys = raw_keys(&etcd.endpoint(), "rivet/state/identities/v1/").await;
        let master = keys.get(&format!("rivet/state/identities/v1/id/{id}"));
        let value = keys.iter().any(|(k, v)| k.ends_with("/node-a") && *v == id.to_string());
        if master.is_some_and(|l| l.contains("app-7")) && value {
            restored = true;
            break;
        }
    }
    assert!(
        restored,
        "the sync loop re-creates the master and value keys of a held identity with the same id"
    );
}

#[tokio::test]
async fn an_ip_published_on_one_node_reaches_the_other() {
    use rivet_proto::identity::v1::ipcache_service_client::IpcacheServiceClient;
    let etcd = start_etcd().await;
    let dir = tempfile::tempdir().unwrap();
    let a = spawn(dir.path(), "node-a", &etcd).await;
    let b = spawn(dir.path(), "node-b", &etcd).await;
    let options = ClientOptions::default();
    let mut ia = IpcacheServiceClient::new(connect_unix(a.socket(), &options).await.unwrap());
    let mut ib = IpcacheServiceClient::new(connect_unix(b.socket(), &options).await.unwrap());
    let mut watch = ib
        .watch_ipcache(pb::WatchIpcacheRequest { sources: vec![] })
        .await
        .unwrap()
        .into_inner();
    ia.upsert_ip(pb::UpsertIpRequest {
        entries: vec![pb::IpcacheEntry {
            prefix: "198.18.5.9".into(),
            identity: 4242,
            host_ip: "198.19.0.1".into(),
            pod_namespace: "default".into(),
            pod_name: "web-0".into(),
            source: pb::IpcacheSource::LocalEndpoint as i32,
            node_name: String::new(),
        }],
    })
    .await
    .expect("node-a publishes its pod's address");
    let seen = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let m = watch.message().await.unwrap().expect("the stream stays open");
            if let Some(e) = m.upserted.iter().find(|e| e.prefix.starts_with("198.18.5.9")) {
                return e.clone();
            }
        }
    })
    .await
    .expect("node-b's stream shows node-a's address");
    assert_eq!(seen.identity, 4242);
    assert_eq!(
        seen.source,
        pb::IpcacheSource::Kvstore as i32,
        "learned through the store"
    );
    assert_eq!(seen.node_name, "node-a");
    ia.delete_ip(pb::DeleteIpRequest {
        prefixes: vec!["198.18.5.9".into()],
        source: pb::IpcacheSource::LocalEndpoint as i32,
    })
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let m = watch.message().await.unwrap().expect("the stream stays open");
            if m.deleted.iter().any(|p| p.starts_with("198.18.5.9")) {
                return;
            }
        }
    })
    .await
    .expect("deleting it on node-a removes it on node-b");
}

#[tokio::test]
async fn list_and_watch_agree_on_the_cache_revision_and_the_list_holds_cidr_identities() {
    let dir = tempfile::tempdir().unwrap();
    let daemon = command(dir.path(), "solo", None).spawn().await.unwrap();
    let mut c = client(&daemon).await;
    let list = |c: &mut IdentityServiceClient<DaemonChannel>| {
        let mut c = c.clone();
        async move {
            c.list_identities(pb::ListIdentitiesRequest::default())
                .await
                .expect("ListIdentities")
                .into_inner()
        }
    };
    for i in 0..2 {
        allocate(&mut c, i).await.unwrap();
    }
    let before = list(&mut c).await;
    assert!(
        before.revision >= 2,
        "two identities are two changes: {}",
        before.revision
    );

    let mut watch = c
        .watch_identities(pb::WatchIdentitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    let snapshot = watch.message().await.unwrap().expect("a snapshot");
    assert!(snapshot.snapshot && snapshot.snapshot_complete);
    assert_eq!(
        snapshot.revision, before.revision,
        "a snapshot and a list of the same cache state carry the same revision"
    );
    let id = allocate(&mut c, 2).await.unwrap();
    let delta = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .expect("the new identity is streamed")
        .unwrap()
        .expect("a delta");
    assert_eq!(delta.added.iter().map(|i| i.id).collect::<Vec<_>>(), vec![id]);
    let after = list(&mut c).await;
    assert_eq!(
        (delta.revision, after.revision),
        (before.revision + 1, before.revision + 1),
        "one new identity is one revision, in the stream and the list alike"
    );

    let cidr = c
        .allocate_cidr_identities(pb::AllocateCidrIdentitiesRequest {
            prefixes: vec!["198.19.128.0/24".into()],
            owner: "policy/default/p".into(),
        })
        .await
        .expect("a CIDR identity")
        .into_inner()
        .identities[0]
        .clone();
    let listed = list(&mut c).await;
    let found = listed
        .identities
        .iter()
        .find(|i| i.id == cidr.id)
        .expect("ListIdentities includes the node's CIDR identities");
    assert_eq!(found.kind, pb::IdentityKind::Cidr as i32);
    assert_eq!(found.labels, vec!["cidr:198.19.128.0/24".to_string()]);
    assert_eq!(found.local_references, 1, "one owner holds it");
}
