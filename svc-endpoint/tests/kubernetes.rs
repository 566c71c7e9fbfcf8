//! svc-endpoint's side of Kubernetes (issue 14), against the real daemons
//! and namespace pods: WatchEndpoints (what svc-k8s-sync writes
//! RivetEndpoint objects from); Kubernetes mode (`--k8s-sync-socket`): the
//! init identity until a pod's metadata arrives, PodMetadataService and its
//! level-triggered replay, policy sources; restore asking svc-k8s-sync's
//! PodDirectory whether each pod still exists. The PodDirectory is served
//! by the test over a Unix socket ([`Directory`]); svc-k8s-sync's own tests
//! prove the wiring with the real API server.

mod support;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use rivet_common::grpc::{DaemonChannel, connect_unix, error_reason};
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::namespace_service_client::NamespaceServiceClient;
use rivet_proto::endpoint::v1::pod_metadata_service_client::PodMetadataServiceClient;
use rivet_proto::endpoint::v1::service_catalog_service_client::ServiceCatalogServiceClient;
use rivet_proto::endpoint::v1::watch_endpoints_response::Event;
use rivet_proto::k8s::v1 as k8spb;
use rivet_testkit::node::{EndpointNode, NodeOptions};
use support::{endpoint_status, eventually, options, pings, start_manager, until};
use svc_endpoint::endpoint::EndpointState;
use svc_endpoint::manager::{EndpointEvent, EndpointSelector, NewEndpoint};
use svc_endpoint::service::validate_create;
use tokio::sync::{oneshot, watch};
use tonic::{Code, Request, Response, Status, Streaming};

/// How long one watch event may take to arrive.
const EVENT_WAIT: Duration = Duration::from_secs(20);

async fn node(endpoint_args: &[&str]) -> EndpointNode {
    EndpointNode::start(NodeOptions {
        endpoint_args: endpoint_args.iter().map(ToString::to_string).collect(),
        ..NodeOptions::default()
    })
    .await
    .expect("the node's daemons start")
}

/// The next event of a watch, within [`EVENT_WAIT`].
async fn next_event(watch: &mut Streaming<pb::WatchEndpointsResponse>, what: &str) -> Event {
    tokio::time::timeout(EVENT_WAIT, watch.message())
        .await
        .unwrap_or_else(|_| panic!("{what}: no watch event within {EVENT_WAIT:?}"))
        .unwrap_or_else(|e| panic!("{what}: the watch failed: {e}"))
        .unwrap_or_else(|| panic!("{what}: the watch ended"))
        .event
        .unwrap_or_else(|| panic!("{what}: an event without content"))
}

/// Reads events until `done` holds for one; returns it (the others before
/// it are intermediate states).
async fn until_event(
    watch: &mut Streaming<pb::WatchEndpointsResponse>,
    what: &str,
    done: impl Fn(&Event) -> bool,
) -> Event {
    let mut seen = Vec::new();
    loop {
        let event = tokio::time::timeout(EVENT_WAIT, next_event(watch, what))
            .await
            .unwrap_or_else(|_| panic!("{what}: not seen within {EVENT_WAIT:?}; seen {seen:?}"));
        if done(&event) {
            return event;
        }
        seen.push(event);
    }
}

fn upserted(event: &Event, id: u32, state: pb::EndpointState) -> bool {
    matches!(event, Event::Upserted(e) if e.id == id && e.state == state as i32)
}

/// WatchEndpoints over the real daemon: the snapshot (one `upserted` per
/// endpoint, then `synced`), then creations, label changes with the new
/// identity, and a removal carrying the endpoint's last state.
#[tokio::test(flavor = "multi_thread")]
async fn watch_endpoints_sends_the_snapshot_then_changes_and_removals() {
    let mut node = node(&[]).await;
    let a = node.add_pod("a", &["k8s:app=a"]).await;
    let mut watch = node
        .endpoints()
        .await
        .watch_endpoints(pb::WatchEndpointsRequest { include_history: true })
        .await
        .expect("WatchEndpoints is served")
        .into_inner();

    // The snapshot: a, ready, then synced.
    match next_event(&mut watch, "the snapshot").await {
        Event::Upserted(e) => {
            assert_eq!(e.id, a.id);
            assert_eq!(e.state, pb::EndpointState::Ready as i32, "{e:?}");
            assert_eq!(e.identity, a.identity);
            assert!(!e.state_history.is_empty(), "include_history fills the history");
        }
        other => panic!("the snapshot starts with the endpoint: {other:?}"),
    }
    assert!(
        matches!(next_event(&mut watch, "synced").await, Event::Synced(true)),
        "synced follows the snapshot"
    );

    // A creation: b arrives, and ends ready with its identity.
    let b = node.add_pod("b", &["k8s:app=b"]).await;
    let Event::Upserted(seen) =
        until_event(&mut watch, "b ready", |e| upserted(e, b.id, pb::EndpointState::Ready)).await
    else {
        unreachable!()
    };
    assert_eq!(seen.identity, b.identity);
    assert_eq!(seen.pod_name, "b");

    // A label change: a's new identity arrives.
    let relabelled = node
        .endpoints()
        .await
        .update_labels(pb::UpdateLabelsRequest {
            r#ref: Some(pb::EndpointRef {
                r#ref: Some(pb::endpoint_ref::Ref::Id(a.id)),
            }),
            labels: vec!["k8s:app=a2".into()],
            r#async: false,
        })
        .await
        .expect("relabelling a")
        .into_inner();
    let new_identity = relabelled.endpoints[0].identity;
    assert_ne!(new_identity, a.identity);
    until_event(&mut watch, "a's new identity", |e| {
        matches!(e, Event::Upserted(e) if e.id == a.id && e.identity == new_identity
            && e.state == pb::EndpointState::Ready as i32)
    })
    .await;

    // A removal: b is removed, with its last state.
    assert_eq!(node.delete_endpoint(b.id).await, vec![b.id]);
    let Event::Removed(gone) = until_event(&mut watch, "b removed", |e| matches!(e, Event::Removed(_))).await else {
        unreachable!()
    };
    assert_eq!(gone.id, b.id, "the removed endpoint is b");
    assert_eq!(gone.pod_name, "b", "the removal carries the endpoint");
    assert_eq!(gone.state, pb::EndpointState::Disconnected as i32);
}

/// A reader that does not read never holds the manager up, and when it
/// reads it gets the latest state of each endpoint, coalesced: one event per
/// endpoint, not one per change.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_watch_reader_never_blocks_the_manager_and_gets_the_latest_state_coalesced() {
    let mut node = EndpointNode::start(NodeOptions {
        without_endpoint_daemon: true,
        ..NodeOptions::default()
    })
    .await
    .expect("the node's daemons start");
    for pod in ["a", "b", "c"] {
        node.add_pod_interface(pod).await;
    }
    let state = tempfile::tempdir().unwrap();
    let (manager, _controllers) = start_manager(options(state.path()), node.dependencies());
    manager.restored().await;
    let mut watch = Box::pin(manager.watch());
    // Read the (empty) snapshot: synced.
    let first = tokio::time::timeout(EVENT_WAIT, watch.next()).await.unwrap().unwrap();
    assert!(matches!(first, EndpointEvent::Synced), "{first:?}");

    // Many changes while the reader does not read: each create goes through
    // several states, then relabels.
    let mut ids = Vec::new();
    for pod in ["a", "b", "c"] {
        let (view, _) = manager
            .create(
                NewEndpoint {
                    spec: validate_create(&node.create_request(pod, &["k8s:app=x"])).unwrap(),
                    sync: true,
                },
                Duration::from_secs(20),
            )
            .await
            .expect("creates complete while the reader does not read");
        ids.push(view.spec.id);
    }
    manager
        .update_labels(
            &EndpointSelector::Id(ids[0]),
            rivet_common::labels::Labels::parse(["k8s:app=y"]).unwrap(),
            true,
            Duration::from_secs(20),
        )
        .await
        .expect("relabelling completes while the reader does not read");

    // One event per endpoint, each its current (ready) state.
    let mut seen = Vec::new();
    for _ in 0..ids.len() {
        match tokio::time::timeout(EVENT_WAIT, watch.next()).await.unwrap().unwrap() {
            EndpointEvent::Upserted(view) => {
                assert_eq!(view.status.state, EndpointState::Ready, "the latest state: {view:?}");
                seen.push(view);
            }
            other => panic!("only upserts: {other:?}"),
        }
    }
    seen.sort_by_key(|v| v.spec.id);
    assert_eq!(seen.iter().map(|v| v.spec.id).collect::<Vec<_>>(), ids);
    assert!(
        seen[0].status.identity_labels.to_string().contains("k8s:app=y"),
        "the relabelled endpoint arrives with its new labels: {:?}",
        seen[0].status.identity_labels
    );
}

// ------------------------------------------------------ Kubernetes mode --

/// What the test's PodDirectory answers.
#[derive(Debug, Default)]
struct DirectoryState {
    /// Whether its caches are synced (else UNAVAILABLE / CACHE_NOT_SYNCED).
    synced: bool,
    /// Pods it says are gone (namespace, name); every other is present.
    absent: BTreeSet<(String, String)>,
}

/// svc-k8s-sync's PodDirectory as the test says, counting lookups.
#[derive(Clone)]
struct DirectoryService {
    state: Arc<Mutex<DirectoryState>>,
    lookups: Arc<watch::Sender<u32>>,
}

#[tonic::async_trait]
impl k8spb::pod_directory_server::PodDirectory for DirectoryService {
    async fn lookup_pod(
        &self,
        request: Request<k8spb::LookupPodRequest>,
    ) -> Result<Response<k8spb::LookupPodResponse>, Status> {
        self.lookups.send_modify(|n| *n += 1);
        let r = request.into_inner();
        let state = self.state.lock().unwrap();
        if !state.synced {
            return Err(rivet_common::grpc::status_with_reason(
                Code::Unavailable,
                "the pod cache has not synced (test)",
                k8spb::ErrorReason::CacheNotSynced,
            ));
        }
        let absent = state.absent.contains(&(r.namespace.clone(), r.name.clone()));
        Ok(Response::new(k8spb::LookupPodResponse {
            presence: if absent {
                k8spb::PodPresence::Absent
            } else {
                k8spb::PodPresence::Present
            }
            .into(),
            uid: if absent { String::new() } else { r.uid },
            node_name: "test-node".into(),
            boot_id: "test-directory".into(),
        }))
    }
}

/// A PodDirectory served on a Unix socket in a temp dir; stopped on drop.
struct Directory {
    dir: tempfile::TempDir,
    state: Arc<Mutex<DirectoryState>>,
    lookups: watch::Receiver<u32>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Directory {
    fn serve(synced: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let listener = tokio::net::UnixListener::bind(dir.path().join("svc-k8s-sync.sock")).unwrap();
        let state = Arc::new(Mutex::new(DirectoryState {
            synced,
            ..DirectoryState::default()
        }));
        let (lookups_tx, lookups) = watch::channel(0);
        let service = DirectoryService {
            state: state.clone(),
            lookups: Arc::new(lookups_tx),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(k8spb::pod_directory_server::PodDirectoryServer::new(service))
                .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await
                .expect("the test's PodDirectory serves");
        });
        Self {
            dir,
            state,
            lookups,
            stop: Some(stop),
            task,
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("svc-k8s-sync.sock")
    }

    fn set(&self, change: impl FnOnce(&mut DirectoryState)) {
        change(&mut self.state.lock().unwrap());
    }

    /// Waits until `n` lookups were answered (or refused) in all.
    async fn lookups_reach(&mut self, n: u32) {
        tokio::time::timeout(EVENT_WAIT, self.lookups.wait_for(|c| *c >= n))
            .await
            .unwrap_or_else(|_| panic!("{n} pod lookups within {EVENT_WAIT:?}"))
            .unwrap();
    }
}

impl Drop for Directory {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

/// A node whose svc-endpoint is in Kubernetes mode with `directory`.
async fn k8s_node(directory: &Directory, extra: &[&str]) -> EndpointNode {
    let socket = directory.socket().display().to_string();
    let mut args = vec!["--k8s-sync-socket", socket.as_str()];
    args.extend_from_slice(extra);
    node(&args).await
}

async fn channel(node: &EndpointNode) -> DaemonChannel {
    connect_unix(&node.sockets().join("svc-endpoint.sock"), &Default::default())
        .await
        .expect("connecting to svc-endpoint")
}

async fn pod_metadata(node: &EndpointNode) -> PodMetadataServiceClient<DaemonChannel> {
    PodMetadataServiceClient::new(channel(node).await)
}

fn metadata(name: &str, labels: &[&str]) -> pb::PodMetadata {
    pb::PodMetadata {
        pod: Some(pb::PodRef {
            namespace: "default".into(),
            name: name.into(),
        }),
        uid: String::new(),
        labels: labels.iter().map(ToString::to_string).collect(),
        named_ports: Vec::new(),
    }
}

/// SetPodMetadata, waited for.
async fn set_metadata(node: &EndpointNode, name: &str, labels: &[&str]) -> pb::SetPodMetadataResponse {
    pod_metadata(node)
        .await
        .set_pod_metadata(pb::SetPodMetadataRequest {
            metadata: Some(metadata(name, labels)),
            wait: true,
        })
        .await
        .unwrap_or_else(|e| panic!("SetPodMetadata {name}: {e}"))
        .into_inner()
}

async fn endpoint(node: &EndpointNode, id: u32) -> pb::Endpoint {
    node.endpoints()
        .await
        .get_endpoint(pb::GetEndpointRequest {
            r#ref: Some(pb::EndpointRef {
                r#ref: Some(pb::endpoint_ref::Ref::Id(id)),
            }),
        })
        .await
        .unwrap_or_else(|e| panic!("endpoint {id}: {e}"))
        .into_inner()
        .endpoint
        .unwrap()
}

async fn status(node: &EndpointNode) -> pb::GetStatusResponse {
    endpoint_status(node).await
}

/// The restore status once restore completed.
async fn restored(node: &EndpointNode) -> pb::RestoreStatus {
    until(EVENT_WAIT, "restore completes", async || {
        let restore = status(node).await.restore.unwrap();
        if restore.phase == pb::RestorePhase::Complete as i32 {
            Ok(restore)
        } else {
            Err(format!("{restore:?}"))
        }
    })
    .await
}

fn reason(status: &Status) -> Option<pb::ErrorReason> {
    error_reason::<pb::ErrorReason>(status)
}

/// Issue 14 §4: a pod created before svc-k8s-sync delivered its labels
/// gets the init identity (the CNI call succeeds; the CNI's labels are
/// ignored) and is default-deny both ways; the labels arriving re-identify
/// it and traffic flows. Identical metadata again regenerates nothing;
/// UpdateLabels is refused in this mode.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_without_metadata_runs_on_init_and_is_reidentified_when_its_labels_arrive() {
    let directory = Directory::serve(true);
    let mut node = k8s_node(&directory, &[]).await;
    let status_before = status(&node).await;
    assert!(status_before.kubernetes_mode);
    assert_eq!(
        status_before.policy_sources,
        vec![
            pb::PolicyOrigin::Api as i32,
            pb::PolicyOrigin::Directory as i32,
            pb::PolicyOrigin::Kubernetes as i32
        ],
        "Kubernetes mode accepts all three sources by default"
    );

    // b's metadata first: b is identified at once.
    set_metadata(&node, "b", &["k8s:app=b"]).await;
    let b = node.add_pod("b", &["k8s:app=from-cni"]).await;
    assert!(!b.labels_pending);
    assert_eq!(b.labels, vec!["k8s:app=b".to_string()], "the CNI's labels are ignored");

    // a has none yet: the create succeeds on init.
    let a = node.add_pod("a", &["k8s:app=from-cni"]).await;
    assert_eq!(a.state, pb::EndpointState::Ready as i32, "the CNI call succeeds");
    assert_eq!(a.identity, 5, "the reserved init identity");
    assert!(a.labels_pending);
    assert!(a.labels.is_empty(), "the CNI's labels are ignored: {:?}", a.labels);
    assert_eq!(status(&node).await.labels_pending, 1);
    assert!(!pings(&node, "b", "a"), "an initializing pod takes no traffic");
    assert!(!pings(&node, "a", "b"), "an initializing pod sends no traffic");

    // Its labels arrive: a new identity, traffic flows.
    let set = set_metadata(&node, "a", &["k8s:app=a"]).await;
    assert!(set.changed);
    assert_eq!(set.affected_endpoints, 1);
    let a = endpoint(&node, a.id).await;
    assert_eq!(a.state, pb::EndpointState::Ready as i32);
    assert!(!a.labels_pending);
    assert!(a.identity >= 256, "a cluster identity: {}", a.identity);
    assert!(
        a.identity_labels.contains(&"k8s:app=a".to_string()),
        "{:?}",
        a.identity_labels
    );
    assert_eq!(status(&node).await.labels_pending, 0);
    assert!(
        pings(&node, "b", "a") && pings(&node, "a", "b"),
        "re-identified, traffic flows"
    );

    // The same again changes nothing and regenerates nothing.
    let again = set_metadata(&node, "a", &["k8s:app=a"]).await;
    assert!(!again.changed);
    assert_eq!(again.affected_endpoints, 0);
    assert_eq!(
        endpoint(&node, a.id).await.regenerations,
        a.regenerations,
        "no regeneration"
    );

    // Named ports come with the metadata too: a regeneration, same identity.
    let mut with_port = metadata("a", &["k8s:app=a"]);
    with_port.named_ports = vec![pb::NamedPort {
        name: "http".into(),
        protocol: "TCP".into(),
        port: 80,
    }];
    let ported = pod_metadata(&node)
        .await
        .set_pod_metadata(pb::SetPodMetadataRequest {
            metadata: Some(with_port.clone()),
            wait: true,
        })
        .await
        .expect("named ports")
        .into_inner();
    assert!(ported.changed && ported.affected_endpoints == 1, "{ported:?}");
    let a_ported = endpoint(&node, a.id).await;
    assert_eq!(a_ported.named_ports, with_port.named_ports);
    assert_eq!(a_ported.identity, a.identity, "ports do not change the identity");

    // The pod deleted in the API: its metadata is forgotten, the endpoint
    // keeps its labels until the CNI deletes it.
    let pod = Some(pb::PodRef {
        namespace: "default".into(),
        name: "a".into(),
    });
    let mut client = pod_metadata(&node).await;
    let deleted = client
        .delete_pod_metadata(pb::DeletePodMetadataRequest { pod: pod.clone() })
        .await
        .unwrap()
        .into_inner();
    assert!(deleted.deleted);
    let again = client
        .delete_pod_metadata(pb::DeletePodMetadataRequest { pod })
        .await
        .unwrap()
        .into_inner();
    assert!(!again.deleted, "idempotent");
    assert_eq!(endpoint(&node, a.id).await.labels, vec!["k8s:app=a".to_string()]);

    // Labels come from Kubernetes only.
    let refused = node
        .endpoints()
        .await
        .update_labels(pb::UpdateLabelsRequest {
            r#ref: Some(pb::EndpointRef {
                r#ref: Some(pb::endpoint_ref::Ref::Id(a.id)),
            }),
            labels: vec!["k8s:app=x".into()],
            r#async: false,
        })
        .await
        .expect_err("UpdateLabels is refused in Kubernetes mode");
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert_eq!(reason(&refused), Some(pb::ErrorReason::LabelsFromKubernetes));
    // A feed cannot hand a pod a reserved label.
    let bad = pod_metadata(&node)
        .await
        .set_pod_metadata(pb::SetPodMetadataRequest {
            metadata: Some(metadata("a", &["reserved:host"])),
            wait: false,
        })
        .await
        .expect_err("reserved labels are refused");
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().starts_with("metadata.labels"), "{}", bad.message());
}

fn policy(name: &str, app: &str) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: {name}\n  namespace: default\n\
         spec:\n  podSelector:\n    matchLabels:\n      app: {app}\n  ingress:\n  - {{}}\n"
    )
}

async fn upsert_kubernetes_policy(node: &EndpointNode, document: &str) -> pb::UpsertPolicyResponse {
    node.policies()
        .await
        .upsert_policy(pb::UpsertPolicyRequest {
            document: document.into(),
            origin: pb::PolicyOrigin::Kubernetes.into(),
            wait: true,
        })
        .await
        .expect("a KUBERNETES policy is accepted in Kubernetes mode")
        .into_inner()
}

enum Item {
    Pod(&'static str, &'static [&'static str]),
    Namespace(&'static str, &'static [&'static str]),
    Policy(String),
    Service(String),
    End,
}

async fn replay(node: &EndpointNode, items: Vec<Item>) -> Result<pb::ReplayKubernetesResponse, Status> {
    use pb::replay_kubernetes_request::Item as I;
    let requests: Vec<pb::ReplayKubernetesRequest> = items
        .into_iter()
        .map(|item| pb::ReplayKubernetesRequest {
            item: Some(match item {
                Item::Pod(name, labels) => I::Pod(metadata(name, labels)),
                Item::Namespace(name, labels) => I::Namespace(pb::SetNamespaceLabelsRequest {
                    namespace: name.into(),
                    labels: labels.iter().map(ToString::to_string).collect(),
                }),
                Item::Policy(document) => I::PolicyDocument(document),
                Item::Service(document) => I::ServiceDocument(document),
                Item::End => I::End(true),
            }),
        })
        .collect();
    pod_metadata(node)
        .await
        .replay_kubernetes(futures::stream::iter(requests))
        .await
        .map(Response::into_inner)
}

/// A Service as the API server has it (its own clusterIP), one port.
fn k8s_service(name: &str, cluster_ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{clusterIP: {cluster_ip}, ports: [{{name: http, port: 80}}]}}\n"
    )
}

/// The names of the Services svc-endpoint's catalog holds.
async fn catalog_services(node: &EndpointNode) -> Vec<String> {
    ServiceCatalogServiceClient::new(channel(node).await)
        .list_services(pb::ListServicesRequest::default())
        .await
        .expect("ListServices")
        .into_inner()
        .services
        .into_iter()
        .map(|s| s.name)
        .collect()
}

/// The replayed Services and EndpointSlices replace the KUBERNETES ones
/// (those of the API stay), also when a document is refused; the
/// replayed Service reaches svc-loader with its slice's backends.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_replaces_the_kubernetes_services() {
    let directory = Directory::serve(true);
    let node = k8s_node(&directory, &["--service-cidr", "198.19.128.0/20"]).await;
    let mut catalog = ServiceCatalogServiceClient::new(channel(&node).await);
    for (document, origin) in [
        (k8s_service("old", "10.96.0.10"), pb::ServiceOrigin::Kubernetes),
        (k8s_service("mine", "198.19.128.7"), pb::ServiceOrigin::Api),
    ] {
        catalog
            .apply_service_object(pb::ApplyServiceObjectRequest {
                document,
                origin: origin as i32,
                wait: false,
            })
            .await
            .expect("the Service applies");
    }
    let slice = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: new-a\n  labels: {kubernetes.io/service-name: new}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [198.18.3.3], nodeName: elsewhere}]\n";
    let answer = replay(
        &node,
        vec![
            Item::Service(slice.into()),
            Item::Service(k8s_service("new", "10.96.0.11")),
            Item::End,
        ],
    )
    .await
    .expect("the replay");
    assert!(answer.rejected.is_empty(), "{:?}", answer.rejected);
    assert_eq!((answer.service_objects, answer.service_objects_removed), (2, 1));
    assert_eq!(catalog_services(&node).await, ["mine", "new"]);

    // svc-loader gets the replayed Service with its slice's backend.
    eventually(EVENT_WAIT, "svc-loader holds Service new", async || {
        let view = catalog
            .get_service(pb::GetServiceRequest {
                namespace: "default".into(),
                name: "new".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .service
            .unwrap();
        view.load_balancer.len() == 1 && view.load_balancer[0].realised && view.backends.len() == 1
    })
    .await;

    // A refused document holds nothing back: the slice no document names
    // goes; the refusal is typed.
    let answer = replay(
        &node,
        vec![
            Item::Service("kind: Service\n".into()),
            Item::Service(k8s_service("new", "10.96.0.11")),
            Item::End,
        ],
    )
    .await
    .expect("the replay");
    assert_eq!(answer.rejected.len(), 1, "{:?}", answer.rejected);
    assert!(
        answer.rejected[0].error.starts_with("apiVersion: "),
        "{:?}",
        answer.rejected
    );
    assert_eq!(answer.rejected[0].reason(), pb::ErrorReason::ServiceInvalid);
    assert_eq!((answer.service_objects, answer.service_objects_removed), (1, 1));
    assert_eq!(catalog_services(&node).await, ["mine", "new"]);
}

async fn namespaces(node: &EndpointNode) -> Vec<(String, Vec<String>)> {
    NamespaceServiceClient::new(channel(node).await)
        .list_namespaces(pb::ListNamespacesRequest {})
        .await
        .unwrap()
        .into_inner()
        .namespaces
        .into_iter()
        .filter(|n| !n.labels.is_empty())
        .map(|n| (n.name, n.labels))
        .collect()
}

async fn kubernetes_policies(node: &EndpointNode) -> Vec<String> {
    node.policies()
        .await
        .list_policies(pb::ListPoliciesRequest {
            origin: pb::PolicyOrigin::Kubernetes.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .policies
        .into_iter()
        .map(|p| p.key.unwrap().name)
        .collect()
}

/// Issue 14 §4 restart independence: a replay naming exactly what
/// svc-endpoint holds changes nothing and regenerates nothing; one that
/// leaves things out forgets them (pod metadata, namespace labels,
/// KUBERNETES policies) and regenerates only the endpoints whose inputs
/// changed; a replay without `end` forgets nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_forgets_what_it_does_not_name_and_regenerates_nothing_unchanged() {
    let directory = Directory::serve(true);
    let mut node = k8s_node(&directory, &[]).await;
    set_metadata(&node, "a", &["k8s:app=a"]).await;
    set_metadata(&node, "b", &["k8s:app=b"]).await;
    set_metadata(&node, "ghost", &["k8s:app=ghost"]).await;
    let a = node.add_pod("a", &[]).await;
    let b = node.add_pod("b", &[]).await;
    let mut namespaces_client = NamespaceServiceClient::new(channel(&node).await);
    for (namespace, labels) in [("default", "k8s:team=x"), ("other", "k8s:team=o")] {
        namespaces_client
            .set_namespace_labels(pb::SetNamespaceLabelsRequest {
                namespace: namespace.into(),
                labels: vec![labels.into()],
            })
            .await
            .unwrap();
    }
    upsert_kubernetes_policy(&node, &policy("p1", "a")).await;
    upsert_kubernetes_policy(&node, &policy("p2", "b")).await;
    // Both re-identified by the namespace labels and realised.
    let settled = async |id: u32| {
        let node = &node;
        eventually(EVENT_WAIT, "the endpoint realised its inputs", async || {
            let e = endpoint(node, id).await;
            e.state == pb::EndpointState::Ready as i32 && e.identity_labels.contains(&"k8s:ns.labels/team=x".into())
        })
        .await;
        endpoint(node, id).await
    };
    let (a, b) = (settled(a.id).await, settled(b.id).await);
    let revision = status(&node).await.policy_revision;

    // Exactly what is held: nothing changes.
    let same = replay(
        &node,
        vec![
            Item::Pod("a", &["k8s:app=a"]),
            Item::Pod("b", &["k8s:app=b"]),
            Item::Pod("ghost", &["k8s:app=ghost"]),
            Item::Namespace("default", &["k8s:team=x"]),
            Item::Namespace("other", &["k8s:team=o"]),
            Item::Policy(policy("p1", "a")),
            Item::Policy(policy("p2", "b")),
            Item::End,
        ],
    )
    .await
    .expect("the replay applies");
    assert_eq!((same.pods, same.namespaces, same.policies), (3, 2, 2));
    assert_eq!(
        (
            same.pods_forgotten,
            same.namespaces_forgotten,
            same.policies_removed,
            same.affected_endpoints
        ),
        (0, 0, 0, 0),
        "{same:?}"
    );
    assert!(same.rejected.is_empty(), "{:?}", same.rejected);
    assert_eq!(
        status(&node).await.policy_revision,
        revision,
        "identical documents keep the revision"
    );
    for before in [&a, &b] {
        let now = endpoint(&node, before.id).await;
        assert_eq!(
            now.regenerations, before.regenerations,
            "endpoint {} not regenerated",
            before.id
        );
    }

    // Less: b's and ghost's metadata, `other` and p2 are forgotten; a's
    // labels and default's changed. a and b (namespace, p2) are affected.
    let less = replay(
        &node,
        vec![
            Item::Pod("a", &["k8s:app=a2"]),
            Item::Namespace("default", &["k8s:team=y"]),
            Item::Policy(policy("p1", "a")),
            Item::End,
        ],
    )
    .await
    .expect("the replay applies");
    assert_eq!(
        (
            less.pods_forgotten,
            less.namespaces_forgotten,
            less.policies_removed,
            less.affected_endpoints
        ),
        (2, 1, 1, 2),
        "{less:?}"
    );
    assert_eq!(
        namespaces(&node).await,
        vec![("default".to_string(), vec!["k8s:team=y".to_string()])]
    );
    assert_eq!(kubernetes_policies(&node).await, vec!["p1".to_string()]);
    eventually(EVENT_WAIT, "a re-identified with its new labels", async || {
        let e = endpoint(&node, a.id).await;
        e.state == pb::EndpointState::Ready as i32 && e.identity_labels.contains(&"k8s:app=a2".into())
    })
    .await;
    let b_now = endpoint(&node, b.id).await;
    assert_eq!(
        b_now.labels,
        vec!["k8s:app=b".to_string()],
        "forgotten metadata leaves the endpoint's labels"
    );
    // ghost's metadata is gone: its pod starts on the init identity.
    let ghost = node.add_pod("ghost", &[]).await;
    assert!(ghost.labels_pending && ghost.identity == 5, "{ghost:?}");

    // Without `end`: refused, nothing forgotten.
    let cut = replay(&node, vec![Item::Pod("a", &["k8s:app=a2"])])
        .await
        .expect_err("a replay without end is refused");
    assert_eq!(cut.code(), Code::InvalidArgument, "{cut:?}");
    assert_eq!(namespaces(&node).await.len(), 1, "nothing forgotten");
    assert_eq!(
        kubernetes_policies(&node).await,
        vec!["p1".to_string()],
        "nothing forgotten"
    );

    // An invalid item is reported and skipped; its kind forgets nothing.
    let partly = replay(
        &node,
        vec![
            Item::Pod("evil", &["reserved:host"]),
            Item::Namespace("default", &["k8s:team=y"]),
            Item::Policy(policy("p1", "a")),
            Item::End,
        ],
    )
    .await
    .expect("the valid items apply");
    assert_eq!(partly.rejected.len(), 1, "{:?}", partly.rejected);
    assert_eq!(partly.rejected[0].item, "pod default/evil");
    assert_eq!(partly.pods_forgotten, 0, "a rejected pod item forgets no pod");
}

/// `--policy-sources`: without Kubernetes mode the default is api and
/// directory: a KUBERNETES policy is refused (POLICY_ORIGIN_DISABLED), and
/// PodMetadataService answers KUBERNETES_MODE_OFF; a node limited to
/// `kubernetes` refuses API policies.
#[tokio::test(flavor = "multi_thread")]
async fn a_policy_of_a_source_the_node_does_not_use_is_refused() {
    let node = node(&[]).await;
    let s = status(&node).await;
    assert!(!s.kubernetes_mode);
    assert_eq!(
        s.policy_sources,
        vec![pb::PolicyOrigin::Api as i32, pb::PolicyOrigin::Directory as i32]
    );
    let refused = node
        .policies()
        .await
        .upsert_policy(pb::UpsertPolicyRequest {
            document: policy("p", "a"),
            origin: pb::PolicyOrigin::Kubernetes.into(),
            wait: false,
        })
        .await
        .expect_err("KUBERNETES is not a source of this node");
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert_eq!(reason(&refused), Some(pb::ErrorReason::PolicyOriginDisabled));
    assert_eq!(status(&node).await.policies, 0, "nothing applied");
    let off = pod_metadata(&node)
        .await
        .set_pod_metadata(pb::SetPodMetadataRequest {
            metadata: Some(metadata("a", &["k8s:app=a"])),
            wait: false,
        })
        .await
        .expect_err("not in Kubernetes mode");
    assert_eq!(off.code(), Code::FailedPrecondition);
    assert_eq!(reason(&off), Some(pb::ErrorReason::KubernetesModeOff));
    drop(node);

    let directory = Directory::serve(true);
    let node = k8s_node(&directory, &["--policy-sources", "kubernetes"]).await;
    assert_eq!(
        status(&node).await.policy_sources,
        vec![pb::PolicyOrigin::Kubernetes as i32]
    );
    let refused = node
        .policies()
        .await
        .upsert_policy(pb::UpsertPolicyRequest {
            document: policy("p", "a"),
            origin: pb::PolicyOrigin::Api.into(),
            wait: false,
        })
        .await
        .expect_err("the API is not a source of this node");
    assert_eq!(reason(&refused), Some(pb::ErrorReason::PolicyOriginDisabled));
    upsert_kubernetes_policy(&node, &policy("p", "a")).await;
}

/// Issue 14 §4/§5: a pod deleted in the API while svc-endpoint was down is
/// ABSENT in svc-k8s-sync's directory: restore drops its endpoint and
/// releases its addresses, and restores the others. While the directory's
/// caches are not synced nothing is dropped on that account; once it
/// answers, `pod-check` drops the endpoint of the gone pod.
#[tokio::test(flavor = "multi_thread")]
async fn restore_drops_the_endpoint_of_a_pod_gone_from_the_api_and_keeps_it_while_unsure() {
    let mut directory = Directory::serve(true);
    let mut node = k8s_node(&directory, &[]).await;
    for pod in ["a", "b", "c"] {
        set_metadata(&node, pod, &["k8s:app=web"]).await;
    }
    let a = node.add_pod("a", &[]).await;
    let b = node.add_pod("b", &[]).await;
    let c = node.add_pod("c", &[]).await;

    // b is deleted in the API while svc-endpoint is down.
    node.endpoint_daemon().kill9();
    directory.set(|d| {
        d.absent.insert(("default".into(), "b".into()));
    });
    node.endpoint_daemon().restart().await.expect("svc-endpoint restarts");
    let restore = restored(&node).await;
    assert_eq!(
        (restore.found, restore.restored, restore.dropped),
        (3, 2, 1),
        "{restore:?}"
    );
    let held = node.allocations().await;
    assert!(
        held.iter()
            .all(|al| al.owner.as_ref().is_none_or(|o| o.container_id != "b")),
        "b's addresses are released: {held:?}"
    );
    let listed = node.datapath_endpoints().await;
    assert!(
        listed.endpoints.iter().all(|e| e.endpoint_id != b.id),
        "nothing of b in the datapath"
    );
    assert_eq!(endpoint(&node, a.id).await.state, pb::EndpointState::Ready as i32);
    assert!(pings(&node, "a", "c"), "the others are restored and reachable");

    // The directory is not synced: c's pod "gone" is not believed yet.
    node.endpoint_daemon().kill9();
    directory.set(|d| {
        d.synced = false;
        d.absent.insert(("default".into(), "c".into()));
    });
    let asked = *directory.lookups.borrow();
    node.endpoint_daemon().restart().await.expect("svc-endpoint restarts");
    let restore = restored(&node).await;
    assert_eq!(
        (restore.found, restore.restored, restore.dropped),
        (2, 2, 0),
        "{restore:?}"
    );
    assert_eq!(
        endpoint(&node, c.id).await.state,
        pb::EndpointState::Ready as i32,
        "kept while unsure"
    );
    // pod-check keeps asking; once the directory answers, c goes.
    directory.lookups_reach(asked + 2).await;
    directory.set(|d| d.synced = true);
    eventually(EVENT_WAIT, "pod-check drops c once svc-k8s-sync answers", async || {
        status(&node).await.restore.unwrap().dropped == 1
    })
    .await;
    eventually(EVENT_WAIT, "c's addresses are released", async || {
        node.allocations()
            .await
            .iter()
            .all(|al| al.owner.as_ref().is_none_or(|o| o.container_id != "c"))
    })
    .await;
    assert_eq!(
        endpoint(&node, a.id).await.state,
        pb::EndpointState::Ready as i32,
        "a stays"
    );
}
