//! A simulated node for svc-loader: a node network namespace with pod
//! namespaces wired by veth pairs and the real svc-loader process running
//! inside it, all removed on drop; and the policy entries tests give it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use rivet_common::grpc::{ClientOptions, DaemonChannel, connect_unix};
use rivet_common::pin_layout;
use rivet_common::testing::netns::{NetNs, PodSpec, TestNode, TestPod};
use rivet_common::testing::{DaemonCommand, DaemonProcess};
use rivet_proto::loader::v1 as pb;
use rivet_proto::loader::v1::load_balancer_service_client::LoadBalancerServiceClient;
use rivet_proto::loader::v1::loader_service_client::LoaderServiceClient;
use rivet_proto::loader::v1::node_routing_service_client::NodeRoutingServiceClient;

/// Endpoint map entries of a test loader: 512 single-address or 341
/// dual-stack endpoints.
pub const DEFAULT_ENDPOINTS_MAX: u32 = 1024;

/// Host-side veth prefix of test nodes; the loader only acts on these.
pub const HOST_PREFIX: &str = "rvh";

/// Removes a node's pin directory (maps and links) on drop.
#[derive(Debug)]
pub struct PinDir(pub PathBuf);

impl PinDir {
    /// The pin directory of test node `node` (`<bpffs>/rivet/<node>`, the
    /// layout of [`rivet_common::pin_layout`]).
    pub fn of_node(node: &str) -> Self {
        Self(pin_layout::pin_dir(pin_layout::DEFAULT_BPFFS, node).expect("a test node name is one path component"))
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            eprintln!("removing test pins {}: {e}", self.0.display());
        }
    }
}

/// A node namespace with pods and svc-loader running in it. Fields drop in
/// order: the loader, then the namespaces, then the pins, then the temp dir.
#[derive(Debug)]
pub struct LoaderNode {
    /// The loader process.
    pub loader: DaemonProcess,
    /// Node and pods.
    pub node: TestNode,
    /// `/sys/fs/bpf/rivet/<node name>`.
    pub pins: PinDir,
    /// Socket dir and logs.
    pub dir: tempfile::TempDir,
    /// The node name (also the pin dir's name).
    pub node_name: String,
}

static NODES: AtomicU32 = AtomicU32::new(0);

/// Pod `n` (1-based) of a test node: 198.18.0.(n+1)/24 and 2001:2::(n+1)/64,
/// gateways 198.18.0.1 and 2001:2::1, answered by the datapath.
pub fn pod_spec(name: &str, n: u8) -> PodSpec {
    PodSpec::new(
        name,
        (Ipv4Addr::new(198, 18, 0, n + 1), 24),
        (Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, u16::from(n) + 1), 64),
    )
    .gateways(Ipv4Addr::new(198, 18, 0, 1), Ipv6Addr::new(0x2001, 2, 0, 0, 0, 0, 0, 1))
}

/// Name of a node's underlay interface (the veth to the underlay bridge).
pub const UNDERLAY_IFNAME: &str = "ul0";

/// The underlay of simulated nodes: a namespace holding the bridge `ul`;
/// node `i` joins it with veth `ul0` (`198.19.254.<i>/24`,
/// `2001:2:0:fe::<i>/64`, MTU 1500), the cluster's conventions. Dropping it
/// deletes the namespace, and with it every node's link to it.
#[derive(Debug)]
pub struct Underlay {
    /// The namespace of the bridge.
    pub ns: NetNs,
}

impl Underlay {
    /// A new underlay namespace with its bridge up.
    pub fn new() -> std::io::Result<Self> {
        let ns = NetNs::new("rvu").map_err(std::io::Error::other)?;
        ns.ip(&["link", "add", "ul", "type", "bridge"])
            .map_err(std::io::Error::other)?;
        ns.ip(&["link", "set", "ul", "up"]).map_err(std::io::Error::other)?;
        Ok(Self { ns })
    }

    /// Node `index`'s underlay IPv4 address.
    pub fn ipv4(index: u8) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, 254, index)
    }

    /// Node `index`'s underlay IPv6 address.
    pub fn ipv6(index: u8) -> Ipv6Addr {
        Ipv6Addr::new(0x2001, 2, 0, 0xfe, 0, 0, 0, u16::from(index))
    }

    /// Connects `node` as node `index` (1..=253): veth `ul0` in it, `n<index>`
    /// on the bridge, addresses and both ends up.
    pub fn join(&self, node: &NetNs, index: u8) -> std::io::Result<()> {
        let port = format!("n{index}");
        let run = |ns: &NetNs, args: &[&str]| ns.ip(args).map(drop).map_err(std::io::Error::other);
        run(
            node,
            &[
                "link",
                "add",
                UNDERLAY_IFNAME,
                "type",
                "veth",
                "peer",
                "name",
                &port,
                "netns",
                self.ns.name(),
            ],
        )?;
        run(&self.ns, &["link", "set", &port, "master", "ul", "up"])?;
        run(
            node,
            &[
                "addr",
                "add",
                &format!("{}/24", Self::ipv4(index)),
                "dev",
                UNDERLAY_IFNAME,
            ],
        )?;
        run(
            node,
            &[
                "-6",
                "addr",
                "add",
                &format!("{}/64", Self::ipv6(index)),
                "dev",
                UNDERLAY_IFNAME,
                "nodad",
            ],
        )?;
        run(node, &["link", "set", UNDERLAY_IFNAME, "mtu", "1500", "up"])
    }
}

/// A host outside the cluster on the underlay (a NodePort client): its own
/// namespace, joined to the bridge by veth `eth0`. Dropping it deletes the
/// namespace and with it the link.
#[derive(Debug)]
pub struct ExternalClient {
    /// Its namespace.
    pub ns: NetNs,
}

impl ExternalClient {
    /// Its IPv4 address on the underlay.
    pub const IPV4: Ipv4Addr = Ipv4Addr::new(198, 19, 254, 200);
    /// Its IPv6 address on the underlay.
    pub const IPV6: Ipv6Addr = Ipv6Addr::new(0x2001, 2, 0, 0xfe, 0, 0, 0, 0x200);

    /// Its addresses, IPv4 first.
    pub fn addrs(&self) -> [IpAddr; 2] {
        [IpAddr::V4(Self::IPV4), IpAddr::V6(Self::IPV6)]
    }
}

impl ExternalClient {
    /// A client host on bridge `bridge` of namespace `bridge_ns`
    /// ([`Self::IPV4`]/24, [`Self::IPV6`]/64): reaches the nodes' underlay
    /// addresses on it, nothing else (no routes to pods).
    pub fn on_bridge(bridge_ns: &NetNs, bridge: &str) -> std::io::Result<Self> {
        let ns = NetNs::new("rvx").map_err(std::io::Error::other)?;
        let port = format!("x{}", CLIENTS.fetch_add(1, Ordering::Relaxed));
        let run = |ns: &NetNs, args: &[&str]| ns.ip(args).map(drop).map_err(std::io::Error::other);
        run(
            &ns,
            &[
                "link",
                "add",
                "eth0",
                "type",
                "veth",
                "peer",
                "name",
                &port,
                "netns",
                bridge_ns.name(),
            ],
        )?;
        run(bridge_ns, &["link", "set", &port, "master", bridge, "up"])?;
        run(&ns, &["addr", "add", &format!("{}/24", Self::IPV4), "dev", "eth0"])?;
        run(
            &ns,
            &[
                "-6",
                "addr",
                "add",
                &format!("{}/64", Self::IPV6),
                "dev",
                "eth0",
                "nodad",
            ],
        )?;
        run(&ns, &["link", "set", "eth0", "up"])?;
        run(&ns, &["link", "set", "lo", "up"])?;
        Ok(Self { ns })
    }
}

impl Underlay {
    /// A client host on the underlay bridge ([`ExternalClient::on_bridge`]).
    pub fn add_external_client(&self) -> std::io::Result<ExternalClient> {
        ExternalClient::on_bridge(&self.ns, "ul")
    }
}

static CLIENTS: AtomicU32 = AtomicU32::new(0);

/// Pod `n` (1-based) of cluster node `index`: `198.18.<index>.(n+1)/24` and
/// `2001:2:0:<index>::(n+1)/64`, gateways .1 and ::1 (the node's pod CIDRs
/// `198.18.<index>.0/24` and `2001:2:0:<index>::/64`, the cluster's
/// conventions).
pub fn cluster_pod_spec(name: &str, index: u8, n: u8) -> PodSpec {
    let v6 = |host: u16| Ipv6Addr::new(0x2001, 2, 0, u16::from(index), 0, 0, 0, host);
    PodSpec::new(
        name,
        (Ipv4Addr::new(198, 18, index, n + 1), 24),
        (v6(u16::from(n) + 1), 64),
    )
    .gateways(Ipv4Addr::new(198, 18, index, 1), v6(1))
}

/// `--ct-max 65536 --lb-flows-max 65536` (test nodes' small conntrack and
/// translated-flow maps), leaving out each flag `extra_args` sets itself
/// (svc-loader refuses a flag given twice): a benchmark opening new
/// connections by the hundred thousand sizes them like a real node.
pub fn small_flow_maps<'a>(extra_args: &[&str]) -> Vec<&'a str> {
    [("--ct-max", "65536"), ("--lb-flows-max", "65536")]
        .into_iter()
        .filter(|(flag, _)| !extra_args.contains(flag))
        .flat_map(|(flag, size)| [flag, size])
        .collect()
}

/// `[flag, value]` unless `extra_args` sets `flag` itself (clap refuses a
/// flag given twice).
fn unless_given<'a>(extra_args: &[&str], flag: &'a str, value: &'a str) -> Vec<&'a str> {
    if extra_args.contains(&flag) {
        Vec::new()
    } else {
        vec![flag, value]
    }
}

impl LoaderNode {
    /// Creates the node with `pods` and starts `loader_bin` inside it with
    /// small maps and `extra_args` (which may size the flow maps itself:
    /// [`small_flow_maps`]).
    pub async fn start(loader_bin: &Path, pods: &[&str], extra_args: &[&str]) -> std::io::Result<Self> {
        Self::start_with_env(loader_bin, pods, extra_args, DEFAULT_ENDPOINTS_MAX, |_| Ok(Vec::new())).await
    }

    /// Node `index` of a cluster on `underlay`: pods addressed from the
    /// node's pod CIDRs ([`cluster_pod_spec`]), joined to the underlay
    /// ([`Underlay::join`]) before `loader_bin` starts with `extra_args`
    /// (e.g. `--routing-mode vxlan --underlay-interface ul0`).
    pub async fn start_on_underlay(
        loader_bin: &Path,
        underlay: &Underlay,
        index: u8,
        pods: &[&str],
        extra_args: &[&str],
    ) -> std::io::Result<Self> {
        let specs = pods
            .iter()
            .enumerate()
            .map(|(i, name)| cluster_pod_spec(name, index, i as u8 + 1))
            .collect();
        Self::start_with_pods(loader_bin, specs, extra_args, DEFAULT_ENDPOINTS_MAX, |node| {
            underlay.join(&node.ns, index)?;
            Ok(Vec::new())
        })
        .await
    }

    /// [`start`](Self::start) with room for `endpoints_max` endpoint map
    /// entries (one per endpoint plus one per address; the ipcache gets
    /// twice as many, at least 4096) and environment variables for the
    /// loader computed once the node namespace exists (e.g. the address of
    /// an OTLP collector listening inside it).
    pub async fn start_with_env(
        loader_bin: &Path,
        pods: &[&str],
        extra_args: &[&str],
        endpoints_max: u32,
        env: impl FnOnce(&TestNode) -> std::io::Result<Vec<(String, String)>>,
    ) -> std::io::Result<Self> {
        let specs = pods
            .iter()
            .enumerate()
            .map(|(i, name)| pod_spec(name, i as u8 + 1))
            .collect();
        Self::start_with_pods(loader_bin, specs, extra_args, endpoints_max, env).await
    }

    async fn start_with_pods(
        loader_bin: &Path,
        pods: Vec<PodSpec>,
        extra_args: &[&str],
        endpoints_max: u32,
        env: impl FnOnce(&TestNode) -> std::io::Result<Vec<(String, String)>>,
    ) -> std::io::Result<Self> {
        let mut node = TestNode::with_host_prefix(HOST_PREFIX).map_err(std::io::Error::other)?;
        for spec in pods {
            node.add_pod(spec).map_err(std::io::Error::other)?;
        }
        let node_name = format!("t{}-{}", std::process::id(), NODES.fetch_add(1, Ordering::Relaxed));
        let pins = PinDir::of_node(&node_name);
        let dir = tempfile::tempdir()?;
        let sockets = dir.path().join("sockets");
        // nsenter switches only the network namespace: `ip netns exec` would
        // remount /sys and hide the bpffs at /sys/fs/bpf.
        let mut loader = DaemonCommand::new("nsenter", sockets.join("svc-loader.sock"));
        for (key, value) in env(&node)? {
            loader = loader.env(key, value);
        }
        let (endpoints_max, ipcache_max) = (
            endpoints_max.to_string(),
            endpoints_max.saturating_mul(2).max(4096).to_string(),
        );
        let loader = loader
            .arg(format!("--net={}", node.ns.path().display()))
            .arg(loader_bin)
            .args(["--socket-dir".as_ref(), sockets.as_os_str()])
            .args(["--state-dir".as_ref(), dir.path().join("state").as_os_str()])
            .args(["--node-name", &node_name, "--endpoint-interface-prefix", HOST_PREFIX])
            .args(small_flow_maps(extra_args))
            .args(["--endpoints-max", &endpoints_max])
            .args(["--ipcache-max", &ipcache_max])
            .args(unless_given(extra_args, "--policy-max", "65536"))
            .args(["--events-bytes", "262144", "--host-address-sync-seconds", "1"])
            .args(extra_args)
            .log_to(dir.path().join("svc-loader.log"))
            .spawn()
            .await?;
        Ok(Self {
            loader,
            node,
            pins,
            dir,
            node_name,
        })
    }

    /// A client of the loader.
    pub async fn client(&self) -> LoaderServiceClient<DaemonChannel> {
        LoaderServiceClient::new(
            connect_unix(self.loader.socket(), &ClientOptions::default())
                .await
                .expect("connect to svc-loader"),
        )
    }

    /// A client of the loader's NodeRoutingService.
    pub async fn routing_client(&self) -> NodeRoutingServiceClient<DaemonChannel> {
        NodeRoutingServiceClient::new(
            connect_unix(self.loader.socket(), &ClientOptions::default())
                .await
                .expect("connect to svc-loader"),
        )
    }

    /// A client of the loader's LoadBalancerService.
    pub async fn lb_client(&self) -> LoadBalancerServiceClient<DaemonChannel> {
        LoadBalancerServiceClient::new(
            connect_unix(self.loader.socket(), &ClientOptions::default())
                .await
                .expect("connect to svc-loader"),
        )
    }

    /// The loader's routes to peers in the node (`ip route show proto 77`
    /// of both families), one trimmed line each.
    pub fn rivet_routes(&self) -> Vec<String> {
        ["-4", "-6"]
            .iter()
            .flat_map(|family| {
                self.node
                    .ns
                    .ip(&[family, "route", "show", "proto", "77"])
                    .expect("ip route runs")
                    .lines()
                    .map(|l| l.trim().to_owned())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The datapath's non-zero drop counters (by reason and direction).
    pub async fn drop_counters(&self) -> Vec<pb::DropCounter> {
        self.client()
            .await
            .get_drop_counters(pb::GetDropCountersRequest { include_zero: false })
            .await
            .expect("svc-loader answers GetDropCounters")
            .into_inner()
            .drops
    }

    /// Packets dropped for `reason`, in both directions.
    pub async fn drops(&self, reason: pb::DropReason) -> u64 {
        self.drop_counters()
            .await
            .iter()
            .filter(|d| d.reason == reason as i32)
            .map(|d| d.packets)
            .sum()
    }

    /// Waits until the drops for `reason` reach `target` (a drop counter
    /// is the signal that packets went through the datapath), at most
    /// `within`; returns the count then.
    pub async fn drops_reaching(&self, reason: pb::DropReason, target: u64, within: std::time::Duration) -> u64 {
        let deadline = std::time::Instant::now() + within;
        loop {
            let now = self.drops(reason).await;
            if now >= target || std::time::Instant::now() >= deadline {
                return now;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// A pod by name.
    pub fn pod(&self, name: &str) -> &TestPod {
        self.node.pod(name)
    }

    /// An ApplyEndpoint request for a pod.
    pub fn endpoint(
        &self,
        pod: &str,
        endpoint_id: u32,
        identity: u32,
        policy: pb::EndpointPolicy,
    ) -> pb::ApplyEndpointRequest {
        let p = self.pod(pod);
        pb::ApplyEndpointRequest {
            endpoint_id,
            host_ifindex: p.host_ifindex,
            addresses: p.addrs().into_iter().map(rivet_proto::net::address_bytes).collect(),
            mac: p.pod_mac.to_vec(),
            identity,
            policy: Some(policy),
        }
    }
}

/// A policy entry.
pub fn entry(
    direction: pb::Direction,
    peer: u32,
    protocol: pb::Protocol,
    port: u32,
    end_port: u32,
    verdict: pb::Verdict,
) -> pb::PolicyEntry {
    pb::PolicyEntry {
        direction: direction as i32,
        peer_identity: peer,
        protocol: protocol as i32,
        port,
        end_port,
        verdict: verdict as i32,
        peer_kind: pb::PeerKind::Identity as i32,
    }
}

/// A policy entry matching peers by address: `cidr_identity` is the
/// identity of one of the policy's prefixes.
pub fn address_entry(
    direction: pb::Direction,
    cidr_identity: u32,
    protocol: pb::Protocol,
    port: u32,
    verdict: pb::Verdict,
) -> pb::PolicyEntry {
    pb::PolicyEntry {
        peer_kind: pb::PeerKind::Address as i32,
        ..entry(direction, cidr_identity, protocol, port, 0, verdict)
    }
}

/// A prefix of an endpoint's policy.
pub fn prefix(direction: pb::Direction, address: IpAddr, prefix_length: u32, cidr_identity: u32) -> pb::EndpointPrefix {
    pb::EndpointPrefix {
        direction: direction as i32,
        prefix: Some(rivet_proto::net::IpPrefix {
            address: rivet_proto::net::address_bytes(address),
            prefix_length,
        }),
        cidr_identity,
    }
}

/// A policy enforcing the given directions with `entries`.
pub fn policy(revision: u64, ingress: bool, egress: bool, entries: Vec<pb::PolicyEntry>) -> pb::EndpointPolicy {
    pb::EndpointPolicy {
        revision,
        enforce_ingress: ingress,
        enforce_egress: egress,
        allow_from_host: true,
        entries,
        prefixes: Vec::new(),
    }
}

/// A ClusterIP service for LoadBalancerService: `vip` (address and port)
/// over `protocol`, `backends` (address and target port, state; on this
/// node), no affinity (set `affinity_timeout_seconds` to add it).
pub fn cluster_ip_service(
    service_id: u32,
    vip: std::net::SocketAddr,
    protocol: pb::Protocol,
    backends: &[(std::net::SocketAddr, pb::BackendState)],
) -> pb::LbService {
    pb::LbService {
        service_id,
        family: if vip.is_ipv4() {
            pb::Family::Ipv4
        } else {
            pb::Family::Ipv6
        } as i32,
        protocol: protocol as i32,
        frontends: vec![pb::LbFrontend {
            kind: pb::FrontendKind::ClusterIp as i32,
            address: rivet_proto::net::address_bytes(vip.ip()),
            port: u32::from(vip.port()),
        }],
        backends: backends
            .iter()
            .map(|(addr, state)| pb::LbBackend {
                address: rivet_proto::net::address_bytes(addr.ip()),
                port: u32::from(addr.port()),
                state: *state as i32,
                node_local: true,
            })
            .collect(),
        affinity_timeout_seconds: 0,
        external_traffic_policy: pb::TrafficPolicy::Cluster as i32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_map_sizes_given_by_the_caller_replace_the_small_ones() {
        assert_eq!(
            small_flow_maps(&["--routing-mode", "vxlan"]),
            ["--ct-max", "65536", "--lb-flows-max", "65536"]
        );
        assert_eq!(small_flow_maps(&["--ct-max", "524288"]), ["--lb-flows-max", "65536"]);
        assert!(small_flow_maps(&["--lb-flows-max", "1", "--ct-max", "2"]).is_empty());
    }
}
