//! Feeding svc-endpoint (DESIGN.md §1, level-triggered): a reconcile
//! controller that compares what the watch caches say ([`Desired`]) with
//! what svc-endpoint was last told and sends the difference as single calls
//! (SetPodMetadata, SetNamespaceLabels, UpsertPolicy, ApplyServiceObject,
//! ...). It sends the
//! whole state as one ReplayKubernetes stream instead the first time, after
//! a re-list of any watched kind, and whenever svc-endpoint's `boot_id`
//! changed (it restarted and remembers nothing), so svc-endpoint forgets
//! what Kubernetes no longer says and regenerates only what changed.
//!
//! Nothing is sent before every watch cache completed its initial list: a
//! partial list would make svc-endpoint forget pods and policies that exist.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rivet_common::controller::{Action, Controller, Controllers, Trigger};
use rivet_common::grpc::{ClientOptions, DaemonChannel, RpcError, connect_unix_lazy};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::endpoint_service_client::EndpointServiceClient;
use rivet_proto::endpoint::v1::namespace_service_client::NamespaceServiceClient;
use rivet_proto::endpoint::v1::pod_metadata_service_client::PodMetadataServiceClient;
use rivet_proto::endpoint::v1::policy_service_client::PolicyServiceClient;
use rivet_proto::endpoint::v1::service_catalog_service_client::ServiceCatalogServiceClient;

use crate::desired::{Change, Desired};
use crate::events::SyncMetrics;
use crate::watch::WatchStatus;

/// A failed call to svc-endpoint.
#[derive(Debug, Clone, thiserror::Error)]
#[error("svc-endpoint {call}: {source}")]
pub struct FeedError {
    /// The rpc (`SetPodMetadata`, `ReplayKubernetes`, ...).
    pub call: &'static str,
    /// What it answered.
    #[source]
    pub source: RpcError<pb::ErrorReason>,
}

impl FeedError {
    fn new(call: &'static str, status: tonic::Status) -> Self {
        Self {
            call,
            source: status.into(),
        }
    }

    /// svc-endpoint refused this one item (an invalid document, a policy
    /// source the node does not accept, a key held by another origin, a
    /// call it does not serve): retrying it at once would not help.
    pub fn is_rejection(&self) -> bool {
        matches!(
            self.source.code(),
            tonic::Code::InvalidArgument | tonic::Code::Unimplemented
        ) || self.source.is(pb::ErrorReason::PolicyOriginDisabled)
            || self.source.is(pb::ErrorReason::PolicyOriginConflict)
            || self.source.is(pb::ErrorReason::ServiceOriginConflict)
            || self.is_retried_on_poll()
    }

    /// A rejection that may pass once other objects change (a clusterIP
    /// still held by a Service deleted in the API but not yet here): it is
    /// not recorded as sent, so every poll tries it again.
    pub fn is_retried_on_poll(&self) -> bool {
        self.source.is(pb::ErrorReason::ClusterIpUnavailable)
    }

    fn label(&self) -> &'static str {
        rivet_common::grpc::code_label(self.source.code())
    }
}

type CallFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, FeedError>> + Send + 'a>>;

/// svc-endpoint's side of the feed; each call returns the `boot_id` it
/// answered with.
pub trait EndpointFeed: Send + Sync {
    /// One incremental change.
    fn apply<'a>(&'a self, change: &'a Change) -> CallFuture<'a, String>;
    /// The whole state.
    fn replay(&self, items: Vec<pb::ReplayKubernetesRequest>) -> CallFuture<'_, pb::ReplayKubernetesResponse>;
    /// Who answers now (no change).
    fn boot_id(&self) -> CallFuture<'_, String>;
}

/// svc-endpoint over its socket (connected lazily; it may start later or
/// restart).
#[derive(Clone, Debug)]
pub struct GrpcFeed {
    channel: DaemonChannel,
}

impl GrpcFeed {
    /// A client of svc-endpoint at `socket`.
    pub fn new(socket: &Path) -> Self {
        let options = ClientOptions {
            request_timeout: Duration::from_secs(30),
            ..ClientOptions::default()
        };
        Self {
            channel: connect_unix_lazy(socket, &options),
        }
    }
}

impl EndpointFeed for GrpcFeed {
    fn apply<'a>(&'a self, change: &'a Change) -> CallFuture<'a, String> {
        Box::pin(async move {
            let channel = self.channel.clone();
            match change {
                Change::SetPod(metadata) => PodMetadataServiceClient::new(channel)
                    .set_pod_metadata(pb::SetPodMetadataRequest {
                        metadata: Some(metadata.clone()),
                        wait: false,
                    })
                    .await
                    .map(|r| r.into_inner().boot_id)
                    .map_err(|s| FeedError::new("SetPodMetadata", s)),
                Change::DeletePod((namespace, name)) => PodMetadataServiceClient::new(channel)
                    .delete_pod_metadata(pb::DeletePodMetadataRequest {
                        pod: Some(pb::PodRef {
                            namespace: namespace.clone(),
                            name: name.clone(),
                        }),
                    })
                    .await
                    .map(|r| r.into_inner().boot_id)
                    .map_err(|s| FeedError::new("DeletePodMetadata", s)),
                Change::SetNamespace(namespace, labels) => NamespaceServiceClient::new(channel)
                    .set_namespace_labels(pb::SetNamespaceLabelsRequest {
                        namespace: namespace.clone(),
                        labels: labels.clone(),
                    })
                    .await
                    .map(|r| r.into_inner().boot_id)
                    .map_err(|s| FeedError::new("SetNamespaceLabels", s)),
                Change::UpsertPolicy(_, document) => PolicyServiceClient::new(channel)
                    .upsert_policy(pb::UpsertPolicyRequest {
                        document: document.clone(),
                        origin: pb::PolicyOrigin::Kubernetes.into(),
                        wait: false,
                    })
                    .await
                    .map(|r| r.into_inner().boot_id)
                    .map_err(|s| FeedError::new("UpsertPolicy", s)),
                Change::DeletePolicy((kind, namespace, name)) => PolicyServiceClient::new(channel)
                    .delete_policy(pb::DeletePolicyRequest {
                        key: Some(pb::PolicyKey {
                            kind: kind.clone(),
                            namespace: namespace.clone(),
                            name: name.clone(),
                        }),
                        origin: pb::PolicyOrigin::Kubernetes.into(),
                        wait: false,
                    })
                    .await
                    .map(|r| r.into_inner().boot_id)
                    .map_err(|s| FeedError::new("DeletePolicy", s)),
                Change::ApplyServiceObject(_, document) => {
                    let mut client = ServiceCatalogServiceClient::new(channel.clone());
                    client
                        .apply_service_object(pb::ApplyServiceObjectRequest {
                            document: document.clone(),
                            origin: pb::ServiceOrigin::Kubernetes.into(),
                            wait: false,
                        })
                        .await
                        .map_err(|s| FeedError::new("ApplyServiceObject", s))?;
                    boot_id_of(channel).await
                }
                Change::DeleteServiceObject((kind, namespace, name)) => {
                    let mut client = ServiceCatalogServiceClient::new(channel.clone());
                    client
                        .delete_service_object(pb::DeleteServiceObjectRequest {
                            key: Some(pb::ServiceObjectKey {
                                kind: (*kind).into(),
                                namespace: namespace.clone(),
                                name: name.clone(),
                            }),
                            origin: pb::ServiceOrigin::Kubernetes.into(),
                            wait: false,
                        })
                        .await
                        .map_err(|s| FeedError::new("DeleteServiceObject", s))?;
                    boot_id_of(channel).await
                }
            }
        })
    }

    fn replay(&self, items: Vec<pb::ReplayKubernetesRequest>) -> CallFuture<'_, pb::ReplayKubernetesResponse> {
        Box::pin(async move {
            PodMetadataServiceClient::new(self.channel.clone())
                .replay_kubernetes(tokio_stream::iter(items))
                .await
                .map(|r| r.into_inner())
                .map_err(|s| FeedError::new("ReplayKubernetes", s))
        })
    }

    fn boot_id(&self) -> CallFuture<'_, String> {
        Box::pin(boot_id_of(self.channel.clone()))
    }
}

/// svc-endpoint's boot_id by GetStatus (the catalog's answers carry none).
async fn boot_id_of(channel: DaemonChannel) -> Result<String, FeedError> {
    EndpointServiceClient::new(channel)
        .get_status(pb::GetStatusRequest {})
        .await
        .map(|r| r.into_inner().boot_id)
        .map_err(|s| FeedError::new("GetStatus", s))
}

/// What the feed did, for GetStatus.
#[derive(Clone, Debug, Default)]
pub struct FeedStatus {
    /// The last call reached svc-endpoint.
    pub connected: bool,
    /// svc-endpoint's boot_id as last seen.
    pub seen_boot_id: String,
    /// Completed replays.
    pub replays: u64,
    /// When the last replay completed.
    pub last_replay_unix_nanos: i64,
    /// The last failure or rejection; empty after a clean pass.
    pub last_error: String,
}

/// What svc-endpoint was told, and when to tell it everything again.
#[derive(Debug, Default)]
struct Sent {
    /// `None`: a replay is due.
    state: Option<Desired>,
    /// `WatchStatus::relists` at the last replay.
    relists: u64,
    boot_id: String,
}

/// The feed controller's state.
pub struct Feed {
    client: Arc<dyn EndpointFeed>,
    status: Arc<WatchStatus>,
    desired: Box<dyn Fn() -> Desired + Send + Sync>,
    sent: tokio::sync::Mutex<Sent>,
    report: Mutex<FeedStatus>,
    metrics: SyncMetrics,
    poll: Duration,
}

impl std::fmt::Debug for Feed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feed")
            .field("report", &self.report())
            .finish_non_exhaustive()
    }
}

impl Feed {
    /// A feed of `client` from the caches behind `status`; `desired` reads
    /// the caches. `poll` is how often svc-endpoint's boot_id is checked
    /// when there is nothing to send.
    pub fn new(
        client: Arc<dyn EndpointFeed>,
        status: Arc<WatchStatus>,
        desired: impl Fn() -> Desired + Send + Sync + 'static,
        metrics: SyncMetrics,
        poll: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            client,
            status,
            desired: Box::new(desired),
            sent: Default::default(),
            report: Default::default(),
            metrics,
            poll,
        })
    }

    /// What the feed did.
    pub fn report(&self) -> FeedStatus {
        self.report.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn update(&self, f: impl FnOnce(&mut FeedStatus)) {
        f(&mut self.report.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// Runs the feed as controller `feed-svc-endpoint`, woken by `trigger`
    /// (fire it on every cache change and when svc-endpoint's boot_id may
    /// have changed).
    pub fn start(self: &Arc<Self>, controllers: &Controllers, trigger: &Trigger) {
        let feed = self.clone();
        controllers.reconcile(Controller::new("feed-svc-endpoint").trigger(trigger), move || {
            let feed = feed.clone();
            async move { feed.pass().await }
        });
    }

    /// One pass: replay or send the difference.
    pub async fn pass(&self) -> Result<Action, FeedError> {
        if !self.status.all_synced() {
            // Woken again by the cache events.
            return Ok(Action::await_change());
        }
        let desired = (self.desired)();
        let relists = self.status.relists();
        let mut sent = self.sent.lock().await;
        let result = self.send(&mut sent, desired, relists).await;
        match &result {
            Ok(_) => self.update(|r| r.connected = true),
            Err(e) => {
                self.metrics.call_failed(e.call, e.label(), &e.to_string());
                let connected = !matches!(
                    e.source.code(),
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
                );
                self.update(|r| {
                    r.connected = connected;
                    r.last_error = e.to_string();
                });
            }
        }
        result
    }

    async fn send(&self, sent: &mut Sent, desired: Desired, relists: u64) -> Result<Action, FeedError> {
        let why = match &sent.state {
            None if sent.boot_id.is_empty() => Some("start"),
            None => Some("svc-endpoint restarted"),
            Some(_) if sent.relists != relists => Some("re-list"),
            Some(_) => None,
        };
        if let Some(why) = why {
            let response = self.client.replay(desired.replay_items()).await?;
            self.metrics.call_ok("ReplayKubernetes");
            self.metrics.replayed(&response.boot_id, why, &response);
            let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
            let rejected = response
                .rejected
                .iter()
                .map(|r| format!("{}: {}", r.item, r.error))
                .collect::<Vec<_>>()
                .join("; ");
            self.update(|r| {
                r.replays += 1;
                r.last_replay_unix_nanos = now.as_nanos() as i64;
                r.seen_boot_id = response.boot_id.clone();
                r.last_error = rejected;
            });
            *sent = Sent {
                state: Some(desired.without_retried_refusals(&response.rejected)),
                relists,
                boot_id: response.boot_id,
            };
            return Ok(Action::requeue(self.poll));
        }
        let state = sent.state.as_mut().expect("checked above");
        let changes = desired.changes_from(state);
        if changes.is_empty() {
            let boot_id = self.client.boot_id().await?;
            return Ok(self.check_boot(sent, boot_id));
        }
        let mut rejections = Vec::new();
        for change in &changes {
            let boot_id = match self.client.apply(change).await {
                Ok(boot_id) => {
                    self.metrics.call_ok(call_name(change));
                    boot_id
                }
                Err(e) if e.is_rejection() => {
                    // Kept as sent: it is retried when the object changes,
                    // not in a loop (or on the next poll, see
                    // `is_retried_on_poll`).
                    self.metrics.call_failed(e.call, e.label(), &e.to_string());
                    rejections.push(e.to_string());
                    if e.is_retried_on_poll() {
                        continue;
                    }
                    sent.boot_id.clone()
                }
                Err(e) => return Err(e),
            };
            if boot_id != sent.boot_id {
                return Ok(self.check_boot(sent, boot_id));
            }
            sent.state.as_mut().expect("checked above").apply(change);
        }
        self.update(|r| r.last_error = rejections.join("; "));
        Ok(Action::requeue(self.poll))
    }

    /// A new boot_id: svc-endpoint restarted; replay at once.
    fn check_boot(&self, sent: &mut Sent, boot_id: String) -> Action {
        if boot_id == sent.boot_id {
            return Action::requeue(self.poll);
        }
        tracing::info!(
            previous = sent.boot_id,
            boot_id,
            "svc-endpoint restarted (new boot_id): replaying the whole state"
        );
        sent.state = None;
        sent.boot_id = boot_id;
        Action::requeue(Duration::ZERO)
    }
}

fn call_name(change: &Change) -> &'static str {
    match change {
        Change::SetPod(_) => "SetPodMetadata",
        Change::DeletePod(_) => "DeletePodMetadata",
        Change::SetNamespace(..) => "SetNamespaceLabels",
        Change::UpsertPolicy(..) => "UpsertPolicy",
        Change::DeletePolicy(_) => "DeletePolicy",
        Change::ApplyServiceObject(..) => "ApplyServiceObject",
        Change::DeleteServiceObject(_) => "DeleteServiceObject",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desired::pod_metadata;
    use pb::replay_kubernetes_request::Item;

    /// svc-endpoint as the feed sees it: records calls, answers with a
    /// boot_id the test sets, refuses what the test says.
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<String>>,
        boot_id: Mutex<String>,
        refuse_upserts: std::sync::atomic::AtomicBool,
        cluster_ip_taken: std::sync::atomic::AtomicBool,
    }

    impl Recorder {
        fn take(&self) -> Vec<String> {
            std::mem::take(&mut self.calls.lock().unwrap())
        }
        fn boot(&self) -> String {
            self.boot_id.lock().unwrap().clone()
        }
        /// Whether service documents are refused with CLUSTER_IP_UNAVAILABLE.
        fn cluster_ip_taken(&self, taken: bool) {
            self.cluster_ip_taken.store(taken, std::sync::atomic::Ordering::SeqCst);
        }
        /// Desired holds one Service, shop/web.
        fn web_service(desired: &Mutex<Desired>) {
            let key = (pb::ServiceObjectKind::Service, "shop".to_string(), "web".to_string());
            desired
                .lock()
                .unwrap()
                .service_objects
                .insert(key, "{\"kind\":\"Service\"}".into());
        }
    }

    impl EndpointFeed for Recorder {
        fn apply<'a>(&'a self, change: &'a Change) -> CallFuture<'a, String> {
            Box::pin(async move {
                if matches!(change, Change::UpsertPolicy(..))
                    && self.refuse_upserts.load(std::sync::atomic::Ordering::SeqCst)
                {
                    return Err(FeedError::new(
                        "UpsertPolicy",
                        tonic::Status::invalid_argument("spec: bad"),
                    ));
                }
                if matches!(change, Change::ApplyServiceObject(..))
                    && self.cluster_ip_taken.load(std::sync::atomic::Ordering::SeqCst)
                {
                    return Err(FeedError::new(
                        "ApplyServiceObject",
                        rivet_common::grpc::status_with_reason(
                            tonic::Code::AlreadyExists,
                            "clusterIP 198.19.128.10 belongs to shop/old",
                            pb::ErrorReason::ClusterIpUnavailable,
                        ),
                    ));
                }
                self.calls.lock().unwrap().push(call_name(change).to_string());
                Ok(self.boot())
            })
        }
        fn replay(&self, items: Vec<pb::ReplayKubernetesRequest>) -> CallFuture<'_, pb::ReplayKubernetesResponse> {
            Box::pin(async move {
                self.calls.lock().unwrap().push(format!("Replay({})", items.len()));
                let taken = self.cluster_ip_taken.load(std::sync::atomic::Ordering::SeqCst);
                // Refuses every service document as its catalog would.
                let rejected = items
                    .iter()
                    .enumerate()
                    .filter(|(_, item)| taken && matches!(item.item, Some(Item::ServiceDocument(_))))
                    .map(|(i, _)| pb::ReplayItemError {
                        item: format!("item {}", i + 1),
                        error: "clusterIP 198.19.128.10 belongs to shop/old".into(),
                        reason: pb::ErrorReason::ClusterIpUnavailable as i32,
                        service_object: Some(pb::ServiceObjectKey {
                            kind: pb::ServiceObjectKind::Service as i32,
                            namespace: "shop".into(),
                            name: "web".into(),
                        }),
                    })
                    .collect();
                Ok(pb::ReplayKubernetesResponse {
                    boot_id: self.boot(),
                    rejected,
                    ..Default::default()
                })
            })
        }
        fn boot_id(&self) -> CallFuture<'_, String> {
            Box::pin(async move { Ok(self.boot()) })
        }
    }

    fn pod(name: &str, app: &str) -> pb::PodMetadata {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "shop", "name": name, "uid": name, "labels": {"app": app}}
        }))
        .unwrap();
        pod_metadata(&pod).unwrap()
    }

    struct Fixture {
        feed: Arc<Feed>,
        recorder: Arc<Recorder>,
        status: Arc<WatchStatus>,
        desired: Arc<Mutex<Desired>>,
    }

    fn fixture() -> Fixture {
        let recorder = Arc::new(Recorder::default());
        *recorder.boot_id.lock().unwrap() = "boot-1".into();
        let status = Arc::new(WatchStatus::default());
        status.register("Pod");
        let desired = Arc::new(Mutex::new(Desired::default()));
        let source = desired.clone();
        let feed = Feed::new(
            recorder.clone(),
            status.clone(),
            move || source.lock().unwrap().clone(),
            SyncMetrics::default(),
            Duration::from_secs(1),
        );
        Fixture {
            feed,
            recorder,
            status,
            desired,
        }
    }

    #[tokio::test]
    async fn nothing_is_sent_before_the_caches_synced_then_one_replay_then_only_changes() {
        let f = fixture();
        f.desired
            .lock()
            .unwrap()
            .pods
            .insert(("shop".into(), "a".into()), pod("a", "web"));
        assert_eq!(f.feed.pass().await.unwrap(), Action::await_change());
        assert!(
            f.recorder.take().is_empty(),
            "nothing before the initial list completed"
        );

        f.status.update("Pod", |s| s.synced = true);
        f.feed.pass().await.unwrap();
        assert_eq!(f.recorder.take(), ["Replay(2)"], "one pod and `end`");
        assert_eq!(f.feed.report().replays, 1);

        f.feed.pass().await.unwrap();
        assert!(f.recorder.take().is_empty(), "no change, no call");

        f.desired
            .lock()
            .unwrap()
            .pods
            .insert(("shop".into(), "a".into()), pod("a", "db"));
        f.desired
            .lock()
            .unwrap()
            .pods
            .insert(("shop".into(), "b".into()), pod("b", "web"));
        f.feed.pass().await.unwrap();
        assert_eq!(f.recorder.take(), ["SetPodMetadata", "SetPodMetadata"]);
        f.desired.lock().unwrap().pods.remove(&("shop".into(), "a".into()));
        f.feed.pass().await.unwrap();
        assert_eq!(f.recorder.take(), ["DeletePodMetadata"]);
    }

    #[tokio::test]
    async fn a_new_boot_id_or_a_relist_replays_everything() {
        let f = fixture();
        f.status.update("Pod", |s| s.synced = true);
        f.feed.pass().await.unwrap();
        f.recorder.take();

        *f.recorder.boot_id.lock().unwrap() = "boot-2".into();
        assert_eq!(
            f.feed.pass().await.unwrap(),
            Action::requeue(Duration::ZERO),
            "the poll sees the restart"
        );
        f.feed.pass().await.unwrap();
        assert_eq!(f.recorder.take(), ["Replay(1)"]);
        assert_eq!(f.feed.report().seen_boot_id, "boot-2");

        f.status.update("Pod", |s| s.relists += 1);
        f.feed.pass().await.unwrap();
        assert_eq!(f.recorder.take(), ["Replay(1)"], "a re-list replays");
        assert_eq!(f.feed.report().replays, 3);
    }

    #[tokio::test]
    async fn a_refused_document_is_reported_and_not_retried_until_it_changes() {
        let f = fixture();
        f.status.update("Pod", |s| s.synced = true);
        f.feed.pass().await.unwrap();
        f.recorder.take();
        f.recorder
            .refuse_upserts
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let key = ("NetworkPolicy".to_string(), "shop".to_string(), "p".to_string());
        f.desired
            .lock()
            .unwrap()
            .policies
            .insert(key.clone(), "{\"bad\":1}".into());
        f.feed.pass().await.unwrap();
        assert!(
            f.feed.report().last_error.contains("spec: bad"),
            "{:?}",
            f.feed.report()
        );
        f.recorder
            .refuse_upserts
            .store(false, std::sync::atomic::Ordering::SeqCst);
        f.feed.pass().await.unwrap();
        assert!(
            f.recorder.take().is_empty(),
            "the same refused document is not sent again"
        );
        f.desired.lock().unwrap().policies.insert(key, "{\"good\":1}".into());
        f.feed.pass().await.unwrap();
        assert_eq!(f.recorder.take(), ["UpsertPolicy"]);
    }

    #[tokio::test]
    async fn a_cluster_ip_conflict_is_retried_on_the_next_poll_not_kept_as_sent() {
        let f = fixture();
        f.status.update("Pod", |s| s.synced = true);
        f.feed.pass().await.unwrap();
        f.recorder.take();
        f.recorder.cluster_ip_taken(true);
        Recorder::web_service(&f.desired);
        f.feed.pass().await.unwrap();
        assert!(
            f.feed.report().last_error.contains("belongs to shop/old"),
            "{:?}",
            f.feed.report()
        );
        assert!(f.recorder.take().is_empty());
        f.recorder.cluster_ip_taken(false);
        f.feed.pass().await.unwrap();
        assert_eq!(f.recorder.take(), ["ApplyServiceObject"], "tried again");
        assert_eq!(f.feed.report().last_error, "");
        f.feed.pass().await.unwrap();
        assert!(f.recorder.take().is_empty(), "then kept as sent");
    }

    #[tokio::test]
    async fn a_cluster_ip_conflict_in_a_replay_is_retried_on_the_next_poll() {
        let f = fixture();
        f.recorder.cluster_ip_taken(true);
        Recorder::web_service(&f.desired);
        f.status.update("Pod", |s| s.synced = true);
        f.feed.pass().await.unwrap();
        assert_eq!(f.recorder.take(), ["Replay(2)"]);
        assert!(
            f.feed.report().last_error.contains("belongs to shop/old"),
            "{:?}",
            f.feed.report()
        );
        f.recorder.cluster_ip_taken(false);
        f.feed.pass().await.unwrap();
        assert_eq!(
            f.recorder.take(),
            ["ApplyServiceObject"],
            "tried again, not kept as sent"
        );
        f.feed.pass().await.unwrap();
        assert!(f.recorder.take().is_empty(), "then kept as sent");
    }
}
