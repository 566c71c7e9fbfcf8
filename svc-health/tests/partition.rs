//! Issue 16 §4 and the partition test of §6 on a real simulated cluster
//! (`rivet_testkit::cluster`: three nodes, VXLAN, every daemon a process,
//! the health endpoints wired by the real rivet-cni): every node sees every
//! peer reachable by all three probe kinds; one node's underlay link goes
//! down and the others show it unreachable within two probe intervals,
//! measured on the rounds' own timestamps; it comes back and they show it
//! reachable again, also within two intervals. `rivet health`, `rivet
//! status` and the metrics say the same.
//!
//! Native routing is not run here: after the link comes back, its peers'
//! pod routes over `ul0` (which the kernel deletes when the link goes down)
//! are not put back, so the probes through the pod datapath stay down
//! (svc-loader's routes to peers; see the README's "Tests").

use std::time::{Duration, SystemTime};

use rivet_common::grpc::{ClientOptions, connect_unix};
use rivet_common::testing::metric_sample;
use rivet_proto::health::v1 as pb;
use rivet_proto::health::v1::health_service_client::HealthServiceClient;
use rivet_testkit::cluster::{Cluster, ClusterNode, ClusterOptions, Routing};

const INTERVAL: Duration = Duration::from_secs(1);

/// svc-health's metrics address inside each node's namespace.
const METRICS: &str = "127.0.0.1:9968";

/// `/metrics` of `node`'s svc-health, fetched from inside its namespace.
fn metrics(node: &ClusterNode) -> String {
    node.netns
        .in_ns(|| {
            use std::io::{Read as _, Write as _};
            let mut stream = std::net::TcpStream::connect(METRICS).expect("svc-health's metrics listener");
            stream
                .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            let mut text = String::new();
            stream.read_to_string(&mut text).unwrap();
            text
        })
        .unwrap()
}

fn reachable_metric(node: &ClusterNode, peer: &str, probe: &str) -> Option<f64> {
    metric_sample(
        &metrics(node),
        &format!("rivet_health_peer_reachable{{peer=\"{peer}\",probe=\"{probe}\"}}"),
    )
}

async fn health(node: &ClusterNode, after_round: u64) -> pb::GetHealthResponse {
    let channel = connect_unix(&node.socket("svc-health"), &ClientOptions::default())
        .await
        .unwrap_or_else(|e| panic!("svc-health of {}: {e}", node.name));
    let mut request = tonic::Request::new(pb::GetHealthRequest { after_round });
    request.set_timeout(Duration::from_secs(10));
    HealthServiceClient::new(channel)
        .get_health(request)
        .await
        .unwrap_or_else(|e| panic!("GetHealth of {}: {e}", node.name))
        .into_inner()
}

fn peer<'a>(h: &'a pb::GetHealthResponse, name: &str) -> Option<&'a pb::PeerHealth> {
    h.peers.iter().find(|p| p.name == name)
}

fn kinds(p: &pb::PeerHealth) -> Vec<i32> {
    let mut kinds: Vec<i32> = p.probes.iter().map(|x| x.kind).collect();
    kinds.dedup();
    kinds
}

fn nanos(t: SystemTime) -> u64 {
    u64::try_from(t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_nanos()).unwrap()
}

/// Round after round of `node` until `done` holds for one; that round.
async fn until(
    node: &ClusterNode,
    what: &str,
    rounds: u64,
    done: impl Fn(&pb::GetHealthResponse) -> bool,
) -> pb::GetHealthResponse {
    let mut h = health(node, 0).await;
    let first = h.round;
    while !done(&h) {
        assert!(
            h.round < first + rounds,
            "{}: {what} not seen in {rounds} rounds: {h:#?}",
            node.name
        );
        h = health(node, h.round).await;
    }
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_node_shows_within_two_intervals_and_its_recovery_too_vxlan() {
    partition(Routing::Vxlan).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_node_shows_within_two_intervals_and_its_recovery_too_native() {
    partition(Routing::Native).await;
}

async fn partition(routing: Routing) {
    let cluster = Cluster::start(ClusterOptions {
        routing,
        daemon_args: vec![
            format!("svc-health=--probe-interval={}", INTERVAL.as_secs_f64()),
            "svc-health=--probe-timeout=0.4".into(),
            format!("svc-health=--metrics-address={METRICS}"),
        ],
        ..Default::default()
    })
    .await
    .unwrap();
    let names: Vec<String> = cluster.nodes().iter().map(|n| n.name.clone()).collect();
    let everyone_reachable = |me: &str| {
        let others: Vec<String> = names.iter().filter(|n| *n != me).cloned().collect();
        move |h: &pb::GetHealthResponse| {
            others.iter().all(|o| {
                peer(h, o).is_some_and(|p| {
                    p.reachable
                        && kinds(p)
                            == [
                                pb::ProbeKind::IcmpNode as i32,
                                pb::ProbeKind::HttpNode as i32,
                                pb::ProbeKind::HttpHealthEndpoint as i32,
                            ]
                })
            })
        }
    };
    // Every node: every peer by ICMP and HTTP on both underlay addresses and HTTP to its health endpoint.
    for node in cluster.nodes() {
        let h = until(
            node,
            "every peer reachable by every probe",
            60,
            everyone_reachable(&node.name),
        )
        .await;
        assert_eq!(h.local.as_ref().unwrap().health_addresses.len(), 2, "{h:#?}");
        for p in &h.peers {
            assert!(p.probes.iter().all(|x| x.latency_nanos > 0), "{p:#?}");
        }
    }
    let status = cluster.node(1).ok(&["status"]);
    assert!(status.contains("health: 2/2 nodes reachable"), "{status}");
    let n3_name = cluster.node(3).name.clone();
    for probe in ["icmp_node", "http_node", "http_health_endpoint"] {
        assert_eq!(reachable_metric(cluster.node(1), &n3_name, probe), Some(1.0), "{probe}");
    }
    let unreachable_events = |node: &ClusterNode| {
        metric_sample(&metrics(node), "rivet_health_peer_changes_total{state=\"unreachable\"}").unwrap_or(0.0)
    };
    let events_before = unreachable_events(cluster.node(1));

    // Node 3's underlay link goes down (its IPv6 addresses kept, as a real NIC losing carrier does).
    let n3 = cluster.node(3);
    n3.netns.sysctl("net.ipv6.conf.ul0.keep_addr_on_down", "1").unwrap();
    let cut = SystemTime::now();
    n3.ip(&["link", "set", "ul0", "down"]);
    for i in [1, 2] {
        let h = until(cluster.node(i), "node 3 unreachable", 10, |h| {
            peer(h, &n3.name).is_some_and(|p| !p.reachable)
        })
        .await;
        let seen = h.round_finished_unix_nanos - nanos(cut);
        assert!(
            seen <= 2 * INTERVAL.as_nanos() as u64,
            "node {i} saw the partition {seen} ns after it (more than two intervals)"
        );
        let p = peer(&h, &n3.name).unwrap();
        assert!(
            p.probes.iter().any(|x| x.status == pb::ProbeStatus::Unreachable as i32
                && x.last_failure_kind != pb::FailureKind::Unspecified as i32
                && !x.last_failure.is_empty()),
            "{p:#?}"
        );
        // The other peer stays reachable.
        let other = if i == 1 { 2 } else { 1 };
        assert!(peer(&h, &cluster.node(other).name).unwrap().reachable, "{h:#?}");
    }
    // The metric says so, and the change was one event (its counter).
    for probe in ["icmp_node", "http_node", "http_health_endpoint"] {
        assert_eq!(reachable_metric(cluster.node(1), &n3.name, probe), Some(0.0), "{probe}");
    }
    assert_eq!(unreachable_events(cluster.node(1)), events_before + 1.0);
    let text = metrics(cluster.node(1));
    assert!(metric_sample(&text, "rivet_health_probe_latency_seconds_count{probe=\"icmp_node\"}").unwrap() > 0.0);
    let shown = cluster.node(1).json(&["health"]);
    let row = shown["peer_health"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == n3.name.as_str())
        .unwrap();
    assert_eq!(row["reachable"], false, "{shown}");
    let status = cluster.node(1).ok(&["status"]);
    assert!(
        status.contains(&format!("health: 1/2 nodes reachable; unreachable: {}", n3.name)),
        "{status}"
    );

    // Back.
    let healed = SystemTime::now();
    n3.ip(&["link", "set", "ul0", "up"]);
    for i in [1, 2] {
        let node = cluster.node(i);
        let h = until(node, "node 3 reachable again", 10, everyone_reachable(&node.name)).await;
        let seen = h.round_finished_unix_nanos - nanos(healed);
        assert!(
            seen <= 2 * INTERVAL.as_nanos() as u64,
            "node {i} saw the recovery {seen} ns after it (more than two intervals)"
        );
    }
    cluster.down().await;
}
