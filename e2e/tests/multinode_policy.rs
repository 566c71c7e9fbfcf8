//! The NetworkPolicy reachability table across nodes (issue 16 §6): the
//! table of `rivet_testkit::policy_matrix` (3 namespaces × 3 pods, a policy
//! per case, the expected 9×9 matrix, TCP/UDP, IPv4/IPv6), the same cases
//! and the same expected answers as on one node (`cli/tests/policy_matrix.rs`),
//! with the nine pods spread over the three nodes of a `rivet cluster up`:
//! pod `i` of the matrix (x/a, x/b, … z/c) on node `i mod 3 + 1`, so every
//! namespace has a pod on every node and every node holds one pod of each
//! namespace. Policies and namespace labels go to every node; a pod's own
//! labels to its node. Once for native routing, once for VXLAN.
//!
//! Every denied probe must show up as a policy drop in `rivet monitor` of
//! the node that drops it (the source's for egress, the destination's for
//! ingress — over VXLAN decided on the identity in the VNI).
//!
//! Egress rules naming a port resolve against the named ports of pods on
//! other nodes too: they travel with the ipcache (`ip/v1`) and svc-endpoint
//! watches it.
//!
//! `RIVET_MATRIX_CASE=<part of a case name>` runs only those cases.
//!
//! Needs root, a bpffs, etcd 3.6 (`cargo xtask install`) and the workspace
//! binaries (`cargo build --bins`).

use std::net::IpAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use rivet_testkit::cluster::{Cluster, ClusterOptions, Routing};
use rivet_testkit::policy_matrix::{Matrix, MatrixNodes};

/// How long every node may take to hold the pods just added.
const PODS_KNOWN_WITHIN: Duration = Duration::from_secs(30);

/// The matrix's pods spread over the cluster's nodes, round robin.
struct SpreadOver<'c> {
    cluster: &'c Cluster,
    runtime: tokio::runtime::Handle,
}

impl MatrixNodes for SpreadOver<'_> {
    fn nodes(&self) -> usize {
        self.cluster.nodes().len()
    }

    fn node_of(&self, index: usize) -> usize {
        index % self.nodes()
    }

    fn rivet(&self, node: usize, args: &[&str]) -> Command {
        self.cluster.node(node + 1).rivet(args)
    }

    fn kill9_and_wait_for_restart(&self, node: usize, name: &str) {
        self.runtime.block_on(self.cluster.kill9(node + 1, name));
    }

    /// Until every other node's datapath ipcache holds each pod's addresses
    /// (over VXLAN with its node's underlay IPv4 as tunnel endpoint).
    fn wait_for_pods(&self, pods: &[(usize, [IpAddr; 2])]) {
        let started = Instant::now();
        loop {
            let missing = self.runtime.block_on(self.pods_not_known(pods));
            if missing.is_empty() {
                return;
            }
            assert!(
                started.elapsed() < PODS_KNOWN_WITHIN,
                "the nodes did not learn the matrix's pods within {PODS_KNOWN_WITHIN:?}:\n  {}",
                missing.join("\n  ")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl SpreadOver<'_> {
    /// Which node lacks which pod address, one line each.
    async fn pods_not_known(&self, pods: &[(usize, [IpAddr; 2])]) -> Vec<String> {
        let mut missing = Vec::new();
        for (index, node) in self.cluster.nodes().iter().enumerate() {
            let entries = match node.datapath_ipcache().await {
                Ok(entries) => entries,
                Err(e) => {
                    missing.push(format!("{}: ListIpcache: {e}", node.name));
                    continue;
                }
            };
            for (host, addrs) in pods.iter().filter(|(host, _)| *host != index) {
                let tunnel = self.cluster.nodes()[*host].underlay_v4.octets();
                for addr in addrs {
                    let held = entries.iter().find(|e| {
                        e.prefix
                            .as_ref()
                            .and_then(|p| rivet_proto::net::prefix_from_proto(p).ok())
                            .is_some_and(|net| net.addr() == *addr && net.prefix_len() == net.max_prefix_len())
                    });
                    match held {
                        None => missing.push(format!("{}: no ipcache entry for {addr}", node.name)),
                        Some(e) if self.cluster.routing == Routing::Vxlan && e.tunnel_endpoint != tunnel => missing
                            .push(format!(
                                "{}: ipcache entry of {addr} tunnels to {:?}, not {:?}",
                                node.name, e.tunnel_endpoint, tunnel
                            )),
                        Some(_) => {}
                    }
                }
            }
        }
        missing
    }
}

/// The whole table over a 3-node cluster in `routing` mode.
fn table_over_three_nodes(routing: Routing) {
    let started = Instant::now();
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let cluster = runtime
        .block_on(Cluster::start(ClusterOptions {
            routing,
            ..Default::default()
        }))
        .unwrap_or_else(|e| panic!("rivet cluster up ({routing:?}): {e}"));
    runtime.block_on(cluster.wait_converged());
    let nodes = SpreadOver {
        cluster: &cluster,
        runtime: runtime.handle().clone(),
    };
    let matrix = Matrix::up(&nodes);
    eprintln!(
        "{routing:?}: 3 nodes, 9 pods, servers and monitors up in {:.1?}",
        started.elapsed()
    );
    matrix.run_table();
    // The monitors and the servers go before the cluster.
    drop(matrix);
    runtime.block_on(cluster.down());
    eprintln!("{routing:?}: the table over 3 nodes in {:.1?}", started.elapsed());
}

#[test]
fn network_policy_reachability_matrix_over_three_nodes_with_native_routing() {
    table_over_three_nodes(Routing::Native);
}

#[test]
fn network_policy_reachability_matrix_over_three_nodes_with_vxlan() {
    table_over_three_nodes(Routing::Vxlan);
}
