//! `rivet cluster up|status|stop-node|start-node|policy|down` and `rivet
//! --node` as a user runs them, through the testkit cluster fixture (which
//! drives this binary): the topology of the address plan, pods on chosen
//! nodes through each node's own rivet-cni, cluster-wide policies, a node
//! stopped and started again, and `down` removing everything — also after
//! a node and etcd were killed with SIGKILL, and after an `up` that failed.
//!
//! Cross-node pod traffic is e2e/tests/multinode.rs's.
//!
//! Needs root, a bpffs at /sys/fs/bpf, the rivet users and etcd 3.6
//! (`cargo xtask install`) and the workspace binaries (`cargo build
//! --bins`). Addresses come from 198.18.0.0/15 and 2001:2::/48 only.

use std::path::Path;
use std::time::Duration;

use rivet_cli::cluster::ClusterRecord;
use rivet_testkit::cluster::{Cluster, ClusterOptions, NodeState};
use support::{alive, netns_list, reachable_tempdir, rivet_bin};

mod support;

/// `rivet cluster status -o json` of the fixture's cluster.
fn status(cluster: &Cluster) -> serde_json::Value {
    let out = cluster
        .rivet(&["cluster", "status", "--name", &cluster.name, "-o", "json"])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("status JSON ({e}): {out:?}"))
}

fn node_states(cluster: &Cluster) -> Vec<String> {
    status(cluster)["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["state"].as_str().unwrap().to_string())
        .collect()
}

/// Nothing of cluster `record` is left: namespaces, pins, processes, dir.
fn assert_nothing_left(record: &ClusterRecord, pids: &[u32]) {
    let namespaces = netns_list();
    let prefix = format!("{}-", record.plan.name);
    let pods = format!("rivet-pod-{}-", record.plan.name);
    assert!(
        !namespaces
            .iter()
            .any(|n| n.starts_with(&prefix) || n.starts_with(&pods)),
        "no namespace of the cluster is left: {namespaces:?}"
    );
    for node in &record.plan.nodes {
        let pins = Path::new("/sys/fs/bpf/rivet").join(&node.name);
        assert!(!pins.exists(), "{} is gone", pins.display());
    }
    for pid in pids {
        assert!(!alive(*pid), "pid {pid} of the cluster exited");
    }
    assert!(!record.dir.exists(), "{} is gone", record.dir.display());
}

/// Every pid of the cluster: etcd, each node's supervisor and daemons.
fn cluster_pids(cluster: &Cluster) -> Vec<u32> {
    let mut pids = vec![cluster.record().etcd.as_ref().unwrap().pid];
    for node in cluster.nodes() {
        if let Some(r) = node.record() {
            pids.push(r.supervisor_pid);
            pids.extend(r.daemons.iter().filter_map(|d| d.pid));
        }
    }
    pids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_comes_up_on_its_address_plan_and_down_removes_it_even_after_a_crash() {
    let mut cluster = Cluster::start(ClusterOptions::default())
        .await
        .expect("rivet cluster up");
    let record = cluster.record().clone();
    let status = status(&cluster);
    assert_eq!(status["routing"], "native");
    assert_eq!(status["etcd"]["healthy"], true, "{status:#}");
    assert_eq!(node_states(&cluster), ["running"; 3]);

    // Each node namespace: ul0 on the plan's addresses, on the underlay
    // bridge with the others (both families reach every other node).
    for node in cluster.nodes() {
        let ul0 = node.ip(&["addr", "show", "dev", "ul0"]);
        assert!(
            ul0.contains(&format!("{}/24", node.underlay_v4))
                && ul0.contains(&format!("{}/64", node.underlay_v6))
                && ul0.contains("mtu 1500"),
            "{ul0}"
        );
        for peer in cluster.nodes().iter().filter(|p| p.index != node.index) {
            for to in [peer.underlay_v4.into(), peer.underlay_v6.into()] {
                let stats = node
                    .netns
                    .ping(to, 2, Duration::from_millis(100), Duration::from_secs(2))
                    .unwrap();
                assert_eq!(stats.received, 2, "{} reaches {to} over the underlay", node.name);
            }
        }
    }
    let bridge_ports = cluster_ip(&record.plan.underlay_netns, &["-o", "link", "show", "master", "ul"]);
    assert_eq!(bridge_ports.lines().count(), 3, "{bridge_ports}");

    // Every node runs in the cluster's routing mode over ul0, its peers in
    // its loader (`rivet --node .. bpf nodes`) once the registry met them.
    for node in cluster.nodes() {
        support::eventually(
            &format!("{} routes to both peers", node.name),
            Duration::from_secs(30),
            || node.json(&["bpf", "nodes"])["nodes"].as_array().unwrap().len() == 2,
        );
        let nodes = node.json(&["bpf", "nodes"]);
        assert_eq!(nodes["routing_mode"], "native", "{nodes:#}");
        assert_eq!(nodes["underlay_interface"], "ul0", "{nodes:#}");
    }

    // Pods go to the node asked for, with that node's pool (its own CNI).
    let a = cluster.add_pod(1, "default", "a", &["app=a"]).await;
    let b = cluster.add_pod(1, "default", "b", &["app=b"]).await;
    let c = cluster.add_pod(2, "other", "c", &["app=c"]).await;
    assert_eq!(a.ipv4.octets()[..3], [198, 18, 1]);
    assert_eq!(c.ipv4.octets()[..3], [198, 18, 2]);
    assert_eq!(c.ipv6.segments()[..4], [0x2001, 2, 0, 2]);
    let listed = cluster.node(2).json(&["pod", "list"]);
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed:#}");
    assert_eq!(listed[0]["name"], "c");
    // The node's datapath ipcache holds its pods (`rivet --node .. bpf ipcache`).
    let ipcache = cluster.node(1).json(&["bpf", "ipcache"]);
    for addr in [format!("{}/32", a.ipv4), format!("{}/128", a.ipv6)] {
        let entry = ipcache
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["prefix"] == addr.as_str());
        assert!(
            entry.is_some_and(|e| e["identity"].as_u64().unwrap() >= 256),
            "{addr} with a's identity in {ipcache:#}"
        );
    }
    // Pods on one node talk (cross-node traffic is the multinode suite's).
    let _server = b.netns.tcp_echo_server(&[b.socket_v4(80), b.socket_v6(80)]).unwrap();
    for to in [b.socket_v4(80), b.socket_v6(80)] {
        assert!(a.netns.tcp_echo(to, Duration::from_secs(2)).unwrap(), "a reaches {to}");
    }

    // A policy applied to the cluster is in every node's repository.
    cluster
        .apply_policy(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: deny-b, namespace: default}\n\
             spec: {podSelector: {matchLabels: {app: b}}, policyTypes: [Ingress]}\n",
        )
        .await;
    for node in cluster.nodes() {
        let policies = node.json(&["policy", "list"]);
        assert_eq!(
            policies["policies"].as_array().unwrap().len(),
            1,
            "{}: {policies:#}",
            node.name
        );
    }
    assert!(
        !a.netns.tcp_echo(b.socket_v4(80), Duration::from_millis(500)).unwrap(),
        "the policy holds"
    );

    // A node stopped and started again.
    cluster.stop_node(3).await;
    assert_eq!(cluster.node(3).state, NodeState::Stopped);
    assert_eq!(node_states(&cluster), ["running", "running", "stopped"]);
    let stopped_is_fine = cluster
        .rivet(&["cluster", "status", "--name", &cluster.name])
        .status()
        .unwrap();
    assert!(stopped_is_fine.success(), "a stopped node leaves the cluster healthy");
    assert!(cluster.node(3).record().is_none());
    cluster.start_node(3).await;
    assert_eq!(node_states(&cluster), ["running"; 3]);

    // A crash of node 2 (supervisor and daemons) and of etcd: down still
    // removes everything from cluster.json.
    let pids = cluster_pids(&cluster);
    cluster.crash_node(2).await;
    assert_eq!(node_states(&cluster), ["running", "crashed", "running"]);
    let crashed = cluster
        .rivet(&["cluster", "status", "--name", &cluster.name])
        .output()
        .unwrap();
    assert_eq!(
        crashed.status.code(),
        Some(1),
        "a crashed node is a problem: {crashed:?}"
    );
    let etcd = record.etcd.as_ref().unwrap().pid;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(etcd as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    drop((a, b, c));
    cluster.down().await;
    assert_nothing_left(&record, &pids);
}

/// `ip -n <ns> <args>`.
fn cluster_ip(ns: &str, args: &[&str]) -> String {
    let out = std::process::Command::new("ip")
        .args(["-n", ns])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn an_up_that_fails_removes_what_it_made() {
    let dir = reachable_tempdir("rvcf");
    let name = format!("rf{:x}", std::process::id());
    // etcd that exits at once: the namespaces are never made, etcd's dir goes.
    let out = std::process::Command::new(rivet_bin())
        .arg("--state-dir")
        .arg(dir.path())
        .args([
            "cluster",
            "up",
            "--name",
            &name,
            "--nodes",
            "2",
            "--etcd-binary",
            "/bin/false",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("etcd exited"), "{text}");
    assert!(!dir.path().join("clusters").join(&name).exists());
    assert!(!netns_list().iter().any(|n| n.starts_with(&format!("{name}-"))));
    // Bad arguments are refused before anything is made.
    for (args, says) in [
        (vec!["--nodes", "0"], "--nodes must be 1 to 253"),
        (vec!["--name", "Bad_Name"], "not a usable cluster name"),
    ] {
        let out = std::process::Command::new(rivet_bin())
            .arg("--state-dir")
            .arg(dir.path())
            .args(["cluster", "up"])
            .args(&args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && text.contains(says), "{args:?}: {text}");
    }
    assert!(
        !dir.path().join("clusters").exists()
            || std::fs::read_dir(dir.path().join("clusters")).unwrap().next().is_none()
    );
}
