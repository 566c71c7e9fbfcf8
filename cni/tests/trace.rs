//! One pod creation is one trace rooted at rivet-cni's `cni.add`: the calls
//! it makes carry the trace context into svc-ipam and svc-endpoint, and
//! svc-endpoint's regeneration carries it on into svc-loader. rivet-cni
//! flushes its spans before it exits. Its own test binary: it sets the OTLP
//! endpoint every daemon inherits.

mod common;

use std::time::Duration;

use common::{Harness, Pod};
use rivet_common::testing::{CollectedSpan, OtlpCollector};
use rivet_testkit::node::NodeOptions;

#[tokio::test(flavor = "multi_thread")]
async fn an_add_is_one_trace_rooted_at_cni_add() {
    let collector = OtlpCollector::start().await.expect("collector starts");
    // SAFETY: set before any other thread of this test reads the environment;
    // the daemons inherit it.
    unsafe { std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint()) };
    let mut h = Harness::start_with(NodeOptions {
        trace_loader: true,
        ..NodeOptions::default()
    })
    .await;
    // rivet-cni runs in the node namespace: it exports to the collector there.
    let node_collector = h
        .node
        .loader_collector
        .as_ref()
        .expect("a collector in the node namespace");
    let pod = Pod::new("traced");
    let mut env = Harness::env("ADD", &pod, "eth0");
    env.push(("OTEL_EXPORTER_OTLP_ENDPOINT".into(), node_collector.endpoint()));
    let add = h.exec(&env, &h.conf("1.1.0")).await;
    add.ok();

    // rivet-cni exited: its spans must already be there (flushed at exit).
    let cni_spans = node_collector.spans();
    let root = cni_spans
        .iter()
        .find(|s| s.service_name == "rivet-cni" && s.name == "cni.add")
        .unwrap_or_else(|| panic!("cni.add was flushed before rivet-cni exited: {cni_spans:#?}"))
        .clone();
    assert!(root.parent_span_id.is_empty(), "cni.add is the root: {root:#?}");
    for step in ["cni.ipam.allocate", "cni.netlink.veth", "cni.endpoint.create"] {
        assert!(
            cni_spans.iter().any(|s| s.name == step && s.trace_id == root.trace_id),
            "{step} is part of the trace: {cni_spans:#?}"
        );
    }

    // Graceful stops flush the daemons' exporters.
    let endpoint = h.node.endpoint_daemon();
    assert!(endpoint.terminate().await.unwrap().success());
    assert!(h.node.ipam.terminate().await.unwrap().success());
    assert!(h.node.identity.terminate().await.unwrap().success());
    assert!(h.node.node.loader.terminate().await.unwrap().success());

    let server = |service: &'static str, method: &'static str| {
        move |s: &CollectedSpan| s.service_name == service && s.name.ends_with(method)
    };
    let node_collector = h.node.loader_collector.as_ref().unwrap();
    let loader_spans = node_collector
        .wait_for(Duration::from_secs(10), |spans| {
            spans.iter().any(server("svc-loader", "/ApplyEndpoint"))
        })
        .await;
    let mut spans = collector
        .wait_for(Duration::from_secs(10), |spans| {
            spans.iter().any(server("svc-ipam", "/Allocate"))
                && spans.iter().any(server("svc-endpoint", "/CreateEndpoint"))
        })
        .await;
    spans.extend(loader_spans);
    for (service, method) in [
        ("svc-endpoint", "/GetInfo"),
        ("svc-ipam", "/Allocate"),
        ("svc-endpoint", "/CreateEndpoint"),
        ("svc-identity", "/AllocateIdentity"),
        ("svc-loader", "/ApplyEndpoint"),
    ] {
        assert!(
            spans
                .iter()
                .any(|s| server(service, method)(s) && s.trace_id == root.trace_id),
            "{service}{method} must belong to the trace of cni.add ({}): {spans:#?}",
            root.trace_id
        );
    }
}
