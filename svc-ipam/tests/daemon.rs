//! svc-ipam as a real process over its Unix socket: durability across
//! kill -9, concurrency, exhaustion, refused configurations, single
//! instance, pools set by SetPool.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::{DaemonCommand, DaemonProcess};
use rivet_proto::daemon::v1::GetInfoRequest;
use rivet_proto::daemon::v1::daemon_client::DaemonClient;
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

fn set_pool_req(name: &str, cidrs: &[&str]) -> pb::SetPoolRequest {
    pb::SetPoolRequest {
        name: name.into(),
        cidrs: cidrs
            .iter()
            .map(|c| rivet_proto::net::prefix_to_proto(c.parse().unwrap()))
            .collect(),
    }
}

async fn degraded(daemon: &DaemonProcess) -> String {
    let channel = connect_unix(daemon.socket(), &ClientOptions::default()).await.unwrap();
    DaemonClient::new(channel)
        .get_info(GetInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .degraded
}

fn reason(status: &tonic::Status) -> Option<pb::ErrorReason> {
    rivet_common::grpc::error_reason(status)
}

async fn pool(c: &mut IpamClient<DaemonChannel>, name: &str) -> pb::Pool {
    let listed = c
        .list(pb::ListRequest {
            pool: name.into(),
            include_allocations: true,
        })
        .await
        .unwrap()
        .into_inner();
    listed.pools.into_iter().next().unwrap()
}

fn cidrs(p: &pb::Pool) -> Vec<String> {
    p.ranges
        .iter()
        .map(|r| rivet_proto::net::format_prefix(r.cidr.as_ref().unwrap()))
        .collect()
}

#[tokio::test]
async fn without_a_pool_svc_ipam_is_degraded_until_set_pool_and_keeps_the_pool_across_kill_9() {
    let (_dir, mut daemon) = start(&[]).await;
    let mut c = client(&daemon).await;
    let waiting = eventually_degraded(&daemon, |d| !d.is_empty()).await;
    assert!(
        waiting.contains("no pool yet: waiting for the node's pod CIDRs"),
        "GetInfo says why: {waiting}"
    );
    let err = c.allocate(allocate_req("a", pb::Family::Ipv4)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(reason(&err), Some(pb::ErrorReason::NoPoolYet));

    let set = c
        .set_pool(set_pool_req("default", &["198.18.0.0/24", "2001:2::/120"]))
        .await
        .unwrap()
        .into_inner();
    assert!(set.changed);
    let set_pool = set.pool.unwrap();
    assert_eq!(set_pool.source, pb::PoolSource::SetPool as i32);
    assert_eq!(cidrs(&set_pool), ["198.18.0.0/24", "2001:2::/120"]);
    assert_eq!(set_pool.ranges[0].available, 253);
    eventually_degraded(&daemon, str::is_empty).await;
    let a = c
        .allocate(allocate_req("a", pb::Family::Ipv4))
        .await
        .unwrap()
        .into_inner()
        .allocation
        .unwrap();
    assert_eq!(address(&a).to_string(), "198.18.0.2");
    assert_eq!(a.prefix_length, 24);

    daemon.kill9();
    daemon.restart().await.expect("svc-ipam restarts without flags");
    let mut c = client(&daemon).await;
    let restored = pool(&mut c, "default").await;
    assert_eq!(cidrs(&restored), ["198.18.0.0/24", "2001:2::/120"], "the pool is back");
    assert_eq!(restored.source, pb::PoolSource::SetPool as i32);
    assert_eq!(
        restored.allocations.iter().map(address).collect::<Vec<_>>(),
        [address(&a)],
        "and its allocations"
    );
    assert_eq!(degraded(&daemon).await, "", "a restored pool is ready at once");
    let again = c
        .set_pool(set_pool_req("default", &["2001:2::/120", "198.18.0.0/24"]))
        .await
        .unwrap()
        .into_inner();
    assert!(!again.changed, "the same ranges again change nothing");
}

/// Allocates an IPv4 address for `container` (interface eth0).
async fn allocate_v4(c: &mut IpamClient<DaemonChannel>, container: &str) -> IpAddr {
    let a = c
        .allocate(allocate_req(container, pb::Family::Ipv4))
        .await
        .unwrap()
        .into_inner();
    address(&a.allocation.unwrap())
}

async fn eventually_degraded(daemon: &DaemonProcess, ok: impl Fn(&str) -> bool) -> String {
    let started = std::time::Instant::now();
    loop {
        let d = degraded(daemon).await;
        if ok(&d) {
            return d;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "GetInfo degraded stays {d:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn set_pool_keeps_allocations_inside_and_refuses_a_change_that_strands_one() {
    let (_dir, daemon) = start(&[]).await;
    let mut c = client(&daemon).await;
    c.set_pool(set_pool_req("default", &["198.18.0.0/29"])).await.unwrap();
    let mut held = BTreeMap::new();
    for i in 0..5 {
        held.insert(allocate_v4(&mut c, &format!("pod-{i}")).await, format!("pod-{i}"));
    }
    let err = c.allocate(allocate_req("pod-x", pb::Family::Ipv4)).await.unwrap_err();
    assert_eq!(reason(&err), Some(pb::ErrorReason::PoolExhausted));

    // Moved: every held address (198.18.0.2-6) would be stranded.
    let before = pool(&mut c, "default").await;
    let err = c
        .set_pool(set_pool_req("default", &["198.18.1.0/24"]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(reason(&err), Some(pb::ErrorReason::PoolChangeStrandsAllocations));
    assert!(
        err.message().contains("5 allocated address(es)") && err.message().contains("198.18.0.2 of pod-0/eth0"),
        "the refusal says how many and names one: {}",
        err.message()
    );
    assert_eq!(
        pool(&mut c, "default").await,
        before,
        "a refused change changes nothing"
    );

    // Grown: every held address stays valid and none is handed out again.
    let grown = c
        .set_pool(set_pool_req("default", &["198.18.0.0/28"]))
        .await
        .unwrap()
        .into_inner();
    assert!(grown.changed);
    assert_eq!(grown.pool.unwrap().ranges[0].allocated, 5);
    assert_eq!(
        allocations(&mut c).await,
        held,
        "allocations inside the new ranges stay"
    );
    for i in 0..8 {
        let fresh = allocate_v4(&mut c, &format!("new-{i}")).await;
        assert!(!held.contains_key(&fresh), "a held address is never handed out twice");
    }
    assert_eq!(
        held.get(&allocate_v4(&mut c, "pod-0").await).map(String::as_str),
        Some("pod-0"),
        "an owner keeps its address across the change"
    );
}

#[tokio::test]
async fn set_pool_refuses_flag_pools_and_invalid_requests_naming_the_field() {
    let (_dir, daemon) = start(&["default=198.18.0.0/24"]).await;
    let mut c = client(&daemon).await;
    let err = c
        .set_pool(set_pool_req("default", &["198.18.4.0/24"]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert_eq!(reason(&err), Some(pb::ErrorReason::PoolFixedByFlag));
    assert!(err.message().contains("--pool"), "{}", err.message());
    let listed = pool(&mut c, "default").await;
    assert_eq!(cidrs(&listed), ["198.18.0.0/24"]);
    assert_eq!(listed.source, pb::PoolSource::Flag as i32);

    let mut host_bits = set_pool_req("other", &["198.18.4.0/24"]);
    host_bits.cidrs[0].address = vec![198, 18, 4, 1];
    let mut bad_length = set_pool_req("other", &["198.18.4.0/24"]);
    bad_length.cidrs[0].address = vec![198, 18, 4];
    for (request, field, text) in [
        (set_pool_req("Other", &["198.18.4.0/24"]), "name", "lowercase"),
        (set_pool_req("", &["198.18.4.0/24"]), "name", "lowercase"),
        (set_pool_req("other", &[]), "cidrs", "no CIDR"),
        (host_bits, "cidrs[0]", "host bits"),
        (bad_length, "cidrs[0]", ""),
        (
            set_pool_req("other", &["198.18.0.128/25"]),
            "cidrs",
            "overlaps 198.18.0.0/24 of pool default",
        ),
        (set_pool_req("other", &["198.18.4.0/31"]), "cidrs", "too small"),
    ] {
        let err = c.set_pool(request.clone()).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{request:?}: {err:?}");
        assert!(
            err.message().starts_with(&format!("{field}: ")) && err.message().contains(text),
            "{request:?}: the error names {field} and says {text:?}: {}",
            err.message()
        );
    }
    let listed = c.list(pb::ListRequest::default()).await.unwrap().into_inner();
    assert_eq!(listed.pools.len(), 1, "nothing refused was created");
}
