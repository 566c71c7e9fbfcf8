//! Services across the nodes of a cluster (issue 17 §3): a 3-node
//! `rivet cluster up`, Services and their EndpointSlices applied to every
//! node with `rivet cluster service apply -f`, pods of the real rivet-cni,
//! every backend serving its pod's name over TCP and UDP
//! (`rivet_testkit::service::NameServer`), IPv4 and IPv6:
//!
//! - ClusterIP from a pod to backends on its own and on the other nodes,
//!   replies from the VIP (a TCP handshake or a connected UDP socket only
//!   completes with them), hairpin (a backend reaching itself through its
//!   service), and policy on the backend's identity (a NetworkPolicy on the
//!   backends admitting only `app=client` blocks another pod's service
//!   path; `rivet monitor` shows the drop to the backend's address, not to
//!   the VIP) — with native routing and with VXLAN;
//! - distribution: 10,000 new connections over 3 backends within 33% ± 5%
//!   each; after one backend is removed, held connections to the other two
//!   keep their backend and new ones never reach the removed one;
//! - session affinity ClientIP; a terminating backend keeps its open
//!   connections and gets no new ones; zero backends → ECONNREFUSED at once
//!   and a `no-service-backend` drop in `rivet monitor`;
//! - kill -9 of svc-loader and of svc-endpoint under service traffic (a
//!   UDP stream through the ClusterIP per family, a held TCP connection): no
//!   datagram lost, the loader's services, ids and tables and `rivet bpf
//!   service list` unchanged, and its restored index serves the next change.
//!
//! Needs root, a bpffs at /sys/fs/bpf, the rivet users and etcd 3.6
//! (`cargo xtask install`) and the workspace binaries (`cargo build
//! --bins`). ClusterIPs come from `rivet node up`'s default service CIDRs
//! (198.19.128.0/20, 2001:2:0:ff::/112).

use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use rivet_proto::loader::v1 as ldpb;
use rivet_testkit::cluster::{Cluster, ClusterOptions, ClusterPod, Routing};
use rivet_testkit::monitor::NodeDrops;
use rivet_testkit::service::{HeldConnection, NameServer, UdpStream, ask_name, ask_name_udp, ask_names};
use serde_json::json;

/// The namespace of every pod and service here.
const NAMESPACE: &str = "shop";
/// The Service's TCP and UDP port.
const SERVICE_PORT: u16 = 80;
/// The backends' port (TCP and UDP).
const TARGET_PORT: u16 = 8080;
/// How long one request may take (a loaded machine).
const ANSWER_WITHIN: Duration = Duration::from_secs(5);
/// How long a request that must not be answered is given.
const NOT_ANSWERED_WITHIN: Duration = Duration::from_millis(500);
/// How long the UDP streams may take to get their answers after a restart.
const STREAM_RESUMES_WITHIN: Duration = Duration::from_secs(30);

/// A backend's EndpointSlice conditions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Condition {
    Ready,
    /// Terminating and still serving (kubelet's graceful shutdown).
    Terminating,
}

/// A pod serving its name on every address at [`TARGET_PORT`].
struct Backend {
    pod: ClusterPod,
    _server: NameServer,
}

async fn backend(cluster: &mut Cluster, node: usize, name: &str) -> Backend {
    let pod = cluster.add_pod(node, NAMESPACE, name, &["app=web"]).await;
    let server = NameServer::start(
        &pod.netns,
        name,
        &[pod.socket_v4(TARGET_PORT), pod.socket_v6(TARGET_PORT)],
    )
    .expect("a name server in the backend pod");
    Backend { pod, _server: server }
}

/// Three backends, be-1, be-2 and be-3, on nodes 1, 2 and 3.
async fn three_backends(cluster: &mut Cluster) -> Vec<Backend> {
    let mut backends = Vec::new();
    for node in 1..=3 {
        backends.push(backend(cluster, node, &format!("be-{node}")).await);
    }
    backends
}

/// Every pod a ready backend.
fn all_ready<'a>(pods: &[&'a ClusterPod]) -> Vec<(&'a ClusterPod, Condition)> {
    pods.iter().map(|p| (*p, Condition::Ready)).collect()
}

/// Applies [`service_yaml`] to every node and waits until every datapath
/// holds its ready backends as active and its terminating ones.
async fn apply_and_wait(
    cluster: &Cluster,
    name: &str,
    vips: [IpAddr; 2],
    affinity_seconds: Option<u32>,
    backends: &[(&ClusterPod, Condition)],
) {
    cluster
        .apply_service(&service_yaml(cluster, name, vips, affinity_seconds, backends))
        .await;
    let with = |condition: Condition| -> Vec<&ClusterPod> {
        backends
            .iter()
            .filter(|(_, c)| *c == condition)
            .map(|(p, _)| *p)
            .collect()
    };
    wait_backends(cluster, vips, &with(Condition::Ready), &with(Condition::Terminating)).await;
}

/// A Service `name` (TCP and UDP port [`SERVICE_PORT`] → [`TARGET_PORT`],
/// dual-stack ClusterIPs `vips`, no selector) and one EndpointSlice per
/// family with `backends`, as multi-document YAML (JSON documents).
fn service_yaml(
    cluster: &Cluster,
    name: &str,
    vips: [IpAddr; 2],
    affinity_seconds: Option<u32>,
    backends: &[(&ClusterPod, Condition)],
) -> String {
    let mut spec = json!({
        "type": "ClusterIP",
        "clusterIP": vips[0].to_string(),
        "clusterIPs": [vips[0].to_string(), vips[1].to_string()],
        "ipFamilies": ["IPv4", "IPv6"],
        "ipFamilyPolicy": "RequireDualStack",
        "ports": [
            { "name": "tcp", "protocol": "TCP", "port": SERVICE_PORT, "targetPort": TARGET_PORT },
            { "name": "udp", "protocol": "UDP", "port": SERVICE_PORT, "targetPort": TARGET_PORT },
        ],
    });
    if let Some(seconds) = affinity_seconds {
        spec["sessionAffinity"] = json!("ClientIP");
        spec["sessionAffinityConfig"] = json!({ "clientIP": { "timeoutSeconds": seconds } });
    }
    let service = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "namespace": NAMESPACE, "name": name },
        "spec": spec,
    });
    let slice = |family: &str, v4: bool| {
        let endpoints: Vec<_> = backends
            .iter()
            .map(|(pod, condition)| {
                let address = if v4 { pod.ipv4.to_string() } else { pod.ipv6.to_string() };
                let terminating = *condition == Condition::Terminating;
                json!({
                    "addresses": [address],
                    "conditions": { "ready": !terminating, "serving": true, "terminating": terminating },
                    "nodeName": cluster.node(pod.node).name,
                    "targetRef": { "kind": "Pod", "namespace": pod.namespace, "name": pod.name },
                })
            })
            .collect();
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {
                "namespace": NAMESPACE,
                "name": format!("{name}-{}", family.to_lowercase()),
                "labels": { "kubernetes.io/service-name": name },
            },
            "addressType": family,
            "endpoints": endpoints,
            "ports": [
                { "name": "tcp", "protocol": "TCP", "port": TARGET_PORT },
                { "name": "udp", "protocol": "UDP", "port": TARGET_PORT },
            ],
        })
    };
    [service, slice("IPv4", true), slice("IPv6", false)]
        .iter()
        .map(|d| serde_json::to_string_pretty(d).expect("JSON"))
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// A service's two ClusterIPs: `198.19.128.<n>` and `2001:2:0:ff::<n>`.
fn vips(n: u8) -> [IpAddr; 2] {
    [
        format!("198.19.128.{n}").parse().unwrap(),
        format!("2001:2:0:ff::{n:x}").parse().unwrap(),
    ]
}

/// The backends (address bytes) of a loader service in `state`.
fn backends_in(service: &ldpb::LbServiceStatus, state: ldpb::BackendState) -> BTreeSet<Vec<u8>> {
    service
        .backends
        .iter()
        .filter_map(|b| b.backend.as_ref())
        .filter(|b| b.state == state as i32)
        .map(|b| b.address.clone())
        .collect()
}

fn address_bytes(address: IpAddr) -> Vec<u8> {
    match address {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

/// Waits until every node's datapath holds both ports of the service at
/// each of `vips`, with exactly `active` as active backends and at least
/// `terminating` as terminating ones (pods, that family's address; a
/// removed backend may stay listed while its flows last).
async fn wait_backends(cluster: &Cluster, vips: [IpAddr; 2], active: &[&ClusterPod], terminating: &[&ClusterPod]) {
    for (family, vip) in vips.iter().enumerate() {
        let pick = |pods: &[&ClusterPod]| -> BTreeSet<Vec<u8>> {
            pods.iter().map(|p| address_bytes(p.addrs()[family])).collect()
        };
        let (active, terminating) = (pick(active), pick(terminating));
        cluster
            .wait_datapath_services(*vip, |services| {
                services.len() == 2
                    && services.iter().all(|s| {
                        backends_in(s, ldpb::BackendState::Active) == active
                            && backends_in(s, ldpb::BackendState::Terminating).is_superset(&terminating)
                    })
            })
            .await;
    }
}

/// The answers of `count` new connections from `from` to `dst`, by name;
/// panics on any failure.
fn spread(from: &ClusterPod, dst: SocketAddr, count: usize) -> BTreeMap<String, usize> {
    let mut by_name = BTreeMap::new();
    for (i, answer) in ask_names(&from.netns, dst, count, ANSWER_WITHIN)
        .into_iter()
        .enumerate()
    {
        let name = answer.unwrap_or_else(|e| panic!("connection {i} of {count} from {} to {dst}: {e}", from.name));
        *by_name.entry(name).or_insert(0) += 1;
    }
    by_name
}

/// `count` connections held open from `from` to `dst`, each asked once.
fn hold(from: &ClusterPod, dst: SocketAddr, count: usize) -> Vec<HeldConnection> {
    (0..count)
        .map(|i| {
            HeldConnection::open(&from.netns, dst, ANSWER_WITHIN)
                .unwrap_or_else(|e| panic!("held connection {i} from {} to {dst}: {e}", from.name))
        })
        .collect()
}

fn names(pods: &[&ClusterPod]) -> BTreeSet<String> {
    pods.iter().map(|p| p.name.clone()).collect()
}

async fn start(routing: Routing) -> Cluster {
    Cluster::start(ClusterOptions {
        routing,
        ..Default::default()
    })
    .await
    .expect("the cluster starts")
}

/// ClusterIP from a pod to backends on every node, replies from the VIP,
/// hairpin, and policy on the backend's identity.
async fn cluster_ip_across_nodes(routing: Routing) {
    let mut cluster = start(routing).await;
    let be = three_backends(&mut cluster).await;
    let client = cluster.add_pod(1, NAMESPACE, "client", &["app=client"]).await;
    let other = cluster.add_pod(2, NAMESPACE, "other", &["app=other"]).await;
    cluster.wait_converged().await;
    let vips = vips(10);
    let pods: Vec<&ClusterPod> = be.iter().map(|b| &b.pod).collect();
    let ready = all_ready(&pods);
    apply_and_wait(&cluster, "web", vips, None, &ready).await;

    for vip in vips {
        let dst = SocketAddr::new(vip, SERVICE_PORT);
        // Every backend, on this node and the two others, answers through
        // the VIP (Maglev spreads the new connections' source ports).
        let seen = spread(&client, dst, 60);
        assert_eq!(
            seen.keys().cloned().collect::<BTreeSet<_>>(),
            names(&pods),
            "60 connections from node 1 to {dst} reach the backends of every node: {seen:?}"
        );
        ask_name(&client.netns, dst, ANSWER_WITHIN)
            .unwrap_or_else(|e| panic!("a TCP connection to {dst} is answered from {dst}: {e}"));
        let over_udp = ask_name_udp(&client.netns, dst, ANSWER_WITHIN)
            .unwrap_or_else(|e| panic!("a datagram to {dst} is answered from {dst}: {e}"));
        assert!(names(&pods).contains(&over_udp), "{over_udp}");

        // Hairpin: be-1 reaches itself through its service (some source
        // ports hash to it).
        let from_backend = spread(&be[0].pod, dst, 60);
        assert!(
            from_backend.contains_key("be-1"),
            "be-1 reaches itself through {dst} (hairpin): {from_backend:?}"
        );
    }

    // Policy on the backend's identity: only app=client may reach the
    // backends; the service path of `other` is blocked where the backend
    // is, on the translated packet.
    let monitors: Vec<NodeDrops> = (1..=3)
        .map(|n| NodeDrops::start(cluster.node(n).rivet(&["monitor", "-o", "json"])))
        .collect();
    cluster
        .apply_policy(&format!(
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: web, namespace: {NAMESPACE}}}\n\
             spec:\n  podSelector: {{matchLabels: {{app: web}}}}\n  policyTypes: [Ingress]\n  \
             ingress:\n  - from:\n    - podSelector: {{matchLabels: {{app: client}}}}\n"
        ))
        .await;
    for vip in vips {
        let dst = SocketAddr::new(vip, SERVICE_PORT);
        let seen = spread(&client, dst, 30);
        assert_eq!(seen.values().sum::<usize>(), 30, "app=client is admitted: {seen:?}");
        for i in 0..10 {
            let answer = ask_name(&other.netns, dst, NOT_ANSWERED_WITHIN);
            assert!(
                answer.is_err(),
                "connection {i} from `other` to {dst} must be denied by the backends' policy: {answer:?}"
            );
        }
        let source = if vip.is_ipv4() {
            IpAddr::V4(other.ipv4)
        } else {
            IpAddr::V6(other.ipv6)
        };
        let backend_addrs: Vec<SocketAddr> = pods
            .iter()
            .map(|p| SocketAddr::new(if vip.is_ipv4() { p.ipv4.into() } else { p.ipv6.into() }, TARGET_PORT))
            .collect();
        let deadline = Instant::now() + rivet_testkit::monitor::DROP_SHOWN_WITHIN;
        loop {
            let drops: Vec<_> = monitors.iter().flat_map(|m| m.involving(&[source])).collect();
            assert!(
                drops.iter().all(|d| d.destination != dst),
                "policy judges the translated packet, never the VIP: {drops:?}"
            );
            if drops
                .iter()
                .any(|d| d.is_policy_drop() && backend_addrs.contains(&d.destination))
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "a policy drop of `other` -> a backend ({backend_addrs:?}) shows in rivet monitor: {drops:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    cluster.down().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cluster_ip_across_nodes_replies_hairpin_and_backend_policy_native() {
    cluster_ip_across_nodes(Routing::Native).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn cluster_ip_across_nodes_replies_hairpin_and_backend_policy_vxlan() {
    cluster_ip_across_nodes(Routing::Vxlan).await;
}

/// Each of 3 backends gets 33% ± 5% of new connections.
fn assert_spread_evenly(seen: &BTreeMap<String, usize>, backends: &BTreeSet<String>, total: usize, what: &str) {
    assert_eq!(
        seen.keys().cloned().collect::<BTreeSet<_>>(),
        *backends,
        "{what}: {seen:?}"
    );
    let share = 1.0 / backends.len() as f64;
    for (name, count) in seen {
        let fraction = *count as f64 / total as f64;
        assert!(
            (fraction - share).abs() <= 0.05,
            "{what}: {name} got {:.1}% of {total}, not {:.1}% ± 5%: {seen:?}",
            fraction * 100.0,
            share * 100.0
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn new_connections_spread_evenly_and_a_removed_backend_moves_no_other_flow() {
    let mut cluster = start(Routing::Native).await;
    let be = three_backends(&mut cluster).await;
    let client = cluster.add_pod(1, NAMESPACE, "client", &["app=client"]).await;
    cluster.wait_converged().await;
    let vips = vips(20);
    let pods: Vec<&ClusterPod> = be.iter().map(|b| &b.pod).collect();
    let ready = all_ready(&pods);
    apply_and_wait(&cluster, "web", vips, None, &ready).await;

    for (vip, total) in [(vips[0], 10_000), (vips[1], 3_000)] {
        let dst = SocketAddr::new(vip, SERVICE_PORT);
        let seen = tokio::task::block_in_place(|| spread(&client, dst, total));
        assert_spread_evenly(&seen, &names(&pods), total, &format!("{total} connections to {dst}"));
    }

    // Long-lived flows across the removal of be-3.
    let mut held: Vec<(IpAddr, HeldConnection)> = vips
        .iter()
        .flat_map(|vip| {
            hold(&client, SocketAddr::new(*vip, SERVICE_PORT), 60)
                .into_iter()
                .map(|c| (*vip, c))
        })
        .collect();
    let survivors = [pods[0], pods[1]];
    let two = all_ready(&survivors);
    apply_and_wait(&cluster, "web", vips, None, &two).await;
    let mut kept = 0;
    for (vip, connection) in &mut held {
        if connection.first == "be-3" {
            continue;
        }
        let now = connection.ask().unwrap_or_else(|e| {
            panic!(
                "a held connection to {vip} on {} after be-3 left: {e}",
                connection.first
            )
        });
        assert_eq!(now, connection.first, "a flow to a surviving backend keeps it");
        kept += 1;
    }
    assert!(kept > 0, "some held connections were on be-1 or be-2");
    for vip in vips {
        let dst = SocketAddr::new(vip, SERVICE_PORT);
        let seen = spread(&client, dst, 600);
        assert_eq!(
            seen.keys().cloned().collect::<BTreeSet<_>>(),
            names(&survivors),
            "new connections to {dst} reach only the two remaining backends: {seen:?}"
        );
    }
    drop(held);
    cluster.down().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn session_affinity_a_terminating_backend_and_zero_backends() {
    let mut cluster = start(Routing::Native).await;
    let be = three_backends(&mut cluster).await;
    let client = cluster.add_pod(1, NAMESPACE, "client", &["app=client"]).await;
    let other = cluster.add_pod(2, NAMESPACE, "other", &["app=other"]).await;
    cluster.wait_converged().await;
    let pods: Vec<&ClusterPod> = be.iter().map(|b| &b.pod).collect();
    let ready = all_ready(&pods);

    // Session affinity ClientIP: every new connection of a client goes to
    // the backend its first one got.
    let sticky = vips(30);
    apply_and_wait(&cluster, "sticky", sticky, Some(60), &ready).await;
    for vip in sticky {
        let dst = SocketAddr::new(vip, SERVICE_PORT);
        for from in [&client, &other] {
            let seen = spread(from, dst, 100);
            assert_eq!(
                seen.len(),
                1,
                "with ClientIP affinity {} sticks to one backend of {dst}: {seen:?}",
                from.name
            );
        }
    }

    // A terminating backend keeps its flows and gets no new ones.
    let web = vips(31);
    apply_and_wait(&cluster, "web", web, None, &ready).await;
    let mut held: Vec<HeldConnection> = web
        .iter()
        .flat_map(|vip| hold(&client, SocketAddr::new(*vip, SERVICE_PORT), 60))
        .collect();
    assert!(
        held.iter().any(|c| c.first == "be-2"),
        "some of 120 held connections are on be-2"
    );
    let draining = [
        (pods[0], Condition::Ready),
        (pods[1], Condition::Terminating),
        (pods[2], Condition::Ready),
    ];
    apply_and_wait(&cluster, "web", web, None, &draining).await;
    for connection in &mut held {
        let now = connection.ask().unwrap_or_else(|e| {
            panic!(
                "a held connection on {} after be-2 began terminating: {e}",
                connection.first
            )
        });
        assert_eq!(now, connection.first, "every open connection keeps its backend");
    }
    for vip in web {
        let dst = SocketAddr::new(vip, SERVICE_PORT);
        let seen = spread(&client, dst, 300);
        assert!(
            !seen.contains_key("be-2"),
            "no new connection to {dst} reaches the terminating be-2: {seen:?}"
        );
    }
    drop(held);

    // No backend: refused at once, and the drop is in rivet monitor.
    let empty = vips(32);
    apply_and_wait(&cluster, "empty", empty, None, &[]).await;
    let monitor = NodeDrops::start(cluster.node(1).rivet(&["monitor", "-o", "json"]));
    for (vip, source) in empty
        .into_iter()
        .zip([IpAddr::V4(client.ipv4), IpAddr::V6(client.ipv6)])
    {
        let dst = SocketAddr::new(vip, SERVICE_PORT);
        let started = Instant::now();
        let answer = ask_name(&client.netns, dst, ANSWER_WITHIN);
        let took = started.elapsed();
        assert!(
            matches!(&answer, Err(e) if e.kind() == ErrorKind::ConnectionRefused),
            "a connection to {dst} without backends is refused: {answer:?}"
        );
        assert!(
            took < Duration::from_secs(1),
            "refused at once, not timed out: {took:?}"
        );
        let over_udp = ask_name_udp(&client.netns, dst, ANSWER_WITHIN);
        assert!(
            matches!(&over_udp, Err(e) if e.kind() == ErrorKind::ConnectionRefused),
            "a datagram to {dst} without backends is refused: {over_udp:?}"
        );
        monitor.wait_for("no backend", "no-service-backend", source, dst);
    }
    cluster.down().await;
}

/// svc-loader's services with what must survive a restart: ids, frontends,
/// backends with their ids and states, table ids (no counters).
async fn loader_services(cluster: &Cluster, node: usize) -> Vec<ldpb::LbServiceStatus> {
    let mut services = cluster
        .node(node)
        .datapath_services()
        .await
        .expect("svc-loader lists its services")
        .services;
    services.sort_by_key(|s| s.service.as_ref().map(|s| s.service_id));
    services
}

#[tokio::test(flavor = "multi_thread")]
async fn kill9_of_svc_loader_and_svc_endpoint_under_service_traffic_loses_nothing() {
    let mut cluster = start(Routing::Native).await;
    let be = three_backends(&mut cluster).await;
    let client = cluster.add_pod(1, NAMESPACE, "client", &["app=client"]).await;
    cluster.wait_converged().await;
    let vips = vips(40);
    let pods: Vec<&ClusterPod> = be.iter().map(|b| &b.pod).collect();
    let ready = all_ready(&pods);
    apply_and_wait(&cluster, "web", vips, None, &ready).await;
    let before = loader_services(&cluster, 1).await;
    // What `rivet bpf service list` shows of the maps (not the flow and
    // affinity counts, which the traffic moves).
    let bpf_services = || cluster.node(1).json(&["bpf", "service", "list"])["services"].clone();
    let bpf_before = bpf_services();
    assert!(
        bpf_before.as_array().is_some_and(|s| s.len() == 4),
        "rivet bpf service list shows the service's 2 ports x 2 families: {bpf_before}"
    );
    let mut held: Vec<HeldConnection> = vips
        .iter()
        .flat_map(|vip| hold(&client, SocketAddr::new(*vip, SERVICE_PORT), 10))
        .collect();

    let mut report = Vec::new();
    let mut lost = false;
    for daemon in ["svc-loader", "svc-endpoint"] {
        let streams: Vec<(IpAddr, UdpStream)> = vips
            .iter()
            .map(|vip| {
                let stream = UdpStream::start(&client.netns, SocketAddr::new(*vip, SERVICE_PORT))
                    .expect("a UDP stream through the ClusterIP");
                (*vip, stream)
            })
            .collect();
        for (_, stream) in &streams {
            tokio::task::block_in_place(|| stream.wait_more_answers(100, STREAM_RESUMES_WITHIN));
        }
        cluster.kill9(1, daemon).await;
        // The restarted daemon resynced (svc-endpoint replays its services
        // to the loader; the loader rebuilt its index from the pins).
        wait_backends(&cluster, vips, &pods, &[]).await;
        for (_, stream) in &streams {
            tokio::task::block_in_place(|| stream.wait_more_answers(100, STREAM_RESUMES_WITHIN));
        }
        for (vip, stream) in streams {
            let totals = stream.stop();
            lost |= totals.lost() > 0 || totals.servers.len() != 1;
            report.push(format!("kill -9 of {daemon} of node 1, UDP to {vip}: {totals:?}"));
        }
        assert_eq!(
            loader_services(&cluster, 1).await,
            before,
            "svc-loader's services, ids and tables are unchanged after kill -9 of {daemon}"
        );
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        !lost,
        "no datagram lost and one backend per flow across kill -9 of svc-loader and svc-endpoint:\n{}",
        report.join("\n")
    );
    assert_eq!(bpf_services(), bpf_before, "`rivet bpf service list` is unchanged");
    for connection in &mut held {
        let now = connection.ask().expect("a held connection after both restarts");
        assert_eq!(now, connection.first, "a held connection keeps its backend");
    }

    // The restored index serves the next change: be-3 leaves, be-1 and
    // be-2 keep their backend ids and the services their tables.
    let two = all_ready(&[pods[0], pods[1]]);
    apply_and_wait(&cluster, "web", vips, None, &two).await;
    let after = loader_services(&cluster, 1).await;
    assert_eq!(after.len(), before.len());
    for (old, new) in before.iter().zip(&after) {
        let (old_service, new_service) = (old.service.as_ref().unwrap(), new.service.as_ref().unwrap());
        assert_eq!(
            (old_service.service_id, &old_service.frontends),
            (new_service.service_id, &new_service.frontends),
            "the same service"
        );
        assert_eq!(old.table_id, new.table_id, "the same Maglev table");
        let ids = |s: &ldpb::LbServiceStatus| -> BTreeMap<Vec<u8>, u32> {
            s.backends
                .iter()
                .filter(|b| {
                    b.backend
                        .as_ref()
                        .is_some_and(|b| b.state == ldpb::BackendState::Active as i32)
                })
                .map(|b| (b.backend.as_ref().unwrap().address.clone(), b.backend_id))
                .collect()
        };
        let (old_ids, new_ids) = (ids(old), ids(new));
        for (address, id) in &new_ids {
            assert_eq!(old_ids.get(address), Some(id), "a surviving backend keeps its id");
        }
    }
    drop(held);
    cluster.down().await;
}
