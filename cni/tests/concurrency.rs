//! 50 ADDs at once (50 rivet-cni processes, as a runtime starting 50 pods)
//! give 50 distinct READY endpoints; 50 DELs at once leave nothing.

mod common;

use std::collections::HashSet;
use std::time::Instant;

use common::{Harness, Pod, median_max, ping, result_ips};
use futures::future::join_all;
use rivet_proto::endpoint::v1 as eppb;

const PODS: usize = 50;

#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_adds_then_fifty_concurrent_dels() {
    let h = Harness::start().await;
    let pods: Vec<Pod> = (0..PODS).map(|i| Pod::new(&format!("conc-{i:02}"))).collect();
    let conf = h.conf("1.1.0");

    let started = Instant::now();
    let adds = join_all(pods.iter().map(|pod| h.cni("ADD", pod, &conf))).await;
    let add_wall = started.elapsed();
    let results: Vec<_> = adds.iter().map(|run| run.ok()).collect();

    let ips: Vec<_> = results.iter().flat_map(result_ips).collect();
    assert_eq!(
        ips.iter().collect::<HashSet<_>>().len(),
        2 * PODS,
        "distinct addresses: {ips:?}"
    );
    let hosts: HashSet<_> = results.iter().map(|r| r["interfaces"][0]["name"].clone()).collect();
    assert_eq!(hosts.len(), PODS);
    let endpoints = h.endpoints().await;
    assert_eq!(endpoints.len(), PODS);
    assert!(endpoints.iter().all(|e| e.state == eppb::EndpointState::Ready as i32));
    assert_eq!(endpoints.iter().map(|e| e.id).collect::<HashSet<_>>().len(), PODS);
    assert_eq!(h.host_veths().len(), PODS);
    // A sample of pods reach each other.
    for (from, to) in [(0, PODS - 1), (PODS / 2, 1)] {
        let dst = result_ips(&results[to]);
        for ip in dst {
            assert_eq!(ping(&pods[from].ns, ip), 3, "{} -> {ip}", pods[from].id);
        }
    }

    let started = Instant::now();
    let dels = join_all(pods.iter().map(|pod| h.cni("DEL", pod, &conf))).await;
    let del_wall = started.elapsed();
    for run in &dels {
        run.ok();
    }
    let left = h.leftovers().await;
    h.assert_clean(&left, "after 50 concurrent DELs");

    let (add_median, add_max) = median_max(adds.iter().map(|r| r.elapsed).collect());
    let (del_median, del_max) = median_max(dels.iter().map(|r| r.elapsed).collect());
    eprintln!(
        "{PODS} concurrent ADDs: wall {add_wall:?}, per ADD median {add_median:?} max {add_max:?}; \
         {PODS} concurrent DELs: wall {del_wall:?}, per DEL median {del_median:?} max {del_max:?}"
    );
}
