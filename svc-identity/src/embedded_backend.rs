//! [`EmbeddedBackend`]: the [`IdentityBackend`] in one crash-safe local file,
//! for a single node without etcd (the default).
//!
//! The store is a flat key → value map holding exactly the keys and values
//! the etcd backend writes (see [`Layout`], default prefix `rivet/state/`,
//! value keys still carrying the node name), so moving to etcd later is a
//! copy of the map. It lives in one [`StateFile`] (kind
//! `rivet-identity-store`, schema 1): `{"revision": N, "kvs": {key: value}}`.
//!
//! - Every mutation is durable (tmp file + fsync + rename + directory fsync)
//!   before its method returns. Concurrent mutations share one write (group
//!   commit): a batch is applied to a copy of the state, written, and only
//!   then made visible; if the write fails every mutation of the batch fails
//!   with [`BackendError::Local`] and nothing of it is visible or kept.
//!   Reads see only durable state. The write runs in its own task, so a
//!   caller that gives up never leaves a half-applied batch.
//! - A revision counter increments per mutation that changed something
//!   (like an etcd transaction; a no-op mutation changes nothing); it is
//!   stored, so revisions keep growing across restarts.
//! - Watches are served from an in-memory history of recent events (the
//!   last 10 000) plus a broadcast of new ones. Watching from a revision
//!   older than the history (which starts empty at [`EmbeddedBackend::open`])
//!   or falling too far behind is [`BackendError::Compacted`]: re-list.
//! - There are no leases: value keys and IP entries persist until released
//!   or deleted, and [`lease_renewed`](IdentityBackend::lease_renewed) never
//!   completes.
//! - A torn or foreign state file fails [`EmbeddedBackend::open`]; it is
//!   never treated as empty (that would hand out identities twice).
//!
//! One process per file: the daemon's single-instance socket guarantees it.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::StreamExt;
use futures::stream::BoxStream;
use rivet_common::state_file::{StateFile, StateFileError};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, oneshot};

use crate::backend::{
    AcquireOutcome, BackendError, CreateOutcome, IdentityBackend, IdentityEvent, IdentityRecord, IpEntry, IpEvent,
    Revision,
};
use crate::etcd_backend::{
    DEFAULT_CLUSTER, DEFAULT_PREFIX, Layout, check_name, decode_identity, decode_ip, decode_value_id, skip_corrupt,
};

/// Kind tag and schema version of the state file.
const STATE_KIND: &str = "rivet-identity-store";
const STATE_VERSION: u32 = 1;
/// Events kept for watches.
const HISTORY: usize = 10_000;
/// Events a slow watcher may fall behind before it is told to re-list.
const BROADCAST_CAPACITY: usize = 4096;

/// The state file's content.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct StoreData {
    /// Revision of the last mutation.
    revision: Revision,
    /// Every key, as etcd would hold it.
    kvs: BTreeMap<String, String>,
}

/// An event of either watch.
#[derive(Debug, Clone)]
enum StoreEvent {
    Identity(IdentityEvent),
    Ip(IpEvent),
}

/// The durable state and the watch machinery.
struct Committed {
    data: StoreData,
    /// Recent events, oldest first.
    history: VecDeque<(Revision, StoreEvent)>,
    /// Every event after this revision is in `history`.
    compacted: Revision,
    events: broadcast::Sender<(Revision, StoreEvent)>,
}

/// A mutation.
#[derive(Debug)]
enum Op {
    Create {
        id: u32,
        labels: String,
    },
    Acquire {
        id: u32,
        labels: String,
    },
    Release {
        labels: String,
    },
    UpsertIp(IpEntry),
    DeleteIp(String),
    /// Tests: write or delete a raw key (another node, the operator's GC).
    #[cfg(test)]
    Raw {
        key: String,
        value: Option<String>,
    },
}

#[derive(Debug)]
enum Outcome {
    Create(CreateOutcome),
    Acquire(AcquireOutcome),
    Done,
}

struct Pending {
    op: Op,
    action: String,
    reply: oneshot::Sender<Result<Outcome, BackendError>>,
}

struct Shared {
    file: StateFile<StoreData>,
    layout: Layout,
    node: String,
    committed: Mutex<Committed>,
    /// Mutations waiting for the next batch.
    queue: Mutex<Vec<Pending>>,
    /// Held by the batch being written.
    writer: Arc<tokio::sync::Mutex<()>>,
    history_cap: usize,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The [`IdentityBackend`] in a local file; see the module docs.
pub struct EmbeddedBackend {
    shared: Arc<Shared>,
}

impl fmt::Debug for EmbeddedBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmbeddedBackend")
            .field("path", &self.shared.file.path())
            .field("node", &self.shared.node)
            .field("revision", &self.revision())
            .finish_non_exhaustive()
    }
}

impl EmbeddedBackend {
    /// Opens (or starts) the store at `path` for `node`, cluster `default`.
    ///
    /// # Errors
    /// `Local` when the file cannot be read or is torn, foreign or of another
    /// schema version (it is never treated as empty).
    pub fn open(path: impl Into<PathBuf>, node: &str) -> Result<Self, BackendError> {
        Self::open_in_cluster(path, DEFAULT_CLUSTER, node)
    }

    /// As [`open`](Self::open) with the cluster name of IP cache keys.
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub fn open_in_cluster(path: impl Into<PathBuf>, cluster: &str, node: &str) -> Result<Self, BackendError> {
        Self::open_with_history(path.into(), cluster, node, HISTORY)
    }

    fn open_with_history(path: PathBuf, cluster: &str, node: &str, history_cap: usize) -> Result<Self, BackendError> {
        let action = format!("opening the embedded identity store {}", path.display());
        check_name("node", node, &action)?;
        check_name("cluster", cluster, &action)?;
        let file: StateFile<StoreData> = StateFile::new(path, STATE_KIND, STATE_VERSION);
        let data = file.load().map_err(|source| BackendError::Local {
            action: action.clone(),
            source,
        })?;
        let data = data.unwrap_or_default();
        tracing::info!(
            path = %file.path().display(),
            revision = data.revision,
            keys = data.kvs.len(),
            "embedded identity store opened"
        );
        let (events, _) = broadcast::channel(BROADCAST_CAPACITY);
        Ok(Self {
            shared: Arc::new(Shared {
                file,
                layout: Layout::new(DEFAULT_PREFIX, cluster),
                node: node.to_string(),
                committed: Mutex::new(Committed {
                    compacted: data.revision,
                    data,
                    history: VecDeque::new(),
                    events,
                }),
                queue: Mutex::new(Vec::new()),
                writer: Arc::new(tokio::sync::Mutex::new(())),
                history_cap: history_cap.max(1),
            }),
        })
    }

    /// The state file.
    pub fn path(&self) -> &Path {
        self.shared.file.path()
    }

    /// This node's name.
    pub fn node(&self) -> &str {
        &self.shared.node
    }

    /// The key layout (default prefix).
    pub fn layout(&self) -> &Layout {
        &self.shared.layout
    }

    /// The revision of the last durable mutation.
    pub fn revision(&self) -> Revision {
        lock(&self.shared.committed).data.revision
    }

    /// Waits until every mutation already queued is written (for a clean stop).
    pub async fn shutdown(&self) {
        let _writer = self.shared.writer.lock().await;
    }

    /// Queues `op`, takes part in the group commit, and returns its outcome
    /// once durable.
    async fn mutate(&self, action: String, op: Op) -> Result<Outcome, BackendError> {
        let (reply, outcome) = oneshot::channel();
        lock(&self.shared.queue).push(Pending {
            op,
            action: action.clone(),
            reply,
        });
        let writer = self.shared.writer.clone().lock_owned().await;
        let batch = std::mem::take(&mut *lock(&self.shared.queue));
        if batch.is_empty() {
            // An earlier batch (finished: it held the writer lock) took ours.
            drop(writer);
        } else {
            let shared = self.shared.clone();
            // Its own task: the batch completes even if this caller goes away.
            tokio::spawn(async move {
                shared.run_batch(batch).await;
                drop(writer);
            });
        }
        outcome.await.map_err(|_| BackendError::Local {
            action,
            source: StateFileError::Io {
                action: "writing",
                path: self.shared.file.path().to_path_buf(),
                source: std::io::Error::other("the store's writer task failed"),
            },
        })?
    }

    fn watch<E: Send + 'static>(
        &self,
        what: &'static str,
        after: Revision,
        select: fn(StoreEvent) -> Option<E>,
    ) -> Result<BoxStream<'static, Result<E, BackendError>>, BackendError> {
        let committed = lock(&self.shared.committed);
        if after < committed.compacted {
            return Err(BackendError::Compacted {
                what,
                revision: after,
                compacted: committed.compacted,
            });
        }
        let backlog: Vec<Result<E, BackendError>> = committed
            .history
            .iter()
            .filter(|(revision, _)| *revision > after)
            .filter_map(|(_, event)| select(event.clone()))
            .map(Ok)
            .collect();
        // Subscribed under the lock that publishes: no gap, no duplicate.
        let live = committed.events.subscribe();
        drop(committed);
        let live = futures::stream::unfold(Some((live, after)), move |state| async move {
            let (mut live, mut seen) = state?;
            loop {
                match live.recv().await {
                    Ok((revision, event)) => {
                        if revision <= seen {
                            continue;
                        }
                        seen = revision;
                        if let Some(e) = select(event) {
                            return Some((Ok(e), Some((live, seen))));
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        let compacted = seen.saturating_add(i64::try_from(missed).unwrap_or(i64::MAX));
                        let err = BackendError::Compacted {
                            what,
                            revision: seen,
                            compacted,
                        };
                        return Some((Err(err), None));
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
        Ok(futures::stream::iter(backlog).chain(live).boxed())
    }

    /// Tests: writes (`Some`) or deletes (`None`) a raw key durably.
    #[cfg(test)]
    async fn raw(&self, key: &str, value: Option<&str>) -> Result<(), BackendError> {
        let op = Op::Raw {
            key: key.to_string(),
            value: value.map(str::to_string),
        };
        self.mutate(format!("writing raw key {key}"), op).await.map(|_| ())
    }
}

impl Shared {
    /// Applies a batch to a copy of the state, writes it, then publishes it
    /// and answers every mutation.
    async fn run_batch(self: Arc<Self>, batch: Vec<Pending>) {
        let mut data = lock(&self.committed).data.clone();
        let mut results = Vec::with_capacity(batch.len());
        let mut events = Vec::new();
        let mut changed_any = false;
        for pending in &batch {
            let result = self.apply(&mut data, &pending.op).map(|(outcome, changed, event)| {
                if changed {
                    data.revision += 1;
                    changed_any = true;
                    if let Some(event) = event {
                        events.push((data.revision, event));
                    }
                }
                outcome
            });
            results.push(result);
        }
        if changed_any {
            let file = self.file.clone();
            let written = tokio::task::spawn_blocking(move || {
                let result = file.store(&data);
                (data, result)
            })
            .await;
            let error = match written {
                Ok((written, Ok(()))) => Ok(written),
                Ok((_, Err(e))) => Err(e),
                Err(join) => Err(StateFileError::Io {
                    action: "writing",
                    path: self.file.path().to_path_buf(),
                    source: std::io::Error::other(format!("the write task failed: {join}")),
                }),
            };
            let data = match error {
                Ok(data) => data,
                Err(error) => {
                    tracing::error!(error = %error, path = %self.file.path().display(), mutations = batch.len(), "writing the embedded identity store failed; the batch is discarded");
                    for pending in batch {
                        let _ = pending.reply.send(Err(BackendError::Local {
                            action: pending.action,
                            source: clone_state_error(&error),
                        }));
                    }
                    return;
                }
            };
            let mut committed = lock(&self.committed);
            committed.data = data;
            for (revision, event) in events {
                let _ = committed.events.send((revision, event.clone()));
                committed.history.push_back((revision, event));
                while committed.history.len() > self.history_cap {
                    if let Some((dropped, _)) = committed.history.pop_front() {
                        committed.compacted = committed.compacted.max(dropped);
                    }
                }
            }
        }
        for (pending, result) in batch.into_iter().zip(results) {
            let _ = pending.reply.send(result);
        }
    }

    /// Applies one mutation: (outcome, changed anything, event).
    fn apply(&self, data: &mut StoreData, op: &Op) -> Result<(Outcome, bool, Option<StoreEvent>), BackendError> {
        let layout = &self.layout;
        let kvs = &mut data.kvs;
        Ok(match op {
            Op::Create { id, labels } => {
                if let Some((_, held)) = exact_values(layout, kvs, labels)?.first() {
                    return Ok((Outcome::Create(CreateOutcome::LabelsHeldAs(*held)), false, None));
                }
                let id_key = layout.id_key(*id);
                match kvs.get(&id_key) {
                    // A released identity awaiting GC: reuse it (via acquire).
                    Some(master) if master == labels => {
                        (Outcome::Create(CreateOutcome::LabelsHeldAs(*id)), false, None)
                    }
                    Some(_) => (Outcome::Create(CreateOutcome::IdTaken), false, None),
                    None => {
                        kvs.insert(id_key, labels.clone());
                        kvs.insert(layout.value_key(labels, &self.node), id.to_string());
                        let event = identity_upsert(*id, labels);
                        (Outcome::Create(CreateOutcome::Created), true, Some(event))
                    }
                }
            }
            Op::Acquire { id, labels } => {
                let id_key = layout.id_key(*id);
                let value_key = layout.value_key(labels, &self.node);
                match kvs.get(&id_key) {
                    Some(master) if master == labels => {
                        let changed = kvs.get(&value_key) != Some(&id.to_string());
                        kvs.insert(value_key, id.to_string());
                        (Outcome::Acquire(AcquireOutcome::Acquired), changed, None)
                    }
                    Some(_) => (Outcome::Acquire(AcquireOutcome::Conflict), false, None),
                    None => {
                        if exact_values(layout, kvs, labels)?.iter().any(|(_, held)| held != id) {
                            return Ok((Outcome::Acquire(AcquireOutcome::Conflict), false, None));
                        }
                        kvs.insert(id_key, labels.clone());
                        kvs.insert(value_key, id.to_string());
                        let event = identity_upsert(*id, labels);
                        (Outcome::Acquire(AcquireOutcome::MasterRecreated), true, Some(event))
                    }
                }
            }
            Op::Release { labels } => {
                let removed = kvs.remove(&layout.value_key(labels, &self.node)).is_some();
                (Outcome::Done, removed, None)
            }
            Op::UpsertIp(entry) => {
                let mut entry = entry.clone();
                entry.node.clone_from(&self.node);
                let key = layout.ip_key(&entry.ip);
                let value = serde_json::to_string(&entry).map_err(|e| BackendError::Corrupt {
                    key: key.clone(),
                    detail: format!("encoding the entry: {e}"),
                })?;
                if kvs.get(&key) == Some(&value) {
                    (Outcome::Done, false, None)
                } else {
                    kvs.insert(key, value);
                    (Outcome::Done, true, Some(StoreEvent::Ip(IpEvent::Upsert(entry))))
                }
            }
            Op::DeleteIp(ip) => {
                let key = layout.ip_key(ip);
                let ours = kvs.get(&key).is_some_and(|v| {
                    decode_ip(layout, key.as_bytes(), v.as_bytes()).is_ok_and(|e| e.node == self.node)
                });
                if ours {
                    kvs.remove(&key);
                    let event = StoreEvent::Ip(IpEvent::Delete { ip: ip.clone() });
                    (Outcome::Done, true, Some(event))
                } else {
                    (Outcome::Done, false, None)
                }
            }
            #[cfg(test)]
            Op::Raw { key, value } => {
                let before = match value {
                    Some(v) => kvs.insert(key.clone(), v.clone()),
                    None => kvs.remove(key),
                };
                let event = if let Some(id) = layout.id_of_key(key) {
                    Some(StoreEvent::Identity(match value {
                        Some(labels) => identity_upsert(id, labels).into_identity(),
                        None => IdentityEvent::Delete { id },
                    }))
                } else if let Some(ip) = layout.ip_of_key(key) {
                    match value {
                        Some(v) => decode_ip(layout, key.as_bytes(), v.as_bytes())
                            .ok()
                            .map(|e| StoreEvent::Ip(IpEvent::Upsert(e))),
                        None => Some(StoreEvent::Ip(IpEvent::Delete { ip: ip.to_string() })),
                    }
                } else {
                    None
                };
                let changed = value.is_some() || before.is_some();
                (Outcome::Done, changed, event.filter(|_| changed))
            }
        })
    }
}

impl StoreEvent {
    #[cfg(test)]
    fn into_identity(self) -> IdentityEvent {
        match self {
            StoreEvent::Identity(e) => e,
            StoreEvent::Ip(_) => unreachable!("an identity event"),
        }
    }
}

fn identity_upsert(id: u32, labels: &str) -> StoreEvent {
    StoreEvent::Identity(IdentityEvent::Upsert(IdentityRecord {
        id,
        labels: labels.to_string(),
    }))
}

/// Keys under `prefix`.
fn with_prefix<'a>(
    kvs: &'a BTreeMap<String, String>,
    prefix: &'a str,
) -> impl Iterator<Item = (&'a String, &'a String)> {
    kvs.range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
        .take_while(move |(k, _)| k.starts_with(prefix))
}

/// The value keys of exactly `labels` as (node, id).
fn exact_values(
    layout: &Layout,
    kvs: &BTreeMap<String, String>,
    labels: &str,
) -> Result<Vec<(String, u32)>, BackendError> {
    let prefix = layout.value_prefix(labels);
    with_prefix(kvs, &prefix)
        .filter_map(|(key, value)| {
            let node = layout.node_of_value_key(labels, key)?;
            Some(decode_value_id(key.as_bytes(), value.as_bytes()).map(|id| (node.to_string(), id)))
        })
        .collect()
}

/// A copy of a state file error for each mutation of a failed batch.
fn clone_state_error(error: &StateFileError) -> StateFileError {
    use serde::de::Error as _;
    match error {
        StateFileError::Corrupt { path, source } => StateFileError::Corrupt {
            path: path.clone(),
            source: serde_json::Error::custom(source.to_string()),
        },
        StateFileError::WrongKind { path, found, expected } => StateFileError::WrongKind {
            path: path.clone(),
            found: found.clone(),
            expected,
        },
        StateFileError::UnsupportedVersion { path, found, supported } => StateFileError::UnsupportedVersion {
            path: path.clone(),
            found: *found,
            supported: *supported,
        },
        StateFileError::Encode { path, source } => StateFileError::Encode {
            path: path.clone(),
            source: serde_json::Error::custom(source.to_string()),
        },
        StateFileError::Io { action, path, source } => StateFileError::Io {
            action,
            path: path.clone(),
            source: std::io::Error::new(source.kind(), source.to_string()),
        },
    }
}

#[tonic::async_trait]
impl IdentityBackend for EmbeddedBackend {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    async fn list_identities(&self) -> Result<(Vec<IdentityRecord>, Revision), BackendError> {
        let committed = lock(&self.shared.committed);
        let layout = &self.shared.layout;
        let prefix = layout.id_prefix();
        let records = with_prefix(&committed.data.kvs, &prefix)
            .filter_map(|(k, v)| skip_corrupt("identity", decode_identity(layout, k.as_bytes(), v.as_bytes())))
            .collect::<std::collections::BTreeSet<_>>();
        Ok((records.into_iter().collect(), committed.data.revision))
    }

    async fn watch_identities(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<IdentityEvent, BackendError>>, BackendError> {
        self.watch("identities", after, |event| match event {
            StoreEvent::Identity(e) => Some(e),
            StoreEvent::Ip(_) => None,
        })
    }

    async fn held_id(&self, labels: &str) -> Result<Option<u32>, BackendError> {
        let committed = lock(&self.shared.committed);
        Ok(exact_values(&self.shared.layout, &committed.data.kvs, labels)?
            .first()
            .map(|(_, id)| *id))
    }

    /// Same answers as the etcd backend, including `LabelsHeldAs(id)` when
    /// the master key of `id` already names `labels` but nobody holds them.
    async fn create_identity(&self, id: u32, labels: &str) -> Result<CreateOutcome, BackendError> {
        let op = Op::Create {
            id,
            labels: labels.to_string(),
        };
        match self
            .mutate(format!("allocating identity {id} for {labels}"), op)
            .await?
        {
            Outcome::Create(outcome) => Ok(outcome),
            other => unreachable!("create answered {other:?}"),
        }
    }

    async fn acquire(&self, id: u32, labels: &str) -> Result<AcquireOutcome, BackendError> {
        let op = Op::Acquire {
            id,
            labels: labels.to_string(),
        };
        match self.mutate(format!("acquiring identity {id} for {labels}"), op).await? {
            Outcome::Acquire(outcome) => Ok(outcome),
            other => unreachable!("acquire answered {other:?}"),
        }
    }

    async fn release(&self, labels: &str) -> Result<(), BackendError> {
        let op = Op::Release {
            labels: labels.to_string(),
        };
        self.mutate(format!("releasing this node's value key for {labels}"), op)
            .await
            .map(|_| ())
    }

    async fn node_value_keys(&self) -> Result<Vec<String>, BackendError> {
        let committed = lock(&self.shared.committed);
        let layout = &self.shared.layout;
        let root = layout.value_root();
        let keys = with_prefix(&committed.data.kvs, &root).map(|(key, _)| key.as_str());
        Ok(layout.node_value_labels(&self.shared.node, keys))
    }

    async fn shutdown(&self) {
        EmbeddedBackend::shutdown(self).await;
    }

    /// Writes the entry with `node` set to this node (the publisher).
    async fn upsert_ip(&self, entry: &IpEntry) -> Result<(), BackendError> {
        self.mutate(
            format!("publishing IP cache entry {}", entry.ip),
            Op::UpsertIp(entry.clone()),
        )
        .await
        .map(|_| ())
    }

    /// Deletes the entry only if this node published it.
    async fn delete_ip(&self, ip: &str) -> Result<(), BackendError> {
        self.mutate(format!("withdrawing IP cache entry {ip}"), Op::DeleteIp(ip.to_string()))
            .await
            .map(|_| ())
    }

    async fn list_ips(&self) -> Result<(Vec<IpEntry>, Revision), BackendError> {
        let committed = lock(&self.shared.committed);
        let layout = &self.shared.layout;
        let prefix = layout.ip_prefix();
        let mut entries: Vec<IpEntry> = with_prefix(&committed.data.kvs, &prefix)
            .filter_map(|(k, v)| skip_corrupt("IP cache", decode_ip(layout, k.as_bytes(), v.as_bytes())))
            .collect();
        entries.sort();
        Ok((entries, committed.data.revision))
    }

    async fn watch_ips(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<IpEvent, BackendError>>, BackendError> {
        self.watch("the IP cache", after, |event| match event {
            StoreEvent::Ip(e) => Some(e),
            StoreEvent::Identity(_) => None,
        })
    }

    /// There is no lease: never completes.
    async fn lease_renewed(&self, _seen: &mut u64) {
        std::future::pending::<()>().await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    const NODE: &str = "node-a";

    fn open(dir: &tempfile::TempDir) -> EmbeddedBackend {
        EmbeddedBackend::open(dir.path().join("identities.json"), NODE).expect("open the store")
    }

    async fn next<T: fmt::Debug>(stream: &mut BoxStream<'static, Result<T, BackendError>>) -> T {
        tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .expect("a watch event within 5 s")
            .expect("the stream goes on")
            .expect("an event, not an error")
    }

    fn upsert(id: u32, labels: &str) -> IdentityEvent {
        IdentityEvent::Upsert(IdentityRecord {
            id,
            labels: labels.into(),
        })
    }

    fn ip_entry(ip: &str, identity: u32) -> IpEntry {
        IpEntry {
            ip: ip.to_string(),
            identity,
            host_ip: Some("192.0.2.1".into()),
            namespace: Some("default".into()),
            pod: Some(format!("pod-{identity}")),
            node: NODE.into(),
            named_ports: Vec::new(),
        }
    }

    /// The file's `kvs`, read as JSON.
    fn file_kvs(store: &EmbeddedBackend) -> BTreeMap<String, String> {
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(store.path()).unwrap()).unwrap();
        assert_eq!(json["kind"], "rivet-identity-store");
        assert_eq!(json["schema_version"], 1);
        serde_json::from_value(json["data"]["kvs"].clone()).unwrap()
    }

    #[tokio::test]
    async fn embedded_create_outcomes() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir);
        assert_eq!(store.kind(), "embedded");
        assert_eq!(
            store.create_identity(300, "k8s:app=web").await.unwrap(),
            CreateOutcome::Created
        );
        assert_eq!(
            store.create_identity(300, "k8s:app=db").await.unwrap(),
            CreateOutcome::IdTaken
        );
        assert_eq!(
            store.create_identity(301, "k8s:app=web").await.unwrap(),
            CreateOutcome::LabelsHeldAs(300)
        );
        assert_eq!(store.held_id("k8s:app=web").await.unwrap(), Some(300));
        store.release("k8s:app=web").await.unwrap();
        store.release("k8s:app=web").await.unwrap();
        assert_eq!(store.held_id("k8s:app=web").await.unwrap(), None);
        // The released identity's master key stays and is reused.
        assert_eq!(
            store.create_identity(300, "k8s:app=web").await.unwrap(),
            CreateOutcome::LabelsHeldAs(300)
        );
        assert_eq!(
            store.acquire(300, "k8s:app=web").await.unwrap(),
            AcquireOutcome::Acquired
        );
        // Another node's value key counts too (same semantics as etcd).
        let key = store.layout().value_key("k8s:app=api", "node-b");
        store.raw(&key, Some("310")).await.unwrap();
        assert_eq!(
            store.create_identity(311, "k8s:app=api").await.unwrap(),
            CreateOutcome::LabelsHeldAs(310)
        );
        store.raw(&key, Some("garbage")).await.unwrap();
        assert!(matches!(
            store.create_identity(311, "k8s:app=api").await,
            Err(BackendError::Corrupt { .. })
        ));
        assert!(matches!(
            store.held_id("k8s:app=api").await,
            Err(BackendError::Corrupt { .. })
        ));
    }

    #[tokio::test]
    async fn embedded_acquire_on_matching_mismatching_and_vanished_master() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir);
        let layout = store.layout().clone();
        assert_eq!(
            store.create_identity(400, "k8s:app=web").await.unwrap(),
            CreateOutcome::Created
        );
        assert_eq!(
            store.acquire(400, "k8s:app=web").await.unwrap(),
            AcquireOutcome::Acquired
        );
        assert_eq!(
            store.acquire(400, "k8s:app=db").await.unwrap(),
            AcquireOutcome::Conflict
        );
        store.raw(&layout.id_key(400), None).await.unwrap();
        assert_eq!(
            store.acquire(400, "k8s:app=web").await.unwrap(),
            AcquireOutcome::MasterRecreated
        );
        assert_eq!(
            file_kvs(&store).get(&layout.id_key(400)).map(String::as_str),
            Some("k8s:app=web")
        );
        store.raw(&layout.id_key(400), Some("k8s:app=other")).await.unwrap();
        assert_eq!(
            store.acquire(400, "k8s:app=web").await.unwrap(),
            AcquireOutcome::Conflict
        );
        // Vanished while another node holds the labels under another id.
        assert_eq!(
            store.create_identity(410, "k8s:app=api").await.unwrap(),
            CreateOutcome::Created
        );
        store
            .raw(&layout.value_key("k8s:app=api", "node-c"), Some("411"))
            .await
            .unwrap();
        store.raw(&layout.id_key(410), None).await.unwrap();
        assert_eq!(
            store.acquire(410, "k8s:app=api").await.unwrap(),
            AcquireOutcome::Conflict
        );
        assert!(!file_kvs(&store).contains_key(&layout.id_key(410)));
    }

    #[tokio::test]
    async fn embedded_release_deletes_only_this_nodes_value_key_and_keys_follow_the_layout() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir);
        let labels = "k8s:app.kubernetes.io/name=x,k8s:app=web";
        assert_eq!(
            store.create_identity(500, labels).await.unwrap(),
            CreateOutcome::Created
        );
        store
            .raw(&store.layout().value_key(labels, "node-b"), Some("500"))
            .await
            .unwrap();
        let entry = IpEntry {
            node: "someone-else".into(),
            named_ports: Vec::new(),
            ..ip_entry("198.18.0.0/24", 500)
        };
        store.upsert_ip(&entry).await.unwrap();
        let ip_json = serde_json::to_string(&ip_entry("198.18.0.0/24", 500)).unwrap();
        let expected: BTreeMap<String, String> = [
            ("rivet/state/identities/v1/id/500".to_string(), labels.to_string()),
            (format!("rivet/state/identities/v1/value/{labels}/node-a"), "500".into()),
            (format!("rivet/state/identities/v1/value/{labels}/node-b"), "500".into()),
            ("rivet/state/ip/v1/default/198.18.0.0/24".to_string(), ip_json),
        ]
        .into();
        assert_eq!(file_kvs(&store), expected);
        store.release(labels).await.unwrap();
        let kvs = file_kvs(&store);
        assert!(!kvs.contains_key(&format!("rivet/state/identities/v1/value/{labels}/node-a")));
        assert!(kvs.contains_key(&format!("rivet/state/identities/v1/value/{labels}/node-b")));
        assert_eq!(store.held_id(labels).await.unwrap(), Some(500));
        // Another cluster name.
        let other = EmbeddedBackend::open_in_cluster(dir.path().join("c1.json"), "c1", NODE).unwrap();
        other.upsert_ip(&ip_entry("198.18.0.1", 1)).await.unwrap();
        assert!(file_kvs(&other).contains_key("rivet/state/ip/v1/c1/198.18.0.1"));
    }

    #[tokio::test]
    async fn embedded_label_sets_sharing_a_key_prefix_stay_apart() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir);
        let short = "k8s:app=web,k8s:example.com";
        let long = "k8s:app=web,k8s:example.com/tier=db";
        assert_eq!(store.create_identity(700, long).await.unwrap(), CreateOutcome::Created);
        assert_eq!(store.held_id(short).await.unwrap(), None);
        assert_eq!(store.create_identity(701, short).await.unwrap(), CreateOutcome::Created);
        assert_eq!(store.held_id(short).await.unwrap(), Some(701));
        store.release(short).await.unwrap();
        assert_eq!(store.held_id(short).await.unwrap(), None);
        assert_eq!(store.held_id(long).await.unwrap(), Some(700));
    }

    #[tokio::test]
    async fn embedded_list_then_watch_delivers_later_changes_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir);
        store.create_identity(800, "k8s:app=a").await.unwrap();
        let (ids, revision) = store.list_identities().await.unwrap();
        assert_eq!(
            ids,
            [IdentityRecord {
                id: 800,
                labels: "k8s:app=a".into()
            }]
        );
        assert_eq!(revision, store.revision());
        let mut live = store.watch_identities(revision).await.unwrap();
        let (_, ip_revision) = store.list_ips().await.unwrap();
        let mut ips = store.watch_ips(ip_revision).await.unwrap();
        store.create_identity(801, "k8s:app=b").await.unwrap();
        store.upsert_ip(&ip_entry("198.18.0.1", 801)).await.unwrap();
        store.upsert_ip(&ip_entry("198.18.0.1", 801)).await.unwrap(); // no-op
        store.create_identity(802, "k8s:app=c").await.unwrap();
        store.release("k8s:app=b").await.unwrap(); // value key: no event
        store.raw(&store.layout().id_key(800), None).await.unwrap();
        store.delete_ip("198.18.0.1").await.unwrap();
        store.delete_ip("198.18.0.1").await.unwrap(); // idempotent
        for watch in [&mut live, &mut store.watch_identities(revision).await.unwrap()] {
            assert_eq!(next(watch).await, upsert(801, "k8s:app=b"));
            assert_eq!(next(watch).await, upsert(802, "k8s:app=c"));
            assert_eq!(next(watch).await, IdentityEvent::Delete { id: 800 });
        }
        assert_eq!(next(&mut ips).await, IpEvent::Upsert(ip_entry("198.18.0.1", 801)));
        assert_eq!(
            next(&mut ips).await,
            IpEvent::Delete {
                ip: "198.18.0.1".into()
            }
        );
        // Another node's entry is not this node's to withdraw.
        let foreign = IpEntry {
            node: "node-b".into(),
            named_ports: Vec::new(),
            ..ip_entry("198.18.0.2", 802)
        };
        let key = store.layout().ip_key("198.18.0.2");
        store
            .raw(&key, Some(&serde_json::to_string(&foreign).unwrap()))
            .await
            .unwrap();
        store.delete_ip("198.18.0.2").await.unwrap();
        assert_eq!(store.list_ips().await.unwrap().0, std::slice::from_ref(&foreign));
        assert_eq!(next(&mut ips).await, IpEvent::Upsert(foreign));
        // Undecodable entries are skipped by listings.
        store
            .raw(&store.layout().ip_key("198.18.0.3"), Some("not json"))
            .await
            .unwrap();
        store.raw(&store.layout().id_prefix(), Some("no id")).await.unwrap();
        assert_eq!(store.list_ips().await.unwrap().0.len(), 1);
        assert_eq!(store.list_identities().await.unwrap().0.len(), 2);
        // The stream ends when the store is dropped.
        drop(store);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), live.next())
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn embedded_watch_before_the_history_is_compacted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("identities.json");
        let store = EmbeddedBackend::open_with_history(path.clone(), DEFAULT_CLUSTER, NODE, 3).unwrap();
        for i in 0..6 {
            store.create_identity(900 + i, &format!("k8s:app=c{i}")).await.unwrap();
        }
        // Six events, three kept: revisions 4..=6.
        let compacted = |r: Result<BoxStream<'static, Result<IdentityEvent, BackendError>>, BackendError>| match r {
            Err(BackendError::Compacted {
                revision, compacted, ..
            }) => (revision, compacted),
            Err(other) => panic!("expected Compacted, got {other}"),
            Ok(_) => panic!("expected Compacted, got a stream"),
        };
        assert_eq!(compacted(store.watch_identities(2).await), (2, 3));
        let mut watch = store.watch_identities(3).await.unwrap();
        assert_eq!(next(&mut watch).await, upsert(903, "k8s:app=c3"));
        assert!(matches!(store.watch_ips(0).await, Err(BackendError::Compacted { .. })));
        drop(store);
        // After a restart the history starts empty at the stored revision.
        let store = open(&dir);
        assert_eq!(store.revision(), 6);
        assert_eq!(compacted(store.watch_identities(5).await), (5, 6));
        let mut watch = store.watch_identities(6).await.unwrap();
        store.create_identity(999, "k8s:app=late").await.unwrap();
        assert_eq!(next(&mut watch).await, upsert(999, "k8s:app=late"));
        assert_eq!(store.revision(), 7);
    }

    #[tokio::test]
    async fn embedded_slow_watcher_is_told_to_relist() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir);
        let mut watch = store.watch_ips(0).await.unwrap();
        // One batch, more events than the broadcast holds.
        let entries: Vec<IpEntry> = (0..BROADCAST_CAPACITY + 10)
            .map(|i| ip_entry(&format!("198.18.{}.{}", i / 256, i % 256), 1000))
            .collect();
        futures::future::join_all(entries.iter().map(|e| store.upsert_ip(e)))
            .await
            .into_iter()
            .collect::<Result<Vec<()>, _>>()
            .unwrap();
        let mut delivered = 0;
        loop {
            match tokio::time::timeout(Duration::from_secs(5), watch.next())
                .await
                .unwrap()
            {
                Some(Ok(_)) => delivered += 1,
                Some(Err(BackendError::Compacted { .. })) => break,
                other => panic!("expected events then Compacted, got {other:?}"),
            }
        }
        assert!(delivered < entries.len());
        assert!(watch.next().await.is_none());
    }

    #[tokio::test]
    async fn embedded_reopen_keeps_everything() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir);
        store.create_identity(300, "k8s:app=web").await.unwrap();
        store.create_identity(301, "k8s:app=db").await.unwrap();
        store.release("k8s:app=db").await.unwrap();
        store.upsert_ip(&ip_entry("198.18.0.1", 300)).await.unwrap();
        let identities = store.list_identities().await.unwrap();
        let ips = store.list_ips().await.unwrap();
        let kvs = file_kvs(&store);
        drop(store);
        let store = open(&dir);
        assert_eq!(store.list_identities().await.unwrap(), identities);
        assert_eq!(store.list_ips().await.unwrap(), ips);
        assert_eq!(file_kvs(&store), kvs);
        assert_eq!(store.held_id("k8s:app=web").await.unwrap(), Some(300));
        assert_eq!(store.held_id("k8s:app=db").await.unwrap(), None);
        assert_eq!(
            store.create_identity(300, "k8s:app=x").await.unwrap(),
            CreateOutcome::IdTaken
        );
    }

    #[tokio::test]
    async fn embedded_torn_or_foreign_file_is_reported_not_treated_as_empty() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir);
        store.create_identity(300, "k8s:app=web").await.unwrap();
        let path = store.path().to_path_buf();
        drop(store);
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() / 2]).unwrap();
        let err = EmbeddedBackend::open(&path, NODE).unwrap_err();
        assert!(
            matches!(
                &err,
                BackendError::Local {
                    source: StateFileError::Corrupt { .. },
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("opening the embedded identity store"), "{err}");
        std::fs::write(&path, b"").unwrap();
        assert!(EmbeddedBackend::open(&path, NODE).is_err());
        StateFile::<u32>::new(&path, "rivet-ipam-allocations", 1)
            .store(&1)
            .unwrap();
        let err = EmbeddedBackend::open(&path, NODE).unwrap_err();
        assert!(
            matches!(
                &err,
                BackendError::Local {
                    source: StateFileError::WrongKind { .. },
                    ..
                }
            ),
            "{err}"
        );
        assert!(EmbeddedBackend::open(dir.path().join("x.json"), "a/b").is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn embedded_concurrent_mutations_share_writes_and_stay_consistent() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(open(&dir));
        let started = Instant::now();
        let tasks: Vec<_> = (0..64u32)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move { store.create_identity(1000 + i, &format!("k8s:app=n{i}")).await })
            })
            .collect();
        for task in tasks {
            assert_eq!(task.await.unwrap().unwrap(), CreateOutcome::Created);
        }
        eprintln!("64 concurrent creations durable in {:?}", started.elapsed());
        assert_eq!(store.revision(), 64);
        // Racing on one label set: one id.
        let tasks: Vec<_> = (0..16u32)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move { (2000 + i, store.create_identity(2000 + i, "k8s:app=race").await.unwrap()) })
            })
            .collect();
        let mut outcomes = Vec::new();
        for task in tasks {
            outcomes.push(task.await.unwrap());
        }
        let winners: Vec<u32> = outcomes
            .iter()
            .filter(|(_, o)| *o == CreateOutcome::Created)
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(winners.len(), 1, "{outcomes:?}");
        for (id, outcome) in &outcomes {
            if *id != winners[0] {
                assert_eq!(*outcome, CreateOutcome::LabelsHeldAs(winners[0]));
            }
        }
        drop(store);
        let store = open(&dir);
        assert_eq!(store.list_identities().await.unwrap().0.len(), 65);
    }

    #[tokio::test]
    async fn embedded_failed_write_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("sub");
        let store = EmbeddedBackend::open(sub.join("identities.json"), NODE).unwrap();
        store.create_identity(300, "k8s:app=web").await.unwrap();
        let revision = store.revision();
        // The directory becomes a file: writing fails.
        std::fs::remove_dir_all(&sub).unwrap();
        std::fs::write(&sub, b"in the way").unwrap();
        let err = store.create_identity(301, "k8s:app=db").await.unwrap_err();
        assert!(matches!(err, BackendError::Local { .. }), "{err}");
        assert!(
            err.to_string().starts_with("allocating identity 301 for k8s:app=db"),
            "{err}"
        );
        assert_eq!(store.revision(), revision);
        assert_eq!(store.held_id("k8s:app=db").await.unwrap(), None);
        assert_eq!(store.list_identities().await.unwrap().0.len(), 1);
        std::fs::remove_file(&sub).unwrap();
        assert_eq!(
            store.create_identity(301, "k8s:app=db").await.unwrap(),
            CreateOutcome::Created
        );
        drop(store);
        let store = EmbeddedBackend::open(sub.join("identities.json"), NODE).unwrap();
        assert_eq!(store.list_identities().await.unwrap().0.len(), 2);
    }

    #[tokio::test]
    async fn embedded_lease_renewed_never_completes() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir);
        assert!(
            tokio::time::timeout(Duration::from_millis(100), store.lease_renewed(&mut 0))
                .await
                .is_err()
        );
        store.shutdown().await;
    }
}
