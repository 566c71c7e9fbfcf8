//! One trace across a gRPC hop (DESIGN.md §7): a client span and the server
//! span of the call it makes share a trace ID, and the server span is a child
//! of the client's. Spans travel through the real OTLP/gRPC exporter to an
//! in-process collector.
//!
//! Its own test binary (one test) because `telemetry::init` installs the
//! process-global subscriber and reads the process environment.

use std::path::PathBuf;
use std::time::Duration;

use rivet_common::telemetry::{self, LogFormat, TelemetryOptions, TraceContextClientLayer, TraceContextServerLayer};
use rivet_common::testing::{CollectedSpan, OtlpCollector};
use rivet_proto::daemon::v1::daemon_client::DaemonClient;
use rivet_proto::daemon::v1::daemon_server::{Daemon, DaemonServer};
use rivet_proto::daemon::v1::{DaemonInfo, GetInfoRequest};
use tracing::Instrument as _;

const SERVICE_NAME: &str = "trace-propagation-test";
/// OTLP `SPAN_KIND_SERVER`.
const KIND_SERVER: i32 = 2;

struct TestDaemon;

#[tonic::async_trait]
impl Daemon for TestDaemon {
    async fn get_info(
        &self,
        _request: tonic::Request<GetInfoRequest>,
    ) -> Result<tonic::Response<DaemonInfo>, tonic::Status> {
        tracing::info!("answering GetInfo");
        Ok(tonic::Response::new(DaemonInfo {
            name: "test-daemon".into(),
            ..Default::default()
        }))
    }
}

fn is_server_span(span: &CollectedSpan) -> bool {
    span.kind == KIND_SERVER && span.name == "rivet.daemon.v1.Daemon/GetInfo"
}

// current_thread: no runtime worker threads exist while the environment is
// modified below. The collector and the exporter run on their own threads, so
// the blocking flush in `guard.shutdown()` cannot starve them.
#[tokio::test(flavor = "current_thread")]
async fn server_span_joins_the_client_trace() -> Result<(), Box<dyn std::error::Error>> {
    let collector = OtlpCollector::start().await?;
    // SAFETY: set_var races with concurrent reads of the environment by other
    // threads. This binary has a single test, the runtime is current-thread,
    // and the collector's thread is idle in its event loop by now (start()
    // returned after it bound its port); nothing else has been spawned yet.
    unsafe {
        std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint());
    }

    let guard = telemetry::init(TelemetryOptions {
        service_name: SERVICE_NAME.into(),
        log_format: LogFormat::Text,
        default_filter: "info".into(),
        resource_attributes: Vec::new(),
    })?;
    assert!(guard.is_exporting(), "OTEL_EXPORTER_OTLP_ENDPOINT is set");

    let dir = tempfile::tempdir()?;
    let path: PathBuf = dir.path().join("daemon.sock");
    let listener = tokio::net::UnixListener::bind(&path)?;
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .layer(TraceContextServerLayer::default())
            .add_service(DaemonServer::new(TestDaemon))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );

    let channel =
        tonic::transport::Endpoint::try_from("http://[::]:50051")?
            .connect_with_connector(tower::service_fn(move |_| {
                let p = path.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(p).await?))
                }
            }))
            .await?;
    let svc = tower::ServiceBuilder::new()
        .layer(TraceContextClientLayer::default())
        .service(channel);
    let mut client = DaemonClient::new(svc);

    let client_span = tracing::info_span!("test.client");
    let info = client
        .get_info(GetInfoRequest {})
        .instrument(client_span.clone())
        .await?
        .into_inner();
    assert_eq!(info.name, "test-daemon");
    drop(client_span); // ends the span, queueing it for export

    server.abort();
    // Flush: every span ended so far reaches the collector before this returns.
    tokio::task::spawn_blocking(move || guard.shutdown()).await??;

    let spans = collector
        .wait_for(Duration::from_secs(10), |spans| {
            spans.iter().any(|s| s.name == "test.client") && spans.iter().any(is_server_span)
        })
        .await;

    let client = spans
        .iter()
        .find(|s| s.name == "test.client")
        .unwrap_or_else(|| panic!("the client span must be exported: {spans:#?}"));
    let server = spans
        .iter()
        .find(|s| is_server_span(s))
        .unwrap_or_else(|| panic!("the grpc.server span must be exported: {spans:#?}"));

    assert_eq!(
        server.trace_id, client.trace_id,
        "the server span must continue the client's trace (traceparent propagated): {spans:#?}"
    );
    // The client layer adds no span of its own, so the caller's span is the
    // direct parent; otherwise walk up from the server span's parent.
    let mut parent = server.parent_span_id.clone();
    while parent != client.span_id {
        parent = spans
            .iter()
            .find(|s| s.span_id == parent)
            .map(|s| s.parent_span_id.clone())
            .unwrap_or_else(|| {
                panic!(
                    "the server span must descend from the client span {}: {spans:#?}",
                    client.span_id
                )
            });
    }
    assert_eq!(server.service_name, SERVICE_NAME, "resource service.name");
    assert_eq!(client.service_name, SERVICE_NAME, "resource service.name");
    for (key, value) in [
        ("rpc.system", "grpc"),
        ("rpc.service", "rivet.daemon.v1.Daemon"),
        ("rpc.method", "GetInfo"),
        ("rpc.grpc.status_code", "0"),
    ] {
        assert_eq!(
            server.attributes.get(key).map(String::as_str),
            Some(value),
            "server span attribute {key}: {server:#?}"
        );
    }
    Ok(())
}
