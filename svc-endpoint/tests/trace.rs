//! One endpoint creation is one trace: the caller's span, svc-endpoint's
//! CreateEndpoint, and the calls its regeneration makes into svc-identity
//! and svc-loader share a trace id at an OTLP collector all processes export
//! to. Its own test binary: it installs the global subscriber and sets the
//! OTLP endpoint every daemon inherits.

use std::time::Duration;

use rivet_common::telemetry::{self, LogFormat, TelemetryOptions};
use rivet_common::testing::OtlpCollector;
use rivet_testkit::node::{EndpointNode, NodeOptions};
use tracing::Instrument;

#[tokio::test(flavor = "multi_thread")]
async fn an_endpoint_creation_is_one_trace_across_the_daemons() {
    let collector = OtlpCollector::start().await.expect("collector starts");
    // SAFETY: set before any other thread of this test reads the environment;
    // the daemons inherit it.
    unsafe { std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint()) };
    let guard = telemetry::init(TelemetryOptions {
        service_name: "endpoint-trace-test".into(),
        log_format: LogFormat::Text,
        default_filter: "info".into(),
    })
    .expect("telemetry initialises");

    let mut node = EndpointNode::start(NodeOptions {
        trace_loader: true,
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

    // Graceful stops flush the daemons' exporters.
    let endpoint = node.endpoint_daemon();
    assert!(endpoint.terminate().await.unwrap().success(), "{}", endpoint.log());
    assert!(
        node.identity.terminate().await.unwrap().success(),
        "{}",
        node.identity.log()
    );
    assert!(
        node.node.loader.terminate().await.unwrap().success(),
        "{}",
        node.node.loader.log()
    );
    guard.shutdown().expect("flush the test's spans");

    let server = |service: &'static str, method: &'static str| {
        move |s: &rivet_common::testing::CollectedSpan| s.service_name == service && s.name.ends_with(method)
    };
    let loader_collector = node
        .loader_collector
        .as_ref()
        .expect("the node collects svc-loader's spans");
    let loader_spans = loader_collector
        .wait_for(Duration::from_secs(10), |spans| {
            spans.iter().any(server("svc-loader", "/ApplyEndpoint"))
        })
        .await;
    let mut spans = collector
        .wait_for(Duration::from_secs(10), |spans| {
            spans.iter().any(|s| s.name == "test.create_endpoint")
                && spans.iter().any(server("svc-endpoint", "/CreateEndpoint"))
                && spans.iter().any(server("svc-identity", "/AllocateIdentity"))
        })
        .await;
    spans.extend(loader_spans);
    let root = spans
        .iter()
        .find(|s| s.name == "test.create_endpoint")
        .unwrap_or_else(|| panic!("the test's span reaches the collector: {spans:#?}"));
    for (service, method) in [
        ("svc-endpoint", "/CreateEndpoint"),
        ("svc-identity", "/AllocateIdentity"),
        ("svc-identity", "/UpsertIp"),
        ("svc-loader", "/ApplyEndpoint"),
    ] {
        assert!(
            spans
                .iter()
                .any(|s| server(service, method)(s) && s.trace_id == root.trace_id),
            "{service}{method} must belong to the creation's trace: {spans:#?}"
        );
    }
}
