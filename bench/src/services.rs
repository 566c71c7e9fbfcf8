//! `services` (issue 17 §4): Rivet's eBPF load balancing against kube-proxy's
//! iptables mode ([`crate::kube_proxy`]) in the same topology and the same run.
//!
//! Topology, twice: a node namespace with a client pod (`198.18.0.2`) and
//! backend pods `b1..b3` (`198.18.0.3-5`), each on its veth. Rivet's node is
//! testkit's [`LoaderNode`] (the real svc-loader, the pods as its endpoints,
//! no policy); the peer's is a plain [`TestNode`] whose node namespace holds
//! kube-proxy's rules (no BPF). Service `i` has ClusterIP
//! `198.18.128.0 + i` (port 80; past 32,768 services the port counts up)
//! and `--backends` backends on port 8080; one more service,
//! `198.18.127.1:5201` → b1, carries the throughput runs. Rivet's services go
//! in through svc-loader's LoadBalancerService (ReplaceServices for the
//! bulk, UpsertService for single changes), the path svc-endpoint's catalog
//! pushes through; the peer's through `iptables-restore` (a full sync) and
//! `iptables-restore --noflush` (kube-proxy's partial sync).
//!
//! Figures, each against the peer in the same run:
//! - **connections**: at each of `--counts` services installed, new TCP
//!   connections per second and connect() latency p50/p99 from the client
//!   pod to `--targets` ClusterIPs spread evenly over the installed
//!   services (a service's position in kube-proxy's `KUBE-SERVICES` is its
//!   map order: the spread measures the average one). Each connection
//!   binds the next source port of its ClusterIP's share of 41,000 (a
//!   4-tuple comes back only every 41,000 connections; within a count a
//!   port serves one ClusterIP, and the next count's targets take the
//!   ports on), connects and closes with a reset (no TIME_WAIT).
//!   `--rounds` short rounds per count, the sides back to back with the
//!   order flipping; ratio = median of the per-round connections/s ratios,
//!   printed with their lowest and highest (the spread). Every backend
//!   must have accepted connections in every run (the translation works on
//!   both sides);
//! - **throughput**: one iperf3 stream client → b1 over five paths: Rivet's
//!   ClusterIP (per-packet translation), Rivet's ClusterIP from an iperf3 in
//!   the socket-LB cgroup (translated once at connect), b1's pod IP on
//!   Rivet's node, and iptables' ClusterIP and pod IP. `--throughput-rounds`
//!   rounds each run every path once, in a cycle where each compared pair
//!   is adjacent, started one further and reversed every other round;
//!   ratios (ClusterIP / pod IP on each side, goal ≥ 0.95 for Rivet; socket
//!   LB / pod IP, goal ≥ 1.0; Rivet / iptables ClusterIP) are medians of
//!   per-round ratios with their spread;
//! - **programming**: with the largest count installed, a new service with
//!   `--change-backends` backends (UpsertService until it returns: the
//!   loader answers once the maps hold it) and one backend of such a service
//!   replaced, `--samples` times each, p50/p99 (goal p99 < 1 s), against
//!   kube-proxy's partial sync of the same change (`iptables-restore
//!   --noflush` of `KUBE-SERVICES` and the service's chains). After each
//!   UpsertService the pinned `lb_frontends` and `lb_backends` are read: the
//!   frontend with its backend count and every backend must be there;
//! - **lookup cost**: at each count, and at each of `--lookup-counts`
//!   (100,000) installed on Rivet alone, the kernel's ns per run of the
//!   `from_container` the loader attached to the client's veth
//!   (`BPF_PROG_TEST_RUN` on its real maps) for `--lookup-samples` SYNs of
//!   new flows to the ClusterIPs, interleaved with as many to b1's pod IP
//!   (the same path without a service); medians (flat: the same at every
//!   count); and the service maps' kernel memory (fdinfo `memlock`).
//!
//! ratio = Rivet / iptables connections/s at the largest count (goal ≥ 2
//! at 10,000).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use std::os::fd::AsFd as _;
use std::path::Path;

use aya::programs::ProgramFd;
use ipnet::IpNet;
use rivet_bpf_sys as sys;
use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::testing::netns::{NetNs, TestNode};
use rivet_datapath::maps::{LB_BACKEND_ACTIVE, LbBackend, LbFrontend, LbFrontendKey, SVC_SCOPE_INTERNAL};
use rivet_datapath::spec::{
    CT4, LB4_FLOWS, MAP_LB_BACKENDS, MAP_LB_FRONTENDS, MAP_LB_MAGLEV, MAP_LB_REV_NAT, MAP_LB_SERVICES,
    MAP_LB_SVC_BACKENDS,
};
use rivet_proto::loader::v1 as pb;
use rivet_proto::loader::v1::load_balancer_service_client::LoadBalancerServiceClient;
use rivet_testkit::cgroup::TestCgroup;
use rivet_testkit::frames::{self, ETH_P_IP, TCP_SYN, proto};
use rivet_testkit::loader::{LoaderNode, cluster_ip_service, pod_spec, policy};

use crate::datapath::{iperf, iperf_with, median};
use crate::kube_proxy::{self, ServicePort};
use crate::report::{BenchResult, Spread, load_average, ms, percentile, sibling_binary};

/// The pods of each side: the client, then the backends.
const PODS: [&str; 4] = ["client", "b1", "b2", "b3"];
/// The backends' port.
const BACKEND_PORT: u16 = 8080;
/// The services' port (the first 32,768 services).
const SERVICE_PORT: u16 = 80;
/// ClusterIPs: `198.18.128.0/17`, service `i` at offset `i % 32768`.
const VIP_BASE: Ipv4Addr = Ipv4Addr::new(198, 18, 128, 0);
const VIPS: u32 = 1 << 15;
/// The throughput service: this ClusterIP and port → b1 on the same port.
const IPERF_VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 127, 1);
const IPERF_PORT: u16 = 5201;
/// Its service id at the loader (the others are `1 + i`).
const IPERF_SERVICE_ID: u32 = 1_000_000;
/// The changed services of the programming figures: ids from here.
const CHANGE_SERVICE_ID: u32 = 2_000_000;
/// Their ClusterIPs (`198.18.126.0/24`) and backends (`198.18.64.0/18`,
/// addresses only: nothing connects to them).
const CHANGE_VIP_BASE: Ipv4Addr = Ipv4Addr::new(198, 18, 126, 0);
const CHANGE_BACKEND_BASE: Ipv4Addr = Ipv4Addr::new(198, 18, 64, 0);
/// The pods' cluster CIDR (kube-proxy masquerades what comes from outside).
const CLUSTER_CIDR: &str = "198.18.0.0/16";
/// Services per ReplaceServices message (the proto's advice).
const REPLACE_CHUNK: usize = 1000;
/// How long one connect() may take before the run fails.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Source ports each connection sequence binds: 20000..=60999.
const SOURCE_PORT_BASE: u16 = 20000;
const SOURCE_PORTS: u64 = 41000;

/// `TC_ACT_REDIRECT`: from_container's verdict on a SYN to a local pod.
const TC_ACT_REDIRECT: u32 = 7;
/// The program on the host veth's tc ingress (tcx) of an endpoint.
const FROM_CONTAINER: &str = "from_container";
/// First source port of the lookup frames (below the connections' ports).
const LOOKUP_PORT_BASE: u16 = 1024;

/// Options of the services benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct ServicesArgs {
    /// Services installed for the connection figures, in order (the last is
    /// the headline and the programming figures' background).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 1000, 10000])]
    counts: Vec<u32>,
    /// Backends per service.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=3))]
    backends: u32,
    /// Services the client connects to, spread evenly over those installed.
    #[arg(long, default_value_t = 16)]
    targets: u32,
    /// Seconds per connection run.
    #[arg(long, default_value_t = 1)]
    seconds: u32,
    /// Connection rounds per count (each side once per round, order
    /// flipping): many short runs back to back, so that the machine's load
    /// weighs on both sides of each round's ratio alike.
    #[arg(long, default_value_t = 8)]
    rounds: usize,
    /// Concurrent connecting threads in the client pod.
    #[arg(long, default_value_t = 1)]
    clients: u32,
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 2)]
    iperf_seconds: u32,
    /// Throughput rounds (each path once per round, the order rotating
    /// and flipping: see `round_order`).
    #[arg(long, default_value_t = 10)]
    throughput_rounds: usize,
    /// Backends of the service the programming figures install and change.
    #[arg(long, default_value_t = 100)]
    change_backends: u32,
    /// Samples per programming figure and side.
    #[arg(long, default_value_t = 30)]
    samples: u32,
    /// Services installed (Rivet only) for more lookup-cost figures after
    /// the connection counts.
    #[arg(long, value_delimiter = ',', default_values_t = [100000])]
    lookup_counts: Vec<u32>,
    /// SYNs per lookup-cost figure (each a new flow).
    #[arg(long, default_value_t = 2000)]
    lookup_samples: u32,
    /// Leave out the throughput figures.
    #[arg(long)]
    skip_throughput: bool,
}

/// One service of the benchmark, as both sides install it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Service {
    id: u32,
    name: String,
    frontend: SocketAddr,
    backends: Vec<SocketAddr>,
}

impl Service {
    fn kube_proxy(&self) -> ServicePort {
        ServicePort {
            name: self.name.clone(),
            frontend: self.frontend,
            endpoints: self.backends.clone(),
        }
    }

    fn loader(&self) -> pb::LbService {
        let backends: Vec<_> = self.backends.iter().map(|b| (*b, pb::BackendState::Active)).collect();
        cluster_ip_service(self.id, self.frontend, pb::Protocol::Tcp, &backends)
    }
}

/// Pod `n` (1-based, as [`pod_spec`] numbers them) address.
fn pod_ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, n + 1)
}

fn offset(base: Ipv4Addr, by: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(base) + by)
}

/// Service `i` of the connection figures: backends b1.. on [`BACKEND_PORT`].
fn service(i: u32, backends: u32) -> Service {
    Service {
        id: 1 + i,
        name: format!("bench/s{i}:http"),
        frontend: SocketAddr::new(
            offset(VIP_BASE, i % VIPS).into(),
            SERVICE_PORT + u16::try_from(i / VIPS).expect("fewer than 2^31 services"),
        ),
        backends: (0..backends)
            .map(|b| SocketAddr::new(pod_ip(2 + b as u8).into(), BACKEND_PORT))
            .collect(),
    }
}

/// The throughput service.
fn iperf_service() -> Service {
    Service {
        id: IPERF_SERVICE_ID,
        name: "bench/iperf:iperf".into(),
        frontend: SocketAddr::new(IPERF_VIP.into(), IPERF_PORT),
        backends: vec![SocketAddr::new(pod_ip(2).into(), IPERF_PORT)],
    }
}

/// `count` services and the throughput service.
fn service_set(count: u32, backends: u32) -> Vec<Service> {
    (0..count)
        .map(|i| service(i, backends))
        .chain(std::iter::once(iperf_service()))
        .collect()
}

/// Indices of `targets` services spread evenly over `count` (the middle of
/// each of `targets` equal slices), without repeats.
fn spread(count: u32, targets: u32) -> Vec<u32> {
    let targets = targets.clamp(1, count.max(1));
    let mut picked: Vec<u32> = (0..targets)
        .map(|k| ((2 * u64::from(k) + 1) * u64::from(count) / (2 * u64::from(targets))) as u32)
        .collect();
    picked.dedup();
    picked
}

/// Change sample `k`'s service: `backends` backends from `first` on.
fn change_service(k: u32, first: u32, backends: u32) -> Service {
    Service {
        id: CHANGE_SERVICE_ID + k,
        name: format!("bench/change{k}:http"),
        frontend: SocketAddr::new(offset(CHANGE_VIP_BASE, k % 256).into(), SERVICE_PORT),
        backends: (first..first + backends)
            .map(|b| SocketAddr::new(offset(CHANGE_BACKEND_BASE, b).into(), BACKEND_PORT))
            .collect(),
    }
}

/// A backend's listener that accepts and closes, on a thread of its own,
/// with a deep accept queue: the connection figures measure the path, not
/// how fast a server drains its queue (an overflowing queue drops the
/// handshake's last ACK and costs the client a 1 s SYN retransmission).
struct AcceptSink {
    listener: socket2::Socket,
    accepted: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The accept queue of each backend (the namespace's `net.core.somaxconn`
/// is raised to it).
const ACCEPT_BACKLOG: i32 = 4096;

impl AcceptSink {
    fn start(ns: &NetNs, addr: SocketAddr) -> anyhow::Result<Self> {
        use socket2::{Domain, Protocol, Socket, Type};
        ns.sysctl("net.core.somaxconn", &ACCEPT_BACKLOG.to_string())?;
        let listener = ns.in_ns(move || -> std::io::Result<Socket> {
            let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
            socket.set_reuse_address(true)?;
            socket.bind(&addr.into())?;
            socket.listen(ACCEPT_BACKLOG)?;
            Ok(socket)
        })?;
        let listener = listener.map_err(|e| anyhow::anyhow!("listening on {addr} in {}: {e}", ns.name()))?;
        let accepted = Arc::new(AtomicU64::new(0));
        let thread = {
            let listener = listener.try_clone()?;
            let accepted = Arc::clone(&accepted);
            std::thread::Builder::new().name("accept-sink".into()).spawn(move || {
                // Ends when `Drop` shuts the listener down (EINVAL).
                while listener.accept().is_ok() {
                    accepted.fetch_add(1, Ordering::Relaxed);
                }
            })?
        };
        Ok(Self {
            listener,
            accepted,
            thread: Some(thread),
        })
    }

    fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for AcceptSink {
    fn drop(&mut self) {
        // A listening socket shut down for reading wakes its accept().
        let _ = self.listener.shutdown(std::net::Shutdown::Read);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `TcpExt` counters of the namespace `ns` (`/proc/net/netstat` read from
/// inside it) named in `names`, in that order.
fn tcp_ext_counters(ns: &NetNs, names: &[&str]) -> anyhow::Result<Vec<u64>> {
    let text = ns.run(&["cat", "/proc/net/netstat"])?;
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (Some(header), Some(values)) = (lines.next(), lines.next()) else {
        anyhow::bail!("no TcpExt counters in {}'s /proc/net/netstat", ns.name());
    };
    let counters: std::collections::HashMap<&str, u64> = header
        .split_whitespace()
        .zip(values.split_whitespace())
        .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
        .collect();
    names
        .iter()
        .map(|name| {
            counters
                .get(name)
                .copied()
                .ok_or_else(|| anyhow::anyhow!("no TcpExt {name} in {}", ns.name()))
        })
        .collect()
}

/// One side of the comparison: its backends' accept sinks and the
/// connection sequence it continues.
struct Side {
    name: &'static str,
    sinks: Vec<AcceptSink>,
    next_connection: Arc<AtomicU64>,
}

impl Side {
    fn new(name: &'static str, node: &TestNode, backends: u32) -> anyhow::Result<Self> {
        let sinks = (0..backends)
            .map(|b| {
                let pod = node.pod(PODS[1 + b as usize]);
                AcceptSink::start(&pod.ns, SocketAddr::new(pod_ip(2 + b as u8).into(), BACKEND_PORT))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            name,
            sinks,
            next_connection: Arc::new(AtomicU64::new(0)),
        })
    }

    fn accepted(&self) -> Vec<u64> {
        self.sinks.iter().map(AcceptSink::accepted).collect()
    }
}

/// What one connection run measured.
#[derive(Debug, Clone, Copy, PartialEq)]
struct ConnectRun {
    per_s: f64,
    p50_us: f64,
    p99_us: f64,
    /// SYNs the client sent again (each a connect() that waited ~1 s).
    syn_retransmits: u64,
    /// Handshakes the backends' full accept queues dropped.
    listen_overflows: u64,
}

/// `clients` threads in `client` connecting to `targets` round-robin for
/// `duration`, connection `k` of `sequence` from the next port of its
/// target's share of [`SOURCE_PORTS`] (a source port reaches one ClusterIP
/// only; a 4-tuple comes back every `SOURCE_PORTS` connections), closed
/// with a reset. Fails on any failed connect().
///
/// One port for several ClusterIPs in a row would have two services'
/// flows reach one backend from one client port, which the datapath (as
/// the kernel's NAT) resolves by choosing another port: a correctness
/// matter (svc-loader's `client_ports_reused_across_services_sharing_backends_lose_no_connection`),
/// kept out of this rate measurement within a count. Across counts the
/// ports do come back to other ClusterIPs, closed flows' tuples taken
/// over by new ones.
fn connect_run(
    client: &NetNs,
    client_ip: Ipv4Addr,
    targets: &[SocketAddr],
    duration: Duration,
    clients: u32,
    sequence: &Arc<AtomicU64>,
) -> anyhow::Result<ConnectRun> {
    let started = Instant::now();
    let deadline = started + duration;
    let threads = (0..clients)
        .map(|_| {
            let targets = targets.to_vec();
            let sequence = Arc::clone(sequence);
            client.spawn_in(move || -> anyhow::Result<Vec<f64>> {
                let mut latencies_us = Vec::with_capacity(100_000);
                while Instant::now() < deadline {
                    let k = sequence.fetch_add(1, Ordering::Relaxed);
                    let n = targets.len() as u64;
                    // Target `k % n` from its own share of the ports: a
                    // source port only ever reaches one ClusterIP.
                    let share = SOURCE_PORTS / n;
                    let (target, turn) = (k % n, k / n);
                    let port = SOURCE_PORT_BASE + (target * share + turn % share) as u16;
                    let target = targets[target as usize];
                    latencies_us.push(connect_once(SocketAddr::new(client_ip.into(), port), target)?);
                }
                Ok(latencies_us)
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut latencies_us = Vec::new();
    for thread in threads {
        let joined = thread
            .join()
            .map_err(|_| anyhow::anyhow!("a connecting thread panicked"))?;
        latencies_us.extend(joined?);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(ConnectRun {
        per_s: latencies_us.len() as f64 / elapsed,
        p50_us: percentile(&mut latencies_us, 0.50),
        p99_us: percentile(&mut latencies_us, 0.99),
        syn_retransmits: 0,
        listen_overflows: 0,
    })
}

/// One connection `from` → `to`: µs spent in connect(); closed with a reset.
fn connect_once(from: SocketAddr, to: SocketAddr) -> anyhow::Result<f64> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(to), Type::STREAM, Some(Protocol::TCP))?;
    // Linux bounds a blocking connect() by SO_SNDTIMEO: a lost SYN fails
    // the run instead of waiting out the retries.
    socket.set_write_timeout(Some(CONNECT_TIMEOUT))?;
    socket.set_linger(Some(Duration::ZERO))?;
    socket.set_reuse_address(true)?;
    socket
        .bind(&from.into())
        .map_err(|e| anyhow::anyhow!("binding {from}: {e}"))?;
    let t = Instant::now();
    socket
        .connect(&to.into())
        .map_err(|e| anyhow::anyhow!("connecting {from} -> {to}: {e}"))?;
    Ok(t.elapsed().as_secs_f64() * 1e6)
}

/// The kernel's ns per run of Rivet's `from_container` on the client's
/// veth (the program the loader attached, on its real maps, by
/// `BPF_PROG_TEST_RUN`): a SYN of a new flow to a ClusterIP (`targets`
/// round-robin: the flow map missed, the frontend, table and backend
/// looked up, the flow entries and conntrack created) and, call by call in
/// between, a SYN of a new flow straight to b1's pod IP (the same path
/// without the service). Each call's verdict must be the redirect to the
/// backend. Source ports from `first_port`, two per sample; medians.
fn lookup_cost(node: &TestNode, targets: &[SocketAddr], samples: u32, first_port: u16) -> anyhow::Result<(f64, f64)> {
    let client = node.pod("client");
    let (ifname, ifindex, pod_mac, host_mac) = (
        client.host_ifname.clone(),
        client.host_ifindex,
        client.pod_mac,
        client.host_mac,
    );
    let targets = targets.to_vec();
    let direct = SocketAddr::new(pod_ip(2).into(), BACKEND_PORT);
    // The test run resolves `ifindex` in the calling thread's namespace.
    node.ns.in_ns(move || -> anyhow::Result<(f64, f64)> {
        let program = from_container_on(ifindex)?;
        let (mut via_service, mut via_pod) = (Vec::new(), Vec::new());
        for k in 0..samples {
            let port = first_port + 2 * u16::try_from(k)?;
            for (to, sport, out) in [
                (targets[k as usize % targets.len()], port, &mut via_service),
                (direct, port + 1, &mut via_pod),
            ] {
                let segment = frames::tcp(pod_ip(1).into(), to.ip(), sport, to.port(), TCP_SYN);
                let IpAddr::V4(dst) = to.ip() else {
                    anyhow::bail!("{to} is not IPv4");
                };
                let packet = frames::ipv4(pod_ip(1), dst, proto::TCP, 64, 1, None, &segment);
                let frame = frames::ethernet(host_mac, pod_mac, ETH_P_IP, &packet);
                let run = sys::test_run_classifier_repeat(program.as_fd(), &frame, ifindex, 1)?;
                anyhow::ensure!(
                    run.retval == TC_ACT_REDIRECT,
                    "{FROM_CONTAINER} on {ifname} returned {} for a SYN to {to}, not the redirect to the backend",
                    run.retval
                );
                out.push(f64::from(run.duration_ns));
            }
        }
        Ok((median(via_service), median(via_pod)))
    })?
}

/// The `from_container` program the loader attached (its `cls_bpf` filter on
/// clsact ingress, named `rivet-<node>-from_container`) to `ifindex` in the calling thread's namespace.
fn from_container_on(ifindex: u32) -> anyhow::Result<ProgramFd> {
    let filters = svc_loader::tc::bpf_filters(ifindex, svc_loader::tc::Direction::Ingress)
        .map_err(|e| anyhow::anyhow!("listing the tc ingress filters of ifindex {ifindex}: {e}"))?;
    let filter = filters
        .iter()
        .find(|f| {
            f.priority == svc_loader::tc::FILTER_PRIORITY
                && f.handle == svc_loader::tc::FILTER_HANDLE
                && f.name.ends_with(FROM_CONTAINER)
        })
        .ok_or_else(|| anyhow::anyhow!("no {FROM_CONTAINER} filter on ifindex {ifindex}: {filters:?}"))?;
    for program in aya::programs::loaded_programs() {
        let program = program?;
        if program.id() == filter.prog_id {
            return Ok(program.fd()?);
        }
    }
    anyhow::bail!("program {} of the {FROM_CONTAINER} filter is gone", filter.prog_id)
}

/// The service maps' kernel memory under `pins` (their fdinfo `memlock`:
/// the preallocated ones in full, the others as filled now), bytes.
fn service_maps_memory(pins: &Path) -> anyhow::Result<u64> {
    [
        MAP_LB_FRONTENDS,
        MAP_LB_BACKENDS,
        MAP_LB_MAGLEV,
        MAP_LB_REV_NAT,
        MAP_LB_SERVICES,
        MAP_LB_SVC_BACKENDS,
    ]
    .iter()
    .map(|map| Ok(rivet_testkit::scale::pinned_map_memory(&pins.join(map))?))
    .sum()
}

/// Whether the pinned `lb_frontends` under `pins` holds `service`'s
/// ClusterIP with its backend count, and `lb_backends` each of its backends.
fn programmed(pins: &Path, service: &Service) -> anyhow::Result<bool> {
    let frontends = sys::obj_get(&pins.join(MAP_LB_FRONTENDS))?;
    let key = LbFrontendKey::vip(service.frontend, proto::TCP, SVC_SCOPE_INTERNAL);
    let Some(frontend) = sys::lookup::<_, LbFrontend>(frontends.as_fd(), &key)? else {
        return Ok(false);
    };
    if usize::from(frontend.backend_count) != service.backends.len() {
        return Ok(false);
    }
    let backends = sys::obj_get(&pins.join(MAP_LB_BACKENDS))?;
    let mut missing: Vec<LbBackend> = service
        .backends
        .iter()
        .map(|b| LbBackend::new(*b, LB_BACKEND_ACTIVE))
        .collect();
    let mut key: Option<u32> = None;
    while let Some(id) = sys::next_key(backends.as_fd(), key.as_ref())? {
        if let Some(backend) = sys::lookup::<_, LbBackend>(backends.as_fd(), &id)? {
            missing.retain(|m| (m.addr, m.port, m.family) != (backend.addr, backend.port, backend.family));
        }
        key = Some(id);
    }
    Ok(missing.is_empty())
}

/// The Rivet side: svc-loader in a node namespace with the pods as its
/// endpoints (no policy), and its LoadBalancerService.
struct Rivet {
    node: LoaderNode,
    lb: LoadBalancerServiceClient<DaemonChannel>,
    /// The cgroup svc-loader attached socket-level load balancing to
    /// (`--socket-lb-cgroup`); only the socket-LB throughput runs join it.
    /// Declared after `node`: removed once the loader is gone.
    socket_lb: TestCgroup,
}

impl Rivet {
    /// svc-loader with room for `services` services (and the benchmark's
    /// own few more).
    async fn start(services: u32) -> anyhow::Result<Self> {
        let room = (services + 1024).to_string();
        let socket_lb = TestCgroup::new().map_err(|e| anyhow::anyhow!("a cgroup v2 directory for socket LB: {e}"))?;
        let cgroup = socket_lb
            .path()
            .to_str()
            .ok_or_else(|| anyhow::anyhow!("a cgroup path that is not UTF-8"))?;
        // Conntrack and flow maps of a real node's size (the test node's
        // 65,536 fill within seconds of new connections, and a full LRU map
        // evicts flows mid-handshake).
        let (ct_max, flows_max) = (
            CT4.default_max_entries.to_string(),
            LB4_FLOWS.default_max_entries.to_string(),
        );
        let node = LoaderNode::start(
            &sibling_binary("svc-loader")?,
            &PODS,
            &[
                "--lb-services-max",
                &room,
                "--socket-lb-cgroup",
                cgroup,
                "--ct-max",
                &ct_max,
                "--lb-flows-max",
                &flows_max,
            ],
        )
        .await?;
        let mut client = node.client().await;
        for (i, pod) in PODS.iter().enumerate() {
            let id = i as u32 + 1;
            client
                .apply_endpoint(node.endpoint(pod, id, 1000 + id, policy(1, false, false, Vec::new())))
                .await?;
        }
        // A bulk ReplaceServices of 100,000 services outlasts the default deadline.
        let options = ClientOptions {
            request_timeout: Duration::from_secs(600),
            ..ClientOptions::default()
        };
        let lb = LoadBalancerServiceClient::new(connect_unix(node.loader.socket(), &options).await?);
        Ok(Self { node, lb, socket_lb })
    }

    /// Replaces the loader's services with `services`; the wall time.
    async fn replace(&mut self, services: &[Service]) -> anyhow::Result<Duration> {
        let chunks: Vec<pb::ReplaceServicesRequest> = services
            .chunks(REPLACE_CHUNK)
            .map(|chunk| pb::ReplaceServicesRequest {
                services: chunk.iter().map(Service::loader).collect(),
            })
            .collect();
        let started = Instant::now();
        self.lb.replace_services(futures::stream::iter(chunks)).await?;
        Ok(started.elapsed())
    }

    /// UpsertService of `service`; the wall time.
    async fn upsert(&mut self, service: &Service) -> anyhow::Result<Duration> {
        let started = Instant::now();
        self.lb
            .upsert_service(pb::UpsertServiceRequest {
                service: Some(service.loader()),
            })
            .await?;
        Ok(started.elapsed())
    }

    async fn delete(&mut self, id: u32) -> anyhow::Result<()> {
        self.lb
            .delete_service(pb::DeleteServiceRequest { service_id: id })
            .await?;
        Ok(())
    }
}

/// The peer: the same pods on a plain node whose namespace holds
/// kube-proxy's rules.
struct Peer {
    node: TestNode,
    cidr: IpNet,
}

impl Peer {
    fn start() -> anyhow::Result<Self> {
        let mut node = TestNode::with_host_prefix("rbsv")?;
        for (i, pod) in PODS.iter().enumerate() {
            node.add_pod(pod_spec(pod, i as u8 + 1).static_gateway_neighbor(true))?;
        }
        Ok(Self {
            node,
            cidr: CLUSTER_CIDR.parse()?,
        })
    }

    /// A full sync of `services`; the wall time of `iptables-restore`.
    fn replace(&self, services: &[Service]) -> anyhow::Result<Duration> {
        let ports: Vec<ServicePort> = services.iter().map(Service::kube_proxy).collect();
        let input = kube_proxy::restore_input(self.cidr, &ports);
        let started = Instant::now();
        kube_proxy::restore(&self.node.ns, true, &input)?;
        Ok(started.elapsed())
    }
}

/// A count's connection rounds summarised.
#[derive(Debug, Clone, Copy, PartialEq)]
struct CountFigures {
    count: u32,
    rivet: ConnectRun,
    peer: ConnectRun,
    /// Rivet / iptables connections/s, over the rounds.
    ratio: Spread,
    rivet_install: Duration,
    peer_install: Duration,
    /// from_container ns per SYN to a ClusterIP, and to a pod IP.
    lookup_ns: f64,
    lookup_pod_ns: f64,
    /// The service maps' kernel memory, bytes.
    maps_memory: u64,
}

/// Medians of the rounds' figures; the retransmissions and overflows of
/// all of them.
fn summarise(runs: &[ConnectRun]) -> ConnectRun {
    let of = |f: fn(&ConnectRun) -> f64| median(runs.iter().map(f).collect());
    ConnectRun {
        per_s: of(|r| r.per_s),
        p50_us: of(|r| r.p50_us),
        p99_us: of(|r| r.p99_us),
        syn_retransmits: runs.iter().map(|r| r.syn_retransmits).sum(),
        listen_overflows: runs.iter().map(|r| r.listen_overflows).sum(),
    }
}

/// One connection run of `side`, checking that every backend took some.
fn side_run(side: &Side, node: &TestNode, targets: &[SocketAddr], args: &ServicesArgs) -> anyhow::Result<ConnectRun> {
    let client = &node.pod("client").ns;
    let backends: Vec<&NetNs> = (0..side.sinks.len()).map(|b| &node.pod(PODS[1 + b]).ns).collect();
    let overflows = || -> anyhow::Result<u64> {
        backends
            .iter()
            .map(|ns| Ok(tcp_ext_counters(ns, &["ListenOverflows"])?[0]))
            .sum()
    };
    let (retransmits_before, overflows_before) = (tcp_ext_counters(client, &["TCPSynRetrans"])?[0], overflows()?);
    let before = side.accepted();
    let client_ip = pod_ip(1);
    let mut run = connect_run(
        client,
        client_ip,
        targets,
        Duration::from_secs(args.seconds.into()),
        args.clients,
        &side.next_connection,
    )?;
    let after = side.accepted();
    anyhow::ensure!(
        before.iter().zip(&after).all(|(b, a)| a > b),
        "{}: a backend accepted no connection in the run (accepted before {before:?}, after {after:?})",
        side.name
    );
    run.syn_retransmits = tcp_ext_counters(client, &["TCPSynRetrans"])?[0] - retransmits_before;
    run.listen_overflows = overflows()? - overflows_before;
    Ok(run)
}

/// Programming figures of one side: p50 and p99 ms of each kind.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Programming {
    new_p50_ms: f64,
    new_p99_ms: f64,
    change_p50_ms: f64,
    change_p99_ms: f64,
}

impl Programming {
    fn of(mut new: Vec<f64>, mut change: Vec<f64>) -> Self {
        Self {
            new_p50_ms: percentile(&mut new, 0.50),
            new_p99_ms: percentile(&mut new, 0.99),
            change_p50_ms: percentile(&mut change, 0.50),
            change_p99_ms: percentile(&mut change, 0.99),
        }
    }
}

/// Rivet's programming: `samples` new services of `backends` backends
/// (each deleted after), then `samples` changes of one backend of one such
/// service.
async fn rivet_programming(rivet: &mut Rivet, args: &ServicesArgs) -> anyhow::Result<Programming> {
    let mut new = Vec::new();
    let pins = rivet.node.pins.0.clone();
    let check = |service: &Service| -> anyhow::Result<()> {
        anyhow::ensure!(
            programmed(&pins, service)?,
            "UpsertService of {} returned before the pinned maps held its frontend and backends",
            service.name
        );
        Ok(())
    };
    for k in 0..args.samples {
        let service = change_service(k, 0, args.change_backends);
        new.push(ms(rivet.upsert(&service).await?));
        check(&service)?;
        rivet.delete(service.id).await?;
    }
    let mut change = Vec::new();
    rivet.upsert(&change_service(0, 0, args.change_backends)).await?;
    for k in 1..=args.samples {
        // Backend `k - 1` leaves, backend `k - 1 + n` joins.
        let service = change_service(0, k, args.change_backends);
        change.push(ms(rivet.upsert(&service).await?));
        check(&service)?;
    }
    rivet.delete(CHANGE_SERVICE_ID).await?;
    Ok(Programming::of(new, change))
}

/// The peer's programming: kube-proxy's partial sync of the same changes
/// with `installed` in its tables.
fn peer_programming(peer: &Peer, installed: &[Service], args: &ServicesArgs) -> anyhow::Result<Programming> {
    let mut ports: Vec<ServicePort> = installed.iter().map(Service::kube_proxy).collect();
    let mut new = Vec::new();
    for k in 0..args.samples {
        let added = change_service(k, 0, args.change_backends).kube_proxy();
        ports.push(added.clone());
        let input = kube_proxy::partial_sync_input(peer.cidr, &ports, &added, &[]);
        let started = Instant::now();
        kube_proxy::restore_noflush(&peer.node.ns, true, &input)?;
        new.push(ms(started.elapsed()));
        ports.pop();
    }
    // Back to `installed` (the added chains go with a full sync).
    peer.replace(installed)?;
    let mut change = Vec::new();
    let first = change_service(0, 0, args.change_backends).kube_proxy();
    ports.push(first.clone());
    let mut previous = first;
    kube_proxy::restore(&peer.node.ns, true, &kube_proxy::restore_input(peer.cidr, &ports))?;
    for k in 1..=args.samples {
        let changed = change_service(0, k, args.change_backends).kube_proxy();
        *ports.last_mut().expect("pushed above") = changed.clone();
        let input = kube_proxy::partial_sync_input(peer.cidr, &ports, &changed, &previous.endpoints);
        let started = Instant::now();
        kube_proxy::restore_noflush(&peer.node.ns, true, &input)?;
        change.push(ms(started.elapsed()));
        previous = changed;
    }
    peer.replace(installed)?;
    Ok(Programming::of(new, change))
}

/// The routes of the throughput figures: iperf3 client → b1 on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// Rivet: through the ClusterIP from an iperf3 in the socket-LB cgroup
    /// (translated once at connect).
    RivetSocketLb,
    /// Rivet: to b1's pod IP.
    RivetPod,
    /// Rivet: through the ClusterIP (translated per packet).
    RivetClusterIp,
    /// iptables: through the ClusterIP (kube-proxy's DNAT).
    IptablesClusterIp,
    /// iptables: to b1's pod IP.
    IptablesPod,
}

/// The routes in a cycle in which each compared pair is adjacent (socket LB
/// and Rivet's pod IP, Rivet's ClusterIP and pod IP, the two ClusterIPs,
/// iptables' ClusterIP and pod IP); `route as usize` is its index here.
const ROUTES: [Route; 5] = [
    Route::RivetSocketLb,
    Route::RivetPod,
    Route::RivetClusterIp,
    Route::IptablesClusterIp,
    Route::IptablesPod,
];

/// Round `round`'s order of the routes: [`ROUTES`] started one further every
/// two rounds and walked backwards every other round, so that each route
/// runs in every position and before and after each neighbour alike.
fn round_order(round: usize) -> [Route; 5] {
    let n = ROUTES.len();
    std::array::from_fn(|i| {
        let step = if round.is_multiple_of(2) { i } else { n - i };
        ROUTES[(round / 2 + step) % n]
    })
}

/// The throughput figures: per route the median Gbit/s, per compared pair
/// the median of the per-round ratios with their spread.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Throughput {
    gbit_per_s: [f64; 5],
    /// Rivet's ClusterIP / Rivet's pod IP.
    cluster_ip: Spread,
    /// Socket LB / Rivet's pod IP.
    socket_lb: Spread,
    /// iptables' ClusterIP / iptables' pod IP.
    iptables: Spread,
    /// Rivet's ClusterIP / iptables' ClusterIP.
    over_iptables: Spread,
}

impl Throughput {
    /// Summarises rounds of bits/s indexed by [`ROUTES`]' order.
    fn of(rounds: &[[f64; 5]]) -> Self {
        let ratio =
            |num: Route, den: Route| Spread::of(rounds.iter().map(|r| r[num as usize] / r[den as usize]).collect());
        Self {
            gbit_per_s: std::array::from_fn(|i| median(rounds.iter().map(|r| r[i] / 1e9).collect())),
            cluster_ip: ratio(Route::RivetClusterIp, Route::RivetPod),
            socket_lb: ratio(Route::RivetSocketLb, Route::RivetPod),
            iptables: ratio(Route::IptablesClusterIp, Route::IptablesPod),
            over_iptables: ratio(Route::RivetClusterIp, Route::IptablesClusterIp),
        }
    }

    fn gbit_per_s(&self, route: Route) -> f64 {
        self.gbit_per_s[route as usize]
    }
}

/// The client's and b1's namespaces on `node`.
fn client_and_b1(node: &TestNode) -> (&NetNs, &NetNs) {
    (&node.pod("client").ns, &node.pod("b1").ns)
}

/// `--throughput-rounds` rounds of one iperf3 stream client → b1 over each
/// [`Route`], in [`round_order`]: the runs of a compared pair are seconds
/// apart, so the machine's load drifting moves both alike.
fn throughput(rivet: &Rivet, peer: &TestNode, args: &ServicesArgs) -> anyhow::Result<Throughput> {
    let (ours, theirs) = (client_and_b1(&rivet.node.node), client_and_b1(peer));
    let (vip, pod) = (IpAddr::V4(IPERF_VIP), IpAddr::V4(pod_ip(2)));
    let seconds = args.iperf_seconds;
    let mut rounds = Vec::with_capacity(args.throughput_rounds);
    for round in 0..args.throughput_rounds {
        let mut bps = [f64::NAN; 5];
        for route in round_order(round) {
            let run = match route {
                Route::RivetSocketLb => iperf_with(ours.0, ours.1, vip, seconds, |command| {
                    rivet.socket_lb.join_on_exec(command)
                })?,
                Route::RivetPod => iperf(ours.0, ours.1, pod, seconds)?,
                Route::RivetClusterIp => iperf(ours.0, ours.1, vip, seconds)?,
                Route::IptablesClusterIp => iperf(theirs.0, theirs.1, vip, seconds)?,
                Route::IptablesPod => iperf(theirs.0, theirs.1, pod, seconds)?,
            };
            bps[route as usize] = run;
        }
        println!(
            "throughput round {round} (Gbit/s): {}",
            ROUTES
                .iter()
                .zip(bps)
                .map(|(p, b)| format!("{p:?} {:.2}", b / 1e9))
                .collect::<Vec<_>>()
                .join(", ")
        );
        rounds.push(bps);
    }
    Ok(Throughput::of(&rounds))
}

const MIB: f64 = 1024.0 * 1024.0;

/// The first source port of lookup step `step`'s frames: every step's
/// flows are new.
fn lookup_ports(step: u16, args: &ServicesArgs) -> u16 {
    LOOKUP_PORT_BASE + step * 2 * args.lookup_samples as u16
}

/// The ClusterIPs the client connects to: `--targets` of the first `count`
/// services of `set`, spread evenly.
fn targets_of(set: &[Service], count: u32, args: &ServicesArgs) -> Vec<SocketAddr> {
    spread(count, args.targets)
        .into_iter()
        .map(|i| set[i as usize].frontend)
        .collect()
}

/// Lookup step `step`'s [`lookup_cost`] on `node` (its own source ports).
fn lookup_step(
    node: &TestNode,
    targets: &[SocketAddr],
    step: usize,
    args: &ServicesArgs,
) -> anyhow::Result<(f64, f64)> {
    let first_port = lookup_ports(u16::try_from(step)?, args);
    tokio::task::block_in_place(|| lookup_cost(node, targets, args.lookup_samples, first_port))
}

/// Runs the benchmark.
pub async fn run(args: &ServicesArgs) -> anyhow::Result<BenchResult> {
    anyhow::ensure!(
        !args.counts.is_empty() && args.rounds > 0 && args.seconds > 0 && args.clients > 0 && args.samples > 0,
        "--counts, --rounds, --seconds, --clients and --samples must be non-empty / > 0"
    );
    anyhow::ensure!(
        args.counts
            .iter()
            .chain(&args.lookup_counts)
            .all(|&c| c > 0 && c <= 60 * VIPS),
        "--counts and --lookup-counts must be 1..={}",
        60 * VIPS
    );
    let steps = args.counts.len() + args.lookup_counts.len();
    anyhow::ensure!(
        u64::from(LOOKUP_PORT_BASE) + 2 * steps as u64 * u64::from(args.lookup_samples) <= u64::from(SOURCE_PORT_BASE),
        "--lookup-samples {} for {steps} counts needs more source ports than the {} below the connections' ones",
        args.lookup_samples,
        SOURCE_PORT_BASE - LOOKUP_PORT_BASE
    );
    let load_before = load_average()?;
    let most = args
        .counts
        .iter()
        .chain(&args.lookup_counts)
        .copied()
        .max()
        .unwrap_or(0);
    let mut rivet = Rivet::start(most).await?;
    let peer = Peer::start()?;
    let rivet_side = Side::new("rivet", &rivet.node.node, args.backends)?;
    let peer_side = Side::new("iptables", &peer.node, args.backends)?;
    let mut metrics = Vec::new();

    let mut figures = Vec::new();
    let mut installed = Vec::new();
    for &count in &args.counts {
        installed = service_set(count, args.backends);
        let rivet_install = rivet.replace(&installed).await?;
        let maps_memory = service_maps_memory(&rivet.node.pins.0)?;
        let peer_install = peer.replace(&installed)?;
        let targets = targets_of(&installed, count, args);
        // Fresh source ports for every count: the same sequence on both sides.
        rivet_side.next_connection.store(0, Ordering::Relaxed);
        peer_side.next_connection.store(0, Ordering::Relaxed);
        let rounds = tokio::task::block_in_place(|| -> anyhow::Result<Vec<(ConnectRun, ConnectRun)>> {
            let mut rounds = Vec::with_capacity(args.rounds);
            for round in 0..args.rounds {
                let ours = || side_run(&rivet_side, &rivet.node.node, &targets, args);
                let theirs = || side_run(&peer_side, &peer.node, &targets, args);
                let (r, p) = if round % 2 == 0 {
                    let r = ours()?;
                    (r, theirs()?)
                } else {
                    let p = theirs()?;
                    (ours()?, p)
                };
                println!(
                    "{count} services, round {round}: rivet {:.0} conn/s (p50 {:.1} us, p99 {:.1} us, {} SYN \
                     retransmits); iptables {:.0} conn/s (p50 {:.1} us, p99 {:.1} us, {} SYN retransmits)",
                    r.per_s, r.p50_us, r.p99_us, r.syn_retransmits, p.per_s, p.p50_us, p.p99_us, p.syn_retransmits
                );
                rounds.push((r, p));
            }
            Ok(rounds)
        })?;
        let (lookup_ns, lookup_pod_ns) = lookup_step(&rivet.node.node, &targets, figures.len(), args)?;
        let ours: Vec<ConnectRun> = rounds.iter().map(|r| r.0).collect();
        let theirs: Vec<ConnectRun> = rounds.iter().map(|r| r.1).collect();
        figures.push(CountFigures {
            count,
            rivet: summarise(&ours),
            peer: summarise(&theirs),
            ratio: Spread::of(rounds.iter().map(|(r, p)| r.per_s / p.per_s).collect()),
            rivet_install,
            peer_install,
            lookup_ns,
            lookup_pod_ns,
            maps_memory,
        });
    }

    println!(
        "{:>8} | {:>10} {:>8} {:>8} | {:>10} {:>8} {:>8} | {:>19} | {:>11} {:>11} | {:>9} {:>9} {:>9}",
        "services",
        "rivet c/s",
        "p50 us",
        "p99 us",
        "iptab c/s",
        "p50 us",
        "p99 us",
        "ratio (min-max)",
        "rivet ms",
        "restore ms",
        "lookup ns",
        "pod ns",
        "maps MiB"
    );
    for f in &figures {
        println!(
            "{:>8} | {:>10.0} {:>8.1} {:>8.1} | {:>10.0} {:>8.1} {:>8.1} | {:>19} | {:>11.1} {:>11.1} | {:>9.0} {:>9.0} {:>9.1}",
            f.count,
            f.rivet.per_s,
            f.rivet.p50_us,
            f.rivet.p99_us,
            f.peer.per_s,
            f.peer.p50_us,
            f.peer.p99_us,
            f.ratio.to_string(),
            ms(f.rivet_install),
            ms(f.peer_install),
            f.lookup_ns,
            f.lookup_pod_ns,
            f.maps_memory as f64 / MIB
        );
        let n = f.count;
        metrics.push((format!("rivet_{n}_conn_per_s"), f.rivet.per_s));
        metrics.push((format!("rivet_{n}_connect_p50_us"), f.rivet.p50_us));
        metrics.push((format!("rivet_{n}_connect_p99_us"), f.rivet.p99_us));
        metrics.push((format!("iptables_{n}_conn_per_s"), f.peer.per_s));
        metrics.push((format!("iptables_{n}_connect_p50_us"), f.peer.p50_us));
        metrics.push((format!("iptables_{n}_connect_p99_us"), f.peer.p99_us));
        push_spread(&mut metrics, &format!("conn_ratio_{n}"), f.ratio);
        metrics.push((format!("rivet_{n}_syn_retransmits"), f.rivet.syn_retransmits as f64));
        metrics.push((format!("iptables_{n}_syn_retransmits"), f.peer.syn_retransmits as f64));
        let overflows = f.rivet.listen_overflows + f.peer.listen_overflows;
        if overflows > 0 {
            println!(
                "note: at {n} services the backends' accept queues overflowed {overflows} times (a starved \
                 accept thread: those connections waited for a SYN retransmission)"
            );
        }
        metrics.push((format!("rivet_{n}_install_ms"), ms(f.rivet_install)));
        metrics.push((format!("iptables_{n}_restore_ms"), ms(f.peer_install)));
        metrics.push((format!("rivet_{n}_lookup_ns"), f.lookup_ns));
        metrics.push((format!("rivet_{n}_pod_ip_syn_ns"), f.lookup_pod_ns));
        metrics.push((format!("rivet_{n}_maps_mib"), f.maps_memory as f64 / MIB));
    }
    let (first, last) = (figures[0], figures[figures.len() - 1]);
    let flatness = last.rivet.per_s / first.rivet.per_s;
    metrics.push(("rivet_conn_per_s_last_over_first".into(), flatness));
    println!(
        "rivet conn/s at {} services = {flatness:.2}x at {} (flat: ~1); at {}: {} iptables (goal >= 2)",
        last.count, first.count, last.count, last.ratio
    );

    if !args.skip_throughput {
        let t = tokio::task::block_in_place(|| throughput(&rivet, &peer.node, args))?;
        println!(
            "throughput ({} interleaved rounds; ratios: median of the rounds' (min-max)): rivet ClusterIP {:.2} Gbit/s \
             vs pod IP {:.2} = {} (goal >= 0.95); socket LB {:.2} = {} pod IP (goal >= 1.0); iptables ClusterIP {:.2} \
             vs pod IP {:.2} = {}; rivet ClusterIP = {} iptables ClusterIP",
            args.throughput_rounds,
            t.gbit_per_s(Route::RivetClusterIp),
            t.gbit_per_s(Route::RivetPod),
            t.cluster_ip,
            t.gbit_per_s(Route::RivetSocketLb),
            t.socket_lb,
            t.gbit_per_s(Route::IptablesClusterIp),
            t.gbit_per_s(Route::IptablesPod),
            t.iptables,
            t.over_iptables,
        );
        for (name, route) in [
            ("rivet_clusterip", Route::RivetClusterIp),
            ("rivet_pod_ip", Route::RivetPod),
            ("rivet_socket_lb", Route::RivetSocketLb),
            ("iptables_clusterip", Route::IptablesClusterIp),
            ("iptables_pod_ip", Route::IptablesPod),
        ] {
            metrics.push((format!("{name}_gbit_per_s"), t.gbit_per_s(route)));
        }
        for (name, spread) in [
            ("rivet_clusterip_over_pod_ip", t.cluster_ip),
            ("rivet_socket_lb_over_pod_ip", t.socket_lb),
            ("iptables_clusterip_over_pod_ip", t.iptables),
            ("rivet_clusterip_over_iptables_clusterip", t.over_iptables),
        ] {
            push_spread(&mut metrics, name, spread);
        }
    }

    let ours = rivet_programming(&mut rivet, args).await?;
    let theirs = tokio::task::block_in_place(|| peer_programming(&peer, &installed, args))?;
    println!(
        "programming with {} services: a service of {} backends: rivet p50 {:.2} ms p99 {:.2} ms, iptables p50 {:.1} \
         ms p99 {:.1} ms; one backend changed: rivet p50 {:.2} ms p99 {:.2} ms, iptables p50 {:.1} ms p99 {:.1} ms \
         (goal p99 < 1000 ms)",
        last.count,
        args.change_backends,
        ours.new_p50_ms,
        ours.new_p99_ms,
        theirs.new_p50_ms,
        theirs.new_p99_ms,
        ours.change_p50_ms,
        ours.change_p99_ms,
        theirs.change_p50_ms,
        theirs.change_p99_ms
    );
    for (side, p) in [("rivet", ours), ("iptables", theirs)] {
        metrics.push((format!("{side}_new_service_p50_ms"), p.new_p50_ms));
        metrics.push((format!("{side}_new_service_p99_ms"), p.new_p99_ms));
        metrics.push((format!("{side}_backend_change_p50_ms"), p.change_p50_ms));
        metrics.push((format!("{side}_backend_change_p99_ms"), p.change_p99_ms));
    }
    drop(peer_side);
    drop(peer);
    let mut lookups = vec![(first.count, first.lookup_ns)];
    for (i, &count) in args.lookup_counts.iter().enumerate() {
        let set = service_set(count, args.backends);
        let install = rivet.replace(&set).await?;
        let memory = service_maps_memory(&rivet.node.pins.0)? as f64 / MIB;
        let targets = targets_of(&set, count, args);
        let (ns, pod_ns) = lookup_step(&rivet.node.node, &targets, args.counts.len() + i, args)?;
        println!(
            "{count} services (Rivet only): installed in {:.0} ms, service maps {memory:.1} MiB; from_container \
             {ns:.0} ns per SYN to a ClusterIP, {pod_ns:.0} ns to a pod IP",
            ms(install)
        );
        metrics.push((format!("rivet_{count}_maps_mib"), memory));
        metrics.push((format!("rivet_{count}_install_ms"), ms(install)));
        metrics.push((format!("rivet_{count}_lookup_ns"), ns));
        metrics.push((format!("rivet_{count}_pod_ip_syn_ns"), pod_ns));
        lookups.push((count, ns));
    }
    let (most, most_ns) = lookups.iter().copied().max_by_key(|l| l.0).expect("one count at least");
    let lookup_flatness = most_ns / first.lookup_ns;
    println!(
        "lookup cost at {most} services = {lookup_flatness:.2}x at {} (flat: ~1)",
        first.count
    );
    metrics.push(("rivet_lookup_ns_most_over_first".into(), lookup_flatness));
    metrics.push(("load_average_1m_before".into(), load_before));
    metrics.push(("load_average_1m_after".into(), load_average()?));
    Ok(BenchResult {
        name: "services".into(),
        metrics,
        ratio: last.ratio.median,
    })
}

/// `<name>` (the median), `<name>_min` and `<name>_max`.
fn push_spread(metrics: &mut Vec<(String, f64)>, name: &str, spread: Spread) {
    metrics.push((name.to_owned(), spread.median));
    metrics.push((format!("{name}_min"), spread.min));
    metrics.push((format!("{name}_max"), spread.max));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_spread_over_the_installed_services() {
        assert_eq!(spread(1, 16), [0]);
        assert_eq!(spread(10_000, 4), [1250, 3750, 6250, 8750]);
        assert_eq!(spread(3, 16), [0, 1, 2]);
    }

    #[test]
    fn service_addresses_stay_unique_past_the_vip_range() {
        let a = service(5, 3);
        let b = service(5 + VIPS, 3);
        assert_eq!(a.frontend.ip(), b.frontend.ip());
        assert_ne!(a.frontend, b.frontend);
        assert_eq!(a.frontend, "198.18.128.5:80".parse().unwrap());
        assert_eq!(a.backends[2], "198.18.0.5:8080".parse().unwrap());
        let set = service_set(3, 2);
        assert_eq!(set.len(), 4);
        assert_eq!(set[3], iperf_service());
    }

    #[test]
    fn every_round_runs_each_route_once_and_compared_pairs_side_by_side() {
        for (i, route) in ROUTES.iter().enumerate() {
            assert_eq!(*route as usize, i, "ROUTES is in declaration order");
        }
        let pairs = [
            (Route::RivetSocketLb, Route::RivetPod),
            (Route::RivetClusterIp, Route::RivetPod),
            (Route::IptablesClusterIp, Route::IptablesPod),
            (Route::RivetClusterIp, Route::IptablesClusterIp),
        ];
        let mut in_position = [[0; 5]; 5];
        for round in 0..10 {
            let order = round_order(round);
            let at = |p: Route| order.iter().position(|o| *o == p).unwrap();
            for route in ROUTES {
                in_position[route as usize][at(route)] += 1;
            }
            // At most one pair is split by the cycle's wrap.
            let apart = pairs.iter().filter(|(a, b)| at(*a).abs_diff(at(*b)) != 1).count();
            assert!(apart <= 1, "round {round}: {order:?}");
        }
        // Ten rounds: every route twice in every position.
        assert_eq!(in_position, [[2; 5]; 5]);
        // Each pair's order flips: socket LB before the pod IP in half the rounds.
        let before = (0..10)
            .filter(|&r| {
                let order = round_order(r);
                let at = |p: Route| order.iter().position(|o| *o == p).unwrap();
                at(Route::RivetSocketLb) < at(Route::RivetPod)
            })
            .count();
        assert_eq!(before, 5);
    }

    #[test]
    fn throughput_ratios_are_per_round() {
        // Round 1 ran on a slower machine: the per-round ratios stay 1.0.
        let rounds = [[2e9, 2e9, 1.9e9, 1e9, 1e9], [1e9, 1e9, 0.95e9, 0.5e9, 0.5e9]];
        let t = Throughput::of(&rounds);
        assert_eq!(t.socket_lb.median, 1.0);
        assert_eq!((t.cluster_ip.min, t.cluster_ip.max), (0.95, 0.95));
        assert_eq!(t.iptables.median, 1.0);
        assert_eq!(t.over_iptables.median, 1.9);
        assert_eq!(t.gbit_per_s(Route::RivetPod), 1.5);
    }

    #[test]
    fn a_change_replaces_one_backend() {
        let before = change_service(0, 0, 100);
        let after = change_service(0, 1, 100);
        let gone: Vec<_> = before.backends.iter().filter(|b| !after.backends.contains(b)).collect();
        let new: Vec<_> = after.backends.iter().filter(|b| !before.backends.contains(b)).collect();
        assert_eq!((gone.len(), new.len()), (1, 1));
        assert_eq!(before.frontend, after.frontend);
    }
}
