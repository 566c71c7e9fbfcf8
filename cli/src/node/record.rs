//! node.json: the running node, its daemons and their states.

use std::path::{Path, PathBuf};

use anyhow::Result;
use rivet_common::state_file::StateFile;
use serde::{Deserialize, Serialize};

use super::NODE_FILE;

/// Schema version of node.json.
const NODE_SCHEMA: u32 = 1;

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
    /// The health endpoint's namespace (`--health-endpoint`), recorded
    /// before it is made; `node down` deletes the endpoint and the namespace.
    #[serde(default)]
    pub health_netns: Option<String>,
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
