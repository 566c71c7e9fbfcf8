//! svc-endpoint's side of Kubernetes (issue 14): WatchEndpoints (what
//! svc-k8s-sync writes RivetEndpoint objects from), against the real
//! daemons and namespace pods.

mod support;

use std::time::Duration;

use futures::StreamExt;
use rivet_proto::endpoint::v1 as pb;
use rivet_proto::endpoint::v1::watch_endpoints_response::Event;
use rivet_testkit::node::{EndpointNode, NodeOptions};
use support::{options, start_manager};
use svc_endpoint::endpoint::EndpointState;
use svc_endpoint::manager::{EndpointEvent, EndpointSelector, NewEndpoint};
use svc_endpoint::service::validate_create;
use tonic::Streaming;

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
