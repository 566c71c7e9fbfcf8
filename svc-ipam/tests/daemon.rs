//! svc-ipam as a real process over its Unix socket: durability across
//! kill -9, concurrency, exhaustion, refused configurations, single instance.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::{DaemonCommand, DaemonProcess};
use rivet_proto::ipam::v1 as pb;
use rivet_proto::ipam::v1::ipam_client::IpamClient;
use tempfile::TempDir;
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_svc-ipam");

fn command(dir: &Path, pools: &[&str]) -> DaemonCommand {
    let mut args = vec![
        "--socket-dir".to_string(),
        dir.join("sockets").display().to_string(),
        "--state-dir".into(),
        dir.join("state").display().to_string(),
        "--node-name".into(),
        "test-node".into(),
    ];
    for p in pools {
        args.push("--pool".into());
        args.push(p.to_string());
    }
    DaemonCommand::new(BIN, dir.join("sockets/svc-ipam.sock"))
        .args(args)
        .log_to(dir.join("svc-ipam.log"))
}

async fn start(pools: &[&str]) -> (TempDir, DaemonProcess) {
    let dir = tempfile::tempdir().unwrap();
    let daemon = command(dir.path(), pools).spawn().await.expect("svc-ipam starts");
    (dir, daemon)
}

async fn client(daemon: &DaemonProcess) -> IpamClient<DaemonChannel> {
    IpamClient::new(connect_unix(daemon.socket(), &ClientOptions::default()).await.unwrap())
}

fn allocate_req(container: &str, family: pb::Family) -> pb::AllocateRequest {
    pb::AllocateRequest {
        owner: Some(pb::Owner {
            container_id: container.into(),
            interface: "eth0".into(),
        }),
        pool: String::new(),
        family: family as i32,
        requested_address: Vec::new(),
    }
}

/// An allocation's address; svc-ipam sends only valid ones.
fn address(a: &pb::Allocation) -> IpAddr {
    rivet_proto::net::address_from_bytes(&a.address).expect("svc-ipam sends 4 or 16 bytes")
}

async fn allocations(c: &mut IpamClient<DaemonChannel>) -> BTreeMap<IpAddr, String> {
    let r = c
        .list(pb::ListRequest {
            pool: String::new(),
            include_allocations: true,
        })
        .await
        .unwrap()
        .into_inner();
    r.pools
        .iter()
        .flat_map(|p| p.allocations.iter())
        .map(|a| (address(a), a.owner.as_ref().unwrap().container_id.clone()))
        .collect()
}

#[tokio::test]
async fn allocations_survive_kill_9_and_restart() {
    let (_dir, mut daemon) = start(&["default=198.18.0.0/24,2001:2::/120"]).await;
    let mut c = client(&daemon).await;
    let mut before = BTreeMap::new();
    for i in 0..20 {
        let family = if i % 2 == 0 { pb::Family::Ipv4 } else { pb::Family::Ipv6 };
        let a = c
            .allocate(allocate_req(&format!("pod-{i}"), family))
            .await
            .unwrap()
            .into_inner();
        before.insert(address(&a.allocation.unwrap()), format!("pod-{i}"));
    }
    let boot_before = daemon.info().boot_id.clone();

    daemon.kill9();
    daemon.restart().await.expect("svc-ipam restarts on its own state");
    assert_ne!(
        daemon.info().boot_id,
        boot_before,
        "a restarted daemon has a new boot id"
    );

    let mut c = client(&daemon).await;
    assert_eq!(
        allocations(&mut c).await,
        before,
        "every acknowledged allocation survives kill -9"
    );
    let again = c
        .allocate(allocate_req("pod-0", pb::Family::Ipv4))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        before.get(&address(&again.allocation.unwrap())).map(String::as_str),
        Some("pod-0"),
        "the same owner gets the same address after a restart"
    );
    let fresh = c
        .allocate(allocate_req("pod-new", pb::Family::Ipv4))
        .await
        .unwrap()
        .into_inner();
    assert!(
        !before.contains_key(&address(&fresh.allocation.unwrap())),
        "a new owner never gets an address that is still held"
    );
}

#[tokio::test]
async fn kill_9_during_concurrent_allocations_loses_no_acknowledged_address() {
    let (_dir, mut daemon) = start(&["default=198.18.0.0/22"]).await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..8 {
        let mut c = client(&daemon).await;
        let stop = stop.clone();
        workers.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            for i in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let owner = format!("w{w}-{i}");
                match c.allocate(allocate_req(&owner, pb::Family::Ipv4)).await {
                    Ok(r) => acked.push((address(&r.into_inner().allocation.unwrap()), owner)),
                    Err(_) => break, // the daemon died under us
                }
            }
            acked
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    daemon.kill9();
    stop.store(true, Ordering::Relaxed);
    let mut acked = BTreeMap::new();
    for w in workers {
        for (addr, owner) in w.await.unwrap() {
            assert!(acked.insert(addr, owner).is_none(), "no address was handed out twice");
        }
    }
    assert!(
        acked.len() > 8,
        "the load ran long enough to matter ({} acked)",
        acked.len()
    );

    daemon
        .restart()
        .await
        .expect("svc-ipam restarts after a crash mid-write");
    let mut c = client(&daemon).await;
    let on_disk = allocations(&mut c).await;
    for (addr, owner) in &acked {
        assert_eq!(
            on_disk.get(addr),
            Some(owner),
            "acknowledged allocation {addr} of {owner} must survive the crash"
        );
    }
}

#[tokio::test]
async fn thousand_concurrent_allocations_from_twenty_clients_are_distinct() {
    let (_dir, daemon) = start(&["default=198.18.0.0/22"]).await;
    let mut tasks = Vec::new();
    for client_no in 0..20 {
        let c = client(&daemon).await;
        for i in 0..50 {
            let mut c = c.clone();
            tasks.push(tokio::spawn(async move {
                c.allocate(allocate_req(&format!("c{client_no}-{i}"), pb::Family::Ipv4))
                    .await
                    .expect("allocation succeeds while the pool has room")
                    .into_inner()
                    .allocation
                    .as_ref()
                    .map(address)
                    .unwrap()
            }));
        }
    }
    let mut seen = BTreeSet::new();
    for t in tasks {
        let addr = t.await.unwrap();
        assert!(seen.insert(addr), "{addr} was handed out twice");
    }
    assert_eq!(seen.len(), 1000);
    for a in &seen {
        assert!(
            !["198.18.0.0", "198.18.0.1", "198.18.3.255"].contains(&a.to_string().as_str()),
            "reserved {a} handed out"
        );
    }
}

#[tokio::test]
async fn exhaustion_is_resource_exhausted_naming_pool_and_size() {
    let (_dir, daemon) = start(&["tiny=198.18.0.0/30", "default=198.18.1.0/24"]).await;
    let mut c = client(&daemon).await;
    let mut req = allocate_req("a", pb::Family::Ipv4);
    req.pool = "tiny".into();
    c.allocate(req.clone()).await.expect("a /30 holds one pod");
    req.owner.as_mut().unwrap().container_id = "b".into();
    let err = c.allocate(req).await.expect_err("the second pod does not fit");
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(
        err.message().contains("pool tiny") && err.message().contains("all 1 ipv4"),
        "the error names the pool and its size: {}",
        err.message()
    );
}

#[test]
fn bad_pool_configurations_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    for (pools, expected) in [
        (vec!["default=198.18.0.0/31"], "too small"),
        (vec!["default=198.18.0.7/24"], "host bits set"),
        (vec!["default=198.18.0.0/33"], "is not a CIDR"),
        (
            vec!["a=198.18.0.0/24", "b=198.18.0.0/25"],
            "overlaps 198.18.0.0/24 of pool a",
        ),
        (vec![], "no address pool configured"),
    ] {
        let out = command(dir.path(), &pools)
            .run_to_exit(Duration::from_secs(10))
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{pools:?} must be refused");
        assert!(
            stderr.contains(expected),
            "{pools:?}: stderr must say {expected:?}: {stderr}"
        );
        assert!(
            !dir.path().join("sockets/svc-ipam.sock").exists(),
            "a refused daemon never opens its socket"
        );
    }
}

#[tokio::test]
async fn second_instance_on_the_same_socket_is_refused() {
    let (dir, first) = start(&["default=198.18.0.0/24"]).await;
    let out = command(dir.path(), &["default=198.18.0.0/24"])
        .run_to_exit(Duration::from_secs(10))
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second instance must not start");
    assert!(stderr.contains("already serving"), "{stderr}");
    let mut c = client(&first).await;
    let info_after = c
        .list(pb::ListRequest::default())
        .await
        .expect("the first instance keeps serving");
    assert_eq!(info_after.into_inner().boot_id, first.info().boot_id);
}

#[tokio::test]
async fn sigterm_stops_gracefully_and_removes_the_socket() {
    let (_dir, mut daemon) = start(&["default=198.18.0.0/24"]).await;
    let socket = daemon.socket().to_path_buf();
    let status = daemon.terminate().await.unwrap();
    assert!(status.success(), "SIGTERM is a clean exit: {status}\n{}", daemon.log());
    assert!(!socket.exists(), "a graceful stop removes the socket");
}

#[tokio::test]
async fn config_dir_supplies_pools_and_metrics_report_usage_per_pool_and_family() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    std::fs::create_dir(&config).unwrap();
    // A mounted ConfigMap: one file per flag, one pool per line.
    std::fs::write(
        config.join("pool"),
        "default=198.18.0.0/28,2001:2::/124\nextra=198.18.1.0/29\n",
    )
    .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    std::fs::write(config.join("metrics-address"), format!("127.0.0.1:{port}")).unwrap();
    let daemon = command(dir.path(), &[])
        .args(["--config-dir".as_ref(), config.as_os_str()])
        .spawn()
        .await
        .expect("svc-ipam starts from its config dir");
    let mut c = client(&daemon).await;
    c.allocate(allocate_req("a", pb::Family::Ipv4)).await.unwrap();
    c.allocate(allocate_req("a", pb::Family::Ipv6)).await.unwrap();

    let metrics = http_get(port, "/metrics").await;
    for line in [
        r#"rivet_ipam_addresses_allocated{pool="default",family="ipv4"} 1"#,
        r#"rivet_ipam_addresses_available{pool="default",family="ipv4"} 12"#,
        r#"rivet_ipam_addresses_allocated{pool="default",family="ipv6"} 1"#,
        r#"rivet_ipam_addresses_available{pool="extra",family="ipv4"} 5"#,
    ] {
        assert!(metrics.contains(line), "metrics must report {line}:\n{metrics}");
    }
    assert!(
        http_get(port, "/healthz").await.starts_with("HTTP/1.1 200"),
        "a serving daemon is healthy"
    );

    std::fs::write(config.join("pools"), "typo").unwrap();
    let out = command(dir.path(), &[])
        .args(["--config-dir".as_ref(), config.as_os_str()])
        .run_to_exit(Duration::from_secs(10))
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("pools"),
        "an unknown config file is an error naming it: {stderr}"
    );
}

async fn http_get(port: u16, path: &str) -> String {
    rivet_common::testing::http_get(([127, 0, 0, 1], port).into(), path)
        .await
        .unwrap()
}
