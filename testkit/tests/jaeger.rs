//! The Jaeger fixture against the real Jaeger: spans exported by this
//! process come back typed through the query API (parents, links,
//! attributes, resource), and a relay makes Jaeger reachable from inside a
//! network namespace. Its own test binary: it installs the global
//! subscriber and sets the OTLP endpoint.

use std::io::{Read as _, Write as _};
use std::time::Duration;

use rivet_common::telemetry::{self, LogFormat, TelemetryOptions, TraceLink};
use rivet_common::testing::netns::NetNs;
use rivet_testkit::jaeger::{Jaeger, OtlpRelay, orphans};

#[tokio::test(flavor = "multi_thread")]
async fn spans_come_back_typed_and_the_relay_reaches_jaeger_from_a_namespace() {
    let jaeger = Jaeger::start().await.expect("Jaeger starts");
    let service = format!("testkit-jaeger-{}", std::process::id());
    // SAFETY: set before any other thread of this test reads the environment.
    unsafe { std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", jaeger.otlp_endpoint()) };
    let guard = telemetry::init(TelemetryOptions {
        service_name: service.clone(),
        log_format: LogFormat::Text,
        default_filter: "info".into(),
        resource_attributes: vec![("service.instance.id".into(), "instance-1".into())],
    })
    .expect("telemetry initialises");

    let root = tracing::info_span!("fixture.root", k8s.pod.name = "web-1");
    let link = root.in_scope(|| {
        tracing::info_span!("fixture.child").in_scope(|| {});
        TraceLink::current().expect("a traced span is current")
    });
    drop(root);
    let linked = tracing::info_span!(parent: None, "fixture.linked");
    link.link_from(&linked);
    drop(linked);
    guard.shutdown().expect("the spans are flushed");

    let spans = jaeger
        .wait_for_service(&service, Duration::from_secs(10), |spans| spans.len() >= 3)
        .await
        .expect("the query API answers");
    let find = |name: &str| {
        spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{name} reached Jaeger: {spans:#?}"))
    };
    let (root, child, linked) = (find("fixture.root"), find("fixture.child"), find("fixture.linked"));
    assert!(root.parent_span_id.is_empty(), "{root:#?}");
    assert_eq!(child.parent_span_id, root.span_id);
    assert_eq!(child.trace_id, root.trace_id);
    assert!(orphans(&spans).is_empty(), "{spans:#?}");
    assert_eq!(root.attribute("k8s.pod.name"), Some("web-1"));
    assert_eq!(root.service_name, service);
    assert_eq!(
        root.resource.get("service.instance.id").map(String::as_str),
        Some("instance-1")
    );
    assert!(root.end_unix_nanos >= child.end_unix_nanos && root.start_unix_nanos <= child.start_unix_nanos);
    assert_ne!(linked.trace_id, root.trace_id, "a link is not a parent");
    assert_eq!(linked.links.len(), 1, "{linked:#?}");
    assert_eq!(
        (linked.links[0].trace_id.as_str(), linked.links[0].span_id.as_str()),
        (link.trace_id().as_str(), root.span_id.as_str())
    );

    // By trace id: exactly the root's trace.
    let trace = jaeger.trace(&root.trace_id).await.expect("the query API answers");
    let mut names: Vec<&str> = trace.iter().map(|s| s.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["fixture.child", "fixture.root"]);
    let unknown = format!("{:032x}", 1u128);
    assert!(jaeger.trace(&unknown).await.expect("a 404 is no spans").is_empty());

    // The relay: from inside a namespace, 127.0.0.1:<relay> is Jaeger (here
    // its query port, so that an HTTP answer proves both directions).
    let ns = NetNs::new("tkjaeger").expect("a namespace");
    let relay = OtlpRelay::start(&ns, jaeger.query_addr()).expect("the relay starts");
    let endpoint = relay.endpoint();
    let addr = endpoint.trim_start_matches("http://").to_owned();
    let answer = tokio::task::spawn_blocking(move || {
        ns.in_ns(move || -> std::io::Result<String> {
            let mut stream = std::net::TcpStream::connect(&addr)?;
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            stream.write_all(b"GET /api/v3/services HTTP/1.0\r\nHost: jaeger\r\n\r\n")?;
            let mut answer = String::new();
            stream.read_to_string(&mut answer)?;
            Ok(answer)
        })
    })
    .await
    .unwrap()
    .expect("entering the namespace")
    .expect("the relay answers");
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    assert!(answer.contains(&service), "Jaeger lists the service: {answer}");
    drop(relay);
}
