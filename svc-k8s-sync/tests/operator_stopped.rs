//! Issue 15 §7, "the operator stopped for a minute": a node in cluster-pool
//! IPAM (its pod CIDRs allocated by the real rivet-operator) with pods and
//! a NetworkPolicy; the operator is killed with SIGKILL for a minute. The
//! pods' traffic loses no packet, new pods on the node start and reach
//! their peers as the policy says, and nothing is tainted or collected.
//! Started again, the operator leads and its passes leave the live pods'
//! RivetEndpoints and the ready node alone.

mod support;

use std::time::{Duration, Instant};

use kube::api::{Api, ListParams};
use rivet_common::testing::{http_get, metric_sample};
use rivet_k8s::RivetEndpoint;
use rivet_testkit::operator::Operator;
use support::{CONVERGE, Cluster, eventually};

/// How long the operator stays down.
const OUTAGE: Duration = Duration::from_secs(60);
/// Ping interval (as root).
const PING_INTERVAL: Duration = Duration::from_millis(5);

async fn rivet_endpoints(cluster: &Cluster) -> Vec<String> {
    let mut names: Vec<String> = Api::<RivetEndpoint>::namespaced(cluster.admin(), "shop")
        .list(&ListParams::default())
        .await
        .expect("RivetEndpoints list")
        .items
        .into_iter()
        .filter_map(|e| e.metadata.name)
        .collect();
    names.sort();
    names
}

/// Passes of the operator's controller `name` (ok and error).
async fn operator_passes(operator: &Operator, name: &str) -> f64 {
    let text = http_get(operator.metrics_address(), "/metrics")
        .await
        .expect("the operator's /metrics");
    ["ok", "error"]
        .iter()
        .filter_map(|result| {
            metric_sample(
                &text,
                &format!("rivet_controller_reconciles_total{{controller=\"{name}\",result=\"{result}\"}}"),
            )
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operator_stopped_for_a_minute_costs_no_packet_and_new_pods_still_start() {
    let mut cluster = Cluster::start_cluster_pool(&[]).await;
    let mut operator = cluster
        .start_operator(&["--endpoint-gc-interval", "1s", "--node-status-grace", "10s"])
        .await;
    eventually("the node is ready and untainted", CONVERGE, || async {
        let ready = cluster.sync_status().await.node_ready;
        let tainted = cluster.not_ready_taint().await;
        if ready && !tainted {
            Ok(())
        } else {
            Err(format!("ready={ready} tainted={tainted}"))
        }
    })
    .await;

    cluster.shop_with_server_policy().await;
    let _echo = cluster.tcp_server("server", 8080);
    assert!(cluster.tcp("client", "server", 8080), "client reaches server");

    // The operator dies (SIGKILL: its Lease stays held, no replica leads).
    operator.kill9();
    let stopped = Instant::now();
    let ping = cluster.ping_in_background(
        "client",
        "server",
        (OUTAGE.as_millis() / PING_INTERVAL.as_millis()) as u64,
    );

    // New pods on the node start meanwhile, on the node's pod CIDRs, and
    // the policy holds for them.
    cluster.pod("shop", "late-client", &[("app", "client")]).await;
    cluster.pod("shop", "late-other", &[("app", "other")]).await;
    let _late_echo = cluster.tcp_server("late-client", 8081);
    eventually("the new client reaches the server", CONVERGE, || async {
        if cluster.tcp("late-client", "server", 8080) {
            Ok(())
        } else {
            Err("no answer".to_string())
        }
    })
    .await;
    assert!(
        cluster.tcp("client", "late-client", 8081),
        "an old pod reaches a new one (no policy selects it)"
    );
    assert!(
        !cluster.tcp("late-other", "server", 8080),
        "the policy denies the new pod it does not allow"
    );

    let (sent, received) = ping.join().expect("the ping thread");
    let down_for = stopped.elapsed();
    assert!(down_for >= OUTAGE, "the operator was down for {down_for:?}");
    assert_eq!(
        sent - received,
        0,
        "no packet lost while the operator was down ({sent} sent)"
    );
    assert!(!cluster.not_ready_taint().await, "nobody tainted the ready node");
    let endpoints = ["client", "late-client", "late-other", "server"];
    eventually("every pod has its RivetEndpoint", CONVERGE, || async {
        match rivet_endpoints(&cluster).await {
            names if names == endpoints => Ok(()),
            names => Err(format!("{names:?}")),
        }
    })
    .await;

    // Started again: a new replica takes over once the dead one's Lease
    // expired; its endpoint GC and taint passes leave the live pods'
    // RivetEndpoints and the ready node alone.
    operator.restart().await.expect("rivet-operator starts again");
    operator.wait_leading(CONVERGE).await.expect("the operator leads again");
    eventually("the operator's endpoint GC made two passes", CONVERGE, || async {
        let passes = operator_passes(&operator, "endpoint-gc").await;
        if passes >= 2.0 {
            Ok(())
        } else {
            Err(format!("{passes} passes"))
        }
    })
    .await;
    assert!(operator_passes(&operator, "node-taint").await >= 1.0);
    assert_eq!(rivet_endpoints(&cluster).await, endpoints);
    assert!(!cluster.not_ready_taint().await, "the ready node stays untainted");
    assert!(cluster.tcp("late-client", "server", 8080));
}
