//! The real svc-health process in a node namespace, with a health endpoint
//! namespace beside it (a veth, as a pod's): `/hello` served on the node's
//! address and inside the health endpoint's namespace (made there by the
//! forked socket helper), no capability in the daemon or its helper, the
//! helper gone with a kill -9, rounds numbered and waited for, a round asked
//! for that does not come in time refused with its reason.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rivet_common::grpc::{ClientOptions, DaemonChannel, RpcError, connect_unix};
use rivet_common::testing::netns::{NetNs, veth_pair};
use rivet_common::testing::{DaemonCommand, DaemonProcess, workspace_binary};
use rivet_proto::health::v1 as pb;
use rivet_proto::health::v1::health_service_client::HealthServiceClient;
use svc_health::net::{self, NamespaceSockets};

const NODE: &str = "198.19.254.1";
const PEER: &str = "198.19.254.2";
const HEALTH_GW: &str = "198.18.1.1";
const HEALTH: &str = "198.18.1.2";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

struct Node {
    node: NetNs,
    health: NetNs,
    peer: NetNs,
    _dir: tempfile::TempDir,
    command: DaemonCommand,
}

impl Node {
    fn new() -> Self {
        let node = NetNs::new("hdn").unwrap();
        let health = NetNs::new("hdh").unwrap();
        let peer = NetNs::new("hdp").unwrap();
        veth_pair(&node, "ul0", &peer, "ul0").unwrap();
        node.ip(&["addr", "add", &format!("{NODE}/24"), "dev", "ul0"]).unwrap();
        peer.ip(&["addr", "add", &format!("{PEER}/24"), "dev", "ul0"]).unwrap();
        veth_pair(&node, "hv0", &health, "eth0").unwrap();
        node.ip(&["addr", "add", &format!("{HEALTH_GW}/24"), "dev", "hv0"])
            .unwrap();
        health
            .ip(&["addr", "add", &format!("{HEALTH}/24"), "dev", "eth0"])
            .unwrap();
        // The test runs the daemon as root: group 0 may open echo sockets, in the node namespace only.
        node.sysctl("net.ipv4.ping_group_range", "0 0").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("svc-health.sock");
        let command = DaemonCommand::new("nsenter", socket)
            .arg(format!("--net={}", node.path().display()))
            .arg("--")
            .arg(workspace_binary("svc-health"))
            .args(["--socket-dir", dir.path().to_str().unwrap()])
            .args(["--node-name", "n1", "--node-address", NODE])
            .arg("--health-netns")
            .arg(health.path())
            .args(["--probe-interval", "0.5", "--probe-timeout", "0.2"]);
        Self {
            node,
            health,
            peer,
            _dir: dir,
            command,
        }
    }
}

async fn client(daemon: &DaemonProcess) -> HealthServiceClient<DaemonChannel> {
    HealthServiceClient::new(
        connect_unix(daemon.socket(), &ClientOptions::default())
            .await
            .expect("connect to svc-health"),
    )
}

async fn health_after(daemon: &DaemonProcess, after_round: u64) -> pb::GetHealthResponse {
    let mut request = tonic::Request::new(pb::GetHealthRequest { after_round });
    request.set_timeout(Duration::from_secs(10));
    client(daemon)
        .await
        .get_health(request)
        .await
        .unwrap_or_else(|e| panic!("GetHealth after round {after_round}: {e}\n{}", daemon.log()))
        .into_inner()
}

/// `CapEff`, `CapPrm`, `CapBnd` and `NoNewPrivs` of a process.
fn privileges(pid: u32) -> Vec<(String, String)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| ["CapEff", "CapPrm", "CapInh", "CapAmb", "NoNewPrivs"].contains(k))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_on_the_node_and_in_the_health_endpoint_with_no_capability_across_a_kill_9() {
    let node = Node::new();
    let mut daemon = node.command.spawn().await.unwrap();
    let pid = daemon.pid().unwrap();

    // Peers probe /hello on the node's address...
    let from_peer = Arc::new(NamespaceSockets::enter(&node.peer.path()).unwrap());
    net::http_hello(&*from_peer, ip(NODE), net::HEALTH_PORT, Duration::from_secs(2))
        .await
        .unwrap_or_else(|e| panic!("/hello on the node: {e}\n{}", daemon.log()));
    // ... and on the health endpoint's, served from its namespace (the node reaches it over the veth).
    let from_node = NamespaceSockets::enter(&node.node.path()).unwrap();
    net::http_hello(&from_node, ip(HEALTH), net::HEALTH_PORT, Duration::from_secs(2))
        .await
        .unwrap_or_else(|e| panic!("/hello in the health endpoint: {e}\n{}", daemon.log()));
    // Not in the node namespace on the health endpoint's gateway: the listener there is the node's only.
    let refused = net::http_hello(&from_node, ip(HEALTH_GW), net::HEALTH_PORT, Duration::from_secs(2))
        .await
        .unwrap_err();
    assert_eq!(refused.kind, svc_health::probe::FailureKind::Refused, "{refused}");

    // No capability, in the daemon and in its socket helper (in the health endpoint's namespace).
    let helpers = children(pid);
    assert_eq!(helpers.len(), 1, "one socket helper: {helpers:?}");
    let helper = helpers[0];
    let helper_ns = std::fs::read_link(format!("/proc/{helper}/ns/net")).unwrap();
    let health_ns = node
        .health
        .in_ns(|| std::fs::read_link("/proc/thread-self/ns/net").unwrap())
        .unwrap();
    assert_eq!(helper_ns, health_ns);
    for p in [pid, helper] {
        for (key, value) in privileges(p) {
            let expected = if key == "NoNewPrivs" { "1" } else { "0000000000000000" };
            assert_eq!(value, expected, "pid {p}: {key}");
        }
    }

    // Rounds are numbered; a caller waits for the next one instead of sleeping.
    let first = health_after(&daemon, 0).await;
    let next = health_after(&daemon, first.round).await;
    assert!(next.round > first.round);
    assert_eq!(next.local.as_ref().unwrap().node_name, "n1");
    assert!(
        next.peers_error.contains("svc-identity"),
        "no registry here: the listing fails and says why: {next:?}"
    );
    assert_eq!(next.probe_interval_nanos, 500_000_000);

    // A round that does not come within the deadline: DEADLINE_EXCEEDED, ROUND_PENDING.
    let mut request = tonic::Request::new(pb::GetHealthRequest {
        after_round: next.round + 1_000,
    });
    request.set_timeout(Duration::from_millis(300));
    let error = RpcError::<pb::ErrorReason>::from(client(&daemon).await.get_health(request).await.unwrap_err());
    assert_eq!(error.code(), tonic::Code::DeadlineExceeded, "{error:?}");
    assert_eq!(error.reason(), Some(pb::ErrorReason::RoundPending), "{error:?}");

    // kill -9: the helper dies with it; the restarted daemon serves both places again.
    daemon.kill9();
    let started = Instant::now();
    while std::path::Path::new(&format!("/proc/{helper}")).exists() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the helper outlived the daemon"
        );
        tokio::task::yield_now().await;
    }
    daemon.restart().await.unwrap();
    net::http_hello(&*from_peer, ip(NODE), net::HEALTH_PORT, Duration::from_secs(2))
        .await
        .unwrap();
    net::http_hello(&from_node, ip(HEALTH), net::HEALTH_PORT, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(children(daemon.pid().unwrap()).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_health_namespace_fails_the_start_naming_it() {
    let node = Node::new();
    let out = DaemonCommand::new("nsenter", node._dir.path().join("x.sock"))
        .arg(format!("--net={}", node.node.path().display()))
        .arg("--")
        .arg(workspace_binary("svc-health"))
        .args(["--socket-dir", node._dir.path().to_str().unwrap()])
        .args(["--health-netns", "/run/netns/no-such-health-ns"])
        .run_to_exit(Duration::from_secs(10))
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/run/netns/no-such-health-ns"), "{stderr}");

    let out = DaemonCommand::new(workspace_binary("svc-health"), node._dir.path().join("y.sock"))
        .args(["--socket-dir", node._dir.path().to_str().unwrap()])
        .args(["--probe-interval", "1", "--probe-timeout", "1"])
        .run_to_exit(Duration::from_secs(10))
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--probe-timeout"), "{stderr}");
}
