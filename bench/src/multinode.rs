//! `multinode` (issue 16 §8): cross-node pod→pod TCP through Rivet against
//! the kernel doing the same job without BPF, in the same topology and the
//! same run: an underlay namespace holding bridge `ul`, two node namespaces
//! on it (veth `ul0`, `198.19.254.<i>/24`, MTU 1500) and a pod on each.
//! Rivet's side is the real `rivet cluster up --nodes 2` (testkit's
//! [`Cluster`]: every node daemon, pods added through rivet-cni, no
//! policy), the kernel's is built here with the same addresses.
//!
//! - **Rivet native** vs **plain kernel routing**: pods as veths, each node
//!   routing the other's pod prefix via the other's underlay address;
//! - **Rivet vxlan** vs **kernel VXLAN**: a `vxlan` device per node (`id`,
//!   `dstport 8472`, `nolearning`) with a static all-zeros FDB entry to the
//!   peer (`bridge fdb append`), an overlay address per node and the peer's
//!   pod prefix routed over it; pods at MTU 1450 (underlay − 50, as Rivet's);
//! - node-to-node request/response latency (between the node namespaces
//!   over the underlay) in Rivet's VXLAN topology, and Rivet VXLAN's RR
//!   latency over it (goal < 1.5×).
//!
//! Each comparison is measured `--rounds` times, the two sides back to back
//! with the order flipping every round; a side's figure is the median of
//! its rounds and each ratio the median of the per-round ratios (Rivet /
//! kernel; goals ≥ 0.95). Throughput: one iperf3 TCP stream for
//! `--seconds`. Request/response: one TCP connection (`TCP_NODELAY`), a
//! 1-byte request answered by a 1-byte response, for `--rr-seconds`
//! ([`request_response`]): transactions/s and p50/p99 latency.
//!
//! Then (unless `--skip-scale`) the §7 figures of `multinode-scale`.
//! ratio = the lower of the two throughput ratios.

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use rivet_common::testing::netns::{NetNs, POD_IFNAME, PodSpec, TestNode, veth_pair};
use rivet_testkit::cluster::{Cluster, ClusterOptions, ClusterPod, Routing};

use crate::datapath::{iperf, median};
use crate::multinode_scale::ScaleArgs;
use crate::report::{BenchResult, load_average, percentile, sibling_binary};

/// Port of the request/response server.
const RR_PORT: u16 = 7001;
/// Transactions before the measured ones (connection and caches warm).
const RR_WARMUP: u32 = 2000;
/// How long one request or response may take before the run fails.
const RR_TIMEOUT: Duration = Duration::from_secs(5);
/// Underlay MTU; VXLAN pods get 50 less.
const UNDERLAY_MTU: u32 = 1500;
/// IPv4 + UDP + VXLAN + inner Ethernet.
const VXLAN_OVERHEAD: u32 = 50;
/// The peer VXLAN device's VNI (any: only two nodes speak on it).
const KERNEL_VNI: &str = "2";
/// The VXLAN UDP port of the cluster (Cilium's).
const VXLAN_PORT: &str = "8472";

/// Options of the multi-node benchmark.
#[derive(Debug, Clone, clap::Args)]
pub struct MultinodeArgs {
    /// Seconds per iperf3 run.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// Seconds per request/response run.
    #[arg(long, default_value_t = 3)]
    rr_seconds: u32,
    /// Rounds per comparison (each side once per round, order flipping).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Leave out the §7 scale figures.
    #[arg(long)]
    skip_scale: bool,
    #[command(flatten)]
    scale: ScaleArgs,
}

/// Where one side's traffic runs: a client pod, a server pod and its
/// address, and the two nodes with the server node's underlay address.
#[derive(Debug, Clone, Copy)]
pub struct Endpoints<'a> {
    /// The sending pod's namespace.
    pub client_pod: &'a NetNs,
    /// The receiving pod's namespace.
    pub server_pod: &'a NetNs,
    /// The receiving pod's IPv4.
    pub server_pod_ip: IpAddr,
    /// The sending pod's node namespace.
    pub client_node: &'a NetNs,
    /// The receiving pod's node namespace.
    pub server_node: &'a NetNs,
    /// The receiving node's underlay IPv4.
    pub server_node_ip: IpAddr,
}

/// How the kernel peer carries pod traffic between its two nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelMode {
    /// Each node routes the other's pod prefix via its underlay address.
    Routing,
    /// A VXLAN device per node with a static FDB entry to the other.
    Vxlan,
}

/// The kernel-only peer: the same topology with no BPF anywhere. Dropped
/// in field order: nodes (pods first), then the underlay.
#[derive(Debug)]
pub struct KernelCluster {
    nodes: [TestNode; 2],
    /// Held for its drop: the bridge namespace goes last.
    _underlay: NetNs,
}

/// Underlay IPv4 of node `i` (1-based), as `rivet cluster up` numbers them.
fn underlay_ip(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, 254, i)
}

/// Overlay IPv4 of node `i` on the kernel VXLAN device.
fn overlay_ip(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, 253, i)
}

/// `ip -n <ns> <words>`.
fn ip(ns: &NetNs, words: &str) -> anyhow::Result<()> {
    ns.ip(&words.split_whitespace().collect::<Vec<_>>())?;
    Ok(())
}

impl KernelCluster {
    /// Builds the underlay, the two nodes with a pod each (`198.18.<i>.2` on
    /// node i, its gateway `198.18.<i>.1` as a static neighbour) and `mode`'s
    /// forwarding.
    pub fn start(mode: KernelMode) -> anyhow::Result<Self> {
        let underlay = NetNs::new("rbul")?;
        ip(&underlay, "link add ul type bridge")?;
        ip(&underlay, "link set ul up")?;
        let pod_mtu = match mode {
            KernelMode::Routing => UNDERLAY_MTU,
            KernelMode::Vxlan => UNDERLAY_MTU - VXLAN_OVERHEAD,
        };
        let mut nodes = Vec::with_capacity(2);
        for i in 1..=2u8 {
            let mut node = TestNode::with_host_prefix("rbh")?;
            let port = format!("ul{i}");
            veth_pair(&underlay, &port, &node.ns, "ul0")?;
            ip(&underlay, &format!("link set {port} master ul"))?;
            ip(&node.ns, &format!("addr add {}/24 dev ul0", underlay_ip(i)))?;
            let spec = PodSpec::new(
                "pod",
                (Ipv4Addr::new(198, 18, i, 2), 24),
                (Ipv6Addr::new(0x2001, 2, 0, u16::from(i), 0, 0, 0, 2), 64),
            )
            .gateways(
                Ipv4Addr::new(198, 18, i, 1),
                Ipv6Addr::new(0x2001, 2, 0, u16::from(i), 0, 0, 0, 1),
            )
            .static_gateway_neighbor(true);
            let pod = node.add_pod(spec)?;
            if pod_mtu != UNDERLAY_MTU {
                let host = pod.host_ifname.clone();
                ip(&pod.ns, &format!("link set {POD_IFNAME} mtu {pod_mtu}"))?;
                ip(&node.ns, &format!("link set {host} mtu {pod_mtu}"))?;
            }
            nodes.push(node);
        }
        for (i, peer) in [(1u8, 2u8), (2, 1)] {
            let ns = &nodes[usize::from(i) - 1].ns;
            match mode {
                KernelMode::Routing => ip(ns, &format!("route add 198.18.{peer}.0/24 via {}", underlay_ip(peer)))?,
                KernelMode::Vxlan => {
                    ip(
                        ns,
                        &format!(
                            "link add vx0 type vxlan id {KERNEL_VNI} dstport {VXLAN_PORT} local {} dev ul0 nolearning",
                            underlay_ip(i)
                        ),
                    )?;
                    ip(ns, &format!("link set vx0 mtu {pod_mtu} up"))?;
                    ip(ns, &format!("addr add {}/24 dev vx0", overlay_ip(i)))?;
                    ns.run(&[
                        "bridge",
                        "fdb",
                        "append",
                        "00:00:00:00:00:00",
                        "dev",
                        "vx0",
                        "dst",
                        &underlay_ip(peer).to_string(),
                    ])?;
                    ip(
                        ns,
                        &format!("route add 198.18.{peer}.0/24 via {} dev vx0", overlay_ip(peer)),
                    )?;
                }
            }
        }
        let [a, b]: [TestNode; 2] = nodes.try_into().expect("two nodes");
        Ok(Self {
            nodes: [a, b],
            _underlay: underlay,
        })
    }

    /// Pod on node 1 → pod on node 2.
    pub fn endpoints(&self) -> Endpoints<'_> {
        let [a, b] = &self.nodes;
        let server = &b.pods()[0];
        Endpoints {
            client_pod: &a.pods()[0].ns,
            server_pod: &server.ns,
            server_pod_ip: server.ipv4().expect("the pod has IPv4"),
            client_node: &a.ns,
            server_node: &b.ns,
            server_node_ip: IpAddr::V4(underlay_ip(2)),
        }
    }
}

/// Rivet's side: a two-node cluster of `rivet cluster up` with a pod on
/// each node.
struct RivetCluster {
    cluster: Cluster,
    client: ClusterPod,
    server: ClusterPod,
}

impl RivetCluster {
    /// Two nodes in `routing` mode from the benchmark's own binaries, pod
    /// `client` on node 1 and `server` on node 2, converged (each loader
    /// holds the other node and its pod).
    async fn start(routing: Routing) -> anyhow::Result<Self> {
        let bin_dir = sibling_binary("rivet")?
            .parent()
            .map(std::path::Path::to_path_buf)
            .ok_or_else(|| anyhow::anyhow!("the benchmark binary has no directory"))?;
        let mut cluster = Cluster::start(ClusterOptions {
            nodes: 2,
            routing,
            bin_dir: Some(bin_dir),
            ..ClusterOptions::default()
        })
        .await?;
        let client = cluster.add_pod(1, "bench", "client", &["app=client"]).await;
        let server = cluster.add_pod(2, "bench", "server", &["app=server"]).await;
        cluster.wait_converged().await;
        Ok(Self {
            cluster,
            client,
            server,
        })
    }

    fn endpoints(&self) -> Endpoints<'_> {
        let server_node = self.cluster.node(2);
        Endpoints {
            client_pod: &self.client.netns,
            server_pod: &self.server.netns,
            server_pod_ip: IpAddr::V4(self.server.ipv4),
            client_node: &self.cluster.node(1).netns,
            server_node: &server_node.netns,
            server_node_ip: IpAddr::V4(server_node.underlay_v4),
        }
    }
}

/// What one request/response run measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RrResult {
    /// Transactions per second.
    pub per_s: f64,
    /// Median transaction latency, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
}

/// A TCP_RR-style run: one connection from `client` to `server` at `dst`
/// ([`RR_PORT`]), `TCP_NODELAY` on both ends, one byte out and the same
/// byte back per transaction, as many as fit in `duration` after a warm-up.
pub fn request_response(client: &NetNs, server: &NetNs, dst: IpAddr, duration: Duration) -> anyhow::Result<RrResult> {
    let addr = SocketAddr::new(dst, RR_PORT);
    let listener = server
        .in_ns(move || TcpListener::bind(addr))?
        .map_err(|e| anyhow::anyhow!("binding the RR server to {addr} in {}: {e}", server.name()))?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut stream, _) = listener.accept()?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(RR_TIMEOUT))?;
        let mut byte = [0u8; 1];
        while stream.read(&mut byte)? == 1 {
            stream.write_all(&byte)?;
        }
        Ok(())
    });
    let run = || -> anyhow::Result<RrResult> {
        let mut stream = client.tcp_stream(addr, RR_TIMEOUT)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(RR_TIMEOUT))?;
        let mut byte = [1u8; 1];
        let mut transact = |byte: &mut [u8; 1]| -> std::io::Result<()> {
            stream.write_all(byte)?;
            stream.read_exact(byte)
        };
        for _ in 0..RR_WARMUP {
            transact(&mut byte)?;
        }
        let mut latencies_us = Vec::with_capacity(100_000);
        let started = Instant::now();
        while started.elapsed() < duration {
            let t = Instant::now();
            transact(&mut byte)?;
            latencies_us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let elapsed = started.elapsed().as_secs_f64();
        Ok(RrResult {
            per_s: latencies_us.len() as f64 / elapsed,
            p50_us: percentile(&mut latencies_us, 0.50),
            p99_us: percentile(&mut latencies_us, 0.99),
        })
    };
    let result = run();
    // The client's stream is closed: the echo thread sees EOF (or its
    // accept a connection that never came is ended by a last connect).
    if result.is_err() {
        let _ = client.tcp_connect(addr, Duration::from_millis(100));
    }
    let echoed = echo
        .join()
        .map_err(|_| anyhow::anyhow!("the RR server thread panicked"))?;
    let result = result?;
    echoed.map_err(|e| anyhow::anyhow!("the RR server in {}: {e}", server.name()))?;
    Ok(result)
}

/// One side's figures in one round.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Side {
    bits_per_s: f64,
    rr: RrResult,
}

fn measure(e: &Endpoints<'_>, args: &MultinodeArgs) -> anyhow::Result<Side> {
    Ok(Side {
        bits_per_s: iperf(e.client_pod, e.server_pod, e.server_pod_ip, args.seconds)?,
        rr: request_response(
            e.client_pod,
            e.server_pod,
            e.server_pod_ip,
            Duration::from_secs(args.rr_seconds.into()),
        )?,
    })
}

/// A comparison's rounds summarised.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Compared {
    ours: Summary,
    peer: Summary,
    /// Median per-round throughput ratio ours / peer.
    throughput_ratio: f64,
    /// Median per-round transactions/s ratio ours / peer.
    rr_ratio: f64,
}

/// Medians of one side's rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Summary {
    gbit_per_s: f64,
    rr_per_s: f64,
    rr_p50_us: f64,
    rr_p99_us: f64,
}

impl Summary {
    fn of(sides: &[Side]) -> Self {
        let of = |f: fn(&Side) -> f64| median(sides.iter().map(f).collect());
        Self {
            gbit_per_s: of(|s| s.bits_per_s / 1e9),
            rr_per_s: of(|s| s.rr.per_s),
            rr_p50_us: of(|s| s.rr.p50_us),
            rr_p99_us: of(|s| s.rr.p99_us),
        }
    }
}

impl Compared {
    fn of(rounds: &[(Side, Side)]) -> Self {
        let ours: Vec<Side> = rounds.iter().map(|r| r.0).collect();
        let peer: Vec<Side> = rounds.iter().map(|r| r.1).collect();
        Self {
            ours: Summary::of(&ours),
            peer: Summary::of(&peer),
            throughput_ratio: median(rounds.iter().map(|(o, p)| o.bits_per_s / p.bits_per_s).collect()),
            rr_ratio: median(rounds.iter().map(|(o, p)| o.rr.per_s / p.rr.per_s).collect()),
        }
    }

    fn push_metrics(&self, ours: &str, peer: &str, metrics: &mut Vec<(String, f64)>) {
        for (name, s) in [(ours, &self.ours), (peer, &self.peer)] {
            metrics.push((format!("{name}_gbit_per_s"), s.gbit_per_s));
            metrics.push((format!("{name}_rr_per_s"), s.rr_per_s));
            metrics.push((format!("{name}_rr_p50_us"), s.rr_p50_us));
            metrics.push((format!("{name}_rr_p99_us"), s.rr_p99_us));
        }
        metrics.push((format!("{ours}_throughput_ratio"), self.throughput_ratio));
        metrics.push((format!("{ours}_rr_ratio"), self.rr_ratio));
    }
}

/// `rounds` rounds of `ours` against `peer`, the order flipping each round.
fn compare(label: &str, ours: &Endpoints<'_>, peer: &Endpoints<'_>, args: &MultinodeArgs) -> anyhow::Result<Compared> {
    let mut rounds = Vec::with_capacity(args.rounds);
    for round in 0..args.rounds {
        let (o, p) = if round % 2 == 0 {
            let o = measure(ours, args)?;
            (o, measure(peer, args)?)
        } else {
            let p = measure(peer, args)?;
            (measure(ours, args)?, p)
        };
        println!(
            "{label} round {round}: Rivet {:.2} Gbit/s, {:.0} RR/s (p50 {:.1} us); kernel {:.2} Gbit/s, {:.0} RR/s \
             (p50 {:.1} us)",
            o.bits_per_s / 1e9,
            o.rr.per_s,
            o.rr.p50_us,
            p.bits_per_s / 1e9,
            p.rr.per_s,
            p.rr.p50_us
        );
        rounds.push((o, p));
    }
    Ok(Compared::of(&rounds))
}

/// Node-to-node request/response over the underlay: the median of
/// `rounds` runs.
fn node_to_node(e: &Endpoints<'_>, args: &MultinodeArgs) -> anyhow::Result<RrResult> {
    let mut runs = Vec::with_capacity(args.rounds);
    for _ in 0..args.rounds {
        runs.push(request_response(
            e.client_node,
            e.server_node,
            e.server_node_ip,
            Duration::from_secs(args.rr_seconds.into()),
        )?);
    }
    Ok(RrResult {
        per_s: median(runs.iter().map(|r| r.per_s).collect()),
        p50_us: median(runs.iter().map(|r| r.p50_us).collect()),
        p99_us: median(runs.iter().map(|r| r.p99_us).collect()),
    })
}

/// Runs the benchmark.
pub async fn run(args: &MultinodeArgs) -> anyhow::Result<BenchResult> {
    anyhow::ensure!(
        args.rounds > 0 && args.seconds > 0 && args.rr_seconds > 0,
        "--rounds, --seconds and --rr-seconds must be > 0"
    );
    let load_before = load_average()?;
    let mut metrics = Vec::new();

    // One mode at a time: its Rivet cluster and its kernel peer.
    let rivet = RivetCluster::start(Routing::Native).await?;
    let plain = KernelCluster::start(KernelMode::Routing)?;
    let native = tokio::task::block_in_place(|| compare("native", &rivet.endpoints(), &plain.endpoints(), args))?;
    native.push_metrics("native", "plain_routing", &mut metrics);
    drop(plain);
    rivet.cluster.down().await;

    let rivet = RivetCluster::start(Routing::Vxlan).await?;
    let kernel_vxlan = KernelCluster::start(KernelMode::Vxlan)?;
    let vxlan = tokio::task::block_in_place(|| compare("vxlan", &rivet.endpoints(), &kernel_vxlan.endpoints(), args))?;
    vxlan.push_metrics("vxlan", "kernel_vxlan", &mut metrics);
    let node = tokio::task::block_in_place(|| node_to_node(&rivet.endpoints(), args))?;
    metrics.push(("node_rr_p50_us".into(), node.p50_us));
    metrics.push(("node_rr_per_s".into(), node.per_s));
    let latency_over_node = vxlan.ours.rr_p50_us / node.p50_us;
    metrics.push(("vxlan_rr_latency_over_node".into(), latency_over_node));
    println!(
        "native: {:.3}x throughput, {:.3}x RR/s of plain routing; vxlan: {:.3}x throughput, {:.3}x RR/s of kernel \
         VXLAN; vxlan RR p50 {:.1} us = {latency_over_node:.2}x node-to-node {:.1} us (goals >= 0.95, < 1.5)",
        native.throughput_ratio,
        native.rr_ratio,
        vxlan.throughput_ratio,
        vxlan.rr_ratio,
        vxlan.ours.rr_p50_us,
        node.p50_us
    );
    drop(kernel_vxlan);
    rivet.cluster.down().await;
    metrics.push(("load_average_1m_before".into(), load_before));
    metrics.push(("load_average_1m_after".into(), load_average()?));

    if !args.skip_scale {
        let scale = crate::multinode_scale::measure(&args.scale).await?;
        metrics.extend(scale.metrics.into_iter().map(|(k, v)| (format!("scale_{k}"), v)));
    }
    Ok(BenchResult {
        name: "multinode".into(),
        metrics,
        ratio: native.throughput_ratio.min(vxlan.throughput_ratio),
    })
}
