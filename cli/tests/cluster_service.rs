//! `rivet cluster service apply` on a two-node cluster (the testkit
//! fixture drives this binary): a Service without clusterIP gets the first
//! node's allocation on every node, its selector takes the pods of both
//! nodes (the other node's from the ipcache, with `node_local` only for
//! each node's own), and a pod reaches the backends through the ClusterIP.
//!
//! Needs root, a bpffs at /sys/fs/bpf, the rivet users and etcd 3.6
//! (`cargo xtask install`) and the workspace binaries (`cargo build
//! --bins`). Addresses come from 198.18.0.0/15 and 2001:2::/48 only.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rivet_proto::loader::v1 as lb;
use rivet_testkit::cluster::{Cluster, ClusterOptions};
use rivet_testkit::service::{NameServer, ask_names};

const WEB: &str = "\
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  ipFamilyPolicy: PreferDualStack
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: 8080}]
";

/// (address:port, node_local) of every backend of the one service in `services`.
fn backends(services: &[lb::LbServiceStatus]) -> BTreeSet<(String, bool)> {
    services
        .iter()
        .filter_map(|s| s.service.as_ref())
        .flat_map(|s| &s.backends)
        .map(|b| {
            let address = rivet_proto::net::address_from_bytes(&b.address).expect("an address");
            let port = u16::try_from(b.port).expect("a port");
            (SocketAddr::new(address, port).to_string(), b.node_local)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_service_apply_gives_every_node_the_same_addresses_and_the_whole_clusters_pods() {
    let mut cluster = Cluster::start(ClusterOptions {
        nodes: 2,
        ..ClusterOptions::default()
    })
    .await
    .expect("the cluster starts");
    let web1 = cluster.add_pod(1, "default", "web-1", &["app=web"]).await;
    let web2 = cluster.add_pod(2, "default", "web-2", &["app=web"]).await;
    let client = cluster.add_pod(2, "default", "client", &["app=client"]).await;
    cluster.wait_converged().await;
    cluster.apply_service(WEB).await;

    // The first node allocated the lowest addresses of the service CIDRs;
    // every node holds them, with both pods as backends.
    let vip4: IpAddr = "198.19.128.1".parse().unwrap();
    let vip6: IpAddr = "2001:2:0:ff::1".parse().unwrap();
    for (vip, pods) in [
        (vip4, [web1.socket_v4(8080), web2.socket_v4(8080)]),
        (vip6, [web1.socket_v6(8080), web2.socket_v6(8080)]),
    ] {
        let want = |node_local_is_first: bool| -> BTreeSet<(String, bool)> {
            BTreeSet::from([
                (pods[0].to_string(), node_local_is_first),
                (pods[1].to_string(), !node_local_is_first),
            ])
        };
        let by_node = cluster
            .wait_datapath_services(vip, |services| services.len() == 1 && backends(services).len() == 2)
            .await;
        // node_local: each node's own pod only.
        assert_eq!(backends(&by_node[0]), want(true), "node 1 for {vip}");
        assert_eq!(backends(&by_node[1]), want(false), "node 2 for {vip}");
    }

    // `rivet bpf service list` on node 1: svc-loader's services named from
    // the catalog, both pods as backends sharing the Maglev slots.
    let listed: serde_json::Value =
        serde_json::from_str(&cluster.node(1).ok(&["bpf", "service", "list", "-o", "json"])).expect("JSON");
    let services = listed["services"].as_array().expect("a list of services");
    let names: BTreeSet<&str> = services.iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from(["default/web:http (IPv4)", "default/web:http (IPv6)"]),
        "{listed}"
    );
    for s in services {
        let slots: u64 = s["backends"]
            .as_array()
            .expect("backends")
            .iter()
            .map(|b| b["maglev_slots"].as_u64().expect("slots"))
            .sum();
        assert_eq!(slots, 1021, "every slot names one of the backends: {s}");
    }

    // Through the ClusterIP, from a pod on node 2, to the pods of both nodes.
    let _servers = [
        NameServer::start(&web1.netns, "web-1", &[web1.socket_v4(8080), web1.socket_v6(8080)]).unwrap(),
        NameServer::start(&web2.netns, "web-2", &[web2.socket_v4(8080), web2.socket_v6(8080)]).unwrap(),
    ];
    for vip in [vip4, vip6] {
        let answers = ask_names(&client.netns, SocketAddr::new(vip, 80), 30, Duration::from_secs(5));
        let names: BTreeSet<String> = answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|e| panic!("a connection to {vip}:80 failed: {e}")))
            .collect();
        assert!(
            names.iter().all(|n| n == "web-1" || n == "web-2") && !names.is_empty(),
            "{vip}: {names:?}"
        );
    }
    cluster.down().await;
}
