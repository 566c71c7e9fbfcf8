//! The cache over a real store (two nodes on etcd, a restart's grace)
//! and its push to a real svc-loader.

use rivet_common::testing::etcd::EtcdServer;
use rivet_testkit::loader::LoaderNode;

use std::path::PathBuf;

use rivet_common::controller::Controllers;
use rivet_common::grpc::DaemonChannel;
use rivet_proto::loader::v1 as loader_pb;
use rivet_proto::loader::v1::loader_service_client::LoaderServiceClient;

use super::*;
use crate::embedded_backend::EmbeddedBackend;
use crate::etcd_backend::{EtcdBackend, EtcdOptions};

const WAIT: Duration = Duration::from_secs(10);

fn net(text: &str) -> IpNet {
    parse_prefix(text).unwrap()
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn pod(prefix: &str, identity: u32, source: IpcacheSource, host: Option<&str>) -> IpcacheEntry {
    IpcacheEntry {
        host_ip: host.map(ip),
        pod_namespace: "default".into(),
        pod_name: format!("pod-{identity}"),
        ..IpcacheEntry::new(net(prefix), identity, source)
    }
}

/// Polls `f` until it yields, failing with `what` after [`WAIT`].
async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A cache of node `name` on `etcd`, running under the returned controllers
/// (dropping them stops it).
async fn etcd_node(etcd: &EtcdServer, name: &str, host: &str) -> (Arc<IpCache>, Controllers) {
    let controllers = Controllers::new();
    let backend = EtcdBackend::connect(EtcdOptions::new(vec![etcd.endpoint()], name), &controllers)
        .await
        .expect("connecting to the test etcd");
    let opts = IpCacheOptions {
        host_ip: Some(ip(host)),
        ..IpCacheOptions::new(name)
    };
    let cache = IpCache::new(Arc::new(backend), opts);
    cache.run(&controllers);
    tokio::time::timeout(WAIT, cache.wait_ready())
        .await
        .expect("the first listing completes");
    (cache, controllers)
}

/// What a subscriber reconstructs from a snapshot and its deltas.
struct View {
    entries: BTreeMap<IpNet, IpcacheEntry>,
    rx: broadcast::Receiver<IpcacheDelta>,
    revision: u64,
}

impl View {
    fn of(cache: &IpCache) -> Self {
        let (snapshot, revision, rx) = cache.subscribe();
        Self {
            entries: snapshot.into_iter().map(|e| (e.prefix, e)).collect(),
            rx,
            revision,
        }
    }

    /// Applies deltas until `pred` holds.
    async fn until(&mut self, what: &str, pred: impl Fn(&BTreeMap<IpNet, IpcacheEntry>) -> bool) {
        let deadline = Instant::now() + WAIT;
        while !pred(&self.entries) {
            let delta = tokio::time::timeout_at(deadline, self.rx.recv())
                .await
                .unwrap_or_else(|_| panic!("timed out waiting in the watch stream until {what}"))
                .expect("no lag in this test");
            assert!(delta.revision > self.revision, "revisions increase");
            self.revision = delta.revision;
            match delta.entry {
                Some(e) => self.entries.insert(delta.prefix, e),
                None => self.entries.remove(&delta.prefix),
            };
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_published_on_one_node_reaches_the_other_and_claims_follow_precedence() {
    let etcd = EtcdServer::start().expect("starting etcd");
    let (a, _a_controllers) = etcd_node(&etcd, "node-a", "10.0.0.1").await;
    let (b, _b_controllers) = etcd_node(&etcd, "node-b", "10.0.0.2").await;
    let x = net("198.18.1.5/32");
    let mut b_view = View::of(&b);

    // A's endpoint → B sees it as KVSTORE, in its view and its stream.
    a.upsert(vec![pod("198.18.1.5", 300, IpcacheSource::LocalEndpoint, None)])
        .await
        .unwrap();
    assert_eq!(
        a.get(&x).unwrap().host_ip,
        Some(ip("10.0.0.1")),
        "a local claim gets the node's host"
    );
    let seen = eventually("B has A's entry", || b.get(&x)).await;
    assert_eq!(
        (seen.source, seen.identity, seen.node_name.as_str(), seen.host_ip),
        (IpcacheSource::KvStore, 300, "node-a", Some(ip("10.0.0.1")))
    );
    assert_eq!(
        (seen.pod_namespace.as_str(), seen.pod_name.as_str()),
        ("default", "pod-300")
    );
    b_view
        .until("A's entry is streamed to B", |v| v.get(&x) == Some(&seen))
        .await;
    assert!(
        a.claims(&x).iter().all(|c| c.source == IpcacheSource::LocalEndpoint),
        "A's own entry, echoed by the store, is no KVSTORE claim on A: {:?}",
        a.claims(&x)
    );

    // KUBERNETES ranks below KVSTORE: claimed, not effective.
    assert_eq!(
        b.upsert(vec![pod(
            "198.18.1.5",
            400,
            IpcacheSource::Kubernetes,
            Some("10.0.0.9")
        )])
        .await
        .unwrap(),
        0
    );
    assert_eq!(b.get(&x).unwrap().source, IpcacheSource::KvStore);
    assert_eq!(b.claims(&x).len(), 2);

    // LOCAL_ENDPOINT ranks above KVSTORE.
    assert_eq!(
        b.upsert(vec![pod("198.18.1.5", 301, IpcacheSource::LocalEndpoint, None)])
            .await
            .unwrap(),
        1
    );
    let local = b.get(&x).unwrap();
    assert_eq!((local.source, local.identity), (IpcacheSource::LocalEndpoint, 301));
    // B's write took the store key; A keeps its own claim effective.
    eventually("A hears of B's claim as KVSTORE", || {
        a.claims(&x)
            .iter()
            .any(|c| c.source == IpcacheSource::KvStore && c.identity == 301)
            .then_some(())
    })
    .await;
    assert_eq!(a.get(&x).unwrap().identity, 300);
    b_view
        .until("B's local claim is streamed", |v| {
            v.get(&x).map(|e| e.identity) == Some(301)
        })
        .await;

    // B withdraws: the store key goes, A still claims it and publishes
    // it again, so B falls back to A's entry.
    assert_eq!(b.delete(IpcacheSource::LocalEndpoint, &[x]).await.unwrap(), 1);
    let back = eventually("A re-published its entry", || {
        b.get(&x)
            .filter(|e| e.source == IpcacheSource::KvStore && e.identity == 300)
    })
    .await;
    assert_eq!(back.node_name, "node-a");

    // A withdraws: B falls back to its KUBERNETES claim, then nothing.
    assert_eq!(a.delete(IpcacheSource::LocalEndpoint, &[x]).await.unwrap(), 1);
    assert_eq!(a.get(&x), None);
    eventually("B falls back to KUBERNETES", || {
        b.get(&x)
            .filter(|e| e.source == IpcacheSource::Kubernetes && e.identity == 400)
    })
    .await;
    assert_eq!(b.delete(IpcacheSource::Kubernetes, &[x]).await.unwrap(), 1);
    assert_eq!(b.get(&x), None);
    b_view.until("the removal is streamed", |v| !v.contains_key(&x)).await;
    assert_eq!(
        b_view.entries.values().cloned().collect::<Vec<_>>(),
        b.list(),
        "the streamed view equals the cache"
    );
    assert_eq!(
        b.delete(IpcacheSource::Kubernetes, &[x]).await.unwrap(),
        0,
        "idempotent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_of_a_previous_run_stay_for_the_grace_then_only_reclaimed_ones_remain() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.json");
    {
        let backend = Arc::new(EmbeddedBackend::open(&path, "n1").unwrap());
        let cache = IpCache::new(backend, IpCacheOptions::new("n1"));
        let controllers = Controllers::new();
        cache.run(&controllers);
        cache
            .upsert(vec![
                pod("198.18.2.1", 300, IpcacheSource::LocalEndpoint, None),
                pod("198.18.2.2", 301, IpcacheSource::LocalEndpoint, None),
            ])
            .await
            .unwrap();
        controllers.shutdown().await;
    }
    let backend = Arc::new(EmbeddedBackend::open(&path, "n1").unwrap());
    let opts = IpCacheOptions {
        restore_grace: Duration::from_millis(300),
        ..IpCacheOptions::new("n1")
    };
    let cache = IpCache::new(backend.clone(), opts);
    let controllers = Controllers::new();
    cache.run(&controllers);
    cache.wait_ready().await;
    let (kept, dropped) = (net("198.18.2.1"), net("198.18.2.2"));
    assert_eq!(cache.get(&kept).map(|e| e.identity), Some(300), "restored at start");
    assert_eq!(
        cache.get(&dropped).map(|e| e.source),
        Some(IpcacheSource::LocalEndpoint)
    );
    // The endpoint replays one of them.
    cache
        .upsert(vec![pod("198.18.2.1", 300, IpcacheSource::LocalEndpoint, None)])
        .await
        .unwrap();
    eventually("the unclaimed entry expires", || {
        cache.get(&dropped).is_none().then_some(())
    })
    .await;
    assert!(cache.get(&kept).is_some(), "a re-claimed entry stays");
    let deadline = Instant::now() + WAIT;
    loop {
        let (entries, _) = backend.list_ips().await.unwrap();
        let ips: Vec<&str> = entries.iter().map(|e| e.ip.as_str()).collect();
        if ips == ["198.18.2.1"] {
            break;
        }
        assert!(Instant::now() < deadline, "store still holds {ips:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn loader_bin() -> PathBuf {
    rivet_common::testing::workspace_binary("svc-loader")
}

async fn loader_ipcache(client: &mut LoaderServiceClient<DaemonChannel>) -> BTreeMap<(Vec<u8>, u32), (u32, Vec<u8>)> {
    let r = client
        .list_ipcache(loader_pb::ListIpcacheRequest {
            page_size: 10000,
            start_after: None,
        })
        .await
        .expect("listing the loader's ipcache")
        .into_inner();
    assert!(r.complete);
    r.entries
        .into_iter()
        .map(|e| {
            let p = e.prefix.unwrap();
            ((p.address, p.prefix_length), (e.identity, e.tunnel_endpoint))
        })
        .collect()
}

fn key(prefix: &str) -> (Vec<u8>, u32) {
    let p = rivet_proto::net::prefix_to_proto(net(prefix));
    (p.address, p.prefix_length)
}

async fn loader_until(
    client: &mut LoaderServiceClient<DaemonChannel>,
    what: &str,
    pred: impl Fn(&BTreeMap<(Vec<u8>, u32), (u32, Vec<u8>)>) -> bool,
) {
    let deadline = Instant::now() + WAIT;
    loop {
        let entries = loader_ipcache(client).await;
        if pred(&entries) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting until {what}; the loader holds {entries:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loader_gets_the_view_and_a_full_resync_after_its_restart() {
    let bin = loader_bin();
    let mut node = LoaderNode::start(&bin, &[], &[]).await.expect("starting svc-loader");
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(EmbeddedBackend::open(dir.path().join("store.json"), "n1").unwrap());
    let opts = IpCacheOptions {
        host_ip: Some(ip("10.1.0.1")),
        ..IpCacheOptions::new("n1")
    };
    let cache = IpCache::new(backend, opts);
    let controllers = Controllers::new();
    cache.run(&controllers);
    let sync = LoaderSync::new(
        cache.clone(),
        LoaderSyncOptions {
            probe_interval: Duration::from_millis(100),
            retry: Backoff::new(Duration::from_millis(50), Duration::from_millis(500)),
            ..LoaderSyncOptions::new(node.loader.socket())
        },
    );
    sync.run(&controllers);
    let mut client = node.client().await;

    cache
        .upsert(vec![
            pod("198.18.5.2", 300, IpcacheSource::LocalEndpoint, None),
            pod("198.18.6.0/24", 301, IpcacheSource::Kubernetes, Some("10.1.0.2")),
        ])
        .await
        .unwrap();
    loader_until(&mut client, "the entries reach the loader", |e| {
        e.get(&key("198.18.5.2")) == Some(&(300, Vec::new()))
            && e.get(&key("198.18.6.0/24")) == Some(&(301, vec![10, 1, 0, 2]))
            && e.get(&key("0.0.0.0/0")) == Some(&(2, Vec::new()))
            && e.get(&key("::/0")) == Some(&(2, Vec::new()))
    })
    .await;
    assert!(sync.wait_pushed(cache.revision(), WAIT).await);
    let before = sync.status();
    assert!(before.connected, "{before:?}");
    assert_eq!(before.loader_boot_id, node.loader.info().boot_id);
    assert_eq!((before.pending, before.last_error.as_str()), (0, ""));

    // Lost behind the cache's back, then the loader restarts.
    let gone = client
        .delete_ipcache(loader_pb::DeleteIpcacheRequest {
            prefixes: vec![rivet_proto::net::prefix_to_proto(net("198.18.5.2"))],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(gone.deleted, 1);
    node.loader.kill9();
    node.loader.restart().await.expect("restarting svc-loader");
    let mut client = node.client().await;
    loader_until(&mut client, "the full resync restores the entry", |e| {
        e.get(&key("198.18.5.2")) == Some(&(300, Vec::new()))
    })
    .await;
    let after = eventually("the status shows the new loader", || {
        let s = sync.status();
        (s.loader_boot_id == node.loader.info().boot_id).then_some(s)
    })
    .await;
    assert_ne!(after.loader_boot_id, before.loader_boot_id);
    assert!(after.full_syncs > before.full_syncs, "{after:?}");
    assert!(after.last_full_sync > before.last_full_sync);
    assert!(after.connected);

    // Withdrawn claims leave the loader.
    cache
        .delete(IpcacheSource::LocalEndpoint, &[net("198.18.5.2")])
        .await
        .unwrap();
    cache
        .delete(IpcacheSource::Kubernetes, &[net("198.18.6.0/24")])
        .await
        .unwrap();
    loader_until(&mut client, "the withdrawn entries leave the loader", |e| {
        !e.contains_key(&key("198.18.5.2")) && !e.contains_key(&key("198.18.6.0/24"))
    })
    .await;
    assert!(sync.wait_pushed(cache.revision(), WAIT).await);
    assert_eq!(sync.status().pending, 0);
}
