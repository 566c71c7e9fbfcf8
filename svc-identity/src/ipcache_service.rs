//! `rivet.identity.v1.IpcacheService` over the [`IpCache`].
//!
//! Callers (svc-endpoint, svc-k8s-sync) may claim with LOCAL_ENDPOINT and
//! KUBERNETES only; RESERVED, KVSTORE and CIDR are server-owned. A batch is
//! validated whole before anything changes. Changes are local first: they
//! never fail because the store is unreachable (LOCAL_ENDPOINT entries are
//! published when it is back, see [`IpCache`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use ipnet::IpNet;
use rivet_common::grpc::{BootId, optional_address_field, prefix_field};
use rivet_proto::identity::v1 as pb;
use rivet_proto::net;
use tokio::sync::broadcast;
use tonic::{Request, Response, Status};

use crate::backend::IpNamedPort;
use crate::ipcache::{IpCache, IpcacheDelta, IpcacheEntry, IpcacheSource, prefix_text};

/// Most entries of one UpsertIp or DeleteIp.
pub const MAX_BATCH: usize = 1024;
/// Entries per snapshot message and most changes per delta message.
const MESSAGE_CHUNK: usize = 1000;
/// Default and largest ListIpcache page.
const DEFAULT_PAGE: usize = 1000;
const MAX_PAGE: usize = 10000;
/// A Kubernetes namespace is a DNS label.
const MAX_NAMESPACE: usize = 63;
/// A Kubernetes object name is a DNS subdomain.
const MAX_POD_NAME: usize = 253;

/// Implements `rivet.identity.v1.IpcacheService`.
#[derive(Debug, Clone)]
pub struct IpcacheService {
    ipcache: Arc<IpCache>,
    boot_id: BootId,
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchIpcacheResponse, Status>> + Send>>;

impl IpcacheService {
    /// A service over `ipcache`.
    pub fn new(ipcache: Arc<IpCache>, boot_id: BootId) -> Self {
        Self { ipcache, boot_id }
    }

    /// The tonic server.
    pub fn into_server(self) -> pb::ipcache_service_server::IpcacheServiceServer<Self> {
        pb::ipcache_service_server::IpcacheServiceServer::new(self)
    }
}

fn invalid(field: impl std::fmt::Display, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}

/// A source a client may claim with.
fn client_source(field: &str, raw: i32) -> Result<IpcacheSource, Status> {
    match IpcacheSource::from_proto(raw) {
        Some(s @ (IpcacheSource::LocalEndpoint | IpcacheSource::Kubernetes)) => Ok(s),
        Some(s) => Err(invalid(
            field,
            format!("{s} is server-owned; clients claim with LOCAL_ENDPOINT or KUBERNETES"),
        )),
        None if raw == 0 => Err(invalid(field, "required (LOCAL_ENDPOINT or KUBERNETES)")),
        None => Err(invalid(field, format!("unknown source {raw}"))),
    }
}

/// A source filter value (any known source).
fn filter_source(field: &str, raw: i32) -> Result<Option<IpcacheSource>, Status> {
    match IpcacheSource::from_proto(raw) {
        Some(s) => Ok(Some(s)),
        None if raw == 0 => Ok(None),
        None => Err(invalid(field, format!("unknown source {raw}"))),
    }
}

fn bounded(field: &str, raw: &str, max: usize) -> Result<String, Status> {
    if raw.len() > max {
        return Err(invalid(field, format!("at most {max} characters, got {}", raw.len())));
    }
    if raw.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(invalid(field, "must not hold whitespace or control characters"));
    }
    Ok(raw.to_string())
}

/// Most named ports one entry may carry.
const MAX_NAMED_PORTS: usize = 256;

/// Validates an entry's named ports: IANA service names, TCP/UDP/SCTP,
/// 1..65535, at most [`MAX_NAMED_PORTS`] (svc-endpoint's bound on an
/// endpoint's).
fn named_ports(field: &str, raw: &[pb::NamedPort]) -> Result<Vec<IpNamedPort>, Status> {
    if raw.len() > MAX_NAMED_PORTS {
        return Err(invalid(
            field,
            format!("{} named ports exceed the limit of {MAX_NAMED_PORTS}", raw.len()),
        ));
    }
    let mut out: Vec<IpNamedPort> = Vec::with_capacity(raw.len());
    for (i, p) in raw.iter().enumerate() {
        rivet_common::named_port::check_port_name(&p.name).map_err(|e| invalid(format!("{field}[{i}].name"), e))?;
        let protocol = p.protocol.clone();
        if !matches!(protocol.as_str(), "TCP" | "UDP" | "SCTP") {
            return Err(invalid(
                format!("{field}[{i}].protocol"),
                format!("{:?} is not TCP, UDP or SCTP", p.protocol),
            ));
        }
        let port = u16::try_from(p.port)
            .ok()
            .filter(|port| *port != 0)
            .ok_or_else(|| invalid(format!("{field}[{i}].port"), format!("{} is not in 1..65535", p.port)))?;
        out.push(IpNamedPort {
            name: p.name.clone(),
            protocol,
            port,
        });
    }
    out.sort();
    Ok(out)
}

/// Validates a whole UpsertIp batch.
fn entries(raw: &[pb::IpcacheEntry]) -> Result<Vec<IpcacheEntry>, Status> {
    if raw.len() > MAX_BATCH {
        return Err(invalid(
            "entries",
            format!("{} entries exceed the limit of {MAX_BATCH}", raw.len()),
        ));
    }
    let mut seen: HashMap<(IpNet, IpcacheSource), usize> = HashMap::new();
    let mut out = Vec::with_capacity(raw.len());
    for (i, e) in raw.iter().enumerate() {
        let f = |name: &str| format!("entries[{i}].{name}");
        let net = prefix_field(&f("prefix"), e.prefix.as_ref())?;
        if e.identity == 0 {
            return Err(invalid(f("identity"), "must be non-zero"));
        }
        let source = client_source(&f("source"), e.source)?;
        let host_ip = optional_address_field(&f("host_ip"), &e.host_ip)?;
        if let Some(first) = seen.insert((net, source), i) {
            return Err(invalid(
                f("prefix"),
                format!("{} with source {source} repeats entries[{first}]", prefix_text(&net)),
            ));
        }
        out.push(IpcacheEntry {
            prefix: net,
            identity: e.identity,
            host_ip,
            pod_namespace: bounded(&f("pod_namespace"), &e.pod_namespace, MAX_NAMESPACE)?,
            pod_name: bounded(&f("pod_name"), &e.pod_name, MAX_POD_NAME)?,
            source,
            node_name: String::new(),
            named_ports: named_ports(&f("named_ports"), &e.named_ports)?,
        });
    }
    Ok(out)
}

/// Snapshot messages of `entries` (one empty message for an empty view).
fn snapshot_messages(boot_id: &str, revision: u64, entries: &[IpcacheEntry]) -> Vec<pb::WatchIpcacheResponse> {
    let chunks: Vec<&[IpcacheEntry]> = if entries.is_empty() {
        vec![&[]]
    } else {
        entries.chunks(MESSAGE_CHUNK).collect()
    };
    let last = chunks.len() - 1;
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| pb::WatchIpcacheResponse {
            boot_id: boot_id.to_string(),
            snapshot: true,
            snapshot_complete: i == last,
            revision,
            upserted: chunk.iter().map(IpcacheEntry::to_proto).collect(),
            deleted: Vec::new(),
        })
        .collect()
}

/// One watcher: what it was sent, so a filtered watcher hears of an entry
/// whose effective source left its filter as a deletion.
struct Watcher {
    sources: BTreeSet<IpcacheSource>,
    sent: BTreeSet<IpNet>,
}

impl Watcher {
    fn wants(&self, e: &IpcacheEntry) -> bool {
        self.sources.is_empty() || self.sources.contains(&e.source)
    }

    fn snapshot(&mut self, entries: Vec<IpcacheEntry>) -> Vec<IpcacheEntry> {
        let entries: Vec<IpcacheEntry> = entries.into_iter().filter(|e| self.wants(e)).collect();
        self.sent = entries.iter().map(|e| e.prefix).collect();
        entries
    }

    /// The message for coalesced changes, if any concerns this watcher.
    fn delta(
        &mut self,
        boot_id: &str,
        revision: u64,
        changes: BTreeMap<IpNet, Option<IpcacheEntry>>,
    ) -> Option<pb::WatchIpcacheResponse> {
        let mut upserted = Vec::new();
        let mut deleted = Vec::new();
        for (prefix, entry) in changes {
            match entry {
                Some(e) if self.wants(&e) => {
                    self.sent.insert(prefix);
                    upserted.push(e.to_proto());
                }
                _ => {
                    if self.sent.remove(&prefix) {
                        deleted.push(net::prefix_to_proto(prefix));
                    }
                }
            }
        }
        (!upserted.is_empty() || !deleted.is_empty()).then(|| pb::WatchIpcacheResponse {
            boot_id: boot_id.to_string(),
            snapshot: false,
            snapshot_complete: false,
            revision,
            upserted,
            deleted,
        })
    }
}

/// One `WatchIpcache` stream: the snapshot, then coalesced deltas (those
/// that queued while the client was slow go out as one message); a watcher
/// too slow for the deltas starts over with a fresh snapshot.
struct IpcacheWatch {
    ipcache: Arc<IpCache>,
    boot_id: String,
    watcher: Watcher,
    deltas: broadcast::Receiver<IpcacheDelta>,
    /// Messages of a snapshot not sent yet.
    pending: VecDeque<pb::WatchIpcacheResponse>,
}

impl IpcacheWatch {
    fn new(ipcache: Arc<IpCache>, boot_id: String, mut watcher: Watcher) -> Self {
        let (snapshot, revision, deltas) = ipcache.subscribe();
        let entries = watcher.snapshot(snapshot);
        Self {
            pending: snapshot_messages(&boot_id, revision, &entries).into(),
            ipcache,
            boot_id,
            watcher,
            deltas,
        }
    }

    /// The next message; `None` when the cache is gone.
    async fn next(&mut self) -> Option<pb::WatchIpcacheResponse> {
        loop {
            if let Some(message) = self.pending.pop_front() {
                return Some(message);
            }
            let mut changes: BTreeMap<IpNet, Option<IpcacheEntry>> = BTreeMap::new();
            let mut revision = 0;
            let mut lagged = false;
            let mut next = self.deltas.recv().await;
            loop {
                match next {
                    Ok(IpcacheDelta {
                        revision: r,
                        prefix,
                        entry,
                        ..
                    }) => {
                        revision = r;
                        changes.insert(prefix, entry);
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        lagged = true;
                        break;
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
                if changes.len() >= MESSAGE_CHUNK {
                    break;
                }
                next = match self.deltas.try_recv() {
                    Ok(d) => Ok(d),
                    Err(broadcast::error::TryRecvError::Empty) => break,
                    Err(broadcast::error::TryRecvError::Lagged(n)) => Err(broadcast::error::RecvError::Lagged(n)),
                    Err(broadcast::error::TryRecvError::Closed) => Err(broadcast::error::RecvError::Closed),
                };
            }
            if lagged {
                let (snapshot, revision, deltas) = self.ipcache.subscribe();
                self.deltas = deltas;
                let entries = self.watcher.snapshot(snapshot);
                self.pending = snapshot_messages(&self.boot_id, revision, &entries).into();
                continue;
            }
            if let Some(message) = self.watcher.delta(&self.boot_id, revision, changes) {
                return Some(message);
            }
        }
    }
}

#[tonic::async_trait]
impl pb::ipcache_service_server::IpcacheService for IpcacheService {
    #[tracing::instrument(name = "ipcache.upsert", skip_all, fields(entries = request.get_ref().entries.len()))]
    async fn upsert_ip(&self, request: Request<pb::UpsertIpRequest>) -> Result<Response<pb::UpsertIpResponse>, Status> {
        let entries = entries(&request.get_ref().entries)?;
        let changed = self.ipcache.upsert(entries).await.map_err(|e| e.to_status())?;
        Ok(Response::new(pb::UpsertIpResponse {
            changed,
            boot_id: self.boot_id.to_string(),
        }))
    }

    #[tracing::instrument(name = "ipcache.delete", skip_all, fields(prefixes = request.get_ref().prefixes.len()))]
    async fn delete_ip(&self, request: Request<pb::DeleteIpRequest>) -> Result<Response<pb::DeleteIpResponse>, Status> {
        let r = request.get_ref();
        let source = client_source("source", r.source)?;
        if r.prefixes.len() > MAX_BATCH {
            return Err(invalid(
                "prefixes",
                format!("{} prefixes exceed the limit of {MAX_BATCH}", r.prefixes.len()),
            ));
        }
        let prefixes = r
            .prefixes
            .iter()
            .enumerate()
            .map(|(i, p)| prefix_field(&format!("prefixes[{i}]"), Some(p)))
            .collect::<Result<Vec<_>, _>>()?;
        let deleted = self
            .ipcache
            .delete(source, &prefixes)
            .await
            .map_err(|e| e.to_status())?;
        Ok(Response::new(pb::DeleteIpResponse {
            deleted,
            boot_id: self.boot_id.to_string(),
        }))
    }

    async fn list_ipcache(
        &self,
        request: Request<pb::ListIpcacheRequest>,
    ) -> Result<Response<pb::ListIpcacheResponse>, Status> {
        let r = request.get_ref();
        let source = filter_source("source", r.source)?;
        let page = match r.page_size as usize {
            0 => DEFAULT_PAGE,
            n if n <= MAX_PAGE => n,
            n => return Err(invalid("page_size", format!("at most {MAX_PAGE}, got {n}"))),
        };
        let after = r
            .start_after
            .as_ref()
            .map(|p| prefix_field("start_after", Some(p)))
            .transpose()?;
        let (entries, complete) = self.ipcache.list_page(source, after, page);
        Ok(Response::new(pb::ListIpcacheResponse {
            entries: entries.iter().map(IpcacheEntry::to_proto).collect(),
            complete,
            boot_id: self.boot_id.to_string(),
        }))
    }

    type WatchIpcacheStream = WatchStream;

    async fn watch_ipcache(
        &self,
        request: Request<pb::WatchIpcacheRequest>,
    ) -> Result<Response<Self::WatchIpcacheStream>, Status> {
        let mut sources = BTreeSet::new();
        for (i, raw) in request.get_ref().sources.iter().enumerate() {
            let field = format!("sources[{i}]");
            match filter_source(&field, *raw)? {
                Some(s) => sources.insert(s),
                None => return Err(invalid(field, "UNSPECIFIED is not a source")),
            };
        }
        if !self.ipcache.is_ready() {
            return Err(Status::unavailable(
                "the IP cache has not been listed from the store yet; retry",
            ));
        }
        let watcher = Watcher {
            sources,
            sent: BTreeSet::new(),
        };
        let watch = IpcacheWatch::new(self.ipcache.clone(), self.boot_id.to_string(), watcher);
        // Driven by the response (no task of its own): it ends when the
        // client goes away.
        let stream = futures::stream::unfold(watch, |mut watch| async move {
            let message = watch.next().await?;
            Some((Ok(message), watch))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt;
    use pb::ipcache_service_server::IpcacheService as _;
    use rivet_common::testing::etcd::EtcdServer;
    use rivet_proto::net::IpPrefix;
    use rivet_testkit::wire;

    use super::*;
    use crate::backend::IdentityBackend as _;
    use crate::embedded_backend::EmbeddedBackend;
    use crate::etcd_backend::{EtcdBackend, EtcdOptions};
    use crate::ipcache::{IpCacheOptions, parse_prefix};

    const WAIT: Duration = Duration::from_secs(10);

    fn entry(prefix: &str, identity: u32, source: pb::IpcacheSource) -> pb::IpcacheEntry {
        pb::IpcacheEntry {
            prefix: Some(wire::prefix(prefix)),
            identity,
            source: source as i32,
            ..Default::default()
        }
    }

    async fn embedded(dir: &tempfile::TempDir, capacity: usize) -> (Arc<IpCache>, IpcacheService) {
        let backend = Arc::new(EmbeddedBackend::open(dir.path().join("store.json"), "n1").unwrap());
        let opts = IpCacheOptions {
            channel_capacity: capacity,
            ..IpCacheOptions::new("n1")
        };
        let cache = IpCache::new(backend, opts);
        let controllers = rivet_common::controller::Controllers::new();
        cache.run(&controllers);
        cache.wait_ready().await;
        let service = IpcacheService::new(cache.clone(), BootId::random());
        (cache, service)
    }

    async fn upsert(service: &IpcacheService, entries: Vec<pb::IpcacheEntry>) -> Result<pb::UpsertIpResponse, Status> {
        service
            .upsert_ip(Request::new(pb::UpsertIpRequest { entries }))
            .await
            .map(Response::into_inner)
    }

    fn refused(result: Result<pb::UpsertIpResponse, Status>, field: &str) -> String {
        let status = result.expect_err("must be refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().starts_with(&format!("{field}: ")),
            "the error names {field}: {}",
            status.message()
        );
        status.message().to_string()
    }

    #[tokio::test]
    async fn a_bad_entry_refuses_the_whole_batch_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let (cache, service) = embedded(&dir, 64).await;
        let before = cache.list();
        let good = entry("198.18.0.5", 300, pb::IpcacheSource::LocalEndpoint);
        let with = |bad: pb::IpcacheEntry| vec![good.clone(), bad];

        let m = refused(
            upsert(&service, with(entry("198.18.0.9", 301, pb::IpcacheSource::Reserved))).await,
            "entries[1].source",
        );
        assert!(m.contains("server-owned"), "{m}");
        for source in [
            pb::IpcacheSource::Kvstore,
            pb::IpcacheSource::Cidr,
            pb::IpcacheSource::Unspecified,
        ] {
            refused(
                upsert(&service, with(entry("198.18.0.9", 301, source))).await,
                "entries[1].source",
            );
        }
        let m = refused(
            upsert(
                &service,
                with(entry("198.18.0.9/24", 301, pb::IpcacheSource::Kubernetes)),
            )
            .await,
            "entries[1].prefix",
        );
        assert!(m.contains("host bits"), "{m}");
        let mut bad_prefix = entry("198.18.0.9", 301, pb::IpcacheSource::Kubernetes);
        bad_prefix.prefix = Some(IpPrefix {
            address: b"198.18.0.9".to_vec(),
            prefix_length: 32,
        });
        refused(upsert(&service, with(bad_prefix)).await, "entries[1].prefix");
        let mut no_prefix = entry("198.18.0.9", 301, pb::IpcacheSource::Kubernetes);
        no_prefix.prefix = None;
        refused(upsert(&service, with(no_prefix)).await, "entries[1].prefix");
        refused(
            upsert(&service, with(entry("198.18.0.9", 0, pb::IpcacheSource::Kubernetes))).await,
            "entries[1].identity",
        );
        let mut bad_host = entry("198.18.0.9", 301, pb::IpcacheSource::Kubernetes);
        bad_host.host_ip = b"node-b".to_vec();
        refused(upsert(&service, with(bad_host)).await, "entries[1].host_ip");
        let mut long_ns = entry("198.18.0.9", 301, pb::IpcacheSource::Kubernetes);
        long_ns.pod_namespace = "n".repeat(64);
        refused(upsert(&service, with(long_ns)).await, "entries[1].pod_namespace");
        let mut bad_name = entry("198.18.0.9", 301, pb::IpcacheSource::Kubernetes);
        bad_name.pod_name = "a\nb".into();
        refused(upsert(&service, with(bad_name)).await, "entries[1].pod_name");
        refused(upsert(&service, with(good.clone())).await, "entries[1].prefix");
        let many = (0..=MAX_BATCH)
            .map(|i| {
                entry(
                    &format!("198.18.{}.{}", i / 256, i % 256),
                    300,
                    pb::IpcacheSource::Kubernetes,
                )
            })
            .collect();
        refused(upsert(&service, many).await, "entries");
        assert_eq!(cache.list(), before, "a refused batch changes nothing");

        let delete = |prefixes: Vec<&str>, source: pb::IpcacheSource| {
            service.delete_ip(Request::new(pb::DeleteIpRequest {
                prefixes: prefixes.into_iter().map(wire::prefix).collect(),
                source: source as i32,
            }))
        };
        let s = delete(vec!["0.0.0.0/0"], pb::IpcacheSource::Reserved)
            .await
            .unwrap_err();
        assert!(s.message().starts_with("source: "), "{s:?}");
        let s = delete(vec!["198.18.0.5", "198.18.0.5/31"], pb::IpcacheSource::LocalEndpoint)
            .await
            .unwrap_err();
        assert!(s.message().starts_with("prefixes[1]: "), "{s:?}");
        assert_eq!(cache.list(), before);

        // The good entry alone goes through; the reply names the server.
        let r = upsert(&service, vec![good.clone()]).await.unwrap();
        assert_eq!((r.changed, r.boot_id.as_str()), (1, service.boot_id.as_str()));
        assert_eq!(upsert(&service, vec![good]).await.unwrap().changed, 0, "idempotent");
        let listed = cache.get(&parse_prefix("198.18.0.5").unwrap()).unwrap();
        assert_eq!(
            (listed.source, listed.node_name.as_str()),
            (IpcacheSource::LocalEndpoint, "n1")
        );
        let r = delete(vec!["198.18.0.5/32"], pb::IpcacheSource::LocalEndpoint)
            .await
            .unwrap();
        assert_eq!(r.into_inner().deleted, 1);
        assert_eq!(cache.list(), before);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_store_takes_local_claims_at_once_and_publishes_them_when_back() {
        let mut etcd = EtcdServer::start().expect("starting etcd");
        let opts = EtcdOptions {
            request_timeout: Duration::from_millis(500),
            dial_timeout: Duration::from_millis(500),
            ..EtcdOptions::new(vec![etcd.endpoint()], "n1")
        };
        let controllers = rivet_common::controller::Controllers::new();
        let backend = Arc::new(EtcdBackend::connect(opts, &controllers).await.unwrap());
        let cache = IpCache::new(backend.clone(), IpCacheOptions::new("n1"));
        let controllers = rivet_common::controller::Controllers::new();
        cache.run(&controllers);
        cache.wait_ready().await;
        let service = IpcacheService::new(cache.clone(), BootId::random());
        let kept = entry("198.18.3.1", 300, pb::IpcacheSource::LocalEndpoint);
        let gone = entry("198.18.3.9", 300, pb::IpcacheSource::LocalEndpoint);
        upsert(&service, vec![kept.clone(), gone]).await.unwrap();
        assert_eq!(cache.pending_writes(), 0, "published while the store answers");
        etcd.stop();

        let local = entry("198.18.3.2", 301, pb::IpcacheSource::LocalEndpoint);
        let k8s = entry("198.18.3.3", 302, pb::IpcacheSource::Kubernetes);
        let started = tokio::time::Instant::now();
        let r = upsert(&service, vec![k8s, local]).await.expect("local first");
        assert_eq!(r.changed, 2);
        let deleted = service
            .delete_ip(Request::new(pb::DeleteIpRequest {
                prefixes: vec![wire::prefix("198.18.3.9")],
                source: pb::IpcacheSource::LocalEndpoint as i32,
            }))
            .await
            .expect("a delete is local first too")
            .into_inner();
        assert_eq!(deleted.deleted, 1);
        let took = started.elapsed();
        assert!(took < Duration::from_secs(1), "no wait on the store: {took:?}");
        let view: Vec<(String, u32)> = cache
            .list()
            .iter()
            .filter(|e| e.source != IpcacheSource::Reserved)
            .map(|e| (prefix_text(&e.prefix), e.identity))
            .collect();
        assert_eq!(
            view,
            [
                ("198.18.3.1/32".to_string(), 300),
                ("198.18.3.2/32".to_string(), 301),
                ("198.18.3.3/32".to_string(), 302)
            ],
            "the view changed at once"
        );
        assert_eq!(cache.pending_writes(), 2, "one entry to publish, one to withdraw");

        etcd.restart().expect("restarting etcd");
        let deadline = tokio::time::Instant::now() + WAIT;
        while cache.pending_writes() != 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "not reconciled after etcd came back"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (stored, _) = backend.list_ips().await.expect("etcd answers");
        let stored: Vec<&str> = stored.iter().map(|e| e.ip.as_str()).collect();
        assert_eq!(
            stored,
            ["198.18.3.1", "198.18.3.2"],
            "the store holds this node's local entries as they are now (KUBERNETES is node-local)"
        );
        upsert(&service, vec![kept]).await.unwrap();
        assert_eq!(cache.pending_writes(), 0, "a replay changes nothing");
    }

    #[tokio::test]
    async fn list_pages_in_prefix_order_and_filters_by_effective_source() {
        let dir = tempfile::tempdir().unwrap();
        let (_cache, service) = embedded(&dir, 64).await;
        let mut batch: Vec<pb::IpcacheEntry> = (0..25)
            .rev()
            .map(|i| entry(&format!("198.18.4.{i}"), 400 + i, pb::IpcacheSource::Kubernetes))
            .collect();
        batch.push(entry("2001:2::/64", 500, pb::IpcacheSource::Kubernetes));
        upsert(&service, batch).await.unwrap();
        let page = |source: pb::IpcacheSource, page_size: u32, start_after: Option<IpPrefix>| {
            service.list_ipcache(Request::new(pb::ListIpcacheRequest {
                source: source as i32,
                page_size,
                start_after,
            }))
        };
        let mut all = Vec::new();
        let mut after = None;
        loop {
            let r = page(pb::IpcacheSource::Unspecified, 10, after)
                .await
                .unwrap()
                .into_inner();
            assert!(r.entries.len() <= 10);
            after = r.entries.last().and_then(|e| e.prefix.clone());
            all.extend(r.entries);
            if r.complete {
                break;
            }
        }
        let prefixes: Vec<IpNet> = all
            .iter()
            .map(|e| net::prefix_from_proto(e.prefix.as_ref().unwrap()).unwrap())
            .collect();
        assert_eq!(prefixes.len(), 28, "25 + one IPv6 + two reserved");
        assert!(prefixes.is_sorted(), "prefix order: {prefixes:?}");
        assert_eq!(all[0].prefix, Some(wire::prefix("0.0.0.0/0")));
        assert_eq!(all[1].prefix, Some(wire::prefix("198.18.4.0/32")));
        let reserved = page(pb::IpcacheSource::Reserved, 0, None).await.unwrap().into_inner();
        let names: Vec<String> = reserved
            .entries
            .iter()
            .map(|e| wire::text(e.prefix.as_ref().unwrap()))
            .collect();
        assert_eq!(names, ["0.0.0.0/0", "::/0"]);
        assert!(reserved.entries.iter().all(|e| e.identity == 2));
        let s = page(pb::IpcacheSource::Unspecified, 10001, None).await.unwrap_err();
        assert!(s.message().starts_with("page_size: "), "{s:?}");
        let s = page(pb::IpcacheSource::Unspecified, 0, Some(wire::prefix("198.18.4.1/24")))
            .await
            .unwrap_err();
        assert!(s.message().starts_with("start_after: "), "{s:?}");
    }

    /// What a watcher reconstructs; returns the number of snapshots seen.
    struct Client {
        view: BTreeMap<String, pb::IpcacheEntry>,
        pending: BTreeMap<String, pb::IpcacheEntry>,
        snapshots: usize,
        revision: u64,
        stream: WatchStream,
    }

    impl Client {
        async fn start(service: &IpcacheService, sources: Vec<pb::IpcacheSource>) -> Self {
            let stream = service
                .watch_ipcache(Request::new(pb::WatchIpcacheRequest {
                    sources: sources.into_iter().map(|s| s as i32).collect(),
                }))
                .await
                .unwrap()
                .into_inner();
            let mut client = Self {
                view: BTreeMap::new(),
                pending: BTreeMap::new(),
                snapshots: 0,
                revision: 0,
                stream,
            };
            client.until(|c| c.snapshots == 1).await;
            client
        }

        fn apply(&mut self, m: pb::WatchIpcacheResponse) {
            assert!(!m.boot_id.is_empty(), "every message names the server");
            if m.snapshot {
                self.pending.extend(m.upserted.into_iter().map(|e| (key(&e), e)));
                if m.snapshot_complete {
                    self.view = std::mem::take(&mut self.pending);
                    self.snapshots += 1;
                    self.revision = m.revision;
                }
                return;
            }
            assert!(m.revision > self.revision, "delta revisions increase");
            self.revision = m.revision;
            for e in m.upserted {
                self.view.insert(key(&e), e);
            }
            for p in m.deleted.iter().map(wire::text) {
                assert!(
                    self.view.remove(&p).is_some(),
                    "a deletion of {p} the watcher never had"
                );
            }
        }

        async fn until(&mut self, pred: impl Fn(&Self) -> bool) {
            let deadline = tokio::time::Instant::now() + WAIT;
            while !pred(self) {
                let m = tokio::time::timeout_at(deadline, self.stream.next())
                    .await
                    .expect("timed out reading the watch stream")
                    .expect("the stream stays open")
                    .expect("no error");
                self.apply(m);
            }
        }

        fn entries(&self) -> Vec<pb::IpcacheEntry> {
            self.view.values().cloned().collect()
        }
    }

    fn proto_list(cache: &IpCache, source: Option<IpcacheSource>) -> Vec<pb::IpcacheEntry> {
        let mut out: Vec<pb::IpcacheEntry> = cache
            .list()
            .iter()
            .filter(|e| source.is_none_or(|s| e.source == s))
            .map(IpcacheEntry::to_proto)
            .collect();
        out.sort_by_key(key);
        out
    }

    /// An entry's prefix as text: the order a watcher's view is kept in.
    fn key(e: &pb::IpcacheEntry) -> String {
        wire::text(e.prefix.as_ref().expect("every entry has its prefix"))
    }

    #[tokio::test]
    async fn watch_streams_snapshot_then_deltas_and_a_lagging_watcher_gets_a_fresh_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let (cache, service) = embedded(&dir, 4).await;
        let mut client = Client::start(&service, vec![]).await;
        assert_eq!(client.entries(), proto_list(&cache, None));

        // One change: one delta.
        upsert(&service, vec![entry("198.18.7.1", 300, pb::IpcacheSource::Kubernetes)])
            .await
            .unwrap();
        client.until(|c| c.view.contains_key("198.18.7.1/32")).await;
        assert_eq!(client.snapshots, 1);

        // Far more changes than the channel holds, before the watcher runs
        // (this runtime has one thread and nothing here yields).
        for i in 2..60u32 {
            cache
                .upsert(vec![IpcacheEntry::new(
                    parse_prefix(&format!("198.18.7.{i}")).unwrap(),
                    300 + i,
                    IpcacheSource::Kubernetes,
                )])
                .await
                .unwrap();
        }
        cache
            .delete(IpcacheSource::Kubernetes, &[parse_prefix("198.18.7.1").unwrap()])
            .await
            .unwrap();
        let want = proto_list(&cache, None);
        client.until(|c| c.entries() == want).await;
        assert!(
            client.snapshots >= 2,
            "the lagging watcher started over with a snapshot"
        );
        assert_eq!(client.revision, cache.revision());
    }

    #[tokio::test]
    async fn a_filtered_watch_hears_an_entry_leaving_its_sources_as_a_deletion() {
        let dir = tempfile::tempdir().unwrap();
        let (cache, service) = embedded(&dir, 64).await;
        let mut client = Client::start(&service, vec![pb::IpcacheSource::Kubernetes]).await;
        assert!(client.view.is_empty(), "no KUBERNETES entry yet: {:?}", client.view);

        upsert(&service, vec![entry("198.18.8.1", 400, pb::IpcacheSource::Kubernetes)])
            .await
            .unwrap();
        client.until(|c| c.view.contains_key("198.18.8.1/32")).await;
        // A local endpoint takes the address over: effective LOCAL_ENDPOINT.
        upsert(
            &service,
            vec![entry("198.18.8.1", 300, pb::IpcacheSource::LocalEndpoint)],
        )
        .await
        .unwrap();
        client.until(|c| c.view.is_empty()).await;
        // It goes: the KUBERNETES claim is effective again.
        service
            .delete_ip(Request::new(pb::DeleteIpRequest {
                prefixes: vec![wire::prefix("198.18.8.1")],
                source: pb::IpcacheSource::LocalEndpoint as i32,
            }))
            .await
            .unwrap();
        client
            .until(|c| c.view.get("198.18.8.1/32").is_some_and(|e| e.identity == 400))
            .await;
        assert_eq!(client.entries(), proto_list(&cache, Some(IpcacheSource::Kubernetes)));

        let s = service
            .watch_ipcache(Request::new(pb::WatchIpcacheRequest { sources: vec![0] }))
            .await
            .err()
            .expect("UNSPECIFIED is no filter value");
        assert!(s.message().starts_with("sources[0]: "), "{s:?}");
    }
}
