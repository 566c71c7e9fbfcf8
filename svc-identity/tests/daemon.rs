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
use rivet_proto::identity::v1::ipcache_service_client::IpcacheServiceClient;
use rivet_testkit::wire;
use tonic::Code;

mod support;

use support::{allocate, allocate_owned, client, labels};

const BIN: &str = env!("CARGO_BIN_EXE_svc-identity");

fn command(dir: &Path, node: &str, etcd: Option<&str>) -> DaemonCommand {
    command_with_ttl(dir, node, etcd, 2)
}

fn command_with_ttl(dir: &Path, node: &str, etcd: Option<&str>, lease_ttl_seconds: u32) -> DaemonCommand {
    let sockets = dir.join(node).join("sockets");
    let ttl = lease_ttl_seconds.to_string();
    let mut cmd = DaemonCommand::new(BIN, sockets.join("svc-identity.sock"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), dir.join(node).join("state").as_os_str()])
        .args([
            "--node-name",
            node,
            "--lease-ttl-seconds",
            &ttl,
            "--resync-seconds",
            "1",
        ])
        .log_to(dir.join(format!("{node}.log")));
    if let Some(e) = etcd {
        cmd = cmd.args(["--etcd-endpoints", e]);
    }
    cmd
}

/// svc-identity as `node` on `etcd`.
async fn spawn(dir: &Path, node: &str, etcd: &EtcdServer) -> DaemonProcess {
    command(dir, node, Some(&etcd.endpoint()))
        .spawn()
        .await
        .expect("svc-identity starts")
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

async fn ipcache_client(d: &DaemonProcess) -> IpcacheServiceClient<DaemonChannel> {
    IpcacheServiceClient::new(connect_unix(d.socket(), &ClientOptions::default()).await.unwrap())
}

/// Claims `prefix` for a local endpoint of the node.
async fn upsert_local(
    c: &mut IpcacheServiceClient<DaemonChannel>,
    prefix: &str,
    identity: u32,
) -> Result<pb::UpsertIpResponse, tonic::Status> {
    c.upsert_ip(pb::UpsertIpRequest {
        entries: vec![pb::IpcacheEntry {
            prefix: Some(wire::prefix(prefix)),
            identity,
            pod_namespace: "default".into(),
            pod_name: format!("pod-{prefix}"),
            source: pb::IpcacheSource::LocalEndpoint as i32,
            ..Default::default()
        }],
    })
    .await
    .map(tonic::Response::into_inner)
}

/// Withdraws a local endpoint's claim on `prefix`.
async fn delete_local(
    c: &mut IpcacheServiceClient<DaemonChannel>,
    prefix: &str,
) -> Result<pb::DeleteIpResponse, tonic::Status> {
    c.delete_ip(pb::DeleteIpRequest {
        prefixes: vec![wire::prefix(prefix)],
        source: pb::IpcacheSource::LocalEndpoint as i32,
    })
    .await
    .map(tonic::Response::into_inner)
}

/// A node's effective IP cache as its WatchIpcache stream builds it
/// (prefix → entry).
struct IpcacheView {
    stream: tonic::Streaming<pb::WatchIpcacheResponse>,
    entries: BTreeMap<String, pb::IpcacheEntry>,
    in_snapshot: bool,
}

impl IpcacheView {
    async fn watch(c: &mut IpcacheServiceClient<DaemonChannel>) -> Self {
        let stream = c
            .watch_ipcache(pb::WatchIpcacheRequest { sources: vec![] })
            .await
            .expect("WatchIpcache")
            .into_inner();
        Self {
            stream,
            entries: BTreeMap::new(),
            in_snapshot: false,
        }
    }

    /// Applies messages until `pred` holds (15 s at most).
    async fn until(&mut self, what: &str, pred: impl Fn(&BTreeMap<String, pb::IpcacheEntry>) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while !pred(&self.entries) {
            let m = tokio::time::timeout_at(deadline, self.stream.message())
                .await
                .unwrap_or_else(|_| panic!("{what}: not within 15 s; the view holds {:?}", self.entries.keys()))
                .expect("the watch works")
                .expect("the watch stays open");
            if m.snapshot && !self.in_snapshot {
                self.entries.clear();
            }
            self.in_snapshot = m.snapshot && !m.snapshot_complete;
            for e in m.upserted {
                self.entries.insert(wire::text(e.prefix.as_ref().expect("a prefix")), e);
            }
            for p in m.deleted {
                self.entries.remove(&wire::text(&p));
            }
        }
    }
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
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    // 2,000 allocations: a 2 s lease expired once under a starved CPU (load
    // 30), and a node without a lease rightly refuses new identities.
    let spawn = async |node| {
        command_with_ttl(dir.path(), node, Some(&etcd.endpoint()), 30)
            .spawn()
            .await
            .expect("svc-identity starts")
    };
    let a = spawn("node-a").await;
    let b = spawn("node-b").await;
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

/// An etcd watch on `prefix` from the current revision, and the keys under
/// it now.
async fn watch_keys(endpoint: &str, prefix: &str) -> (etcd_client::WatchStream, BTreeSet<String>) {
    let mut c = etcd_client::Client::connect([endpoint], None).await.unwrap();
    rivet_common::testing::etcd::watch_from_listing(&mut c, prefix)
        .await
        .expect("etcd lists and watches")
}

/// Follows `watch` (started over `keys`) until no key satisfies `gone`;
/// returns how long that took and every key deleted meanwhile. Panics
/// after `limit`.
async fn wait_keys_gone(
    watch: &mut etcd_client::WatchStream,
    keys: &mut BTreeSet<String>,
    limit: Duration,
    gone: impl Fn(&str) -> bool,
) -> (Duration, Vec<String>) {
    let started = std::time::Instant::now();
    let deadline = tokio::time::Instant::now() + limit;
    let mut deleted = Vec::new();
    while keys.iter().any(|k| gone(k)) {
        let message = tokio::time::timeout_at(deadline, watch.message())
            .await
            .unwrap_or_else(|_| panic!("keys still there after {limit:?}: {keys:?}"))
            .expect("the etcd watch works")
            .expect("the etcd watch stays open");
        for event in message.events() {
            let key = event.kv().unwrap().key_str().unwrap().to_string();
            match event.event_type() {
                etcd_client::EventType::Put => keys.insert(key),
                etcd_client::EventType::Delete => {
                    deleted.push(key.clone());
                    keys.remove(&key)
                }
            };
        }
    }
    (started.elapsed(), deleted)
}

#[tokio::test]
async fn a_killed_node_loses_its_value_keys_after_the_lease_ttl() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let mut a = spawn(dir.path(), "node-a", &etcd).await;
    let b = spawn(dir.path(), "node-b", &etcd).await;
    let (mut ca, mut cb) = (client(&a).await, client(&b).await);
    let shared = allocate(&mut ca, 1).await.unwrap();
    assert_eq!(allocate(&mut cb, 1).await.unwrap(), shared);
    allocate(&mut ca, 2).await.unwrap();
    let (mut watch, mut keys) = watch_keys(&etcd.endpoint(), "rivet/state/identities/v1/value/").await;
    assert_eq!(keys.iter().filter(|k| k.ends_with("/node-a")).count(), 2, "{keys:?}");
    a.kill9();
    // The signal: etcd deletes the keys when the lease (TTL 2 s) expires.
    let (took, _) = wait_keys_gone(&mut watch, &mut keys, Duration::from_secs(10), |k| {
        k.ends_with("/node-a")
    })
    .await;
    eprintln!("node-a's value keys expired {took:?} after kill -9 (lease TTL 2 s)");
    assert!(
        took >= Duration::from_millis(900),
        "nothing revoked the lease of a killed node: {took:?}"
    );
    assert!(keys.iter().any(|k| k.ends_with("/node-b")), "node-b is unaffected");
    assert_eq!(allocate(&mut cb, 1).await.unwrap(), shared, "node-b keeps its identity");
}

#[tokio::test]
async fn a_cleanly_stopped_node_revokes_its_lease_so_its_keys_go_at_once() {
    const TTL_SECONDS: u32 = 30;
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let endpoint = etcd.endpoint();
    let mut a = command_with_ttl(dir.path(), "node-a", Some(&endpoint), TTL_SECONDS)
        .spawn()
        .await
        .unwrap();
    let b = command_with_ttl(dir.path(), "node-b", Some(&endpoint), TTL_SECONDS)
        .spawn()
        .await
        .unwrap();
    let mut ca = client(&a).await;
    allocate(&mut ca, 1).await.unwrap();
    let mut ia = ipcache_client(&a).await;
    upsert_local(&mut ia, "198.18.7.1", 4242)
        .await
        .expect("node-a publishes");
    let mut b_view = IpcacheView::watch(&mut ipcache_client(&b).await).await;
    b_view
        .until("node-b learns node-a's pod", |v| v.contains_key("198.18.7.1/32"))
        .await;
    let (mut watch, mut keys) = watch_keys(&endpoint, "rivet/state/").await;

    let stopped = std::time::Instant::now();
    let status = a.terminate().await.expect("SIGTERM stops node-a");
    assert!(status.success(), "node-a exits cleanly: {status}");
    let (took, _) = wait_keys_gone(&mut watch, &mut keys, Duration::from_secs(10), |k| {
        k.ends_with("/node-a") || k.ends_with("/198.18.7.1")
    })
    .await;
    eprintln!("node-a's keys were gone {took:?} after SIGTERM (lease TTL {TTL_SECONDS} s)");
    b_view
        .until("node-b's view loses node-a's pod", |v| !v.contains_key("198.18.7.1/32"))
        .await;
    let gone = stopped.elapsed();
    assert!(
        gone < Duration::from_secs(u64::from(TTL_SECONDS) / 3),
        "node-b's view lost node-a's pod {gone:?} after the stop: well before the TTL"
    );
}

#[tokio::test]
async fn etcd_outage_keeps_known_sets_and_refuses_new_ones_then_recovers() {
    let mut etcd = EtcdServer::start_async().await.expect("etcd starts");
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

/// Polls GetStatus until the store is connected and nothing of this node
/// waits to be written (30 s).
async fn wait_reconciled(c: &mut IdentityServiceClient<DaemonChannel>) -> pb::StoreStatus {
    let mut last = store_status(c).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !(last.connected && last.pending_writes == 0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not reconciled within 30 s: {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        last = store_status(c).await;
    }
    last
}

#[tokio::test]
async fn etcd_outage_serves_known_sets_and_ip_changes_locally_and_reconciles_when_back() {
    let mut etcd = EtcdServer::start_async().await.expect("etcd starts");
    let endpoint = etcd.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let a = spawn(dir.path(), "node-a", &etcd).await;
    let b = spawn(dir.path(), "node-b", &etcd).await;
    let (mut ca, mut cb) = (client(&a).await, client(&b).await);
    let (mut ia, mut ib) = (ipcache_client(&a).await, ipcache_client(&b).await);
    // node-a holds sets 1 and 2; only node-b holds set 3 (node-a knows it
    // from its cache); set 4 has no identity anywhere.
    let held = allocate_owned(&mut ca, 1, "endpoint/1").await.unwrap();
    let released = allocate_owned(&mut ca, 2, "endpoint/2").await.unwrap();
    let elsewhere = allocate(&mut cb, 3).await.unwrap();
    upsert_local(&mut ia, "198.18.9.1", held).await.unwrap();
    upsert_local(&mut ia, "198.18.9.2", released).await.unwrap();
    let mut b_view = IpcacheView::watch(&mut ib).await;
    b_view
        .until("node-b learns node-a's pods", |v| {
            v.contains_key("198.18.9.1/32") && v.contains_key("198.18.9.2/32")
        })
        .await;
    let mut known_to_a = None;
    for _ in 0..200 {
        let listed = ca
            .list_identities(pb::ListIdentitiesRequest::default())
            .await
            .unwrap()
            .into_inner();
        if listed.identities.iter().any(|i| i.id == elsewhere) {
            known_to_a = Some(elsewhere);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(known_to_a, Some(elsewhere), "node-a's cache learns node-b's identity");

    etcd.stop();
    wait_store(&mut ca, "node-a sees the outage", |s| !s.connected).await;
    let started = std::time::Instant::now();
    // Local work goes on.
    assert_eq!(
        allocate_owned(&mut ca, 3, "endpoint/3")
            .await
            .expect("a set known from the cache"),
        elsewhere,
        "the id node-b holds"
    );
    assert_eq!(allocate_owned(&mut ca, 1, "endpoint/4").await.unwrap(), held);
    let released_refs = ca
        .release_identity(pb::ReleaseIdentityRequest {
            id: 0,
            owner: "endpoint/2".into(),
        })
        .await
        .expect("a release never needs the store")
        .into_inner();
    assert_eq!(released_refs.released[0].remaining_local_references, 0);
    upsert_local(&mut ia, "198.18.9.3", elsewhere)
        .await
        .expect("a new local entry is taken while the store is away");
    assert_eq!(
        delete_local(&mut ia, "198.18.9.2").await.expect("a delete too").deleted,
        1
    );
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "local work does not wait for the store: {took:?}"
    );
    let local: Vec<String> = ia
        .list_ipcache(pb::ListIpcacheRequest::default())
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .filter(|e| e.source == pb::IpcacheSource::LocalEndpoint as i32)
        .map(|e| wire::text(&e.prefix.expect("a prefix")))
        .collect();
    assert_eq!(
        local,
        ["198.18.9.1/32", "198.18.9.3/32"],
        "node-a's view changed at once"
    );
    // Only a new set needs the store: typed reason, clear message.
    let err = allocate(&mut ca, 4).await.expect_err("a new set needs the store");
    assert_eq!(err.code(), Code::Unavailable, "{}", err.message());
    assert_eq!(
        rivet_common::grpc::error_reason(&err),
        Some(pb::ErrorReason::KvstoreUnreachable),
        "{err:?}"
    );
    assert!(err.message().contains("kvstore is unreachable"), "{}", err.message());
    let down = store_status(&mut ca).await;
    assert!(down.pending_writes >= 3, "a value key and two entries wait: {down:?}");

    let _etcd = tokio::task::spawn_blocking(move || {
        etcd.restart().expect("etcd restarts");
        etcd
    })
    .await
    .unwrap();
    let reconciled = wait_reconciled(&mut ca).await;
    eprintln!(
        "node-a reconciled {:?} after the outage began: {reconciled:?}",
        started.elapsed()
    );
    b_view
        .until("node-b sees node-a's changes", |v| {
            v.contains_key("198.18.9.1/32") && v.contains_key("198.18.9.3/32") && !v.contains_key("198.18.9.2/32")
        })
        .await;
    let keys = raw_keys(&endpoint, "rivet/state/").await;
    let of_a: BTreeSet<&str> = keys
        .keys()
        .filter(|k| k.contains("/value/") && k.ends_with("/node-a"))
        .map(String::as_str)
        .collect();
    let value = |i: usize| format!("rivet/state/identities/v1/value/{}/node-a", labels(i).join(","));
    assert_eq!(
        of_a,
        BTreeSet::from([value(1).as_str(), value(3).as_str()]),
        "node-a's value keys: the sets it holds, not the released one"
    );
    let ips: BTreeSet<&str> = keys
        .keys()
        .filter(|k| k.starts_with("rivet/state/ip/"))
        .map(String::as_str)
        .collect();
    assert_eq!(
        ips,
        BTreeSet::from([
            "rivet/state/ip/v1/default/198.18.9.1",
            "rivet/state/ip/v1/default/198.18.9.3"
        ]),
        "the store holds node-a's entries as they are now"
    );
    let masters = keys.keys().filter(|k| k.contains("/id/")).count();
    assert_eq!(masters, 3, "no identity was created twice or for set 4: {keys:?}");
    let fresh = allocate(&mut ca, 4).await.expect("a new set once the store is back");
    assert!(![held, released, elsewhere].contains(&fresh));
    assert_eq!(allocate(&mut cb, 4).await.unwrap(), fresh, "one id cluster-wide");
}

#[tokio::test]
async fn embedded_store_keeps_every_acknowledged_identity_across_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = command(dir.path(), "solo", None).spawn().await.unwrap();
    let mut c = client(&a).await;
    let mut acked = BTreeMap::new();
    let (progress, mut acknowledged) = tokio::sync::watch::channel(0usize);
    let worker = tokio::spawn(async move {
        let mut got = Vec::new();
        for i in 0..2000 {
            match allocate(&mut c, i).await {
                Ok(id) => {
                    got.push((i, id));
                    progress.send_replace(got.len());
                }
                Err(_) => break,
            }
        }
        got
    });
    // Killed in the middle of the stream, once some were acknowledged.
    tokio::time::timeout(Duration::from_secs(10), acknowledged.wait_for(|n| *n >= 20))
        .await
        .expect("20 allocations within 10 s")
        .expect("the worker runs");
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

/// The value keys of the embedded store's file, as label sets.
fn embedded_value_keys(dir: &Path, node: &str) -> BTreeSet<String> {
    let path = dir.join(node).join("state").join("identity").join("store.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let file: serde_json::Value = serde_json::from_str(&text).expect("the store file is JSON");
    let kvs = file
        .pointer("/data/kvs")
        .and_then(|v| v.as_object())
        .unwrap_or_else(|| panic!("no kvs in {text}"));
    kvs.keys()
        .filter_map(|k| k.strip_prefix("rivet/state/identities/v1/value/"))
        .filter_map(|k| k.strip_suffix(&format!("/{node}")))
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn value_keys_of_a_previous_run_nobody_claims_again_are_deleted_after_the_restore_grace() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = command(dir.path(), "solo", None)
        .args(["--restore-grace-seconds", "0"])
        .spawn()
        .await
        .unwrap();
    let mut c = client(&a).await;
    let kept = allocate(&mut c, 1).await.unwrap();
    allocate(&mut c, 2).await.unwrap();
    let set = |i: usize| labels(i).join(",");
    assert_eq!(
        embedded_value_keys(dir.path(), "solo"),
        BTreeSet::from([set(1), set(2)])
    );
    a.kill9();
    a.restart().await.expect("restarts on the embedded store");
    let mut c = client(&a).await;
    // Only set 1 is claimed again (an endpoint of set 2 went while the
    // daemon was down).
    assert_eq!(allocate(&mut c, 1).await.unwrap(), kept);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut keys = embedded_value_keys(dir.path(), "solo");
    while keys != BTreeSet::from([set(1)]) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "stale value keys stay: {keys:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        keys = embedded_value_keys(dir.path(), "solo");
    }
    assert_eq!(
        allocate(&mut c, 1).await.unwrap(),
        kept,
        "the held identity is untouched"
    );
}

#[tokio::test]
async fn keys_that_vanish_from_etcd_are_recreated_with_the_same_id() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
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

/// Named ports travel with the address (other nodes' egress rules naming a
/// port resolve against them).
#[tokio::test]
async fn an_ip_published_on_one_node_reaches_the_other() {
    use rivet_proto::identity::v1::ipcache_service_client::IpcacheServiceClient;
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
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
            prefix: Some(wire::prefix("198.18.5.9")),
            identity: 4242,
            host_ip: wire::address("198.19.0.1"),
            pod_namespace: "default".into(),
            pod_name: "web-0".into(),
            source: pb::IpcacheSource::LocalEndpoint as i32,
            named_ports: vec![named_port("http", "TCP", 8080), named_port("dns", "UDP", 5353)],
            ..Default::default()
        }],
    })
    .await
    .expect("node-a publishes its pod's address");
    for (port, field) in [
        (named_port("8080", "TCP", 80), "entries[0].named_ports[0].name"),
        (named_port("-web", "TCP", 80), "entries[0].named_ports[0].name"),
        (named_port("http", "ICMP", 80), "entries[0].named_ports[0].protocol"),
        (named_port("http", "tcp", 80), "entries[0].named_ports[0].protocol"),
        (named_port("http", "TCP", 0), "entries[0].named_ports[0].port"),
        (named_port("http", "TCP", 65536), "entries[0].named_ports[0].port"),
    ] {
        let err = ia
            .upsert_ip(pb::UpsertIpRequest {
                entries: vec![pb::IpcacheEntry {
                    prefix: Some(wire::prefix("198.18.5.10")),
                    identity: 4242,
                    source: pb::IpcacheSource::LocalEndpoint as i32,
                    named_ports: vec![port.clone()],
                    ..Default::default()
                }],
            })
            .await
            .expect_err("a bad named port is refused");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{port:?}: {err:?}");
        assert!(err.message().starts_with(field), "{port:?}: {}", err.message());
    }
    let too_many = ia
        .upsert_ip(pb::UpsertIpRequest {
            entries: vec![pb::IpcacheEntry {
                prefix: Some(wire::prefix("198.18.5.10")),
                identity: 4242,
                source: pb::IpcacheSource::LocalEndpoint as i32,
                named_ports: (0..257)
                    .map(|i| named_port(&format!("p{i}"), "TCP", 1000 + i))
                    .collect(),
                ..Default::default()
            }],
        })
        .await
        .expect_err("257 named ports are refused");
    assert!(
        too_many.message().starts_with("entries[0].named_ports:"),
        "{}",
        too_many.message()
    );
    let seen = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let m = watch.message().await.unwrap().expect("the stream stays open");
            if let Some(e) = m.upserted.iter().find(|e| e.prefix == Some(wire::prefix("198.18.5.9"))) {
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
    assert_eq!(
        seen.named_ports,
        vec![named_port("dns", "UDP", 5353), named_port("http", "TCP", 8080)],
        "the pod's named ports came through etcd"
    );
    let listed = ib
        .list_ipcache(pb::ListIpcacheRequest::default())
        .await
        .unwrap()
        .into_inner();
    let listed = listed
        .entries
        .iter()
        .find(|e| e.prefix == Some(wire::prefix("198.18.5.9")))
        .expect("node-b lists node-a's address");
    assert_eq!(listed.named_ports, seen.named_ports, "ListIpcache has them too");
    assert!(
        !ia.list_ipcache(pb::ListIpcacheRequest::default())
            .await
            .unwrap()
            .into_inner()
            .entries
            .iter()
            .any(|e| e.prefix == Some(wire::prefix("198.18.5.10"))),
        "a refused entry is not in the cache"
    );
    ia.delete_ip(pb::DeleteIpRequest {
        prefixes: vec![wire::prefix("198.18.5.9")],
        source: pb::IpcacheSource::LocalEndpoint as i32,
    })
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let m = watch.message().await.unwrap().expect("the stream stays open");
            if m.deleted.contains(&wire::prefix("198.18.5.9")) {
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
            prefixes: vec![wire::prefix("198.19.128.0/24")],
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

// ------------------------------------------- restart during an etcd outage --

/// The local snapshot of `node` (see `svc_identity::snapshot`), if written.
fn snapshot_file(state: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(state.join("identity").join("etcd-snapshot.json")).ok()?;
    Some(serde_json::from_str(&text).expect("the snapshot is JSON"))
}

/// Waits until the snapshot satisfies `pred` (15 s): the daemon writes it
/// after changes, coalesced.
async fn wait_snapshot(state: &Path, what: &str, pred: impl Fn(&serde_json::Value) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let snapshot = snapshot_file(state);
        if snapshot.as_ref().is_some_and(&pred) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the snapshot never showed {what}: {snapshot:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `ip` fields of the entries under `/data/ipcache/<part>`.
fn snapshot_ips(s: &serde_json::Value, part: &str) -> BTreeSet<String> {
    s.pointer(&format!("/data/ipcache/{part}"))
        .and_then(|v| v.as_array())
        .map(|a| a.iter().map(|e| e["ip"].as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// `/metrics` of a daemon.
async fn metrics(address: std::net::SocketAddr) -> String {
    let response = rivet_common::testing::http_get(address, "/metrics")
        .await
        .expect("GET /metrics");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

/// The value of the sample `series` (exactly as printed), 0 when absent.
fn sample(text: &str, series: &str) -> f64 {
    rivet_common::testing::metric_sample(text, series).unwrap_or(0.0)
}

/// The prefixes of svc-loader's ipcache under 198.18.9.0/24 with their
/// identities (the node's own addresses, which svc-loader keeps itself,
/// left out).
async fn loader_entries(loader: &rivet_testkit::loader::LoaderNode) -> BTreeMap<String, u32> {
    let r = loader
        .client()
        .await
        .list_ipcache(rivet_proto::loader::v1::ListIpcacheRequest {
            page_size: 10000,
            start_after: None,
        })
        .await
        .expect("svc-loader lists its ipcache")
        .into_inner();
    r.entries
        .into_iter()
        .filter_map(|e| {
            let p = e.prefix?;
            let octets: [u8; 4] = p.address.as_slice().try_into().ok()?;
            let ip = std::net::Ipv4Addr::from(octets);
            (octets[..3] == [198, 18, 9]).then(|| (format!("{ip}/{}", p.prefix_length), e.identity))
        })
        .collect()
}

/// Polls svc-loader's ipcache until `pred` holds (15 s).
async fn loader_until(
    loader: &rivet_testkit::loader::LoaderNode,
    what: &str,
    pred: impl Fn(&BTreeMap<String, u32>) -> bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let entries = loader_entries(loader).await;
        if pred(&entries) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "svc-loader never held {what}: {entries:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn list_ids(c: &mut IdentityServiceClient<DaemonChannel>) -> BTreeSet<u32> {
    c.list_identities(pb::ListIdentitiesRequest {
        kind: pb::IdentityKind::Cluster as i32,
        ..Default::default()
    })
    .await
    .expect("ListIdentities")
    .into_inner()
    .identities
    .iter()
    .map(|i| i.id)
    .collect()
}

/// Every key under `prefix` with its lease.
async fn raw_leases(endpoint: &str, prefix: &str) -> BTreeMap<String, i64> {
    let mut c = etcd_client::Client::connect([endpoint], None).await.unwrap();
    let r = c.get(prefix, Some(GetOptions::new().with_prefix())).await.unwrap();
    r.kvs()
        .iter()
        .map(|kv| (kv.key_str().unwrap().to_string(), kv.lease()))
        .collect()
}

/// svc-identity killed (-9) while etcd is down restarts and serves from its
/// local snapshot: identities (list, watch, allocation of known sets),
/// svc-loader's full ipcache push with the other node's entries, local
/// changes; it reports itself degraded. When etcd is back it converges:
/// entries and identities another node deleted meanwhile go, what this node
/// released or withdrew before the kill goes at once (not after the restore
/// grace), its keys move to its new lease, and the metrics counted it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_during_an_etcd_outage_serves_its_snapshot_and_converges_when_etcd_is_back() {
    let loader =
        rivet_testkit::loader::LoaderNode::start(&rivet_common::testing::workspace_binary("svc-loader"), &[], &[])
            .await
            .expect("svc-loader starts");
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let endpoint = etcd.endpoint();
    let dir = tempfile::tempdir().unwrap();
    let metrics_address = std::net::SocketAddr::from(([127, 0, 0, 1], rivet_common::testing::free_local_port()));
    let state_a = dir.path().join("node-a").join("state");
    // node-a shares svc-loader's socket dir; its lease outlives the test, so
    // keys of its first run go only if something deletes them.
    let mut a = DaemonCommand::new(BIN, loader.dir.path().join("sockets").join("svc-identity.sock"))
        .args(["--socket-dir".as_ref(), loader.dir.path().join("sockets").as_os_str()])
        .args(["--state-dir".as_ref(), state_a.as_os_str()])
        .args([
            "--node-name",
            "node-a",
            "--lease-ttl-seconds",
            "120",
            "--resync-seconds",
            "1",
        ])
        .args(["--etcd-endpoints", &endpoint])
        .args(["--metrics-address", &metrics_address.to_string()])
        .log_to(dir.path().join("node-a.log"))
        .spawn()
        .await
        .expect("node-a starts");
    let b = spawn(dir.path(), "node-b", &etcd).await;
    let (mut ca, mut cb) = (client(&a).await, client(&b).await);
    let (mut ia, mut ib) = (ipcache_client(&a).await, ipcache_client(&b).await);

    // node-a: sets 1 and 2 with a pod each; node-b: set 3 with pods .20
    // and .21, and set 5 (held, then garbage-collected while node-a is down).
    let set1 = allocate_owned(&mut ca, 1, "endpoint/1").await.unwrap();
    let set2 = allocate_owned(&mut ca, 2, "endpoint/2").await.unwrap();
    upsert_local(&mut ia, "198.18.9.1", set1).await.unwrap();
    upsert_local(&mut ia, "198.18.9.2", set2).await.unwrap();
    let set3 = allocate(&mut cb, 3).await.unwrap();
    let set5 = allocate(&mut cb, 5).await.unwrap();
    upsert_local(&mut ib, "198.18.9.20", set3).await.unwrap();
    upsert_local(&mut ib, "198.18.9.21", set3).await.unwrap();
    loader_until(&loader, "both nodes' pods", |l| {
        ["198.18.9.1/32", "198.18.9.2/32", "198.18.9.20/32", "198.18.9.21/32"]
            .iter()
            .all(|p| l.contains_key(*p))
    })
    .await;

    // etcd stops; node-a releases set 2 and withdraws .2 locally, and its
    // snapshot records that; then it is killed.
    let etcd = etcd.stop_async().await;
    wait_store(&mut ca, "node-a sees the outage", |s| !s.connected).await;
    ca.release_identity(pb::ReleaseIdentityRequest {
        id: 0,
        owner: "endpoint/2".into(),
    })
    .await
    .expect("a release is local");
    delete_local(&mut ia, "198.18.9.2").await.expect("a delete is local");
    let set2_labels = labels(2).join(",");
    wait_snapshot(
        &state_a,
        "set 2 released, .2 withdrawn, node-b's pods and identities",
        |s| {
            let ids: BTreeSet<u64> = s["data"]["identities"]["identities"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["id"].as_u64().unwrap())
                .collect();
            s["data"]["identities"]["released"] == serde_json::json!([set2_labels])
                && [set1, set3, set5].iter().all(|id| ids.contains(&u64::from(*id)))
                && snapshot_ips(s, "local") == BTreeSet::from(["198.18.9.1".to_string()])
                && snapshot_ips(s, "published").contains("198.18.9.2")
                && snapshot_ips(s, "remote") == BTreeSet::from(["198.18.9.20".into(), "198.18.9.21".into()])
        },
    )
    .await;
    a.kill9();

    // While node-a is down, etcd answers for a while: node-b deletes pod .20
    // and the operator's GC deletes set 5's master key.
    let etcd = etcd.restart_async().await.expect("etcd restarts");
    wait_store(&mut cb, "node-b reconnects", |s| s.connected).await;
    delete_local(&mut ib, "198.18.9.20").await.unwrap();
    cb.release_identity(pb::ReleaseIdentityRequest {
        id: set5,
        owner: String::new(),
    })
    .await
    .unwrap();
    let mut raw = etcd_client::Client::connect([&endpoint], None).await.unwrap();
    raw.delete(format!("rivet/state/identities/v1/id/{set5}"), None)
        .await
        .unwrap();
    // node-b withdraws .20 from etcd when its IP cache watch is back too.
    let (mut watch, mut keys) = watch_keys(&endpoint, "rivet/state/").await;
    wait_keys_gone(&mut watch, &mut keys, Duration::from_secs(10), |k| {
        k == "rivet/state/ip/v1/default/198.18.9.20" || k.ends_with(&format!("/id/{set5}"))
    })
    .await;
    let old_lease_keys = raw_leases(&endpoint, "rivet/state/").await;

    // etcd goes again; node-a restarts and serves from its snapshot.
    let etcd = etcd.stop_async().await;
    a.restart().await.expect("node-a starts while etcd is down");
    let (mut ca, mut ia) = (client(&a).await, ipcache_client(&a).await);
    let status = ca.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner();
    let store = status.store.clone().unwrap();
    assert!(
        !store.connected && store.last_error.contains("snapshot") && store.lease_id == 0,
        "degraded, never in sync, no lease: {store:?}"
    );
    assert_eq!(
        status.cluster_identities, 4,
        "sets 1, 2, 3, 5 from the snapshot: {status:?}"
    );
    let listed = list_ids(&mut ca).await;
    assert!(
        [set1, set2, set3, set5].iter().all(|id| listed.contains(id)),
        "ListIdentities serves the snapshot's identities: {listed:?}"
    );
    let mut watch = ca
        .watch_identities(pb::WatchIdentitiesRequest {})
        .await
        .expect("WatchIdentities serves while etcd is away")
        .into_inner();
    let first = watch.message().await.unwrap().expect("a snapshot");
    assert!(first.snapshot && first.snapshot_complete);
    let watched: BTreeSet<u32> = first.added.iter().map(|i| i.id).collect();
    assert_eq!(watched, listed, "the watch's snapshot is the list");
    // svc-endpoint's replay, and a new pod of a set another node holds.
    assert_eq!(allocate_owned(&mut ca, 1, "endpoint/1").await.unwrap(), set1);
    assert_eq!(
        allocate_owned(&mut ca, 3, "endpoint/3")
            .await
            .expect("a known set allocates"),
        set3
    );
    upsert_local(&mut ia, "198.18.9.1", set1).await.unwrap();
    upsert_local(&mut ia, "198.18.9.3", set3)
        .await
        .expect("the new pod's address is taken locally");
    let err = allocate(&mut ca, 4)
        .await
        .expect_err("a set with no identity needs etcd");
    assert_eq!(
        rivet_common::grpc::error_reason(&err),
        Some(pb::ErrorReason::KvstoreUnreachable),
        "{err:?}"
    );
    // svc-loader got the snapshot's view (a full push with the other node's
    // pods, stale .20 included) and the new pod.
    let loader_boot_id = loader.loader.info().boot_id.clone();
    let mut pushed = None;
    for _ in 0..300 {
        let status = ca.get_status(pb::GetStatusRequest {}).await.unwrap().into_inner();
        let sync = status.loader.unwrap_or_default();
        if sync.connected && sync.loader_boot_id == loader_boot_id {
            pushed = Some(sync);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pushed = pushed.expect("node-a pushes its ipcache to svc-loader while etcd is down");
    assert!(pushed.last_full_sync_unix_nanos > 0, "{pushed:?}");
    loader_until(&loader, "the snapshot's view and the new pod", |l| {
        l.get("198.18.9.1/32") == Some(&set1)
            && l.get("198.18.9.3/32") == Some(&set3)
            && l.contains_key("198.18.9.20/32")
            && l.contains_key("198.18.9.21/32")
            && !l.contains_key("198.18.9.2/32")
    })
    .await;
    let degraded = metrics(metrics_address).await;
    assert_eq!(
        sample(&degraded, "rivet_identity_snapshot_loads_total{outcome=\"loaded\"}"),
        1.0,
        "{degraded}"
    );
    assert!(
        sample(&degraded, "rivet_identity_local_allocations_total") >= 2.0,
        "{degraded}"
    );
    assert!(
        sample(&degraded, "rivet_identity_store_pending_writes{keys=\"ip_entries\"}") >= 1.0,
        "{degraded}"
    );
    assert!(
        sample(&degraded, "rivet_identity_store_pending_writes{keys=\"value_keys\"}") >= 1.0,
        "{degraded}"
    );

    // A pass tried and failed meanwhile (every --resync-seconds).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let unreachable = "rivet_identity_reconcile_passes_total{keys=\"value_keys\",outcome=\"store_unreachable\"}";
    loop {
        let text = metrics(metrics_address).await;
        if sample(&text, unreachable) >= 1.0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no failed pass counted: {text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // etcd is back: node-a converges.
    let _etcd = etcd.restart_async().await.expect("etcd restarts");
    let reconciled = wait_reconciled(&mut ca).await;
    let lease = reconciled.lease_id;
    assert!(lease != 0, "{reconciled:?}");
    loader_until(&loader, "the other node's deleted pod gone", |l| {
        !l.contains_key("198.18.9.20/32") && l.contains_key("198.18.9.21/32") && l.contains_key("198.18.9.3/32")
    })
    .await;
    let listed = list_ids(&mut ca).await;
    assert!(
        !listed.contains(&set5) && listed.contains(&set1) && listed.contains(&set3),
        "the garbage-collected identity is not resurrected: {listed:?}"
    );
    let mut b_view = IpcacheView::watch(&mut ib).await;
    b_view
        .until("node-b sees node-a as it is now", |v| {
            v.contains_key("198.18.9.1/32") && v.contains_key("198.18.9.3/32") && !v.contains_key("198.18.9.2/32")
        })
        .await;
    let leases = raw_leases(&endpoint, "rivet/state/").await;
    let value = |i: usize| format!("rivet/state/identities/v1/value/{}/node-a", labels(i).join(","));
    let a_pods = ["1", "2", "3"].map(|n| format!("rivet/state/ip/v1/default/198.18.9.{n}"));
    let of_a: BTreeMap<String, i64> = leases
        .iter()
        .filter(|(k, _)| k.ends_with("/node-a") || a_pods.contains(k))
        .map(|(k, l)| (k.clone(), *l))
        .collect();
    let record = "rivet/state/nodes/v1/default/node-a".to_string();
    let expected: BTreeMap<String, i64> = [value(1), value(3), a_pods[0].clone(), a_pods[2].clone(), record]
        .into_iter()
        .map(|k| (k, lease))
        .collect();
    assert_eq!(
        of_a, expected,
        "node-a's keys: the sets and pods it has and its node record, all on its new lease (set 2's value key and .2 \
         went at once, before the restore grace; the first run's lease held {old_lease_keys:?})"
    );
    let masters = leases.keys().filter(|k| k.contains("/id/")).count();
    assert_eq!(
        masters, 3,
        "sets 1, 2, 3: none created twice, set 5 not re-created: {leases:?}"
    );
    let fresh = allocate(&mut ca, 4).await.expect("a new set once etcd is back");
    assert!(![set1, set2, set3, set5].contains(&fresh));
    assert_eq!(allocate(&mut cb, 4).await.unwrap(), fresh, "one id cluster-wide");

    // The snapshot is written min_interval (500 ms) after the last change:
    // wait for that write, not only for the store.
    let written = "rivet_identity_snapshot_writes_total{outcome=\"written\"}";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut converged = metrics(metrics_address).await;
    while sample(&converged, written) < 1.0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        converged = metrics(metrics_address).await;
    }
    for series in [
        "rivet_identity_reconcile_passes_total{keys=\"value_keys\",outcome=\"store_unreachable\"}",
        "rivet_identity_reconcile_passes_total{keys=\"value_keys\",outcome=\"succeeded\"}",
        "rivet_identity_reconcile_passes_total{keys=\"ip_entries\",outcome=\"succeeded\"}",
        "rivet_identity_reconcile_keys_total{key=\"value\",action=\"created\"}",
        "rivet_identity_reconcile_keys_total{key=\"value\",action=\"deleted\"}",
        "rivet_identity_reconcile_keys_total{key=\"ip\",action=\"created\"}",
        "rivet_identity_reconcile_keys_total{key=\"ip\",action=\"deleted\"}",
        "rivet_identity_snapshot_writes_total{outcome=\"written\"}",
    ] {
        assert!(sample(&converged, series) >= 1.0, "{series}: {converged}");
    }
    for keys in ["value_keys", "ip_entries"] {
        let series = format!("rivet_identity_store_pending_writes{{keys=\"{keys}\"}}");
        assert_eq!(sample(&converged, &series), 0.0, "{series}: {converged}");
    }
    drop(b);
}

/// The controllers GetInfo reports, by name.
async fn controllers(d: &DaemonProcess) -> BTreeMap<String, rivet_proto::daemon::v1::ControllerStatus> {
    let channel = connect_unix(d.socket(), &ClientOptions::default()).await.unwrap();
    let info = rivet_proto::daemon::v1::daemon_client::DaemonClient::new(channel)
        .get_info(rivet_proto::daemon::v1::GetInfoRequest {})
        .await
        .expect("GetInfo")
        .into_inner();
    info.controllers.into_iter().map(|c| (c.name.clone(), c)).collect()
}

/// Polls GetInfo until controller `name` satisfies `pred` (20 s).
async fn wait_controller(
    d: &DaemonProcess,
    name: &str,
    what: &str,
    pred: impl Fn(&rivet_proto::daemon::v1::ControllerStatus) -> bool,
) -> rivet_proto::daemon::v1::ControllerStatus {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let all = controllers(d).await;
        let c = all
            .get(name)
            .unwrap_or_else(|| panic!("controller {name} is listed: {all:?}"));
        if pred(c) {
            return c.clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: {c:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The identity watch is a supervised controller: when its stream fails
/// (etcd stops under it) it is restarted with backoff, each restart counted
/// in /metrics by reason and shown by GetInfo, and it is healthy again once
/// etcd is back.
#[tokio::test]
async fn a_failing_identity_watch_is_restarted_counted_in_metrics_and_shown_then_recovers() {
    use rivet_proto::daemon::v1::ControllerState;

    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let metrics_address = std::net::SocketAddr::from(([127, 0, 0, 1], rivet_common::testing::free_local_port()));
    let a = command(dir.path(), "node-a", Some(&etcd.endpoint()))
        .args(["--metrics-address", &metrics_address.to_string()])
        .spawn()
        .await
        .expect("node-a starts");
    let mut c = client(&a).await;
    wait_store(&mut c, "the store is listed", |s| s.connected).await;
    let names: BTreeSet<String> = controllers(&a).await.into_keys().collect();
    for expected in [
        "identity-watch",
        "identity-value-keys",
        "identity-lease-renewals",
        "ipcache-watch",
        "ipcache-publish",
        "ipcache-lease-renewals",
        "ipcache-loader-sync",
        "snapshot-writer",
        "snapshot-changes",
        "etcd-lease-keeper",
        "kvstore-heartbeat-watch",
        "kvstore-heartbeat-check",
        "metrics-server",
    ] {
        assert!(names.contains(expected), "{expected} runs as a controller: {names:?}");
    }
    let watch = wait_controller(&a, "identity-watch", "the watch is up", |w| {
        w.state == ControllerState::Running as i32 && w.last_success_age_ms.is_some()
    })
    .await;
    assert_eq!(watch.restarts, 0, "{watch:?}");
    let series = r#"rivet_controller_restarts_total{controller="identity-watch",reason="error"}"#;
    assert_eq!(sample(&metrics(metrics_address).await, series), 0.0);

    let etcd = etcd.stop_async().await;
    let failing = wait_controller(&a, "identity-watch", "the failed watch is restarted", |w| {
        w.state == ControllerState::Failing as i32 && w.restarts >= 2
    })
    .await;
    assert!(
        !failing.last_error.is_empty() && failing.failing_for_ms.is_some(),
        "{failing:?}"
    );
    let text = metrics(metrics_address).await;
    assert!(sample(&text, series) >= 2.0, "restarts are counted by reason:\n{text}");
    assert_eq!(
        sample(&text, r#"rivet_controller_failing{controller="identity-watch"}"#),
        1.0,
        "{text}"
    );

    let _etcd = etcd.restart_async().await.expect("etcd restarts");
    let recovered = wait_controller(&a, "identity-watch", "the watch recovers", |w| {
        w.state == ControllerState::Running as i32 && w.failing_for_ms.is_none()
    })
    .await;
    assert!(recovered.restarts >= failing.restarts, "{recovered:?}");
    assert!(
        !recovered.last_error.is_empty(),
        "the last error stays for operators: {recovered:?}"
    );
    let text = metrics(metrics_address).await;
    assert_eq!(
        sample(&text, r#"rivet_controller_failing{controller="identity-watch"}"#),
        0.0,
        "{text}"
    );
}

/// A cluster range reaching into the CIDR identities (2^24 up) is refused
/// before the daemon starts: cluster and CIDR identities would collide.
#[test]
fn a_max_identity_in_the_cidr_range_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = std::process::Command::new(BIN)
        .args(["--max-identity", "16777216", "--node-name", "max-identity"])
        .arg("--socket-dir")
        .arg(dir.path().join("sockets"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A daemon that accepted the flag would serve until stopped.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("svc-identity accepted --max-identity 16777216 and started");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let stderr = std::io::read_to_string(child.stderr.take().unwrap()).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("the largest cluster identity must be in 256..=16777215"),
        "{stderr}"
    );
    assert!(!dir.path().join("sockets").exists(), "nothing was started");
}

fn named_port(name: &str, protocol: &str, port: u32) -> pb::NamedPort {
    pb::NamedPort {
        name: name.into(),
        protocol: protocol.into(),
        port,
    }
}

/// Issue 19 §1: a client that ended its replay (svc-endpoint after it saw
/// the new boot id) has what the restart restored and it did not claim again
/// released at once, not after the restore grace (default 120 s): the IP
/// entry and value key of an endpoint deleted while svc-identity was down go
/// within seconds, while the replayed endpoint's entries and another
/// client's reference, which that client never replays, stay without a gap.
/// A marker for an earlier boot is refused with its reason.
#[tokio::test]
async fn ending_a_replay_releases_at_once_what_was_restored_and_not_claimed_again() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    // A lease that outlives the test: only a deletion removes the old run's keys.
    let mut a = command_with_ttl(dir.path(), "node-a", Some(&etcd.endpoint()), 900)
        .spawn()
        .await
        .expect("svc-identity starts");
    let mut c = client(&a).await;
    let mut ip = ipcache_client(&a).await;
    let live = allocate_owned(&mut c, 1, "endpoint/1").await.unwrap();
    let gone = allocate_owned(&mut c, 2, "endpoint/2").await.unwrap();
    allocate_owned(&mut c, 3, "other/3").await.unwrap();
    upsert_local(&mut ip, "198.18.7.1/32", live).await.unwrap();
    upsert_local(&mut ip, "198.18.7.2/32", gone).await.unwrap();
    let state = dir.path().join("node-a").join("state");
    wait_snapshot(&state, "the claims and their owners", |s| {
        snapshot_ips(s, "local").len() == 2
            && s.pointer("/data/identities/held")
                .is_some_and(|h| h.as_object().is_some_and(|h| h.len() == 3))
    })
    .await;

    let is_value = |set: usize| {
        move |k: &str| k.contains("/value/") && k.contains(&format!("app=app-{set},")) && k.ends_with("/node-a")
    };
    let is_ip =
        |last: u8| move |k: &str| k.starts_with("rivet/state/ip/v1/") && k.ends_with(&format!("/198.18.7.{last}"));
    let (mut watch, mut keys) = watch_keys(&etcd.endpoint(), "rivet/state/").await;
    for (what, present) in [
        ("set 1's value key", keys.iter().any(|k| is_value(1)(k))),
        ("set 2's value key", keys.iter().any(|k| is_value(2)(k))),
        ("set 3's value key", keys.iter().any(|k| is_value(3)(k))),
        ("198.18.7.1", keys.iter().any(|k| is_ip(1)(k))),
        ("198.18.7.2", keys.iter().any(|k| is_ip(2)(k))),
    ] {
        assert!(present, "{what} is in etcd before the kill: {keys:?}");
    }
    let old_boot = c
        .get_status(pb::GetStatusRequest {})
        .await
        .unwrap()
        .into_inner()
        .boot_id;

    // Endpoint 2 goes while svc-identity is down: nobody claims set 2 or
    // 198.18.7.2 again; other/3 never replays.
    a.kill9();
    a.restart().await.expect("svc-identity restarts");
    let restarted = std::time::Instant::now();
    let mut c = client(&a).await;
    let mut ip = ipcache_client(&a).await;
    let mut view = IpcacheView::watch(&mut ip).await;
    view.until("the restored view", |v| v.contains_key("198.18.7.1/32"))
        .await;
    let replayed = c
        .allocate_identity(pb::AllocateIdentityRequest {
            labels: labels(1),
            owner: "endpoint/1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(replayed.identity.unwrap().id, live);
    upsert_local(&mut ip, "198.18.7.1/32", live).await.unwrap();
    let boot_id = replayed.boot_id;
    assert_ne!(boot_id, old_boot);

    let end = |boot_id: &str| pb::EndReplayRequest {
        boot_id: boot_id.into(),
        owner_prefix: "endpoint/".into(),
        ip_sources: vec![pb::IpcacheSource::LocalEndpoint as i32],
    };
    let stale = c.end_replay(end(&old_boot)).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition, "{stale:?}");
    assert_eq!(
        rivet_common::grpc::error_reason::<pb::ErrorReason>(&stale),
        Some(pb::ErrorReason::BootIdMismatch),
        "{stale:?}"
    );
    for (bad, field) in [
        (
            pb::EndReplayRequest {
                owner_prefix: "endpoint".into(),
                ..end(&boot_id)
            },
            "owner_prefix",
        ),
        (
            pb::EndReplayRequest {
                ip_sources: vec![pb::IpcacheSource::Kvstore as i32],
                ..end(&boot_id)
            },
            "ip_sources[0]",
        ),
        (end(""), "boot_id"),
    ] {
        let refused = c.end_replay(bad).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().starts_with(field), "{refused:?} names {field}");
    }

    let ended = c.end_replay(end(&boot_id)).await.expect("EndReplay").into_inner();
    assert_eq!(
        (ended.withdrawn_ip_claims, ended.released_identities),
        (1, 1),
        "198.18.7.2 and set 2 were endpoint 2's; set 3 is another client's"
    );
    // Every delete since before the kill, until endpoint 2's keys are gone.
    let (took, deleted) = wait_keys_gone(&mut watch, &mut keys, Duration::from_secs(20), |k| {
        is_value(2)(k) || is_ip(2)(k)
    })
    .await;
    eprintln!(
        "endpoint 2's IP entry and value key gone {took:?} after the marker, {:?} after the restart (grace 120 s)",
        restarted.elapsed()
    );
    let gap = std::cell::Cell::new(false);
    view.until("198.18.7.2 withdrawn from the view", |v| {
        gap.set(gap.get() || !v.contains_key("198.18.7.1/32"));
        !v.contains_key("198.18.7.2/32")
    })
    .await;
    assert!(!gap.get(), "198.18.7.1 never left the view");

    // No gap: since before the kill etcd deleted endpoint 2's keys only.
    assert!(
        deleted.iter().all(|k| is_value(2)(k) || is_ip(2)(k)),
        "only endpoint 2's keys were deleted: {deleted:?}"
    );
    let now = raw_keys(&etcd.endpoint(), "rivet/state/").await;
    for (what, present) in [
        ("set 1's value key", now.keys().any(|k| is_value(1)(k))),
        (
            "set 3's value key (another client's)",
            now.keys().any(|k| is_value(3)(k)),
        ),
        ("198.18.7.1", now.keys().any(|k| is_ip(1)(k))),
    ] {
        assert!(present, "{what} stays: {now:?}");
    }
    // A claim after the marker is an ordinary claim.
    upsert_local(&mut ip, "198.18.7.2/32", gone).await.unwrap();
    view.until("198.18.7.2 claimed again", |v| v.contains_key("198.18.7.2/32"))
        .await;
    assert!(
        raw_keys(&etcd.endpoint(), "rivet/state/ip/v1/")
            .await
            .keys()
            .any(|k| is_ip(2)(k)),
        "published again"
    );
}
