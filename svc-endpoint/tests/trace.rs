//! One endpoint creation is one trace in a real Jaeger: the caller's span,
//! svc-endpoint's CreateEndpoint and its regeneration's calls into
//! svc-identity and svc-loader (inside the node namespace, through the
//! node's relay), parent-child links intact. Its own test binary: it
//! installs the global subscriber and sets the OTLP endpoint.

use std::collections::BTreeSet;
use std::time::Duration;

use rivet_common::telemetry::{self, TelemetryOptions};
use rivet_proto::endpoint::v1 as pb;
use rivet_testkit::jaeger::{Jaeger, JaegerSpan, orphans};
use rivet_testkit::node::{EndpointNode, NodeOptions};
use tracing::Instrument;

const SERVICE: &str = "endpoint-trace-test";

#[tokio::test(flavor = "multi_thread")]
async fn an_endpoint_creation_is_one_trace_across_the_daemons() {
    let jaeger = Jaeger::start().await.expect("Jaeger starts");
    // SAFETY: set before any other thread of this test reads the environment.
    unsafe { std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", jaeger.otlp_endpoint()) };
    let guard = telemetry::init(TelemetryOptions::new(SERVICE)).expect("telemetry initialises");

    let mut node = EndpointNode::start(NodeOptions {
        otlp: Some(jaeger.otlp_addr()),
        ..NodeOptions::default()
    })
    .await
    .expect("the node's daemons start");
    node.add_pod_interface("traced").await;
    let request = node.create_request("traced", &["k8s:app=traced"]);
    let span = tracing::info_span!("test.create_endpoint");
    async {
        node.endpoints()
            .await
            .create_endpoint(request)
            .await
            .expect("create succeeds");
    }
    .instrument(span)
    .await;
    guard.shutdown().expect("flush the test's spans");

    let ours = jaeger
        .wait_for_service(SERVICE, Duration::from_secs(10), |spans| {
            spans.iter().any(|s| s.name == "test.create_endpoint")
        })
        .await
        .expect("the query API answers");
    let root = ours
        .iter()
        .find(|s| s.name == "test.create_endpoint")
        .unwrap_or_else(|| panic!("the test's span reaches Jaeger: {ours:#?}"));
    let has = |spans: &[JaegerSpan], service: &str, method: &str| {
        spans
            .iter()
            .any(|s| s.service_name == service && s.name.ends_with(method))
    };
    let expected = [
        ("svc-endpoint", "/CreateEndpoint"),
        ("svc-identity", "/AllocateIdentity"),
        ("svc-identity", "/UpsertIp"),
        ("svc-loader", "/ApplyEndpoint"),
    ];
    let trace = jaeger
        .wait_for_trace(&root.trace_id, Duration::from_secs(20), |spans| {
            expected.iter().all(|(service, method)| has(spans, service, method)) && orphans(spans).is_empty()
        })
        .await
        .expect("the query API answers");
    for (service, method) in expected {
        assert!(
            has(&trace, service, method),
            "{service}{method} must belong to the creation's trace: {trace:#?}"
        );
    }
    assert!(orphans(&trace).is_empty(), "orphans: {:#?}", orphans(&trace));
    let roots: BTreeSet<&str> = trace
        .iter()
        .filter(|s| s.parent_span_id.is_empty())
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(roots, BTreeSet::from(["test.create_endpoint"]), "one root");

    // The watch item carries the creation's context, so that a watcher's
    // work for it (svc-k8s-sync's RivetEndpoint write) joins this trace.
    let mut watch = node
        .endpoints()
        .await
        .watch_endpoints(pb::WatchEndpointsRequest::default())
        .await
        .expect("WatchEndpoints opens")
        .into_inner();
    let endpoint = loop {
        let item = watch
            .message()
            .await
            .expect("the watch streams")
            .expect("the snapshot holds the endpoint");
        match item.event {
            Some(pb::watch_endpoints_response::Event::Upserted(e)) if e.pod_name == "traced" => break e,
            Some(pb::watch_endpoints_response::Event::Synced(_)) => panic!("snapshot without the endpoint"),
            _ => {}
        }
    };
    let parts: Vec<&str> = endpoint.traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "a W3C traceparent: {:?}", endpoint.traceparent);
    assert_eq!(parts[1], root.trace_id, "the creation's trace");
    let parent = trace
        .iter()
        .find(|s| s.span_id == parts[2])
        .unwrap_or_else(|| panic!("the traceparent's span {} in {trace:#?}", parts[2]));
    assert_eq!(parent.service_name, "svc-endpoint", "{parent:#?}");
}
