//! `rivet node up|down|status`: the single-node launcher.
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
//! `--operator-group` ([`crate::accounts`]). Before starting them, `node up`
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

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::{Args, Subcommand};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rivet_common::grpc::{ClientOptions, connect_unix};
use rivet_common::privileges::CapabilityList;
use rivet_common::state_file::{StateFile, write_atomic};
use rivet_proto::daemon::v1::{GetInfoRequest, daemon_client::DaemonClient};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::accounts::{self, NodeAccounts};
use crate::table::Table;
use crate::{Context, age, netns, now_unix_nanos, pod};

/// The node daemons in start order (stopped in reverse). svc-gc comes last:
/// it sweeps svc-loader's pinned conntrack maps and asks svc-endpoint which
/// endpoints exist.
pub const NODE_DAEMONS: [&str; 5] = ["svc-ipam", "svc-identity", "svc-loader", "svc-endpoint", "svc-gc"];

/// The privileged datapath daemon that creates the pins.
const LOADER: &str = "svc-loader";

/// The conntrack garbage collector, the other datapath daemon.
const GC: &str = "svc-gc";

/// The CNI plugin binary.
pub const CNI_BINARY: &str = "rivet-cni";

/// File name of the installed network configuration list.
pub const CONFLIST_FILE: &str = "10-rivet.conflist";

/// Network name in the conflist.
pub const NETWORK_NAME: &str = "rivet";

/// The CNI spec versions rivet-cni reads (its VERSION verb's
/// `supportedVersions`), oldest first; `--cni-version` takes one of them.
pub const CNI_VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// cniVersion of the conflist unless `--cni-version` says otherwise: the
/// newest version common runtimes read (containerd 1.6's libcni refuses
/// 1.1.0 results). rivet-cni still answers 1.1.0 to a conflist asking for it.
pub const DEFAULT_CNI_VERSION: &str = "1.0.0";

/// Plugins a runtime runs beside rivet-cni from the CNI bin dir:
/// containerd's CRI plugin sets up every pod's `lo` with `loopback`, and a
/// sandbox whose `loopback` is missing fails (and so does its cleanup).
pub const COMPANION_PLUGINS: [&str; 1] = ["loopback"];

/// Where Debian's containernetworking-plugins are; `--cni-plugins-dir`.
pub const DEFAULT_CNI_PLUGINS_DIR: &str = "/usr/lib/cni";

/// The node record under the state dir.
pub const NODE_FILE: &str = "node.json";

/// Schema version of node.json.
const NODE_SCHEMA: u32 = 1;

/// Pools of a node in its own namespace when no `--pool` is given.
pub const DEFAULT_NETNS_POOL: &str = "default=198.18.0.0/22,2001:2::/64";

/// Addresses on `lo` of a created node namespace when no `--node-address` is given.
pub const DEFAULT_NODE_ADDRESSES: [&str; 2] = ["198.19.0.1/32", "2001:2:0:ffff::1/128"];

/// Set in the environment of the background supervisor of `--detach`.
const DETACHED_ENV: &str = "RIVET_NODE_DETACHED";

/// Longest Unix socket path (`sun_path` is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// How often readiness is probed.
const READY_POLL: Duration = Duration::from_millis(50);

/// Log lines quoted when a daemon fails to start or crash-loops.
const LOG_TAIL_LINES: usize = 12;

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
    /// MTU of pod interfaces.
    #[arg(long, default_value_t = 1500)]
    pub mtu: u32,
    /// Deadline of each CNI call (the conflist's timeoutSeconds).
    #[arg(long, default_value_t = 30)]
    pub cni_timeout_seconds: u64,
    /// etcd endpoints for svc-identity (comma-separated); default: its embedded store.
    #[arg(long)]
    pub etcd_endpoints: Option<String>,
    /// Mount point of the BPF filesystem.
    #[arg(long, default_value = "/sys/fs/bpf")]
    pub bpffs: PathBuf,
    /// An extra flag for one daemon, DAEMON=ARG (e.g.
    /// `svc-endpoint=--policy-dir=/etc/rivet/policies`); repeat for several.
    #[arg(long = "daemon-arg", value_name = "DAEMON=ARG")]
    pub daemon_args: Vec<String>,
    /// User of svc-ipam, svc-identity and svc-endpoint, which run with no
    /// capabilities (`cargo xtask install` creates it).
    #[arg(long, value_name = "USER", default_value = accounts::DEFAULT_DAEMON_USER)]
    pub daemon_user: String,
    /// User of svc-loader (which keeps CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON)
    /// and svc-gc (none); the pins are this user's. Must differ from --daemon-user.
    #[arg(long, value_name = "USER", default_value = accounts::DEFAULT_DATAPATH_USER)]
    pub datapath_user: String,
    /// Group of the daemon sockets: its members may make read-only calls
    /// (`rivet status`, `... list`, `rivet monitor`); changes need root.
    #[arg(long, value_name = "GROUP", default_value = accounts::DEFAULT_OPERATOR_GROUP)]
    pub operator_group: String,
    /// How long a daemon may take to answer on its socket, seconds.
    #[arg(long, default_value_t = 30)]
    pub ready_timeout_seconds: u64,
    /// Time between SIGTERM and SIGKILL when stopping a daemon, seconds.
    #[arg(long, default_value_t = 10)]
    pub stop_grace_seconds: u64,
    /// Run in the background; return once the node is up.
    #[arg(long)]
    pub detach: bool,
}

// ---------------------------------------------------------------------------
// The node record.

/// Where the node is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodePhase {
    /// Starting daemons.
    Starting,
    /// Every daemon answered; the CNI plugin is installed.
    Running,
    /// Tearing down.
    Stopping,
}

/// What a supervised daemon is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DaemonPhase {
    /// Not started yet.
    Pending,
    /// Started, not answering yet.
    Starting,
    /// Answering on its socket.
    Running,
    /// Exited; waiting for the backoff before a restart.
    Restarting,
    /// Exiting over and over; still restarted, at the longest backoff.
    CrashLoop,
    /// Stopped by the supervisor.
    Stopped,
}

impl DaemonPhase {
    /// As printed.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Restarting => "restarting",
            Self::CrashLoop => "crash-loop",
            Self::Stopped => "stopped",
        }
    }
}

/// One daemon as the supervisor sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonStatus {
    /// Daemon name.
    pub name: String,
    /// Its current process.
    pub pid: Option<u32>,
    /// What it is doing.
    pub phase: DaemonPhase,
    /// Restarts after an unexpected exit.
    pub restarts: u32,
    /// When the current process started, Unix nanoseconds.
    pub started_unix_nanos: i64,
    /// How the last process ended (`signal 9 (SIGKILL)`, `exit status 1`).
    pub last_exit: Option<String>,
    /// When, Unix nanoseconds; 0 never.
    pub last_exit_unix_nanos: i64,
    /// Its socket.
    pub socket: PathBuf,
    /// Its log file.
    pub log: PathBuf,
}

/// `<state-dir>/node.json`: the running node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// Node name.
    pub node_name: String,
    /// Lifecycle phase.
    pub phase: NodePhase,
    /// Pid of `rivet node up` (the supervisor).
    pub supervisor_pid: u32,
    /// Start, Unix nanoseconds.
    pub started_unix_nanos: i64,
    /// The daemons' state dir (also of node.json and the pod records).
    pub state_dir: PathBuf,
    /// The daemons' socket dir.
    pub socket_dir: PathBuf,
    /// Whether the node created the socket dir (and removes it).
    pub socket_dir_created: bool,
    /// Logs.
    pub log_dir: PathBuf,
    /// The node's network namespace, if any.
    pub netns: Option<String>,
    /// `/run/netns/<netns>`.
    pub netns_path: Option<PathBuf>,
    /// Whether the node created the namespace (and deletes it).
    pub netns_created: bool,
    /// Addresses put on `lo` of a created namespace.
    pub node_addresses: Vec<String>,
    /// svc-ipam's pools.
    pub pools: Vec<String>,
    /// `<bpffs>/rivet/<node-name>`.
    pub pin_dir: PathBuf,
    /// Where rivet-cni is installed.
    pub cni_bin_dir: PathBuf,
    /// Where the conflist is installed.
    pub cni_conf_dir: PathBuf,
    /// The installed conflist.
    pub conflist: PathBuf,
    /// The installed rivet-cni.
    pub cni_binary: PathBuf,
    /// Companion plugins (`loopback`) the node copied into the CNI bin dir
    /// and removes when it stops; one that was there already is not listed.
    #[serde(default)]
    pub cni_plugins: Vec<PathBuf>,
    /// SIGTERM → SIGKILL grace of each daemon, seconds.
    pub stop_grace_seconds: u64,
    /// The daemons, in start order.
    pub daemons: Vec<DaemonStatus>,
}

impl NodeRecord {
    fn file(state_dir: &Path) -> StateFile<Self> {
        StateFile::new(state_dir.join(NODE_FILE), "node", NODE_SCHEMA)
    }

    /// The node of `state_dir`, if one is recorded.
    pub fn load(state_dir: &Path) -> Result<Option<Self>> {
        Ok(Self::file(state_dir).load()?)
    }

    /// Writes node.json (atomically).
    pub fn store(&self) -> Result<()> {
        Ok(Self::file(&self.state_dir).store(self)?)
    }

    /// The status of daemon `name`.
    pub fn daemon(&self, name: &str) -> Option<&DaemonStatus> {
        self.daemons.iter().find(|d| d.name == name)
    }
}

// ---------------------------------------------------------------------------
// Supervision.

/// How a node daemon is started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonSpec {
    /// Daemon name, e.g. `svc-ipam`.
    pub name: String,
    /// Its binary.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Run inside this network namespace (`nsenter --net=<path>`).
    pub netns: Option<PathBuf>,
    /// The socket it answers `GetInfo` on once ready.
    pub socket: PathBuf,
    /// stdout and stderr are appended here.
    pub log: PathBuf,
}

impl DaemonSpec {
    /// The command line, program first (`nsenter --net=... -- <program>
    /// ...` for a daemon in a namespace).
    pub fn command_line(&self) -> Vec<OsString> {
        let mut line = Vec::new();
        if let Some(ns) = &self.netns {
            let mut net = OsString::from("--net=");
            net.push(ns);
            line.extend([OsString::from("nsenter"), net, OsString::from("--")]);
        }
        line.push(self.program.clone().into_os_string());
        line.extend(self.args.iter().cloned());
        line
    }

    /// Starts it: own process group, stdin closed, output appended to its log.
    fn spawn(&self) -> std::io::Result<Child> {
        if let Some(dir) = self.log.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut log = OpenOptions::new().create(true).append(true).open(&self.log)?;
        let line = self.command_line();
        writeln!(
            log,
            "==== rivet node: starting {} at {}: {}",
            self.name,
            now_unix_nanos() / 1_000_000_000,
            line.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
        )?;
        let mut cmd = Command::new(&line[0]);
        cmd.args(&line[1..])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .kill_on_drop(false);
        cmd.spawn()
            .map_err(|e| std::io::Error::new(e.kind(), format!("starting {}: {e}", line[0].to_string_lossy())))
    }
}

/// When and how often a daemon that exits is restarted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Delay before the first restart.
    pub initial_backoff: Duration,
    /// The delay doubles per exit up to this.
    pub max_backoff: Duration,
    /// A process that ran this long counts as healthy: its exit starts the
    /// backoff and the crash count over.
    pub healthy_after: Duration,
    /// Exits counted for crash-loop detection are those within this window…
    pub crash_loop_window: Duration,
    /// …and this many of them make a crash loop.
    pub crash_loop_exits: usize,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
            healthy_after: Duration::from_secs(30),
            crash_loop_window: Duration::from_secs(60),
            crash_loop_exits: 5,
        }
    }
}

/// What to do after an exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartDecision {
    /// Wait this long, then restart.
    pub delay: Duration,
    /// The daemon is crash-looping.
    pub crash_loop: bool,
    /// …and this exit made it one (report it once).
    pub entered_crash_loop: bool,
    /// Exits within the window, this one included.
    pub recent_exits: usize,
}

/// The restart policy applied to one daemon's exits (pure: time is given).
#[derive(Debug, Clone)]
pub struct RestartTracker {
    policy: RestartPolicy,
    next_delay: Duration,
    exits: VecDeque<Instant>,
    crash_loop: bool,
}

impl RestartTracker {
    /// A tracker with no exits yet.
    pub fn new(policy: RestartPolicy) -> Self {
        Self {
            next_delay: policy.initial_backoff,
            policy,
            exits: VecDeque::new(),
            crash_loop: false,
        }
    }

    /// Records an exit at `now` of a process that ran `uptime`.
    pub fn on_exit(&mut self, now: Instant, uptime: Duration) -> RestartDecision {
        if uptime >= self.policy.healthy_after {
            self.next_delay = self.policy.initial_backoff;
            self.exits.clear();
            self.crash_loop = false;
        }
        self.exits.push_back(now);
        while let Some(first) = self.exits.front() {
            if now.duration_since(*first) > self.policy.crash_loop_window {
                self.exits.pop_front();
            } else {
                break;
            }
        }
        let delay = self.next_delay;
        self.next_delay = (self.next_delay * 2).min(self.policy.max_backoff);
        let crash_loop = self.exits.len() >= self.policy.crash_loop_exits;
        let entered = crash_loop && !self.crash_loop;
        self.crash_loop = crash_loop;
        RestartDecision {
            delay,
            crash_loop,
            entered_crash_loop: entered,
            recent_exits: self.exits.len(),
        }
    }
}

/// How a readiness wait ended.
enum Readiness {
    Ready,
    Exited(String),
    TimedOut,
    Stopped,
}

/// Called with every daemon's status whenever one changes.
pub type StatusObserver = Arc<dyn Fn(&[DaemonStatus]) + Send + Sync>;

/// What every supervising task shares.
#[derive(Clone)]
struct Shared {
    statuses: Arc<Mutex<Vec<DaemonStatus>>>,
    observer: StatusObserver,
    policy: RestartPolicy,
    ready_timeout: Duration,
    stop_grace: Duration,
}

impl Shared {
    fn update(&self, name: &str, f: impl FnOnce(&mut DaemonStatus)) {
        let snapshot = {
            let mut statuses = self.statuses.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(s) = statuses.iter_mut().find(|s| s.name == name) {
                f(s);
            }
            statuses.clone()
        };
        (self.observer)(&snapshot);
    }
}

/// Starts daemons in order, restarts them when they exit, stops them in
/// reverse order.
///
/// ```no_run
/// # async fn t(specs: Vec<rivet_cli::node::DaemonSpec>) -> anyhow::Result<()> {
/// use std::sync::Arc;
/// use std::time::Duration;
/// use rivet_cli::node::{NodeSupervisor, RestartPolicy};
/// let mut supervisor = NodeSupervisor::new(
///     specs,
///     RestartPolicy::default(),
///     Duration::from_secs(30),
///     Duration::from_secs(10),
///     Arc::new(|statuses| eprintln!("{statuses:?}")),
/// );
/// let (_stop_tx, stop) = tokio::sync::watch::channel(false);
/// supervisor.start(&stop).await?;
/// // ... until told to stop:
/// supervisor.stop().await;
/// # Ok(()) }
/// ```
pub struct NodeSupervisor {
    specs: Vec<DaemonSpec>,
    shared: Shared,
    /// Supervising tasks of started daemons, in start order.
    tasks: Vec<(watch::Sender<bool>, JoinHandle<()>)>,
}

impl std::fmt::Debug for NodeSupervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeSupervisor")
            .field("specs", &self.specs)
            .field("started", &self.tasks.len())
            .finish()
    }
}

impl NodeSupervisor {
    /// A supervisor for `specs` (in start order); nothing runs yet.
    pub fn new(
        specs: Vec<DaemonSpec>,
        policy: RestartPolicy,
        ready_timeout: Duration,
        stop_grace: Duration,
        observer: StatusObserver,
    ) -> Self {
        let statuses = specs
            .iter()
            .map(|s| DaemonStatus {
                name: s.name.clone(),
                pid: None,
                phase: DaemonPhase::Pending,
                restarts: 0,
                started_unix_nanos: 0,
                last_exit: None,
                last_exit_unix_nanos: 0,
                socket: s.socket.clone(),
                log: s.log.clone(),
            })
            .collect();
        Self {
            specs,
            shared: Shared {
                statuses: Arc::new(Mutex::new(statuses)),
                observer,
                policy,
                ready_timeout,
                stop_grace,
            },
            tasks: Vec::new(),
        }
    }

    /// Every daemon's status.
    pub fn statuses(&self) -> Vec<DaemonStatus> {
        self.shared
            .statuses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Starts the daemons in order, each once the previous one answers;
    /// from then on each is supervised. Fails (leaving the started ones
    /// running, for [`stop`](Self::stop)) when one exits or does not answer
    /// in time, or when `cancel` turns true.
    pub async fn start(&mut self, cancel: &watch::Receiver<bool>) -> Result<()> {
        for spec in self.specs.clone() {
            if *cancel.borrow() {
                bail!("interrupted while starting the node");
            }
            let started = Instant::now();
            let mut child = spec.spawn()?;
            let pid = child.id();
            self.shared.update(&spec.name, |s| {
                s.pid = pid;
                s.phase = DaemonPhase::Starting;
                s.started_unix_nanos = now_unix_nanos();
            });
            let mut cancel = cancel.clone();
            match wait_ready(&spec, &mut child, self.shared.ready_timeout, &mut cancel).await {
                Readiness::Ready => {}
                outcome => {
                    terminate(&mut child, self.shared.stop_grace).await;
                    self.shared.update(&spec.name, |s| {
                        s.pid = None;
                        s.phase = DaemonPhase::Stopped;
                    });
                    let why = match outcome {
                        Readiness::Exited(status) => format!("exited while starting ({status})"),
                        Readiness::TimedOut => format!(
                            "did not answer on {} within {}s",
                            spec.socket.display(),
                            self.shared.ready_timeout.as_secs()
                        ),
                        _ => "interrupted while starting".into(),
                    };
                    bail!(
                        "{} {why}; the end of {}:\n{}",
                        spec.name,
                        spec.log.display(),
                        log_tail(&spec.log, LOG_TAIL_LINES)
                    );
                }
            }
            self.shared.update(&spec.name, |s| s.phase = DaemonPhase::Running);
            eprintln!(
                "rivet node: {} is up (pid {}, {} ms)",
                spec.name,
                pid.unwrap_or_default(),
                started.elapsed().as_millis()
            );
            let (stop_tx, stop_rx) = watch::channel(false);
            let task = tokio::spawn(supervise(spec, child, started, self.shared.clone(), stop_rx));
            self.tasks.push((stop_tx, task));
        }
        Ok(())
    }

    /// Stops the started daemons in reverse order: SIGTERM, SIGKILL after
    /// the grace period. A daemon waiting for a restart is not restarted.
    pub async fn stop(&mut self) {
        while let Some((stop, task)) = self.tasks.pop() {
            let _ = stop.send(true);
            let _ = task.await;
        }
    }
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Supervises one running daemon until told to stop.
async fn supervise(
    spec: DaemonSpec,
    mut child: Child,
    mut started: Instant,
    shared: Shared,
    mut stop: watch::Receiver<bool>,
) {
    let mut tracker = RestartTracker::new(shared.policy.clone());
    loop {
        let status = tokio::select! {
            status = child.wait() => status,
            () = stopped(&mut stop) => {
                shared.update(&spec.name, |s| s.phase = DaemonPhase::Stopped);
                terminate(&mut child, shared.stop_grace).await;
                shared.update(&spec.name, |s| s.pid = None);
                eprintln!("rivet node: {} stopped", spec.name);
                return;
            }
        };
        let mut exit = match status {
            Ok(status) => describe_exit(status),
            Err(e) => format!("lost track of it: {e}"),
        };
        // Restart until one answers again, or until told to stop.
        loop {
            let decision = tracker.on_exit(Instant::now(), started.elapsed());
            shared.update(&spec.name, |s| {
                s.pid = None;
                s.phase = if decision.crash_loop {
                    DaemonPhase::CrashLoop
                } else {
                    DaemonPhase::Restarting
                };
                s.restarts += 1;
                s.last_exit = Some(exit.clone());
                s.last_exit_unix_nanos = now_unix_nanos();
            });
            eprintln!(
                "rivet node: {} exited ({exit}) after {:.1}s; restarting in {} ms",
                spec.name,
                started.elapsed().as_secs_f64(),
                decision.delay.as_millis()
            );
            if decision.entered_crash_loop {
                eprintln!(
                    "rivet node: {} is crash-looping: {} exits within {}s; it keeps being restarted \
                     with backoff up to {}s. The end of {}:\n{}",
                    spec.name,
                    decision.recent_exits,
                    shared.policy.crash_loop_window.as_secs(),
                    shared.policy.max_backoff.as_secs(),
                    spec.log.display(),
                    log_tail(&spec.log, LOG_TAIL_LINES)
                );
            }
            tokio::select! {
                () = tokio::time::sleep(decision.delay) => {}
                () = stopped(&mut stop) => {
                    shared.update(&spec.name, |s| s.phase = DaemonPhase::Stopped);
                    eprintln!("rivet node: {} stopped (was waiting to restart)", spec.name);
                    return;
                }
            }
            started = Instant::now();
            let mut next = match spec.spawn() {
                Ok(c) => c,
                Err(e) => {
                    exit = format!("could not start: {e}");
                    continue;
                }
            };
            let pid = next.id();
            shared.update(&spec.name, |s| {
                s.pid = pid;
                s.phase = DaemonPhase::Starting;
                s.started_unix_nanos = now_unix_nanos();
            });
            match wait_ready(&spec, &mut next, shared.ready_timeout, &mut stop).await {
                Readiness::Ready => {
                    shared.update(&spec.name, |s| s.phase = DaemonPhase::Running);
                    eprintln!(
                        "rivet node: {} is up again (pid {}, {} ms)",
                        spec.name,
                        pid.unwrap_or_default(),
                        started.elapsed().as_millis()
                    );
                    child = next;
                    break;
                }
                Readiness::Exited(status) => exit = format!("{status}, while starting"),
                Readiness::TimedOut => {
                    terminate(&mut next, shared.stop_grace).await;
                    exit = format!("not answering within {}s", shared.ready_timeout.as_secs());
                }
                Readiness::Stopped => {
                    shared.update(&spec.name, |s| s.phase = DaemonPhase::Stopped);
                    terminate(&mut next, shared.stop_grace).await;
                    shared.update(&spec.name, |s| s.pid = None);
                    eprintln!("rivet node: {} stopped", spec.name);
                    return;
                }
            }
        }
    }
}

/// Waits until the daemon answers `GetInfo` on its socket with its own pid.
async fn wait_ready(
    spec: &DaemonSpec,
    child: &mut Child,
    timeout: Duration,
    stop: &mut watch::Receiver<bool>,
) -> Readiness {
    let deadline = Instant::now() + timeout;
    let pid = child.id();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Readiness::Exited(describe_exit(status)),
            Ok(None) => {}
            Err(e) => return Readiness::Exited(format!("lost track of it: {e}")),
        }
        if *stop.borrow() {
            return Readiness::Stopped;
        }
        if answering_pid(&spec.socket).await.is_some_and(|p| Some(p) == pid) {
            return Readiness::Ready;
        }
        if Instant::now() >= deadline {
            return Readiness::TimedOut;
        }
        tokio::select! {
            () = tokio::time::sleep(READY_POLL) => {}
            () = stopped(stop) => return Readiness::Stopped,
        }
    }
}

/// The pid of the daemon answering `GetInfo` on `socket`, if one does.
async fn answering_pid(socket: &Path) -> Option<u32> {
    if !socket.exists() {
        return None;
    }
    let options = ClientOptions {
        connect_timeout: Duration::ZERO,
        request_timeout: Duration::from_secs(1),
        ..ClientOptions::default()
    };
    let channel = connect_unix(socket, &options).await.ok()?;
    let info = DaemonClient::new(channel).get_info(GetInfoRequest {}).await.ok()?;
    Some(info.into_inner().pid)
}

/// SIGTERM, then SIGKILL after `grace`; reaps the child.
async fn terminate(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    }
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
}

/// `exit status 1`, `signal 9 (SIGKILL)`.
fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => match Signal::try_from(signal) {
            Ok(s) => format!("signal {signal} ({})", s.as_str()),
            Err(_) => format!("signal {signal}"),
        },
        _ => status.to_string(),
    }
}

/// The last `n` lines of a log file, indented, for messages.
fn log_tail(path: &Path, n: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            let tail = &lines[lines.len().saturating_sub(n)..];
            if tail.is_empty() {
                "  (empty)".into()
            } else {
                tail.iter().map(|l| format!("  {l}")).collect::<Vec<_>>().join("\n")
            }
        }
        Err(e) => format!("  (cannot read it: {e})"),
    }
}

// ---------------------------------------------------------------------------
// The node plan: every path, flag and file of a node, from the arguments.

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
        let pools = if !args.pools.is_empty() {
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
        let first_pool = pools[0].split_once('=').map(|(n, _)| n.to_string()).unwrap_or_default();
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
            if !NODE_DAEMONS.contains(&daemon) || arg.is_empty() {
                bail!("`{d}`: the daemon must be one of {}", NODE_DAEMONS.join(", "));
            }
            seen.insert(daemon);
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
            pin_dir: args.bpffs.join("rivet").join(&node_name),
            args: args.clone(),
        };
        for daemon in NODE_DAEMONS {
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

    /// The node daemons, in start order, each switching to its user at start
    /// and admitting on its socket only who needs it ([`accounts`]).
    pub fn specs(&self, accounts: &NodeAccounts) -> Vec<DaemonSpec> {
        NODE_DAEMONS
            .iter()
            .map(|&name| {
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
                    accounts.operator_gid.to_string().into(),
                    "--allowed-uids".into(),
                    ids(&accounts.full_access_uids(name)).into(),
                    "--read-only-gids".into(),
                    accounts.operator_gid.to_string().into(),
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
                    }
                    LOADER => {
                        args.extend([
                            "--bpffs".into(),
                            self.args.bpffs.clone().into(),
                            "--endpoint-interface-prefix".into(),
                            self.args.host_interface_prefix.clone().into(),
                        ]);
                    }
                    GC => args.extend(["--bpffs".into(), self.args.bpffs.clone().into()]),
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
                    // The datapath daemons live in the node's namespace (DESIGN.md §8).
                    netns: if matches!(name, LOADER | GC) {
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
        json!({
            "cniVersion": self.args.cni_version,
            "name": NETWORK_NAME,
            "plugins": [{
                "type": CNI_BINARY,
                "socketDir": self.socket_dir,
                "ipamPool": self.ipam_pool,
                "hostInterfacePrefix": self.args.host_interface_prefix,
                "mtu": self.args.mtu,
                "logFile": self.log_dir.join("rivet-cni.log"),
                "timeoutSeconds": self.args.cni_timeout_seconds,
            }],
        })
    }

    /// The initial node record.
    fn record(&self, socket_dir_created: bool, specs: &[DaemonSpec]) -> NodeRecord {
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
            stop_grace_seconds: self.args.stop_grace_seconds,
            daemons: specs
                .iter()
                .map(|s| DaemonStatus {
                    name: s.name.clone(),
                    pid: None,
                    phase: DaemonPhase::Pending,
                    restarts: 0,
                    started_unix_nanos: 0,
                    last_exit: None,
                    last_exit_unix_nanos: 0,
                    socket: s.socket.clone(),
                    log: s.log.clone(),
                })
                .collect(),
        }
    }
}

// ---------------------------------------------------------------------------
// node up.

/// Runs `rivet node ...`.
pub async fn run(ctx: &Context, state_dir: &Path, command: NodeCommand) -> Result<bool> {
    match command {
        NodeCommand::Up(args) => up(ctx, state_dir, &args).await,
        NodeCommand::Down { timeout_seconds } => down(state_dir, Duration::from_secs(timeout_seconds)).await,
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

/// The directory of the running `rivet`.
fn own_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the running rivet binary")?;
    Ok(exe
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".")))
}

async fn up(ctx: &Context, state_dir: &Path, args: &UpArgs) -> Result<bool> {
    let plan = NodePlan::new(&ctx.socket_dir, state_dir, args, &own_dir()?)?;
    if args.detach && std::env::var_os(DETACHED_ENV).is_none() {
        return detach(ctx, &plan).await;
    }
    // Signals first: a SIGTERM while starting must tear down, not kill us.
    // A parent may have left them blocked (a blocked mask is inherited):
    // unblock them, here and so in every daemon.
    let mut shutdown = nix::sys::signal::SigSet::empty();
    shutdown.add(Signal::SIGINT);
    shutdown.add(Signal::SIGTERM);
    shutdown.thread_unblock().context("unblocking SIGINT and SIGTERM")?;
    let (cancel_tx, cancel) = watch::channel(false);
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = sigint.recv() => {}
            _ = sigterm.recv() => {}
        }
        let _ = cancel_tx.send(true);
    });

    preflight(&plan).await?;
    let companions = plan.companion_plugins()?;
    let accounts = NodeAccounts::resolve(&args.daemon_user, &args.datapath_user, &args.operator_group)?;
    check_reachable(&plan, &accounts)?;
    let socket_dir_created = !plan.socket_dir.exists();
    std::fs::create_dir_all(&plan.socket_dir).with_context(|| format!("creating {}", plan.socket_dir.display()))?;
    if socket_dir_created {
        accounts::set_up_socket_dir(&plan.socket_dir, &accounts)?;
    }
    std::fs::create_dir_all(&plan.log_dir).with_context(|| format!("creating {}", plan.log_dir.display()))?;
    let specs = plan.specs(&accounts);
    let record = Arc::new(Mutex::new(plan.record(socket_dir_created, &specs)));
    let save = {
        let record = Arc::clone(&record);
        move |f: &dyn Fn(&mut NodeRecord)| {
            let mut r = record.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            f(&mut r);
            if let Err(e) = r.store() {
                eprintln!("rivet node: writing node.json: {e:#}");
            }
        }
    };
    save(&|_| {});

    let observer: StatusObserver = {
        let record = Arc::clone(&record);
        Arc::new(move |statuses: &[DaemonStatus]| {
            let mut r = record.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            r.daemons = statuses.to_vec();
            if let Err(e) = r.store() {
                eprintln!("rivet node: writing node.json: {e:#}");
            }
        })
    };
    let mut supervisor = NodeSupervisor::new(
        specs,
        RestartPolicy::default(),
        Duration::from_secs(args.ready_timeout_seconds),
        Duration::from_secs(args.stop_grace_seconds),
        observer,
    );

    let started = async {
        if plan.create_netns {
            let ns = plan.netns.as_deref().expect("--create-netns requires --netns");
            netns::create(ns)?;
            save(&|r| r.netns_created = true);
            configure_node_netns(&plan)?;
            eprintln!("rivet node: created network namespace {ns}");
        } else if let Some(ns) = &plan.netns
            && !netns::exists(ns)
        {
            bail!("network namespace `{ns}` does not exist (add --create-netns to create it)");
        }
        give_daemons_their_dirs(&plan, &accounts)?;
        supervisor.start(&cancel).await?;
        // Recorded before the copy: node down removes whatever was started.
        let copied: Vec<PathBuf> = companions
            .iter()
            .filter(|c| c.source.is_some())
            .map(|c| c.target.clone())
            .collect();
        save(&|r| r.cni_plugins = copied.clone());
        install_cni(&plan, &companions)?;
        anyhow::Ok(())
    }
    .await;

    let outcome = match started {
        Ok(()) => {
            save(&|r| r.phase = NodePhase::Running);
            let snapshot = record.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
            print!("{}", describe_node(&snapshot));
            println!(
                "stop it with Ctrl-C, or `rivet --state-dir {} node down`",
                plan.state_dir.display()
            );
            let _ = std::io::stdout().flush();
            let mut cancel = cancel.clone();
            stopped(&mut cancel).await;
            eprintln!("rivet node: stopping node {}", plan.node_name);
            Ok(true)
        }
        Err(e) => Err(e),
    };
    save(&|r| r.phase = NodePhase::Stopping);
    let snapshot = record.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    for message in before_daemons_stop(&snapshot).await {
        eprintln!("rivet node: {message}");
    }
    supervisor.stop().await;
    for message in after_daemons_stop(&snapshot) {
        eprintln!("rivet node: {message}");
    }
    eprintln!("rivet node: node {} stopped", plan.node_name);
    outcome
}

/// Refuses to start over a running node, live sockets or missing binaries.
async fn preflight(plan: &NodePlan) -> Result<()> {
    if let Some(existing) = NodeRecord::load(&plan.state_dir)? {
        if supervisor_alive(existing.supervisor_pid) {
            bail!(
                "node {} is already running from {} (supervisor pid {}); stop it with `rivet --state-dir {} node down`",
                existing.node_name,
                plan.state_dir.display(),
                existing.supervisor_pid,
                plan.state_dir.display()
            );
        }
        bail!(
            "{} records node {} whose supervisor (pid {}) is gone; clean up what it left with \
             `rivet --state-dir {} node down`",
            plan.state_dir.join(NODE_FILE).display(),
            existing.node_name,
            existing.supervisor_pid,
            plan.state_dir.display()
        );
    }
    for daemon in NODE_DAEMONS {
        let binary = plan.bin_dir.join(daemon);
        if !binary.is_file() {
            bail!(
                "{} is missing (build it with `cargo build --bins`, or give --bin-dir)",
                binary.display()
            );
        }
        if let Some(pid) = answering_pid(&plan.socket(daemon)).await {
            bail!(
                "{daemon} (pid {pid}) already answers on {}: another node uses this socket dir",
                plan.socket(daemon).display()
            );
        }
    }
    let cni = plan.bin_dir.join(CNI_BINARY);
    if !cni.is_file() {
        bail!(
            "{} is missing (build it with `cargo build --bins`, or give --bin-dir)",
            cni.display()
        );
    }
    Ok(())
}

/// Fails unless each daemon's user can reach its state dir and socket dir
/// (and both can create sockets in an existing socket dir).
fn check_reachable(plan: &NodePlan, accounts: &NodeAccounts) -> Result<()> {
    for daemon in NODE_DAEMONS {
        let account = accounts.of(daemon);
        accounts::check_reachable(account, &plan.daemon_state_dir(daemon), "state dir")?;
        accounts::check_reachable(account, &plan.socket(daemon), "socket dir")?;
    }
    accounts::check_reachable(&accounts.datapath, &plan.pin_dir.join(LOADER), "pin dir")?;
    if plan.socket_dir.exists() {
        accounts::check_socket_dir(&plan.socket_dir, accounts)?;
    }
    Ok(())
}

/// What the daemons write becomes their users': each one's state dir
/// (moving the entries of the layout before per-daemon dirs), stale lock
/// files of their sockets, and the pin dir.
fn give_daemons_their_dirs(plan: &NodePlan, accounts: &NodeAccounts) -> Result<()> {
    for message in accounts::migrate_legacy_state(&plan.state_dir)? {
        eprintln!("rivet node: {message}");
    }
    for daemon in NODE_DAEMONS {
        let account = accounts.of(daemon);
        accounts::give_private_dir(&plan.daemon_state_dir(daemon), account)?;
        accounts::give_lock_file(&rivet_common::socket::lock_path(&plan.socket(daemon)), account)?;
    }
    if let Some(bpf_root) = plan.pin_dir.parent() {
        std::fs::create_dir_all(bpf_root).with_context(|| format!("creating {}", bpf_root.display()))?;
    }
    accounts::give_private_dir(&plan.pin_dir, &accounts.datapath)
}

/// Forwarding on, DAD off, the node addresses on `lo`: only inside the
/// node's own namespace.
fn configure_node_netns(plan: &NodePlan) -> Result<()> {
    let ns = plan.netns.as_deref().expect("a node namespace");
    let path = netns::path(ns);
    netns::sysctls(
        &path,
        &[
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv6.conf.all.forwarding", "1"),
            // Host veths need a usable link-local address at once.
            ("net.ipv6.conf.all.accept_dad", "0"),
            ("net.ipv6.conf.default.accept_dad", "0"),
        ],
    )?;
    for address in &plan.node_addresses {
        if address.contains(':') {
            netns::ip(ns, &["-6", "addr", "add", address, "dev", "lo", "nodad"])?;
        } else {
            netns::ip(ns, &["addr", "add", address, "dev", "lo"])?;
        }
    }
    Ok(())
}

/// Copies rivet-cni and the companion plugins to copy into the CNI bin dir,
/// then writes the conflist (atomically, each).
fn install_cni(plan: &NodePlan, companions: &[CompanionPlugin]) -> Result<()> {
    std::fs::create_dir_all(&plan.args.cni_bin_dir)
        .with_context(|| format!("creating {}", plan.args.cni_bin_dir.display()))?;
    let target = plan.cni_binary_path();
    install_executable(&plan.bin_dir.join(CNI_BINARY), &target)?;
    for plugin in companions {
        if let Some(source) = &plugin.source {
            install_executable(source, &plugin.target)?;
            eprintln!(
                "rivet node: installed {} from {}",
                plugin.target.display(),
                source.display()
            );
        }
    }
    let text = serde_json::to_string_pretty(&plan.conflist()).expect("JSON values serialise") + "\n";
    write_atomic(&plan.conflist_path(), text.as_bytes())
        .map_err(|(action, e)| anyhow!("{action} {}: {e}", plan.conflist_path().display()))?;
    eprintln!(
        "rivet node: installed {} and {}",
        target.display(),
        plan.conflist_path().display()
    );
    Ok(())
}

/// Copies an executable to `target` through a temp file beside it (a
/// runtime never sees half a binary).
fn install_executable(source: &Path, target: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let name = target.file_name().unwrap_or_default().to_string_lossy();
    let tmp = target.with_file_name(format!(".{name}.tmp"));
    std::fs::copy(source, &tmp).with_context(|| format!("copying {} to {}", source.display(), tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", tmp.display()))?;
    File::open(&tmp)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("syncing {}", tmp.display()))?;
    std::fs::rename(&tmp, target).with_context(|| format!("installing {}", target.display()))
}

/// Teardown before the daemons stop: no new pods (the conflist goes), and
/// the test pods are deleted while the daemons can still answer DEL.
async fn before_daemons_stop(record: &NodeRecord) -> Vec<String> {
    let mut messages = Vec::new();
    remove_file(&record.conflist, &mut messages);
    let state_dir = record.state_dir.clone();
    match tokio::task::spawn_blocking(move || pod::delete_all(&state_dir, Duration::from_secs(60))).await {
        Ok(m) => messages.extend(m),
        Err(e) => messages.push(format!("deleting pods: {e}")),
    }
    messages
}

/// Teardown once the daemons are gone: the installed plugin, the pins, the
/// sockets, the namespace and node.json.
fn after_daemons_stop(record: &NodeRecord) -> Vec<String> {
    let mut messages = Vec::new();
    remove_file(&record.cni_binary, &mut messages);
    for plugin in &record.cni_plugins {
        remove_file(plugin, &mut messages);
    }
    match std::fs::remove_dir_all(&record.pin_dir) {
        Ok(()) => messages.push(format!("removed pins {}", record.pin_dir.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => messages.push(format!("removing pins {}: {e}", record.pin_dir.display())),
    }
    for daemon in NODE_DAEMONS {
        let socket = rivet_common::socket::socket_path(&record.socket_dir, daemon);
        let mut quiet = Vec::new();
        remove_file(&socket, &mut quiet);
        remove_file(&rivet_common::socket::lock_path(&socket), &mut quiet);
    }
    if record.socket_dir_created {
        let _ = std::fs::remove_dir(&record.socket_dir);
    }
    if record.netns_created
        && let Some(ns) = &record.netns
    {
        match netns::delete(ns) {
            Ok(()) => messages.push(format!("deleted network namespace {ns}")),
            Err(e) => messages.push(format!("{e:#}")),
        }
    }
    remove_file(&record.state_dir.join(NODE_FILE), &mut Vec::new());
    messages
}

fn remove_file(path: &Path, messages: &mut Vec<String>) {
    match std::fs::remove_file(path) {
        Ok(()) => messages.push(format!("removed {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => messages.push(format!("removing {}: {e}", path.display())),
    }
}

/// Starts this same command in the background and waits until its node
/// is up; prints the node.
async fn detach(ctx: &Context, plan: &NodePlan) -> Result<bool> {
    use std::os::unix::process::CommandExt;
    std::fs::create_dir_all(&plan.log_dir).with_context(|| format!("creating {}", plan.log_dir.display()))?;
    let log_path = plan.log_dir.join("node.log");
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let exe = std::env::current_exe()?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(std::env::args_os().skip(1))
        .env(DETACHED_ENV, "1")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // Its own session: no terminal signals, survives this process.
    // SAFETY: setsid is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the background supervisor")?;
    let pid = child.id();
    let deadline =
        Instant::now() + Duration::from_secs(plan.args.ready_timeout_seconds * NODE_DAEMONS.len() as u64 + 30);
    loop {
        if let Some(status) = child.try_wait()? {
            bail!(
                "the node did not come up: the supervisor exited ({}); the end of {}:\n{}",
                describe_exit(status),
                log_path.display(),
                log_tail(&log_path, 25)
            );
        }
        if let Ok(Some(record)) = NodeRecord::load(&plan.state_dir)
            && record.supervisor_pid == pid
            && record.phase == NodePhase::Running
        {
            ctx.print(&record, || {
                format!(
                    "{}its log: {}\nstop it with `rivet --state-dir {} node down`\n",
                    describe_node(&record),
                    log_path.display(),
                    plan.state_dir.display()
                )
            });
            return Ok(true);
        }
        if Instant::now() >= deadline {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            bail!(
                "the node did not come up in time; stopping it. The end of {}:\n{}",
                log_path.display(),
                log_tail(&log_path, 25)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------
// node down.

/// Whether `pid` is a live `rivet ... node up` (not a zombie, not a reused pid).
pub fn supervisor_alive(pid: u32) -> bool {
    process_alive(pid) && cmdline(pid).is_some_and(|args| args.iter().any(|a| a == "up"))
}

/// Whether `pid` runs (a zombie does not).
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

fn cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

async fn down(state_dir: &Path, timeout: Duration) -> Result<bool> {
    let Some(record) = NodeRecord::load(state_dir)? else {
        println!("no node recorded in {}: nothing to stop", state_dir.display());
        return Ok(true);
    };
    let pid = record.supervisor_pid;
    if supervisor_alive(pid) {
        println!("stopping node {} (supervisor pid {pid})", record.node_name);
        // A background supervisor reports its teardown in node.log: show it.
        let log = record.log_dir.join("node.log");
        let offset = std::fs::metadata(&log).map_or(0, |m| m.len());
        kill(Pid::from_raw(pid as i32), Signal::SIGTERM).with_context(|| format!("signalling pid {pid}"))?;
        let deadline = Instant::now() + timeout;
        while supervisor_alive(pid) {
            if Instant::now() >= deadline {
                bail!(
                    "the supervisor (pid {pid}) is still stopping after {}s; see {}",
                    timeout.as_secs(),
                    record.log_dir.join("node.log").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if let Ok(text) = std::fs::read(&log) {
            let start = usize::try_from(offset).unwrap_or(usize::MAX).min(text.len());
            for line in String::from_utf8_lossy(&text[start..]).lines() {
                let line = line.strip_prefix("rivet node: ").unwrap_or(line);
                if !line.starts_with("stopping node")
                    && !line.starts_with(&format!("node {} stopped", record.node_name))
                {
                    println!("  {line}");
                }
            }
        }
    }
    // A clean stop removed node.json last; if it is still there, the
    // supervisor died without cleaning up: do it from the record.
    if let Some(record) = NodeRecord::load(state_dir)? {
        println!(
            "the supervisor (pid {pid}) is gone without cleaning up; cleaning up node {}",
            record.node_name
        );
        let mut record = record;
        record.phase = NodePhase::Stopping;
        for message in before_daemons_stop(&record).await {
            println!("  {message}");
        }
        let grace = Duration::from_secs(record.stop_grace_seconds);
        for daemon in record.daemons.iter().rev() {
            if let Some(pid) = daemon.pid
                && process_alive(pid)
                && cmdline(pid).is_some_and(|args| args.iter().any(|a| a.ends_with(&daemon.name)))
            {
                stop_pid(pid, grace).await;
                println!("  stopped {} (pid {pid})", daemon.name);
            }
        }
        for message in after_daemons_stop(&record) {
            println!("  {message}");
        }
    }
    println!("node {} stopped", record.node_name);
    Ok(true)
}

/// SIGTERM to a process that is not our child, SIGKILL after `grace`.
async fn stop_pid(pid: u32, grace: Duration) {
    let target = Pid::from_raw(pid as i32);
    let _ = kill(target, Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    while process_alive(pid) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if process_alive(pid) {
        let _ = kill(target, Signal::SIGKILL);
    }
}

// ---------------------------------------------------------------------------
// Printing.

/// The supervisor's view in `rivet status`: one line about the node, then
/// each daemon's state, restarts and last exit.
pub fn describe_supervision(r: &NodeRecord) -> String {
    let now = now_unix_nanos();
    let mut out = format!(
        "node {} (netns {}, supervisor pid {}{}, up {}):\n",
        r.node_name,
        r.netns.as_deref().unwrap_or("-"),
        r.supervisor_pid,
        gone(r),
        age(now, r.started_unix_nanos)
    );
    let mut t = Table::new(["DAEMON", "STATE", "RESTARTS", "LAST EXIT"]);
    for d in &r.daemons {
        t.row([
            d.name.clone(),
            d.phase.as_str().into(),
            d.restarts.to_string(),
            match &d.last_exit {
                Some(exit) => format!("{exit}, {} ago", age(now, d.last_exit_unix_nanos)),
                None => "-".into(),
            },
        ]);
    }
    for line in t.render().lines() {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// ` NOT RUNNING (...)` when the recorded supervisor is gone.
fn gone(r: &NodeRecord) -> String {
    if r.supervisor_pid == std::process::id() || supervisor_alive(r.supervisor_pid) {
        String::new()
    } else {
        format!(
            " NOT RUNNING (clean up with `rivet --state-dir {} node down`)",
            r.state_dir.display()
        )
    }
}

/// The user and effective capabilities process `pid` runs with (from
/// `/proc/<pid>/status`: what the daemon dropped to, not what it was told).
fn running_as(pid: u32) -> Option<(String, String)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let uid: u32 = field("Uid:")?.split_whitespace().nth(1)?.parse().ok()?;
    let mask = u64::from_str_radix(field("CapEff:")?, 16).ok()?;
    let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
        .map_or_else(|| uid.to_string(), |u| u.name);
    Some((user, CapabilityList::from_mask(mask).short()))
}

/// The node for people: where things are, then a table of the daemons.
pub fn describe_node(r: &NodeRecord) -> String {
    let now = now_unix_nanos();
    let netns = match &r.netns {
        Some(ns) if r.netns_created => format!("{ns} (created; lo: {})", r.node_addresses.join(", ")),
        Some(ns) => ns.clone(),
        None => "- (the host's)".into(),
    };
    let phase = match r.phase {
        NodePhase::Starting => "starting",
        NodePhase::Running => "running",
        NodePhase::Stopping => "stopping",
    };
    let mut out = format!(
        "node {}: {phase} for {}, supervisor pid {}{}\n",
        r.node_name,
        age(now, r.started_unix_nanos),
        r.supervisor_pid,
        gone(r)
    );
    let body = crate::fields([
        ("netns", netns),
        ("pools", r.pools.join(" ")),
        ("sockets", r.socket_dir.display().to_string()),
        ("state", r.state_dir.display().to_string()),
        ("logs", r.log_dir.display().to_string()),
        ("pins", r.pin_dir.display().to_string()),
        (
            "cni",
            std::iter::once(&r.conflist)
                .chain(std::iter::once(&r.cni_binary))
                .chain(&r.cni_plugins)
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join("\n"),
        ),
    ]);
    let mut t = Table::new([
        "DAEMON",
        "STATE",
        "PID",
        "RESTARTS",
        "UP",
        "LAST EXIT",
        "USER",
        "CAPABILITIES",
    ]);
    for d in &r.daemons {
        let (user, capabilities) = d.pid.and_then(running_as).unwrap_or(("-".into(), "-".into()));
        t.row([
            d.name.clone(),
            d.phase.as_str().into(),
            d.pid.map_or("-".into(), |p| p.to_string()),
            d.restarts.to_string(),
            if d.pid.is_some() {
                age(now, d.started_unix_nanos)
            } else {
                "-".into()
            },
            match &d.last_exit {
                Some(exit) => format!("{exit}, {} ago", age(now, d.last_exit_unix_nanos)),
                None => "-".into(),
            },
            user,
            capabilities,
        ]);
    }
    for line in body.lines().chain(t.render().lines()) {
        out.push_str("  ");
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    fn args(extra: &[&str]) -> UpArgs {
        Cli::try_parse_from(std::iter::once("up").chain(extra.iter().copied()))
            .unwrap()
            .up
    }

    fn plan(extra: &[&str]) -> Result<NodePlan> {
        NodePlan::new(
            Path::new("/tmp/r/sockets"),
            Path::new("/tmp/r/state"),
            &args(extra),
            Path::new("/opt/rivet/bin"),
        )
    }

    /// Flags every daemon gets from `node up`.
    const COMMON: usize = 14;

    fn test_accounts() -> NodeAccounts {
        let account = |name: &str, uid, gid| rivet_common::privileges::Account {
            name: name.into(),
            uid,
            gid,
            groups: vec![gid, 995],
        };
        NodeAccounts {
            daemon: account("rivet", 999, 994),
            datapath: account("rivet-datapath", 998, 994),
            operator_group: "rivet-operator".into(),
            operator_gid: 995,
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
        for (bad, expected) in [
            (vec!["--netns", "a/b"], "network namespace name"),
            (vec!["--netns", "n", "--pool", "nocidr"], "is not a pool"),
            (
                vec!["--netns", "n", "--create-netns", "--node-address", "1.2.3.4"],
                "prefix length",
            ),
            (
                vec!["--netns", "n", "--daemon-arg", "svc-k8s-sync=--x"],
                "must be one of",
            ),
            (vec!["--netns", "n", "--daemon-arg", "svc-ipam"], "DAEMON=ARG"),
            (vec!["--netns", "n", "--node-name", "a b"], "node name"),
            (
                vec!["--netns", "n", "--host-interface-prefix", "toolongprefix"],
                "1 to 10",
            ),
        ] {
            let err = plan(&bad).unwrap_err().to_string();
            assert!(err.contains(expected), "{bad:?}: {err}");
        }
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
        assert_eq!(specs.iter().filter(|s| s.netns.is_some()).count(), 2);
        assert_eq!(strings(&specs[3].args)[COMMON..], ["--dependency-poll-ms=200"]);
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

    fn policy() -> RestartPolicy {
        RestartPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
            healthy_after: Duration::from_secs(10),
            crash_loop_window: Duration::from_secs(60),
            crash_loop_exits: 3,
        }
    }

    #[test]
    fn backoff_doubles_to_the_cap_and_resets_after_a_healthy_run() {
        let mut t = RestartTracker::new(policy());
        let t0 = Instant::now();
        let quick = Duration::from_millis(10);
        let delays: Vec<u128> = (0..6)
            .map(|i| t.on_exit(t0 + Duration::from_secs(i * 100), quick).delay.as_millis())
            .collect();
        // 100 s apart: never a crash loop, but quick exits keep backing off.
        assert_eq!(delays, [100, 200, 400, 800, 1000, 1000]);
        // A run longer than healthy_after starts over.
        let d = t.on_exit(t0 + Duration::from_secs(1000), Duration::from_secs(11));
        assert_eq!(d.delay, Duration::from_millis(100));
        assert_eq!(d.recent_exits, 1);
    }

    #[test]
    fn crash_loop_is_reported_once_and_ends_after_a_healthy_run() {
        let mut t = RestartTracker::new(policy());
        let t0 = Instant::now();
        let quick = Duration::from_millis(10);
        let d1 = t.on_exit(t0, quick);
        let d2 = t.on_exit(t0 + Duration::from_secs(1), quick);
        assert!(!d1.crash_loop && !d2.crash_loop);
        let d3 = t.on_exit(t0 + Duration::from_secs(2), quick);
        assert!(d3.crash_loop && d3.entered_crash_loop);
        assert_eq!(d3.recent_exits, 3);
        let d4 = t.on_exit(t0 + Duration::from_secs(3), quick);
        assert!(d4.crash_loop && !d4.entered_crash_loop, "reported once");
        // Exits older than the window no longer count.
        let d5 = t.on_exit(t0 + Duration::from_secs(200), quick);
        assert!(!d5.crash_loop);
        assert_eq!(d5.recent_exits, 1);
        // A healthy run clears it as well.
        for i in 0..3 {
            t.on_exit(t0 + Duration::from_secs(201 + i), quick);
        }
        let healthy = t.on_exit(t0 + Duration::from_secs(300), Duration::from_secs(60));
        assert!(!healthy.crash_loop);
    }

    #[test]
    fn exits_are_described() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            describe_exit(std::process::ExitStatus::from_raw(1 << 8)),
            "exit status 1"
        );
        assert_eq!(
            describe_exit(std::process::ExitStatus::from_raw(9)),
            "signal 9 (SIGKILL)"
        );
    }

    #[test]
    fn liveness_of_processes() {
        assert!(process_alive(std::process::id()));
        assert!(!process_alive(u32::MAX - 1));
        // The test binary is not a `rivet node up`.
        assert!(!supervisor_alive(std::process::id()));
    }

    /// The supervisor with `sh` scripts standing in for daemons: a fake
    /// daemon is "ready" once its socket answers, so here readiness is
    /// checked against a real (tiny) gRPC daemon only in tests/node.rs;
    /// this checks start failures and their messages.
    #[tokio::test]
    async fn a_daemon_that_exits_while_starting_fails_the_start_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        let spec = DaemonSpec {
            name: "fake".into(),
            program: "/bin/sh".into(),
            args: vec!["-c".into(), "echo cannot bind the socket >&2; exit 3".into()],
            netns: None,
            socket: dir.path().join("fake.sock"),
            log: dir.path().join("fake.log"),
        };
        let seen = Arc::new(Mutex::new(Vec::new()));
        let observer: StatusObserver = {
            let seen = Arc::clone(&seen);
            Arc::new(move |s: &[DaemonStatus]| seen.lock().unwrap().push(s[0].phase))
        };
        let mut supervisor = NodeSupervisor::new(
            vec![spec],
            RestartPolicy::default(),
            Duration::from_secs(5),
            Duration::from_secs(1),
            observer,
        );
        let (_tx, cancel) = watch::channel(false);
        let err = supervisor.start(&cancel).await.unwrap_err().to_string();
        assert!(err.contains("fake exited while starting (exit status 3)"), "{err}");
        assert!(err.contains("cannot bind the socket"), "{err}");
        assert_eq!(*seen.lock().unwrap(), [DaemonPhase::Starting, DaemonPhase::Stopped]);
        supervisor.stop().await;
    }

    #[tokio::test]
    async fn a_daemon_that_never_answers_times_out_and_is_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let spec = DaemonSpec {
            name: "mute".into(),
            program: "/bin/sleep".into(),
            args: vec!["30".into()],
            netns: None,
            socket: dir.path().join("mute.sock"),
            log: dir.path().join("mute.log"),
        };
        let mut supervisor = NodeSupervisor::new(
            vec![spec],
            RestartPolicy::default(),
            Duration::from_millis(300),
            Duration::from_secs(1),
            Arc::new(|_: &[DaemonStatus]| {}),
        );
        let (_tx, cancel) = watch::channel(false);
        let started = Instant::now();
        let err = supervisor.start(&cancel).await.unwrap_err().to_string();
        assert!(err.contains("did not answer"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        let status = &supervisor.statuses()[0];
        assert_eq!(status.phase, DaemonPhase::Stopped);
        assert!(status.pid.is_none());
        // The log has the start marker with the command line.
        let log = std::fs::read_to_string(dir.path().join("mute.log")).unwrap();
        assert!(log.contains("starting mute") && log.contains("/bin/sleep 30"), "{log}");
    }

    #[test]
    fn node_is_described() {
        let p = plan(&["--netns", "rn1", "--create-netns"]).unwrap();
        let mut r = p.record(true, &p.specs(&test_accounts()));
        r.phase = NodePhase::Running;
        r.netns_created = true;
        r.daemons[3].pid = Some(42);
        r.daemons[3].phase = DaemonPhase::Running;
        r.daemons[3].restarts = 1;
        r.daemons[3].started_unix_nanos = now_unix_nanos();
        r.daemons[3].last_exit = Some("signal 9 (SIGKILL)".into());
        r.daemons[3].last_exit_unix_nanos = now_unix_nanos();
        let text = describe_node(&r);
        assert!(text.starts_with("node rn1: running for "), "{text}");
        assert!(
            text.contains("netns    rn1 (created; lo: 198.19.0.1/32, 2001:2:0:ffff::1/128)"),
            "{text}"
        );
        assert!(text.contains("svc-endpoint  running  42   1"), "{text}");
        assert!(text.contains("signal 9 (SIGKILL), 0ms ago"), "{text}");
        let brief = describe_supervision(&r);
        assert!(brief.starts_with("node rn1 (netns rn1, supervisor pid "), "{brief}");
        assert!(
            brief.contains("  svc-endpoint  running  1         signal 9 (SIGKILL), 0ms ago\n"),
            "{brief}"
        );
        // node.json round trip.
        let dir = tempfile::tempdir().unwrap();
        r.state_dir = dir.path().to_path_buf();
        r.store().unwrap();
        assert_eq!(NodeRecord::load(dir.path()).unwrap(), Some(r));
    }
}
