//! The identity store in the Kubernetes API (`--identity-store kubernetes`,
//! Cilium's "CRD mode"): every cluster identity is a cluster-scoped
//! `RivetIdentity` object named by its number, `spec.labels` the canonical
//! label set, and a `rivet.io/labels-hash` label for lookups by labels.
//!
//! # Allocation and the race it closes
//!
//! etcd creates an identity in one transaction that checks both the id and
//! the label set, so two nodes racing on one set end with one id. The API
//! server can only create an object *if its name is free*: a label set is
//! not unique by itself. Two nodes picking different random ids for one new
//! set would both succeed and the set would have two identities.
//!
//! This store closes that window by ordering the ids: it asks the allocator
//! for [`IdOrder::LabelHash`], so every node tries the ids of a new set in
//! the same order, starting at a hash of the labels. Two nodes racing on a
//! set race for the same first free object; the API server lets exactly one
//! create it, and the other gets `409 AlreadyExists`, reads the object,
//! finds its own labels and uses that id ([`CreateOutcome::LabelsHeldAs`]).
//! An id taken by another set sends both to the next id of the same order.
//! What remains: an identity deleted (garbage-collected) on the probe path
//! of a new set while two nodes allocate it can make them see the path
//! differently; GC of unused identities is the operator's (after a grace
//! period), so this needs a GC and a first allocation of the same set on two
//! nodes within one API round trip.
//!
//! # References and GC
//!
//! There are no per-node value keys: objects carry no reference count, and
//! this store never deletes one (svc-identity's RBAC has no `delete`). This
//! node's references are counted locally by the allocator; `release` does
//! nothing here. Which identities are in use is what the `RivetEndpoint`
//! objects say (their `status.identity`); rivet-operator deletes identities
//! no endpoint uses for two GC rounds. Its first round marks the object
//! ([`GC_UNUSED_SINCE_ANNOTATION`]) and its second deletes it with a
//! precondition on the resourceVersion the mark produced: `acquire` of a
//! marked identity removes the mark (a merge patch), which changes the
//! resourceVersion, so a reuse between the rounds makes the delete fail and
//! the identity survives. An identity still held here but deleted anyway is
//! re-created with the same number by the next reconcile pass
//! ([`AcquireOutcome::MasterRecreated`]).
//!
//! # IP cache
//!
//! This node's IP cache entries stay local (svc-loader gets them as always;
//! svc-k8s-sync publishes the pods as `RivetEndpoint`s); the other nodes'
//! pods come from their `RivetEndpoint`s when the store is given a
//! [`ClusterObjects`] ([`KubernetesBackend::with_cluster`]), else none.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use futures::stream::{self, BoxStream, StreamExt};
use rivet_common::labels::Labels;
use rivet_k8s::kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use rivet_k8s::kube::{self, Client, ResourceExt};
use rivet_k8s::{RivetIdentity, RivetIdentitySpec};
use sha2::{Digest, Sha256};

use crate::backend::{
    AcquireOutcome, BackendError, CreateOutcome, IdOrder, IdentityBackend, IdentityEvent, IdentityRecord, IpEntry,
    IpEvent, Revision,
};
use crate::kubernetes_cluster::ClusterObjects;

/// The label holding a hash of the identity labels (for lookups by labels).
pub const LABELS_HASH_LABEL: &str = "rivet.io/labels-hash";

/// The annotation rivet-operator's identity GC marks an unused identity
/// with (an RFC 3339 time); `acquire` removes it (see the module docs).
pub const GC_UNUSED_SINCE_ANNOTATION: &str = "rivet.io/gc-unused-since";

/// The field manager of this store's writes.
const FIELD_MANAGER: &str = "svc-identity";

/// The resource, as errors name it.
const RESOURCE: &str = "rivetidentities.rivet.io";

/// Objects per page when listing.
const PAGE_SIZE: u32 = 500;

/// How long one watch request runs before the API server ends it (the
/// allocator then lists and watches again).
const WATCH_TIMEOUT_SECONDS: u32 = 290;

/// The identity store in the Kubernetes API.
#[derive(Clone)]
pub struct KubernetesBackend {
    identities: Api<RivetIdentity>,
    watch_timeout_seconds: u32,
    /// Watch requests sent, for tests (a resumed watch is a new request).
    watch_requests: Arc<AtomicU64>,
    /// Object reads (GET) sent, for tests.
    reads: Arc<AtomicU64>,
    /// The objects as the listing and the watch (and this node's own reads
    /// and creates) last showed them: `acquire` of an identity known here
    /// needs no request, so a reconcile pass over the held identities costs
    /// the API server nothing while they exist.
    known: Known,
    /// Identities whose object carries the GC mark, as last seen.
    marked: Marked,
    /// The other nodes' pods, for the IP cache.
    cluster: Option<Arc<ClusterObjects>>,
}

/// Identity number → canonical labels.
type Known = Arc<RwLock<BTreeMap<u32, String>>>;

/// Identity numbers whose object carries [`GC_UNUSED_SINCE_ANNOTATION`].
type Marked = Arc<RwLock<BTreeSet<u32>>>;

fn is_marked(object: &RivetIdentity) -> bool {
    object.annotations().contains_key(GC_UNUSED_SINCE_ANNOTATION)
}

impl std::fmt::Debug for KubernetesBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesBackend").finish_non_exhaustive()
    }
}

impl KubernetesBackend {
    /// A store over `client` (nothing is sent yet).
    pub fn new(client: Client) -> Self {
        Self {
            identities: Api::all(client),
            watch_timeout_seconds: WATCH_TIMEOUT_SECONDS,
            watch_requests: Arc::default(),
            reads: Arc::default(),
            known: Known::default(),
            marked: Marked::default(),
            cluster: None,
        }
    }

    /// The same store with the other nodes' pods (their RivetEndpoints) as
    /// its IP cache entries.
    pub fn with_cluster(self, cluster: Arc<ClusterObjects>) -> Self {
        Self {
            cluster: Some(cluster),
            ..self
        }
    }

    /// The same store with watch requests the API server ends after
    /// `seconds` (tests of the resumed watch).
    pub fn with_watch_timeout(self, seconds: u32) -> Self {
        Self {
            watch_timeout_seconds: seconds,
            ..self
        }
    }

    /// Watch requests sent so far.
    pub fn watch_requests(&self) -> u64 {
        self.watch_requests.load(Ordering::Relaxed)
    }

    /// Object reads (GET) sent so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    async fn get(&self, id: u32) -> Result<Option<IdentityRecord>, BackendError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let object = self
            .identities
            .get_opt(&id.to_string())
            .await
            .map_err(|e| api_error(e, "get", format!("reading RivetIdentity {id}")))?;
        let found = object.as_ref().map(record).transpose()?;
        let mut known = self.known.write().expect("known identities poisoned");
        match &found {
            Some(r) => known.insert(id, r.labels.clone()),
            None => known.remove(&id),
        };
        self.note_mark(id, object.as_ref().is_some_and(is_marked));
        Ok(found)
    }

    fn note_mark(&self, id: u32, marked: bool) {
        let mut set = self.marked.write().expect("marked identities poisoned");
        if marked {
            set.insert(id);
        } else {
            set.remove(&id);
        }
    }

    /// Removes the GC mark of `id` (a merge patch: the resourceVersion
    /// changes, so the operator's fenced delete fails). `false` when the
    /// object is gone.
    async fn unmark(&self, id: u32) -> Result<bool, BackendError> {
        let patch = serde_json::json!({ "metadata": { "annotations": { GC_UNUSED_SINCE_ANNOTATION: null } } });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PatchParams::default()
        };
        match self
            .identities
            .patch(&id.to_string(), &params, &Patch::Merge(&patch))
            .await
        {
            Ok(object) => {
                self.note_mark(id, is_marked(&object));
                tracing::info!(id, "removed the GC mark of an identity in use again");
                Ok(true)
            }
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
            Err(e) => Err(api_error(
                e,
                "patch",
                format!("removing the GC mark of RivetIdentity {id}"),
            )),
        }
    }

    /// Creates the object; `Ok(false)` when the name is taken.
    async fn create(&self, id: u32, labels: &str) -> Result<bool, BackendError> {
        let action = || format!("creating RivetIdentity {id} for {labels}");
        let object = identity_object(id, labels).map_err(|detail| BackendError::Corrupt {
            key: labels.to_string(),
            detail,
        })?;
        match self.identities.create(&PostParams::default(), &object).await {
            Ok(_) => {
                let mut known = self.known.write().expect("known identities poisoned");
                known.insert(id, labels.to_string());
                Ok(true)
            }
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(e) => Err(api_error(e, "create", action())),
        }
    }
}

#[tonic::async_trait]
impl IdentityBackend for KubernetesBackend {
    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    fn id_order(&self) -> IdOrder {
        IdOrder::LabelHash
    }

    async fn list_identities(&self) -> Result<(Vec<IdentityRecord>, Revision), BackendError> {
        let mut records = Vec::new();
        let mut marked = BTreeSet::new();
        let mut params = ListParams::default().limit(PAGE_SIZE);
        let mut revision = None;
        loop {
            let page = self
                .identities
                .list(&params)
                .await
                .map_err(|e| api_error(e, "list", "listing RivetIdentities".into()))?;
            // The first page's version: later pages continue its snapshot.
            if revision.is_none() {
                revision = Some(parse_revision(page.metadata.resource_version.as_deref())?);
            }
            for object in &page.items {
                let r = record(object)?;
                if is_marked(object) {
                    marked.insert(r.id);
                }
                records.push(r);
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
        records.sort();
        *self.known.write().expect("known identities poisoned") =
            records.iter().map(|r| (r.id, r.labels.clone())).collect();
        *self.marked.write().expect("marked identities poisoned") = marked;
        Ok((records, revision.unwrap_or_default()))
    }

    /// One watch that resumes by itself: when the API server ends a watch
    /// request (its timeout, 290 s), the next starts
    /// from the last version seen (objects and bookmarks), so the allocator
    /// re-lists only after an error, not every few minutes.
    async fn watch_identities(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<IdentityEvent, BackendError>>, BackendError> {
        let watch = ResumingWatch {
            identities: self.identities.clone(),
            timeout_seconds: self.watch_timeout_seconds,
            requests: self.watch_requests.clone(),
            known: self.known.clone(),
            marked: self.marked.clone(),
            version: after.to_string(),
            events: None,
            failed: false,
        };
        Ok(stream::unfold(watch, |mut watch| async move {
            let event = watch.next().await?;
            Some((event, watch))
        })
        .boxed())
    }

    async fn held_id(&self, labels: &str) -> Result<Option<u32>, BackendError> {
        let selector = format!("{LABELS_HASH_LABEL}={}", labels_hash(labels));
        let listed = self
            .identities
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| api_error(e, "list", format!("looking up the RivetIdentity of {labels}")))?;
        let mut ids = Vec::new();
        for object in &listed.items {
            let r = record(object)?;
            if r.labels == labels {
                ids.push(r.id);
            }
        }
        Ok(ids.into_iter().min())
    }

    async fn create_identity(&self, id: u32, labels: &str) -> Result<CreateOutcome, BackendError> {
        if self.create(id, labels).await? {
            return Ok(CreateOutcome::Created);
        }
        // The name is taken: by this set (another node won the race for
        // the same id) or by another set.
        Ok(match self.get(id).await? {
            Some(existing) if existing.labels == labels => CreateOutcome::LabelsHeldAs(id),
            // Another set, or deleted since: the allocator tries on.
            _ => CreateOutcome::IdTaken,
        })
    }

    /// Known here with these labels: no request (see `known`). Otherwise
    /// read, and re-created with the same number when it is gone. A
    /// marked identity (GC) is unmarked.
    async fn acquire(&self, id: u32, labels: &str) -> Result<AcquireOutcome, BackendError> {
        let known = self.known.read().expect("known identities poisoned").get(&id).cloned();
        let existing = match known {
            Some(known) if known == labels => Some(known),
            _ => self.get(id).await?.map(|r| r.labels),
        };
        match existing {
            Some(existing) if existing == labels => {
                let marked = self.marked.read().expect("marked identities poisoned").contains(&id);
                if !marked || self.unmark(id).await? {
                    return Ok(AcquireOutcome::Acquired);
                }
                // Deleted by the GC meanwhile: re-create it below.
                self.known.write().expect("known identities poisoned").remove(&id);
            }
            Some(_) => return Ok(AcquireOutcome::Conflict),
            None => {}
        }
        if self.create(id, labels).await? {
            return Ok(AcquireOutcome::MasterRecreated);
        }
        Ok(match self.get(id).await? {
            Some(existing) if existing.labels == labels => AcquireOutcome::Acquired,
            _ => AcquireOutcome::Conflict,
        })
    }

    /// Nothing per node to delete (see the module docs).
    async fn release(&self, _labels: &str) -> Result<(), BackendError> {
        Ok(())
    }

    /// No per-node keys: nothing for a pass to delete.
    async fn node_value_keys(&self) -> Result<Vec<String>, BackendError> {
        Ok(Vec::new())
    }

    /// Local only (see the module docs).
    async fn upsert_ip(&self, _entry: &IpEntry) -> Result<(), BackendError> {
        Ok(())
    }

    /// Local only (see the module docs).
    async fn delete_ip(&self, _ip: &str) -> Result<(), BackendError> {
        Ok(())
    }

    /// The other nodes' pods (none without [`ClusterObjects`]).
    async fn list_ips(&self) -> Result<(Vec<IpEntry>, Revision), BackendError> {
        match &self.cluster {
            Some(cluster) => cluster.list_ips().await,
            None => Ok((Vec::new(), 0)),
        }
    }

    /// Their changes (never yields without [`ClusterObjects`]).
    async fn watch_ips(
        &self,
        after: Revision,
    ) -> Result<BoxStream<'static, Result<IpEvent, BackendError>>, BackendError> {
        match &self.cluster {
            Some(cluster) => cluster.watch_ips(after).await,
            None => Ok(stream::pending().boxed()),
        }
    }

    /// No lease: never completes.
    async fn lease_renewed(&self, _seen: &mut u64) {
        std::future::pending::<()>().await;
    }
}

/// The state of one resuming watch (see `watch_identities`).
struct ResumingWatch {
    identities: Api<RivetIdentity>,
    timeout_seconds: u32,
    requests: Arc<AtomicU64>,
    known: Known,
    marked: Marked,
    /// The last resourceVersion seen: where the next request starts.
    version: String,
    events: Option<BoxStream<'static, Result<WatchEvent<RivetIdentity>, kube::Error>>>,
    /// An error was yielded: the stream ends (the allocator re-lists).
    failed: bool,
}

impl ResumingWatch {
    async fn next(&mut self) -> Option<Result<IdentityEvent, BackendError>> {
        if self.failed {
            return None;
        }
        let action = |version: &str| format!("watching RivetIdentities from version {version}");
        loop {
            let events = match &mut self.events {
                Some(events) => events,
                None => {
                    let params = WatchParams::default().timeout(self.timeout_seconds);
                    self.requests.fetch_add(1, Ordering::Relaxed);
                    match self.identities.watch(&params, &self.version).await {
                        Ok(events) => self.events.insert(events.boxed()),
                        Err(e) => return self.fail(api_error(e, "watch", action(&self.version))),
                    }
                }
            };
            let event = match events.next().await {
                // The API server ended the request: resume.
                None => {
                    self.events = None;
                    continue;
                }
                Some(Ok(event)) => event,
                Some(Err(e)) => return self.fail(api_error(e, "watch", action(&self.version))),
            };
            let (object, deleted) = match event {
                WatchEvent::Added(object) | WatchEvent::Modified(object) => (object, false),
                WatchEvent::Deleted(object) => (object, true),
                WatchEvent::Bookmark(bookmark) => {
                    self.version = bookmark.metadata.resource_version;
                    continue;
                }
                // 410 Gone: the version is older than the API server keeps.
                WatchEvent::Error(status) if status.code == 410 => {
                    return self.fail(BackendError::Compacted {
                        what: "RivetIdentities",
                        revision: self.version.parse().unwrap_or_default(),
                        compacted: 0,
                    });
                }
                WatchEvent::Error(status) => {
                    let error = api_error(kube::Error::Api(status), "watch", action(&self.version));
                    return self.fail(error);
                }
            };
            if let Some(version) = object.resource_version() {
                self.version = version;
            }
            let event = if deleted {
                identity_number(&object).map(|id| IdentityEvent::Delete { id })
            } else {
                record(&object).map(IdentityEvent::Upsert)
            };
            if let Ok(id) = identity_number(&object) {
                let mut marked = self.marked.write().expect("marked identities poisoned");
                if !deleted && is_marked(&object) {
                    marked.insert(id);
                } else {
                    marked.remove(&id);
                }
            }
            let mut known = self.known.write().expect("known identities poisoned");
            match &event {
                Ok(IdentityEvent::Upsert(r)) => {
                    known.insert(r.id, r.labels.clone());
                }
                Ok(IdentityEvent::Delete { id }) => {
                    known.remove(id);
                }
                Err(_) => {}
            }
            return Some(event);
        }
    }

    fn fail(&mut self, error: BackendError) -> Option<Result<IdentityEvent, BackendError>> {
        self.failed = true;
        self.events = None;
        Some(Err(error))
    }
}

/// A hash of the canonical labels, short enough for a label value (63).
pub fn labels_hash(labels: &str) -> String {
    let digest = Sha256::digest(labels.as_bytes());
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

fn identity_object(id: u32, labels: &str) -> Result<RivetIdentity, String> {
    let parsed: Labels = labels.parse().map_err(|e| format!("not a label set: {e}"))?;
    Ok(RivetIdentity {
        metadata: ObjectMeta {
            name: Some(id.to_string()),
            labels: Some(BTreeMap::from([(LABELS_HASH_LABEL.to_string(), labels_hash(labels))])),
            ..ObjectMeta::default()
        },
        spec: RivetIdentitySpec {
            labels: parsed.iter().map(ToString::to_string).collect(),
        },
    })
}

fn identity_number(object: &RivetIdentity) -> Result<u32, BackendError> {
    let name = object.name_any();
    name.parse().map_err(|_| BackendError::Corrupt {
        key: format!("RivetIdentity {name}"),
        detail: "the name is not an identity number".into(),
    })
}

fn record(object: &RivetIdentity) -> Result<IdentityRecord, BackendError> {
    let id = identity_number(object)?;
    let labels = Labels::parse(&object.spec.labels).map_err(|e| BackendError::Corrupt {
        key: format!("RivetIdentity {id}"),
        detail: format!("spec.labels: {e}"),
    })?;
    Ok(IdentityRecord {
        id,
        labels: labels.to_string(),
    })
}

fn parse_revision(version: Option<&str>) -> Result<Revision, BackendError> {
    version
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| BackendError::Corrupt {
            key: "RivetIdentities".into(),
            detail: format!("resourceVersion {version:?} is not a number"),
        })
}

/// Errors of the API: refusals (RBAC, validation) are typed with the verb
/// and resource; server errors, throttling and transport failures mean the
/// store is unavailable (retry).
fn api_error(error: kube::Error, verb: &'static str, action: String) -> BackendError {
    match error {
        kube::Error::Api(status) if (400..500).contains(&status.code) && status.code != 429 => BackendError::Refused {
            action,
            verb,
            resource: RESOURCE,
            code: status.code,
            message: status.message.clone(),
        },
        other => BackendError::Unavailable {
            action,
            detail: other.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_hold_the_canonical_labels_and_their_hash() {
        let labels = "k8s:app=web,k8s:io.kubernetes.pod.namespace=shop";
        let object = identity_object(70001, labels).unwrap();
        assert_eq!(object.metadata.name.as_deref(), Some("70001"));
        assert_eq!(
            object.spec.labels,
            ["k8s:app=web", "k8s:io.kubernetes.pod.namespace=shop"]
        );
        let hash = &object.metadata.labels.as_ref().unwrap()[LABELS_HASH_LABEL];
        assert_eq!(hash.len(), 32);
        assert_ne!(hash, &labels_hash("k8s:app=db,k8s:io.kubernetes.pod.namespace=shop"));
        assert_eq!(
            record(&object).unwrap(),
            IdentityRecord {
                id: 70001,
                labels: labels.into()
            }
        );
    }

    #[test]
    fn an_object_with_a_bad_name_or_labels_is_corrupt_and_named() {
        let mut object = identity_object(300, "k8s:app=web").unwrap();
        object.metadata.name = Some("web".into());
        assert_eq!(
            record(&object).unwrap_err().to_string(),
            "RivetIdentity web: stored value is invalid: the name is not an identity number"
        );
        let mut object = identity_object(300, "k8s:app=web").unwrap();
        object.spec.labels = vec!["=".into()];
        assert!(
            record(&object)
                .unwrap_err()
                .to_string()
                .starts_with("RivetIdentity 300: stored value is invalid: spec.labels:")
        );
    }
}
