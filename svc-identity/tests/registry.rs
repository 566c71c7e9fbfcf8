//! The node registry as real processes: three svc-identity nodes on one
//! real etcd find each other (`NodeService.ListNodes`), claim each other's
//! underlay addresses as remote-node, and drop a node that stops cleanly
//! (at once) or crashes (after its lease TTL); a restarted node's record
//! replaces the old one; unusable records are skipped and counted.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use rivet_common::testing::etcd::EtcdServer;
use rivet_common::testing::{DaemonCommand, DaemonProcess};
use rivet_proto::identity::v1 as pb;
use rivet_proto::identity::v1::identity_service_client::IdentityServiceClient;
use rivet_proto::identity::v1::ipcache_service_client::IpcacheServiceClient;
use rivet_proto::loader::v1 as loader_pb;
use rivet_testkit::loader::{LoaderNode, UNDERLAY_IFNAME, Underlay};

mod support;

use support::{channel, list_nodes, nodes_until};

const BIN: &str = env!("CARGO_BIN_EXE_svc-identity");

/// Node `i` (1-based) of the simulated cluster's conventions.
struct TestNode {
    name: String,
    ttl_seconds: u32,
    metrics: Option<SocketAddr>,
    /// Whether it gets `--pod-cidr` (else its record is the operator's
    /// mirror).
    pod_cidr_flags: bool,
}

impl TestNode {
    fn new(i: u8, ttl_seconds: u32) -> Self {
        Self {
            name: format!("node-{i}"),
            ttl_seconds,
            metrics: None,
            pod_cidr_flags: true,
        }
    }

    fn index(&self) -> u8 {
        self.name.trim_start_matches("node-").parse().unwrap()
    }

    fn underlay(&self) -> (IpAddr, IpAddr) {
        let i = self.index();
        (
            format!("198.19.254.{i}").parse().unwrap(),
            format!("2001:2:0:fe::{i}").parse().unwrap(),
        )
    }

    fn command(&self, dir: &Path, etcd: &str) -> DaemonCommand {
        self.command_in(&dir.join(&self.name).join("sockets"), dir, etcd)
    }

    /// The command with its socket in `sockets` (svc-loader's, to push to it).
    fn command_in(&self, sockets: &Path, dir: &Path, etcd: &str) -> DaemonCommand {
        let i = self.index();
        let (v4, v6) = self.underlay();
        let mut cmd = DaemonCommand::new(BIN, sockets.join("svc-identity.sock"))
            .args(["--socket-dir".as_ref(), sockets.as_os_str()])
            .args(["--state-dir".as_ref(), dir.join(&self.name).join("state").as_os_str()])
            .args(["--node-name", &self.name, "--etcd-endpoints", etcd])
            .args(["--lease-ttl-seconds", &self.ttl_seconds.to_string()])
            .args(["--routing-mode", "vxlan", "--tunnel-port", "8472"])
            .args(["--node-address", &v4.to_string(), "--node-address", &v6.to_string()])
            .log_to(dir.join(format!("{}.log", self.name)));
        if self.pod_cidr_flags {
            cmd = cmd.args([
                "--pod-cidr",
                &format!("198.18.{i}.0/24"),
                "--pod-cidr",
                &format!("2001:2:0:{i}::/64"),
            ]);
        }
        if let Some(address) = self.metrics {
            cmd = cmd.args(["--metrics-address", &address.to_string()]);
        }
        cmd
    }

    async fn spawn(&self, dir: &Path, etcd: &EtcdServer) -> DaemonProcess {
        self.command(dir, &etcd.endpoint())
            .spawn()
            .await
            .expect("svc-identity starts")
    }
}

/// Polls `d`'s ipcache until `pred` holds for its NODE claims (address →
/// (identity, node)).
async fn node_claims_until(d: &DaemonProcess, what: &str, pred: impl Fn(&BTreeMap<String, (u32, String)>) -> bool) {
    let mut client = IpcacheServiceClient::new(channel(d).await);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let entries = client
            .list_ipcache(pb::ListIpcacheRequest {
                source: pb::IpcacheSource::Node as i32,
                page_size: 1000,
                ..Default::default()
            })
            .await
            .expect("ListIpcache")
            .into_inner()
            .entries;
        let claims: BTreeMap<String, (u32, String)> = entries
            .into_iter()
            .map(|e| {
                let p = e.prefix.unwrap();
                let ip = rivet_proto::net::address_from_bytes(&p.address).unwrap();
                (format!("{ip}/{}", p.prefix_length), (e.identity, e.node_name))
            })
            .collect();
        if pred(&claims) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {claims:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ip(bytes: &[u8]) -> IpAddr {
    rivet_proto::net::address_from_bytes(bytes).unwrap()
}

#[tokio::test]
async fn three_nodes_see_each_other_and_drop_a_stopped_or_crashed_node() {
    const LONG_TTL: u32 = 30;
    const SHORT_TTL: u32 = 2;
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2, n3) = (
        TestNode::new(1, SHORT_TTL),
        TestNode::new(2, LONG_TTL),
        TestNode::new(3, SHORT_TTL),
    );
    let a = n1.spawn(dir.path(), &etcd).await;
    let mut b = n2.spawn(dir.path(), &etcd).await;
    let mut c = n3.spawn(dir.path(), &etcd).await;

    let nodes = nodes_until(&a, "node-1 sees all three nodes", |n| n.len() == 3).await;
    let listing = list_nodes(&a).await;
    assert_eq!(listing.nodes[0].name, "node-1", "this node first");
    assert!(listing.nodes[0].local && !listing.nodes[1].local);
    assert_eq!(listing.cluster, "default");
    for (node, process) in [(&n1, &a), (&n2, &b), (&n3, &c)] {
        let record = &nodes[&node.name];
        let (v4, v6) = node.underlay();
        let i = node.index();
        assert_eq!(
            record.addresses.iter().map(|a| ip(a)).collect::<Vec<_>>(),
            vec![v4, v6],
            "{}: underlay addresses, IPv4 first",
            node.name
        );
        let cidrs: Vec<String> = record
            .pod_cidrs
            .iter()
            .map(|p| format!("{}/{}", ip(&p.address), p.prefix_length))
            .collect();
        assert_eq!(cidrs, vec![format!("198.18.{i}.0/24"), format!("2001:2:0:{i}::/64")]);
        assert_eq!(record.routing_mode, pb::RoutingMode::Vxlan as i32);
        assert_eq!(record.tunnel_port, 8472);
        assert_eq!(
            record.boot_id,
            process.info().boot_id,
            "{}: the writer's boot id",
            node.name
        );
        assert_eq!(record.source, pb::NodeSource::Node as i32);
    }
    node_claims_until(&a, "node-1 claims its peers' addresses as remote-node", |c| {
        c.len() == 4
            && c["198.19.254.2/32"] == (6, "node-2".into())
            && c["2001:2:0:fe::3/128"] == (6, "node-3".into())
            && !c.contains_key("198.19.254.1/32")
    })
    .await;

    // A clean stop: node-2's key goes with its revoked lease (TTL 30 s).
    let stopped = Instant::now();
    assert!(b.terminate().await.unwrap().success(), "node-2 stops cleanly");
    nodes_until(&a, "node-1 drops the stopped node-2", |n| !n.contains_key("node-2")).await;
    let took = stopped.elapsed();
    assert!(
        took < Duration::from_secs(u64::from(LONG_TTL) / 3),
        "node-2 left {took:?} after SIGTERM: at once, not after its TTL"
    );
    node_claims_until(&a, "node-2's addresses are withdrawn", |c| {
        c.len() == 2 && !c.contains_key("198.19.254.2/32")
    })
    .await;

    // A crash: node-3's record stays until its lease (TTL 2 s) expires.
    let old_boot = c.info().boot_id.clone();
    c.kill9();
    let killed = Instant::now();
    nodes_until(&a, "node-1 drops the crashed node-3 after its TTL", |n| {
        !n.contains_key("node-3")
    })
    .await;
    let took = killed.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "node-3's record went {took:?} after kill -9: only its lease expiry removes it"
    );
    node_claims_until(&a, "node-3's addresses are withdrawn", |c| c.is_empty()).await;

    // A restart: the new record (new boot id) replaces the old at once.
    let mut c = n3.spawn(dir.path(), &etcd).await;
    let new_boot = c.info().boot_id.clone();
    assert_ne!(new_boot, old_boot);
    nodes_until(&a, "node-1 sees node-3 again with its new boot id", |n| {
        n.get("node-3").is_some_and(|r| r.boot_id == new_boot)
    })
    .await;
    c.kill9();
    let killed = Instant::now();
    let nodes = nodes_until(&a, "a restarted-then-killed node-3 expires too", |n| {
        !n.contains_key("node-3")
    })
    .await;
    assert!(killed.elapsed() >= Duration::from_millis(900));
    assert_eq!(nodes.keys().collect::<Vec<_>>(), vec!["node-1"]);
}

#[tokio::test]
async fn a_restarted_node_replaces_its_record_before_the_old_lease_expires() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2) = (TestNode::new(1, 2), TestNode::new(2, 4));
    let a = n1.spawn(dir.path(), &etcd).await;
    let mut b = n2.spawn(dir.path(), &etcd).await;
    let old_boot = b.info().boot_id.clone();
    nodes_until(&a, "node-1 sees node-2", |n| {
        n.get("node-2").is_some_and(|r| r.boot_id == old_boot)
    })
    .await;
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let key = "rivet/state/nodes/v1/default/node-2";
    let old_lease = client.get(key, None).await.unwrap().kvs()[0].lease();
    b.kill9();
    let b = n2.spawn(dir.path(), &etcd).await;
    let new_boot = b.info().boot_id.clone();
    nodes_until(&a, "node-2's new record replaces the old", |n| {
        n.get("node-2").is_some_and(|r| r.boot_id == new_boot)
    })
    .await;
    let new_lease = client.get(key, None).await.unwrap().kvs()[0].lease();
    assert_ne!(new_lease, old_lease, "the record moved to the new process's lease");
    // The old lease expiring (TTL 4 s) takes nothing: the key is on the new
    // one. Wait for etcd to drop the old lease, then look again.
    let deadline = Instant::now() + Duration::from_secs(15);
    while client.lease_time_to_live(old_lease, None).await.unwrap().ttl() > 0 {
        assert!(Instant::now() < deadline, "lease {old_lease} never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let nodes = nodes_until(&a, "node-2 stays", |_| true).await;
    assert_eq!(nodes["node-2"].boot_id, new_boot, "{nodes:#?}");
}

#[tokio::test]
async fn unusable_records_are_skipped_and_counted_and_operator_records_are_peers() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let mut n1 = TestNode::new(1, 2);
    let metrics = SocketAddr::from(([127, 0, 0, 1], rivet_common::testing::free_local_port()));
    n1.metrics = Some(metrics);
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let prefix = "rivet/state/nodes/v1/default/";
    // Before the node starts (its listing) and after (its watch).
    client.put(format!("{prefix}garbage"), "{not json", None).await.unwrap();
    let a = n1.spawn(dir.path(), &etcd).await;
    let liar = r#"{"name":"someone-else","cluster":"default","source":"node"}"#;
    client.put(format!("{prefix}liar"), liar, None).await.unwrap();
    let mirrored = r#"{"name":"op-node","cluster":"default","addresses":[{"type":"InternalIP","ip":"198.19.254.9"}],"podCidrs":["198.18.9.0/24"],"encapsulation":{"mode":"direct"},"source":"operator"}"#;
    client.put(format!("{prefix}op-node"), mirrored, None).await.unwrap();
    let nodes = nodes_until(&a, "node-1 lists the operator's record", |n| n.contains_key("op-node")).await;
    assert_eq!(nodes.len(), 2, "the unusable records are not nodes: {nodes:#?}");
    let op = &nodes["op-node"];
    assert_eq!(op.source, pb::NodeSource::Operator as i32);
    assert_eq!(op.routing_mode, pb::RoutingMode::Native as i32);
    assert!(op.boot_id.is_empty());
    node_claims_until(&a, "the mirrored node's address is remote-node", |c| {
        c.get("198.19.254.9/32") == Some(&(6, "op-node".into()))
    })
    .await;
    // A known node whose key is overwritten by garbage is gone.
    client.put(format!("{prefix}op-node"), "[]", None).await.unwrap();
    nodes_until(&a, "node-1 drops the node whose record became unusable", |n| {
        !n.contains_key("op-node")
    })
    .await;
    node_claims_until(&a, "its address is withdrawn", |c| c.is_empty()).await;
    let text = rivet_common::testing::http_get(metrics, "/metrics").await.unwrap();
    let sample = |series: &str| rivet_common::testing::metric_sample(&text, series).unwrap_or(0.0);
    assert_eq!(
        sample(r#"rivet_identity_node_records_invalid_total{reason="undecodable"}"#),
        2.0,
        "{text}"
    );
    assert_eq!(
        sample(r#"rivet_identity_node_records_invalid_total{reason="name_mismatch"}"#),
        1.0
    );
    assert_eq!(sample(r#"rivet_identity_node_changes_total{change="joined"}"#), 1.0);
    assert_eq!(sample(r#"rivet_identity_node_changes_total{change="left"}"#), 1.0);
    assert_eq!(sample("rivet_identity_nodes"), 1.0);
}

/// A node record as rivet-operator mirrors a RivetNode into etcd.
fn mirrored_record(node: &str, underlay: &str, pod_cidr: &str) -> String {
    serde_json::json!({
        "name": node,
        "cluster": "default",
        "addresses": [{ "type": "InternalIP", "ip": underlay }],
        "podCidrs": [pod_cidr],
        "encapsulation": { "mode": "direct" },
        "source": "operator",
    })
    .to_string()
}

/// `node`'s pod CIDRs as `ListNodes` shows them.
fn pod_cidrs(node: &pb::Node) -> Vec<String> {
    node.pod_cidrs
        .iter()
        .map(|p| format!("{}/{}", ip(&p.address), p.prefix_length))
        .collect()
}

/// A routed node given no `--pod-cidr` (deploy/'s etcd overlay: the
/// DaemonSet cannot give one per node) takes its pod CIDRs from the record
/// rivet-operator mirrors from its RivetNode (the cluster pool's
/// allocation), follows their change, and never overwrites that key: its
/// peers route the mirrored CIDRs to it.
#[tokio::test]
async fn a_routed_node_without_pod_cidrs_reads_the_operator_s_mirror_of_its_record() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let key = "rivet/state/nodes/v1/default/node-1";
    let first = mirrored_record("node-1", "198.19.254.1", "198.18.65.0/24");
    client.put(key, first.clone(), None).await.unwrap();
    let mut n1 = TestNode::new(1, 2);
    n1.pod_cidr_flags = false;
    let a = n1.spawn(dir.path(), &etcd).await;
    let b = TestNode::new(2, 2).spawn(dir.path(), &etcd).await;

    let nodes = nodes_until(&a, "node-1 lists its own pod CIDRs from the mirror and node-2", |n| {
        n.len() == 2 && n.get("node-1").is_some_and(|r| pod_cidrs(r) == ["198.18.65.0/24"])
    })
    .await;
    assert!(nodes["node-1"].local, "{nodes:#?}");
    nodes_until(&b, "node-2 routes the mirrored pod CIDR to node-1", |n| {
        n.get("node-1").is_some_and(|r| pod_cidrs(r) == ["198.18.65.0/24"])
    })
    .await;

    // The cluster pool moves the node: the mirror changes, the node follows.
    let second = mirrored_record("node-1", "198.19.254.1", "198.18.66.0/24");
    client.put(key, second.clone(), None).await.unwrap();
    nodes_until(&a, "node-1 follows its mirrored record", |n| {
        n.get("node-1").is_some_and(|r| pod_cidrs(r) == ["198.18.66.0/24"])
    })
    .await;
    nodes_until(&b, "node-2 follows the mirrored record", |n| {
        n.get("node-1").is_some_and(|r| pod_cidrs(r) == ["198.18.66.0/24"])
    })
    .await;

    // node-1 wrote nothing under its key: still the mirror's, without a
    // lease (node-2, given --pod-cidr, publishes its own on its lease).
    let held = client.get(key, None).await.unwrap();
    let kv = &held.kvs()[0];
    assert_eq!(
        kv.value_str().unwrap(),
        second,
        "a node without --pod-cidr must not overwrite the operator's record of it"
    );
    assert_eq!(kv.lease(), 0, "the mirror's key stays without a lease");
    let own = client.get("rivet/state/nodes/v1/default/node-2", None).await.unwrap();
    assert_ne!(own.kvs()[0].lease(), 0, "node-2 publishes its own record on its lease");
    drop(b);
}

#[tokio::test]
async fn routing_needs_a_node_store_and_an_underlay_address() {
    let dir = tempfile::tempdir().unwrap();
    let run = |extra: &[&str]| {
        let sockets = dir.path().join("sockets");
        DaemonCommand::new(BIN, sockets.join("svc-identity.sock"))
            .args(["--socket-dir".as_ref(), sockets.as_os_str()])
            .args(["--state-dir".as_ref(), dir.path().join("state").as_os_str()])
            .args(["--node-name", "node-1"])
            .args(extra)
            .run_to_exit(Duration::from_secs(10))
            .expect("svc-identity exits")
    };
    let refused = |extra: &[&str], message: &str| {
        let out = run(extra);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{extra:?} is refused");
        assert!(stderr.contains(message), "{extra:?}: {stderr}");
    };
    refused(&["--routing-mode", "native"], "--routing-mode needs the etcd store");
    let etcd = ["--etcd-endpoints", "http://127.0.0.1:9"];
    refused(&[&etcd[..], &["--routing-mode", "native"]].concat(), "--node-address");
    refused(
        &[
            &etcd[..],
            &["--routing-mode", "vxlan", "--node-address", "2001:2:0:fe::1"],
        ]
        .concat(),
        "needs an IPv4 --node-address",
    );
    refused(&["--pod-cidr", "198.18.1.1/24"], "host bits");
}

/// svc-loader of node 1 on `underlay`, in vxlan mode.
async fn vxlan_loader(underlay: &Underlay) -> LoaderNode {
    LoaderNode::start_on_underlay(
        &rivet_common::testing::workspace_binary("svc-loader"),
        underlay,
        1,
        &[],
        &["--routing-mode", "vxlan", "--underlay-interface", UNDERLAY_IFNAME],
    )
    .await
    .expect("svc-loader starts in vxlan mode")
}

/// svc-loader's peers: name → (underlay IPv4, pod CIDRs).
async fn loader_peers(loader: &LoaderNode) -> BTreeMap<String, (String, Vec<String>)> {
    let r = loader
        .routing_client()
        .await
        .list_nodes(loader_pb::ListNodesRequest {})
        .await
        .expect("svc-loader lists its peers")
        .into_inner();
    r.nodes
        .into_iter()
        .map(|n| {
            let cidrs = n.pod_cidrs.iter().map(rivet_proto::net::format_prefix).collect();
            (n.name, (rivet_proto::net::format_address(&n.underlay_ipv4), cidrs))
        })
        .collect()
}

async fn loader_peers_until(
    loader: &LoaderNode,
    what: &str,
    pred: impl Fn(&BTreeMap<String, (String, Vec<String>)>) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let peers = loader_peers(loader).await;
        if pred(&peers) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {peers:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// svc-loader's ipcache entry of `address` (identity, tunnel endpoint).
async fn loader_entry(loader: &LoaderNode, address: &str) -> Option<(u32, String)> {
    let r = loader
        .client()
        .await
        .list_ipcache(loader_pb::ListIpcacheRequest {
            page_size: 10000,
            start_after: None,
        })
        .await
        .expect("svc-loader lists its ipcache")
        .into_inner();
    r.entries.into_iter().find_map(|e| {
        let p = e.prefix?;
        (rivet_proto::net::format_address(&p.address) == address).then(|| {
            let tunnel = if e.tunnel_endpoint.is_empty() {
                String::new()
            } else {
                rivet_proto::net::format_address(&e.tunnel_endpoint)
            };
            (e.identity, tunnel)
        })
    })
}

async fn loader_entry_until(loader: &LoaderNode, address: &str, want: Option<(u32, &str)>) {
    let want = want.map(|(id, t)| (id, t.to_string()));
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = loader_entry(loader, address).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "svc-loader's entry of {address}: {got:?}, want {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The registry feeds a real svc-loader in vxlan mode: the peers (a node
/// it cannot route left out, the others still pushed), their underlay
/// addresses as remote-node, their pods with the peer as tunnel endpoint
/// (`--node-address` is the publishing node's host IP), and a stopped peer
/// removed.
#[tokio::test]
async fn peers_reach_svc_loader_as_routes_and_remote_node_entries() {
    let underlay = Underlay::new().expect("the underlay namespace");
    let loader = vxlan_loader(&underlay).await;
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2, n3) = (TestNode::new(1, 2), TestNode::new(2, 30), TestNode::new(3, 2));
    let _a = n1
        .command_in(&loader.dir.path().join("sockets"), dir.path(), &etcd.endpoint())
        .spawn()
        .await
        .expect("node-1's svc-identity starts beside svc-loader");
    let mut b = n2.spawn(dir.path(), &etcd).await;
    let _c = n3.spawn(dir.path(), &etcd).await;
    // A mirrored node with only an IPv6 address: no vxlan peer.
    let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
    let v6_only = r#"{"name":"v6-only","cluster":"default","addresses":[{"type":"InternalIP","ip":"2001:2:0:fe::9"}],"podCidrs":["198.18.9.0/24"],"source":"operator"}"#;
    client
        .put("rivet/state/nodes/v1/default/v6-only", v6_only, None)
        .await
        .unwrap();

    loader_peers_until(&loader, "svc-loader holds node-2 and node-3", |p| {
        p.len() == 2
            && p.get("node-2")
                == Some(&(
                    "198.19.254.2".into(),
                    vec!["198.18.2.0/24".into(), "2001:2:0:2::/64".into()],
                ))
            && p.get("node-3").is_some_and(|(v4, _)| v4 == "198.19.254.3")
    })
    .await;
    loader_entry_until(&loader, "198.19.254.2", Some((6, ""))).await;
    loader_entry_until(&loader, "2001:2:0:fe::9", Some((6, ""))).await;

    // node-2's pod: node-2 is its tunnel endpoint (its --node-address).
    let mut ib = IpcacheServiceClient::new(channel(&b).await);
    ib.upsert_ip(pb::UpsertIpRequest {
        entries: vec![pb::IpcacheEntry {
            prefix: Some(rivet_testkit::wire::prefix("198.18.2.7")),
            identity: 4242,
            source: pb::IpcacheSource::LocalEndpoint as i32,
            ..Default::default()
        }],
    })
    .await
    .expect("node-2 publishes its pod");
    loader_entry_until(&loader, "198.18.2.7", Some((4242, "198.19.254.2"))).await;

    assert!(b.terminate().await.unwrap().success());
    loader_peers_until(&loader, "node-2's routes go when it stops", |p| {
        p.len() == 1 && p.contains_key("node-3")
    })
    .await;
    loader_entry_until(&loader, "198.19.254.2", None).await;
    loader_entry_until(&loader, "198.18.2.7", None).await;
}

/// svc-identity killed and restarted while etcd is down keeps the peers'
/// addresses remote-node in svc-loader (from its local snapshot): its
/// full push must not drop them, or the loader would drop the peers'
/// tunnel traffic until etcd is back.
#[tokio::test]
async fn a_restart_during_an_etcd_outage_keeps_the_peers_remote_node_in_svc_loader() {
    let underlay = Underlay::new().expect("the underlay namespace");
    let loader = vxlan_loader(&underlay).await;
    let mut etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2) = (TestNode::new(1, 30), TestNode::new(2, 30));
    let sockets = loader.dir.path().join("sockets");
    let mut a = n1
        .command_in(&sockets, dir.path(), &etcd.endpoint())
        .spawn()
        .await
        .expect("node-1's svc-identity starts beside svc-loader");
    let _b = n2.spawn(dir.path(), &etcd).await;
    loader_entry_until(&loader, "198.19.254.2", Some((6, ""))).await;
    let snapshot = dir.path().join("node-1/state/identity/etcd-snapshot.json");
    let deadline = Instant::now() + Duration::from_secs(15);
    while !std::fs::read_to_string(&snapshot).is_ok_and(|s| s.contains("198.19.254.2")) {
        assert!(Instant::now() < deadline, "the snapshot never held node-2's address");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    etcd.stop();
    a.kill9();
    let a = n1
        .command_in(&sockets, dir.path(), &etcd.endpoint())
        .spawn()
        .await
        .expect("node-1's svc-identity restarts without etcd");
    let mut identity = IdentityServiceClient::new(channel(&a).await);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let status = identity
            .get_status(pb::GetStatusRequest {})
            .await
            .expect("GetStatus")
            .into_inner();
        if status.loader.as_ref().is_some_and(|l| l.connected) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted svc-identity never pushed to svc-loader: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        loader_entry(&loader, "198.19.254.2").await,
        Some((6, String::new())),
        "node-2's address stays remote-node after the full push"
    );
    let listing = list_nodes(&a).await;
    assert!(!listing.listed, "etcd is down: the registry has not listed");
}

/// A node's record carries the addresses of its endpoints with the
/// reserved `health` identity, kept current: another node sees the health
/// endpoint appear and go.
#[tokio::test]
async fn the_health_endpoint_addresses_follow_the_local_health_claims() {
    let etcd = EtcdServer::start_async().await.expect("etcd starts");
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2) = (TestNode::new(1, 2), TestNode::new(2, 2));
    let a = n1.spawn(dir.path(), &etcd).await;
    let b = n2.spawn(dir.path(), &etcd).await;
    let mut ia = IpcacheServiceClient::new(channel(&a).await);
    let claim = |address: &str, identity: u32| pb::IpcacheEntry {
        prefix: Some(rivet_testkit::wire::prefix(address)),
        identity,
        source: pb::IpcacheSource::LocalEndpoint as i32,
        ..Default::default()
    };
    ia.upsert_ip(pb::UpsertIpRequest {
        entries: vec![
            claim("198.18.1.2", 4),
            claim("2001:2:0:1::2", 4),
            claim("198.18.1.3", 4242),
        ],
    })
    .await
    .expect("node-1 claims its health endpoint and a pod");
    let health = |n: &BTreeMap<String, pb::Node>| -> Option<Vec<IpAddr>> {
        n.get("node-1")
            .map(|r| r.health_addresses.iter().map(|a| ip(a)).collect())
    };
    let want: Vec<IpAddr> = vec!["198.18.1.2".parse().unwrap(), "2001:2:0:1::2".parse().unwrap()];
    nodes_until(&b, "node-2 sees node-1's health endpoint (not its pod)", |n| {
        health(n).as_ref() == Some(&want)
    })
    .await;
    ia.delete_ip(pb::DeleteIpRequest {
        prefixes: vec![rivet_testkit::wire::prefix("2001:2:0:1::2")],
        source: pb::IpcacheSource::LocalEndpoint as i32,
    })
    .await
    .unwrap();
    nodes_until(&b, "node-2 sees node-1's health endpoint lose its IPv6 address", |n| {
        health(n).as_ref() == Some(&want[..1].to_vec())
    })
    .await;
}
