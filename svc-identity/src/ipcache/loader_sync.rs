//! [`LoaderSync`] pushes the effective view to svc-loader: a full
//! `ReplaceIpcache` on connect and whenever the loader's boot id changes
//! (noticed on every response and by a `GetInfo` probe while idle), then
//! coalesced `UpsertIpcache`/`DeleteIpcache` batches. It waits for the first
//! listing of the store, or a view restored from the local snapshot
//! ([`IpCache::restore`], [`crate::snapshot`]), before its first full sync:
//! replacing the loader's ipcache with a view lacking the other nodes'
//! entries would cut the traffic to them, while waiting only delays changes.
//! With a routing mode it also waits for the node registry's first listing
//! (the peers' addresses as remote-node), unless the view came from the
//! snapshot, which holds them.
//!
//! With a routing mode (multi-node), the same session pushes the complete set
//! of peer nodes from the registry ([`LoaderSyncOptions::peers`]) with
//! `NodeRoutingService.ReplaceNodes`: after every full sync (so again on
//! each new loader boot id) and whenever the set changes, never before the
//! registry's first listing (an empty set would remove the loader's routes).
//! A loader without a routing mode answers ROUTING_DISABLED: logged, and not
//! asked again until the set changes or the loader restarts.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ipnet::IpNet;
use rivet_common::backoff::Backoff;
use rivet_common::controller::{Controller, Controllers, Progress};
use rivet_common::grpc::{BootIdWatch, ClientOptions, DaemonChannel, connect_unix};
use rivet_common::telemetry::TraceLink;
use rivet_proto::daemon::v1::{GetInfoRequest, daemon_client::DaemonClient};
use rivet_proto::identity::v1 as pb;
use rivet_proto::loader::v1 as loader_pb;
use rivet_proto::loader::v1::loader_service_client::LoaderServiceClient;
use rivet_proto::loader::v1::node_routing_service_client::NodeRoutingServiceClient;
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;
use tracing::Instrument as _;

use super::{IpCache, IpcacheDelta, IpcacheEntry, IpcacheSource};
use crate::registry::PeerNodes;

/// Most entries svc-loader takes in one ipcache call.
pub const LOADER_MAX_BATCH: usize = 4096;

/// How [`LoaderSync`] reaches svc-loader.
#[derive(Debug, Clone)]
pub struct LoaderSyncOptions {
    /// svc-loader's socket.
    pub socket: PathBuf,
    /// Connect and per-call timeouts.
    pub client: ClientOptions,
    /// Delays between failed sessions.
    pub retry: Backoff,
    /// How often an idle session asks the loader who it is, to notice a
    /// restart (and resync) when no change is pushed.
    pub probe_interval: Duration,
    /// Entries per call (at most [`LOADER_MAX_BATCH`]).
    pub batch_size: usize,
    /// The peer nodes to push (`None` inside: not listed yet); `None`: a
    /// single node, nothing pushed
    /// ([`NodeRegistry::peer_nodes`](crate::registry::NodeRegistry::peer_nodes)).
    pub peers: Option<watch::Receiver<Option<PeerNodes>>>,
}

impl LoaderSyncOptions {
    /// Defaults for `socket`: probe every second, batches of 4096.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            client: ClientOptions::default(),
            retry: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)),
            probe_interval: Duration::from_secs(1),
            batch_size: LOADER_MAX_BATCH,
            peers: None,
        }
    }
}

/// The state of the push to svc-loader (`GetStatus`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoaderSyncStatus {
    /// A session is up (the last call succeeded).
    pub connected: bool,
    /// svc-loader's boot id at the last full sync.
    pub loader_boot_id: String,
    /// When the last full sync completed.
    pub last_full_sync: Option<SystemTime>,
    /// Full syncs done since start.
    pub full_syncs: u64,
    /// Changes of the effective view not yet pushed (every entry before the
    /// first full sync).
    pub pending: u32,
    /// The latest error; empty once a session is up again.
    pub last_error: String,
}

impl LoaderSyncStatus {
    /// The protobuf message.
    pub fn to_proto(&self) -> pb::LoaderSyncStatus {
        pb::LoaderSyncStatus {
            connected: self.connected,
            loader_boot_id: self.loader_boot_id.clone(),
            last_full_sync_unix_nanos: self
                .last_full_sync
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
            pending: self.pending,
            last_error: self.last_error.clone(),
        }
    }
}

/// Why a session with the loader ended.
#[derive(Debug, thiserror::Error)]
enum SyncError {
    #[error("{0}")]
    Connect(#[from] rivet_common::grpc::ConnectError),
    #[error("{action}: svc-loader answered {:?}: {source}", source.code())]
    Call {
        action: &'static str,
        source: rivet_common::grpc::RpcError<rivet_proto::loader::v1::ErrorReason>,
    },
}

fn call_error(action: &'static str) -> impl FnOnce(tonic::Status) -> SyncError {
    move |s| SyncError::Call {
        action,
        source: s.into(),
    }
}

/// Pushes an [`IpCache`]'s effective view to svc-loader; see the module docs.
pub struct LoaderSync {
    ipcache: Arc<IpCache>,
    opts: LoaderSyncOptions,
    status: Mutex<LoaderSyncStatus>,
    /// The cache revision the loader holds.
    pushed: watch::Sender<u64>,
}

impl std::fmt::Debug for LoaderSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoaderSync")
            .field("opts", &self.opts)
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

impl LoaderSync {
    /// A sync of `ipcache` to the loader at `opts.socket`; call
    /// [`run`](Self::run).
    pub fn new(ipcache: Arc<IpCache>, opts: LoaderSyncOptions) -> Arc<Self> {
        let (pushed, _) = watch::channel(0);
        Arc::new(Self {
            ipcache,
            opts,
            status: Mutex::new(LoaderSyncStatus::default()),
            pushed,
        })
    }

    /// Starts pushing (`ipcache-loader-sync`) under `controllers`: a
    /// session that fails is started again with [`LoaderSyncOptions::retry`]'s
    /// backoff.
    pub fn run(self: &Arc<Self>, controllers: &Controllers) {
        let this = self.clone();
        let controller = Controller::new("ipcache-loader-sync").backoff(self.opts.retry.clone());
        controllers.supervise(controller, move |progress| this.clone().sync(progress));
    }

    fn lock(&self) -> MutexGuard<'_, LoaderSyncStatus> {
        self.status.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state of the push.
    pub fn status(&self) -> LoaderSyncStatus {
        let mut status = self.lock().clone();
        status.pending = if status.full_syncs == 0 {
            self.ipcache.len() as u32
        } else {
            self.ipcache.revision().saturating_sub(*self.pushed.borrow()) as u32
        };
        status
    }

    /// The cache revision the loader holds.
    pub fn pushed_revision(&self) -> u64 {
        *self.pushed.borrow()
    }

    /// Waits until the loader holds the cache at `revision` or later
    /// (e.g. [`IpCache::revision`] after a change), or `timeout` passes;
    /// returns whether it does.
    pub async fn wait_pushed(&self, revision: u64, timeout: Duration) -> bool {
        let mut rx = self.pushed.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|r| *r >= revision))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// The loader's form of an effective entry: identity, and the host as
    /// tunnel endpoint for another node's IPv4 host (the loader's underlay
    /// is IPv4 only).
    pub fn loader_entry(&self, e: &IpcacheEntry) -> loader_pb::IpcacheEntry {
        let tunnel = match (e.source, e.host_ip) {
            (IpcacheSource::KvStore | IpcacheSource::Kubernetes, Some(IpAddr::V4(host)))
                if self.ipcache.opts.host_ip != Some(IpAddr::V4(host)) && !host.is_unspecified() =>
            {
                rivet_proto::net::address_bytes(IpAddr::V4(host))
            }
            _ => Vec::new(),
        };
        loader_pb::IpcacheEntry {
            prefix: Some(rivet_proto::net::prefix_to_proto(e.prefix)),
            identity: e.identity,
            tunnel_endpoint: tunnel,
        }
    }

    /// One session with svc-loader, its error kept for the status; its
    /// controller starts the next one.
    async fn sync(self: Arc<Self>, progress: Progress) -> Result<(), SyncError> {
        self.ipcache.wait_ready().await;
        // Nor before the peers' addresses are remote-node: a view without
        // them would make the loader drop their tunnel traffic.
        if let Some(peers) = &self.opts.peers
            && !self.ipcache.restored_from_snapshot()
        {
            let _ = peers.clone().wait_for(Option::is_some).await;
        }
        let result = self.session(&progress).await;
        if let Err(error) = &result {
            let mut status = self.lock();
            status.connected = false;
            status.last_error = error.to_string();
        }
        result
    }

    /// Connect, full sync, then deltas until something fails. `Ok` only
    /// when the cache is gone.
    async fn session(&self, progress: &Progress) -> Result<(), SyncError> {
        let channel = connect_unix(&self.opts.socket, &self.opts.client).await?;
        let mut loader = LoaderServiceClient::new(channel.clone());
        let mut routing = NodeRoutingServiceClient::new(channel.clone());
        let mut daemon = DaemonClient::new(channel);
        let restarted = Arc::new(AtomicBool::new(false));
        let flag = restarted.clone();
        let boot = BootIdWatch::new("svc-loader", move |_| flag.store(true, Ordering::SeqCst));
        let mut peers = self.opts.peers.clone();
        let mut deltas = self.full_sync(&mut loader, &boot, &restarted).await?;
        self.push_peers(&mut routing, &boot, peers.as_mut()).await?;
        progress.ok();
        let mut probe = tokio::time::interval(self.opts.probe_interval);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        probe.tick().await;
        loop {
            if restarted.load(Ordering::SeqCst) {
                deltas = self.full_sync(&mut loader, &boot, &restarted).await?;
                self.push_peers(&mut routing, &boot, peers.as_mut()).await?;
                continue;
            }
            tokio::select! {
                () = peers_changed(peers.as_mut()) => {
                    self.push_peers(&mut routing, &boot, peers.as_mut()).await?;
                }
                first = deltas.recv() => {
                    let mut batch: BTreeMap<IpNet, Option<IpcacheEntry>> = BTreeMap::new();
                    let mut causes: Vec<TraceLink> = Vec::new();
                    let mut revision = 0;
                    let mut lagged = false;
                    let mut next = first;
                    loop {
                        match next {
                            Ok(d) => {
                                revision = d.revision;
                                batch.insert(d.prefix, d.entry);
                                if let Some(cause) = d.cause
                                    && !causes.contains(&cause)
                                {
                                    causes.push(cause);
                                }
                            }
                            Err(broadcast::error::RecvError::Lagged(n)) => {
                                tracing::info!(missed = n, "the loader push fell behind the ipcache; full resync");
                                lagged = true;
                                break;
                            }
                            Err(broadcast::error::RecvError::Closed) => return Ok(()),
                        }
                        next = match deltas.try_recv() {
                            Ok(d) => Ok(d),
                            Err(broadcast::error::TryRecvError::Empty) => break,
                            Err(broadcast::error::TryRecvError::Lagged(n)) => Err(broadcast::error::RecvError::Lagged(n)),
                            Err(broadcast::error::TryRecvError::Closed) => Err(broadcast::error::RecvError::Closed),
                        };
                    }
                    if lagged {
                        deltas = self.full_sync(&mut loader, &boot, &restarted).await?;
                        self.push_peers(&mut routing, &boot, peers.as_mut()).await?;
                        continue;
                    }
                    self.push(&mut loader, &boot, batch, &causes).await?;
                    self.pushed.send_replace(revision);
                }
                _ = probe.tick() => {
                    let info = daemon
                        .get_info(GetInfoRequest {})
                        .await
                        .map_err(call_error("asking svc-loader who it is"))?
                        .into_inner();
                    boot.observe_message(&info);
                }
            }
        }
    }

    /// Replaces the loader's peer nodes with the registry's set (once it is
    /// listed; nothing for a single node).
    async fn push_peers(
        &self,
        routing: &mut NodeRoutingServiceClient<DaemonChannel>,
        boot: &BootIdWatch,
        peers: Option<&mut watch::Receiver<Option<PeerNodes>>>,
    ) -> Result<(), SyncError> {
        let Some(nodes) = peers.and_then(|p| p.borrow_and_update().clone()) else {
            return Ok(());
        };
        let request = loader_pb::ReplaceNodesRequest {
            nodes: nodes.as_ref().clone(),
        };
        match routing.replace_nodes(request).await {
            Ok(response) => {
                let response = response.into_inner();
                boot.observe(&response.boot_id);
                tracing::info!(
                    peers = nodes.len(),
                    routes_added = response.routes_added,
                    routes_removed = response.routes_removed,
                    routes_unchanged = response.routes_unchanged,
                    loader_boot_id = %response.boot_id,
                    "peer nodes pushed to svc-loader"
                );
                Ok(())
            }
            Err(status) => {
                let error: rivet_common::grpc::RpcError<loader_pb::ErrorReason> = status.into();
                if error.reason() == Some(loader_pb::ErrorReason::RoutingDisabled) {
                    tracing::warn!(
                        peers = nodes.len(),
                        "svc-loader runs without a routing mode (--routing-mode none) while svc-identity has one: peer nodes not pushed"
                    );
                    return Ok(());
                }
                // A refused set must not stop the ipcache push: kept until
                // the set changes (the registry leaves out what the loader
                // refuses, so this is a disagreement on the rules).
                if error.code() == tonic::Code::InvalidArgument {
                    tracing::warn!(
                        peers = nodes.len(),
                        error = error.message(),
                        "svc-loader refused the peer node set; its routes stay as they were"
                    );
                    return Ok(());
                }
                Err(SyncError::Call {
                    action: "replacing svc-loader's peer nodes",
                    source: error,
                })
            }
        }
    }

    /// Replaces the loader's ipcache with the effective view; returns the
    /// receiver of the deltas after it.
    async fn full_sync(
        &self,
        loader: &mut LoaderServiceClient<DaemonChannel>,
        boot: &BootIdWatch,
        restarted: &AtomicBool,
    ) -> Result<broadcast::Receiver<IpcacheDelta>, SyncError> {
        let started = Instant::now();
        let (snapshot, revision, deltas) = self.ipcache.subscribe();
        let entries: Vec<loader_pb::IpcacheEntry> = snapshot.iter().map(|e| self.loader_entry(e)).collect();
        let chunks: Vec<loader_pb::ReplaceIpcacheRequest> = entries
            .chunks(self.batch_size())
            .map(|c| loader_pb::ReplaceIpcacheRequest { entries: c.to_vec() })
            .collect();
        let response = loader
            .replace_ipcache(tokio_stream::iter(chunks))
            .await
            .map_err(call_error("replacing svc-loader's ipcache"))?
            .into_inner();
        // Whatever restart this response reveals, this sync covered it.
        boot.observe_message(&response);
        restarted.store(false, Ordering::SeqCst);
        {
            let mut status = self.lock();
            status.connected = true;
            status.loader_boot_id.clone_from(&response.boot_id);
            status.last_full_sync = Some(SystemTime::now());
            status.full_syncs += 1;
            status.last_error.clear();
        }
        self.pushed.send_replace(revision);
        tracing::info!(
            entries = entries.len(),
            upserted = response.upserted,
            unchanged = response.unchanged,
            deleted = response.deleted,
            loader_boot_id = %response.boot_id,
            revision,
            elapsed = ?started.elapsed(),
            "ipcache fully synced to svc-loader"
        );
        Ok(deltas)
    }

    /// Pushes coalesced changes: upserts, then deletes, in batches, in an
    /// `ipcache.push` trace of its own that links to the requests that
    /// caused them (`causes`): a pod's trace then shows when its addresses
    /// reached the datapath.
    async fn push(
        &self,
        loader: &mut LoaderServiceClient<DaemonChannel>,
        boot: &BootIdWatch,
        batch: BTreeMap<IpNet, Option<IpcacheEntry>>,
        causes: &[TraceLink],
    ) -> Result<(), SyncError> {
        let mut upserts = Vec::new();
        let mut deletes = Vec::new();
        for (prefix, entry) in batch {
            match entry {
                Some(e) => upserts.push(self.loader_entry(&e)),
                None => deletes.push(rivet_proto::net::prefix_to_proto(prefix)),
            }
        }
        let (upserted, deleted) = (upserts.len(), deletes.len());
        let span = tracing::info_span!(parent: None, "ipcache.push", upserted, deleted, causes = causes.len());
        for cause in causes {
            cause.link_from(&span);
        }
        self.push_entries(loader, boot, upserts, deletes).instrument(span).await
    }

    /// The calls of [`push`](Self::push).
    async fn push_entries(
        &self,
        loader: &mut LoaderServiceClient<DaemonChannel>,
        boot: &BootIdWatch,
        upserts: Vec<loader_pb::IpcacheEntry>,
        deletes: Vec<rivet_proto::net::v1::IpPrefix>,
    ) -> Result<(), SyncError> {
        let (upserted, deleted) = (upserts.len(), deletes.len());
        for chunk in upserts.chunks(self.batch_size()) {
            let r = loader
                .upsert_ipcache(loader_pb::UpsertIpcacheRequest {
                    entries: chunk.to_vec(),
                })
                .await
                .map_err(call_error("upserting svc-loader's ipcache entries"))?
                .into_inner();
            boot.observe_message(&r);
        }
        for chunk in deletes.chunks(self.batch_size()) {
            let r = loader
                .delete_ipcache(loader_pb::DeleteIpcacheRequest {
                    prefixes: chunk.to_vec(),
                })
                .await
                .map_err(call_error("deleting svc-loader's ipcache entries"))?
                .into_inner();
            boot.observe_message(&r);
        }
        tracing::debug!(upserted, deleted, "ipcache changes pushed to svc-loader");
        Ok(())
    }

    fn batch_size(&self) -> usize {
        self.opts.batch_size.clamp(1, LOADER_MAX_BATCH)
    }
}

/// Completes when the peer set changed; never without one (or once its
/// registry is gone).
async fn peers_changed(peers: Option<&mut watch::Receiver<Option<PeerNodes>>>) {
    if let Some(rx) = peers
        && rx.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}
