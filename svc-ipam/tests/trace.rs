//! One trace across processes: a client span in this test process and
//! svc-ipam's server span share a trace id, as seen by an OTLP collector
//! both export to. Its own test binary: it installs the global subscriber.

use std::time::Duration;

use rivet_common::grpc::{ClientOptions, connect_unix};
use rivet_common::telemetry::{self, LogFormat, TelemetryOptions};
use rivet_common::testing::{DaemonCommand, OtlpCollector};
use rivet_proto::ipam::v1 as pb;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use tracing::Instrument;

#[tokio::test]
async fn client_and_server_spans_share_one_trace() {
    let collector = OtlpCollector::start().await.expect("collector starts");
    // SAFETY: set before any other thread of this test reads the environment.
    unsafe { std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint()) };
    let guard = telemetry::init(TelemetryOptions {
        service_name: "ipam-trace-test".into(),
        log_format: LogFormat::Text,
        default_filter: "info".into(),
        resource_attributes: Vec::new(),
    })
    .expect("telemetry initialises");

    let dir = tempfile::tempdir().unwrap();
    let sockets = dir.path().join("sockets");
    let mut daemon = DaemonCommand::new(env!("CARGO_BIN_EXE_svc-ipam"), sockets.join("svc-ipam.sock"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), dir.path().join("state").as_os_str()])
        .args(["--pool", "default=198.18.0.0/24"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint())
        .log_to(dir.path().join("svc-ipam.log"))
        .spawn()
        .await
        .expect("svc-ipam starts");

    let span = tracing::info_span!("test.allocate");
    async {
        let channel = connect_unix(daemon.socket(), &ClientOptions::default()).await.unwrap();
        IpamClient::new(channel)
            .allocate(pb::AllocateRequest {
                owner: Some(pb::Owner {
                    container_id: "traced".into(),
                    interface: "eth0".into(),
                }),
                pool: String::new(),
                family: pb::Family::Ipv4 as i32,
                requested_address: Vec::new(),
            })
            .await
            .expect("allocate succeeds");
    }
    .instrument(span)
    .await;

    // A graceful stop flushes the daemon's exporter; shutting down ours flushes the test's.
    assert!(daemon.terminate().await.unwrap().success(), "{}", daemon.log());
    guard.shutdown().expect("flush the test's spans");

    let spans = collector
        .wait_for(Duration::from_secs(10), |spans| {
            spans.iter().any(|s| s.name == "test.allocate")
                && spans
                    .iter()
                    .any(|s| s.service_name == "svc-ipam" && s.name.ends_with("/Allocate"))
        })
        .await;
    let client = spans
        .iter()
        .find(|s| s.name == "test.allocate")
        .unwrap_or_else(|| panic!("the test's span reaches the collector: {spans:#?}"));
    let server = spans
        .iter()
        .find(|s| s.service_name == "svc-ipam" && s.name.ends_with("/Allocate"))
        .unwrap_or_else(|| panic!("svc-ipam's server span reaches the collector: {spans:#?}"));
    assert_eq!(
        server.trace_id, client.trace_id,
        "one request across two processes must be one trace"
    );
    assert_eq!(
        server.parent_span_id, client.span_id,
        "the server span is a child of the caller's span"
    );
    assert!(
        spans
            .iter()
            .any(|s| s.service_name == "svc-ipam" && s.name == "ipam.allocate" && s.trace_id == client.trace_id),
        "the handler's span belongs to the same trace"
    );
}
