//! The kvstore away (issue 19 §2) on a 2-node `rivet cluster up` (native
//! routing): the cluster's etcd stopped (SIGSTOP: every request hangs, as
//! with a partition or a stuck disk) for [`OUTAGE`] under churn.
//!
//! - Traffic of the pods that existed before goes on: a flood ping each way
//!   between a pod on each node loses nothing across the outage.
//! - A pod whose label set already has an identity starts during the outage
//!   (its node's svc-identity serves it from its cache) and reaches the
//!   other node's pod.
//! - A pod with a new label set cannot get an identity while etcd is away:
//!   `rivet pod add` fails or waits, is retried, and succeeds after etcd
//!   returns.
//! - Afterwards nothing is duplicated: both nodes list each label set under
//!   one identity, the same on both, and no two pods share an address.
//!
//! Needs root, a bpffs, etcd 3.6 (`cargo xtask install`) and the workspace
//! binaries (`cargo build --bins`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rivet_testkit::cluster::{Cluster, ClusterOptions, ClusterPod, Routing};
use rivet_testkit::monitor::NodeDrops;
use rivet_testkit::traffic::Pinger;

/// How long etcd is away.
const OUTAGE: Duration = Duration::from_secs(60);
/// How long a flood ping may take to complete a run.
const PING_RUN_WITHIN: Duration = Duration::from_secs(30);
/// How long the new label set may take to get its pod once etcd is back.
const AFTER_RETURN_WITHIN: Duration = Duration::from_secs(90);

/// etcd stopped with SIGSTOP; continued on drop, also when the test fails,
/// so the cluster's teardown finds it running.
struct EtcdStopped {
    pid: Pid,
}

impl EtcdStopped {
    fn stop(pid: u32) -> Self {
        let pid = Pid::from_raw(i32::try_from(pid).expect("a pid"));
        kill(pid, Signal::SIGSTOP).expect("SIGSTOP to the cluster's etcd");
        Self { pid }
    }
}

impl Drop for EtcdStopped {
    fn drop(&mut self) {
        let _ = kill(self.pid, Signal::SIGCONT);
    }
}

/// Pod `from` pings `to` 3 times with every reply back.
fn pings(from: &ClusterPod, to: std::net::IpAddr) -> Result<(), String> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", from.netns.name(), "ping", "-c", "3", "-W", "2"])
        .arg(to.to_string())
        .output()
        .map_err(|e| format!("running ping: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if text.contains("3 received") || text.contains("3 packets received") {
        Ok(())
    } else {
        Err(format!("{text}{}", String::from_utf8_lossy(&out.stderr)))
    }
}

/// Each cluster identity's labels → ids on `node` (`rivet identity list`).
fn identities(cluster: &Cluster, node: usize) -> BTreeMap<String, Vec<u64>> {
    let list = cluster.node(node).json(&["identity", "list"]);
    let mut by_labels: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for identity in list.as_array().expect("rivet identity list -o json prints a list") {
        if identity["kind"] != "cluster" {
            continue;
        }
        let labels: Vec<&str> = identity["labels"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|l| l.as_str())
            .collect();
        by_labels
            .entry(labels.join(","))
            .or_default()
            .push(identity["id"].as_u64().expect("an id"));
    }
    by_labels
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_outage_under_churn_loses_no_traffic_and_duplicates_nothing() {
    let mut cluster = Cluster::start(ClusterOptions {
        nodes: 2,
        routing: Routing::Native,
        // svc-identity's default lease TTL (15 min): the outage must be
        // survived as a user's nodes would (with a TTL shorter than the
        // hang, 2-4 packets of 10 million were lost: see DEFAULT_LEASE_TTL).
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("rivet cluster up: {e}"));
    cluster.wait_converged().await;
    let a = cluster.add_pod(1, "outage", "a", &["app=a"]).await;
    let b = cluster.add_pod(2, "outage", "b", &["app=b"]).await;
    cluster.wait_converged().await;
    // What the datapaths drop of the pods' traffic, to name a loss's cause.
    let monitors = [1, 2].map(|node| NodeDrops::start(cluster.node(node).rivet(&["monitor", "-o", "json"])));
    let flows = [
        ("a -> b IPv4", Pinger::start(a.netns.name(), b.ipv4.into())),
        ("b -> a IPv6", Pinger::start(b.netns.name(), a.ipv6.into())),
    ];
    for (_, pinger) in &flows {
        tokio::task::block_in_place(|| pinger.wait_runs(1, PING_RUN_WITHIN));
    }

    let etcd_pid = cluster.record().etcd.as_ref().expect("the cluster runs etcd").pid;
    let stopped_at = Instant::now();
    let stopped = EtcdStopped::stop(etcd_pid);

    // A known label set: served from node 1's cache while etcd is away.
    let a2 = cluster.add_pod(1, "outage", "a2", &["app=a"]).await;
    tokio::task::block_in_place(|| pings(&a2, b.ipv4.into()))
        .unwrap_or_else(|e| panic!("a2 (started during the outage) must reach b on node 2: {e}"));

    // A new label set: no identity while etcd is away. Tried as a runtime
    // retries (every 2 s); etcd continues once OUTAGE has passed; the pod
    // must start, and only then.
    let mut stopped = Some(stopped);
    let mut failures = 0;
    let c = loop {
        if stopped.is_some() && stopped_at.elapsed() >= OUTAGE {
            drop(stopped.take());
            eprintln!("etcd continued {:?} after it stopped", stopped_at.elapsed());
        }
        let during_outage = stopped.is_some();
        match cluster.try_add_pod(2, "outage", "c", &["app=c"]).await {
            Ok(pod) => {
                assert!(
                    !during_outage,
                    "pod c (a new label set) must not get an identity while etcd is away ({:?} in, after {failures} failures)",
                    stopped_at.elapsed()
                );
                break pod;
            }
            Err(e) => {
                failures += 1;
                assert!(
                    stopped_at.elapsed() < OUTAGE + AFTER_RETURN_WITHIN,
                    "pod c (a new label set) did not start within {AFTER_RETURN_WITHIN:?} of etcd's return: {e}"
                );
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    eprintln!(
        "pod c (a new label set) started {:?} after etcd stopped, after {failures} failed adds",
        stopped_at.elapsed()
    );

    cluster.wait_converged().await;
    // A whole run each way after the return.
    for (_, pinger) in &flows {
        tokio::task::block_in_place(|| pinger.wait_runs(1, PING_RUN_WITHIN));
    }
    let mut report = Vec::new();
    let mut lost = 0;
    for (what, pinger) in flows {
        let totals = pinger.stop();
        lost += totals.lost();
        report.push(format!("{what}: {totals:?}"));
    }
    let pod_addrs = [a.addrs(), b.addrs()].concat();
    for (node, monitor) in monitors.iter().enumerate() {
        report.push(format!(
            "drops on node {}: {:?}",
            node + 1,
            monitor.involving(&pod_addrs)
        ));
    }
    assert_eq!(lost, 0, "no echo lost across the etcd outage: {report:#?}");
    tokio::task::block_in_place(|| pings(&c, a.ipv4.into()))
        .unwrap_or_else(|e| panic!("c (started after the outage) must reach a on node 1: {e}"));

    // Nothing duplicated: one identity per label set, the same on both nodes.
    let (one, two) = (identities(&cluster, 1), identities(&cluster, 2));
    for (labels, ids) in one.iter().chain(two.iter()) {
        assert_eq!(ids.len(), 1, "label set {labels} has one identity: {ids:?}");
    }
    for (labels, ids) in &one {
        if let Some(other) = two.get(labels) {
            assert_eq!(ids, other, "both nodes agree on {labels}'s identity");
        }
    }
    let addresses: Vec<std::net::IpAddr> = [&a, &b, &a2, &c].iter().flat_map(|p| p.addrs()).collect();
    let mut unique = addresses.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        addresses.len(),
        "no address held by two pods: {addresses:?}"
    );
    eprintln!("{}", report.join("\n"));
    for pod in [a, b, a2, c] {
        cluster.delete_pod(pod).await;
    }
    cluster.down().await;
}
