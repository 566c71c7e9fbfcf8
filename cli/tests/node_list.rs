//! `rivet node list` on a simulated cluster (`rivet cluster up`, the
//! testkit fixture): every node sees the others as `rivet node up
//! --routing vxlan --underlay-interface ul0` published them — underlay
//! addresses read from `ul0`, the pool's CIDRs, the routing mode — itself
//! marked; a node that leaves cleanly is gone from the others' lists.
//!
//! Needs root, a bpffs and the workspace binaries (`cargo build --bins`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rivet_testkit::cluster::{Cluster, ClusterNode, ClusterOptions, Routing};

/// `rivet node list -o json` on `node`, by name, once svc-identity listed.
fn nodes_until(node: &ClusterNode, what: &str, pred: impl Fn(&BTreeMap<String, serde_json::Value>) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let list = node.json(&["node", "list"]);
        let nodes: BTreeMap<String, serde_json::Value> = list["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| (n["name"].as_str().unwrap().to_string(), n.clone()))
            .collect();
        if list["listed"] == true && pred(&nodes) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {list:#}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_list_shows_the_cluster_as_the_node_up_flags_published_it() {
    let mut cluster = Cluster::start(ClusterOptions {
        nodes: 2,
        routing: Routing::Vxlan,
        ..Default::default()
    })
    .await
    .expect("rivet cluster up");
    let (n1, n2) = (cluster.node(1), cluster.node(2));
    let expected = |n: &ClusterNode, local: bool| {
        serde_json::json!({
            "name": n.name,
            "local": local,
            "addresses": [n.underlay_v4.to_string(), n.underlay_v6.to_string()],
            "pod_cidrs": n.pod_cidrs,
            "routing": "vxlan",
            "tunnel_port": 8472,
        })
    };
    let (e1, e2) = (expected(n1, true), expected(n2, false));
    nodes_until(n1, "node 1 lists both nodes as published", |nodes| {
        nodes.len() == 2
            && [(&n1.name, &e1), (&n2.name, &e2)].iter().all(|(name, want)| {
                let got = &nodes[name.as_str()];
                want.as_object().unwrap().iter().all(|(k, v)| &got[k] == v)
                    && got["source"] == "node"
                    && !got["boot_id"].as_str().unwrap().is_empty()
            })
    });
    let table = n1.ok(&["node", "list"]);
    assert!(table.contains(&format!("{} *", n1.name)), "{table}");
    assert!(
        table.contains("NAME") && table.contains("POD CIDRS") && table.contains("BOOT-ID"),
        "{table}"
    );
    // The pod MTU follows from ul0 (1500) under VXLAN.
    let record = n1.record().expect("node 1 runs");
    let conflist: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&record.conflist).expect("node 1's conflist")).unwrap();
    assert_eq!(conflist["plugins"][0]["mtu"], 1450, "{conflist}");

    let gone = n2.name.clone();
    cluster.stop_node(2).await;
    nodes_until(cluster.node(1), "node 1 forgets the node that left", |nodes| {
        nodes.len() == 1 && !nodes.contains_key(&gone)
    });
    cluster.down().await;
}
