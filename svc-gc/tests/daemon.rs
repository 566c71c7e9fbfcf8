//! The real svc-gc process: over a million entries killed with SIGKILL in the
//! middle of a pass and restarted; a TCP connection between two pods of a
//! whole simulated node (real datapath, svc-endpoint listing the endpoints)
//! across many passes; `rivet gc` and the metrics.

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::{DaemonCommand, DaemonProcess, http_get, workspace_binary};
use rivet_datapath::maps::{Ct4Key, CtEntry, DIR_EGRESS, DIR_INGRESS, ipv4_to_raw};
use rivet_datapath::spec;
use rivet_proto::gc::v1 as pb;
use rivet_proto::gc::v1::gc_service_client::GcServiceClient;
use rivet_testkit::gc::{BPFFS, SECOND, TestMaps, daemon_command, synthetic_entries};
use rivet_testkit::node::{EndpointNode, NodeOptions};
use svc_gc::clock::{Clock, KernelClock};
use svc_gc::map::{BatchMode, EntryMap as _, PinnedMap};

async fn client(daemon: &DaemonProcess) -> GcServiceClient<DaemonChannel> {
    GcServiceClient::new(
        connect_unix(daemon.socket(), &ClientOptions::default())
            .await
            .expect("connect to svc-gc"),
    )
}

async fn status(daemon: &DaemonProcess) -> pb::StatusResponse {
    client(daemon)
        .await
        .status(pb::StatusRequest {})
        .await
        .expect("Status")
        .into_inner()
}

async fn wait_status(
    daemon: &DaemonProcess,
    what: &str,
    pred: impl Fn(&pb::StatusResponse) -> bool,
) -> pb::StatusResponse {
    let started = Instant::now();
    loop {
        let s = status(daemon).await;
        if pred(&s) {
            return s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}: {s:?}\n{}",
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn map_stats<'a>(pass: &'a pb::PassStats, map: &str) -> &'a pb::MapPassStats {
    pass.maps.iter().find(|m| m.map == map).expect("the map is in the pass")
}

fn expired(m: &pb::MapPassStats) -> u64 {
    m.deleted.as_ref().map_or(0, |d| d.expired)
}

const LIVE: u32 = 900_000;
const EXPIRED: u32 = 100_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_pass_over_a_million_entries_and_restart() {
    let maps = TestMaps::create("kill9", 1_310_720, 64).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let clock = KernelClock::new();
    let (keys, values) = synthetic_entries(clock.monotonic_nanos(), LIVE, EXPIRED, 21_600);
    let mut ct4 = maps.ct4();
    ct4.insert_all(&keys, &values).unwrap();
    let live = LIVE as usize;
    let command = daemon_command(
        &workspace_binary("svc-gc"),
        dir.path(),
        &maps.node_name,
        &[
            "--start-interval-seconds",
            "3600",
            "--min-interval-seconds",
            "3600",
            "--max-interval-seconds",
            "3600",
            "--pressure-threshold",
            "1",
        ],
    );

    // Start svc-gc (its initial pass runs at once), watch a sample of the
    // expired entries and SIGKILL it as soon as one of them is gone: killed
    // in the middle of deleting (a sample of 1000 is looked up in ~1 ms; the
    // pass takes far longer to delete 100k). Retried if the pass was done.
    let sample: Vec<Ct4Key> = keys[live..].iter().step_by(100).copied().collect();
    let mut killed = None;
    for attempt in 0..4 {
        ct4.insert_all(&keys[live..], &values[live..]).unwrap();
        let mut daemon = command.spawn().await.unwrap();
        let started = Instant::now();
        while sample.iter().all(|k| ct4.lookup(k).unwrap().is_some()) {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the pass deleted nothing: {:?}\n{}",
                status(&daemon).await,
                daemon.log()
            );
            tokio::task::yield_now().await;
        }
        let boot_id = daemon.info().boot_id.clone();
        daemon.kill9();
        let left = ct4.dump().unwrap().len() - live;
        eprintln!("attempt {attempt}: killed with {left} expired entries left");
        if left > 0 && left < EXPIRED as usize {
            killed = Some((daemon, boot_id, left));
            break;
        }
    }
    let (mut daemon, old_boot_id, left) = killed.expect("svc-gc was killed in the middle of a pass");

    // Consistent: every live entry is there, unchanged; everything else is
    // an expired entry as written; both iterations agree.
    let batch: HashMap<Ct4Key, CtEntry> = ct4.dump().unwrap().into_iter().collect();
    let mut per_entry = PinnedMap::<Ct4Key, CtEntry>::open(maps.pin_dir(), &spec::CT4, BatchMode::Never).unwrap();
    let walked: HashMap<Ct4Key, CtEntry> = per_entry.dump().unwrap().into_iter().collect();
    assert!(!per_entry.batched());
    assert_eq!(batch.len(), live + left);
    assert!(batch == walked, "batch and per-element iteration see the same map");
    for (k, v) in keys.iter().zip(&values).take(live) {
        assert_eq!(batch.get(k), Some(v), "a live entry was touched");
    }
    for (k, v) in keys.iter().zip(&values).skip(live) {
        if let Some(found) = batch.get(k) {
            assert_eq!(found, v);
        }
    }

    // Restarted, the initial pass completes and finishes the job.
    daemon.restart().await.unwrap();
    assert_ne!(daemon.info().boot_id, old_boot_id);
    let s = wait_status(&daemon, "the initial pass after the restart", |s| s.passes >= 1).await;
    let pass = s.last_pass.unwrap();
    assert_eq!(pass.trigger, pb::PassTrigger::Initial as i32);
    let ct4_stats = map_stats(&pass, "ct4");
    assert_eq!(ct4_stats.error, "", "{pass:?}");
    assert!(ct4_stats.batched);
    assert_eq!(ct4_stats.scanned, (live + left) as u64);
    assert_eq!(expired(ct4_stats), left as u64);
    assert_eq!(ct4_stats.remaining, live as u64);
    assert_eq!(ct4.dump().unwrap().len(), live);
    eprintln!(
        "pass over {} entries: {} ms",
        ct4_stats.scanned,
        ct4_stats.duration_nanos / 1_000_000
    );

    // And the next one has nothing left to do.
    let again = client(&daemon)
        .await
        .run_now(pb::RunNowRequest {})
        .await
        .unwrap()
        .into_inner();
    let pass = again.pass.unwrap();
    assert_eq!(pass.pass_number, 2);
    assert_eq!(pass.trigger, pb::PassTrigger::RunNow as i32);
    assert_eq!((pass.scanned, pass.deleted.unwrap().expired), (live as u64, 0));
    assert_eq!(again.boot_id, daemon.info().boot_id);
}

fn rivet(sockets: &Path, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(workspace_binary("rivet"))
        .arg("--socket-dir")
        .arg(sockets)
        .args(args)
        .args(["-o", "json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "rivet {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test]
async fn rivet_gc_run_and_status_and_metrics() {
    let maps = TestMaps::create("cli", 1024, 1024).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let clock = KernelClock::new();
    let (keys, values) = synthetic_entries(clock.monotonic_nanos(), 10, 5, 21_600);
    let mut ct4 = maps.ct4();
    ct4.insert_all(&keys, &values).unwrap();
    let metrics = SocketAddr::from(([127, 0, 0, 1], rivet_common::testing::free_local_port()));
    let daemon = daemon_command(
        &workspace_binary("svc-gc"),
        dir.path(),
        &maps.node_name,
        &["--metrics-address", &metrics.to_string()],
    )
    .spawn()
    .await
    .unwrap();
    wait_status(&daemon, "the initial pass", |s| s.passes >= 1).await;

    // Three more idle entries; `rivet gc run` deletes them.
    let (more_keys, more_values) = synthetic_entries(clock.monotonic_nanos(), 0, 3, 21_600);
    let more_keys: Vec<Ct4Key> = more_keys
        .iter()
        .map(|k| Ct4Key {
            dport: 443u16.to_be(),
            ..*k
        })
        .collect();
    ct4.insert_all(&more_keys, &more_values).unwrap();
    let sockets = dir.path().join("sockets");
    let pass = rivet(&sockets, &["gc", "run"]);
    assert_eq!(pass["trigger"], "run-now");
    assert_eq!(pass["deleted"]["expired"], 3);
    assert_eq!(
        pass["orphan_check"], "skipped-list-failed",
        "no svc-endpoint on this node"
    );
    assert_eq!(pass["maps"][0]["map"], "ct4");
    assert_eq!(pass["maps"][0]["remaining"], 10);

    let s = rivet(&sockets, &["gc", "status"]);
    assert_eq!(s["passes"], 2);
    assert_eq!(s["totals"][0]["deleted"]["expired"], 8);
    assert_eq!(s["timeouts"]["tcp_established_s"], 21_600.0);
    assert_eq!(s["min_interval_nanos"], 10 * SECOND);
    assert_eq!(s["boot_id"], daemon.info().boot_id.as_str());

    let text = String::from_utf8(
        std::process::Command::new(workspace_binary("rivet"))
            .arg("--socket-dir")
            .arg(&sockets)
            .args(["gc", "status"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    assert!(text.contains("Last pass:") && text.contains("ct6"), "{text}");

    let exposition = http_get(metrics, "/metrics").await.unwrap();
    for line in [
        "rivet_gc_entries_deleted_total{map=\"ct4\",reason=\"expired\"} 8",
        "rivet_gc_passes_total{trigger=\"run_now\"} 1",
        "rivet_gc_passes_total{trigger=\"initial\"} 1",
        "rivet_gc_entries{map=\"ct4\"} 10",
    ] {
        assert!(exposition.contains(line), "missing {line}:\n{exposition}");
    }
}

/// The ct4 entries of connections to `dst`, by key.
fn entries_to(pin_dir: &Path, dst: SocketAddr) -> HashMap<Ct4Key, CtEntry> {
    let SocketAddr::V4(dst) = dst else { panic!("IPv4") };
    let mut map = PinnedMap::<Ct4Key, CtEntry>::open(pin_dir, &spec::CT4, BatchMode::Auto).unwrap();
    map.dump()
        .unwrap()
        .into_iter()
        .filter(|(k, _)| k.daddr == ipv4_to_raw(*dst.ip()) && k.dport == dst.port().to_be())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_connection_between_pods_survives_passes_while_active_and_expires_when_idle() {
    let mut node = EndpointNode::start(NodeOptions::default()).await.unwrap();
    node.add_pod("a", &["k8s:app=a"]).await;
    node.add_pod("b", &["k8s:app=b"]).await;
    let server = node.pod("b").tcp_server(0).unwrap();
    let dst = SocketAddr::new(node.ipv4("b"), server.port());
    let pin_dir = node.node.pins.0.clone();
    let sockets = node.sockets();

    // svc-gc in the node namespace, a pass every second, idle timeouts of 3 s.
    let gc = DaemonCommand::new("nsenter", sockets.join("svc-gc.sock"))
        .arg(format!("--net={}", node.node.node.ns.path().display()))
        .arg(workspace_binary("svc-gc"))
        .args(["--socket-dir".as_ref(), sockets.as_os_str()])
        .args(["--state-dir".as_ref(), node.state_dir().as_os_str()])
        .args(["--node-name", &node.node.node_name, "--bpffs", BPFFS])
        .args(["--ct-tcp-syn-timeout", "3", "--ct-tcp-established-timeout", "3"])
        .args([
            "--ct-tcp-closing-timeout",
            "3",
            "--ct-udp-timeout",
            "3",
            "--ct-icmp-timeout",
            "3",
        ])
        .args([
            "--start-interval-seconds",
            "1",
            "--min-interval-seconds",
            "1",
            "--max-interval-seconds",
            "1",
        ])
        .args(["--pressure-threshold", "1"])
        .log_to(node.node.dir.path().join("svc-gc.log"))
        .spawn()
        .await
        .unwrap();

    // Active for 9 s, three timeouts: an echo every 300 ms.
    let mut stream = node.pod("a").tcp_stream(dst, Duration::from_secs(5)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let passes_before = status(&gc).await.passes;
    let mut packets: HashMap<Ct4Key, u64> = HashMap::new();
    let started = Instant::now();
    let mut i = 0u32;
    while started.elapsed() < Duration::from_secs(9) {
        let message = format!("message {i:06}");
        stream.write_all(message.as_bytes()).unwrap();
        let mut back = vec![0; message.len()];
        stream.read_exact(&mut back).expect("the connection works");
        assert_eq!(back, message.as_bytes());
        let entries = entries_to(&pin_dir, dst);
        let directions: Vec<u8> = {
            let mut d: Vec<u8> = entries.keys().map(|k| k.direction).collect();
            d.sort_unstable();
            d
        };
        assert_eq!(
            directions,
            [DIR_INGRESS, DIR_EGRESS],
            "a's egress and b's ingress entry: {entries:?}"
        );
        for (key, entry) in &entries {
            let total = entry.packets_fwd + entry.packets_rev;
            let previous = packets.insert(*key, total).unwrap_or(0);
            // A deleted entry would come back with its counters restarted.
            assert!(
                total >= previous,
                "entry {key:?} was deleted while active ({previous} → {total})"
            );
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let last_activity = Instant::now();
    let s = status(&gc).await;
    assert!(
        s.passes >= passes_before + 6,
        "{} passes while active",
        s.passes - passes_before
    );
    let last = s.last_pass.unwrap();
    assert_eq!(
        last.orphan_check,
        pb::OrphanCheck::Done as i32,
        "svc-endpoint lists both pods"
    );

    // Idle: both entries go once 3 s (+ up to the refresh granularity and a
    // pass interval) passed, not before.
    let gone = loop {
        let entries = entries_to(&pin_dir, dst);
        if entries.is_empty() {
            break last_activity.elapsed();
        }
        assert!(
            last_activity.elapsed() < Duration::from_secs(15),
            "idle entries still there: {entries:?}\n{}",
            gc.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        gone >= Duration::from_secs(3),
        "deleted after {gone:?} idle, before the timeout"
    );
    let s = status(&gc).await;
    let ct4 = s.totals.iter().find(|t| t.map == "ct4").unwrap();
    assert!(ct4.deleted.as_ref().unwrap().expired >= 2, "{s:?}");
    assert_eq!(ct4.deleted.as_ref().unwrap().orphaned_endpoint, 0);
    eprintln!("entries deleted {gone:?} after the last packet; {} passes", s.passes);
}
