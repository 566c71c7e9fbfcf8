//! The local snapshot: what svc-identity needs to serve while etcd is
//! unreachable, kept in one crash-safe file (`rivet_common::state_file`:
//! tmp + fsync + rename) beside its other state, so a restart during an
//! outage (a node reboot, a kill -9 and the supervisor's restart) serves
//! at once instead of waiting for etcd.
//!
//! # What it holds, and why
//!
//! - the identity cache (every master key learned from etcd, and the
//!   identities held here) with the store revision of its last listing:
//!   `AllocateIdentity` of a known set, `WatchIdentities` and
//!   `ListIdentities` are served from it;
//! - the label sets this node released whose value key may still be in the
//!   store: deleted when etcd is back, not after the restore grace;
//! - the IP cache: other nodes' entries (KVSTORE claims), this node's
//!   LOCAL_ENDPOINT claims, and this node's entries as the store held them:
//!   the push to svc-loader starts from it (a full `ReplaceIpcache` without
//!   the other nodes' entries would cut the traffic to them), and entries
//!   withdrawn here but still in the store are withdrawn when it is back.
//!
//! - the owners of the references held here, by label set: not served
//!   (clients replay their references when they see the new boot id), but
//!   what tells whose `EndReplay` releases a value key of the previous run
//!   nobody claimed again.
//!
//! Not held: the local references themselves (value keys of a previous run
//! nobody claims again go when their clients end their replay, or after the
//! restore grace), CIDR identities and KUBERNETES claims (node-local,
//! replayed by their owners).
//!
//! # When it is read and written
//!
//! Only with etcd (the embedded store is local already). Loaded once at
//! start, before anything is served: the snapshot's view is served, marked
//! as not in sync (`GetStatus` `connected: false`), until the first listing
//! of the store replaces it: identities and other nodes' entries the store
//! no longer has go then (no stale entry is resurrected). Written by
//! [`SnapshotWriter`]: after changes, coalesced over
//! [`SnapshotOptions::min_interval`], gathered and written on the blocking
//! pool (never on a request's path nor an async worker), retried with backoff when the write fails; and once
//! more at a clean stop. A snapshot of another node, key prefix or cluster
//! is ignored.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rivet_common::backoff::Backoff;
use rivet_common::controller::{Action, Controller, Controllers, Trigger};
use rivet_common::state_file::{StateFile, StateFileError};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::allocator::IdentityAllocator;
use crate::backend::{IdentityRecord, IpEntry, Revision};
use crate::events::{self, IdentityMetrics};
use crate::ipcache::IpCache;

/// The state file's kind.
pub const SNAPSHOT_KIND: &str = "svc-identity-snapshot";
/// The state file's schema version.
pub const SNAPSHOT_SCHEMA_VERSION: u32 = 1;
/// The file name under `<state-dir>/identity/`.
pub const SNAPSHOT_FILE_NAME: &str = "etcd-snapshot.json";

/// What a component's part of the snapshot changes with: a generation
/// bumped by every change of it (what wakes the [`SnapshotWriter`]) and the
/// store revision of the component's last listing (or of the restored
/// snapshot until then).
#[derive(Debug)]
pub struct SnapshotPart {
    generation: watch::Sender<u64>,
    store_revision: AtomicI64,
}

impl Default for SnapshotPart {
    fn default() -> Self {
        Self {
            generation: watch::channel(0).0,
            store_revision: AtomicI64::new(0),
        }
    }
}

impl SnapshotPart {
    /// Notes a change of the part.
    pub fn changed(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    /// Changes whenever the part changed.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// The store revision of the last listing; 0 before any.
    pub fn store_revision(&self) -> Revision {
        self.store_revision.load(Ordering::Acquire)
    }

    /// Records the store revision of a listing (or a restored snapshot's).
    pub fn set_store_revision(&self, revision: Revision) {
        self.store_revision.store(revision, Ordering::Release);
    }
}

/// The allocator's part of the snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentitySnapshot {
    /// The store revision of the listing the cache was last built from (0:
    /// never listed).
    pub store_revision: Revision,
    /// Every identity of the cache.
    pub identities: Vec<IdentityRecord>,
    /// Label sets released here whose value key of this node the store may
    /// still hold.
    pub released: Vec<String>,
    /// Label sets held here → the owners of their references (`""` for
    /// anonymous ones): whose client's `EndReplay` releases a value key a
    /// restart finds unclaimed (absent in older snapshots).
    #[serde(default)]
    pub held: Option<BTreeMap<String, Vec<String>>>,
}

/// The IP cache's part of the snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcacheSnapshot {
    /// The store revision of the last listing (0: never listed).
    pub store_revision: Revision,
    /// Other nodes' entries (KVSTORE claims).
    pub remote: Vec<IpEntry>,
    /// This node's LOCAL_ENDPOINT claims, in store form.
    pub local: Vec<IpEntry>,
    /// This node's entries as the store held them.
    pub published: Vec<IpEntry>,
    /// Other nodes' underlay addresses (NODE claims → remote-node) with
    /// their node, so that a restart during an outage keeps accepting the
    /// peers' tunnel traffic (absent in older snapshots).
    #[serde(default)]
    pub nodes: Vec<(std::net::IpAddr, String)>,
}

/// The whole snapshot of one node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// The node it was written by.
    pub node: String,
    /// The store's key prefix.
    pub prefix: String,
    /// The cluster of the IP cache keys.
    pub cluster: String,
    /// When it was written, milliseconds since the epoch.
    pub written_unix_millis: u64,
    /// The identity cache.
    pub identities: IdentitySnapshot,
    /// The IP cache.
    pub ipcache: IpcacheSnapshot,
}

impl Snapshot {
    /// How long ago it was written (`None` when the clock went back).
    pub fn age(&self) -> Option<Duration> {
        let written = UNIX_EPOCH + Duration::from_millis(self.written_unix_millis);
        SystemTime::now().duration_since(written).ok()
    }
}

/// Where the snapshot lives and whose it is.
#[derive(Debug, Clone)]
pub struct SnapshotOptions {
    /// The file (`<state-dir>/identity/etcd-snapshot.json`).
    pub path: PathBuf,
    /// This node.
    pub node: String,
    /// The store's key prefix.
    pub prefix: String,
    /// The cluster.
    pub cluster: String,
    /// Changes within this interval go into one write.
    pub min_interval: Duration,
}

impl SnapshotOptions {
    /// Defaults for `path` and the keyspace: writes at most every 500 ms.
    pub fn new(path: impl Into<PathBuf>, node: &str, prefix: &str, cluster: &str) -> Self {
        Self {
            path: path.into(),
            node: node.to_string(),
            prefix: prefix.to_string(),
            cluster: cluster.to_string(),
            min_interval: Duration::from_millis(500),
        }
    }

    fn file(&self) -> StateFile<Snapshot> {
        StateFile::new(self.path.clone(), SNAPSHOT_KIND, SNAPSHOT_SCHEMA_VERSION)
    }

    /// Whether `s` was written for this node and keyspace.
    fn mismatch(&self, s: &Snapshot) -> Option<String> {
        let ours = (self.node.as_str(), self.prefix.as_str(), self.cluster.as_str());
        let theirs = (s.node.as_str(), s.prefix.as_str(), s.cluster.as_str());
        (ours != theirs).then(|| {
            format!(
                "{} was written for node {:?}, prefix {:?}, cluster {:?}; this is node {:?}, prefix {:?}, cluster {:?}",
                self.path.display(),
                theirs.0,
                theirs.1,
                theirs.2,
                ours.0,
                ours.1,
                ours.2
            )
        })
    }
}

/// Reads the snapshot at start (blocking; before the runtime serves):
/// `None` when there is none or it cannot be used (each case an event).
pub fn load(opts: &SnapshotOptions, metrics: &IdentityMetrics) -> Option<Snapshot> {
    match opts.file().load() {
        Ok(None) => {
            events::snapshot_missing(metrics, &opts.path);
            None
        }
        Err(e) => {
            events::snapshot_unusable(metrics, &e);
            None
        }
        Ok(Some(s)) => {
            if let Some(reason) = opts.mismatch(&s) {
                events::snapshot_unusable(metrics, &reason);
                return None;
            }
            events::snapshot_loaded(
                metrics,
                s.identities.identities.len(),
                s.ipcache.remote.len() + s.ipcache.local.len(),
                s.age(),
            );
            Some(s)
        }
    }
}

/// Restores the allocator and the IP cache from `snapshot`; call before
/// their `run`.
pub fn restore(snapshot: Snapshot, allocator: &IdentityAllocator, ipcache: &IpCache) {
    let age = snapshot
        .age()
        .map_or_else(|| "an unknown time".to_string(), |a| format!("{}s", a.as_secs()));
    let origin = format!(
        "the kvstore has not been listed since this process started; serving the local snapshot written {age} ago"
    );
    allocator.restore(snapshot.identities, &origin);
    ipcache.restore(snapshot.ipcache);
}

/// Writes the snapshot after changes; see the module docs.
pub struct SnapshotWriter {
    allocator: Arc<IdentityAllocator>,
    ipcache: Arc<IpCache>,
    opts: SnapshotOptions,
    metrics: IdentityMetrics,
    /// Held while a snapshot is gathered and written: a write that outlived
    /// its aborted task never runs beside another one (they share the temp
    /// file), and the last write holds the newest state.
    file: std::sync::Mutex<StateFile<Snapshot>>,
}

impl std::fmt::Debug for SnapshotWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotWriter")
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl SnapshotWriter {
    /// A writer of `allocator`'s and `ipcache`'s state; call
    /// [`run`](Self::run).
    pub fn new(
        allocator: Arc<IdentityAllocator>,
        ipcache: Arc<IpCache>,
        opts: SnapshotOptions,
        metrics: IdentityMetrics,
    ) -> Arc<Self> {
        Arc::new(Self {
            allocator,
            ipcache,
            file: std::sync::Mutex::new(opts.file()),
            opts,
            metrics,
        })
    }

    /// Writes after every change of the allocator's or the IP cache's state
    /// (`snapshot-writer`; changes within [`SnapshotOptions::min_interval`]
    /// share one write; a failed write is retried with backoff), woken by
    /// `snapshot-changes`, under `controllers`.
    pub fn run(self: &Arc<Self>, controllers: &Controllers) {
        let trigger = Trigger::new();
        let retry = Backoff::new(
            self.opts.min_interval.max(Duration::from_millis(100)),
            Duration::from_secs(30),
        );
        let this = self.clone();
        // What the restore loaded is the file already: no write before a change.
        let mut changed = false;
        controllers.reconcile(
            Controller::new("snapshot-writer").trigger(&trigger).backoff(retry),
            move || {
                let (this, write) = (this.clone(), std::mem::replace(&mut changed, true));
                async move {
                    if write {
                        // Whatever changes meanwhile goes into this write.
                        tokio::time::sleep(this.opts.min_interval).await;
                        this.write()
                            .await
                            .inspect_err(|e| events::snapshot_write_failed(&this.metrics, e))?;
                    }
                    Ok::<_, SnapshotError>(Action::await_change())
                }
            },
        );
        let this = self.clone();
        controllers.supervise(Controller::new("snapshot-changes"), move |progress| {
            progress.ok();
            this.clone().forward_changes(trigger.clone())
        });
    }

    /// Fires `trigger` on every change of the allocator's or the IP cache's
    /// state; `Ok` when either is gone.
    async fn forward_changes(self: Arc<Self>, trigger: Trigger) -> Result<(), SnapshotError> {
        let mut identities = self.allocator.state_changes();
        let mut ipcache = self.ipcache.state_changes();
        loop {
            tokio::select! {
                changed = identities.changed() => if changed.is_err() { return Ok(()) },
                changed = ipcache.changed() => if changed.is_err() { return Ok(()) },
            }
            identities.borrow_and_update();
            ipcache.borrow_and_update();
            trigger.trigger();
        }
    }

    /// Writes once more now (a clean stop, after the controllers stopped); a
    /// failure is reported, the previous snapshot stays.
    pub async fn write_last(self: &Arc<Self>) {
        if let Err(e) = self.write().await {
            events::snapshot_write_failed(&self.metrics, &e);
        }
    }

    /// Gathers the state and writes it, both on the blocking pool (the
    /// gathering copies the whole identity and IP cache, never on an async
    /// worker).
    ///
    /// # Errors
    /// The write failed (the previous snapshot stays).
    pub async fn write(self: &Arc<Self>) -> Result<(), SnapshotError> {
        let started = Instant::now();
        let writer = Arc::clone(self);
        let (identities, ip_entries) = tokio::task::spawn_blocking(move || writer.gather_and_store())
            .await
            .map_err(SnapshotError::Task)??;
        events::snapshot_written(&self.metrics, identities, ip_entries, started.elapsed());
        Ok(())
    }

    /// Gathers the state now and stores it (blocking); returns how many
    /// identities and IP cache entries it holds.
    fn gather_and_store(&self) -> Result<(usize, usize), StateFileError> {
        let file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        let snapshot = Snapshot {
            node: self.opts.node.clone(),
            prefix: self.opts.prefix.clone(),
            cluster: self.opts.cluster.clone(),
            written_unix_millis: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            identities: self.allocator.snapshot(),
            ipcache: self.ipcache.snapshot(),
        };
        file.store(&snapshot)?;
        Ok((
            snapshot.identities.identities.len(),
            snapshot.ipcache.remote.len() + snapshot.ipcache.local.len(),
        ))
    }
}

/// Why the snapshot could not be written.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file could not be written.
    #[error("writing the local snapshot: {0}")]
    File(#[from] StateFileError),
    /// The blocking task failed.
    #[error("writing the local snapshot: the blocking task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::AllocatorOptions;
    use crate::embedded_backend::EmbeddedBackend;
    use crate::ipcache::{IpCacheOptions, IpcacheEntry, IpcacheSource};

    fn options(dir: &std::path::Path, node: &str) -> SnapshotOptions {
        SnapshotOptions::new(dir.join(SNAPSHOT_FILE_NAME), node, "rivet/state/", "default")
    }

    #[tokio::test]
    async fn a_written_snapshot_restores_the_view_and_another_nodes_or_a_torn_one_is_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let backend = Arc::new(EmbeddedBackend::open(dir.path().join("store.json"), "n1").unwrap());
        let metrics = IdentityMetrics::default();
        let allocator = IdentityAllocator::new(backend.clone(), AllocatorOptions::default());
        let ipcache = IpCache::new(backend, IpCacheOptions::new("n1"));
        let controllers = Controllers::new();
        allocator.run(&controllers);
        ipcache.run(&controllers);
        allocator.wait_ready().await;
        let web = allocator.allocate(&"k8s:app=web".parse().unwrap(), None).await.unwrap();
        let pod = IpcacheEntry::new("198.18.3.1/32".parse().unwrap(), web.id, IpcacheSource::LocalEndpoint);
        ipcache.upsert(vec![pod]).await.unwrap();
        let writer = SnapshotWriter::new(
            allocator.clone(),
            ipcache.clone(),
            options(dir.path(), "n1"),
            metrics.clone(),
        );
        writer.write().await.expect("written");
        controllers.shutdown().await;

        let loaded = load(&options(dir.path(), "n1"), &metrics).expect("loaded");
        assert_eq!(
            loaded.identities.identities,
            vec![IdentityRecord {
                id: web.id,
                labels: "k8s:app=web".into()
            }]
        );
        assert_eq!(
            loaded.ipcache.local.iter().map(|e| e.ip.as_str()).collect::<Vec<_>>(),
            ["198.18.3.1"]
        );
        let backend = Arc::new(EmbeddedBackend::open(dir.path().join("other.json"), "n1").unwrap());
        let (allocator, ipcache) = (
            IdentityAllocator::new(backend.clone(), AllocatorOptions::default()),
            IpCache::new(backend, IpCacheOptions::new("n1")),
        );
        restore(loaded, &allocator, &ipcache);
        assert!(allocator.is_ready() && ipcache.is_ready(), "served before any listing");
        assert_eq!(allocator.lookup(&"k8s:app=web".parse().unwrap()).unwrap(), Some(web.id));
        assert!(
            allocator.store_error().is_some_and(|e| e.contains("local snapshot")),
            "{:?}",
            allocator.store_error()
        );
        let restored = ipcache.get(&"198.18.3.1/32".parse().unwrap()).expect("the local claim");
        assert_eq!(
            (restored.identity, restored.source),
            (web.id, IpcacheSource::LocalEndpoint)
        );

        assert!(load(&options(dir.path(), "n2"), &metrics).is_none(), "another node's");
        let path = dir.path().join(SNAPSHOT_FILE_NAME);
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() / 2]).unwrap();
        assert!(load(&options(dir.path(), "n1"), &metrics).is_none(), "a torn one");
        assert!(
            load(&options(&dir.path().join("none"), "n1"), &metrics).is_none(),
            "none"
        );
        let mut registry = prometheus_client::registry::Registry::default();
        metrics.register(&mut registry, Vec::new);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for (outcome, n) in [("loaded", 1), ("unusable", 2), ("missing", 1)] {
            let line = format!("identity_snapshot_loads_total{{outcome=\"{outcome}\"}} {n}");
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert!(
            text.contains("identity_snapshot_writes_total{outcome=\"written\"} 1"),
            "{text}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_at_once_never_share_the_temp_file_and_the_newest_stays() {
        let dir = tempfile::tempdir().unwrap();
        let backend = Arc::new(EmbeddedBackend::open(dir.path().join("store.json"), "n1").unwrap());
        let allocator = IdentityAllocator::new(backend.clone(), AllocatorOptions::default());
        let ipcache = IpCache::new(backend, IpCacheOptions::new("n1"));
        let controllers = Controllers::new();
        allocator.run(&controllers);
        allocator.wait_ready().await;
        let writer = SnapshotWriter::new(
            allocator.clone(),
            ipcache,
            options(dir.path(), "n1"),
            IdentityMetrics::default(),
        );
        // Many writes at once, as when a stop's last write meets one that
        // outlived the aborted loop.
        let writes = (0..16).map(|i| {
            let (writer, allocator) = (writer.clone(), allocator.clone());
            tokio::spawn(async move {
                allocator
                    .allocate(&format!("k8s:app=a{i}").parse().unwrap(), None)
                    .await
                    .unwrap();
                writer.write().await
            })
        });
        for result in futures::future::join_all(writes).await {
            result.unwrap().expect("every write succeeds");
        }
        writer.write().await.expect("the last write");
        let loaded = load(&options(dir.path(), "n1"), &IdentityMetrics::default()).expect("a whole snapshot");
        assert_eq!(
            loaded.identities.identities.len(),
            16,
            "the newest snapshot is in the file"
        );
        controllers.shutdown().await;
    }
}
