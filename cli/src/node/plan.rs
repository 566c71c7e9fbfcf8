//! The node plan: every path, flag and file of a node, from the arguments.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use rivet_common::pin_layout;
use serde_json::Value;

use super::{
    ALL_DAEMONS, CNI_BINARY, COMPANION_PLUGINS, CONFLIST_FILE, DEFAULT_NETNS_POOL, DEFAULT_NODE_ADDRESSES, DaemonSpec,
    GC, HEALTH, IpamMode, K8S_SYNC, LOADER, NodePhase, NodeRecord, RoutingMode, UpArgs, VXLAN_OVERHEAD,
};
use crate::accounts::NodeAccounts;
use crate::{netns, now_unix_nanos};

/// Longest Unix socket path (`sun_path` is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Pod MTU without `--mtu` and without VXLAN.
const DEFAULT_MTU: u32 = 1500;

/// The node's underlay interface as `node up` found it (`--underlay-interface`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Underlay {
    /// Its name in the node's namespace.
    pub interface: String,
    /// Its global addresses, IPv4 first.
    pub addresses: Vec<std::net::IpAddr>,
    /// Its MTU.
    pub mtu: u32,
}

impl Underlay {
    /// From `ip -j addr show dev <interface>`: the global addresses
    /// (link-local ones are no node address) and the MTU.
    ///
    /// ```
    /// let json = r#"[{"ifname":"ul0","mtu":1500,"addr_info":[
    ///     {"family":"inet6","local":"2001:2:0:fe::1","prefixlen":64,"scope":"global"},
    ///     {"family":"inet6","local":"fe80::1","prefixlen":64,"scope":"link"},
    ///     {"family":"inet","local":"198.19.254.1","prefixlen":24,"scope":"global"}]}]"#;
    /// let u = rivet_cli::node::Underlay::from_ip_json("ul0", json).unwrap();
    /// assert_eq!(u.addresses, ["198.19.254.1".parse::<std::net::IpAddr>().unwrap(), "2001:2:0:fe::1".parse().unwrap()]);
    /// assert_eq!(u.mtu, 1500);
    /// ```
    pub fn from_ip_json(interface: &str, json: &str) -> Result<Self> {
        let links: Value = serde_json::from_str(json)
            .map_err(|e| anyhow::anyhow!("reading `ip -j addr show dev {interface}`: {e}"))?;
        let Some(link) = links.as_array().and_then(|l| l.first()) else {
            bail!("the underlay interface {interface} does not exist");
        };
        let mtu = link["mtu"]
            .as_u64()
            .and_then(|m| u32::try_from(m).ok())
            .ok_or_else(|| anyhow::anyhow!("the underlay interface {interface} reports no MTU"))?;
        let mut addresses: Vec<std::net::IpAddr> = link["addr_info"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["scope"] == "global")
            .filter_map(|a| a["local"].as_str()?.parse().ok())
            .collect();
        addresses.sort_by_key(|ip| (ip.is_ipv6(), *ip));
        if addresses.is_empty() {
            bail!(
                "the underlay interface {interface} has no global address: give it the node's underlay address first"
            );
        }
        Ok(Self {
            interface: interface.to_string(),
            addresses,
            mtu,
        })
    }
}

/// A plugin installed beside rivet-cni ([`COMPANION_PLUGINS`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompanionPlugin {
    /// Its file name.
    pub name: String,
    /// Where it is copied from; `None`: the CNI bin dir has it already
    /// (kept as it is, and left there when the node stops).
    pub source: Option<PathBuf>,
    /// Its path in the CNI bin dir.
    pub target: PathBuf,
}

/// Everything `rivet node up` will do, resolved from its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlan {
    /// Node name.
    pub node_name: String,
    /// The node's namespace.
    pub netns: Option<String>,
    /// Create (and delete) it.
    pub create_netns: bool,
    /// Addresses on `lo` of the created namespace.
    pub node_addresses: Vec<String>,
    /// svc-ipam pools.
    pub pools: Vec<String>,
    /// The CNI's pool.
    pub ipam_pool: String,
    /// Daemon binaries and rivet-cni.
    pub bin_dir: PathBuf,
    /// State dir.
    pub state_dir: PathBuf,
    /// Socket dir.
    pub socket_dir: PathBuf,
    /// Log dir.
    pub log_dir: PathBuf,
    /// `<bpffs>/rivet/<node>`.
    pub pin_dir: PathBuf,
    /// The underlay interface, once read ([`with_underlay`](Self::with_underlay)).
    pub underlay: Option<Underlay>,
    /// The health endpoint's namespace (`--health-endpoint`).
    pub health_netns: Option<String>,
    /// Arguments of `rivet node up`.
    pub args: UpArgs,
}

impl NodePlan {
    /// Resolves the arguments (`bin_dir_default`: where this `rivet` is).
    pub fn new(socket_dir: &Path, state_dir: &Path, args: &UpArgs, bin_dir_default: &Path) -> Result<Self> {
        if let Some(ns) = &args.netns {
            netns::check_name(ns)?;
        }
        let node_name = match (&args.node_name, &args.netns) {
            (Some(n), _) => n.clone(),
            (None, Some(ns)) => ns.clone(),
            (None, None) => rivet_common::config::hostname(),
        };
        let name_ok = !node_name.is_empty()
            && node_name.len() <= 64
            && node_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && !node_name.starts_with('.');
        if !name_ok {
            bail!("`{node_name}` is not a usable node name (1 to 64 of A-Z a-z 0-9 - _ ., it names the pin dir)");
        }
        let cluster_pool = args.ipam_mode == IpamMode::ClusterPool;
        if cluster_pool && args.kubeconfig.is_none() {
            bail!("--ipam-mode cluster-pool needs --kubeconfig: the pod CIDRs come from the node's RivetNode");
        }
        if cluster_pool && !args.pools.is_empty() {
            bail!("--pool and --ipam-mode cluster-pool exclude each other: svc-ipam's pool comes from the RivetNode");
        }
        let pools = if !args.pools.is_empty() || cluster_pool {
            args.pools.clone()
        } else if args.netns.is_some() {
            vec![DEFAULT_NETNS_POOL.to_string()]
        } else {
            bail!("give svc-ipam's pools with --pool NAME=CIDR[,CIDR] (defaults exist only with --netns)");
        };
        for p in &pools {
            match p.split_once('=') {
                Some((name, cidrs)) if !name.is_empty() && !cidrs.is_empty() => {}
                _ => bail!("`{p}` is not a pool: give NAME=CIDR[,CIDR...]"),
            }
        }
        // Cluster-pool: svc-k8s-sync sets pool `default`.
        let first_pool = pools
            .first()
            .and_then(|p| p.split_once('='))
            .map_or("default".to_string(), |(n, _)| n.to_string());
        let node_addresses = if args.create_netns && args.node_addresses.is_empty() {
            DEFAULT_NODE_ADDRESSES.iter().map(|a| a.to_string()).collect()
        } else {
            args.node_addresses.clone()
        };
        for a in &node_addresses {
            let ok = a
                .split_once('/')
                .is_some_and(|(ip, len)| ip.parse::<std::net::IpAddr>().is_ok() && len.parse::<u8>().is_ok());
            if !ok {
                bail!("`{a}` is not an address with prefix length (e.g. 198.19.0.1/32)");
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for d in &args.daemon_args {
            let Some((daemon, arg)) = d.split_once('=') else {
                bail!("`{d}` is not DAEMON=ARG");
            };
            if !ALL_DAEMONS.contains(&daemon) || arg.is_empty() {
                bail!("`{d}`: the daemon must be one of {}", ALL_DAEMONS.join(", "));
            }
            seen.insert(daemon);
        }
        if args.routing.is_some() {
            if args.etcd_endpoints.is_none() {
                bail!("--routing needs --etcd-endpoints: the nodes of a cluster find each other in etcd");
            }
            if cluster_pool {
                bail!(
                    "--routing with --ipam-mode cluster-pool is not supported yet: svc-identity publishes the \
                     pod CIDRs of --pool (node-pool)"
                );
            }
        }
        if args.underlay_interface.is_some() && args.create_netns {
            bail!(
                "--underlay-interface is read when `node up` starts: create the node's namespace with the \
                 interface in it first, then give --netns without --create-netns"
            );
        }
        if let Some(name) = &args.underlay_interface {
            let ok = !name.is_empty()
                && name.len() <= 15
                && name.bytes().all(|b| b.is_ascii_graphic() && b != b'/' && b != b':');
            if !ok {
                bail!("`{name}` is not an interface name (1 to 15 printable characters, no / or :)");
            }
        }
        if args.host_interface_prefix.is_empty() || args.host_interface_prefix.len() > 10 {
            bail!("--host-interface-prefix must be 1 to 10 characters (interface names are at most 15)");
        }
        let plan = Self {
            node_name: node_name.clone(),
            netns: args.netns.clone(),
            create_netns: args.create_netns,
            node_addresses,
            pools,
            ipam_pool: args.ipam_pool.clone().unwrap_or(first_pool),
            bin_dir: args.bin_dir.clone().unwrap_or_else(|| bin_dir_default.to_path_buf()),
            state_dir: state_dir.to_path_buf(),
            socket_dir: socket_dir.to_path_buf(),
            log_dir: args.log_dir.clone().unwrap_or_else(|| state_dir.join("logs")),
            pin_dir: pin_layout::pin_dir(&args.bpffs, &node_name)?,
            underlay: None,
            health_netns: if args.health_endpoint {
                Some(super::health_netns(&node_name)?)
            } else {
                None
            },
            args: args.clone(),
        };
        if args.kubeconfig.as_deref() == Some("") {
            bail!("--kubeconfig needs the path of a kubeconfig or `in-cluster`");
        }
        for daemon in plan.daemons() {
            let socket = plan.socket(daemon);
            if socket.as_os_str().len() > MAX_SOCKET_PATH {
                bail!(
                    "the socket path {} is longer than the {MAX_SOCKET_PATH} bytes a Unix socket allows: \
                     use a shorter --socket-dir",
                    socket.display()
                );
            }
        }
        Ok(plan)
    }

    /// The plan with the underlay interface `node up` read; refuses a vxlan
    /// node without an IPv4 underlay address (tunnel endpoints are IPv4)
    /// and an MTU too small for the encapsulation.
    pub fn with_underlay(mut self, underlay: Underlay) -> Result<Self> {
        if self.args.routing == Some(RoutingMode::Vxlan) {
            if !underlay.addresses.iter().any(std::net::IpAddr::is_ipv4) {
                bail!(
                    "--routing vxlan needs an IPv4 address on {}: tunnel endpoints are IPv4",
                    underlay.interface
                );
            }
            if underlay.mtu < 1280 + VXLAN_OVERHEAD && self.args.mtu.is_none() {
                bail!(
                    "{}'s MTU {} leaves pods less than IPv6's 1280 under VXLAN",
                    underlay.interface,
                    underlay.mtu
                );
            }
        }
        self.underlay = Some(underlay);
        Ok(self)
    }

    /// The pods' MTU: `--mtu`, else the underlay's minus the VXLAN
    /// overhead with `--routing vxlan`, else 1500.
    pub fn mtu(&self) -> u32 {
        match (self.args.mtu, self.args.routing, &self.underlay) {
            (Some(mtu), _, _) => mtu,
            (None, Some(RoutingMode::Vxlan), Some(u)) => u.mtu - VXLAN_OVERHEAD,
            _ => DEFAULT_MTU,
        }
    }

    /// Every CIDR of the svc-ipam pools (the node's pod CIDRs).
    fn pod_cidrs(&self) -> Vec<&str> {
        self.pools
            .iter()
            .filter_map(|p| p.split_once('='))
            .flat_map(|(_, cidrs)| cidrs.split(','))
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .collect()
    }

    /// The daemons this node runs, in start order: [`NODE_DAEMONS`](super::NODE_DAEMONS), and
    /// svc-k8s-sync before svc-endpoint with `--kubeconfig`.
    pub fn daemons(&self) -> Vec<&'static str> {
        ALL_DAEMONS
            .into_iter()
            .filter(|d| *d != K8S_SYNC || self.args.kubeconfig.is_some())
            .collect()
    }

    /// `<socket-dir>/<daemon>.sock`.
    pub fn socket(&self, daemon: &str) -> PathBuf {
        rivet_common::socket::socket_path(&self.socket_dir, daemon)
    }

    /// `/run/netns/<netns>`.
    pub fn netns_path(&self) -> Option<PathBuf> {
        self.netns.as_deref().map(netns::path)
    }

    /// The installed conflist.
    pub fn conflist_path(&self) -> PathBuf {
        self.args.cni_conf_dir.join(CONFLIST_FILE)
    }

    /// The installed rivet-cni.
    pub fn cni_binary_path(&self) -> PathBuf {
        self.args.cni_bin_dir.join(CNI_BINARY)
    }

    /// The [`COMPANION_PLUGINS`] and where each comes from: copied from
    /// `--cni-plugins-dir`, or kept when `--cni-bin-dir` has it already (a
    /// runtime's own install). An error names what is missing and where it
    /// was looked for.
    pub fn companion_plugins(&self) -> Result<Vec<CompanionPlugin>> {
        COMPANION_PLUGINS
            .iter()
            .map(|&name| {
                let target = self.args.cni_bin_dir.join(name);
                let source = self.args.cni_plugins_dir.join(name);
                let source = if target.is_file() {
                    None
                } else if source.is_file() {
                    Some(source)
                } else {
                    bail!(
                        "the CNI plugin `{name}` is in neither {} nor {}: runtimes need it beside rivet-cni \
                         (containerd sets up every pod's lo with it); install the reference plugins \
                         (Debian package containernetworking-plugins) or give --cni-plugins-dir DIR",
                        self.args.cni_plugins_dir.display(),
                        self.args.cni_bin_dir.display()
                    )
                };
                Ok(CompanionPlugin {
                    name: name.to_string(),
                    source,
                    target,
                })
            })
            .collect()
    }

    /// `<state-dir>/<daemon>`: the daemon's own state dir, its user's.
    pub fn daemon_state_dir(&self, daemon: &str) -> PathBuf {
        self.state_dir.join(daemon)
    }

    /// Uids that may call every method of daemon `name`: the
    /// [`accounts`](NodeAccounts::full_access_uids)' ones, and with
    /// `--kubeconfig` svc-k8s-sync's user on svc-endpoint (it feeds pod
    /// metadata and policies; without it every feed call was refused).
    fn full_access_uids(&self, accounts: &NodeAccounts, name: &str) -> Vec<u32> {
        let mut uids = accounts.full_access_uids(name);
        let feeder = accounts.of(K8S_SYNC).uid;
        let fed = match name {
            "svc-endpoint" => self.args.kubeconfig.is_some(),
            // Cluster-pool IPAM: svc-k8s-sync sets svc-ipam's pool (SetPool).
            "svc-ipam" => self.args.ipam_mode == IpamMode::ClusterPool,
            _ => false,
        };
        if fed && !uids.contains(&feeder) {
            uids.push(feeder);
        }
        uids
    }

    /// The node daemons, in start order, each switching to its user at start
    /// and admitting on its socket only who needs it ([`accounts`](crate::accounts)).
    pub fn specs(&self, accounts: &NodeAccounts) -> Vec<DaemonSpec> {
        self.daemons()
            .into_iter()
            .map(|name| {
                let ids = |ids: &[u32]| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
                let mut args: Vec<OsString> = vec![
                    "--socket-dir".into(),
                    self.socket_dir.clone().into(),
                    "--state-dir".into(),
                    self.daemon_state_dir(name).into(),
                    "--node-name".into(),
                    self.node_name.clone().into(),
                    "--user".into(),
                    accounts.of(name).name.clone().into(),
                    "--socket-gid".into(),
                    accounts.reader_gid.to_string().into(),
                    "--allowed-uids".into(),
                    ids(&self.full_access_uids(accounts, name)).into(),
                    "--read-only-gids".into(),
                    accounts.reader_gid.to_string().into(),
                ];
                match name {
                    "svc-ipam" => {
                        for p in &self.pools {
                            args.extend(["--pool".into(), p.into()]);
                        }
                    }
                    "svc-identity" => {
                        if let Some(etcd) = &self.args.etcd_endpoints {
                            args.extend(["--etcd-endpoints".into(), etcd.into()]);
                        }
                        if let Some(cluster) = &self.args.cluster_name {
                            args.extend(["--cluster-name".into(), cluster.into()]);
                        }
                        if let Some(routing) = self.args.routing {
                            args.extend(["--routing-mode".into(), routing.as_str().into()]);
                            args.extend(["--tunnel-port".into(), self.args.tunnel_port.to_string().into()]);
                            for ip in self.underlay.iter().flat_map(|u| &u.addresses) {
                                args.extend(["--node-address".into(), ip.to_string().into()]);
                            }
                            for cidr in self.pod_cidrs() {
                                args.extend(["--pod-cidr".into(), cidr.into()]);
                            }
                        }
                    }
                    LOADER => {
                        args.extend([
                            "--bpffs".into(),
                            self.args.bpffs.clone().into(),
                            "--endpoint-interface-prefix".into(),
                            self.args.host_interface_prefix.clone().into(),
                        ]);
                        if let (Some(routing), Some(interface)) = (self.args.routing, &self.args.underlay_interface) {
                            args.extend([
                                "--routing-mode".into(),
                                routing.as_str().into(),
                                "--underlay-interface".into(),
                                interface.into(),
                                "--tunnel-port".into(),
                                self.args.tunnel_port.to_string().into(),
                            ]);
                        }
                        for interface in &self.args.nodeport_interfaces {
                            args.extend(["--nodeport-interface".into(), interface.into()]);
                        }
                        if let Some(cgroup) = &self.args.socket_lb_cgroup {
                            args.extend(["--socket-lb-cgroup".into(), cgroup.clone().into()]);
                        }
                    }
                    GC => args.extend(["--bpffs".into(), self.args.bpffs.clone().into()]),
                    HEALTH => {
                        // Where peers probe /hello: the underlay's addresses in a cluster, else the node's.
                        let mut addresses: Vec<String> = self
                            .underlay
                            .iter()
                            .flat_map(|u| &u.addresses)
                            .map(ToString::to_string)
                            .collect();
                        if addresses.is_empty() {
                            addresses = self
                                .node_addresses
                                .iter()
                                .map(|a| a.split_once('/').map_or(a.as_str(), |(ip, _)| ip).to_string())
                                .collect();
                        }
                        for ip in addresses {
                            args.extend(["--node-address".into(), ip.into()]);
                        }
                        if let Some(ns) = &self.health_netns {
                            args.extend(["--health-netns".into(), netns::path(ns).into()]);
                        }
                    }
                    "svc-endpoint" => {
                        if self.args.kubeconfig.is_some() {
                            args.extend(["--k8s-sync-socket".into(), self.socket(K8S_SYNC).into()]);
                        }
                        for cidr in &self.args.service_cidrs {
                            args.extend(["--service-cidr".into(), cidr.to_string().into()]);
                        }
                    }
                    K8S_SYNC => {
                        args.extend([
                            "--kubeconfig".into(),
                            self.args.kubeconfig.clone().unwrap_or_default().into(),
                        ]);
                        for address in &self.node_addresses {
                            let ip = address.split_once('/').map_or(address.as_str(), |(ip, _)| ip);
                            args.extend(["--node-address".into(), ip.into()]);
                        }
                        if self.args.ipam_mode == IpamMode::ClusterPool {
                            args.extend(["--ipam-mode".into(), "cluster-pool".into()]);
                        }
                    }
                    _ => {}
                }
                for d in &self.args.daemon_args {
                    if let Some((daemon, arg)) = d.split_once('=')
                        && daemon == name
                    {
                        args.push(arg.into());
                    }
                }
                DaemonSpec {
                    name: name.to_string(),
                    program: self.bin_dir.join(name),
                    args,
                    // The datapath daemons live in the node's namespace (DESIGN.md §8), and so
                    // does svc-health (its probes leave from there).
                    netns: if matches!(name, LOADER | GC | HEALTH) {
                        self.netns_path()
                    } else {
                        None
                    },
                    socket: self.socket(name),
                    log: self.log_dir.join(format!("{name}.log")),
                }
            })
            .collect()
    }

    /// The network configuration list installed for runtimes.
    pub fn conflist(&self) -> Value {
        rivet_cni::install::Conflist {
            cni_version: self.args.cni_version.clone(),
            socket_dir: self.socket_dir.clone(),
            ipam_pool: self.ipam_pool.clone(),
            host_interface_prefix: self.args.host_interface_prefix.clone(),
            mtu: self.mtu(),
            log_file: Some(self.log_dir.join("rivet-cni.log")),
            timeout_seconds: self.args.cni_timeout_seconds,
            // The runtime's OTEL_EXPORTER_OTLP_ENDPOINT, if it has one.
            otlp_endpoint: None,
        }
        .to_json()
    }

    /// The initial node record.
    pub(super) fn record(&self, socket_dir_created: bool, specs: &[DaemonSpec]) -> NodeRecord {
        NodeRecord {
            node_name: self.node_name.clone(),
            phase: NodePhase::Starting,
            supervisor_pid: std::process::id(),
            started_unix_nanos: now_unix_nanos(),
            state_dir: self.state_dir.clone(),
            socket_dir: self.socket_dir.clone(),
            socket_dir_created,
            log_dir: self.log_dir.clone(),
            netns: self.netns.clone(),
            netns_path: self.netns_path(),
            netns_created: false,
            node_addresses: if self.create_netns {
                self.node_addresses.clone()
            } else {
                Vec::new()
            },
            pools: self.pools.clone(),
            pin_dir: self.pin_dir.clone(),
            cni_bin_dir: self.args.cni_bin_dir.clone(),
            cni_conf_dir: self.args.cni_conf_dir.clone(),
            conflist: self.conflist_path(),
            cni_binary: self.cni_binary_path(),
            cni_plugins: Vec::new(),
            health_netns: None,
            stop_grace_seconds: self.args.stop_grace_seconds,
            daemons: specs.iter().map(DaemonSpec::pending_status).collect(),
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::node::NODE_DAEMONS;
    use clap::Parser;
    use serde_json::json;

    use crate::pod;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    pub(in crate::node) fn args(extra: &[&str]) -> UpArgs {
        Cli::try_parse_from(std::iter::once("up").chain(extra.iter().copied()))
            .unwrap()
            .up
    }

    /// Each of `cases` (flags, part of the error) is refused with that error.
    fn assert_refused(cases: &[(Vec<&str>, &str)]) {
        for (bad, expected) in cases {
            let err = plan(bad).unwrap_err().to_string();
            assert!(err.contains(expected), "{bad:?}: {err}");
        }
    }

    pub(in crate::node) fn plan(extra: &[&str]) -> Result<NodePlan> {
        NodePlan::new(
            Path::new("/tmp/r/sockets"),
            Path::new("/tmp/r/state"),
            &args(extra),
            Path::new("/opt/rivet/bin"),
        )
    }

    /// Flags every daemon gets from `node up`.
    const COMMON: usize = 14;

    pub(in crate::node) fn test_accounts() -> NodeAccounts {
        let account = |name: &str, uid, gid| rivet_common::privileges::Account {
            name: name.into(),
            uid,
            gid,
            groups: vec![gid, 995],
        };
        NodeAccounts {
            daemon: account("rivet", 999, 994),
            datapath: account("rivet-datapath", 998, 994),
            reader_group: "rivet-readers".into(),
            reader_gid: 995,
        }
    }

    fn strings(v: &[OsString]) -> Vec<String> {
        v.iter().map(|a| a.to_string_lossy().into_owned()).collect()
    }

    #[test]
    fn netns_mode_has_defaults() {
        let p = plan(&["--netns", "rn1", "--create-netns"]).unwrap();
        assert_eq!(p.node_name, "rn1");
        assert_eq!(p.pools, [DEFAULT_NETNS_POOL]);
        assert_eq!(p.ipam_pool, "default");
        assert_eq!(p.node_addresses, DEFAULT_NODE_ADDRESSES);
        assert_eq!(p.pin_dir, Path::new("/sys/fs/bpf/rivet/rn1"));
        assert_eq!(p.log_dir, Path::new("/tmp/r/state/logs"));
        assert_eq!(p.netns_path(), Some(PathBuf::from("/run/netns/rn1")));
        // An existing namespace: no addresses are added to it.
        let p = plan(&["--netns", "rn1", "--node-name", "n"]).unwrap();
        assert_eq!(p.node_name, "n");
        assert!(p.node_addresses.is_empty());
    }

    #[test]
    fn host_mode_needs_pools_and_bad_input_is_refused() {
        let err = plan(&[]).unwrap_err().to_string();
        assert!(err.contains("--pool"), "{err}");
        let p = plan(&["--pool", "a=10.0.0.0/24", "--pool", "b=fd00::/64", "--node-name", "h1"]).unwrap();
        assert_eq!(p.ipam_pool, "a");
        assert!(p.netns_path().is_none());
        assert_refused(&[
            (vec!["--netns", "a/b"], "network namespace name"),
            (vec!["--netns", "n", "--pool", "nocidr"], "is not a pool"),
            (
                vec!["--netns", "n", "--create-netns", "--node-address", "1.2.3.4"],
                "prefix length",
            ),
            (
                vec!["--netns", "n", "--daemon-arg", "svc-operator=--x"],
                "must be one of",
            ),
            (vec!["--netns", "n", "--daemon-arg", "svc-ipam"], "DAEMON=ARG"),
            (vec!["--netns", "n", "--node-name", "a b"], "node name"),
            (
                vec!["--netns", "n", "--host-interface-prefix", "toolongprefix"],
                "1 to 10",
            ),
        ]);
        // --create-netns and --node-address need their companions.
        assert!(Cli::try_parse_from(["up", "--create-netns"]).is_err());
        assert!(Cli::try_parse_from(["up", "--netns", "n", "--node-address", "1.2.3.4/32"]).is_err());
    }

    #[test]
    fn socket_paths_must_fit() {
        let long = format!("/tmp/{}", "d".repeat(100));
        let err = NodePlan::new(
            Path::new(&long),
            Path::new("/s"),
            &args(&["--netns", "n"]),
            Path::new("/b"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("shorter --socket-dir"), "{err}");
    }

    #[test]
    fn a_kubeconfig_adds_svc_k8s_sync_before_svc_endpoint_in_kubernetes_mode() {
        let without = plan(&["--netns", "rn1", "--create-netns"]).unwrap();
        assert_eq!(
            without.daemons(),
            NODE_DAEMONS,
            "nothing Kubernetes without --kubeconfig"
        );
        let p = plan(&[
            "--netns",
            "rn1",
            "--create-netns",
            "--kubeconfig",
            "/etc/rivet/kubeconfig",
        ])
        .unwrap();
        let specs = p.specs(&test_accounts());
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "svc-ipam",
                "svc-identity",
                "svc-loader",
                "svc-k8s-sync",
                "svc-endpoint",
                "svc-gc",
                "svc-health"
            ]
        );
        assert_eq!(
            strings(&specs[3].args)[COMMON..],
            [
                "--kubeconfig",
                "/etc/rivet/kubeconfig",
                "--node-address",
                "198.19.0.1",
                "--node-address",
                "2001:2:0:ffff::1"
            ]
        );
        assert!(
            specs[3].netns.is_none(),
            "svc-k8s-sync talks to the API server from the host"
        );
        assert_eq!(
            strings(&specs[4].args)[COMMON..],
            [
                "--k8s-sync-socket",
                "/tmp/r/sockets/svc-k8s-sync.sock",
                "--service-cidr",
                "198.19.128.0/20",
                "--service-cidr",
                "2001:2:0:ff::/112"
            ]
        );
        // svc-k8s-sync's user may feed svc-endpoint; without Kubernetes only root.
        let allowed = |specs: &[DaemonSpec], name: &str| {
            let args = strings(&specs.iter().find(|s| s.name == name).unwrap().args);
            args[args.iter().position(|a| a == "--allowed-uids").unwrap() + 1].clone()
        };
        assert_eq!(allowed(&specs, "svc-endpoint"), "0,999");
        assert_eq!(allowed(&without.specs(&test_accounts()), "svc-endpoint"), "0");
        assert!(plan(&["--netns", "rn1", "--kubeconfig", ""]).is_err());
    }

    #[test]
    fn cluster_pool_starts_svc_ipam_without_a_pool_and_svc_k8s_sync_in_that_mode() {
        let p = plan(&[
            "--netns",
            "rn1",
            "--create-netns",
            "--kubeconfig",
            "/etc/rivet/kubeconfig",
            "--ipam-mode",
            "cluster-pool",
        ])
        .unwrap();
        assert!(p.pools.is_empty());
        assert_eq!(p.ipam_pool, "default", "svc-k8s-sync sets pool default");
        let specs = p.specs(&test_accounts());
        let args = |name: &str| strings(&specs.iter().find(|s| s.name == name).unwrap().args);
        let ipam = args("svc-ipam");
        assert!(!ipam.iter().any(|a| a == "--pool"), "{ipam:?}");
        assert_eq!(args("svc-k8s-sync")[COMMON + 2 + 4..], ["--ipam-mode", "cluster-pool"]);
        assert_refused(&[
            (
                vec!["--netns", "n", "--ipam-mode", "cluster-pool"],
                "needs --kubeconfig",
            ),
            (
                vec![
                    "--netns",
                    "n",
                    "--kubeconfig",
                    "k",
                    "--ipam-mode",
                    "cluster-pool",
                    "--pool",
                    "a=10.0.0.0/24",
                ],
                "exclude each other",
            ),
        ]);
    }

    fn underlay(addresses: &[&str], mtu: u32) -> Underlay {
        Underlay {
            interface: "ul0".into(),
            addresses: addresses.iter().map(|a| a.parse().unwrap()).collect(),
            mtu,
        }
    }

    #[test]
    fn the_socket_lb_cgroup_reaches_svc_loader_only_when_given() {
        let socket_lb = plan(&["--netns", "rn1", "--socket-lb-cgroup", "/sys/fs/cgroup/kubepods"]).unwrap();
        let specs = socket_lb.specs(&test_accounts());
        let loader = strings(&specs.iter().find(|s| s.name == "svc-loader").unwrap().args);
        assert!(
            loader.ends_with(&["--socket-lb-cgroup".to_owned(), "/sys/fs/cgroup/kubepods".to_owned()]),
            "{loader:?}"
        );
        let off = plan(&["--netns", "rn1"]).unwrap();
        assert!(
            off.specs(&test_accounts())
                .iter()
                .all(|s| !strings(&s.args).iter().any(|a| a == "--socket-lb-cgroup")),
            "off by default"
        );
    }

    #[test]
    fn routing_passes_the_mode_underlay_and_pod_cidrs_to_svc_identity_and_svc_loader() {
        let routed = |routing: &str, extra: &[&str]| {
            let mut a = vec![
                "--netns",
                "c1-n1",
                "--etcd-endpoints",
                "http://127.0.0.1:2379",
                "--pool",
                "default=198.18.1.0/24,2001:2:0:1::/64",
                "--routing",
                routing,
                "--underlay-interface",
                "ul0",
                "--cluster-name",
                "c1",
            ];
            a.extend(extra);
            plan(&a).unwrap()
        };
        let p = routed("vxlan", &[])
            .with_underlay(underlay(&["198.19.254.1", "2001:2:0:fe::1"], 1500))
            .unwrap();
        let specs = p.specs(&test_accounts());
        let args = |name: &str| strings(&specs.iter().find(|s| s.name == name).unwrap().args)[COMMON..].to_vec();
        assert_eq!(
            args("svc-identity"),
            [
                "--etcd-endpoints",
                "http://127.0.0.1:2379",
                "--cluster-name",
                "c1",
                "--routing-mode",
                "vxlan",
                "--tunnel-port",
                "8472",
                "--node-address",
                "198.19.254.1",
                "--node-address",
                "2001:2:0:fe::1",
                "--pod-cidr",
                "198.18.1.0/24",
                "--pod-cidr",
                "2001:2:0:1::/64",
            ]
        );
        assert_eq!(
            args("svc-loader")[4..],
            [
                "--routing-mode",
                "vxlan",
                "--underlay-interface",
                "ul0",
                "--tunnel-port",
                "8472"
            ]
        );
        assert_eq!(
            p.conflist()["plugins"][0]["mtu"],
            1450,
            "vxlan: the underlay's MTU - 50"
        );
        let given = routed("vxlan", &["--mtu", "1400"]).with_underlay(underlay(&["198.19.254.1"], 1500));
        assert_eq!(given.unwrap().mtu(), 1400, "--mtu wins");
        let native = routed("native", &[]).with_underlay(underlay(&["2001:2:0:fe::1"], 9000));
        assert_eq!(native.unwrap().mtu(), 1500, "native routing adds no header");
        let err = routed("vxlan", &[])
            .with_underlay(underlay(&["2001:2:0:fe::1"], 1500))
            .unwrap_err();
        assert!(err.to_string().contains("needs an IPv4 address on ul0"), "{err}");
        // Without --routing nothing of it reaches the daemons.
        let alone = plan(&["--netns", "rn1"]).unwrap();
        let specs = alone.specs(&test_accounts());
        assert!(
            specs
                .iter()
                .all(|s| !strings(&s.args).iter().any(|a| a == "--routing-mode"))
        );
        assert_eq!(alone.mtu(), 1500);

        assert_refused(&[
            (
                vec!["--netns", "n", "--routing", "native", "--underlay-interface", "ul0"],
                "needs --etcd-endpoints",
            ),
            (
                vec![
                    "--netns",
                    "n",
                    "--create-netns",
                    "--etcd-endpoints",
                    "e",
                    "--routing",
                    "native",
                    "--underlay-interface",
                    "ul0",
                ],
                "without --create-netns",
            ),
            (
                vec![
                    "--netns",
                    "n",
                    "--etcd-endpoints",
                    "e",
                    "--routing",
                    "native",
                    "--underlay-interface",
                    "a/b",
                ],
                "not an interface name",
            ),
            (
                vec![
                    "--netns",
                    "n",
                    "--etcd-endpoints",
                    "e",
                    "--routing",
                    "native",
                    "--underlay-interface",
                    "ul0",
                    "--kubeconfig",
                    "k",
                    "--ipam-mode",
                    "cluster-pool",
                ],
                "not supported yet",
            ),
        ]);
        // clap: each of --routing and --underlay-interface needs the other.
        for lone in [&["--routing", "native"][..], &["--underlay-interface", "ul0"][..]] {
            let parsed = Cli::try_parse_from(std::iter::once("up").chain(lone.iter().copied()));
            assert!(parsed.is_err(), "{lone:?} alone is refused");
        }
    }

    #[test]
    fn daemons_in_order_with_their_flags() {
        let p = plan(&[
            "--netns",
            "rn1",
            "--create-netns",
            "--etcd-endpoints",
            "http://127.0.0.1:2379",
            "--daemon-arg",
            "svc-endpoint=--dependency-poll-ms=200",
            "--host-interface-prefix",
            "rvc",
        ])
        .unwrap();
        let specs = p.specs(&test_accounts());
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, NODE_DAEMONS);
        let ipam = strings(&specs[0].args);
        assert_eq!(
            ipam[..COMMON],
            [
                "--socket-dir",
                "/tmp/r/sockets",
                "--state-dir",
                "/tmp/r/state/svc-ipam",
                "--node-name",
                "rn1",
                "--user",
                "rivet",
                "--socket-gid",
                "995",
                "--allowed-uids",
                "0,999",
                "--read-only-gids",
                "995",
            ]
        );
        assert_eq!(ipam[COMMON..], ["--pool", DEFAULT_NETNS_POOL]);
        assert_eq!(
            strings(&specs[1].args)[COMMON..],
            ["--etcd-endpoints", "http://127.0.0.1:2379"]
        );
        // Each daemon: its own state dir, its user, and full access only for who drives it.
        for (spec, user, uids) in [
            (&specs[1], "rivet", "0,999"),
            (&specs[2], "rivet-datapath", "0,999"),
            (&specs[3], "rivet", "0"),
            (&specs[4], "rivet-datapath", "0"),
        ] {
            let args = strings(&spec.args);
            assert_eq!(args[3], format!("/tmp/r/state/{}", spec.name));
            assert_eq!((args[7].as_str(), args[11].as_str()), (user, uids), "{}", spec.name);
        }
        // The datapath daemons, svc-loader and svc-gc, run in the namespace, via nsenter.
        let loader = &specs[2];
        assert_eq!(
            strings(&loader.command_line())[..4],
            ["nsenter", "--net=/run/netns/rn1", "--", "/opt/rivet/bin/svc-loader"]
        );
        assert_eq!(
            strings(&loader.args)[COMMON..],
            ["--bpffs", "/sys/fs/bpf", "--endpoint-interface-prefix", "rvc"]
        );
        let gc = &specs[4];
        assert_eq!(
            strings(&gc.command_line())[..4],
            ["nsenter", "--net=/run/netns/rn1", "--", "/opt/rivet/bin/svc-gc"]
        );
        assert_eq!(strings(&gc.args)[COMMON..], ["--bpffs", "/sys/fs/bpf"]);
        // svc-health too: its probes leave from the node's namespace, and it serves /hello on the
        // node's addresses there; it runs as the daemon user, reached read-only by the others.
        let health = &specs[5];
        assert_eq!(
            strings(&health.command_line())[..4],
            ["nsenter", "--net=/run/netns/rn1", "--", "/opt/rivet/bin/svc-health"]
        );
        assert_eq!(
            strings(&health.args)[COMMON..],
            ["--node-address", "198.19.0.1", "--node-address", "2001:2:0:ffff::1"]
        );
        assert_eq!(
            (strings(&health.args)[7].as_str(), strings(&health.args)[11].as_str()),
            ("rivet", "0")
        );
        assert_eq!(specs.iter().filter(|s| s.netns.is_some()).count(), 3);
        // The service CIDRs of every node by default, then --daemon-arg.
        assert_eq!(
            strings(&specs[3].args)[COMMON..],
            [
                "--service-cidr",
                "198.19.128.0/20",
                "--service-cidr",
                "2001:2:0:ff::/112",
                "--dependency-poll-ms=200"
            ]
        );
        assert_eq!(specs[3].socket, Path::new("/tmp/r/sockets/svc-endpoint.sock"));
        assert_eq!(specs[3].log, Path::new("/tmp/r/state/logs/svc-endpoint.log"));
        assert_eq!(strings(&specs[3].command_line())[0], "/opt/rivet/bin/svc-endpoint");
        // Without --etcd-endpoints: the embedded store (no flag).
        let p = plan(&["--netns", "rn1"]).unwrap();
        assert_eq!(p.specs(&test_accounts())[1].args.len(), COMMON);
    }

    #[test]
    fn conflist_is_what_rivet_cni_reads() {
        let p = plan(&["--netns", "rn1", "--mtu", "1400", "--cni-conf-dir", "/tmp/r/net.d"]).unwrap();
        let list = p.conflist();
        assert_eq!(
            list,
            json!({
                // The newest version containerd 1.6 and CRI-O read.
                "cniVersion": "1.0.0",
                "name": "rivet",
                "plugins": [{
                    "type": "rivet-cni",
                    "socketDir": "/tmp/r/sockets",
                    "ipamPool": "default",
                    "hostInterfacePrefix": "lxc",
                    "mtu": 1400,
                    "logFile": "/tmp/r/state/logs/rivet-cni.log",
                    "timeoutSeconds": 30,
                }],
            })
        );
        assert_eq!(p.conflist_path(), Path::new("/tmp/r/net.d/10-rivet.conflist"));
        // The pod commands read it back.
        let parsed = pod::NetworkConfigList::parse(&list.to_string()).unwrap();
        assert_eq!(parsed.plugin_types(), ["rivet-cni"]);
    }

    #[test]
    fn cni_version_flag_takes_what_rivet_cni_supports() {
        for version in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"] {
            let p = plan(&["--netns", "rn1", "--cni-version", version]).unwrap();
            assert_eq!(p.conflist()["cniVersion"], version);
        }
        for bad in ["0.2.0", "1.2.0", "1.1", ""] {
            let err = Cli::try_parse_from(["up", "--netns", "rn1", "--cni-version", bad]).unwrap_err();
            assert!(
                err.to_string().contains("1.0.0") && err.to_string().contains("1.1.0"),
                "{bad:?}: the error lists the supported versions: {err}"
            );
        }
    }

    #[test]
    fn loopback_comes_from_the_machines_plugins_unless_the_bin_dir_has_one() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("lib-cni");
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&source).unwrap();
        let p = plan(&[
            "--netns",
            "rn1",
            "--cni-bin-dir",
            bin.to_str().unwrap(),
            "--cni-plugins-dir",
            source.to_str().unwrap(),
        ])
        .unwrap();
        // Missing everywhere: a message naming the plugin, where it was
        // looked for and how to get it.
        let err = p.companion_plugins().unwrap_err().to_string();
        for want in [
            "loopback",
            source.to_str().unwrap(),
            bin.to_str().unwrap(),
            "containernetworking-plugins",
            "--cni-plugins-dir",
        ] {
            assert!(err.contains(want), "{want} in: {err}");
        }
        // In the machine's plugins: copied.
        std::fs::write(source.join("loopback"), "#!/bin/sh\n").unwrap();
        let plugins = p.companion_plugins().unwrap();
        assert_eq!(
            plugins,
            [CompanionPlugin {
                name: "loopback".into(),
                source: Some(source.join("loopback")),
                target: bin.join("loopback"),
            }]
        );
        // Already in the bin dir (a runtime's own install): kept, not ours.
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("loopback"), "theirs").unwrap();
        let plugins = p.companion_plugins().unwrap();
        assert_eq!(plugins[0].source, None, "{plugins:?}");
    }
}
