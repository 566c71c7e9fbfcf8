//! The kvstore heartbeat end to end: the operator's duty in-process (a
//! `Term` of its own, no elector) writing to a real etcd 3.6, a real
//! svc-identity process watching it. Short flags: interval 300 ms, stale
//! after 3 intervals.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use rivet_common::controller::Controllers;
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::etcd::EtcdServer;
use rivet_common::testing::{DaemonCommand, DaemonProcess, free_local_port, http_get, metric_sample, workspace_binary};
use rivet_operator::heartbeat::KvstoreHeartbeat;
use rivet_operator::kvstore::Layout;
use rivet_operator::term::{Duty, Term};
use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;

const INTERVAL: Duration = Duration::from_millis(300);
const MULTIPLE: u32 = 3;
const THRESHOLD: Duration = Duration::from_millis(900);
const PREFIX: &str = "rivet/state/";

async fn spawn_identity(dir: &Path, etcd: &EtcdServer, metrics: SocketAddr) -> DaemonProcess {
    let sockets = dir.join("sockets");
    DaemonCommand::new(workspace_binary("svc-identity"), sockets.join("svc-identity.sock"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), dir.join("state").as_os_str()])
        .args(["--node-name", "n1", "--etcd-endpoints", &etcd.endpoint()])
        .args(["--kvstore-prefix", PREFIX])
        .args(["--kvstore-heartbeat-interval", "300ms"])
        .args(["--kvstore-heartbeat-stale-multiple", &MULTIPLE.to_string()])
        .args(["--metrics-address", &metrics.to_string()])
        .log_to(dir.join("svc-identity.log"))
        .spawn()
        .await
        .expect("svc-identity starts")
}

async fn heartbeat(c: &mut IdentityServiceClient<DaemonChannel>) -> pb::KvstoreHeartbeat {
    c.get_status(pb::GetStatusRequest {})
        .await
        .expect("GetStatus")
        .into_inner()
        .kvstore_heartbeat
        .expect("GetStatus reports the heartbeat")
}

/// Polls GetStatus until `pred` holds (10 s); the report and when it held.
async fn wait_heartbeat(
    c: &mut IdentityServiceClient<DaemonChannel>,
    what: &str,
    pred: impl Fn(&pb::KvstoreHeartbeat) -> bool,
) -> (pb::KvstoreHeartbeat, Instant) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let report = heartbeat(c).await;
        if pred(&report) {
            return (report, Instant::now());
        }
        assert!(Instant::now() < deadline, "{what}: {report:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// svc-identity's metric `series` (exactly as printed), if present.
async fn sample(metrics: SocketAddr, series: &str) -> Option<f64> {
    let text = http_get(metrics, "/metrics").await.expect("GET /metrics");
    metric_sample(&text, series)
}

fn state(r: &pb::KvstoreHeartbeat) -> pb::KvstoreHeartbeatState {
    pb::KvstoreHeartbeatState::try_from(r.state).expect("a known state")
}

/// A term of the duty on its own controllers; ended and shut down by
/// [`stop`].
fn start(duty: &KvstoreHeartbeat) -> (Term, Controllers) {
    let term = Term::begin("test", 0, std::time::Instant::now() + Duration::from_secs(3600));
    let controllers = Controllers::new();
    duty.start(&term, &controllers);
    (term, controllers)
}

async fn stop((term, controllers): (Term, Controllers)) -> Instant {
    term.end();
    controllers.shutdown().await;
    Instant::now()
}

#[tokio::test]
async fn svc_identity_reports_the_heartbeat_missing_fresh_stale_and_fresh_again() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_local_port()));
    let mut identity = spawn_identity(dir.path(), &etcd, metrics).await;
    let mut c = IdentityServiceClient::new(
        connect_unix(identity.socket(), &ClientOptions::default())
            .await
            .unwrap(),
    );

    // No operator yet: its own state, unhealthy only after the threshold.
    let (missing, _) = wait_heartbeat(&mut c, "missing, then unhealthy", |r| {
        state(r) == pb::KvstoreHeartbeatState::Missing && !r.healthy
    })
    .await;
    assert_eq!(missing.stale_threshold_ms, THRESHOLD.as_millis() as u64);
    assert_eq!((missing.observed_age_ms, missing.last_written_unix_nanos), (None, 0));

    let client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let duty = KvstoreHeartbeat::new(client.clone(), &Layout::new(PREFIX, "default"), INTERVAL);
    let term = start(&duty);
    let (fresh, _) = wait_heartbeat(&mut c, "fresh once the leader writes", |r| {
        state(r) == pb::KvstoreHeartbeatState::Fresh && r.healthy
    })
    .await;
    let written = std::time::UNIX_EPOCH + Duration::from_nanos(fresh.last_written_unix_nanos as u64);
    let written_age = std::time::SystemTime::now().duration_since(written).unwrap_or_default();
    assert!(
        written_age < Duration::from_secs(5),
        "the leader writes the time now: {written_age:?} ago"
    );
    assert!(fresh.observed_age_ms.expect("an age") < THRESHOLD.as_millis() as u64);
    assert_eq!(sample(metrics, "rivet_identity_kvstore_healthy").await, Some(1.0));
    let age = sample(metrics, "rivet_identity_kvstore_heartbeat_age_seconds").await;
    assert!(age.is_some_and(|a| a < THRESHOLD.as_secs_f64()), "{age:?}");

    // The term ends: no more writes, stale after the threshold (not before
    // the last write's age reaches it, so not before threshold - interval).
    let stopped = stop(term).await;
    let (stale, at) = wait_heartbeat(&mut c, "stale after the writes stop", |r| {
        state(r) == pb::KvstoreHeartbeatState::Stale
    })
    .await;
    assert!(!stale.healthy);
    let after = at - stopped;
    assert!(
        after >= THRESHOLD - INTERVAL - Duration::from_millis(50),
        "stale {after:?} after the last term ended: too early for a {THRESHOLD:?} threshold"
    );
    // Within the threshold of the last write (plus the polling and a busy
    // machine's scheduling).
    assert!(
        after <= THRESHOLD + Duration::from_secs(1),
        "stale only {after:?} after the last term ended"
    );
    assert!(stale.observed_age_ms.expect("an age") >= THRESHOLD.as_millis() as u64);
    assert_eq!(sample(metrics, "rivet_identity_kvstore_healthy").await, Some(0.0));
    let age = sample(metrics, "rivet_identity_kvstore_heartbeat_age_seconds").await;
    assert!(age.is_some_and(|a| a >= THRESHOLD.as_secs_f64()), "{age:?}");
    let series = r#"rivet_identity_kvstore_heartbeat_transitions_total{state="stale",healthy="false"}"#;
    // Logged and counted by the check controller, woken at the turn.
    let deadline = Instant::now() + Duration::from_secs(10);
    while sample(metrics, series).await.is_none() {
        assert!(Instant::now() < deadline, "the transition to stale is never counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        sample(metrics, series).await,
        Some(1.0),
        "the transition is counted once"
    );

    // A new term writes again.
    let term = start(&duty);
    wait_heartbeat(&mut c, "fresh again", |r| {
        state(r) == pb::KvstoreHeartbeatState::Fresh && r.healthy
    })
    .await;
    stop(term).await;

    // Restarted while the key's written time is older than the threshold
    // (the last leader wrote it long ago): stale at once, never fresh first.
    identity.terminate().await.expect("svc-identity stops");
    let mut kv = client.kv_client();
    kv.put(format!("{PREFIX}.heartbeat"), "2026-01-01T00:00:00.000Z", None)
        .await
        .unwrap();
    identity.restart().await.expect("svc-identity restarts");
    let mut c = IdentityServiceClient::new(
        connect_unix(identity.socket(), &ClientOptions::default())
            .await
            .unwrap(),
    );
    let (first, _) = wait_heartbeat(&mut c, "the key read at start", |r| {
        state(r) != pb::KvstoreHeartbeatState::Missing
    })
    .await;
    assert_eq!(state(&first), pb::KvstoreHeartbeatState::Stale, "{first:?}");
    assert!(!first.healthy);
}
