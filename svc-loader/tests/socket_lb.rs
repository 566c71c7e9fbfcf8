//! Socket-level load balancing: the cgroup programs attached to a cgroup v2
//! directory of the test's (`--socket-lb-cgroup`), a client process started
//! inside it in a pod's namespace, and backends in other pods.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;
use std::time::Duration;

use rivet_bpf_sys as sys;
use rivet_datapath::maps::{Ct4Key, Ct6Key, LB_SOCK_REV_F_DATAGRAM, LbSockRev, LbSockRevKey};
use rivet_datapath::spec::{MAP_LB_SOCK_REV, MAP_LB4_FLOWS, MAP_LB6_FLOWS};
use rivet_proto::loader::v1 as pb;
use rivet_testkit::cgroup::{Probe, ProbeReport, TestCgroup, run_probe};
use rivet_testkit::loader::{LoaderNode, policy};
use rivet_testkit::service::NameServer;
use svc_loader::datapath::{SOCKET_LB_LINKS_DIR, SOCKET_LB_PROGRAMS};

const BIN: &str = env!("CARGO_BIN_EXE_svc-loader");
const PROBE_TIMEOUT: Duration = Duration::from_secs(20);
/// The backends' port (TCP and UDP: [`NameServer`]).
const BACKEND_PORT: u16 = 8080;
/// The services' ports.
const TCP_PORT: u16 = 80;
const UDP_PORT: u16 = 53;

fn cgroup() -> TestCgroup {
    TestCgroup::new().expect("a cgroup v2 directory for the test (root, cgroup2 mounted)")
}

/// Every socket LB link pinned under `pin_dir`, by program: (link id,
/// program id, cgroup id, attach type).
fn links(pin_dir: &Path) -> Vec<(&'static str, sys::LinkInfo)> {
    SOCKET_LB_PROGRAMS
        .iter()
        .filter_map(|program| {
            let fd = sys::obj_get(&pin_dir.join(SOCKET_LB_LINKS_DIR).join(program.name)).ok()?;
            Some((program.name, sys::link_info(fd.as_fd()).expect("link info")))
        })
        .collect()
}

fn cgroup_id(cgroup: &TestCgroup) -> u64 {
    std::fs::metadata(cgroup.path()).expect("cgroup dir").ino()
}

fn socket_lb_flag(args: &mut Vec<OsString>, cgroup: Option<&TestCgroup>) {
    if let Some(i) = args.iter().position(|a| a == "--socket-lb-cgroup") {
        args.drain(i..i + 2);
    }
    if let Some(cgroup) = cgroup {
        args.push("--socket-lb-cgroup".into());
        args.push(cgroup.path().into());
    }
}

/// The links are pinned on the cgroup asked for, survive a kill -9 and are
/// adopted (same links, the new loader's programs), move when the flag
/// names another cgroup, and go when the flag is removed.
#[tokio::test]
async fn links_are_pinned_adopted_moved_and_detached_with_the_flag() {
    let first = cgroup();
    let second = cgroup();
    let mut node = LoaderNode::start(
        BIN.as_ref(),
        &[],
        &["--socket-lb-cgroup", first.path().to_str().unwrap()],
    )
    .await
    .expect("a test node with socket LB starts");

    let attached = links(&node.pins.0);
    assert_eq!(attached.len(), SOCKET_LB_PROGRAMS.len(), "one pinned link per program");
    for ((name, info), program) in attached.iter().zip(SOCKET_LB_PROGRAMS) {
        assert_eq!(*name, program.name);
        assert_eq!(info.link_type, sys::BPF_LINK_TYPE_CGROUP, "{name}");
        assert_eq!(info.cgroup_id, cgroup_id(&first), "{name} is on the flag's cgroup");
        assert_eq!(info.attach_type, program.attach_type, "{name}");
    }

    node.loader.kill9();
    assert_eq!(links(&node.pins.0), attached, "the links stay while the loader is down");
    node.loader.restart().await.expect("the loader restarts");
    let adopted = links(&node.pins.0);
    for ((name, before), (_, after)) in attached.iter().zip(&adopted) {
        assert_eq!(after.id, before.id, "{name}: the same link is adopted");
        assert_ne!(
            after.prog_id, before.prog_id,
            "{name}: it runs the new loader's program"
        );
        assert_eq!(after.cgroup_id, before.cgroup_id, "{name}");
    }
    assert!(
        node.loader.log().contains("socket load balancing attached"),
        "the start is logged"
    );

    node.loader
        .restart_with_args(|args| socket_lb_flag(args, Some(&second)))
        .await
        .expect("the loader restarts with another cgroup");
    let moved = links(&node.pins.0);
    assert_eq!(moved.len(), SOCKET_LB_PROGRAMS.len());
    for ((name, before), (_, after)) in adopted.iter().zip(&moved) {
        assert_ne!(after.id, before.id, "{name}: a new link");
        assert_eq!(after.cgroup_id, cgroup_id(&second), "{name} moved to the new cgroup");
    }
    let link_dir = node.pins.0.join(SOCKET_LB_LINKS_DIR);
    assert_eq!(
        std::fs::read_dir(&link_dir).unwrap().count(),
        SOCKET_LB_PROGRAMS.len(),
        "no staged pin is left"
    );

    node.loader
        .restart_with_args(|args| socket_lb_flag(args, None))
        .await
        .expect("the loader restarts without the flag");
    assert!(!link_dir.exists(), "the link pins are gone without the flag");
    assert!(links(&node.pins.0).is_empty());
}

// ------------------------------------------------------------------ services

/// The ClusterIPs of the tests (the service CIDRs of `rivet node up`).
fn vip(family: pb::Family) -> IpAddr {
    match family {
        pb::Family::Ipv6 => "2001:2:0:ff::10".parse().unwrap(),
        _ => "198.19.128.10".parse().unwrap(),
    }
}

fn service(
    service_id: u32,
    family: pb::Family,
    protocol: pb::Protocol,
    port: u16,
    backends: &[IpAddr],
) -> pb::LbService {
    pb::LbService {
        service_id,
        family: family as i32,
        protocol: protocol as i32,
        frontends: vec![pb::LbFrontend {
            kind: pb::FrontendKind::ClusterIp as i32,
            address: rivet_proto::net::address_bytes(vip(family)),
            port: port.into(),
        }],
        backends: backends
            .iter()
            .map(|addr| pb::LbBackend {
                address: rivet_proto::net::address_bytes(*addr),
                port: BACKEND_PORT.into(),
                state: pb::BackendState::Active as i32,
                node_local: true,
            })
            .collect(),
        affinity_timeout_seconds: 0,
        external_traffic_policy: pb::TrafficPolicy::Cluster as i32,
    }
}

/// A node with a client pod and two backend pods (`b1`, `b2`) answering
/// with their names on [`BACKEND_PORT`], every pod an unrestricted endpoint.
struct ServiceNode {
    node: LoaderNode,
    _backends: Vec<NameServer>,
}

impl ServiceNode {
    async fn start(cgroup: &TestCgroup) -> Self {
        let node = LoaderNode::start(
            BIN.as_ref(),
            &["client", "b1", "b2"],
            &["--socket-lb-cgroup", cgroup.path().to_str().unwrap()],
        )
        .await
        .expect("a test node with socket LB starts");
        let mut client = node.client().await;
        for (id, pod) in [(1, "client"), (2, "b1"), (3, "b2")] {
            client
                .apply_endpoint(node.endpoint(pod, id, 1000 + id, policy(1, false, false, vec![])))
                .await
                .expect("the endpoint is applied");
        }
        let backends = ["b1", "b2"]
            .iter()
            .map(|pod| {
                let addrs: Vec<SocketAddr> = node
                    .pod(pod)
                    .addrs()
                    .into_iter()
                    .map(|ip| SocketAddr::new(ip, BACKEND_PORT))
                    .collect();
                NameServer::start(&node.pod(pod).ns, pod, &addrs).expect("the backend serves")
            })
            .collect();
        Self {
            node,
            _backends: backends,
        }
    }

    fn backend_addr(&self, pod: &str, family: pb::Family) -> IpAddr {
        let p = self.node.pod(pod);
        match family {
            pb::Family::Ipv6 => p.ipv6().unwrap(),
            _ => p.ipv4().unwrap(),
        }
    }

    /// Both backends of `family`.
    fn backends(&self, family: pb::Family) -> Vec<IpAddr> {
        ["b1", "b2"].iter().map(|pod| self.backend_addr(pod, family)).collect()
    }

    /// The `protocol` service of each family at its VIP (TCP: ids 10 and
    /// 20 on [`TCP_PORT`]; UDP: 11 and 21 on [`UDP_PORT`]), with both
    /// backends behind it or none.
    async fn upsert_services(&self, protocol: pb::Protocol, with_backends: bool) {
        let (ids, port) = match protocol {
            pb::Protocol::Udp => ([11, 21], UDP_PORT),
            _ => ([10, 20], TCP_PORT),
        };
        for (id, family) in ids.into_iter().zip(FAMILIES) {
            let backends = if with_backends {
                self.backends(family)
            } else {
                Vec::new()
            };
            self.upsert(service(id, family, protocol, port, &backends)).await;
        }
    }

    /// Programs `service` through svc-loader's UpsertService.
    async fn upsert(&self, service: pb::LbService) {
        self.node
            .lb_client()
            .await
            .upsert_service(pb::UpsertServiceRequest { service: Some(service) })
            .await
            .expect("the service is accepted");
    }

    fn probe(&self, cgroup: Option<&TestCgroup>, probe: Probe, target: SocketAddr) -> ProbeReport {
        run_probe(&self.node.pod("client").ns, cgroup, probe, target, PROBE_TIMEOUT).expect("the socket probe runs")
    }

    fn pin(&self, map: &str) -> std::os::fd::OwnedFd {
        sys::obj_get(&self.node.pins.0.join(map)).unwrap_or_else(|e| panic!("open the pinned {map}: {e}"))
    }

    /// Entries in lb4_flows and lb6_flows: translated per packet.
    fn per_packet_flows(&self) -> usize {
        let count4 = count_keys::<Ct4Key>(&self.pin(MAP_LB4_FLOWS));
        let count6 = count_keys::<Ct6Key>(&self.pin(MAP_LB6_FLOWS));
        count4 + count6
    }

    /// What lb_sock_rev holds for socket `cookie` sent to `backend`.
    fn sock_rev(&self, cookie: u64, backend: SocketAddr) -> Option<LbSockRev> {
        sys::lookup(self.pin(MAP_LB_SOCK_REV).as_fd(), &LbSockRevKey::new(cookie, backend)).expect("lookup")
    }
}

fn count_keys<K: aya::Pod>(map: &std::os::fd::OwnedFd) -> usize {
    let mut count = 0;
    let mut key: Option<K> = None;
    while let Some(next) = sys::next_key::<K>(map.as_fd(), key.as_ref()).expect("walk the map") {
        count += 1;
        key = Some(next);
    }
    count
}

const FAMILIES: [pb::Family; 2] = [pb::Family::Ipv4, pb::Family::Ipv6];

/// Asserts that a TCP probe to `frontend` was answered by a backend with
/// the VIP as its peer (getpeername); the backend's name.
fn answered_through_the_vip(tcp: &ProbeReport, frontend: SocketAddr) -> String {
    assert_eq!(tcp.error(), None, "{frontend}: {tcp:?}");
    assert_eq!(
        tcp.addr("peer"),
        Some(frontend),
        "{frontend}: getpeername shows the VIP"
    );
    let name = tcp.get("reply").expect("a backend answered").to_owned();
    assert!(["b1", "b2"].contains(&name.as_str()), "{frontend}: answered by {name}");
    name
}

/// TCP from a process of the cgroup reaches a backend through the
/// The kernel's monotonic clock in whole seconds (`bpf_ktime_get_ns()`'s).
fn now_s() -> u32 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given, nothing else.
    assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) }, 0);
    ts.tv_sec as u32
}

/// ClusterIP, translated once at connect: getpeername shows the VIP,
/// lb_sock_rev holds the translation, and the per-packet path created no
/// flow. Unconnected UDP: the reply's source is the VIP. A pod address is
/// left alone; the translation goes on while the loader is down (kill -9)
/// and after its restart.
#[tokio::test]
async fn tcp_and_udp_to_a_cluster_ip_are_translated_at_the_socket() {
    let cgroup = cgroup();
    let mut node = ServiceNode::start(&cgroup).await;
    node.upsert_services(pb::Protocol::Tcp, true).await;
    node.upsert_services(pb::Protocol::Udp, true).await;

    for family in FAMILIES {
        let frontend = SocketAddr::new(vip(family), TCP_PORT);
        let tcp = node.probe(Some(&cgroup), Probe::Tcp, frontend);
        let name = answered_through_the_vip(&tcp, frontend);
        let backend = SocketAddr::new(node.backend_addr(&name, family), BACKEND_PORT);
        let cookie = tcp.number("cookie").expect("the socket's cookie") as u64;
        let rev = node
            .sock_rev(cookie, backend)
            .unwrap_or_else(|| panic!("{family:?}: lb_sock_rev holds the socket's backend {backend}"));
        assert_eq!(rev.frontend(), Some(frontend), "{family:?}");
        // Written at connect: left to the LRU, never aged by svc-gc.
        assert_eq!(rev.flags, 0, "{family:?}");
        assert!(now_s().abs_diff(rev.last_used) <= 2, "{family:?}: {rev:?}");

        let frontend = SocketAddr::new(vip(family), UDP_PORT);
        let udp = node.probe(Some(&cgroup), Probe::Udp, frontend);
        assert_eq!(udp.error(), None, "{family:?}: {udp:?}");
        assert_eq!(
            udp.addr("from"),
            Some(frontend),
            "{family:?}: recvfrom shows the VIP as the reply's source"
        );
        let reply = udp.get("reply").expect("a backend answered");
        assert!(
            reply == "b1 hello" || reply == "b2 hello",
            "{family:?}: answered {reply:?}"
        );
        // Written per datagram by sendto: svc-gc ages it by its last use.
        let backend = SocketAddr::new(node.backend_addr(&reply[..2], family), BACKEND_PORT);
        let cookie = udp.number("cookie").expect("the socket's cookie") as u64;
        let rev = node
            .sock_rev(cookie, backend)
            .unwrap_or_else(|| panic!("{family:?}: lb_sock_rev holds the datagram's backend {backend}"));
        assert_eq!(rev.flags, LB_SOCK_REV_F_DATAGRAM, "{family:?}");
        assert!(now_s().abs_diff(rev.last_used) <= 2, "{family:?}: {rev:?}");
    }
    assert_eq!(
        node.per_packet_flows(),
        0,
        "translated at the socket: no per-packet flow entry"
    );
    for family in FAMILIES {
        let direct = SocketAddr::new(node.backend_addr("b1", family), BACKEND_PORT);
        let tcp = node.probe(Some(&cgroup), Probe::Tcp, direct);
        assert_eq!(
            tcp.addr("peer"),
            Some(direct),
            "{family:?}: a pod address is left alone"
        );
        assert_eq!(tcp.get("reply"), Some("b1"), "{family:?}");
    }

    // The pinned links keep translating while the loader is down, and
    // after its restart (adopted, services restored from the pins).
    let frontend = SocketAddr::new(vip(pb::Family::Ipv4), TCP_PORT);
    node.node.loader.kill9();
    let down = node.probe(Some(&cgroup), Probe::Tcp, frontend);
    assert_eq!(down.addr("peer"), Some(frontend), "loader down: {down:?}");
    assert!(down.get("reply").is_some(), "loader down: {down:?}");
    node.node.loader.restart().await.expect("the loader restarts");
    let again = node.probe(Some(&cgroup), Probe::Tcp, frontend);
    assert_eq!(again.addr("peer"), Some(frontend), "after the restart: {again:?}");
    assert!(again.get("reply").is_some(), "after the restart: {again:?}");
    assert_eq!(
        node.per_packet_flows(),
        0,
        "still translated at the socket: no per-packet flow entry"
    );
}

/// The node's own sockets (a process of the cgroup in the node's
/// namespace) reach the ClusterIP's backends too, translated at connect:
/// the node has no per-packet path of its own to a ClusterIP.
#[tokio::test]
async fn the_nodes_own_sockets_are_translated_at_connect() {
    let cgroup = cgroup();
    let node = ServiceNode::start(&cgroup).await;
    node.upsert_services(pb::Protocol::Tcp, true).await;
    for family in FAMILIES {
        let frontend = SocketAddr::new(vip(family), TCP_PORT);
        let tcp = run_probe(&node.node.node.ns, Some(&cgroup), Probe::Tcp, frontend, PROBE_TIMEOUT)
            .expect("the socket probe runs");
        answered_through_the_vip(&tcp, frontend);
    }
}

/// A ClusterIP with no backend: connect() and sendto() fail with
/// ECONNREFUSED at once, no packet sent, each counted as no-service-backend.
#[tokio::test]
async fn a_cluster_ip_without_backends_refuses_at_connect_and_counts_the_drop() {
    let cgroup = cgroup();
    let node = ServiceNode::start(&cgroup).await;
    node.upsert_services(pb::Protocol::Tcp, false).await;
    node.upsert_services(pb::Protocol::Udp, false).await;
    let before = node.node.drops(pb::DropReason::NoServiceBackend).await;
    for family in FAMILIES {
        let tcp = node.probe(Some(&cgroup), Probe::Tcp, SocketAddr::new(vip(family), TCP_PORT));
        assert_eq!(tcp.error(), Some("ECONNREFUSED"), "{family:?}: {tcp:?}");
        let udp = node.probe(Some(&cgroup), Probe::Udp, SocketAddr::new(vip(family), UDP_PORT));
        assert_eq!(udp.error(), Some("ECONNREFUSED"), "{family:?}: {udp:?}");
    }
    assert_eq!(
        node.node.drops(pb::DropReason::NoServiceBackend).await - before,
        4,
        "each refused connect/sendto is counted once"
    );
}

/// A process outside the cgroup reaches the same ClusterIP through the
/// per-packet path (translated in from_container: flow entries), with
/// getpeername showing the VIP there too.
#[tokio::test]
async fn sockets_outside_the_cgroup_take_the_per_packet_path() {
    let cgroup = cgroup();
    let node = ServiceNode::start(&cgroup).await;
    node.upsert_services(pb::Protocol::Tcp, true).await;
    for family in FAMILIES {
        let frontend = SocketAddr::new(vip(family), TCP_PORT);
        answered_through_the_vip(&node.probe(None, Probe::Tcp, frontend), frontend);
    }
    assert!(
        node.per_packet_flows() >= 4,
        "the connections from outside the cgroup were translated per packet (two entries each)"
    );
}
