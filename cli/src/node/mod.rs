//! `rivet node up|down|status|list`: the node launcher.
//!
//! `rivet node up` starts every node daemon as its own process, in
//! dependency order — svc-ipam, svc-identity, svc-loader, svc-endpoint, svc-gc —
//! each one only once the previous one answers `GetInfo` on its socket, and
//! supervises them ([`NodeSupervisor`]): a daemon that exits is restarted
//! after a backoff (200 ms doubling to 30 s, reset once it ran 30 s), and one
//! that exits 5 times within 60 s is reported as crash-looping (and still
//! restarted, at the longest backoff). Each daemon's stdout and stderr are
//! appended to `<log-dir>/<daemon>.log`. Daemons run in their own process
//! groups, so a terminal's Ctrl-C reaches only the supervisor, which stops
//! them in order.
//!
//! Once the daemons are up it installs the CNI plugin: `rivet-cni` from the
//! bin dir into `--cni-bin-dir`, with `loopback` beside it (runtimes need
//! it; copied from `--cni-plugins-dir`, default /usr/lib/cni, unless the bin
//! dir has one: `node up` fails before starting anything when neither has
//! it), and `10-rivet.conflist` (cniVersion `--cni-version`, default 1.0.0,
//! network `rivet`, plugin `rivet-cni` with the socket dir, IPAM pool, host
//! interface prefix, MTU, log file and timeout) into `--cni-conf-dir`; the
//! conflist comes last, because a runtime starts using it as soon as it
//! appears. svc-identity uses its embedded store unless `--etcd-endpoints`
//! is given.
//!
//! Each daemon is started as root with `--user`: svc-ipam, svc-identity and
//! svc-endpoint switch to `--daemon-user` with no capabilities, svc-loader
//! and svc-gc to `--datapath-user` (svc-loader keeping CAP_BPF,
//! CAP_NET_ADMIN and CAP_PERFMON), and each socket admits full calls only
//! from root and the daemons that drive it, read-only calls from
//! `--reader-group` ([`crate::accounts`]). Before starting them, `node up`
//! gives each daemon `<state-dir>/<daemon>/` and the datapath user the pin dir.
//!
//! For demos and tests the node can live in a network namespace
//! (DESIGN.md §8): `--netns NAME` uses an existing one, `--create-netns`
//! creates it with IPv4/IPv6 forwarding on, IPv6 DAD off and the node
//! addresses on `lo` (so the kernel has a source address for ARP and ND
//! towards pods); svc-loader, svc-gc, and rivet-cni when `rivet pod` runs it, run
//! inside it via `nsenter --net` (not `ip netns exec`, which remounts /sys
//! and hides the bpffs). Pools default to 198.18.0.0/22 and 2001:2::/64 there.
//!
//! A node of a cluster (multi-node, DESIGN.md §9): `--routing native|vxlan`
//! with `--underlay-interface NAME` (an interface already in the node's
//! namespace: give `--netns` of an existing namespace) and
//! `--etcd-endpoints` (nodes meet there; `--cluster-name` names the
//! cluster). `node up` reads the interface's global addresses and MTU
//! before it starts anything, turns forwarding on in the node's namespace,
//! and passes svc-loader `--routing-mode`, `--underlay-interface` and
//! `--tunnel-port`, and svc-identity `--routing-mode`, `--tunnel-port`, the
//! interface's addresses as `--node-address` and the pools' CIDRs as
//! `--pod-cidr`. With vxlan the pod MTU is the interface's minus 50 unless
//! `--mtu` says otherwise. Cluster-pool IPAM is refused with `--routing`
//! (svc-identity publishes the pools of `--pool`). `rivet node list` shows
//! the cluster as svc-identity's registry sees it.
//!
//! `<state-dir>/node.json` describes the running node — its namespace,
//! directories, CNI files and the pid of every process — for `rivet pod`,
//! `rivet status` (which finds the socket dir there) and `rivet node down`.
//!
//! Stopping (SIGINT or SIGTERM to the supervisor; `rivet node down` sends
//! SIGTERM to the pid in node.json and waits): the conflist is removed, the
//! test pods of `rivet pod add` are deleted (CNI DEL, then their namespaces),
//! the daemons are stopped in reverse order (SIGTERM, SIGKILL after
//! `--stop-grace-seconds`), then everything the node created goes: the
//! installed rivet-cni and the `loopback` it copied, the pins under `<bpffs>/rivet/<node>`, the sockets
//! and their lock files, the socket dir if it created it, the network
//! namespace if it created it, and node.json. Logs and the daemons' state
//! stay. `rivet node up --detach` runs the same supervisor in the background
//! (its own output in `<log-dir>/node.log`) and returns once the node is up.
//! When the supervisor was killed without cleaning up, `rivet node down`
//! does the cleanup itself from node.json.
//!
//! Modules: `plan` (every path, flag and file of a node, from the
//! arguments), `list` (`rivet node list`), `supervisor` (start, readiness, restart with backoff, stop),
//! `record` (node.json), `up`, `down` (and the teardown both share), and
//! `render` (`rivet node status`, the supervision part of `rivet status`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, anyhow};
use clap::{Args, Subcommand};

use crate::Context;
use crate::accounts;

mod cleanup;
mod down;
mod health;
mod list;
mod plan;
mod prepare;
mod record;
mod render;
mod supervisor;
mod up;

pub use down::supervisor_alive;
pub use health::health_netns;
pub use plan::{CompanionPlugin, NodePlan, Underlay};
pub use record::{DaemonPhase, DaemonStatus, NodePhase, NodeRecord};
pub use render::{describe_node, describe_supervision};
pub use supervisor::{
    DaemonSpec, NodeSupervisor, RestartDecision, RestartPolicy, RestartTracker, StatusObserver, log_tail,
};

/// The sysctls of a node namespace (`--create-netns`, and the nodes of
/// `rivet cluster up`): forwarding on; DAD off, since host veths need a
/// usable link-local address at once.
pub const NODE_NETNS_SYSCTLS: &[(&str, &str)] = &[
    ("net.ipv4.ip_forward", "1"),
    ("net.ipv6.conf.all.forwarding", "1"),
    ("net.ipv6.conf.all.accept_dad", "0"),
    ("net.ipv6.conf.default.accept_dad", "0"),
];

/// The node daemons in start order (stopped in reverse). svc-gc comes after
/// svc-endpoint: it sweeps svc-loader's pinned conntrack maps and asks
/// svc-endpoint which endpoints exist. svc-health comes last: it probes the
/// peers svc-identity lists.
pub const NODE_DAEMONS: [&str; 6] = [
    "svc-ipam",
    "svc-identity",
    "svc-loader",
    "svc-endpoint",
    "svc-gc",
    HEALTH,
];

/// The Kubernetes watcher, started before svc-endpoint when `rivet node up`
/// is given `--kubeconfig` (svc-endpoint then runs in Kubernetes mode).
pub const K8S_SYNC: &str = "svc-k8s-sync";

/// Every daemon a node may run, for cleaning up sockets.
pub const ALL_DAEMONS: [&str; 7] = [
    "svc-ipam",
    "svc-identity",
    "svc-loader",
    K8S_SYNC,
    "svc-endpoint",
    "svc-gc",
    HEALTH,
];

/// The privileged datapath daemon that creates the pins.
const LOADER: &str = "svc-loader";

/// The conntrack garbage collector, the other datapath daemon.
const GC: &str = "svc-gc";

/// The prober between nodes: in the node's namespace (its probes leave
/// from there, and peers probe its `/hello` there), unprivileged.
const HEALTH: &str = "svc-health";

/// The CNI plugin binary, its conflist and the plugins beside it: shared
/// with `rivet-cni install` (the DaemonSet's init container).
pub use rivet_cni::install::{
    BINARY as CNI_BINARY, CNI_VERSIONS, COMPANION_PLUGINS, CONFLIST_FILE, DEFAULT_CNI_VERSION, NETWORK_NAME,
};

/// Where Debian's containernetworking-plugins are; `--cni-plugins-dir`.
pub const DEFAULT_CNI_PLUGINS_DIR: &str = "/usr/lib/cni";

/// The node record under the state dir.
pub const NODE_FILE: &str = "node.json";

/// Pools of a node in its own namespace when no `--pool` is given.
pub const DEFAULT_NETNS_POOL: &str = "default=198.18.0.0/22,2001:2::/64";

/// Addresses on `lo` of a created node namespace when no `--node-address` is given.
pub const DEFAULT_NODE_ADDRESSES: [&str; 2] = ["198.19.0.1/32", "2001:2:0:ffff::1/128"];

/// `rivet node ...`
#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// Start and supervise the node daemons and install the CNI plugin; runs
    /// until SIGINT/SIGTERM (or in the background with --detach).
    Up(Box<UpArgs>),
    /// Stop the node started with `rivet node up` (SIGTERM to its supervisor)
    /// and wait until everything it created is gone.
    Down {
        /// How long to wait for the supervisor to finish, seconds.
        #[arg(long, default_value_t = 120)]
        timeout_seconds: u64,
    },
    /// The node of node.json: namespace, directories and each daemon's pid,
    /// state and restarts.
    Status,
    /// Prepare the node's directories for daemons another supervisor starts
    /// (the Kubernetes DaemonSet's init container): the socket dir, each
    /// daemon's state dir and the pin dir, as `up` does before starting them.
    Prepare(PrepareArgs),
    /// Remove what `prepare` and `rivet-cni install` put on the node (CNI
    /// plugin and conflist, dead sockets, empty dirs) once svc-loader has
    /// removed its pins (no pod) and no daemon serves; otherwise keep
    /// everything. The Kubernetes
    /// DaemonSet's `cleanup` sidecar runs it with --wait-for-signal.
    Cleanup(CleanupArgs),
    /// The cluster's nodes as this node sees them (svc-identity's registry):
    /// name, underlay addresses, pod CIDRs, routing, health endpoint, boot
    /// id and who wrote the record; this node is marked `*`.
    List,
}

/// `rivet node prepare` (the socket and state dirs are the global
/// `--socket-dir` and `--state-dir`).
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct PrepareArgs {
    /// Node name (the pin dir is `<bpffs>/rivet/<node-name>`).
    #[arg(long)]
    pub node_name: String,
    /// Mount point of the BPF filesystem.
    #[arg(long, default_value = rivet_common::pin_layout::DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// The daemons' accounts.
    #[command(flatten)]
    pub accounts: AccountArgs,
}

/// The accounts the node's daemons run as (`rivet node up` and `prepare`).
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct AccountArgs {
    /// User of svc-ipam, svc-identity, svc-endpoint, svc-k8s-sync and
    /// svc-health, which run with no capabilities (`cargo xtask install`
    /// creates it).
    #[arg(long, value_name = "USER", default_value = accounts::DEFAULT_DAEMON_USER)]
    pub daemon_user: String,
    /// User of svc-loader (which keeps CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON)
    /// and svc-gc (none); the pins are this user's. Must differ from --daemon-user.
    #[arg(long, value_name = "USER", default_value = accounts::DEFAULT_DATAPATH_USER)]
    pub datapath_user: String,
    /// Group of the daemon sockets (a name or a GID; both users must be
    /// members): its members may make read-only calls (`rivet status`,
    /// `... list`, `rivet monitor`); changes need root.
    #[arg(long, value_name = "GROUP", default_value = accounts::DEFAULT_READER_GROUP)]
    pub reader_group: String,
}

impl AccountArgs {
    /// The accounts, looked up on this machine.
    pub fn resolve(&self) -> Result<accounts::NodeAccounts> {
        accounts::NodeAccounts::resolve(&self.daemon_user, &self.datapath_user, &self.reader_group)
    }
}

/// `rivet node cleanup` (the socket and state dirs are the global
/// `--socket-dir` and `--state-dir`).
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct CleanupArgs {
    /// Node name (the pin dir is `<bpffs>/rivet/<node-name>`).
    #[arg(long)]
    pub node_name: String,
    /// Mount point of the BPF filesystem.
    #[arg(long, default_value = rivet_common::pin_layout::DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// The runtime's CNI plugin directory.
    #[arg(long, value_name = "DIR")]
    pub cni_bin_dir: PathBuf,
    /// The runtime's CNI configuration directory.
    #[arg(long, value_name = "DIR")]
    pub cni_conf_dir: PathBuf,
    /// rivet-cni's log file (`rivet-cni install --log-file`).
    #[arg(long, value_name = "FILE")]
    pub cni_log_file: Option<PathBuf>,
    /// Wait for SIGTERM or SIGINT first (a container that runs until its pod ends).
    #[arg(long)]
    pub wait_for_signal: bool,
}

/// `rivet node up`.
#[derive(Debug, Clone, PartialEq, Eq, Args)]
pub struct UpArgs {
    /// Node name (pins go to `<bpffs>/rivet/<node-name>`); default: the
    /// network namespace's name, else the hostname.
    #[arg(long)]
    pub node_name: Option<String>,
    /// Run the node in this network namespace (svc-loader and the CNI
    /// plugin inside it).
    #[arg(long, value_name = "NAME")]
    pub netns: Option<String>,
    /// Create the --netns namespace (and delete it when the node stops).
    #[arg(long, requires = "netns")]
    pub create_netns: bool,
    /// An address (with prefix length) on `lo` of the created namespace;
    /// repeat for several. Default 198.19.0.1/32 and 2001:2:0:ffff::1/128.
    #[arg(long = "node-address", value_name = "CIDR", requires = "create_netns")]
    pub node_addresses: Vec<String>,
    /// An address pool of svc-ipam, NAME=CIDR[,CIDR...]; repeat for several.
    /// Default with --netns: default=198.18.0.0/22,2001:2::/64.
    #[arg(long = "pool", value_name = "NAME=CIDR,...")]
    pub pools: Vec<String>,
    /// Cluster-pool IPAM (`--ipam-mode cluster-pool`): svc-ipam starts
    /// without a pool and svc-k8s-sync hands it the pod CIDRs the operator
    /// allocates into this node's RivetNode (needs --kubeconfig). Default
    /// `node-pool`: svc-ipam's --pool flags.
    #[arg(long, value_enum, default_value_t = IpamMode::NodePool)]
    pub ipam_mode: IpamMode,
    /// The pool the CNI plugin allocates from; default: the first pool's name.
    #[arg(long)]
    pub ipam_pool: Option<String>,
    /// Where the daemon binaries and rivet-cni are; default: the directory
    /// of this `rivet`.
    #[arg(long, value_name = "DIR")]
    pub bin_dir: Option<PathBuf>,
    /// Daemon logs (`<daemon>.log`, `node.log`, `rivet-cni.log`); default `<state-dir>/logs`.
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// Where rivet-cni is installed.
    #[arg(long, value_name = "DIR", default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// Where 10-rivet.conflist is installed.
    #[arg(long, value_name = "DIR", default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
    /// cniVersion of the conflist (containerd 1.6 reads up to 1.0.0).
    #[arg(long, value_name = "VERSION", default_value = DEFAULT_CNI_VERSION,
          value_parser = clap::builder::PossibleValuesParser::new(CNI_VERSIONS))]
    pub cni_version: String,
    /// The machine's CNI plugins: `loopback`, which runtimes need beside
    /// rivet-cni, is copied from here into --cni-bin-dir unless that has one.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_CNI_PLUGINS_DIR)]
    pub cni_plugins_dir: PathBuf,
    /// Prefix of the pods' host-side veth names (CNI and svc-loader).
    #[arg(long, default_value = "lxc")]
    pub host_interface_prefix: String,
    /// MTU of pod interfaces; default 1500, or with `--routing vxlan` the
    /// underlay interface's MTU minus the 50 bytes of VXLAN encapsulation.
    #[arg(long)]
    pub mtu: Option<u32>,
    /// How pod traffic crosses nodes (multi-node; the same on every node of
    /// the cluster): `native` (pod CIDRs routed via the nodes' underlay
    /// addresses) or `vxlan` (a tunnel; the source identity rides in the
    /// VNI). Needs --etcd-endpoints (nodes meet there) and
    /// --underlay-interface. Without it the node is alone.
    #[arg(long, value_enum, requires = "underlay_interface")]
    pub routing: Option<RoutingMode>,
    /// The node's interface to the other nodes (in its namespace, existing
    /// before `node up`): its global addresses are the node's underlay
    /// addresses (svc-identity's --node-address), svc-loader routes and
    /// tunnels over it, and its MTU sets the vxlan pod MTU.
    #[arg(long, value_name = "NAME", requires = "routing")]
    pub underlay_interface: Option<String>,
    /// Socket-level load balancing: svc-loader attaches its cgroup
    /// connect/sendmsg/recvmsg/getpeername programs to this cgroup v2
    /// directory (on a real node the pods' cgroup, e.g. kubepods), so the
    /// sockets of its processes reach a ClusterIP's backend directly. Off
    /// by default: simulated nodes share the machine's cgroups, so one
    /// node's programs would translate other nodes' sockets (svc-loader's
    /// README has the measurement).
    #[arg(long, value_name = "DIR")]
    pub socket_lb_cgroup: Option<PathBuf>,
    /// UDP port of the VXLAN tunnel (`--routing vxlan`; Cilium's 8472).
    #[arg(long, default_value_t = DEFAULT_TUNNEL_PORT)]
    pub tunnel_port: u16,
    /// An interface of the node (in its namespace) where NodePort services
    /// are served to the outside, besides the underlay of --routing
    /// (repeatable; svc-loader's --nodeport-interface).
    #[arg(long = "nodeport-interface", value_name = "NAME")]
    pub nodeport_interfaces: Vec<String>,
    /// The cluster this node belongs to (svc-identity's `--cluster-name`:
    /// node records and IP cache keys are per cluster); default `default`.
    #[arg(long)]
    pub cluster_name: Option<String>,
    /// Deadline of each CNI call (the conflist's timeoutSeconds).
    #[arg(long, default_value_t = 30)]
    pub cni_timeout_seconds: u64,
    /// Connect the node to Kubernetes: start svc-k8s-sync with this
    /// kubeconfig (a path readable by --daemon-user, or `in-cluster`) and run
    /// svc-endpoint in Kubernetes mode (pod labels, namespace labels and
    /// policies from the API server). Without it nothing Kubernetes runs.
    #[arg(long, value_name = "PATH|in-cluster")]
    pub kubeconfig: Option<String>,
    /// etcd endpoints for svc-identity (comma-separated); default: its embedded store.
    #[arg(long)]
    pub etcd_endpoints: Option<String>,
    /// Mount point of the BPF filesystem.
    #[arg(long, default_value = rivet_common::pin_layout::DEFAULT_BPFFS)]
    pub bpffs: PathBuf,
    /// An extra flag for one daemon, DAEMON=ARG (e.g.
    /// `svc-endpoint=--policy-dir=/etc/rivet/policies`); repeat for several.
    #[arg(long = "daemon-arg", value_name = "DAEMON=ARG")]
    pub daemon_args: Vec<String>,
    /// The daemons' accounts.
    #[command(flatten)]
    pub accounts: AccountArgs,
    /// How long a daemon may take to answer on its socket, seconds.
    #[arg(long, default_value_t = 30)]
    pub ready_timeout_seconds: u64,
    /// Time between SIGTERM and SIGKILL when stopping a daemon, seconds.
    #[arg(long, default_value_t = 10)]
    pub stop_grace_seconds: u64,
    /// Run in the background; return once the node is up.
    #[arg(long)]
    pub detach: bool,
    /// Give the node a health endpoint (namespace `hlth-<node>`, wired by rivet-cni with the reserved
    /// `health` identity): the other nodes' svc-health probe it through the pod datapath, and this
    /// node's svc-health probes theirs from it. `rivet cluster up` gives every node one.
    #[arg(long)]
    pub health_endpoint: bool,
    /// Where Services' cluster IPs come from (svc-endpoint's
    /// --service-cidr), at most one CIDR per family; repeat for both.
    #[arg(long = "service-cidr", value_name = "CIDR",
          default_values_t = [DEFAULT_SERVICE_CIDR4.parse::<ipnet::IpNet>().expect("a CIDR"),
                              DEFAULT_SERVICE_CIDR6.parse::<ipnet::IpNet>().expect("a CIDR")])]
    pub service_cidrs: Vec<ipnet::IpNet>,
}

/// The IPv4 service CIDR of `rivet node up` and `rivet cluster up`.
pub const DEFAULT_SERVICE_CIDR4: &str = "198.19.128.0/20";

/// The IPv6 service CIDR of `rivet node up` and `rivet cluster up`.
pub const DEFAULT_SERVICE_CIDR6: &str = "2001:2:0:ff::/112";

/// The VXLAN UDP port unless `--tunnel-port` says otherwise.
pub const DEFAULT_TUNNEL_PORT: u16 = 8472;

/// Bytes VXLAN adds to a packet on an IPv4 underlay (outer IPv4, UDP,
/// VXLAN and inner Ethernet headers): the pod MTU is the underlay's minus
/// this.
pub const VXLAN_OVERHEAD: u32 = 50;

/// How pod traffic crosses nodes (`--routing`; also `rivet cluster up
/// --routing` and its cluster.json).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoutingMode {
    /// Pod CIDRs routed via the peers' underlay addresses.
    #[default]
    Native,
    /// A collect-metadata VXLAN device.
    Vxlan,
}

impl RoutingMode {
    /// The daemons' `--routing-mode` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Vxlan => "vxlan",
        }
    }
}

/// Where the node's pod CIDRs come from (`--ipam-mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum IpamMode {
    /// svc-ipam's `--pool` flags.
    #[default]
    NodePool,
    /// The operator's allocation in the node's RivetNode, via svc-k8s-sync.
    ClusterPool,
}

/// Runs `rivet node ...`.
pub async fn run(ctx: &Context, state_dir: &Path, command: NodeCommand) -> Result<bool> {
    match command {
        NodeCommand::Up(args) => up::up(ctx, state_dir, &args).await,
        NodeCommand::Down { timeout_seconds } => down::down(state_dir, Duration::from_secs(timeout_seconds)).await,
        NodeCommand::Prepare(args) => prepare::prepare(&ctx.socket_dir, state_dir, &args),
        NodeCommand::Cleanup(args) => cleanup::cleanup(&ctx.socket_dir, state_dir, &args).await,
        NodeCommand::List => list::list(ctx).await.map(|()| true).map_err(Into::into),
        NodeCommand::Status => {
            let record = NodeRecord::load(state_dir)?.ok_or_else(|| no_node(state_dir))?;
            ctx.print(&record, || describe_node(&record));
            Ok(true)
        }
    }
}

fn no_node(state_dir: &Path) -> anyhow::Error {
    anyhow!(
        "no node recorded in {} (start one with `rivet --state-dir {} node up`)",
        state_dir.join(NODE_FILE).display(),
        state_dir.display()
    )
}
