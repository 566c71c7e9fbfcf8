//! `rivet status` against a real svc-identity on a real etcd: the node's
//! health, its exit status and the full reason while the kvstore is away,
//! back, and while a daemon does not answer; and the daemon's controllers
//! (its identity watch failing and restarted while etcd is away).

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use rivet_common::testing::etcd::EtcdServer;
use rivet_common::testing::{DaemonCommand, DaemonProcess, workspace_binary};

/// `rivet --socket-dir <sockets> status <extra>`.
fn status(sockets: &Path, extra: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_rivet"))
        .arg("--socket-dir")
        .arg(sockets)
        .arg("--state-dir")
        .arg(sockets.with_file_name("cli-state"))
        .arg("status")
        .args(extra)
        .output()
        .expect("running rivet status")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `rivet status` until it exits with `code` (GetStatus reflects the
/// store within a few seconds); returns that run's output.
async fn status_until(sockets: &Path, code: i32, what: &str) -> Output {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let out = status(sockets, &[]);
        if out.status.code() == Some(code) {
            return out;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: rivet status still exits {:?}:\n{}",
            out.status.code(),
            text(&out)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs `rivet status -o json` until svc-identity's `identity-watch`
/// controller satisfies `pred` (20 s); returns it.
async fn identity_watch_until(
    sockets: &Path,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let out = status(sockets, &["-o", "json"]);
        let daemons: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        let watch = daemons
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| d["daemon"] == "svc-identity")
            .flat_map(|d| d["controllers"].as_array().cloned().unwrap_or_default())
            .find(|c| c["name"] == "identity-watch");
        if let Some(watch) = watch.filter(|w| pred(w)) {
            return watch;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}:\n{}", text(&out));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn identity_on(dir: &Path, etcd: &EtcdServer) -> DaemonProcess {
    let sockets = dir.join("sockets");
    DaemonCommand::new(workspace_binary("svc-identity"), sockets.join("svc-identity.sock"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), dir.join("state").as_os_str()])
        .args(["--node-name", "status-node", "--etcd-endpoints", &etcd.endpoint()])
        .log_to(dir.join("svc-identity.log"))
        .spawn()
        .await
        .expect("svc-identity starts")
}

#[tokio::test]
async fn status_exits_non_zero_with_the_whole_reason_while_the_kvstore_is_down_and_zero_after() {
    let mut etcd = tokio::task::spawn_blocking(EtcdServer::start)
        .await
        .unwrap()
        .expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let sockets = dir.path().join("sockets");
    let mut identity = identity_on(dir.path(), &etcd).await;

    let healthy = status(&sockets, &[]);
    assert_eq!(healthy.status.code(), Some(0), "{}", text(&healthy));
    assert!(text(&healthy).contains("node health: HEALTHY"), "{}", text(&healthy));

    etcd.stop();
    let down = status_until(&sockets, 3, "the store outage shows").await;
    let shown = text(&down);
    assert!(shown.contains("node health: DEGRADED"), "{shown}");
    let problem = shown
        .lines()
        .find(|l| l.contains("svc-identity degraded: kvstore (etcd) unreachable"))
        .unwrap_or_else(|| panic!("the problem is listed: {shown}"));
    assert!(
        problem.contains("the store is unreachable") && !problem.contains('…'),
        "the whole reason, not cut: {problem}"
    );
    let json = status(&sockets, &["-o", "json"]);
    assert_eq!(json.status.code(), Some(3), "{}", text(&json));
    let daemons: serde_json::Value = serde_json::from_slice(&json.stdout).expect("JSON");
    let svc = daemons
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["daemon"] == "svc-identity")
        .expect("svc-identity is listed");
    assert_eq!(svc["health"], "degraded", "{svc}");
    let reason = svc["problems"][0].as_str().expect("a problem");
    assert!(problem.ends_with(reason), "JSON carries the same full reason: {reason}");
    // The identity watch fails with etcd and is restarted: rivet status shows it.
    let watch = identity_watch_until(&sockets, "the watch is shown failing and restarted", |w| {
        w["state"] == "failing" && w["restarts"].as_u64().unwrap_or(0) >= 1
    })
    .await;
    assert!(!watch["last_error"].as_str().unwrap_or("").is_empty(), "{watch}");
    let shown = text(&status(&sockets, &[]));
    let row = shown
        .lines()
        .find(|l| l.contains("svc-identity") && l.contains("identity-watch"))
        .unwrap_or_else(|| panic!("the controller is listed: {shown}"));
    assert!(row.contains("failing"), "{row}");

    let _etcd = tokio::task::spawn_blocking(move || {
        etcd.restart().expect("etcd restarts");
        etcd
    })
    .await
    .unwrap();
    let back = status_until(&sockets, 0, "the store is back").await;
    assert!(text(&back).contains("node health: HEALTHY"), "{}", text(&back));
    identity_watch_until(&sockets, "the watch runs again", |w| w["state"] == "running").await;

    // A daemon whose socket is there but which does not answer.
    identity.kill9();
    let dead = status(&sockets, &[]);
    assert_eq!(dead.status.code(), Some(1), "{}", text(&dead));
    assert!(text(&dead).contains("node health: UNHEALTHY"), "{}", text(&dead));
    assert!(
        text(&dead).contains("svc-identity unhealthy: does not answer"),
        "{}",
        text(&dead)
    );
}
