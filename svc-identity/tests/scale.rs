//! Scale by simulation (issue 16 §7), small enough for CI: simulated nodes
//! publish their node records, identities and pods in a real etcd, each on
//! its own lease ([`rivet_testkit::scale`], svc-identity's own store code),
//! and one real node (svc-identity on that etcd pushing to svc-loader in a
//! node namespace) ends with every remote pod in its pinned ipcache, with
//! the pod's identity and its node as tunnel endpoint — read from the map
//! itself, as the datapath reads it. Then one more pod appears, and the
//! simulated nodes stop (leases revoked): their entries leave the map.
//!
//! The full 50 x 200 figures come from `cargo xtask bench multinode-scale`.
//! Needs root (namespaces, bpffs) and the workspace binaries
//! (`cargo build --bins`).

use std::net::IpAddr;
use std::time::Duration;

use rivet_common::testing::etcd::EtcdServer;
use rivet_common::testing::workspace_binary;
use rivet_testkit::scale::{EtcdNode, ScaleSpec, SimulatedCluster};

/// Simulated nodes.
const NODES: u32 = 10;
/// Pods per simulated node.
const PODS: u32 = 100;
/// How often the map is read while waiting.
const POLL: Duration = Duration::from_millis(20);
/// Generous for a debug build on a busy 2-core machine.
const CONVERGE_WITHIN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_node_holds_every_simulated_pod_with_identity_and_tunnel_endpoint() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let bin_dir = workspace_binary("svc-loader")
        .parent()
        .expect("binaries live in a directory")
        .to_path_buf();
    let mut spec = ScaleSpec::new(NODES, PODS);
    spec.apps = 30;
    let node = EtcdNode::start(&bin_dir, &etcd.endpoint(), &spec.cluster, 4096, &[])
        .await
        .expect("the observed node starts");
    let ipcache = node.ipcache().expect("the loader pinned its ipcache");

    let cluster = SimulatedCluster::publish(&etcd.endpoint(), spec)
        .await
        .expect("the simulated nodes publish their pods");
    let expected = cluster.expected().to_vec();
    assert_eq!(expected.len(), (NODES * PODS) as usize);
    let identities: std::collections::BTreeSet<u32> = expected.iter().map(|e| e.identity).collect();
    assert_eq!(identities.len(), 30, "one identity per app across all nodes");
    assert!(
        identities.iter().all(|id| *id >= 256),
        "cluster identities: {identities:?}"
    );

    let converged = ipcache
        .wait_for(&expected, POLL, CONVERGE_WITHIN)
        .await
        .expect("the ipcache reads");
    if let Err(missing) = &converged {
        panic!(
            "{} of {} entries missing or wrong after {CONVERGE_WITHIN:?}, e.g. {:?} (found {:?}); svc-identity log:\n{}",
            missing.len(),
            expected.len(),
            missing[0],
            ipcache.lookup(IpAddr::V4(missing[0].ip)),
            node.identity.log()
        );
    }

    // One more pod on the last node.
    let extra = cluster.add_pod(NODES - 1, 0).await.expect("one more pod publishes");
    let appeared = ipcache
        .wait_for(&[extra], POLL, CONVERGE_WITHIN)
        .await
        .expect("the ipcache reads");
    assert!(appeared.is_ok(), "the extra pod {extra:?} never reached the ipcache");

    // The simulated nodes stop cleanly: their leases go, and with them
    // every entry they published (a lookup finds no pod entry any more).
    cluster.withdraw().await;
    let mut all = expected;
    all.push(extra);
    let started = std::time::Instant::now();
    loop {
        let mut held = Vec::new();
        for e in &all {
            if ipcache.holds(e).expect("the ipcache reads") {
                held.push(e);
            }
        }
        if held.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < CONVERGE_WITHIN,
            "{} entries of stopped nodes still in the ipcache after {CONVERGE_WITHIN:?}, e.g. {:?} -> {:?}",
            held.len(),
            held[0],
            ipcache.lookup(IpAddr::V4(held[0].ip))
        );
        tokio::time::sleep(POLL).await;
    }
}
